"""What the real TPU compiler makes of a transformer layer's training step: plain jit (XLA's
windowed einsum on, the default), dense (windowed einsum off) and meshslice's default
plan, compiled ahead of time for TPU pods on this machine (libtpu, no TPU needed; see
meshslice.aot) and read with meshslice.costmodel.tpu_schedule.

The step is meshslice.gpt's (layernorm, attention, MLP; fwd + bwd + SGD; lax.scan over
jax.checkpoint-ed layers), at GPT-3 (hidden 12288, 96 heads) or Megatron-NLG (20480,
160 heads) size, sequence 2048, one sequence per chip, bfloat16, --layers layers. Each
(model, chips) runs on the mesh shape the cost model recommends (`python -m meshslice
autotune --model M --chips P`), unless --mesh says otherwise. Variants, each compiled in
its own process (libtpu reads its flags once per process):

  plain        the user's jitted step, libtpu defaults (windowed einsum fires on big GEMMs)
  dense        the same, --xla_tpu_enable_windowed_einsum_for_{all_gather,reduce_scatter}
               =false: local GEMMs, synchronous collectives
  plain_async  plain with the async collective flags the rewrite gets
  dense_async  dense with them
  meshslice    meshslice.transform(step) with the default plan, with the generation's
               async collective flags (meshslice.backend_flags.tpu_overlap_flags: no
               all-gather continuation fusion on v4 / v5p / v6e, the MaxText group on
               v5e; --meshslice_flags to change) so its sliced collectives can overlap
  meshslice_dense  the same with windowed einsum off too (dense_async's flags): the
               sites it leaves to XLA run XLA's dense program, and are planned so
               (optional: --variants=...,meshslice_dense)

The headline ("vs best XLA") is the rewrite's simulated step against the best of the four
XLA variants at the same mesh. Every table states each variant's flags and the libtpu
version.

Figures per variant (per device, one step; loops times their trip counts):
  compute Mcyc   sum of the compiler's estimated cycles (dot + relayout copies + other)
  dot Mcyc       of which dots / convolutions
  copies         relayout copies run
  coll GB        bytes one device sends in collectives (ring formulas, tpu_schedule)
  WE loops       windowed-einsum loops (XLA's collective matmul)
  step ms        simulated step: compiler cycles at the chip clock, collectives from the
                 profile's ICI model with links derived for the mesh from the topology
                 (as the planner prices sites), async ones overlapping what runs between
                 start/done
  exposed ms     step ms - compute ms
  peak GiB       arguments + outputs + temps - aliased (compiled.memory_analysis())
  compile s      compile time on this machine

  python bench/tpu_aot.py --chips=64 --models=gpt3                  # ~5-10 min, 2 cores
  python bench/tpu_aot.py --chips=64,256 --models=gpt3,megatron --out=/tmp/aot.jsonl \\
      --markdown=/tmp/aot.md
  python bench/tpu_aot.py --generations=v5p,v6e --chips=256
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

_MODELS = flags.DEFINE_list("models", ["gpt3", "megatron"], "gpt3, megatron")
_CHIPS = flags.DEFINE_list("chips", ["64", "256", "1024"], "chip counts")
_GENERATIONS = flags.DEFINE_list("generations", ["v4"], "TPU generations: v4, v5p, v5e, v6e")
_VARIANTS = flags.DEFINE_list("variants", ["plain", "dense", "plain_async", "dense_async",
                                           "meshslice"],
                              "plain, dense, plain_async, dense_async, meshslice, "
                              "meshslice_dense")
_MESHSLICE_FLAGS = flags.DEFINE_string(
    "meshslice_flags", "async", "libtpu flag presets of the meshslice variant and of the "
    "*_async XLA variants (meshslice.aot.preset_flags): async (the generation's), fusion "
    "(MaxText's continuation-fusion group), safe_async")
_MESH = flags.DEFINE_list("mesh", [], "mesh overrides as CHIPS:RxC, e.g. 256:32x8; several "
                          "for one chip count compile each (every side's best mesh is then "
                          "the headline's)")
_MESHSLICE_OPTIONS = flags.DEFINE_string(
    "meshslice_options", "{}", "JSON of meshslice.transform options for the meshslice "
    "variants, e.g. '{\"reduce_scatter\": \"all_to_all\"}' (with --meshslice_flags="
    "async,all_to_all, which every async variant, XLA's included, then gets)")
_LAYERS = flags.DEFINE_integer("layers", 1, "layers in the step")
_SUMMARIZE = flags.DEFINE_list(
    "summarize", [], "compile nothing: print the best-mesh summary of these --out JSON-lines "
    "files (several runs: scales, generations, libtpus)")
_SCHEDULER_LOG = flags.DEFINE_bool(
    "scheduler_log", False, "also read libtpu's latency-hiding scheduler totals (its own cost "
    "model's 'Total cycles', entry + loop bodies, and its wasted cycles in parentheses; "
    "docs/tpu.md) into the 'libtpu sched Mcyc' column")
_TIMEOUT = flags.DEFINE_integer("timeout", 3600, "seconds per compile (each variant)")
_OUT = flags.DEFINE_string("out", None, "append one JSON line per (model, chips, variant)")
_MARKDOWN = flags.DEFINE_string("markdown", None, "write the table as markdown here")
_WORKER = flags.DEFINE_string("worker", None, "internal: run one variant, JSON spec")
_SAVE_HLO = flags.DEFINE_string("save_hlo", None, "write each compiled program's text here "
                                "(MODEL_CHIPS_MESH_VARIANT.hlo), to re-read it later without "
                                "compiling: tpu_schedule.read_schedule(open(path).read())")

def variant_flags(variant: str, generation: str, async_presets: str = "async") -> tuple:
  """The libtpu flags of a variant (meshslice.aot.VARIANTS) on `generation`, its async
  part from `async_presets`."""
  from meshslice import aot
  return aot.variant_flags(variant, generation, async_presets)


def _worker(spec: dict) -> dict:
  """Compile one variant in this process and return its figures."""
  from meshslice import aot
  use_pass, _ = aot.VARIANTS[spec["variant"]]
  gen, _ = aot.parse_topology(spec["topology"])
  aot.set_flags(*variant_flags(spec["variant"], gen.name, spec.get("async", "async")))
  import jax
  jax.config.update("jax_platforms", "cpu")
  mesh = aot.make_mesh(spec["topology"], spec["mesh"])
  step, params, data = aot.model_step(spec["model"], mesh, layers=spec["layers"])
  record = {}
  fn = step
  if use_pass:
    import meshslice
    fn = meshslice.transform(step, **{"profile": gen.profile, **spec.get("options", {})})
    with jax.set_mesh(mesh):
      report = fn.explain(params, data)
    record["rewritten_sites"] = len(report.rewritten)
    record["plans"] = list(report.plan_counts(reduce_scatter=True))
  import contextlib
  from meshslice.costmodel import tpu_schedule
  log = tpu_schedule.capture_stderr() if spec.get("scheduler_log") else None
  with log if log is not None else contextlib.nullcontext():
    compiled, seconds = aot.compile(fn, params, data, mesh=mesh)
  if spec.get("save_hlo"):
    mesh_name = "x".join(map(str, spec["mesh"]))
    name = f"{spec['model']}_{spec['topology']}_{mesh_name}_{spec['variant']}"
    os.makedirs(spec["save_hlo"], exist_ok=True)
    with open(os.path.join(spec["save_hlo"], name.replace(":", "-") + ".hlo"), "w") as f:
      f.write(compiled.as_text())
  record.update(aot.analyze(compiled, gen.profile, compile_s=seconds, mesh_shape=spec["mesh"],
                            scheduler_log=log.text if log is not None else None).row())
  from importlib.metadata import version
  record["libtpu"] = version("libtpu")
  return record


def _run_variant(spec: dict) -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  if spec.get("scheduler_log"):
    from meshslice.costmodel.tpu_schedule import SCHEDULER_LOG_ENV
    env.update(SCHEDULER_LOG_ENV)          # read by libtpu when it loads
  start = time.perf_counter()
  try:
    out = subprocess.run([sys.executable, __file__, f"--worker={json.dumps(spec)}"],
                         capture_output=True, text=True, env=env, timeout=_TIMEOUT.value)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {_TIMEOUT.value} s"}
  lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  if not lines:
    tail = [l for l in out.stderr.splitlines() if "Error" in l or "error" in l][-3:]
    return {"error": f"exit {out.returncode}: {' | '.join(tail)[-500:]}",
            "wall_s": time.perf_counter() - start}
  return json.loads(lines[-1][len("RESULT "):])


def _meshes_for(model: str, chips: int, profile: str) -> list:
  """The --mesh overrides for `chips`, else the one mesh autotune recommends."""
  asked = [tuple(int(v) for v in shape.split("x"))
           for count, shape in (item.split(":") for item in _MESH.value) if int(count) == chips]
  if asked:
    return asked
  from meshslice.costmodel.autotune import recommend_mesh
  # the memory check counts the layers this bench compiles, not the whole model's (which
  # need not fit, e.g. all of GPT-3 on 64 chips)
  return [recommend_mesh(chips, model=model, profile=profile,
                         memory_layers=_LAYERS.value).best_shape]


COLUMNS = ("model", "chips", "topology", "mesh", "variant", "compute Mcyc", "dot Mcyc",
           "copies", "coll GB", "WE loops", "step ms", "exposed ms", "peak GiB",
           "libtpu peak GiB", "libtpu sched Mcyc", "compile s", "vs best XLA")


def _cells(r: dict) -> list[str]:
  head = [r["model"], str(r["chips"]), r["topology"], "x".join(map(str, r["mesh"])),
          r["variant"]]
  if "error" in r:
    return head + [r["error"]] + [""] * (len(COLUMNS) - len(head) - 1)
  best = r.get("versus_best_xla")
  return head + [f"{r['compute_cycles'] / 1e6:.1f}", f"{r['dot_cycles'] / 1e6:.1f}",
                 str(r["relayout_copies"]), f"{r['collective_bytes'] / 1e9:.2f}",
                 str(r["windowed_einsum_loops"]), f"{r['step_s'] * 1e3:.2f}",
                 f"{r['exposed_s'] * 1e3:.2f}", f"{r['peak_bytes'] / 2**30:.2f}",
                 f"{(r.get('libtpu_peak_bytes') or 0) / 2**30:.2f}", _scheduler_cell(r),
                 f"{r['compile_s']:.0f}",
                 f"{best[2]:.3f}x ({best[0]})" if best else ""]


def _scheduler_cell(r: dict) -> str:
  """libtpu's scheduler total (entry + loop bodies, Mcycles) and, in parentheses, the part
  it counts as waiting for collectives; "" when not logged."""
  if r.get("scheduler_cycles") is None:
    return ""
  total = f"{(r['scheduler_cycles'] + (r.get('scheduler_loop_cycles') or 0)) / 1e6:.1f}"
  wasted = r.get("scheduler_wasted_cycles")
  return total if wasted is None else f"{total} ({wasted / 1e6:.1f})"


def headline(records) -> list:
  """Per (model, generation, chips, mesh): meshslice's record gets "versus_best_xla" =
  (best XLA variant, its step seconds, its step / meshslice's: > 1 is faster)."""
  from meshslice import aot
  groups = {}
  for r in records:
    key = (r["model"], r.get("generation"), r["chips"], tuple(r["mesh"]))
    groups.setdefault(key, {})[r["variant"]] = r
  for rows in groups.values():
    for variant in (v for v in rows if aot.VARIANTS.get(v, (False,))[0]):
      best = aot.versus_best_xla(rows, variant=variant)
      if best is not None:
        rows[variant]["versus_best_xla"] = list(best)
  return records


def best_meshes(records) -> list:
  """Per (model, generation, chips): each side at its own best mesh: the fastest XLA
  variant over every mesh compiled against each meshslice variant's fastest mesh, as
  lines for the table's foot."""
  from meshslice import aot
  groups = {}
  for r in records:
    if isinstance(r.get("step_s"), (int, float)) and r["step_s"] > 0:
      groups.setdefault((r["model"], r.get("generation"), r["chips"]), []).append(r)
  lines = []
  for (model, gen, chips), rows in groups.items():
    xla = [r for r in rows if r["variant"] in aot.XLA_VARIANTS]
    if not xla:
      continue
    rival = min(xla, key=lambda r: r["step_s"])
    for variant in sorted({r["variant"] for r in rows if r["variant"] not in aot.XLA_VARIANTS}):
      ours = min((r for r in rows if r["variant"] == variant), key=lambda r: r["step_s"])
      lines.append(
          f"- {model} {gen} {chips} chips, each at its best of "
          f"{len({tuple(r['mesh']) for r in rows})} mesh(es): {variant} "
          f"{'x'.join(map(str, ours['mesh']))} {ours['step_s'] * 1e3:.2f} ms against "
          f"{rival['variant']} {'x'.join(map(str, rival['mesh']))} "
          f"{rival['step_s'] * 1e3:.2f} ms: {rival['step_s'] / ours['step_s']:.3f}x")
  return lines


SUMMARY_COLUMNS = ("model", "chips", "generation", "libtpu", "best XLA (mesh)", "XLA ms",
                   "meshslice (mesh)", "meshslice ms", "vs best XLA", "libtpu sched: XLA / ours",
                   "compute vs dense", "exposed ms", "libtpu peak vs best XLA")


def summary(records) -> list:
  """One row per (model, generation, chips, libtpu): the fastest XLA variant and the
  fastest meshslice variant over every mesh compiled (SUMMARY_COLUMNS). "compute vs
  dense" divides by the dense program's compute at the rewrite's mesh (dense_async's
  when dense was not compiled: the same program, its compute within 2%); the scheduler
  column is libtpu's own total (entry + loops) for each side, where it logged one."""
  from meshslice import aot
  groups = {}
  for r in records:
    if isinstance(r.get("step_s"), (int, float)) and r["step_s"] > 0:
      key = (r["model"], r["chips"], r.get("generation"), r.get("libtpu", "?"))
      groups.setdefault(key, []).append(r)
  sched = lambda r: (None if r.get("scheduler_cycles") is None else
                     r["scheduler_cycles"] + (r.get("scheduler_loop_cycles") or 0))
  rows = []
  for (model, chips, gen, lib), rs in groups.items():
    xla = [r for r in rs if r["variant"] in aot.XLA_VARIANTS]
    ours = [r for r in rs if r["variant"] not in aot.XLA_VARIANTS]
    if not xla or not ours:
      continue
    rival, best = min(xla, key=lambda r: r["step_s"]), min(ours, key=lambda r: r["step_s"])
    dense = [r for name in ("dense", "dense_async") for r in xla
             if r["variant"] == name and r["mesh"] == best["mesh"]]
    mesh = lambda r: "x".join(map(str, r["mesh"]))
    a, b = sched(rival), sched(best)
    rows.append([
        model, str(chips), gen or "", lib, f"{rival['variant']} ({mesh(rival)})",
        f"{rival['step_s'] * 1e3:.1f}", f"{best['variant']} ({mesh(best)})",
        f"{best['step_s'] * 1e3:.1f}", f"{rival['step_s'] / best['step_s']:.3f}x",
        f"{a / 1e6:.0f} / {b / 1e6:.0f}" if a and b else (f"- / {b / 1e6:.0f}" if b else ""),
        f"{best['compute_s'] / dense[0]['compute_s']:.3f}x" if dense else "",
        f"{best['exposed_s'] * 1e3:.1f}",
        f"{best['libtpu_peak_bytes'] / rival['libtpu_peak_bytes']:.2f}x"
        if rival.get("libtpu_peak_bytes") else ""])
  return rows


def summary_markdown(records) -> str:
  lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in summary(records)])


def flag_lines(records) -> list:
  """One line per (generation, variant, libtpu): the flags it was compiled with."""
  seen = {}
  for r in records:
    seen.setdefault((r.get("generation"), r["variant"], r.get("libtpu", "?")),
                    r.get("flags", ""))
  return [f"- {gen} {variant} (libtpu {lib}): `{flags_ or '(libtpu defaults)'}`"
          for (gen, variant, lib), flags_ in seen.items()]


def exposed_lines(records, top: int = 3) -> list:
  """One line per compiled program: its largest exposed-communication groups
  (`Simulation.exposed_by`: the wait's kind, collective, group size and link), in ms."""
  lines = []
  for r in records:
    groups = r.get("exposed_by") or []
    if groups:
      parts = ", ".join(f"{label}: {seconds * 1e3:.2f} ms ({count}x)"
                        for label, seconds, count in groups[:top])
      lines.append(f"- {r['model']} {r.get('generation') or ''} {r['chips']} chips "
                   f"{'x'.join(map(str, r['mesh']))} {r['variant']}: {parts}")
  return lines


def markdown(records) -> str:
  records = headline(list(records))
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(_cells(r)) + " |" for r in records]
  lines += ["", *best_meshes(records)]
  lines += ["", "Where the exposed time goes (simulator, largest 3 per program):",
            *exposed_lines(records)]
  lines += ["", "libtpu flags (LIBTPU_INIT_ARGS) per variant:", *flag_lines(records)]
  return "\n".join(lines)


def main(argv):
  del argv
  if _WORKER.value:
    print("RESULT " + json.dumps(_worker(json.loads(_WORKER.value))), flush=True)
    return
  if _SUMMARIZE.value:
    records = [json.loads(line) for path in _SUMMARIZE.value
               for line in open(path, encoding="utf-8") if line.strip()]
    print(summary_markdown(records))
    return
  from meshslice import aot
  if not aot.have_libtpu():
    raise app.UsageError("bench/tpu_aot.py needs libtpu: pip install -e '.[tpu]'")
  unknown = [v for v in _VARIANTS.value if v not in aot.VARIANTS]
  if unknown:
    raise app.UsageError(f"--variants: unknown {unknown}; known: {', '.join(aot.VARIANTS)}")
  try:
    aot.preset_flags(_MESHSLICE_FLAGS.value, None)
  except ValueError as e:
    raise app.UsageError(f"--meshslice_flags: {e}")
  try:
    options = json.loads(_MESHSLICE_OPTIONS.value)
    if not isinstance(options, dict):
      raise ValueError("not a JSON object")
  except ValueError as e:
    raise app.UsageError(f"--meshslice_options: {e} (want a JSON object of "
                         f"meshslice.transform options)")
  records = []
  for generation in _GENERATIONS.value:
    for model in _MODELS.value:
      for chips in (int(c) for c in _CHIPS.value):
        try:
          topology = aot.topology_name(generation, chips)
        except ValueError as e:
          print(f"skip {generation} {model} {chips}: {e}", flush=True)
          continue
        profile = aot.GENERATIONS[generation].profile
        for mesh, variant in ((m, v) for m in _meshes_for(model, chips, profile)
                              for v in _VARIANTS.value):
          spec = {"model": model, "topology": topology, "mesh": list(mesh),
                  "variant": variant, "layers": _LAYERS.value, "save_hlo": _SAVE_HLO.value,
                  "async": _MESHSLICE_FLAGS.value, "options": options,
                  "scheduler_log": _SCHEDULER_LOG.value}
          record = dict(spec, chips=chips, generation=generation, **_run_variant(spec))
          records.append(record)
          print(" | ".join(_cells(record)), flush=True)
          if _OUT.value:
            with open(_OUT.value, "a", encoding="utf-8") as f:
              f.write(json.dumps(record, sort_keys=True) + "\n")
  table = markdown(records)
  print(table)
  if _MARKDOWN.value:
    with open(_MARKDOWN.value, "w", encoding="utf-8") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  app.run(main)
