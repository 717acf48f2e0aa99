"""Which libtpu flags make a sliced program's all-gathers asynchronous, per TPU
generation (docs/tpu.md "Flags per generation"). Compiles a hand-written sliced
shard_map (OS S=4 then LS S=4, 4096^2 bf16, 2 x 4 mesh) for TOPOLOGY under this
process's LIBTPU_INIT_ARGS and prints the compiled collectives by opcode (no meshslice
import, so it runs on any jax with libtpu, e.g. the newest). A collective offloaded to
the SparseCore (v5p, v6e) is still counted by its opcode, inside the called computation,
and once more as a "call-start" (the async call that runs it):

  LIBTPU_INIT_ARGS="--xla_enable_async_all_gather=true" python bench/tpu_flags_probe.py v4:2x2x2

A refused flag prints its FAILED_PRECONDITION message as "error".
"""
import os
import sys
import re
import json
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
topo_name = sys.argv[1]
gen = topo_name.split(":")[0]
chip = "megacore" if gen in ("v4", "v5p") else "default"
topo = topologies.get_topology_desc(platform="tpu", topology_name=topo_name,
    chip_config_name=chip, chips_per_host_bounds=(2, 2, 1), num_slices=1)
devs = np.array(topo.devices)
n = devs.size
mesh = Mesh(devs.reshape(2, n // 2), ("x", "y"))
S = 4
M = K = N = 4096
def os_body(x, w):   # x [M/r, K/c], w [K/r, N/c]
  xs = jnp.split(x, S, axis=1)
  ws = jnp.split(w, S, axis=0)
  acc = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
  for s in range(S):
    xg = jax.lax.all_gather(xs[s], "y", axis=1, tiled=True)
    wg = jax.lax.all_gather(ws[s], "x", axis=0, tiled=True)
    acc = acc + jnp.dot(xg, wg, preferred_element_type=jnp.float32)
  return acc.astype(x.dtype)
def ls_body(x, w):   # x [M/r, K/c], w [K/c, N/r] -> y [M/r, N/c]
  wsl = jnp.split(w, S, axis=1)
  outs = []
  for s in range(S):
    wg = jax.lax.all_gather(wsl[s], "x", axis=1, tiled=True)
    part = jnp.dot(x, wg, preferred_element_type=jnp.float32)
    outs.append(jax.lax.psum_scatter(part, "y", scatter_dimension=1, tiled=True))
  return jnp.concatenate(outs, axis=1).astype(x.dtype)
f_os = jax.shard_map(os_body, mesh=mesh, in_specs=(P("x", "y"), P("x", "y")),
                     out_specs=P("x", "y"), check_vma=False)
f_ls = jax.shard_map(ls_body, mesh=mesh, in_specs=(P("x", "y"), P("y", "x")),
                     out_specs=P("x", "y"), check_vma=False)
def both(x, w, w2):
  return f_ls(f_os(x, w), w2)
sd = lambda spec: jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
out = {"topology": topo_name, "flags": os.environ.get("LIBTPU_INIT_ARGS", ""),
       "jax": jax.__version__}
try:
  text = jax.jit(both).lower(sd(P("x","y")), sd(P("x","y")), sd(P("y","x"))).compile().as_text()
  ops = {}
  for line in text.splitlines():
    m = re.search(r" = (?:\([^=]*?\)|\S+) ([a-z][a-z0-9-]*)\(", line)
    if not m:
      continue
    op = m.group(1)
    if op == "fusion" and "async_collective_fusion" in line.split("=")[0]:
      op = "async_collective_fusion"
    if op in ("all-gather", "all-gather-start", "reduce-scatter", "all-reduce",
              "all-reduce-start", "collective-permute-start", "async_collective_fusion",
              "reduce-scatter-start", "async-start", "call-start"):
      ops[op] = ops.get(op, 0) + 1
  out.update(ops)
except Exception as e:
  out["error"] = str(e).splitlines()[0][:300]
print("RESULT " + json.dumps(out))
