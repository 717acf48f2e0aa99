"""Single-GEMM programs compiled for a TPU topology: what the planner is fitted to
(`python -m meshslice calibrate --aot`) and ranked against (bench/tpu_rank.py).

One *case* is one 2D-sharded GEMM `Y[M,N] = X[M,K] . W[K,N]` on an R x C mesh (axes
"x", "y"), its operands laid out for one dataflow (docs/design.md):

    os  X (M:x, K:y), W (K:x, N:y)     ls  X (M:x, K:y), W (K:y, N:x)
    rs  X (M:y, K:x), W (K:x, N:y)     output Y (M:x, N:y) in all three

Programs compiled per case, each read with `meshslice.costmodel.tpu_schedule`:

    "xla"             plain `jax.jit(a @ b)`: XLA's own program (windowed einsum where it
                      fires) under the flag set of the process
    "meshslice S=k"   the MeshSlice shard_map body with k slices (S=1: the collective
                      algorithm)

Flag sets (libtpu reads its flags once per process, so each runs in its own subprocess):
"async" = the topology's generation's async collective flags
(`backend_flags.tpu_overlap_flags`: the flags the rewrite is planned for; windowed einsum
on, as by default), "async_dense" = those plus `aot.DENSE_FLAGS` (windowed einsum off),
"default" (libtpu defaults) and "dense" (`aot.DENSE_FLAGS` alone): XLA's program as users
without the async flags get it. Each record carries the flags it was compiled with.

Example:
  >>> cases = [Case(dataflow="os", m=8192, k=8192, n=8192)]
  >>> records = compile_cases("v4:2x2x2", (2, 4), cases, "async_dense",
  ...                         ksplits=())                             # doctest: +SKIP
  >>> records[0]["program"], records[0]["windowed_einsum_loops"]      # doctest: +SKIP
  ('xla', 0)
"""
from __future__ import annotations

import dataclasses
import json
import sys

FLAG_SETS = ("async", "async_dense", "default", "dense")

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Case:
  """One GEMM site: dataflow, global sizes, element type, and a label for reports."""

  dataflow: str
  m: int
  k: int
  n: int
  dtype: str = "bfloat16"
  label: str = ""


def flags_of(flag_set: str, generation: str | None = None) -> tuple:
  """The libtpu flags of a flag set (module docstring) on a TPU generation."""
  from .backend_flags import preset_flags
  presets = {"async": ("async",), "async_dense": ("async", "dense"), "default": (),
             "dense": ("dense",)}
  if flag_set not in presets:
    raise ValueError(f"flag set must be one of {FLAG_SETS}, got {flag_set!r}")
  return preset_flags(presets[flag_set], generation)


# the record's figures, in this order (costmodel.compiler_fit and bench/tpu_rank read them)
_FIGURES = ("compute_cycles", "dot_cycles", "copy_cycles", "other_cycles", "relayout_copies",
            "dots", "sync", "async", "collective_bytes", "windowed_einsum_loops", "step_s",
            "compute_s", "exposed_s", "sync_collective_s")


def _record(result) -> dict:
  """The figures of one analyzed program (an `aot.AotResult`) that the fits and the
  ranking use: its row's, the two the row leaves out, and per-op counts over the
  expanded schedule (loop bodies once per trip; the loops here are short)."""
  sync, asyn, dots = {}, {}, []
  for op in result.schedule.expanded():
    if op.kind == "collective":
      sync[op.collective] = sync.get(op.collective, 0) + 1
    elif op.kind == "start":
      asyn[op.collective] = asyn.get(op.collective, 0) + 1
    if op.kind == "dot":
      dots.append((op.cycles, op.flops, 1))
  figures = {**result.row(), "other_cycles": result.summary.other_cycles,
             "sync_collective_s": result.simulation.sync_collective_s,
             "dots": dots, "sync": sync, "async": asyn}
  return {key: figures[key] for key in _FIGURES}


def compile_cases(topology: str, mesh_shape, cases, flag_set: str, *, ksplits=(1, 2, 4),
                  echo=None) -> list[dict]:
  """Compile every program of every case under `flag_set`, in this process (which must
  not have loaded libtpu with other flags). One record per program: the case's fields,
  "program", "flag_set", "flags", "topology", "mesh", "compile_s" and the figures of
  `_record`, from `aot.analyze` with the profile's links derived for the mesh. A ksplit
  the case cannot slice exactly is skipped."""
  from . import aot
  gen, _ = aot.parse_topology(topology)
  aot.set_flags(*flags_of(flag_set, gen.name))
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  jax.config.update("jax_platforms", "cpu")
  rows, cols = (int(v) for v in mesh_shape)
  mesh = aot.make_mesh(topology, (rows, cols))
  out_sharding = NamedSharding(mesh, P("x", "y"))
  from meshslice.rewrites import build_body, plain_gemm
  records = []
  for case in cases:
    dtype = jnp.dtype(case.dtype)
    # the one table of the plain GEMM's layouts per dataflow (rewrites.plain_gemm)
    geometry, lhs_axes, rhs_axes = plain_gemm(case.dataflow, case.m, case.k, case.n, rows,
                                              cols, dtype)
    specs = (P(*lhs_axes), P(*rhs_axes))
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))
            for shape, s in zip(((case.m, case.k), (case.k, case.n)), specs)]
    programs = {"xla": jax.jit(lambda a, b: a @ b, out_shardings=out_sharding)}
    if flag_set == "async":
      for ksplit in ksplits:
        if ksplit not in geometry.valid_ksplits():
          continue
        body = build_body("meshslice", geometry, ksplit)
        programs[f"meshslice S={ksplit}"] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x", "y")),
            out_shardings=out_sharding)
    for name, fn in programs.items():
      compiled, seconds = aot.compile(fn, *args, mesh=mesh)
      # each collective at its axis's full links (ring_shares=False): as the shipped
      # compiler terms were fitted
      result = aot.analyze(compiled, gen.profile, compile_s=seconds, mesh_shape=(rows, cols),
                           ring_shares=False)
      del compiled
      record = dict(dataclasses.asdict(case), program=name, flag_set=flag_set,
                    flags=result.flags, topology=topology, mesh=[rows, cols],
                    compile_s=seconds, **_record(result))
      records.append(record)
      if echo:
        echo(f"  {case.label or case.dataflow:<22} {name:<14} {flag_set:<11} "
             f"{record['compute_cycles'] / 1e6:8.3f} Mcycles  step "
             f"{record['step_s'] * 1e6:9.1f} us  ({seconds:.0f} s compile)")
  return records


def compile_in_subprocess(topology: str, mesh_shape, cases, flag_set: str, *,
                          ksplits=(1, 2, 4), timeout: float = 3600, echo=None) -> list[dict]:
  """`compile_cases` in a fresh Python process (libtpu flags are per process,
  `aot.run_in_fresh_process`); progress lines are passed to `echo` as they come."""
  from . import aot
  spec = {"topology": topology, "mesh": list(mesh_shape), "flag_set": flag_set,
          "ksplits": list(ksplits), "cases": [dataclasses.asdict(c) for c in cases]}

  def progress(line: str) -> None:
    if echo and line.strip():
      echo(line.rstrip())

  # XLA_FLAGS is not passed on: the caller's emulated CPU devices are not wanted here
  try:
    return aot.run_in_fresh_process(["-m", "meshslice.aot_sites", json.dumps(spec)],
                                    prefix="RECORD ", echo=progress, timeout=timeout)
  except aot.FreshProcessError as e:
    if e.timed_out:
      raise RuntimeError(f"{flag_set} compiles timed out after {timeout} s") from None
    raise RuntimeError(f"{flag_set} compiles failed (exit {e.returncode}):\n"
                       f"{e.stderr[-3000:]}") from None


def _worker(spec_json: str) -> int:
  spec = json.loads(spec_json)
  cases = [Case(**c) for c in spec["cases"]]
  for record in compile_cases(spec["topology"], spec["mesh"], cases, spec["flag_set"],
                              ksplits=tuple(spec["ksplits"]),
                              echo=lambda s: print(s, flush=True)):
    print("RECORD " + json.dumps(record), flush=True)
  return 0


# `python -m meshslice calibrate --aot` moved to calibrate_aot, which imports this module:
# resolved on first use (PEP 562), so that importing aot_sites does not load the CLI.
# (An import cycle all the same: tests/test_layering.KNOWN_CYCLES.)
_MOVED_TO_CALIBRATE = ("calibrate_main", "DEFAULT_SHAPES")


def __getattr__(name: str):
  if name in _MOVED_TO_CALIBRATE:
    import importlib
    return getattr(importlib.import_module(".calibrate_aot", __package__), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":      # the worker of compile_in_subprocess
  sys.exit(_worker(sys.argv[1]))
