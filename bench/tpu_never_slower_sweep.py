"""The never-slower promise over a grid of layer steps: for every (model, sequence length,
mesh) of one TPU topology, XLA's own program (plain `jax.jit` of the step) and
`meshslice.transform(step)`'s default plan, both compiled in ONE process under one libtpu
flag set (so the promise's "under the same compiler flags" holds by construction), each
read under both time models (alpha-beta: `aot.analyze`'s simulation; routed links:
`routed_links.simulate_routed`). A row whose least favourable ratio XLA / plan falls
below --tolerance is marked BROKEN: the default plan compiled slower than XLA there.

The step is `aot.model_step`'s (one GPT-style layer fwd + bwd + SGD, bf16, one sequence
per chip unless --batch_per_chip says otherwise). --models takes the presets gpt3 and
megatron, and "custom:<heads>x<head_dim>" for smaller hidden sizes.

  python bench/tpu_never_slower_sweep.py --topology=v4:4x4x4 \\
      --meshes=16x4,8x8,32x2,64x1 --models=gpt3,custom:32x128 --seqs=2048,256
  # ~20-60 s a compile at 64 chips on 2 cores; two compiles a row

It prints one line a row as it goes, then a table, and writes one JSON line a row to
--out (jax / libtpu versions, flags, topology, mesh, model, seq, batch, the plan's
decisions, both models' figures, the command). A compile that fails (memory, an
unsupported shape) is reported with its reason and the sweep goes on.
"""
import json
import math
import os
import re
import sys
import time
from importlib.metadata import version

from absl import app, flags

_TOPOLOGY = flags.DEFINE_string("topology", "v4:4x4x4", "TPU topology to compile for")
_MESHES = flags.DEFINE_list("meshes", ["16x4", "8x8", "32x2", "64x1"],
                            "mesh shapes RxC (axes x, y) whose product is the device count")
_MODELS = flags.DEFINE_list("models", ["gpt3", "custom:32x128"],
                            "gpt3, megatron, or custom:<heads>x<head_dim>")
_SEQS = flags.DEFINE_list("seqs", ["2048", "256"], "tokens per sequence")
_BATCH_PER_CHIP = flags.DEFINE_integer("batch_per_chip", 1, "sequences per device")
_FLAGS = flags.DEFINE_string("flags", "dense,async,all_to_all", "libtpu flag presets "
                             "(aot.preset_flags), set before libtpu loads")
_TOLERANCE = flags.DEFINE_float("tolerance", 0.995, "least favourable XLA / plan below "
                                "this is a broken promise")
_OUT = flags.DEFINE_string("out", "/tmp/never_slower_sweep.jsonl", "JSON lines, one a row")
_PROFILE = flags.DEFINE_string("profile", None, "the profile the default plan is made with "
                               "(default: none named, what meshslice.transform picks for "
                               "the mesh); the simulation uses the generation's")

MODELS = ("alpha-beta", "routed-links")


def model_argument(name: str, seq: int):
  """What `aot.model_step` takes for `name`: a preset name or a ModelSpec."""
  match = re.fullmatch(r"custom:(\d+)x(\d+)", name)
  if match:
    from meshslice.costmodel.autotune import ModelSpec
    return ModelSpec(name=name, heads=int(match.group(1)), head_dim=int(match.group(2)),
                     seq=seq)
  if name not in ("gpt3", "megatron"):
    raise app.UsageError(f"--models: {name!r} is not gpt3, megatron or "
                         "custom:<heads>x<head_dim>")
  return name


def simulate(compiled, seconds: float, mesh, shape, profile: str) -> dict:
  """{model: step, compute and exposed seconds} of one compiled program."""
  from meshslice import aot
  from meshslice.costmodel import routed_links
  result = aot.analyze(compiled, profile, compile_s=seconds, mesh_shape=shape)
  routed = routed_links.simulate_routed(result.schedule, mesh, profile)
  out = {}
  for model, sim in (("alpha-beta", result.simulation), ("routed-links", routed)):
    out[model] = {"step_s": sim.step_s, "compute_s": sim.compute_s,
                  "exposed_s": sim.exposed_s}
  out["libtpu_peak_bytes"] = result.libtpu_peak_bytes
  out["compile_s"] = seconds
  return out


def least_favourable(xla: dict, plan: dict) -> tuple:
  """(min over the models of XLA's step / the plan's, that model)."""
  return min((xla[m]["step_s"] / plan[m]["step_s"], m) for m in MODELS)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from meshslice import aot
  try:
    generation, _ = aot.parse_topology(_TOPOLOGY.value)
    shapes = [tuple(int(v) for v in m.split("x")) for m in _MESHES.value]
    seqs = [int(s) for s in _SEQS.value]
  except ValueError as e:
    raise app.UsageError(f"--topology / --meshes / --seqs: {e}") from None
  # libtpu reads its flags once, when it loads: before anything else touches jax
  aot.set_flags(*aot.preset_flags(_FLAGS.value, generation.name))
  import jax
  jax.config.update("jax_platforms", "cpu")        # the host runs nothing but the compiler
  import meshslice

  profile = generation.profile
  common = {"topology": _TOPOLOGY.value, "flag_presets": _FLAGS.value,
            "plan_profile": _PROFILE.value or "default",
            "libtpu_flags": os.environ.get("LIBTPU_INIT_ARGS", ""), "profile": profile,
            "jax": jax.__version__, "libtpu": version("libtpu"),
            "command": " ".join([sys.executable] + sys.argv)}
  print(f"{_TOPOLOGY.value}; jax {jax.__version__}, libtpu {common['libtpu']}; flags "
        f"{_FLAGS.value}: {common['libtpu_flags']}", flush=True)
  rows = []
  with open(_OUT.value, "w") as out:
    for name in _MODELS.value:
      for seq in seqs:
        for shape in shapes:
          row = {**common, "model": name, "seq": seq, "mesh": "x".join(map(str, shape)),
                 "batch": _BATCH_PER_CHIP.value * math.prod(shape)}
          began = time.perf_counter()
          try:
            mesh = aot.make_mesh(_TOPOLOGY.value, shape)
            step, params, data = aot.model_step(model_argument(name, seq), mesh,
                                                batch=row["batch"], seq=seq)
            fn = meshslice.transform(step, **({"profile": _PROFILE.value}
                                              if _PROFILE.value else {}))
            with jax.set_mesh(mesh):
              report = fn.explain(params, data)
            row["plan"] = {k: n for k, n in report.plan_counts(reduce_scatter=True).items()}
            row["left_to_xla"] = len(report.sites) - len(report.rewritten)
            for program, f in (("xla", step), ("default", fn)):
              if program == "default" and not report.rewritten:
                row[program] = row["xla"]        # nothing rewritten: XLA's program
                continue
              compiled, seconds = aot.compile(f, params, data, mesh=mesh)
              row[program] = simulate(compiled, seconds, mesh, shape, profile)
              del compiled
            ratio, model = least_favourable(row["xla"], row["default"])
            row["least_favourable"] = {"ratio": ratio, "model": model}
            row["broken"] = ratio < _TOLERANCE.value
          except Exception as e:    # out of memory, a shape the model cannot take: reported
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
          row["wall_s"] = time.perf_counter() - began
          rows.append(row)
          out.write(json.dumps(row) + "\n")
          out.flush()
          print(line(row), flush=True)
  print("\n| model | seq | mesh | rewritten | XLA alpha-beta / routed ms | plan alpha-beta "
        "/ routed ms | XLA / plan, least favourable |\n|---|---:|---|---|---:|---:|---:|")
  for row in rows:
    print(table_row(row))
  broken = [r for r in rows if r.get("broken")]
  print(f"\n{len(broken)} of {len(rows)} rows broken (least favourable below "
        f"{_TOLERANCE.value}); {sum('error' in r for r in rows)} failed to compile")


def _rewritten(row: dict) -> str:
  plan = row.get("plan") or {}
  return ", ".join(f"{n}x {k}" for k, n in plan.items()) or "nothing"


def line(row: dict) -> str:
  head = f"{row['model']} seq {row['seq']} {row['mesh']}"
  if "error" in row:
    return f"{head}: FAILED {row['error'][:300]}"
  x, p = row["xla"], row["default"]
  lf = row["least_favourable"]
  mark = "  BROKEN" if row["broken"] else ""
  return (f"{head}: {_rewritten(row)}; XLA {x['alpha-beta']['step_s'] * 1e3:.2f} / "
          f"{x['routed-links']['step_s'] * 1e3:.2f} ms, plan "
          f"{p['alpha-beta']['step_s'] * 1e3:.2f} / {p['routed-links']['step_s'] * 1e3:.2f}"
          f" ms: {lf['ratio']:.3f}x ({lf['model']}){mark}  [{row['wall_s']:.0f} s]")


def table_row(row: dict) -> str:
  if "error" in row:
    return f"| {row['model']} | {row['seq']} | {row['mesh']} | compile failed | | | |"
  x, p, lf = row["xla"], row["default"], row["least_favourable"]
  ms = lambda f: f"{f['alpha-beta']['step_s'] * 1e3:.2f} / {f['routed-links']['step_s'] * 1e3:.2f}"
  mark = " **broken**" if row["broken"] else ""
  return (f"| {row['model']} | {row['seq']} | {row['mesh']} | {_rewritten(row)} | {ms(x)} | "
          f"{ms(p)} | {lf['ratio']:.3f}x ({lf['model']}){mark} |")


if __name__ == "__main__":
  app.run(main)
