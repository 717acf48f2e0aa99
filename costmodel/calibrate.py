"""Calibrate a hardware profile on the machine at hand (`python -m meshslice calibrate`).

Measures, on a 2D device mesh:

  collectives  all-gather, reduce-scatter and permute (one ppermute) on each mesh axis
               over a range of per-device shard sizes, inside `jax.shard_map`;
  GEMMs        the local matmul of one device over slice shapes (one dim at a time cut
               down from a base shape), with every device of the mesh busy at once;

fits the time models of docs/costmodel.md / `meshslice.costmodel.profiles` with
`meshslice.costmodel.fitting` (the models, the fits and the hop_ratio rule are described
there) and writes a `HardwareProfile` JSON file that `meshslice.transform(f,
profile=path)` and `meshslice.costmodel.load_profile(path)` accept.

Timing. Each measurement runs the operation `loops` times in a `lax.fori_loop` (each
iteration depends on the last, so nothing is hoisted or merged) and takes
(t(1 + loops) - t(1)) / loops over median call times, which cancels the dispatch cost.

The fitting names (`fit_collective`, `fit_gemm_efficiency`, `fit_collectives`,
`build_profile`, `rank`, `spearman`, ...) are re-exported here: the benches import them
from this module.

Example:
  python -m meshslice calibrate --mesh 2x4 --out my-cpu.json          # emulated CPU mesh
  python -m meshslice calibrate --mesh 4x4 --dtype bfloat16 \\
      --sizes-kib 64,256,1024,4096,16384 --gemm-base 2048 --gemm-min 128 \\
      --peak-flops 2.75e14 --name my-v4 --out v4.json                  # a TPU v4-16 slice
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import time

import numpy as np

from meshslice.costmodel.fitting import (REFERENCE_PROFILE as REFERENCE_PROFILE,
                                         UNMEASURABLE_BANDWIDTH as UNMEASURABLE_BANDWIDTH,
                                         CollectiveFit as CollectiveFit, GemmFit as GemmFit,
                                         build_profile as build_profile,
                                         fit_collective as fit_collective,
                                         fit_collectives as fit_collectives,
                                         fit_gemm_efficiency as fit_gemm_efficiency,
                                         rank as rank, spearman as spearman)
from meshslice.costmodel.profiles import (COLLECTIVES, HardwareProfile, known_profiles,
                                          load_profile, save_profile)

# the element types `--dtype` accepts: floating types the collectives and GEMMs run in
# as given (an integer type would be promoted by the GEMM's scaling to float32)
DTYPES = ("float32", "bfloat16", "float16")


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


# ----------------------------------------------------------------------------- report

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
  p.add_argument("--out", required=True,
                 help="profile JSON file to write (a .json name in an existing directory)")
  p.add_argument("--name", default=None, help="profile name (default: calibrated-<platform>)")
  p.add_argument("--dtype", default="float32",
                 help=f"element type for collectives and GEMMs: {', '.join(DTYPES)}")
  p.add_argument("--sizes-kib", default="16,64,256,1024",
                 help="per-device shard sizes to time, KiB, comma-separated (>= 2 distinct)")
  p.add_argument("--kinds", default=",".join(COLLECTIVES),
                 help="collectives to time, comma-separated, from: " + ", ".join(COLLECTIVES))
  p.add_argument("--group-sizes", default="axis", choices=["axis", "all"],
                 help="ring sizes for all-gather / reduce-scatter: the whole axis, or every "
                      "divisor >= 2 (identifies base overhead and hop latency separately)")
  p.add_argument("--hop-ratio", type=float, default=None,
                 help="hop_latency / base_overhead used to split the fitted intercept when "
                      "only one hop count was timed, >= 0 (default: the tpu-v4 profile's "
                      "ratio)")
  p.add_argument("--gemm-base", type=int, default=256, help="largest GEMM extent timed")
  p.add_argument("--gemm-min", type=int, default=16,
                 help="smallest GEMM slice extent timed (at most --gemm-base / 2)")
  p.add_argument("--peak-flops", type=float, default=None,
                 help="datasheet peak FLOP/s per device (default: best measured throughput)")
  p.add_argument("--skip-collectives", action="store_true",
                 help="GEMMs only; collective parameters come from --base-profile "
                      "(for a single device)")
  p.add_argument("--base-profile", default=REFERENCE_PROFILE,
                 help="profile to take unmeasured parameters from: a shipped name ("
                      + ", ".join(known_profiles()) + ") or a profile JSON path")
  p.add_argument("--loops", type=int, default=4, help="operations per timed call (>= 1)")
  p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (>= 1)")
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


# ----------------------------------------------------------------------------- checking
# Every option is checked before JAX starts and before anything is timed (a calibration
# takes minutes to hours on real hardware); each check raises ValueError with a message
# that names the option, and the command lines turn it into `parser.error` (exit 2).

def _positive_int(option: str, value, *, allow_zero: bool = False) -> None:
  if value is not None and (value < 0 if allow_zero else value < 1):
    kind = "a non-negative integer" if allow_zero else "a positive integer"
    raise ValueError(f"{option} must be {kind}, got {value}")


def _closest(text: str, known) -> str:
  close = difflib.get_close_matches(text, list(known), n=1, cutoff=0.6)
  return f"; did you mean {close[0]!r}?" if close else ""


def check_profile_option(option: str, name) -> HardwareProfile:
  """`load_profile(name)`, or a ValueError naming `option` (with the closest shipped
  profile name when `name` looks mistyped).

  Example:
    >>> check_profile_option("--base-profile", "tpu-v44")
    Traceback (most recent call last):
    ...
    ValueError: --base-profile: unknown hardware profile 'tpu-v44'; ...; did you mean 'tpu-v4'?
  """
  try:
    return load_profile(name)
  except ValueError as e:
    hint = "" if os.path.exists(name) else _closest(os.path.basename(name), known_profiles())
    raise ValueError(f"{option}: {e}{hint}") from None


def check_output_path(option: str, path: str, *, suffix: str | None = None) -> None:
  """A ValueError naming `option` unless `path` can be written: not a directory, in an
  existing writable directory, ending in `suffix` when given.

  Example:
    >>> check_output_path("--out", "/no/such/dir/p.json")
    Traceback (most recent call last):
    ...
    ValueError: --out '/no/such/dir/p.json': directory '/no/such/dir' does not exist (...)
  """
  if not path:
    raise ValueError(f"{option} must name a file, got {path!r}")
  if os.path.isdir(path):
    raise ValueError(f"{option} {path!r} is a directory; give a file name in it, e.g. "
                     f"{os.path.join(path, 'profile' + (suffix or '.json'))!r}")
  if suffix and not path.endswith(suffix):
    raise ValueError(f"{option} must name a {suffix} file (the suffix by which load_profile "
                     f"tells a profile file from a shipped profile's name), got {path!r}")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise ValueError(f"{option} {path!r}: directory {os.path.dirname(path) or folder!r} "
                     "does not exist (create it first)")
  if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path)
                                                  and not os.access(path, os.W_OK)):
    raise ValueError(f"{option} {path!r}: not writable")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Checked:
  """The options of `calibrate` that `main` uses parsed: mesh shape, shard sizes (bytes),
  collective kinds and the base profile."""

  shape: tuple[int, int]
  sizes: tuple[int, ...]
  kinds: tuple[str, ...]
  base: HardwareProfile


def _check_args(args) -> _Checked:
  """Every option of `calibrate`, checked; a ValueError names the first bad one. Every
  process of a --distributed job checks the output paths too (each runs the same
  command, and one that stopped alone would leave the others waiting), so their
  directory must exist on every host, as it does on a shared file system."""
  try:
    shape = tuple(int(v) for v in args.mesh.lower().split("x"))
  except ValueError:
    shape = ()
  if len(shape) != 2 or min(shape) < 1:
    raise ValueError(f"--mesh must be RxC with positive R and C (e.g. 2x4), got {args.mesh!r}")
  if args.name is not None and not args.name.strip():
    raise ValueError(f"--name must be a non-empty profile name, got {args.name!r}")
  if args.dtype not in DTYPES:
    raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
  try:
    kib = [float(v) for v in args.sizes_kib.split(",") if v.strip()]
  except ValueError:
    kib = [math.nan]
  sizes = tuple(int(v * 1024) if math.isfinite(v) else 0 for v in kib)
  if min(sizes, default=0) < 1 or (len(set(sizes)) < 2 and not args.skip_collectives):
    raise ValueError("--sizes-kib must be >= 2 distinct positive shard sizes in KiB, "
                     f"comma-separated (e.g. 16,64,256), got {args.sizes_kib!r}")
  kinds = tuple(dict.fromkeys(k.strip() for k in args.kinds.split(",") if k.strip()))
  for kind in kinds:
    if kind not in COLLECTIVES:
      raise ValueError(f"--kinds must be drawn from {', '.join(COLLECTIVES)} "
                       f"(comma-separated), got {kind!r}{_closest(kind, COLLECTIVES)}")
  if not kinds and not args.skip_collectives:
    raise ValueError(f"--kinds names no collective; give some of {', '.join(COLLECTIVES)}, "
                     "or --skip-collectives")
  if args.hop_ratio is not None and not (math.isfinite(args.hop_ratio)
                                         and args.hop_ratio >= 0):
    raise ValueError("--hop-ratio must be a finite number >= 0 (hop_latency / "
                     f"base_overhead), got {args.hop_ratio:g}")
  if args.peak_flops is not None and not (math.isfinite(args.peak_flops)
                                          and args.peak_flops > 0):
    raise ValueError("--peak-flops must be a finite number > 0 (FLOP/s per device), got "
                     f"{args.peak_flops:g}")
  for option, value in (("--gemm-base", args.gemm_base), ("--gemm-min", args.gemm_min),
                        ("--loops", args.loops), ("--repeats", args.repeats),
                        ("--cpu-devices", args.cpu_devices),
                        ("--num-processes", args.num_processes)):
    _positive_int(option, value)
  _positive_int("--process-id", args.process_id, allow_zero=True)
  if args.gemm_min > args.gemm_base // 2:
    raise ValueError(f"--gemm-min must be at most half of --gemm-base ({args.gemm_base // 2}), "
                     f"so that more than one GEMM shape is timed; got {args.gemm_min}")
  if (args.process_id is not None and args.num_processes is not None
      and args.process_id >= args.num_processes):
    raise ValueError(f"--process-id must be below --num-processes ({args.num_processes}), "
                     f"got {args.process_id}")
  if not args.distributed:
    for option, value in (("--coordinator-address", args.coordinator_address),
                          ("--num-processes", args.num_processes),
                          ("--process-id", args.process_id)):
      if value is not None:
        raise ValueError(f"{option} only applies with --distributed")
  if args.coordinator_address is not None:
    host, _, port = args.coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError("--coordinator-address must be host:port (e.g. 10.0.0.1:1234), got "
                       f"{args.coordinator_address!r}")
  base = check_profile_option("--base-profile", args.base_profile)
  check_output_path("--out", args.out, suffix=".json")
  if args.report is not None:
    check_output_path("--report", args.report)
    if os.path.abspath(args.report) == os.path.abspath(args.out):
      raise ValueError(f"--report must differ from --out (both {args.out!r})")
  return _Checked(shape=shape, sizes=sizes, kinds=kinds, base=base)


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
  """Run the calibration; returns a process exit status (0 = profile written). Every
  option is checked first: a bad one stops it with a usage error naming the option (exit
  2) before JAX starts and before anything is measured.

  Example:
    >>> main(["--mesh", "2x4", "--out", "/tmp/cpu.json", "--sizes-kib", "4,64",
    ...       "--gemm-base", "64", "--gemm-min", "16"])                # doctest: +SKIP
    0
  """
  parser = _parser()
  args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
  try:
    checked = _check_args(args)
  except ValueError as e:
    parser.error(str(e))
  shape, sizes, kinds, base = checked.shape, checked.sizes, checked.kinds, checked.base
  jax = _start_jax(args)
  n = shape[0] * shape[1]
  if n > jax.device_count():
    parser.error(f"--mesh {args.mesh} needs {n} devices; JAX has {jax.device_count()}")
  devices = mesh_devices(shape)
  lead = jax.process_index() == 0
  echo = None if args.quiet or not lead else print
  platform = jax.devices()[0].platform
  kind_name = getattr(jax.devices()[0], "device_kind", platform)
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
