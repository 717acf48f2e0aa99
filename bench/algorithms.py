"""Every distributed-GEMM algorithm of meshslice.rewrites on GPT-3-shaped sites, on the
emulated 8-device CPU mesh.

The sites are the four feed-forward GEMMs of a transformer layer (docs/costmodel.md),
Y[T, N] = X[T, K] . W[K, N] with T tokens and hidden size H scaled down to CPU size:

  qkv H -> 3H,  attn_out H -> H,  mlp_up H -> 4H,  mlp_down 4H -> H

For each mesh, site, dataflow (os, ls, rs: the layouts of docs/design.md) and
algorithm it builds `jax.jit(jax.shard_map(build_body(...)))`, checks the result equals
`x @ w`, and prints one row:

  colls     collectives one call executes (while loops count every trip)
  MB/dev    bytes each device moves, from the compiled HLO (meshslice.hlo)
  bytes     MB/dev relative to the `collective` algorithm of the same site and dataflow
  ms        CPU wall time of one call, median of --repeats after --warmup calls
  time      ms relative to plain `jax.jit(lambda x, w: x @ w)` with the same input and
            output shardings (the `gspmd` row; its bytes column compares GSPMD's own
            partitioning with `collective`)
  check     "ok", or the largest error relative to max |x @ w|

CPU collectives are synchronous and the 8 devices share the host's cores, so the time
column shows slicing / ring overhead, never the overlap benefit (docs/design.md).

  python bench/algorithms.py                                    # defaults: H=256, T=1024
  python bench/algorithms.py --hidden=32 --tokens=64 --meshes=2x2 --sites=mlp_up \
      --ksplits=2 --repeats=1 --warmup=0                        # tiny (the test's run)
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from meshslice.hlo import collective_stats  # noqa: E402
from meshslice.rewrites import build_body, plain_gemm  # noqa: E402

HIDDEN = flags.DEFINE_integer("hidden", 256, "hidden size H (GPT-3: 12288)")
TOKENS = flags.DEFINE_integer("tokens", 1024, "tokens T = rows of X")
MESHES = flags.DEFINE_list("meshes", ["2x4", "2x2"], "mesh shapes RxC (R*C <= 8)")
SITES = flags.DEFINE_list("sites", ["qkv", "attn_out", "mlp_up", "mlp_down"], "sites")
DATAFLOWS = flags.DEFINE_list("dataflows", ["os", "ls", "rs"], "dataflows")
KSPLITS = flags.DEFINE_list("ksplits", ["2", "4"], "meshslice slice counts S")
REPEATS = flags.DEFINE_integer("repeats", 10, "timed calls per row (median)")
WARMUP = flags.DEFINE_integer("warmup", 2, "untimed calls per row after compiling")

# (K, N) of each site in units of H.
SITE_SHAPES = {"qkv": (1, 3), "attn_out": (1, 1), "mlp_up": (1, 4), "mlp_down": (4, 1)}

# Y[M, N] = X[M, K] . W[K, N] is laid out per dataflow by `rewrites.plain_gemm`
# (geometry.py's table); the output is always P(x, y).
OUT_SPEC = P("x", "y")


def variants(ksplits):
  """(row name, algorithm, ksplit, options) of every algorithm measured.

  >>> [v[0] for v in variants([2])]
  ['collective', 'meshslice-s2', 'cannon', 'wang', 'wang-bidi', 'summa']
  """
  return ([("collective", "collective", 1, {})]
          + [(f"meshslice-s{s}", "meshslice", s, {}) for s in ksplits]
          + [("cannon", "cannon", 1, {}), ("wang", "wang", 1, {}),
             ("wang-bidi", "wang", 1, dict(bidirectional=True)), ("summa", "summa", 1, {})])


def _mesh(shape):
  n = shape[0] * shape[1]
  return jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:n])


def _median_ms(fn, args, warmup, repeats):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(max(repeats, 1)):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def _error(out, ref):
  """Largest |out - ref| relative to max |ref| (f32 sums in another order: ~1e-6)."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def measure(fn, args, ref, warmup, repeats):
  """{'colls', 'bytes', 'ms', 'error'} of one jitted function."""
  compiled = fn.lower(*args).compile()       # time what was inspected; compile once
  stats = collective_stats(compiled.as_text())
  error = _error(compiled(*args), ref)
  return {"colls": sum(stats["count"].values()), "bytes": stats["total_bytes"],
          "ms": _median_ms(compiled, args, warmup, repeats), "error": error}


def run_site(shape, site, dataflow, hidden, tokens, ksplits, warmup, repeats):
  """Rows (dicts) of every algorithm for one (mesh, site, dataflow); algorithms that
  cannot serve the site (e.g. cannon on a non-square mesh) are skipped."""
  mesh = _mesh(shape)
  k_mult, n_mult = SITE_SHAPES[site]
  dims = {"M": tokens, "K": k_mult * hidden, "N": n_mult * hidden}
  geometry, lhs_axes, rhs_axes = plain_gemm(dataflow, dims["M"], dims["K"], dims["N"],
                                            shape[0], shape[1], jnp.dtype(jnp.float32))
  lhs_spec, rhs_spec = P(*lhs_axes), P(*rhs_axes)
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (dims["M"], dims["K"]), jnp.float32)
  w = jax.random.normal(kw, (dims["K"], dims["N"]), jnp.float32)
  ref = np.asarray(jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
  args = (jax.device_put(x, NamedSharding(mesh, lhs_spec)),
          jax.device_put(w, NamedSharding(mesh, rhs_spec)))
  base = dict(mesh=f"{shape[0]}x{shape[1]}", site=site, dataflow=dataflow)
  plain = jax.jit(lambda a, b: a @ b, in_shardings=tuple(a.sharding for a in args),
                  out_shardings=NamedSharding(mesh, OUT_SPEC))
  rows = [dict(base, algorithm="gspmd", **measure(plain, args, ref, warmup, repeats))]
  for name, algorithm, ksplit, options in variants(ksplits):
    try:
      body = build_body(algorithm, geometry, ksplit, **options)
    except ValueError as e:     # cannot serve this site: skip (cannon off-square quietly)
      if "square mesh" not in str(e):
        print(f"# skipped {name} on {base['mesh']} {site} {dataflow}: {e}")
      continue
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(lhs_spec, rhs_spec),
                               out_specs=OUT_SPEC))
    rows.append(dict(base, algorithm=name, **measure(fn, args, ref, warmup, repeats)))
  coll = next(r["bytes"] for r in rows if r["algorithm"] == "collective")
  for r in rows:
    r["bytes_ratio"] = r["bytes"] / coll if coll else float("nan")
    r["time_ratio"] = r["ms"] / rows[0]["ms"]
  return rows


COLUMNS = ("mesh", "site", "flow", "algorithm", "colls", "MB/dev", "bytes", "ms", "time",
           "check")


def format_table(rows, tolerance=1e-4):
  """The rows as a whitespace-separated table, one line per row after a header.

  >>> print(format_table([dict(mesh="2x2", site="qkv", dataflow="os",
  ...     algorithm="collective", colls=2, bytes=2e6, bytes_ratio=1.0, ms=3.0,
  ...     time_ratio=1.5, error=1e-7)]))           # doctest: +NORMALIZE_WHITESPACE
  mesh site flow algorithm colls MB/dev bytes ms time check
  2x2 qkv os collective 2 2.000 1.00x 3.00 1.50x ok
  """
  widths = (5, 9, 5, 13, 6, 9, 7, 9, 7, 10)
  lines = ["".join(f"{c:<{w}}" for c, w in zip(COLUMNS, widths)).rstrip()]
  for r in rows:
    check = "ok" if r["error"] <= tolerance else f"ERR{r['error']:.1e}"
    cells = (r["mesh"], r["site"], r["dataflow"], r["algorithm"], str(r["colls"]),
             f"{r['bytes'] / 1e6:.3f}", f"{r['bytes_ratio']:.2f}x", f"{r['ms']:.2f}",
             f"{r['time_ratio']:.2f}x", check)
    lines.append("".join(f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip())
  return "\n".join(lines)


def main(argv):
  del argv
  shapes = [tuple(int(v) for v in m.split("x")) for m in MESHES.value]
  ksplits = [int(s) for s in KSPLITS.value]
  print(f"sites: T={TOKENS.value} tokens, H={HIDDEN.value}, float32; "
        f"{jax.device_count()} CPU devices; median of {REPEATS.value} calls after "
        f"{WARMUP.value} warm-up")
  rows = []
  for shape in shapes:
    for site in SITES.value:
      for dataflow in DATAFLOWS.value:
        rows += run_site(shape, site, dataflow, HIDDEN.value, TOKENS.value, ksplits,
                         WARMUP.value, REPEATS.value)
  print(format_table(rows))
  print("bytes: vs collective (same site, dataflow); time: vs plain jax.jit (gspmd row)")
  return 1 if any(r["error"] > 1e-4 for r in rows) else 0


if __name__ == "__main__":
  app.run(main)
