"""meshslice.tune on a model's layer for a TPU topology, ahead of time, with a table.

Compiles plain XLA and each candidate plan for the topology (no TPU needed: libtpu
compiles on this machine, docs/tpu.md), simulates each compiled program and prints,
per candidate: simulated step, compute, exposed communication, libtpu's peak memory,
the step and peak against XLA's program compiled in the same run, the step against the
limit (XLA's compute: with the `dense` flags it is the dense program's), and which
candidate tune chose (the fastest, within --max_peak when given). Tune ranks by the
alpha-beta simulator; --routed (on by default) adds each program's step under the
routed-links model (`costmodel.routed_links`) and the less favourable of the two ratios.

  python bench/tpu_tune.py --model=gpt3 --topology=v4:8x8x4 --mesh=64x4 \\
      --candidate=collective+all_to_all --candidate="collective+all_to_all, ls ksplit=2" \\
      --held="wq wk wv:*wq,*wk,*wv" --max_peak=1.10          # ~6 min on 2 cores

--candidate (repeated) names an entry of `meshslice.tune.CANDIDATES` (default: all of
them), in the order given; a name's base must come before it. Each --held
"label:pattern,pattern" (repeated) adds a `meshslice.HeldGathers` candidate on the last
--candidate that holds no gathers itself, holding back the weight gradients whose module
matches a pattern. Each --sliced "label:dataflow:ksplit:pattern,pattern" (repeated) adds a
`meshslice.SlicedSites` candidate, each on the one before (the first on the last
--candidate of transform options, e.g. collective+all_to_all): its sites of that
dataflow whose module matches a pattern (all when none is given) sliced in ksplit;
--held then builds on the last of them. --refine=N: N sweeps of tune's local search
from the fastest candidate within --max_peak (one module's sites of one dataflow
sliced one step finer or coarser, a group of weight gradients held or released, a move
at a time; ~30 compiles a sweep for GPT-3's layer). --flags:
libtpu flag presets (`aot.preset_flags`, default dense,async,all_to_all) for the
topology's generation, set before libtpu loads. --whole tunes the whole training step
(`meshslice.whole_step`, 4 scanned layers by default) instead of one layer.
--plan_out=PATH saves the chosen plan (Plan JSON, `meshslice.transform(step,
plan=PATH)`), so a refine result can be applied and compiled again without a rerun.
"""
import importlib
import json
from importlib.metadata import version

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "gpt3", "gpt3 or megatron (aot.model_step)")
_TOPOLOGY = flags.DEFINE_string("topology", "v4:8x8x4", "TPU topology to compile for")
_MESH = flags.DEFINE_string("mesh", "64x4", "mesh shape RxC (axes x, y)")
_LAYERS = flags.DEFINE_integer("layers", 0, "transformer layers (0: one for a layer step, "
                                "four for --whole)")
_WHOLE = flags.DEFINE_bool("whole", False, "tune the whole training step (meshslice."
                           "whole_step: embedding, scanned layers, loss, Adam), not a layer")
_BATCH = flags.DEFINE_integer("batch", 0, "sequences per step (default: one per chip)")
_SEQ = flags.DEFINE_integer("seq", 0, "sequence length (default: the model's)")
_FLAGS = flags.DEFINE_string("flags", "dense,async,all_to_all", "libtpu flag presets")
_CANDIDATES = flags.DEFINE_multi_string("candidate", [], "a CANDIDATES name (repeat; "
                                        "default: every default candidate)")
_SLICED = flags.DEFINE_multi_string("sliced", [], "'label:dataflow:ksplit:pattern,pattern': "
                                    "a SlicedSites candidate on the last candidate "
                                    "holding none (repeat: each on the one before)")
_HELD = flags.DEFINE_multi_string("held", [], "'label:pattern,pattern': a HeldGathers "
                                  "candidate on the last --candidate holding none (repeat)")
_MAX_PEAK = flags.DEFINE_float("max_peak", None, "tune's memory budget: a multiple of "
                               "XLA's libtpu peak")
_REFINE = flags.DEFINE_integer("refine", 0, "tune's sweeps of local search from the "
                                "fastest candidate within --max_peak (0: none)")
_ROUTED = flags.DEFINE_bool("routed", True, "also price every candidate's compiled "
                            "schedule under the routed-links model (torus links; no "
                            "recompiling) and give the least favourable ratio")
_JSON = flags.DEFINE_string("json", "", "also write the rows as JSON lines here")
_PLAN_OUT = flags.DEFINE_string("plan_out", "", "also save the chosen plan here (Plan JSON: "
                                "meshslice.transform(step, plan=PATH) applies it)")
_CACHE_DIR = flags.DEFINE_string("cache_dir", None, "keep compiled candidates here and read "
                                 "back those compiled before (tune's cache_dir)")


def candidates(names: list, held: list, sliced: tuple = ()) -> dict:
  """The candidates the flags ask for: {name: options}."""
  tune_module = importlib.import_module("meshslice.tune")   # meshslice.tune is the function
  wanted = list(names) or list(tune_module.CANDIDATES)
  unknown = [n for n in wanted if n not in tune_module.CANDIDATES]
  if unknown:
    raise app.UsageError(f"--candidate: unknown {unknown}; known: "
                         f"{', '.join(map(repr, tune_module.CANDIDATES))}")
  out = {n: tune_module.CANDIDATES[n] for n in wanted}
  # --held builds on the last candidate that does not hold gathers itself; --sliced
  # chains from the last candidate of transform options (and --held then on its end)
  base = next((n for n in reversed(wanted)
               if not isinstance(out[n], tune_module.HeldGathers)), wanted[-1])
  if sliced:
    base = next((n for n in reversed(wanted) if isinstance(out[n], dict)), base)
  for group in sliced:
    label, dataflow, ksplit, patterns = (group.split(":", 3) + ["", "", ""])[:4]
    if dataflow not in ("os", "ls", "rs") or not ksplit.isdigit() or not label.strip():
      raise app.UsageError(f"--sliced: {group!r} is not 'label:dataflow:ksplit:"
                           "pattern,pattern' (dataflow os, ls or rs; patterns may be empty)")
    name = f"{base}, {label.strip()}"
    out[name] = tune_module.SlicedSites(
        base, dataflow, int(ksplit), tuple(p.strip() for p in patterns.split(",") if p.strip()))
    base = name
  for group in held:
    label, sep, patterns = group.partition(":")
    if not sep or not patterns.strip():
      raise app.UsageError(f"--held: {group!r} is not 'label:pattern,pattern'")
    out[f"{base}, {label.strip()} held"] = tune_module.HeldGathers(
        base, tuple(p.strip() for p in patterns.split(",")))
  return out


def rows(results: dict, plan, routed_step=None) -> list[dict]:
  """One row per candidate, ratios against the "xla" candidate of the same run.

  `routed_step(result)` (optional) prices a candidate's compiled schedule under the
  routed-links model; the rows then carry that step and its ratio beside tune's
  alpha-beta figures, and "least_vs_xla" is the less favourable of the two ratios.
  """
  xla = results["xla"].result
  # one routed simulation per candidate (XLA's included), each seconds on a pod program
  routed_s = {name: routed_step(c.result) for name, c in results.items()} if routed_step \
      else {}
  out = []
  for name, c in results.items():
    r, sim = c.result, c.result.simulation
    extra = {}
    if routed_step:
      routed, xla_routed = routed_s[name], routed_s["xla"]
      extra = {"routed_ms": routed * 1e3, "routed_vs_xla": xla_routed / routed,
               "least_vs_xla": min(xla_routed / routed, xla.simulation.step_s / sim.step_s)}
    out.append({"candidate": name, "step_ms": sim.step_s * 1e3,
                "compute_ms": sim.compute_s * 1e3, "exposed_ms": sim.exposed_s * 1e3,
                **extra,
                "peak_gib": r.libtpu_peak_bytes / 2**30,
                "step_vs_xla": xla.simulation.step_s / sim.step_s,
                "peak_vs_xla": r.libtpu_peak_bytes / max(xla.libtpu_peak_bytes, 1),
                "step_vs_limit": sim.step_s / xla.simulation.compute_s,
                "chosen": c.plan == plan})
  return out


def table(records: list[dict]) -> str:
  routed = bool(records) and "routed_ms" in records[0]
  head = ("| candidate | step ms | compute ms | exposed ms | libtpu peak GiB | step vs XLA "
          "| peak vs XLA | step vs limit | chosen |")
  rule = "|---|---:|---:|---:|---:|---:|---:|---:|---|"
  if routed:
    head += " routed step ms | routed vs XLA | least favourable vs XLA |"
    rule += "---:|---:|---:|"
  lines = [head, rule]
  for r in records:
    line = (f"| {r['candidate']} | {r['step_ms']:.2f} | {r['compute_ms']:.2f} | "
            f"{r['exposed_ms']:.2f} | {r['peak_gib']:.2f} | {r['step_vs_xla']:.3f}x | "
            f"{r['peak_vs_xla']:.3f}x | {r['step_vs_limit']:.3f}x | "
            f"{'yes' if r['chosen'] else ''} |")
    if routed:
      line += (f" {r['routed_ms']:.2f} | {r['routed_vs_xla']:.3f}x | "
               f"{r['least_vs_xla']:.3f}x |")
    lines.append(line)
  return "\n".join(lines)


def main(argv):
  del argv
  from meshslice import aot
  generation, _ = aot.parse_topology(_TOPOLOGY.value)
  aot.set_flags(*aot.preset_flags(_FLAGS.value, generation.name))
  import jax
  import meshslice
  shape = tuple(int(v) for v in _MESH.value.split("x"))
  mesh = aot.make_mesh(_TOPOLOGY.value, shape)
  step, *args = aot.model_step(_MODEL.value, mesh, layers=_LAYERS.value or None,
                               whole=_WHOLE.value, batch=_BATCH.value or None,
                               seq=_SEQ.value or None)
  results = {}
  plan = meshslice.tune(step, *args, mesh=mesh, results=results, echo=print,
                        candidates=candidates(_CANDIDATES.value, _HELD.value,
                                              _SLICED.value),
                        max_peak=_MAX_PEAK.value, refine=_REFINE.value,
                        cache_dir=_CACHE_DIR.value)
  routed_step = None
  if _ROUTED.value:
    from meshslice.costmodel import routed_links
    profile = generation.profile

    def routed_step(result):
      return routed_links.simulate_routed(result.schedule, mesh, profile).step_s

  records = rows(results, plan, routed_step)
  print(f"\n{_MODEL.value} on {_TOPOLOGY.value} as {_MESH.value}, jax {jax.__version__}, "
        f"libtpu {version('libtpu')}, flags {_FLAGS.value}"
        f"{'' if _MAX_PEAK.value is None else f', max_peak {_MAX_PEAK.value:g}'}"
        f"{f', refine {_REFINE.value}' if _REFINE.value else ''}; "
        "limit = XLA's compute")
  print(table(records))
  if _PLAN_OUT.value:
    plan.save(_PLAN_OUT.value)
    print(f"chosen plan saved to {_PLAN_OUT.value}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      for r in records:
        f.write(json.dumps({"model": _MODEL.value, "topology": _TOPOLOGY.value,
                            "mesh": _MESH.value, "whole": _WHOLE.value,
                            "layers": _LAYERS.value or (4 if _WHOLE.value else 1),
                            **r}) + "\n")


if __name__ == "__main__":
  app.run(main)
