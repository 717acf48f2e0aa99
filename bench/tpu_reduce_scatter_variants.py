"""Where the rewrite's exposed time goes on v4 under the safe flags, and one way out: the
reduce-scatters.

libtpu keeps reduce-scatters synchronous on v4 under every flag we tried (docs/tpu.md), so
the collective plan's reduce-scatter sites (the weight gradients) expose their whole
transfer. This experiment compiles the GPT-3 step with the collective plan three ways,
each against XLA's best program (dense_async) compiled with the same flags:

  psum_scatter  the rewrite as the pass emits it by default (one reduce-scatter per site)
  all_to_all    the pass option reduce_scatter="all_to_all": each reduce-scatter as an
                all-to-all (async on v4 with --xla_tpu_enable_async_all_to_all) followed
                by adds of the n pieces, laid out pieces-major without a copy of the
                partial (rewrites/scatter.py; what "auto" picks under these flags)
  ring          each reduce-scatter written as n-1 collective-permutes (async) with adds,
                swapped in for `jax.lax.psum_scatter` while the rewrite is traced (an
                experiment, not a pass option)

Every variant, XLA included, is compiled with v4's safe async flags, windowed einsum off,
and async all-to-all on.

  python bench/tpu_reduce_scatter_variants.py                    # v4:2x2x2 as 2x4, batch 8
  python bench/tpu_reduce_scatter_variants.py v4:8x8x4 64x4 256  # the pod (slow compiles)
"""
from __future__ import annotations

import json
import sys
import time

from meshslice import aot


def main(argv) -> int:
  topology = argv[1] if len(argv) > 1 else "v4:2x2x2"
  shape = tuple(int(n) for n in (argv[2] if len(argv) > 2 else "2x4").split("x"))
  batch = int(argv[3]) if len(argv) > 3 else 8
  flags = aot.preset_flags("dense,async,all_to_all", "v4")
  aot.set_flags(*flags)                    # before libtpu loads

  import jax
  from jax import lax

  import meshslice

  psum_scatter = lax.psum_scatter

  def ring_scatter(x, axis_name, *, scatter_dimension=0, tiled=False, **kw):
    n = lax.psum(1, axis_name)
    if not tiled or kw or n == 1:
      return psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled,
                          **kw)
    i = lax.axis_index(axis_name)
    size = x.shape[scatter_dimension] // n

    def piece(j):
      return lax.dynamic_slice_in_dim(x, (j % n) * size, size, scatter_dimension)

    # after step s device i holds the sum over devices i-s..i of piece i-1-(n-1-s)
    acc = piece(i - 1)
    for s in range(1, n):
      acc = lax.ppermute(acc, axis_name, [(k, (k + 1) % n) for k in range(n)]) + piece(i - 1 - s)
    return acc

  mesh = aot.make_mesh(topology, shape)
  step, params, data = aot.model_step("gpt3", mesh, layers=1, batch=batch)
  rows = {}
  for name, scatter in (("xla (dense_async)", None), ("psum_scatter", psum_scatter),
                        ("all_to_all", "option"), ("ring", ring_scatter)):
    fn = step
    if scatter == "option":
      fn = meshslice.transform(step, algorithm="collective", reduce_scatter="all_to_all")
    elif scatter is not None:
      lax.psum_scatter = scatter
      fn = meshslice.transform(step, algorithm="collective")
    start = time.perf_counter()
    try:
      compiled, secs = aot.compile(fn, params, data, mesh=mesh)
    finally:
      lax.psum_scatter = psum_scatter
    row = aot.analyze(compiled, "tpu-v4", mesh_shape=shape, compile_s=secs).row()
    rows[name] = row
    print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

  best = rows["xla (dense_async)"]["step_s"]
  print(f"GPT-3 one layer, batch {batch}, {topology} as {'x'.join(map(str, shape))}, "
        f"jax {jax.__version__}; flags: {' '.join(flags)}")
  print("| variant | step ms | compute ms | exposed ms | sync / async collectives | "
        "coll GB | libtpu peak GiB | vs XLA |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for name, r in rows.items():
    print(f"| {name} | {r['step_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | "
          f"{r['exposed_s'] * 1e3:.1f} | {r['sync_collectives']} / {r['async_collectives']} | "
          f"{r['collective_bytes'] / 1e9:.2f} | {r['libtpu_peak_bytes'] / 2**30:.2f} | "
          f"{best / r['step_s']:.3f}x |")
  print("RESULT " + json.dumps({k: {f: v for f, v in r.items() if f != "flags"}
                                for k, r in rows.items()}, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
