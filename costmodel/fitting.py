"""Fitting the cost model's parameters to timings, and judging a profile by rank: pure
numpy, no JAX (the measurements are `meshslice.costmodel.calibrate`'s).

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

`build_profile` turns the fits into a `HardwareProfile`. `spearman` / `rank` (rank
agreement of measured and predicted times, used by bench/compare.py and bench/tpu_rank.py)
are how a calibrated profile is judged.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from .profiles import (COLLECTIVES, CollectiveParams, GemmEfficiency, HardwareProfile,
                       load_profile)

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


# ----------------------------------------------------------------------------- profile

def fit_collectives(samples, *, hop_ratio=None) -> dict:
  """{(kind, dim): CollectiveFit} for every (kind, dim) with samples (each with kind,
  dim, group, hops, shard_bytes and seconds, as `calibrate.CollectiveSample`)."""
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
