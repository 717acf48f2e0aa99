"""What slicing a GEMM costs on one accelerator: the measurements the cost model's compute
terms (max_efficiency, op_overhead, float32 accumulation traffic, relayout copies) are
fitted to. Needs no mesh: one device runs the local matmuls of a sliced site.

For each shape (m, n, k) and slice count S it times, with jax.jit on the default device:

  os  S matmuls (m, n, k/S) in bf16, each adding its float32 product into an accumulator
      (the local work of an output-stationary site with S slices)
  ls  S matmuls (m, n/S, k), each writing its own output columns (lhs-stationary)
  copy  a block-cyclic relayout: (C, m, k/S) -> (m, C * k/S) in bf16

Steps are kept apart with optimization barriers, as the pass emits them, so XLA cannot
fuse the slices back into one matmul. Prints one JSON line per measurement and a table.

  python bench/gemm_slicing.py --shapes=8192x6144x12288 --ksplits=1,2,4,8,16,32,64
"""
from __future__ import annotations

import json
import time

from absl import app, flags

_SHAPES = flags.DEFINE_list("shapes", ["8192x6144x12288", "16384x7680x20480"],
                            "m x n x k of the local matmul")
_KSPLITS = flags.DEFINE_list("ksplits", ["1", "2", "4", "8", "16", "32", "64"], "slice counts")
_REPEATS = flags.DEFINE_integer("repeats", 10, "timed runs (after 3 warm-ups)")
_OUT = flags.DEFINE_string("out", None, "also write the JSON lines here")


def _timeit(fn, *args, repeats):
  import jax
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _os(s):
  import jax
  import jax.numpy as jnp

  def f(x, w):
    m, k = x.shape
    n = w.shape[1]
    acc = jnp.zeros((m, n), jnp.float32)
    for i in range(s):
      xs = jax.lax.slice_in_dim(x, i * k // s, (i + 1) * k // s, axis=1)
      ws = jax.lax.slice_in_dim(w, i * k // s, (i + 1) * k // s, axis=0)
      acc = acc + jax.lax.dot(xs, ws, preferred_element_type=jnp.float32)
      acc = jax.lax.optimization_barrier(acc)
    return acc.astype(jnp.bfloat16)
  return jax.jit(f)


def _ls(s):
  import jax
  import jax.numpy as jnp

  def f(x, w):
    n = w.shape[1]
    outs = []
    for i in range(s):
      ws = jax.lax.slice_in_dim(w, i * n // s, (i + 1) * n // s, axis=1)
      y = jax.lax.dot(x, ws, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
      outs.append(jax.lax.optimization_barrier(y))
    return jnp.concatenate(outs, axis=1)
  return jax.jit(f)


def _copy():
  import jax
  import jax.numpy as jnp

  def f(g):               # (C, m, kb) -> (m, C * kb)
    c, m, kb = g.shape
    return jnp.transpose(g, (1, 0, 2)).reshape(m, c * kb)
  return jax.jit(f)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  dev = jax.devices()[0]
  rows = []
  key = jax.random.PRNGKey(0)
  for shape in _SHAPES.value:
    m, n, k = (int(v) for v in shape.split("x"))
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16)
    for s in (int(v) for v in _KSPLITS.value):
      if k % s or n % s:
        continue
      for kind, build in (("os", _os), ("ls", _ls)):
        t = _timeit(build(s), x, w, repeats=_REPEATS.value)
        rows.append({"kind": kind, "m": m, "n": n, "k": k, "ksplit": s, "seconds": t,
                     "tflops": 2 * m * n * k / t / 1e12, "device": dev.device_kind})
        print(json.dumps(rows[-1]), flush=True)
    for c, s in ((8, 4), (8, 16), (32, 16)):
      if k % (c * s):
        continue
      g = jnp.zeros((c, m, k // (c * s)), jnp.bfloat16)
      t = _timeit(_copy(), g, repeats=_REPEATS.value)
      nbytes = g.size * 2
      rows.append({"kind": "copy", "m": m, "n": 0, "k": k // s, "ksplit": s, "c": c,
                   "bytes": nbytes, "seconds": t, "GBps_rw": 2 * nbytes / t / 1e9,
                   "device": dev.device_kind})
      print(json.dumps(rows[-1]), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in rows))
  print(f"\n{'kind':5} {'m x n x k':>20} {'S':>4} {'ms':>9} {'TFLOP/s':>8}")
  for r in rows:
    if r["kind"] != "copy":
      print(f"{r['kind']:5} {r['m']}x{r['n']}x{r['k']:>6} {r['ksplit']:>4} "
            f"{r['seconds'] * 1e3:9.3f} {r['tflops']:8.1f}")
    else:
      print(f"copy  {r['bytes'] / 1e6:.1f} MB (C={r['c']}) {r['seconds'] * 1e3:9.3f} ms "
            f"{r['GBps_rw']:.0f} GB/s read+write")


if __name__ == "__main__":
  app.run(main)
