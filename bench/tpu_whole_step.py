"""A WHOLE training step for a TPU topology, XLA's program against meshslice's, under two
link models.

Every other TPU figure is one transformer layer with one scan trip. This app compiles,
ahead of time with libtpu in ONE process under one flag set (default
`dense,async,all_to_all`, `aot.preset_flags`, set before libtpu loads), the whole step
of `meshslice.whole_step` (one-hot token embedding, --layers checkpointed layers in a
`lax.scan`, logits + softmax cross-entropy, Adam with float32 moments; bf16 params; one
sequence per chip unless --batch) as

  xla        plain `jax.jit` of the step (under dense + async: XLA's dense_async program)
  meshslice  `meshslice.transform(step)`, the default plan for the topology's profile

and reads each compiled schedule (`aot.analyze`: `costmodel.tpu_schedule`) under

  alpha-beta    `tpu_schedule.simulate`, links derived for the mesh (`aot.analyze`'s
                simulation, as the project's other TPU tables)
  routed-links  `routed_links.simulate_routed(schedule, mesh, profile)`: every collective
                routed over the torus, per-link load

and, beside them, libtpu's latency-hiding scheduler's own totals (its log captured from
each compile's stderr): the entry computation's, and that plus the loop bodies times
their trips; its own units, so only their ratios are printed.

It prints per program and model: step, compute, exposed (ms), libtpu's peak memory, the
compile time, and XLA / program (> 1: faster than XLA), the least favourable over the
two models as the claim. JSON lines go to --out_dir (one per program, one summary), with
jax / libtpu versions, flags, topology, mesh, model, layers and the command.

  python bench/tpu_whole_step.py                 # gpt3, 4 layers, v4:8x8x4 as 64x4
  python bench/tpu_whole_step.py --model=llama70b --layers=4 --batch=64
  python bench/tpu_whole_step.py --model=tiny --topology=v4:2x2x2 --mesh=2x4  # seconds
"""
import json
import math
import os
import sys
import time
from importlib.metadata import version

from absl import app, flags

import explain_accuracy

_MODEL = flags.DEFINE_string("model", "gpt3", "a meshslice.whole_step preset: gpt3, "
                             "megatron, llama70b, tiny, tiny_llama")
_TOPOLOGY = flags.DEFINE_string("topology", "v4:8x8x4", "TPU topology to compile for")
_MESH = flags.DEFINE_string("mesh", "64x4", "mesh shape RxC (axes x, y)")
_LAYERS = flags.DEFINE_integer("layers", 4, "layers in the scan (>= 4: steady state)")
_BATCH = flags.DEFINE_integer("batch", 0, "sequences per step (0: one per device)")
_SEQ = flags.DEFINE_integer("seq", 0, "tokens per sequence (0: the preset's)")
_DTYPE = flags.DEFINE_string("dtype", "", "param dtype (default: the preset's; bf16 at "
                             "scale)")
_FLAGS = flags.DEFINE_string("flags", "dense,async,all_to_all", "libtpu flag presets "
                             "(aot.preset_flags), set before libtpu loads")
_PROGRAMS = flags.DEFINE_list("programs", ["xla", "meshslice"], "of xla, meshslice (xla "
                              "is needed for the ratios)")
_OPTIONS = flags.DEFINE_string("options", "{}", "JSON of meshslice.transform options for "
                               "the meshslice program (default: the default plan)")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/whole_step", "where the JSON lines (and "
                               "HLO with --save_hlo) go")
_SAVE_HLO = flags.DEFINE_bool("save_hlo", False, "keep each compiled program's HLO text")
_TOP = flags.DEFINE_integer("top", 3, "exposed-time groups printed per program and model")

PROGRAMS = ("xla", "meshslice")
MODELS = ("alpha-beta", "routed-links")


def read(compiled, seconds: float, mesh, shape, profile: str,
         scheduler_log: str | None = None) -> dict:
  """One compiled program's figures under both link models, and libtpu's scheduler
  total when `scheduler_log` (the compile's stderr) holds it."""
  from meshslice import aot
  from meshslice.costmodel import routed_links
  result = aot.analyze(compiled, profile, compile_s=seconds, mesh_shape=shape,
                       scheduler_log=scheduler_log)
  routed = routed_links.simulate_routed(result.schedule, mesh, profile)
  lhs = None
  if result.scheduler_cycles is not None:
    # The entry computation's total counts a loop as one node: "cycles" adds the loop
    # bodies x trips. On GPT-3 / Llama whole steps that sum is 65-110x the simulated
    # step (2026-12-05), so it is not trusted there: no "nominal_step_s" is written
    # (bench/plot_results.py plots libtpu's totals only where a record has one).
    cycles = result.scheduler_cycles + (result.scheduler_loop_cycles or 0.0)
    lhs = {"entry_cycles": result.scheduler_cycles,
           "loop_cycles": result.scheduler_loop_cycles, "cycles": cycles,
           "wasted_cycles": result.scheduler_wasted_cycles}

  row = result.row()
  keep = ("compute_cycles", "dot_cycles", "copy_cycles", "relayout_copies", "collectives",
          "collective_bytes", "sync_collectives", "async_collectives",
          "windowed_einsum_loops", "peak_bytes", "temp_bytes", "libtpu_peak_bytes")
  return {"alpha-beta": result.simulation.figures(), "routed-links": routed.figures(),
          "libtpu-lhs": lhs, **{k: row[k] for k in keep}, "compile_s": seconds,
          "hlo_chars": len(compiled.as_text())}


def ratios(records: dict) -> dict:
  """{program: {model: XLA step / program step}} for every program but xla."""
  xla = records.get("xla")
  return {name: {m: (xla[m]["step_s"] / f[m]["step_s"] if xla and f[m]["step_s"] else None)
                 for m in MODELS}
          for name, f in records.items() if name != "xla"}


def table(records: dict, by_program: dict) -> str:
  ms = lambda v: f"{v * 1e3:.2f}"
  lines = ["| program | model | step ms | compute ms | exposed ms | XLA / program | "
           "libtpu peak GiB | compile s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
  for name, f in records.items():
    for m in MODELS:
      s = f[m]
      r = by_program.get(name, {}).get(m)
      ratio = "1 (base)" if name == "xla" else "—" if r is None else f"{r:.3f}x"
      lines.append(f"| {name} | {m} | {ms(s['step_s'])} | {ms(s['compute_s'])} | "
                   f"{ms(s['exposed_s'])} | {ratio} | "
                   f"{f['libtpu_peak_bytes'] / 2**30:.2f} | {f['compile_s']:.0f} |")
  return "\n".join(lines)


def exposure(records: dict, top: int) -> str:
  lines = []
  for name, f in records.items():
    for m in MODELS:
      s = f[m]
      groups = "; ".join(f"{label} {sec * 1e3:.2f} ms x{n}"
                         for label, sec, n in s["exposed_by"][:top])
      lines.append(f"  {name:<9} {m:<12} exposed {s['exposed_s'] * 1e3:8.2f} ms: "
                   f"{groups or 'nothing'}")
      lines.append(f"  {'':<9} {'':<12} {explain_accuracy.overlap(s)}")
  return "\n".join(lines)


def decisions(report) -> str:
  return ", ".join(f"{n}x {k}" for k, n in report.plan_counts().items())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  wanted = [p.strip() for p in _PROGRAMS.value if p.strip()]
  if not wanted or set(wanted) - set(PROGRAMS):
    raise app.UsageError(f"--programs: {wanted} not of {', '.join(PROGRAMS)}")
  from meshslice.options import options_from_json
  try:
    options = options_from_json(_OPTIONS.value, "--options")
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  from meshslice import aot
  try:
    generation, _ = aot.parse_topology(_TOPOLOGY.value)
    shape = tuple(int(v) for v in _MESH.value.split("x"))
  except ValueError as e:
    raise app.UsageError(f"--topology / --mesh: {e}") from None
  # libtpu reads its flags once, when it loads (the first topology): before anything else;
  # its scheduler then logs its own step estimate to stderr, captured per compile
  from meshslice.costmodel import tpu_schedule
  os.environ.update(tpu_schedule.SCHEDULER_LOG_ENV)
  aot.set_flags(*aot.preset_flags(_FLAGS.value, generation.name))
  import jax
  jax.config.update("jax_platforms", "cpu")        # the host runs nothing but the compiler
  import meshslice
  from meshslice import whole_step

  profile = generation.profile
  start = time.perf_counter()
  mesh = aot.make_mesh(_TOPOLOGY.value, shape)
  try:
    step, params, opt, data = whole_step.whole_step(
        _MODEL.value, mesh, layers=_LAYERS.value, batch=_BATCH.value or None,
        seq=_SEQ.value or None, dtype=_DTYPE.value or None)
  except ValueError as e:
    raise app.UsageError(f"--model / --layers / --batch / --seq: {e}") from None
  cfg = whole_step.config(_MODEL.value, layers=_LAYERS.value,
                          batch=_BATCH.value or math.prod(shape), seq=_SEQ.value or None,
                          dtype=_DTYPE.value or None)
  common = {"model": _MODEL.value, "topology": _TOPOLOGY.value, "mesh": _MESH.value,
            "layers": cfg.layers, "batch": cfg.batch, "seq": cfg.seq, "vocab": cfg.vocab,
            "dtype": cfg.dtype, "moments": "float32", "profile": profile,
            "flag_presets": _FLAGS.value, "libtpu_flags": os.environ["LIBTPU_INIT_ARGS"],
            "options": options, "jax": jax.__version__, "libtpu": version("libtpu"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
  head = (f"whole step: {cfg.name} ({cfg.kind}, hidden {cfg.hidden}, {cfg.heads} heads"
          f"{f' / {cfg.kv} KV' if cfg.kv != cfg.heads else ''}, ffn {cfg.ffn}, vocab "
          f"{cfg.vocab}), {cfg.layers} layers, batch {cfg.batch} x seq {cfg.seq}, "
          f"{cfg.dtype} params + f32 Adam moments; {_TOPOLOGY.value} as {_MESH.value}; "
          f"jax {jax.__version__}, libtpu {common['libtpu']}; flags {_FLAGS.value}: "
          f"{common['libtpu_flags']}")
  print(head, flush=True)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  tag = f"{cfg.name}_L{cfg.layers}_{_TOPOLOGY.value}_{_MESH.value}".replace(":", "-")
  jsonl = os.path.join(_OUT_DIR.value, f"{tag}.jsonl")
  records = {}
  with open(jsonl, "w") as out:
    for name in wanted:
      fn = step
      plan = ""
      if name == "meshslice":
        fn = meshslice.transform(step, **{"profile": profile, **options})
        with jax.set_mesh(mesh):
          report = fn.explain(params, opt, data)
        plan = f"{report.summary()}; rewritten: {decisions(report)}"
        predicted = explain_accuracy.predicted_by_explain(report)
        print(f"meshslice plan: {plan}", flush=True)
      began = time.perf_counter()
      try:
        with tpu_schedule.capture_stderr() as log:
          compiled, seconds = aot.compile(fn, params, opt, data, mesh=mesh)
      except Exception as e:           # e.g. out of HBM on the chips: reported, not fatal
        reason = f"{type(e).__name__}: {str(e)[:2000]}"
        print(f"{name}: compile failed after {time.perf_counter() - began:.0f} s: {reason}",
              flush=True)
        out.write(json.dumps({**common, "program": name, "error": reason}) + "\n")
        out.flush()
        continue
      if _SAVE_HLO.value:
        with open(os.path.join(_OUT_DIR.value, f"{tag}_{name}.hlo"), "w") as f:
          f.write(compiled.as_text())
      figures = read(compiled, seconds, mesh, shape, profile, log.text)
      if name == "meshslice":
        figures["explain"] = predicted
      del compiled
      records[name] = figures
      print(f"{name}: compiled in {seconds:.0f} s; alpha-beta "
            f"{figures['alpha-beta']['step_s'] * 1e3:.2f} ms, routed "
            f"{figures['routed-links']['step_s'] * 1e3:.2f} ms, libtpu peak "
            f"{figures['libtpu_peak_bytes'] / 2**30:.2f} GiB", flush=True)
      out.write(json.dumps({**common, "program": name, "plan": plan, **figures}) + "\n")
      out.flush()
    by_program = ratios(records)
    least = {n: min(((r, m) for m, r in by.items() if r is not None), default=(None, None))
             for n, by in by_program.items()}
    out.write(json.dumps({**common, "program": "summary", "ratios_xla_over_program":
                          by_program, "least_favourable": {
                              n: {"ratio": r, "model": m} for n, (r, m) in least.items()},
                          "wall_s": time.perf_counter() - start}) + "\n")
  print()
  print(head)
  print(table(records, by_program))
  print("\nwhere the exposed time goes:")
  print(exposure(records, _TOP.value))
  for n, (r, m) in least.items():
    print(f"\nleast favourable: {n} {'—' if r is None else format(r, '.3f') + 'x'} vs XLA "
          f"({m})")
  for key, what in (("entry_cycles", "the entry computation"),
                    ("cycles", "entry + loop bodies x trips")):
    lhs = {n: (f.get("libtpu-lhs") or {}).get(key) for n, f in records.items()}
    if lhs.get("xla"):
      print(f"libtpu's scheduler ({what}; its own cycles, units unverified): " + ", ".join(
          f"{n} {c / 1e6:.1f}M" + ("" if n == "xla" or not c else
                                   f" (XLA / {n} {lhs['xla'] / c:.3f}x)")
          for n, c in lhs.items() if c))
  if "xla" in records and "explain" in records.get("meshslice", {}):
    print(explain_accuracy.versus_compiled(records["xla"], records["meshslice"], MODELS))
  print(f"wall {time.perf_counter() - start:.0f} s; JSON lines: {jsonl}")


if __name__ == "__main__":
  app.run(main)
