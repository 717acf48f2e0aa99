"""Measured vs predicted: does the cost model order candidate plans the way the hardware
does?

For each site (one 2D-sharded matmul `x @ w` of shape m x n x k, for each dataflow's
layouts of docs/design.md) and each candidate plan (collective, meshslice with each
--ksplits value, and any --algorithms), the site is transformed with exactly that plan
(`strict=True`: a plan the site cannot take is skipped, with the reason) and timed; the
plan's predicted time comes from the report (`site.predicted_seconds`) under --profile,
ideally a profile calibrated on this machine (`python -m meshslice calibrate`).

Printed per site: measured and predicted time and their ranks, and the Spearman rank
correlation over that site's plans (1 = the model orders the plans exactly as measured,
-1 = exactly backwards); then the Spearman correlation over all (site, plan) pairs, the
mean of the per-site values, and how often the predicted-best plan is the measured-best.

A measured time is the median wall time of one call of the jitted program (repeats are
interleaved over the candidates so a shared machine's slow periods hit all of them);
it includes the dispatch of one call, a roughly constant offset that rank correlation
ignores. On CPU, collectives are synchronous memory copies, so no plan overlaps
communication with compute; the figures test the model's per-collective and per-GEMM
terms there, not the overlap.

  python bench/compare.py --profile /tmp/cpu.json             # 8 emulated CPU devices
  python bench/compare.py --mesh 4x4 --shapes 8192x8192x8192 --dtype bfloat16 \\
      --ksplits 2,4,8 --algorithms wang,summa,cannon --profile my-v4.json
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags

import cluster  # noqa: E402  (bench/cluster.py: shared flags)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

_MESH = flags.DEFINE_string("mesh", "2x4", "mesh shape RxC (axes r, c)")
_SHAPES = flags.DEFINE_list("shapes", ["256x256x256", "512x128x256"],
                            "sites as MxNxK (global sizes)")
_DATAFLOWS = flags.DEFINE_list("dataflows", ["os", "ls", "rs"], "dataflows to lay out")
_KSPLITS = flags.DEFINE_list("ksplits", ["2", "4"], "meshslice slice counts to try")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["wang", "summa"],
                                "further algorithms to try (ksplit 1)")
_PROFILE = flags.DEFINE_string("profile", "cpu", "hardware profile name or JSON path")
_DTYPE = flags.DEFINE_string("dtype", "float32", "element type")
_REPEATS = flags.DEFINE_integer("repeats", 20, "timed calls per plan (median)")
_OUT = flags.DEFINE_string("out", None, "write JSON lines here (one per plan, one summary)")

# Input layouts (x, w) per dataflow on axes (r, c); the output is always (M:r, N:c).
LAYOUTS = {"os": (P("r", "c"), P("r", "c")), "ls": (P("r", "c"), P("c", "r")),
           "rs": (P("c", "r"), P("r", "c"))}


def candidates(ksplits, algorithms) -> list[tuple[str, dict]]:
  """(label, transform options) of each plan, the collective algorithm first.

  Example:
    >>> [label for label, _ in candidates([2, 4], ["wang"])]
    ['collective', 'meshslice S=2', 'meshslice S=4', 'wang']
  """
  out = [("collective", {"algorithm": "collective"})]
  out += [(f"meshslice S={k}", {"algorithm": "meshslice", "ksplit": int(k)}) for k in ksplits]
  out += [(a, {"algorithm": a, "ksplit": 1}) for a in algorithms]
  return out


def site_program(mesh, dataflow, m, n, k, dtype):
  """The jitted `x @ w` with `dataflow`'s input layouts, and its sharded inputs."""
  lx, lw = LAYOUTS[dataflow]
  shard = lambda spec: NamedSharding(mesh, spec)
  f = jax.jit(lambda x, w: x @ w, in_shardings=(shard(lx), shard(lw)),
              out_shardings=shard(P("r", "c")))
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.device_put(jax.random.normal(kx, (m, k), jnp.float32).astype(dtype), shard(lx))
  w = jax.device_put(jax.random.normal(kw, (k, n), jnp.float32).astype(dtype), shard(lw))
  return f, x, w


@jax.jit
def _rel_error(out, reference):
  # on device: a replicated scalar every process can read (multi-host outputs are not)
  out, reference = out.astype(jnp.float32), reference.astype(jnp.float32)
  return jnp.max(jnp.abs(out - reference)) / (jnp.max(jnp.abs(reference)) + 1e-30)


def run(mesh, *, shapes, dataflows, plans, profile, dtype, repeats, echo=print) -> list[dict]:
  """One record per (site, plan) that can run: measured and predicted seconds."""
  import meshslice
  rows = []
  for shape in shapes:
    m, n, k = shape
    for dataflow in dataflows:
      f, x, w = site_program(mesh, dataflow, m, n, k, dtype)
      reference = f(x, w)
      built = []
      for label, options in plans:
        fast = meshslice.transform(f, profile=profile, strict=True, **options)
        try:
          site = fast.explain(x, w).sites[0]
        except ValueError as e:               # the plan cannot serve this site
          if echo:
            echo(f"  {m}x{n}x{k} {dataflow} {label}: skipped ({e})")
          continue
        if not site.rewritten or site.dataflow != dataflow:
          if echo:
            echo(f"  {m}x{n}x{k} {dataflow} {label}: skipped (site planned as "
                 f"{site.dataflow or 'left alone'}: {site.reason or site.note})")
          continue
        err = float(_rel_error(fast(x, w), reference))   # compiles, and checks the plan
        built.append((label, fast, site, err))
      times = {label: [] for label, *_ in built}
      for _ in range(repeats):                # interleaved: drifts hit every plan alike
        for label, fast, _, _ in built:
          start = time.perf_counter()
          jax.block_until_ready(fast(x, w))
          times[label].append(time.perf_counter() - start)
      for label, fast, site, err in built:
        rows.append({"record": "plan", "m": m, "n": n, "k": k, "dataflow": dataflow,
                     "plan": label, "algorithm": site.algorithm, "ksplit": site.ksplit,
                     "measured_s": statistics.median(times[label]),
                     "predicted_s": float(site.predicted_seconds),
                     "baseline_predicted_s": float(site.baseline_seconds),
                     "max_rel_error": err})
  return rows


def summarize(rows) -> dict:
  """Spearman rank correlations of measured vs predicted: over all rows, per site (mean),
  and the fraction of sites whose predicted-best plan is the measured-best.

  Example:
    >>> rows = [{"m": 1, "n": 1, "k": 1, "dataflow": "os", "measured_s": a, "predicted_s": b}
    ...         for a, b in ((1, 10), (2, 30), (3, 20))]
    >>> s = summarize(rows)
    >>> round(s["spearman_all"], 3), s["top1_agreement"]
    (0.5, 1.0)
  """
  from meshslice.costmodel.calibrate import spearman
  sites = {}
  for r in rows:
    sites.setdefault((r["m"], r["n"], r["k"], r["dataflow"]), []).append(r)
  per_site = {}
  top1 = []
  for key, group in sites.items():
    measured = [r["measured_s"] for r in group]
    predicted = [r["predicted_s"] for r in group]
    per_site["{}x{}x{} {}".format(*key)] = spearman(measured, predicted)
    top1.append(int(np.argmin(measured)) == int(np.argmin(predicted)))
  finite = [v for v in per_site.values() if np.isfinite(v)]
  return {"record": "summary",
          "spearman_all": spearman([r["measured_s"] for r in rows],
                                   [r["predicted_s"] for r in rows]),
          "spearman_per_site": per_site,
          "spearman_site_mean": float(np.mean(finite)) if finite else float("nan"),
          "top1_agreement": float(np.mean(top1)) if top1 else float("nan"),
          "sites": len(sites), "plans": len(rows)}


def render(rows, summary) -> str:
  from meshslice.costmodel.calibrate import rank
  lines = [f"{'site':<18}{'plan':<16}{'measured us':>12}{'predicted us':>13}"
           f"{'rank m/p':>10}"]
  sites = {}
  for r in rows:
    sites.setdefault((r["m"], r["n"], r["k"], r["dataflow"]), []).append(r)
  for key, group in sites.items():
    rm = rank([r["measured_s"] for r in group])
    rp = rank([r["predicted_s"] for r in group])
    name = "{}x{}x{} {}".format(*key)
    for r, a, b in zip(group, rm, rp):
      lines.append(f"{name:<18}{r['plan']:<16}{r['measured_s'] * 1e6:>12.1f}"
                   f"{r['predicted_s'] * 1e6:>13.1f}{a:>6g}/{b:<3g}")
    lines.append(f"{'':<18}{'spearman':<16}{summary['spearman_per_site'][name]:>12.2f}")
  lines.append(f"spearman over all {summary['plans']} (site, plan) pairs: "
               f"{summary['spearman_all']:.2f}; mean per site: "
               f"{summary['spearman_site_mean']:.2f}; predicted-best = measured-best on "
               f"{summary['top1_agreement'] * 100:.0f}% of {summary['sites']} sites")
  return "\n".join(lines)


def _finite(value):
  """NaN (an undefined correlation) as JSON null: NaN is not valid JSON."""
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def main(argv):
  del argv
  cluster.start()
  from meshslice.costmodel import load_profile
  r, c = (int(v) for v in _MESH.value.lower().split("x"))
  mesh = jax.make_mesh((r, c), ("r", "c"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:r * c])
  shapes = [tuple(int(v) for v in s.lower().split("x")) for s in _SHAPES.value]
  plans = candidates([int(k) for k in _KSPLITS.value], _ALGORITHMS.value)
  profile = load_profile(_PROFILE.value)
  lead = jax.process_index() == 0
  if lead:
    print(f"measured vs predicted on mesh {r}x{c} ({jax.devices()[0].platform}), profile "
          f"{profile.name}, {_DTYPE.value}, median of {_REPEATS.value} calls")
  rows = run(mesh, shapes=shapes, dataflows=_DATAFLOWS.value, plans=plans, profile=profile,
             dtype=_DTYPE.value, repeats=_REPEATS.value, echo=print if lead else None)
  summary = summarize(rows)
  if not lead:
    return
  print(render(rows, summary))
  if _OUT.value:
    common = {"mesh": [r, c], "profile": profile.name, "dtype": _DTYPE.value,
              "platform": jax.devices()[0].platform, "repeats": _REPEATS.value}
    with open(_OUT.value, "w", encoding="utf-8") as f:
      for row in rows + [summary]:
        f.write(json.dumps(_finite({**common, **row}), sort_keys=True) + "\n")
    print(f"{len(rows) + 1} records written to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
