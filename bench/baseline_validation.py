"""The cost model's baselines next to what the TPU compiler emits for them.

For each GEMM (dataflow layouts of docs/design.md, output P(x, y)), compiled ahead of
time for --topology as an RxC mesh (libtpu on this machine, docs/tpu.md):

  xla-default  plain `jax.jit` of the GEMM, default flags (XLA's windowed einsum on)
  xla-dense    the same with windowed einsum off (`aot.DENSE_FLAGS`)
  collective   the project's collective body (`rewrites.build_body("collective")`) in a
               shard_map, default flags

each compiled program is read and simulated (`costmodel.tpu_schedule.simulate`) with
the same per-axis profile the planner uses for this mesh (`profile_for_mesh`), and set
beside the cost model's prediction for the collective algorithm: communication time
(sum of collective durations) and step time. The simulator times every collective with
the cost model's own ICI formulas, so an agreement in communication says the compiler
emits the collectives (kinds, groups, bytes) the model assumes; the step columns add
what it overlaps and the compiler's compute estimates.

Flags are read once per process, so each flag set compiles in a subprocess.

  python bench/baseline_validation.py                    # 4096^3 bf16 os, ls, rs; v4 2x4
  python bench/baseline_validation.py --gemms os:8192x4096x4096 --out /tmp/v.jsonl
"""
from __future__ import annotations

import json

from absl import app, flags

import cluster  # noqa: E402  (bench/cluster.py: the subprocess runner)

_TOPOLOGY = flags.DEFINE_string("topology", "v4:2x2x2", "TPU topology to compile for")
_MESH = flags.DEFINE_string("mesh", "2x4", "mesh shape RxC (axes x, y)")
_GEMMS = flags.DEFINE_list("gemms", ["os:4096x4096x4096", "ls:4096x4096x4096",
                                     "rs:4096x4096x4096"], "dataflow:MxKxN, bf16")
_PROFILE = flags.DEFINE_string("profile", "tpu-v4", "hardware profile")
_WORKER = flags.DEFINE_enum("worker", None, ["default", "dense"],
                            "internal: compile under this flag set and print JSON lines")
_OUT = flags.DEFINE_string("out", None, "also write the records as JSON lines here")


def _gemms():
  for item in _GEMMS.value:
    flow, _, dims = item.partition(":")
    m, k, n = (int(v) for v in dims.split("x"))
    yield flow, m, k, n


def compile_and_simulate(flag_set: str) -> list[dict]:
  """In this process: compile every program `flag_set` is used for, simulate it."""
  from meshslice import aot
  aot.set_flags(*aot.FLAG_PRESETS[flag_set])
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from meshslice.costmodel import load_profile, profile_for_mesh
  from meshslice.costmodel import tpu_schedule as ts
  from meshslice.rewrites import build_body, plain_gemm

  rows, cols = (int(v) for v in _MESH.value.split("x"))
  mesh = aot.make_mesh(_TOPOLOGY.value, (rows, cols))
  base = load_profile(_PROFILE.value)
  profile = profile_for_mesh(base, (rows, cols))
  dtype = jnp.bfloat16
  out = NamedSharding(mesh, P("x", "y"))
  records = []
  for flow, m, k, n in _gemms():
    # X[M, K] @ W[K, N] laid out for the dataflow; the output is always P(x, y)
    geometry, lhs_axes, rhs_axes = plain_gemm(flow, m, k, n, rows, cols, dtype)
    specs = (P(*lhs_axes), P(*rhs_axes))
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))
            for shape, s in zip(((m, k), (k, n)), specs)]
    if flag_set == "dense":
      programs = {"xla-dense": jax.jit(lambda a, b: a @ b, out_shardings=out)}
    else:
      body = build_body("collective", geometry, 1)
      programs = {"xla-default": jax.jit(lambda a, b: a @ b, out_shardings=out),
                  "collective": jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                                                      out_specs=P("x", "y")),
                                        out_shardings=out)}
    for name, fn in programs.items():
      text = fn.lower(*args).compile().as_text()
      schedule = ts.read_schedule(text, chip=base.name)
      summary = ts.summarize(schedule)
      sim = ts.simulate(schedule, profile, clock_hz=ts.CLOCK_HZ[base.name])
      records.append({"dataflow": flow, "m": m, "k": k, "n": n, "program": name,
                      "flags": flag_set, "step_s": sim.step_s, "compute_s": sim.compute_s,
                      "collective_s": sim.collective_s, "exposed_s": sim.exposed_s,
                      "sync_collective_s": sim.sync_collective_s,
                      "collectives": summary.collective_count,
                      "collective_bytes": summary.collective_bytes,
                      "async_collectives": summary.async_collectives,
                      "windowed_einsum_loops": summary.windowed_einsum_loops})
  return records


def predictions(flow, m, k, n) -> dict:
  """The cost model's collective baseline for one GEMM on this mesh."""
  from meshslice.costmodel import GemmProblem, load_profile, predict, profile_for_mesh
  rows, cols = (int(v) for v in _MESH.value.split("x"))
  profile = profile_for_mesh(load_profile(_PROFILE.value), (rows, cols))
  cost = predict(GemmProblem(m=m, n=n, k=k, rows=rows, cols=cols), "collective", flow, 1,
                 profile)
  return {"comm_s": cost.comm_s, "compute_s": cost.compute_s, "total_s": cost.total_s}


def _run_worker(flag_set: str) -> list[dict]:
  return cluster.run_flag_set(__file__, flag_set, topology=_TOPOLOGY.value, mesh=_MESH.value,
                              gemms=_GEMMS.value, profile=_PROFILE.value)


def main(argv):
  if _WORKER.value:
    cluster.print_json_lines(compile_and_simulate(_WORKER.value))
    return
  cluster.require_libtpu()
  records = _run_worker("default") + _run_worker("dense")
  us = lambda s: f"{s * 1e6:8.1f}"
  print(f"{_TOPOLOGY.value} as {_MESH.value}, profile {_PROFILE.value} per axis; us")
  print(f"{'gemm':22} {'program':12} {'pred comm':>9} {'sim comm':>9} {'pred step':>9} "
        f"{'sim step':>9} {'sim exposed':>11} {'we loops':>8}  collectives")
  for r in records:
    p = predictions(r["dataflow"], r["m"], r["k"], r["n"])
    r["predicted"] = p
    colls = ", ".join(f"{kind} {count}" for kind, count in sorted(r["collectives"].items()))
    print(f"{r['dataflow']} {r['m']}x{r['k']}x{r['n']:<12} {r['program']:12} "
          f"{us(p['comm_s']):>9} {us(r['collective_s']):>9} {us(p['total_s']):>9} "
          f"{us(r['step_s']):>9} {us(r['exposed_s']):>11} {r['windowed_einsum_loops']:8d}  "
          f"{colls} ({r['async_collectives']} async)")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      for r in records:
        f.write(json.dumps(r, sort_keys=True) + "\n")


if __name__ == "__main__":
  app.run(main)
