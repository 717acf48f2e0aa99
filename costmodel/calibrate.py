"""Calibrate a hardware profile on the machine at hand (`python -m meshslice calibrate`).

Measures, on a 2D device mesh:

  collectives  all-gather, reduce-scatter and permute (one ppermute) on each mesh axis
               over a range of per-device shard sizes, inside `jax.shard_map`;
  GEMMs        the local matmul of one device over slice shapes (one dim at a time cut
               down from a base shape), with every device of the mesh busy at once;

fits the time models of docs/costmodel.md / `meshslice.costmodel.profiles` and writes
a `HardwareProfile` JSON file that `meshslice.transform(f, profile=path)` and
`meshslice.costmodel.load_profile(path)` accept.

Collective model (n = ring size, b = per-device shard bytes; the shard is the input of
an all-gather, the output of a reduce-scatter, the payload of a permute):

    all-gather / reduce-scatter   t = base + (n - 1) * b / bw + (n - 1) * hop
    permute over h ring hops      t = base + b / bw + h * hop

Every sample is a row (1, x, h) -> t with x = (n - 1) * b, h = n - 1 (or x = b, h = hops
for permute), fitted by non-negative least squares on relative residuals (timings span
orders of magnitude; each sample counts by its relative error).

Identifiability. With one ring size per axis (the common case: the mesh axis itself),
`h` is constant, so `base` and `hop` only enter as one intercept a = base + h * hop.
Then the fit keeps the measured intercept and splits it with a documented rule:
hop = hop_ratio * base, i.e. base = a / (1 + h * hop_ratio), hop_ratio borrowed from the
reference profile (tpu-v4, measured by the MeshSlice authors: 5/13 for all-gather, 5/26
for reduce-scatter, 50/13 for permute) unless given. Predictions on the calibrated mesh
shape only use the intercept, so the rule affects only other axis sizes. Measure more
ring sizes to identify both: `group_sizes` (sub-rings of an axis, e.g. 2 and 4 on a
4-device axis) for all-gather / reduce-scatter, permute shifts of 1 .. n/2 hops for
permute (done by default on axes with n >= 4).

GEMM model (`GemmEfficiency`): efficiency(m, n, k) = E * min(1, m/m_sat) *
min(1, n/n_sat) * min(1, k/k_sat), fitted in log space by a grid search over the
saturation points (E in closed form for each grid point). `peak_flops` is the chip's
datasheet peak if given, else the best throughput measured (then E is close to 1).

Timing. Each measurement runs the operation `loops` times in a `lax.fori_loop` (each
iteration depends on the last, so nothing is hoisted or merged) and takes
(t(1 + loops) - t(1)) / loops over median call times, which cancels the dispatch cost.

`spearman` / `rank` (rank agreement of measured and predicted times, used by
bench/compare.py) live here too: they are how a calibrated profile is judged.

Example:
  python -m meshslice calibrate --mesh 2x4 --out my-cpu.json          # emulated CPU mesh
  python -m meshslice calibrate --mesh 4x4 --dtype bfloat16 \\
      --sizes-kib 64,256,1024,4096,16384 --gemm-base 2048 --gemm-min 128 \\
      --peak-flops 2.75e14 --name my-v4 --out v4.json                  # a TPU v4-16 slice
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import numpy as np

from meshslice.costmodel.profiles import (COLLECTIVES, CollectiveParams, GemmEfficiency,
                                          HardwareProfile, load_profile, save_profile)

# Bandwidth written when the timings show no size dependence at all (a flat line):
# the profile needs a finite positive number, and this one makes bytes cost ~nothing.
UNMEASURABLE_BANDWIDTH = 1e15
REFERENCE_PROFILE = "tpu-v4"


# ----------------------------------------------------------------------------- fits

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveFit:
  """Fitted alpha-beta parameters of one collective kind on one profile dim.

  Attributes:
    kind: "all_gather", "reduce_scatter" or "permute".
    bandwidth: bytes/s; hop_latency, base_overhead: seconds.
    r2: coefficient of determination of the fit on the measured seconds.
    max_rel_error: max over samples of |predicted - measured| / measured.
    samples: how many timings were fitted.
    identified: True when base and hop were separately identified (>= 2 hop counts);
      False when their sum was split by the hop_ratio rule.
    note: what was clamped or split, for people.
  """

  kind: str
  bandwidth: float
  hop_latency: float
  base_overhead: float
  r2: float
  max_rel_error: float
  samples: int
  identified: bool
  note: str = ""

  def predict(self, group, shard_bytes, hops=None):
    """Model seconds for ring size(s) `group` and shard bytes (and permute hops)."""
    x, h = _terms(self.kind, np.asarray(group, float), np.asarray(shard_bytes, float),
                  None if hops is None else np.asarray(hops, float))
    return self.base_overhead + x / self.bandwidth + h * self.hop_latency


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GemmFit:
  """Fitted GEMM efficiency model and the peak it is relative to.

  Attributes:
    peak_flops: FLOP/s the efficiency is a fraction of.
    efficiency: the fitted `GemmEfficiency`.
    r2, max_rel_error: fit quality on the measured seconds.
    samples: how many shapes were timed.
    note: what was assumed or clamped.
  """

  peak_flops: float
  efficiency: GemmEfficiency
  r2: float
  max_rel_error: float
  samples: int
  note: str = ""

  def predict(self, shapes, batch=1):
    """Model seconds of local matmuls of `shapes` (rows of m, n, k)."""
    s = np.asarray(shapes, float).reshape(-1, 3)
    eff = np.array([self.efficiency(*row) for row in s])
    return 2.0 * batch * s.prod(axis=1) / (self.peak_flops * eff)


def _terms(kind, group, shard_bytes, hops):
  """The (bytes term x, hop count h) of each sample under the model of `kind`."""
  if kind == "permute":
    return shard_bytes, np.ones_like(shard_bytes) if hops is None else hops
  return (group - 1) * shard_bytes, group - 1


def _quality(measured, predicted):
  measured, predicted = np.asarray(measured, float), np.asarray(predicted, float)
  ss_tot = float(np.sum((measured - measured.mean()) ** 2))
  ss_res = float(np.sum((measured - predicted) ** 2))
  r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
  return r2, float(np.max(np.abs(predicted - measured) / measured))


def _nnls_small(a, t, w):
  """Non-negative weighted least squares for a handful of columns: the optimum is the
  plain least-squares fit on its support, so try every support and keep the best
  feasible one (exact, and 7 tiny solves for 3 columns)."""
  aw, tw = a * w[:, None], t * w
  best = (np.inf, np.zeros(a.shape[1]))
  for size in range(1, a.shape[1] + 1):
    for support in itertools.combinations(range(a.shape[1]), size):
      cols = list(support)
      coef, *_ = np.linalg.lstsq(aw[:, cols], tw, rcond=None)
      if np.any(coef < 0):
        continue
      full = np.zeros(a.shape[1])
      full[cols] = coef
      err = float(np.sum((aw @ full - tw) ** 2))
      if err < best[0] - 1e-30:
        best = (err, full)
  return best[1]


def fit_collective(kind, group, shard_bytes, seconds, *, hops=None,
                   hop_ratio: float | None = None) -> CollectiveFit:
  """Fit base overhead, bandwidth and hop latency of one collective on one mesh axis.

  Args:
    kind: "all_gather", "reduce_scatter" or "permute".
    group: ring size n of each sample (scalar or array).
    shard_bytes: per-device shard bytes of each sample.
    seconds: measured seconds per collective.
    hops: permute only: ring hops of each sample (default 1).
    hop_ratio: hop_latency / base_overhead, used only when the samples have a single
      hop count (base and hop not identifiable); default: the reference profile's.

  Example (synthetic timings from known parameters come back):
    >>> b = np.array([1e4, 1e5, 1e6, 1e4, 1e5, 1e6])
    >>> n = np.array([2, 2, 2, 4, 4, 4])
    >>> t = 2e-5 + (n - 1) * b / 5e9 + (n - 1) * 1e-6
    >>> f = fit_collective("all_gather", n, b, t)
    >>> round(f.bandwidth / 1e9, 6), round(f.hop_latency * 1e6, 6), f.identified
    (5.0, 1.0, True)
  """
  if kind not in COLLECTIVES:
    raise ValueError(f"kind must be one of {COLLECTIVES}, got {kind!r}")
  seconds = np.asarray(seconds, float).reshape(-1)
  shard_bytes = np.broadcast_to(np.asarray(shard_bytes, float), seconds.shape)
  group = np.broadcast_to(np.asarray(group, float), seconds.shape)
  hops = None if hops is None else np.broadcast_to(np.asarray(hops, float), seconds.shape)
  if seconds.size < 2 or np.any(seconds <= 0):
    raise ValueError(f"{kind}: need >= 2 positive timings, got {seconds.tolist()}")
  if kind != "permute" and np.any(group < 2):
    raise ValueError(f"{kind}: ring sizes must be >= 2, got {sorted(set(group.tolist()))}")
  x, h = _terms(kind, group, shard_bytes, hops)
  if len(np.unique(x)) < 2:
    raise ValueError(f"{kind}: need >= 2 distinct shard sizes to fit a bandwidth")
  w = 1.0 / seconds                          # relative residuals
  notes = []
  identified = len(np.unique(h)) >= 2
  if identified:
    base, inv_bw, hop = _nnls_small(np.stack([np.ones_like(x), x, h], axis=1), seconds, w)
  else:
    intercept, inv_bw = _nnls_small(np.stack([np.ones_like(x), x], axis=1), seconds, w)
    h0 = float(h[0])
    if hop_ratio is None:
      ref = load_profile(REFERENCE_PROFILE).collective(kind)
      hop_ratio = ref.hop_latency[0] / ref.base_overhead[0]
    base = intercept / (1.0 + h0 * hop_ratio)
    hop = hop_ratio * base
    notes.append(f"one hop count ({h0:g}): fitted base + {h0:g} * hop = "
                 f"{intercept * 1e6:.3g} us, split with hop = {hop_ratio:.3g} * base")
  bandwidth = 1.0 / inv_bw if inv_bw > 1.0 / UNMEASURABLE_BANDWIDTH else UNMEASURABLE_BANDWIDTH
  if bandwidth == UNMEASURABLE_BANDWIDTH:
    notes.append("no size dependence measured: bandwidth set to "
                 f"{UNMEASURABLE_BANDWIDTH:g} B/s")
  fit = CollectiveFit(kind=kind, bandwidth=float(bandwidth), hop_latency=float(hop),
                      base_overhead=float(base), r2=0.0, max_rel_error=0.0,
                      samples=int(seconds.size), identified=identified, note="; ".join(notes))
  r2, worst = _quality(seconds, fit.predict(group, shard_bytes, hops))
  return dataclasses.replace(fit, r2=r2, max_rel_error=worst)


def _log_grid(values, per_octave=8):
  lo, hi = float(np.min(values)), float(np.max(values))
  if hi <= lo:
    return np.array([lo])
  count = int(math.ceil(math.log2(hi / lo) * per_octave)) + 1
  return np.unique(np.concatenate([np.geomspace(lo, hi, count), np.unique(values)]))


def fit_gemm_efficiency(shapes, seconds, *, peak_flops: float | None = None,
                        batch: int = 1) -> GemmFit:
  """Fit the saturating GEMM-efficiency model to timed local matmuls.

  Args:
    shapes: (samples, 3) array of (m, n, k).
    seconds: measured seconds of each matmul.
    peak_flops: the peak the efficiency is relative to; default: the best measured
      throughput (so max_efficiency comes out near 1).
    batch: batch count each matmul ran (multiplies the FLOPs).

  Saturation points are searched on a log grid (8 points per octave) between the
  smallest and largest measured extent of each dim; a saturation point at the smallest
  extent means the dim never limited efficiency in the measured range.

  Example (synthetic timings from known parameters come back, to the grid step):
    >>> true = GemmEfficiency(max_efficiency=0.8, m_sat=64, n_sat=128, k_sat=32)
    >>> sweep = [(d, 256, 256) for d in (8, 16, 32, 64, 128, 256)]
    >>> shapes = sweep + [s[1:] + s[:1] for s in sweep] + [s[2:] + s[:2] for s in sweep]
    >>> t = [2 * m * n * k / (1e12 * true(m, n, k)) for m, n, k in shapes]
    >>> f = fit_gemm_efficiency(shapes, t, peak_flops=1e12)
    >>> e = f.efficiency
    >>> e.max_efficiency, e.m_sat, e.n_sat, e.k_sat
    (0.8, 64.0, 128.0, 32.0)
  """
  s = np.asarray(shapes, float).reshape(-1, 3)
  t = np.asarray(seconds, float).reshape(-1)
  if len(s) != len(t) or len(t) < 2 or np.any(t <= 0) or np.any(s <= 0):
    raise ValueError("need >= 2 positive timings, one per (m, n, k) shape")
  flops = 2.0 * batch * s.prod(axis=1)
  achieved = flops / t
  notes = []
  if peak_flops is None:
    peak_flops = float(achieved.max())
    notes.append("peak_flops = best measured throughput")
  log_eff = np.log(achieved / peak_flops)
  logs = np.log(s)
  grids = [np.log(_log_grid(s[:, d])) for d in range(3)]
  # hinge[d][g, i] = min(0, log dim_d(i) - log sat_d(g))
  hinge = [np.minimum(0.0, logs[None, :, d] - g[:, None]) for d, g in enumerate(grids)]
  total = (hinge[0][:, None, None, :] + hinge[1][None, :, None, :]
           + hinge[2][None, None, :, :])
  log_e = np.minimum(0.0, np.mean(log_eff - total, axis=-1))   # E <= 1
  sse = np.sum((log_eff - total - log_e[..., None]) ** 2, axis=-1)
  # ties (flat regions): prefer the smallest saturation points, as argmin does in C order
  best = np.unravel_index(int(np.argmin(sse + 1e-12 * np.arange(sse.size).reshape(sse.shape))),
                          sse.shape)
  max_e = float(np.exp(log_e[best]))
  if np.mean(log_eff - total[best]) > 0:
    notes.append("measured throughput exceeds peak_flops: max_efficiency clamped to 1")
  eff = GemmEfficiency(max_efficiency=min(1.0, max_e),
                       m_sat=float(np.exp(grids[0][best[0]])),
                       n_sat=float(np.exp(grids[1][best[1]])),
                       k_sat=float(np.exp(grids[2][best[2]])))
  eff = _round_sats(eff)
  fit = GemmFit(peak_flops=float(peak_flops), efficiency=eff, r2=0.0, max_rel_error=0.0,
                samples=int(len(t)), note="; ".join(notes))
  r2, worst = _quality(t, fit.predict(s, batch))
  return dataclasses.replace(fit, r2=r2, max_rel_error=worst)


def _round_sats(eff: GemmEfficiency) -> GemmEfficiency:
  # grid points are exp(log(x)); round the float noise off (64.00000000001 -> 64.0)
  r = lambda v: float(np.round(v, 6))
  return GemmEfficiency(max_efficiency=float(np.round(eff.max_efficiency, 12)),
                        m_sat=r(eff.m_sat), n_sat=r(eff.n_sat), k_sat=r(eff.k_sat))


def rank(values) -> np.ndarray:
  """Ranks 1..n of `values`, ties sharing their average rank.

  Example:
    >>> rank([30.0, 10.0, 20.0, 10.0]).tolist()
    [4.0, 1.5, 3.0, 1.5]
  """
  a = np.asarray(values, float).reshape(-1)
  order = np.argsort(a, kind="stable")
  ranks = np.empty(len(a))
  ranks[order] = np.arange(1, len(a) + 1, dtype=float)
  for v in np.unique(a):
    tied = a == v
    if tied.sum() > 1:
      ranks[tied] = ranks[tied].mean()
  return ranks


def spearman(x, y) -> float:
  """Spearman rank correlation of two equally long sequences (Pearson's r of their
  ranks, ties averaged); nan when either has a single distinct value or < 2 entries.

  Example:
    >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    >>> round(spearman([1, 2, 3, 4], [1, 3, 2, 4]), 3)
    0.8
  """
  rx, ry = rank(x), rank(y)
  if len(rx) != len(ry):
    raise ValueError(f"spearman needs equally long sequences, got {len(rx)} and {len(ry)}")
  if len(rx) < 2 or np.ptp(rx) == 0 or np.ptp(ry) == 0:
    return float("nan")
  rx, ry = rx - rx.mean(), ry - ry.mean()
  return float(np.sum(rx * ry) / np.sqrt(np.sum(rx * rx) * np.sum(ry * ry)))


# ----------------------------------------------------------------------------- measuring

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveSample:
  """One timed collective: kind, profile dim (mesh axis 0 or 1), ring size, hops
  (permute), per-device shard bytes, seconds per collective."""

  kind: str
  dim: int
  group: int
  hops: int
  shard_bytes: int
  seconds: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GemmSample:
  """One timed local matmul (m, n, k) with every device of the mesh running it."""

  m: int
  n: int
  k: int
  seconds: float


def _median_call(fn, args, repeats):
  import jax
  jax.block_until_ready(fn(*args))         # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _per_iteration(fn, make_args, loops, repeats):
  """(t(1 + loops) - t(1)) / loops: the cost of one loop iteration without dispatch.
  Interleaves the two call kinds so slow drifts of a shared machine hit both."""
  import jax
  lo, hi = make_args(1), make_args(1 + loops)
  jax.block_until_ready(fn(*lo))
  jax.block_until_ready(fn(*hi))
  t_lo, t_hi = [], []
  for _ in range(repeats):
    for args, out in ((lo, t_lo), (hi, t_hi)):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      out.append(time.perf_counter() - start)
  per = (np.median(t_hi) - np.median(t_lo)) / loops
  # A shared CPU can make the difference vanish; fall back to the plain average then.
  return float(per) if per > 0 else float(np.median(t_hi) / (1 + loops))


def _group_mesh(devices, dim, group):
  """A 3-axis mesh ("o0", "g", "o1") whose axis "g" is a ring of `group` consecutive
  devices along profile dim `dim` of the 2D device array (a sub-ring when smaller)."""
  import jax
  r, c = devices.shape
  if dim == 0:
    return jax.sharding.Mesh(devices.reshape(r // group, group, c), ("o0", "g", "o1"))
  return jax.sharding.Mesh(devices.reshape(r, c // group, group), ("o0", "o1", "g"))


def _collective_fn(mesh, kind, elems, dtype, shift):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  g = mesh.shape["g"]
  names = mesh.axis_names
  spec = P(names)                           # one block per device
  local = elems * g if kind == "reduce_scatter" else elems

  def body(x, loops):
    def step(_, x):
      if kind == "all_gather":
        y = jax.lax.all_gather(x, "g", tiled=True)
      elif kind == "reduce_scatter":
        y = jax.lax.psum_scatter(x, "g", scatter_dimension=0, tiled=True)
      else:
        return jax.lax.ppermute(x, "g", [(i, (i + shift) % g) for i in range(g)])
      # the barrier keeps XLA from shrinking the collective to the two elements read;
      # the next iteration depends on this one at O(1) cost
      y = jax.lax.optimization_barrier(y)
      return x.at[0].set(y[0] + y[-1])
    return jax.lax.fori_loop(0, loops[0], step, x)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec,
                             check_vma=False))
  x = jax.device_put(jnp.ones((mesh.size * local,), dtype), NamedSharding(mesh, spec))
  rep = NamedSharding(mesh, P())
  return fn, lambda loops: (x, jax.device_put(jnp.array([loops], jnp.int32), rep))


def measure_collectives(devices, *, kinds=COLLECTIVES, sizes_bytes=(65536, 262144, 1048576),
                        dtype="float32", group_sizes="axis", loops=4, repeats=5,
                        echo=None) -> list[CollectiveSample]:
  """Time each collective kind on each profile dim of the 2D `devices` array.

  group_sizes: "axis" (rings of the whole axis only) or "all" (every divisor >= 2 of the
  axis size: sub-rings identify base and hop separately). Permute runs shifts of
  1 .. n // 2 hops on a ring of the whole axis.

  Example:
    >>> devs = np.array(jax.devices()[:8]).reshape(2, 4)            # doctest: +SKIP
    >>> s = measure_collectives(devs, kinds=("permute",), sizes_bytes=(4096, 65536))
    ... # doctest: +SKIP
  """
  import jax.numpy as jnp
  itemsize = jnp.dtype(dtype).itemsize
  samples = []
  for dim in (0, 1):
    size = devices.shape[dim]
    if size < 2:
      continue
    groups = ([size] if group_sizes == "axis" else
              [g for g in range(2, size + 1) if size % g == 0])
    for kind in kinds:
      plans = ([(size, s) for s in range(1, size // 2 + 1)] if kind == "permute"
               else [(g, 1) for g in groups])
      for group, hops in plans:
        mesh = _group_mesh(devices, dim, group)
        for nbytes in sizes_bytes:
          elems = max(1, int(nbytes) // itemsize)
          fn, make_args = _collective_fn(mesh, kind, elems, dtype, hops)
          seconds = _per_iteration(fn, make_args, loops, repeats)
          sample = CollectiveSample(kind=kind, dim=dim, group=group, hops=hops,
                                    shard_bytes=elems * itemsize, seconds=seconds)
          samples.append(sample)
          if echo:
            echo(f"  {kind:<15} dim {dim} ring {group} hops {hops} "
                 f"{sample.shard_bytes / 1024:>9.1f} KiB  {seconds * 1e6:>10.1f} us")
  return samples


def gemm_shapes(base: int, smallest: int) -> list[tuple[int, int, int]]:
  """Slice shapes: each dim halved from `base` down to `smallest`, the others at base.

  Example:
    >>> gemm_shapes(64, 32)
    [(64, 64, 64), (32, 64, 64), (64, 32, 64), (64, 64, 32)]
  """
  shapes = [(base, base, base)]
  d = base // 2
  cuts = []
  while d >= smallest:
    cuts.append(d)
    d //= 2
  for cut in cuts:
    for axis in range(3):
      shape = [base] * 3
      shape[axis] = cut
      shapes.append(tuple(shape))
  return shapes


def _gemm_fn(devices, m, n, k, dtype):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(-1), ("d",))

  def body(a, b, loops):
    def step(_, a):
      out = jax.lax.optimization_barrier(jnp.dot(a[0], b[0]))   # no slicing through it
      return a.at[0, 0, 0].set(out[0, 0].astype(a.dtype))     # chain the iterations
    return jax.lax.fori_loop(0, loops[0], step, a)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d"), P()),
                             out_specs=P("d"), check_vma=False))
  a = jax.device_put(jnp.ones((mesh.size, m, k), dtype) * 1e-3, NamedSharding(mesh, P("d")))
  b = jax.device_put(jnp.ones((mesh.size, k, n), dtype) * 1e-3, NamedSharding(mesh, P("d")))
  rep = NamedSharding(mesh, P())
  return fn, lambda loops: (a, b, jax.device_put(jnp.array([loops], jnp.int32), rep))


def measure_gemms(devices, shapes, *, dtype="float32", loops=3, repeats=5,
                  echo=None) -> list[GemmSample]:
  """Time the local matmul of each (m, n, k) in `shapes`, all devices at once."""
  samples = []
  for m, n, k in shapes:
    fn, make_args = _gemm_fn(devices, m, n, k, dtype)
    seconds = _per_iteration(fn, make_args, loops, repeats)
    samples.append(GemmSample(m=m, n=n, k=k, seconds=seconds))
    if echo:
      echo(f"  gemm {m:>6} x {n:>6} x {k:>6}  {seconds * 1e6:>10.1f} us  "
           f"{2 * m * n * k / seconds / 1e9:>8.2f} GFLOP/s")
  return samples


# ----------------------------------------------------------------------------- profile

def fit_collectives(samples, *, hop_ratio=None) -> dict:
  """{(kind, dim): CollectiveFit} for every (kind, dim) with samples."""
  fits = {}
  for kind in COLLECTIVES:
    for dim in (0, 1):
      mine = [s for s in samples if s.kind == kind and s.dim == dim]
      if not mine:
        continue
      fits[(kind, dim)] = fit_collective(
          kind, [s.group for s in mine], [s.shard_bytes for s in mine],
          [s.seconds for s in mine], hops=[s.hops for s in mine],
          hop_ratio=None if hop_ratio is None else hop_ratio.get(kind))
  return fits


def build_profile(*, name: str, collective_fits: dict, gemm_fit: GemmFit,
                  description: str = "", base: HardwareProfile | None = None
                  ) -> HardwareProfile:
  """A HardwareProfile from the fits. A (kind, dim) without a fit takes the other dim's
  fit of that kind (a mesh with an axis of size 1 measures only one), else `base`'s.

  Example:
    >>> g = GemmFit(peak_flops=1e12, efficiency=GemmEfficiency(max_efficiency=1, m_sat=8,
    ...             n_sat=8, k_sat=8), r2=1.0, max_rel_error=0.0, samples=3)
    >>> p = build_profile(name="x", collective_fits={}, gemm_fit=g,
    ...                   base=load_profile("tpu-v4"))
    >>> p.all_gather == load_profile("tpu-v4").all_gather
    True
  """
  params = {}
  for kind in COLLECTIVES:
    per_dim = []
    for dim in (0, 1):
      fit = collective_fits.get((kind, dim)) or collective_fits.get((kind, 1 - dim))
      if fit is None:
        if base is None:
          raise ValueError(f"no {kind} timings on either mesh dim and no base profile to "
                           "take them from (pass base=..., e.g. load_profile('tpu-v4'))")
        ref = base.collective(kind)
        per_dim.append((ref.bandwidth[dim], ref.hop_latency[dim], ref.base_overhead[dim]))
      else:
        per_dim.append((fit.bandwidth, fit.hop_latency, fit.base_overhead))
    params[kind] = CollectiveParams(bandwidth=tuple(p[0] for p in per_dim),
                                    hop_latency=tuple(p[1] for p in per_dim),
                                    base_overhead=tuple(p[2] for p in per_dim))
  return HardwareProfile(name=name, peak_flops=gemm_fit.peak_flops, gemm=gemm_fit.efficiency,
                         description=description, **params)


def _fit_rows(collective_fits, gemm_fit):
  rows = []
  for (kind, dim), f in sorted(collective_fits.items()):
    rows.append({"what": f"{kind} dim {dim}", "bandwidth_GBps": f.bandwidth / 1e9,
                 "hop_us": f.hop_latency * 1e6, "base_us": f.base_overhead * 1e6,
                 "r2": f.r2, "max_rel_error": f.max_rel_error, "samples": f.samples,
                 "identified": f.identified, "note": f.note})
  if gemm_fit is not None:
    e = gemm_fit.efficiency
    rows.append({"what": "gemm", "peak_flops": gemm_fit.peak_flops,
                 "max_efficiency": e.max_efficiency, "m_sat": e.m_sat, "n_sat": e.n_sat,
                 "k_sat": e.k_sat, "r2": gemm_fit.r2, "max_rel_error": gemm_fit.max_rel_error,
                 "samples": gemm_fit.samples, "note": gemm_fit.note})
  return rows


def render_fits(collective_fits, gemm_fit) -> str:
  """The fit-quality table printed by `main`."""
  lines = [f"{'fit':<22}{'bandwidth':>12}{'hop':>10}{'base':>10}{'R^2':>8}{'max rel':>9}"
           f"{'n':>4}  note"]
  for (kind, dim), f in sorted(collective_fits.items()):
    lines.append(f"{kind + ' dim ' + str(dim):<22}{f.bandwidth / 1e9:>9.3f} GB/s"
                 f"{f.hop_latency * 1e6:>7.2f} us{f.base_overhead * 1e6:>7.2f} us"
                 f"{f.r2:>8.3f}{f.max_rel_error:>9.2f}{f.samples:>4}  {f.note}")
  if gemm_fit is not None:
    e = gemm_fit.efficiency
    lines.append(f"{'gemm':<22}peak {gemm_fit.peak_flops / 1e9:.2f} GFLOP/s, max_efficiency "
                 f"{e.max_efficiency:.3f}, sat m/n/k {e.m_sat:g}/{e.n_sat:g}/{e.k_sat:g}, "
                 f"R^2 {gemm_fit.r2:.3f}, max rel {gemm_fit.max_rel_error:.2f}, "
                 f"n {gemm_fit.samples}  {gemm_fit.note}")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m meshslice calibrate",
      description="Measure collectives and GEMMs on a 2D device mesh, fit the cost model's "
                  "parameters and write a hardware profile JSON file.")
  p.add_argument("--mesh", default="2x4", help="mesh shape RxC (R * C <= device count); "
                 "profile dim 0 is the R axis, dim 1 the C axis")
  p.add_argument("--out", required=True, help="profile JSON file to write")
  p.add_argument("--name", default=None, help="profile name (default: calibrated-<platform>)")
  p.add_argument("--dtype", default="float32", help="element type for collectives and GEMMs")
  p.add_argument("--sizes-kib", default="16,64,256,1024",
                 help="per-device shard sizes to time, KiB, comma-separated")
  p.add_argument("--kinds", default=",".join(COLLECTIVES), help="collectives to time")
  p.add_argument("--group-sizes", default="axis", choices=["axis", "all"],
                 help="ring sizes for all-gather / reduce-scatter: the whole axis, or every "
                      "divisor >= 2 (identifies base overhead and hop latency separately)")
  p.add_argument("--hop-ratio", type=float, default=None,
                 help="hop_latency / base_overhead used to split the fitted intercept when "
                      "only one hop count was timed (default: the tpu-v4 profile's ratio)")
  p.add_argument("--gemm-base", type=int, default=256, help="largest GEMM extent timed")
  p.add_argument("--gemm-min", type=int, default=16, help="smallest GEMM slice extent timed")
  p.add_argument("--peak-flops", type=float, default=None,
                 help="datasheet peak FLOP/s per device (default: best measured throughput)")
  p.add_argument("--skip-collectives", action="store_true",
                 help="GEMMs only; collective parameters come from --base-profile "
                      "(for a single device)")
  p.add_argument("--base-profile", default=REFERENCE_PROFILE,
                 help="profile to take unmeasured parameters from")
  p.add_argument("--loops", type=int, default=4, help="operations per timed call")
  p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement")
  p.add_argument("--report", default=None,
                 help="also write the raw timings and fits as JSON here")
  p.add_argument("--cpu-devices", type=int, default=8,
                 help="emulated CPU devices when JAX runs on CPU (set before JAX starts)")
  p.add_argument("--distributed", action="store_true",
                 help="call jax.distributed.initialize() first: on Cloud TPU pods and under "
                      "SLURM / Open MPI / Kubernetes it detects the job itself; elsewhere "
                      "give the next three options")
  p.add_argument("--coordinator-address", default=None,
                 help="host:port of process 0 (or set JAX_COORDINATOR_ADDRESS)")
  p.add_argument("--num-processes", type=int, default=None, help="processes in the job")
  p.add_argument("--process-id", type=int, default=None, help="this process's index")
  p.add_argument("--quiet", action="store_true", help="do not print each timing")
  return p


def mesh_devices(shape):
  """The first R * C devices as an R x C array in `jax.make_mesh` order, which on TPU
  follows the physical torus, so profile dim 0 / 1 time the links that mesh axis 0 / 1
  of a program built with `jax.make_mesh` will use."""
  import jax
  from jax.sharding import AxisType
  n = shape[0] * shape[1]
  return jax.make_mesh(tuple(shape), ("r", "c"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:n]).devices


def _start_jax(args):
  import jax
  try:
    # Must precede JAX's first use; a no-op (error) when the caller already started it.
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  except RuntimeError:
    pass
  if args.distributed:
    kwargs = {k: v for k, v in (("coordinator_address", args.coordinator_address),
                                ("num_processes", args.num_processes),
                                ("process_id", args.process_id)) if v is not None}
    jax.distributed.initialize(**kwargs)
  return jax


def main(argv=None) -> int:
  """Run the calibration; returns a process exit status (0 = profile written).

  Example:
    >>> main(["--mesh", "2x4", "--out", "/tmp/cpu.json", "--sizes-kib", "4,64",
    ...       "--gemm-base", "64", "--gemm-min", "16"])                # doctest: +SKIP
    0
  """
  parser = _parser()
  args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
  try:
    shape = tuple(int(v) for v in args.mesh.lower().split("x"))
    assert len(shape) == 2 and min(shape) >= 1
    sizes = [int(float(v) * 1024) for v in args.sizes_kib.split(",") if v]
    assert len(sizes) >= 2 or args.skip_collectives
    kinds = tuple(k for k in args.kinds.split(",") if k)
    assert all(k in COLLECTIVES for k in kinds)
  except (ValueError, AssertionError):
    parser.error("--mesh must be RxC, --sizes-kib a list of >= 2 sizes, --kinds drawn "
                 f"from {','.join(COLLECTIVES)}")
  jax = _start_jax(args)
  n = shape[0] * shape[1]
  if n > jax.device_count():
    parser.error(f"--mesh {args.mesh} needs {n} devices; JAX has {jax.device_count()}")
  devices = mesh_devices(shape)
  lead = jax.process_index() == 0
  echo = None if args.quiet or not lead else print
  platform = jax.devices()[0].platform
  kind_name = getattr(jax.devices()[0], "device_kind", platform)
  base = load_profile(args.base_profile)
  if lead:
    print(f"calibrating on {n} x {kind_name} ({platform}), mesh {shape[0]}x{shape[1]}, "
          f"{args.dtype}")
  samples = []
  fits = {}
  if not args.skip_collectives and n > 1:
    samples = measure_collectives(devices, kinds=kinds, sizes_bytes=sizes, dtype=args.dtype,
                                  group_sizes=args.group_sizes, loops=args.loops,
                                  repeats=args.repeats, echo=echo)
    ratio = None if args.hop_ratio is None else {k: args.hop_ratio for k in COLLECTIVES}
    fits = fit_collectives(samples, hop_ratio=ratio)
  shapes = gemm_shapes(args.gemm_base, args.gemm_min)
  gemms = measure_gemms(devices, shapes, dtype=args.dtype, loops=args.loops,
                        repeats=args.repeats, echo=echo)
  gemm_fit = fit_gemm_efficiency([(g.m, g.n, g.k) for g in gemms],
                                 [g.seconds for g in gemms], peak_flops=args.peak_flops)
  name = args.name or f"calibrated-{platform}"
  kinds_done = sorted({k for k, _ in fits})
  others = "" if len(kinds_done) == len(COLLECTIVES) else f" (others from {base.name})"
  collectives = (f"collectives measured: {', '.join(kinds_done)}{others}, shard sizes "
                 f"{args.sizes_kib} KiB; where only one ring size was timed, base overhead "
                 "and hop latency split the fitted intercept by the hop_ratio rule "
                 "(meshslice/costmodel/calibrate.py)" if fits else
                 f"collectives not measured: taken from {base.name}")
  description = (
      f"Calibrated by meshslice.costmodel.calibrate on {n} x {kind_name} ({platform}), mesh "
      f"{shape[0]}x{shape[1]}, {args.dtype}, jax {jax.__version__}; {collectives}; GEMM "
      f"slices {args.gemm_min}..{args.gemm_base}"
      + (f", peak_flops given ({args.peak_flops:g})." if args.peak_flops else
         ", peak_flops = best measured throughput."))
  profile = build_profile(name=name, collective_fits=fits, gemm_fit=gemm_fit,
                          description=description, base=base)
  # CPU collectives are synchronous: nothing overlaps, whatever the fitted numbers say
  profile = dataclasses.replace(profile, overlap=platform != "cpu")
  if lead:
    print(render_fits(fits, gemm_fit))
    save_profile(profile, args.out)
    print(f"profile {name!r} written to {args.out}")
    if args.report:
      with open(args.report, "w", encoding="utf-8") as f:
        json.dump({"profile": profile.to_json_dict(),
                   "collectives": [dataclasses.asdict(s) for s in samples],
                   "gemms": [dataclasses.asdict(g) for g in gemms],
                   "fits": _fit_rows(fits, gemm_fit)}, f, indent=1)
      print(f"timings and fits written to {args.report}")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  sys.exit(main())
