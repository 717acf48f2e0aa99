"""The MeshSlice bodies as the real TPU compiler sees them (ahead of time, libtpu; skipped
without it): a rewritten OS / LS / RS site must not make XLA relayout (`copy`) anything
the dense program does not, and its sliced collectives must stay S collectives.

A 2048^3 bf16 GEMM on v4:2x2x2 as a (2, 4) mesh with S = 2 (seconds of compiling).
Each compile runs in a subprocess with the dense program's flags (windowed einsum off,
docs/tpu.md): libtpu reads its flags once per process.
"""
import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_platforms", "cpu")
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from meshslice import aot
from meshslice.costmodel import tpu_schedule as ts
from meshslice.rewrites import GemmGeometry, build_body

aot.set_flags(*aot.DENSE_FLAGS)
mesh = Mesh(np.array(aot.topology("v4:2x2x2").devices).reshape(2, 4), ("x", "y"))
m, k, n, ksplit = map(int, sys.argv[1:5])
layouts = {"os": ((P("x", "y"), P("x", "y")), dict(lhs_dim=1, rhs_dim=0, out_dim=None,
                                                  global_extent=k)),
           "ls": ((P("x", "y"), P("y", "x")), dict(lhs_dim=None, rhs_dim=1, out_dim=1,
                                                  global_extent=n)),
           "rs": ((P("y", "x"), P("x", "y")), dict(lhs_dim=0, rhs_dim=None, out_dim=0,
                                                  global_extent=m))}
out_sharding = NamedSharding(mesh, P("x", "y"))
result = {}
for flow, (specs, dims) in layouts.items():
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, s))
          for shape, s in zip(((m, k), (k, n)), specs)]
  geometry = GemmGeometry(dimension_numbers=(((1,), (0,)), ((), ())), dataflow=flow,
                          row_axis="x", col_axis="y", row_size=2, col_size=4,
                          out_dtype=jnp.dtype(jnp.bfloat16), **dims)
  programs = {
      "dense": jax.jit(lambda a, b: a @ b, out_shardings=out_sharding),
      "meshslice": jax.jit(jax.shard_map(build_body("meshslice", geometry, ksplit),
                                         mesh=mesh, in_specs=specs, out_specs=P("x", "y")),
                           out_shardings=out_sharding)}
  for name, fn in programs.items():
    summary = ts.summarize(fn.lower(*args).compile().as_text())
    result[f"{flow}/{name}"] = {"copies": summary.relayout_copies,
                                "copy_cycles": summary.copy_cycles,
                                "collectives": summary.collective_count}
print("RESULT", json.dumps(result))
"""


@pytest.fixture(scope="module")
def compiled():
  pytest.importorskip("libtpu")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  # the old bodies relayouted here (a (blocks, S, B) view of the lane dim made TPU
  # transpose whole operands: 2 copies for OS, 3 for LS, 1 for RS; 6/5/1 at 8192^3, S=4)
  out = subprocess.run([sys.executable, "-c", _SCRIPT, "2048", "2048", "2048", "2"],
                       capture_output=True,
                       text=True, env=env, timeout=600)
  lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, out.stderr[-3000:]
  return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("dataflow", ["os", "ls", "rs"])
def test_rewritten_site_adds_no_relayout_copy(compiled, dataflow):
  dense, rewritten = compiled[f"{dataflow}/dense"], compiled[f"{dataflow}/meshslice"]
  assert rewritten["copies"] <= dense["copies"], (dense, rewritten)
  assert rewritten["copy_cycles"] <= dense["copy_cycles"], (dense, rewritten)


@pytest.mark.parametrize("dataflow,expect", [
    ("os", {"all-gather": 4}),
    ("ls", {"all-gather": 2, "reduce-scatter": 2}),
    ("rs", {"all-gather": 2, "reduce-scatter": 2}),
])
def test_sliced_collectives_stay_separate_on_tpu(compiled, dataflow, expect):
  assert compiled[f"{dataflow}/meshslice"]["collectives"] == expect
