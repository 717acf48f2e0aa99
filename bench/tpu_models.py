"""One model layer's programs for a TPU topology, each ratio under three cost models.

"Speed you can trust": a simulated speed-up is only as good as the model that priced it,
so this app compiles, in ONE process under one libtpu flag set (default
`dense,async,all_to_all`, `aot.preset_flags`), three programs of the same step
(`aot.model_step`: one layer fwd + bwd + SGD, bf16, one sequence per chip):

  xla      XLA's own program: plain `jax.jit` of the step (under the dense + async flags
           this is "dense_async", XLA's best program, docs/tpu.md)
  default  `meshslice.transform(step)`, the default plan
  tuned    tune's candidate "collective+all_to_all, ls ksplit=2": the plan of the
           "collective+all_to_all" candidate, frozen, with only its ls sites sliced in 2
           (`tune.SlicedSites`, built as `meshslice.tune` builds it)

and reads every compiled program under

  alpha-beta    `tpu_schedule.simulate` with the mesh's profile and axis_dims, exactly as
                `aot.analyze` does (its `simulation`)
  routed-links  `routed_links.simulate_routed(schedule, mesh, profile)`: per-link load
                of every collective routed over the torus (DESIGN.md, Dec 2026 facts)
  libtpu-lhs    libtpu's latency-hiding scheduler "Total cycles" (entry computation plus
                the bodies of `while` loops times their trips; `SCHEDULER_LOG_ENV` is set
                before libtpu loads and each compile's stderr captured). Its own units:
                a ranking signal, the ms shown beside it are nominal (cycles / clock).

It prints, per program: step / compute / exposed under each model, libtpu's peak memory,
then XLA / program per model (> 1: the program is faster), where each model's exposed
time goes (`Simulation.exposed_by`, the scheduler's wasted cycles by kind), and the
claim: the least favourable ratio over the models,

  least favourable: default X.XXXx, tuned Y.YYYx (model ...)

JSON lines (--out_dir/<model>_<topology>_<mesh>.jsonl): one per program with every
figure, one summary with the ratios; each carries jax / libtpu versions, flags, topology,
mesh, model and the command. The compiled HLO and the scheduler's log lines are kept
beside them (--save_hlo).

  python bench/tpu_models.py --model=gpt3 --topology=v4:8x8x4 --mesh=64x4 \\
      --out_dir=/tmp/models          # 3 compiles of 256 chips: ~5-15 min on 2 cores

--model also takes "custom:<heads>x<head_dim>" (e.g. custom:4x128, with --seq) for a
small layer (tests: v4:2x2x2 as 2x4).
"""
import json
import math
import os
import re
import sys
import time
from importlib.metadata import version

from absl import app, flags

import explain_accuracy

_MODEL = flags.DEFINE_string("model", "gpt3", "gpt3, megatron, or custom:<heads>x<head_dim>")
_TOPOLOGY = flags.DEFINE_string("topology", "v4:8x8x4", "TPU topology to compile for")
_MESH = flags.DEFINE_string("mesh", "64x4", "mesh shape RxC (axes x, y)")
_LAYERS = flags.DEFINE_integer("layers", 1, "transformer layers")
_BATCH = flags.DEFINE_integer("batch", 0, "sequences per step (default: one per chip)")
_SEQ = flags.DEFINE_integer("seq", 0, "sequence length (default: the model's; custom: 256)")
_FLAGS = flags.DEFINE_string("flags", "dense,async,all_to_all", "libtpu flag presets "
                             "(aot.preset_flags), set before libtpu loads")
_PROGRAMS = flags.DEFINE_list("programs", ["xla", "default", "tuned"],
                              "programs to compile, of xla, default, tuned (xla is needed "
                              "for the ratios)")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/models", "where the JSON lines, HLO and "
                               "scheduler logs go")
_SAVE_HLO = flags.DEFINE_bool("save_hlo", True, "keep each compiled program's HLO text")
_TOP = flags.DEFINE_integer("top", 4, "exposed-time groups printed per model")

PROGRAMS = ("xla", "default", "tuned")
MODELS = ("alpha-beta", "routed-links", "libtpu-lhs")
TUNED = "collective+all_to_all, ls ksplit=2"


def model_of(name: str, seq: int):
  """(model argument for aot.model_step, seq override): a preset name, or a ModelSpec
  for "custom:<heads>x<head_dim>"."""
  match = re.fullmatch(r"custom:(\d+)x(\d+)", name)
  if match:
    from meshslice.costmodel.autotune import ModelSpec
    return ModelSpec(name=name, heads=int(match.group(1)), head_dim=int(match.group(2)),
                     seq=seq or 256), None
  if name not in ("gpt3", "megatron"):
    raise app.UsageError(f"--model: {name!r} is not gpt3, megatron or "
                         "custom:<heads>x<head_dim>")
  return name, seq or None


def plans(step, params, data, mesh, profile: str) -> dict:
  """{program: transform options} for the rewritten programs: the default plan, and the
  tuned candidate's frozen plan (as meshslice.tune derives SlicedSites candidates)."""
  import importlib
  import jax
  import meshslice
  tune_module = importlib.import_module("meshslice.tune")   # meshslice.tune is the function
  out = {"default": {"profile": profile}}
  request = tune_module.CANDIDATES[TUNED]
  base_options = tune_module.CANDIDATES[request.base]
  with jax.set_mesh(mesh):
    report = meshslice.transform(step, profile=profile, **base_options).explain(params, data)
  plan = tune_module.frozen_plan(report)
  sliced = tune_module.sliced_plan(report, plan, request)
  if sliced is None:
    print(f"tuned: no {request.dataflow} site of {request.base!r} slices at ksplit "
          f"{request.ksplit}: the tuned program is its base plan")
  out["tuned"] = {"profile": profile, "plan": sliced or plan}
  return out


def describe(fn, params, data, mesh) -> tuple:
  """(the rewritten sites' decisions, counted; what explain predicts for the sites it
  priced against XLA, `explain_accuracy.predicted_by_explain`)."""
  import jax
  with jax.set_mesh(mesh):
    report = fn.explain(params, data)
  counts = report.plan_counts(reduce_scatter=True)
  decisions = [f"{n}x {k}" for k, n in counts.items()] + [
      f"{len(report.sites) - len(report.rewritten)} left to XLA"]
  return decisions, explain_accuracy.predicted_by_explain(report)


def read(compiled, seconds: float, log_text: str, mesh, shape, profile: str) -> dict:
  """Every figure of one compiled program under the three models."""
  from meshslice import aot
  from meshslice.costmodel import routed_links, tpu_schedule
  result = aot.analyze(compiled, profile, compile_s=seconds, mesh_shape=shape,
                       scheduler_log=log_text)
  schedule = result.schedule
  ab = result.simulation
  routed = routed_links.simulate_routed(schedule, mesh, profile)
  clock = tpu_schedule.CLOCK_HZ[profile]
  text = compiled.as_text()
  entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
  totals = tpu_schedule.read_scheduler_log(log_text)
  record = tpu_schedule.scheduler_entry(totals, entry.group(1) if entry else None)
  lhs = None
  if record is not None:
    loops = result.scheduler_loop_cycles or 0.0
    lhs = {"entry_cycles": record.cycles, "loop_cycles": loops,
           "cycles": record.cycles + loops, "wasted_cycles": record.wasted_cycles,
           "wasted_by_kind": dict(record.wasted_by_kind),
           "memory_peak_bytes": record.memory_peak_bytes,
           "nominal_step_s": (record.cycles + loops) / clock,
           "nominal_wasted_s": record.wasted_cycles / clock,
           "computations_logged": len(totals)}

  row = result.row()
  summary = {k: row[k] for k in ("compute_cycles", "dot_cycles", "copy_cycles",
                                 "relayout_copies", "collectives", "collective_bytes",
                                 "sync_collectives", "async_collectives",
                                 "windowed_einsum_loops")}
  return {"alpha-beta": ab.figures(), "routed-links": routed.figures(), "libtpu-lhs": lhs,
          "summary": summary, "loops": len([e for e in schedule.entries
                                            if isinstance(e, tpu_schedule.Loop)]),
          "libtpu_peak_bytes": result.libtpu_peak_bytes, "peak_bytes": result.peak_bytes,
          "temp_bytes": result.temp_bytes, "compile_s": seconds,
          "hlo_chars": len(text)}


def step_of(figures: dict, model: str):
  """The figure a model ranks programs by: seconds, or the scheduler's cycles."""
  m = figures.get(model)
  if not m:
    return None
  return m["cycles"] if model == "libtpu-lhs" else m["step_s"]


def ratios(records: dict) -> dict:
  """{program: {model: XLA / program}} (> 1: the program is faster than XLA's)."""
  out = {}
  xla = records.get("xla")
  for name, figures in records.items():
    if name == "xla" or xla is None:
      continue
    out[name] = {}
    for model in MODELS:
      a, b = step_of(xla, model), step_of(figures, model)
      out[name][model] = a / b if a and b else None
  return out


def least(by_model: dict):
  """(least favourable ratio, its model) over the models that gave one."""
  known = [(r, m) for m, r in by_model.items() if r is not None]
  return min(known) if known else (None, None)


def _mega(cycles: float) -> str:
  """Millions, one decimal where that keeps four digits, else four significant ones."""
  v = cycles / 1e6
  return f"{v:.1f}" if abs(v) >= 10 else f"{v:.4g}"


def table(records: dict) -> str:
  def ms(v):
    return "—" if v is None else f"{v * 1e3:.2f}"
  lines = ["| program | α-β step ms | α-β exposed ms | routed step ms | routed exposed ms "
           "| libtpu LHS Mcycles (nominal ms) | LHS wasted Mcycles | compute ms | "
           "libtpu peak GiB | compile s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name, f in records.items():
    ab, rt, lhs = f["alpha-beta"], f["routed-links"], f["libtpu-lhs"]
    lhs_text = ("—" if lhs is None else
                f"{_mega(lhs['cycles'])} ({ms(lhs['nominal_step_s'])})")
    wasted = "—" if lhs is None else _mega(lhs['wasted_cycles'])
    lines.append(f"| {name} | {ms(ab['step_s'])} | {ms(ab['exposed_s'])} | "
                 f"{ms(rt['step_s'])} | {ms(rt['exposed_s'])} | {lhs_text} | {wasted} | "
                 f"{ms(ab['compute_s'])} | {f['libtpu_peak_bytes'] / 2**30:.2f} | "
                 f"{f['compile_s']:.0f} |")
  return "\n".join(lines)


def ratio_table(by_program: dict) -> str:
  def x(v):
    return "—" if v is None else f"{v:.3f}x"
  lines = ["| program | XLA / program: alpha-beta | routed-links | libtpu-lhs | "
           "least favourable |", "|---|---:|---:|---:|---|"]
  for name, by_model in by_program.items():
    r, m = least(by_model)
    lines.append(f"| {name} | {x(by_model['alpha-beta'])} | {x(by_model['routed-links'])} "
                 f"| {x(by_model['libtpu-lhs'])} | {x(r)} ({m}) |")
  return "\n".join(lines)


def exposure(records: dict, top: int) -> str:
  lines = []
  for name, f in records.items():
    for model in ("alpha-beta", "routed-links"):
      s = f[model]
      groups = "; ".join(f"{label} {sec * 1e3:.2f} ms x{n}"
                         for label, sec, n in s["exposed_by"][:top])
      lines.append(f"  {name:<8} {model:<13} exposed {s['exposed_s'] * 1e3:7.2f} ms: "
                   f"{groups or 'nothing'}")
      lines.append(f"  {'':<8} {'':<13} {explain_accuracy.overlap(s)}")
    lhs = f["libtpu-lhs"]
    if lhs is not None:
      kinds = "; ".join(f"{k} {v / 1e6:.2f}M" for k, v in sorted(
          lhs["wasted_by_kind"].items(), key=lambda kv: -kv[1])[:top])
      lines.append(f"  {name:<8} {'libtpu-lhs':<13} wasted {_mega(lhs['wasted_cycles']):>7}M"
                   f" cycles of {_mega(lhs['cycles'])}M: {kinds or 'nothing'}")
  return "\n".join(lines)


def _lhs_lines(text: str) -> str:
  return "\n".join(l for l in text.splitlines() if "latency_hiding_scheduler" in l)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  wanted = [p.strip() for p in _PROGRAMS.value if p.strip()]
  unknown = [p for p in wanted if p not in PROGRAMS]
  if unknown or not wanted:
    raise app.UsageError(f"--programs: {unknown or wanted} not of {', '.join(PROGRAMS)}")
  from meshslice import aot
  try:
    generation, _ = aot.parse_topology(_TOPOLOGY.value)
    shape = tuple(int(v) for v in _MESH.value.split("x"))
  except ValueError as e:
    raise app.UsageError(f"--topology / --mesh: {e}") from None
  model_arg, seq = model_of(_MODEL.value, _SEQ.value)
  flag_list = aot.preset_flags(_FLAGS.value, generation.name)
  # libtpu reads these once, when it loads (the first topology): before anything else
  from meshslice.costmodel import tpu_schedule
  os.environ.update(tpu_schedule.SCHEDULER_LOG_ENV)
  aot.set_flags(*flag_list)
  import jax
  jax.config.update("jax_platforms", "cpu")        # the host runs nothing but the compiler
  import meshslice

  profile = generation.profile
  command = " ".join([sys.executable] + sys.argv)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  tag = f"{_MODEL.value}_{_TOPOLOGY.value}_{_MESH.value}".replace(":", "-")
  jsonl = os.path.join(_OUT_DIR.value, f"{tag}.jsonl")
  start = time.perf_counter()
  mesh = aot.make_mesh(_TOPOLOGY.value, shape)
  step, params, data = aot.model_step(model_arg, mesh, layers=_LAYERS.value,
                                      batch=_BATCH.value or None, seq=seq)
  common = {"model": _MODEL.value, "topology": _TOPOLOGY.value, "mesh": _MESH.value,
            "layers": _LAYERS.value, "batch": _BATCH.value or math.prod(shape),
            "seq": _SEQ.value or None, "dtype": "bfloat16", "profile": profile,
            "flag_presets": _FLAGS.value, "libtpu_flags": os.environ["LIBTPU_INIT_ARGS"],
            "jax": jax.__version__, "libtpu": version("libtpu"), "command": command}
  print(f"{_MODEL.value} on {_TOPOLOGY.value} as {_MESH.value}, {_LAYERS.value} layer(s), "
        f"bf16, batch {common['batch']}; jax {jax.__version__}, libtpu {common['libtpu']}; "
        f"flags {_FLAGS.value}: {common['libtpu_flags']}", flush=True)
  options = plans(step, params, data, mesh, profile) if set(wanted) - {"xla"} else {}
  records = {}
  with open(jsonl, "w") as out:
    for name in wanted:
      fn = step if name == "xla" else meshslice.transform(step, **options[name])
      decisions, predicted = ([], None) if name == "xla" else describe(fn, params, data, mesh)
      if decisions:
        print(f"{name}: {', '.join(decisions)}", flush=True)
      began = time.perf_counter()
      try:
        with tpu_schedule.capture_stderr() as log:
          compiled, seconds = aot.compile(fn, params, data, mesh=mesh)
      except Exception as e:           # e.g. out of memory on the chips: reported, not fatal
        reason = f"{type(e).__name__}: {str(e)[:2000]}"
        print(f"{name}: compile failed after {time.perf_counter() - began:.0f} s: "
              f"{reason}", flush=True)
        out.write(json.dumps({**common, "program": name, "error": reason,
                              "stderr_tail": log.text[-4000:]}) + "\n")
        out.flush()
        continue
      stem = os.path.join(_OUT_DIR.value, f"{tag}_{name}")
      if _SAVE_HLO.value:
        with open(stem + ".hlo", "w") as f:
          f.write(compiled.as_text())
      with open(stem + ".lhs.log", "w") as f:
        f.write(_lhs_lines(log.text) + "\n")
      figures = read(compiled, seconds, log.text, mesh, shape, profile)
      if predicted is not None and predicted["sites_compared"]:
        figures["explain"] = predicted      # a pinned plan (tuned) is not compared
      del compiled
      records[name] = figures
      ab, rt, lhs = figures["alpha-beta"], figures["routed-links"], figures["libtpu-lhs"]
      print(f"{name}: compiled in {seconds:.0f} s; alpha-beta {ab['step_s'] * 1e3:.2f} ms, "
            f"routed {rt['step_s'] * 1e3:.2f} ms, libtpu LHS "
            f"{'—' if lhs is None else _mega(lhs['cycles']) + 'M'}, "
            f"peak {figures['libtpu_peak_bytes'] / 2**30:.2f} GiB", flush=True)
      out.write(json.dumps({**common, "program": name, "plan": decisions,
                            **figures}) + "\n")
      out.flush()
    by_program = ratios(records)
    claims = {name: least(by_model) for name, by_model in by_program.items()}
    out.write(json.dumps({**common, "program": "summary", "ratios_xla_over_program":
                          by_program, "least_favourable": {
                              n: {"ratio": r, "model": m} for n, (r, m) in claims.items()},
                          "wall_s": time.perf_counter() - start}) + "\n")
  print(f"\n{_MODEL.value} on {_TOPOLOGY.value} as {_MESH.value}, jax {jax.__version__}, "
        f"libtpu {common['libtpu']}, flags {_FLAGS.value}; libtpu LHS: the scheduler's "
        "entry + loop-body cycles (its units; ms nominal at the chip clock)")
  print(table(records))
  print()
  print(ratio_table(by_program))
  print("\nwhere the exposed time goes:")
  print(exposure(records, _TOP.value))
  for name, figures in records.items():
    if "explain" in figures and "xla" in records:
      told = explain_accuracy.versus_compiled(records["xla"], figures,
                                              ("alpha-beta", "routed-links"))
      print(f"{name}: {told}")
  if claims:
    parts = [f"{n} {'—' if r is None else format(r, '.3f') + 'x'}"
             for n, (r, _) in claims.items()]
    which = ", ".join(f"{n}: {m}" for n, (_, m) in claims.items())
    print(f"\nleast favourable: {', '.join(parts)} (model {which})")
  print(f"wall {time.perf_counter() - start:.0f} s; JSON lines: {jsonl}")


if __name__ == "__main__":
  app.run(main)
