"""Does the planner rank candidate plans as the TPU compiler's programs do?

For every single-GEMM site of one GPT-3 and one Megatron-NLG layer (forward os, backward
data ls, backward weight rs of qkv, attn-out, mlp-up, mlp-down; one sequence of 2048
tokens per chip; docs/costmodel.md section 8's os layout) on --topology as an RxC mesh,
each candidate plan is compiled ahead of time (meshslice.aot_sites):

    xla                  plain jit, windowed einsum on (libtpu's default), libtpu defaults
    xla dense            plain jit, windowed einsum off, otherwise libtpu defaults
    xla async            plain jit with the async flags the rewrite gets (the topology's
                         generation's, backend_flags.tpu_overlap_flags)
    xla dense async      windowed einsum off, with the async flags
    meshslice S=k        the MeshSlice body with k slices (k = 1: the collective
                         algorithm), with the async flags

The planner's pick is scored against the best of the four XLA programs. The flags of
each flag set are printed with the table.

and read with the schedule simulator (costmodel.tpu_schedule.simulate; collectives timed
with the profile's links derived for the mesh, as the planner prices them). Next to each
simulated time stands the planner's predicted time of the same candidate
(meshslice.costing: the analytic model plus the compiler terms of the profile, see
costmodel/xla_baseline.py). Prints both per site and the Spearman rank correlation,
over all (site, candidate) pairs and within each site.

Compiles are cached in --records (JSON lines), so re-running with another profile or
calibration costs no compile:

  python bench/tpu_rank.py                                    # 256 v4 chips as 32x8
  python bench/tpu_rank.py --profile my-v4.json               # a calibrated profile
  python bench/tpu_rank.py --topology v4:2x2x2 --mesh 2x4 --scale 32   # 8 chips, shrunk
"""
from __future__ import annotations

import json
import os

from absl import app, flags

_TOPOLOGY = flags.DEFINE_string("topology", "v4:8x8x4", "TPU topology to compile for")
_MESH = flags.DEFINE_string("mesh", "32x8", "mesh shape RxC (axes x, y)")
_MODELS = flags.DEFINE_list("models", ["gpt3", "megatron"], "gpt3, megatron")
_TOKENS = flags.DEFINE_integer("tokens", 0, "tokens per step (default: 2048 per chip)")
_SCALE = flags.DEFINE_integer("scale", 1, "divide the token count by this (small topologies)")
_KSPLITS = flags.DEFINE_list("ksplits", ["1", "2", "4"], "meshslice slice counts")
_PROFILE = flags.DEFINE_string("profile", "tpu-v4", "profile the planner predicts with")
_RECORDS = flags.DEFINE_string("records", "/tmp/meshslice_tpu_rank.jsonl",
                               "compiled-program records (cache; appended)")
_COMPILE = flags.DEFINE_bool("compile", True, "compile the cases missing from --records")

HIDDEN = {"gpt3": 12288, "megatron": 20480}
# flag set (meshslice.aot_sites) -> whether the meshslice programs compile under it
FLAG_SETS = {"async": True, "async_dense": False, "default": False, "dense": False}
# candidate name -> flag set of XLA's program
XLA_PROGRAMS = {"xla": "default", "xla dense": "dense", "xla async": "async",
                "xla dense async": "async_dense"}
LAYERS = (("qkv", 1, 3), ("attn_out", 1, 1), ("mlp_up", 1, 4), ("mlp_down", 4, 1))


def site_cases(models, tokens: int):
  """The GEMM sites of one layer per model, as aot_sites.Case (os layout: forward os,
  backward data ls, backward weight rs)."""
  from meshslice.aot_sites import Case
  cases = []
  for model in models:
    h = HIDDEN[model]
    for name, d_in, d_out in LAYERS:
      d_in, d_out = d_in * h, d_out * h
      cases += [Case(dataflow="os", m=tokens, k=d_in, n=d_out, label=f"{model} {name} fwd"),
                Case(dataflow="ls", m=tokens, k=d_out, n=d_in, label=f"{model} {name} bwd-data"),
                Case(dataflow="rs", m=d_in, k=tokens, n=d_out,
                     label=f"{model} {name} bwd-weight")]
  return cases


def load_records(path):
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def compile_missing(cases, topology, mesh, ksplits, path):
  """Compile what `path` lacks, one flag set per subprocess, appending as it goes."""
  from meshslice.aot_sites import compile_in_subprocess
  from meshslice import aot
  from meshslice.aot_sites import flags_of
  generation = aot.parse_topology(topology)[0].name
  have = {(r["dataflow"], r["m"], r["k"], r["n"], r["flag_set"], r.get("flags"),
           r["topology"], tuple(r["mesh"])) for r in load_records(path)}
  for flag_set, ks in FLAG_SETS.items():
    ks = ksplits if ks else ()
    flags_ = " ".join(flags_of(flag_set, generation))
    todo = [c for c in cases if (c.dataflow, c.m, c.k, c.n, flag_set, flags_, topology,
                                  tuple(mesh)) not in have]
    if not todo:
      continue
    print(f"compiling {len(todo)} sites under {flag_set} flags for {topology} as "
          f"{'x'.join(map(str, mesh))} ...", flush=True)
    records = compile_in_subprocess(topology, mesh, todo, flag_set, ksplits=ks,
                                    echo=lambda s: print(s, flush=True) if "Mcycles" in s
                                    else None)
    with open(path, "a", encoding="utf-8") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")


def main(argv):
  del argv
  mesh = tuple(int(v) for v in _MESH.value.lower().split("x"))
  tokens = (_TOKENS.value or 2048 * mesh[0] * mesh[1]) // _SCALE.value
  cases = site_cases(_MODELS.value, tokens)
  ksplits = tuple(int(k) for k in _KSPLITS.value)
  if _COMPILE.value:
    compile_missing(cases, _TOPOLOGY.value, mesh, ksplits, _RECORDS.value)
  print(report(cases, load_records(_RECORDS.value), topology=_TOPOLOGY.value, mesh=mesh,
               profile=_PROFILE.value, ksplits=ksplits))


def _problem(case, mesh):
  """The case's GemmProblem, as the planner sees it."""
  from meshslice.costmodel import compiler_fit
  return compiler_fit.problem_of({"m": case.m, "k": case.k, "n": case.n,
                                  "mesh": list(mesh), "dtype": case.dtype})


def candidates(record_index, case, topology, mesh, ksplits):
  """[(candidate name, simulated seconds, predict(terms) -> seconds)] of one case that
  were compiled (under the flags its flag set has today)."""
  from meshslice import aot, costing
  from meshslice.aot_sites import flags_of
  generation = aot.parse_topology(topology)[0].name
  key = lambda program, flag_set: (case.dataflow, case.m, case.k, case.n, program, flag_set,
                                   " ".join(flags_of(flag_set, generation)), topology,
                                   tuple(mesh))
  problem = _problem(case, mesh)
  flow = case.dataflow
  out = []
  def add(name, program, flag_set, predict):
    record = record_index.get(key(program, flag_set))
    if record is not None:
      out.append((name, record["step_s"], predict))
  for name, flag_set in XLA_PROGRAMS.items():
    baseline = "dense" if "dense" in flag_set else "windowed"
    add(name, "xla", flag_set, lambda prof, terms, b=baseline: costing.xla_program(
        problem, prof, flow, b, terms).seconds)
  for k in ksplits:
    algorithm = "collective" if k == 1 else "meshslice"
    add(f"meshslice S={k}", f"meshslice S={k}", "async",
        lambda prof, terms, k=k, a=algorithm: costing.predict(problem, prof, a, flow, k, terms))
  return out


def planner_pick(case, mesh, site_prof, terms, ksplits) -> str:
  """The candidate name the pass would run for `case`: `costing.choose` over collective
  and meshslice (fewest slices within the model's error of the fastest), left to XLA
  unless predicted faster than XLA's windowed program by more than `costing.XLA_MARGIN`
  (`costing.leave_to_xla`). A site left to XLA runs XLA's program under the same flags
  as the rewrite: "xla async"."""
  from meshslice import costing
  problem = _problem(case, mesh)
  choice = costing.choose(problem, site_prof, case.dataflow, terms=terms,
                          algorithms=costing.AUTO_ALGORITHMS,
                          ksplits=tuple(k for k in ksplits if k > 1))
  if choice is None or choice.algorithm is None:
    return "xla async"
  xla = costing.xla_program(problem, site_prof, case.dataflow, "windowed", terms)
  if costing.leave_to_xla(choice.seconds, choice.algorithm == "collective", xla):
    return "xla async"
  return f"meshslice S={1 if choice.algorithm == 'collective' else choice.ksplit}"


def report(cases, records, *, topology, mesh, profile, ksplits) -> str:
  """The per-site table and the Spearman correlations, as text."""
  import numpy as np
  from meshslice import costing
  from meshslice.costmodel import load_profile, profile_for_mesh, xla_baseline
  from meshslice.costmodel.calibrate import spearman
  index = {(r["dataflow"], r["m"], r["k"], r["n"], r["program"], r["flag_set"],
            r.get("flags"), r["topology"], tuple(r["mesh"])): r for r in records}
  site_prof = profile_for_mesh(load_profile(profile), tuple(mesh))
  terms = xla_baseline.read_terms(profile)
  lines = [f"{topology} as {'x'.join(map(str, mesh))}, profile {profile}; seconds x 1e3 "
           "(ms): simulated (compiled program) / predicted with compiler terms / "
           "analytic alone"]
  pooled = {"sim": [], "terms": [], "analytic": []}
  within = {"terms": [], "analytic": []}
  picks = {"terms": [], "analytic": []}
  rule = []                  # what the planner would pick, by its own rule
  versus_xla = []            # its pick against the better of XLA's two programs
  for case in cases:
    rows = candidates(index, case, topology, mesh, ksplits)
    if len(rows) < 2:
      continue
    sim = [t for _, t, _ in rows]
    pred = {"terms": [f(site_prof, terms) for *_, f in rows],
            "analytic": [f(site_prof, None) for *_, f in rows]}
    cells = "  ".join(f"{name} {s * 1e3:.2f}/{pt * 1e3:.2f}/{pa * 1e3:.2f}" for
                      (name, s, _), pt, pa in zip(rows, pred["terms"], pred["analytic"]))
    lines.append(f"{case.label:<24} {cells}")
    pooled["sim"] += sim
    for model in within:
      pooled[model] += pred[model]
      within[model].append(spearman(sim, pred[model]))
      chosen = int(np.argmin(pred[model]))
      picks[model].append(sim[chosen] / min(sim))
    names = [name for name, _, _ in rows]
    pick = planner_pick(case, mesh, site_prof, terms, ksplits)
    if pick in names:
      rule.append(sim[names.index(pick)] / min(sim))
      xla = [t for name, t in zip(names, sim) if name in XLA_PROGRAMS]
      if xla:
        versus_xla.append(sim[names.index(pick)] / min(xla))
  if rule:
    lines.append(
        f"planner's rule (fewest slices within {costing.NEAR_TIE:.0%} of the fastest, "
        f"then against XLA's windowed program by more than {costing.XLA_MARGIN:.0%}): "
        f"the simulated best on "
        f"{sum(r == 1.0 for r in rule)} of {len(rule)} sites, "
        f"{(np.mean(rule) - 1) * 100:.1f} % slower than it on average "
        f"(worst {(max(rule) - 1) * 100:.1f} %)")
  if versus_xla:
    slower = [r for r in versus_xla if r > 1.0]
    lines.append(
        f"planner's pick against the best of XLA's four programs (windowed einsum on / "
        f"off, libtpu defaults / async flags): "
        f"slower on {len(slower)} of {len(versus_xla)} sites"
        + (f" (worst +{(max(slower) - 1) * 100:.1f} %)" if slower else "")
        + f", {(1 - np.mean(versus_xla)) * 100:.1f} % faster on average")
  for model in within:
    rho = spearman(pooled["sim"], pooled[model])
    per_site = [r for r in within[model] if r == r]
    regret = picks[model]
    lines.append(
        f"{model:>9}: Spearman over {len(pooled['sim'])} (site, candidate) pairs = "
        f"{rho:.3f}; within a site: mean {np.mean(per_site):.3f} (min {min(per_site):.3f}) "
        f"over {len(per_site)} sites; the predicted best candidate is the simulated best "
        f"on {sum(r == 1.0 for r in regret)} of {len(regret)} sites, "
        f"{(np.mean(regret) - 1) * 100:.1f} % slower than it on average "
        f"(worst {(max(regret) - 1) * 100:.1f} %)")
  from meshslice import aot
  from meshslice.aot_sites import flags_of
  generation = aot.parse_topology(topology)[0].name
  lines.append("libtpu flags (LIBTPU_INIT_ARGS) per flag set:")
  for name, flag_set in [*XLA_PROGRAMS.items(), ("meshslice S=k", "async")]:
    lines.append(f"  {name}: {' '.join(flags_of(flag_set, generation)) or '(libtpu defaults)'}")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
