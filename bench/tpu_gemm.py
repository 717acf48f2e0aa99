"""One 2D-sharded GEMM as the real TPU compiler schedules it: MeshSlice bodies vs the dense
program, from ahead-of-time compiles on this machine (libtpu; docs/tpu.md).

For each dataflow (OS, LS, RS; layouts of docs/design.md) and S in --ksplits, the
MeshSlice shard_map body (`meshslice.rewrites.build_body("meshslice", ...)`) is compiled
for --topology as an RxC mesh, under libtpu's async-collective flags; the baseline is
plain `jax.jit` of the same GEMM with XLA's windowed einsum off (the "dense" program).
Flags are per process, so each flag set compiles in its own subprocess. Prints, per
variant, the compiler's estimated cycles (total compute, dots, relayout copies, the
rest), the collectives (count by kind, how many asynchronous) and the ratio of compute
cycles to the dense program's.

  python bench/tpu_gemm.py                          # 8192^3 bf16, v4:2x2x2 as 2x4, S=1,2,4
  python bench/tpu_gemm.py --ksplits 2 --dataflows os --out /tmp/gemm.jsonl
"""
from __future__ import annotations

from absl import app, flags

import cluster  # noqa: E402  (bench/cluster.py: the JSON-lines writer)

_TOPOLOGY = flags.DEFINE_string("topology", "v4:2x2x2", "TPU topology to compile for")
_MESH = flags.DEFINE_string("mesh", "2x4", "mesh shape RxC (axes x, y)")
_SIZE = flags.DEFINE_list("size", ["8192", "8192", "8192"], "M,K,N")
_KSPLITS = flags.DEFINE_list("ksplits", ["1", "2", "4"], "slice counts S")
_DATAFLOWS = flags.DEFINE_list("dataflows", ["os", "ls", "rs"], "dataflows")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "element type")
_WORKER = flags.DEFINE_enum("worker", None, ["dense", "async"],
                            "internal: compile under this flag set and print JSON lines")
_OUT = flags.DEFINE_string("out", None, "also write the records as JSON lines here")

# Not `meshslice.aot_sites.compile_cases`, whose programs and records differ from these:
# its "async" set is the generation's flags (`preset_flags`; here the continuation-fusion
# group, `FLAG_PRESETS["async"]`), its mesh is `aot.make_mesh`'s device order (here the
# topology's own), it compiles XLA's program under every flag set, and its records carry
# the fit's figures, not `summarize`'s collective counts and overlap cycles.
def compile_variants(flag_set: str) -> list[dict]:
  """Compile, in this process, every variant that `flag_set` is used for."""
  from meshslice import aot
  aot.set_flags(*aot.FLAG_PRESETS[flag_set])
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from meshslice.costmodel import tpu_schedule as ts
  from meshslice.rewrites import build_body, plain_gemm

  jax.config.update("jax_platforms", "cpu")
  rows, cols = (int(v) for v in _MESH.value.split("x"))
  mesh = Mesh(np.array(aot.topology(_TOPOLOGY.value).devices).reshape(rows, cols), ("x", "y"))
  m, k, n = (int(v) for v in _SIZE.value)
  dtype = jnp.dtype(_DTYPE.value)
  out_sharding = NamedSharding(mesh, P("x", "y"))
  records = []
  for dataflow in _DATAFLOWS.value:
    geometry, lhs_axes, rhs_axes = plain_gemm(dataflow, m, k, n, rows, cols, dtype)
    specs = (P(*lhs_axes), P(*rhs_axes))
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))
            for shape, s in zip(((m, k), (k, n)), specs)]
    programs = {}
    if flag_set == "dense":
      programs["dense"] = jax.jit(lambda a, b: a @ b, out_shardings=out_sharding)
    else:
      for ksplit in (int(s) for s in _KSPLITS.value):
        body = build_body("meshslice", geometry, ksplit)
        programs[f"meshslice S={ksplit}"] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x", "y")),
            out_shardings=out_sharding)
    for name, fn in programs.items():
      summary = ts.summarize(fn.lower(*args).compile().as_text())
      records.append({"dataflow": dataflow, "program": name, "flags": flag_set,
                      "compute_cycles": summary.compute_cycles,
                      "dot_cycles": summary.dot_cycles, "copy_cycles": summary.copy_cycles,
                      "relayout_copies": summary.relayout_copies,
                      "other_cycles": summary.other_cycles,
                      "collectives": summary.collective_count,
                      "async_collectives": summary.async_collectives,
                      "overlap_cycles": summary.overlap_cycles})
  return records


def _run_worker(flag_set: str) -> list[dict]:
  return cluster.run_flag_set(__file__, flag_set, topology=_TOPOLOGY.value, mesh=_MESH.value,
                              size=_SIZE.value, ksplits=_KSPLITS.value,
                              dataflows=_DATAFLOWS.value, dtype=_DTYPE.value)


def main(argv):
  if _WORKER.value:
    cluster.print_json_lines(compile_variants(_WORKER.value))
    return
  cluster.require_libtpu()
  records = _run_worker("dense") + _run_worker("async")
  dense = {r["dataflow"]: r["compute_cycles"] for r in records if r["program"] == "dense"}
  print(f"{'x'.join(_SIZE.value)} {_DTYPE.value} GEMM on {_TOPOLOGY.value} as {_MESH.value}; "
        "estimated cycles (compiler), ratio = compute / dense")
  print(f"{'flow':4} {'program':14} {'flags':5} {'compute':>9} {'dots':>9} {'copies':>11} "
        f"{'other':>8} {'collectives':32} {'async':>5} {'ratio':>6}")
  for r in records:
    r["ratio_to_dense"] = round(r["compute_cycles"] / dense[r["dataflow"]], 3)
    colls = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items()))
    print(f"{r['dataflow']:4} {r['program']:14} {r['flags']:5} {r['compute_cycles']:9d} "
          f"{r['dot_cycles']:9d} {r['copy_cycles']:8d}({r['relayout_copies']}) "
          f"{r['other_cycles']:8d} {colls:32} {r['async_collectives']:5d} "
          f"{r['ratio_to_dense']:6.3f}")
  if _OUT.value:
    cluster.write_jsonl(_OUT.value, records)


if __name__ == "__main__":
  app.run(main)
