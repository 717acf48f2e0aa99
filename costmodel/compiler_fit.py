"""Fit `xla_baseline.CompilerTerms` to compiled single-GEMM programs.

Input: records as `meshslice.aot_sites.compile_cases` writes them (one per compiled
program: the case's dataflow, m, k, n, mesh; "program" = "xla" or "meshslice S=k";
"flag_set" = "async" or "async_dense"; compute / dot cycles, each dot's (cycles, FLOPs,
runs), collective counts sync and async, windowed-einsum loops). Pure arithmetic: no
JAX, no compiles.

  dots           cycles = fixed + flops / rate over every dot of every program (but
                 windowed-einsum loops, priced by their own factor), least
                 squares on relative residuals -> dot_efficiency = rate * clock / peak,
                 dot_fixed_s = fixed / clock
  extra_scale    per dataflow, over sliced programs: (non-dot cycles - the same case's
                 S=1 program's) / clock against the analytic model's non-matmul compute
                 ops, least squares through 0
  async_fraction per dataflow and kind, over sliced programs: async collectives / the
                 pipelined ones (all but the prologue's all-gathers, the epilogue's
                 reduce-scatter)
  allreduce_max_block  per dataflow, over sliced programs by block size: the largest
                 block up to which every program had an all-reduce in place of its
                 sliced reduce-scatters
  last_allreduce_min_bytes  per dataflow and reduce-scatter group size, over the
                 sliced programs above that block: the smallest partial sum (one
                 slice's unscattered piece of Y per device) from which on every program
                 had an all-reduce (its last slice's reduce-scatter converted)
  windowed       over "xla" programs under "async" where windowed einsum fired, next to
                 the same case's dense ("async_dense") program: the smallest ring size,
                 per dataflow the smallest windowed shard, the median dot-cycle ratio and
                 the median non-dot seconds per output element; then the ring's hidden
                 share, by grid search (0, 0.05, .., 1) on the simulated steps. Dataflows
                 where it never fired keep `fallback`'s terms.

Example (synthetic records: two dots of a known rate come back):
  >>> recs = [{"dots": [[1000 + 2e9 / 2e5, 2e9, 1]]}, {"dots": [[1000 + 8e9 / 2e5, 8e9, 1]]}]
  >>> fixed, rate = fit_dots(recs)
  >>> round(fixed), round(rate)
  (1000, 200000)
"""
from __future__ import annotations

import statistics

import numpy as np

from .profiles import HardwareProfile
from .timing import DATAFLOWS, GemmProblem, movements, schedule
from .topology import profile_for_mesh
from .xla_baseline import CompilerTerms


def problem_of(record: dict) -> GemmProblem:
  """The GemmProblem of a record's case (mesh axis x = rows = profile dim 0)."""
  rows, cols = record["mesh"]
  width = 2 if record.get("dtype", "bfloat16") in ("bfloat16", "float16") else 4
  return GemmProblem(m=record["m"], n=record["n"], k=record["k"], rows=rows, cols=cols,
                     in_bytes=width, out_bytes=width)


def ksplit_of(record: dict) -> int:
  """S of a "meshslice S=k" record, 0 for "xla"."""
  program = record["program"]
  return int(program.split("=")[1]) if program.startswith("meshslice") else 0


def fit_dots(records) -> tuple[float, float]:
  """(fixed cycles per dot, FLOPs per cycle) over every dot of `records`."""
  rows = [(c, f) for r in records for c, f, _ in r["dots"] if c > 0 and f > 0]
  if len(rows) < 2:
    raise ValueError("need >= 2 dots with compiler estimates to fit the dot terms")
  cycles, flops = np.array(rows, float).T
  w = 1.0 / cycles                               # relative residuals
  a = np.stack([np.ones_like(flops), flops], axis=1) * w[:, None]
  (fixed, per_flop), *_ = np.linalg.lstsq(a, cycles * w, rcond=None)
  if fixed < 0:                                  # no fixed cost visible: rate alone
    fixed, per_flop = 0.0, float(np.sum(flops * cycles * w * w) / np.sum((flops * w) ** 2))
  return float(fixed), float(1.0 / per_flop)


def _analytic_extra(record, profile) -> float:
  p = problem_of(record)
  sched = schedule(p, "meshslice", record["dataflow"], ksplit_of(record), profile)
  return sum(st.repeat * op.seconds for st in sched.stages for op in st.ops
             if op.stream == "compute" and op.name != "matmul")


def _key(r):
  return (r["dataflow"], r["m"], r["k"], r["n"], tuple(r["mesh"]))


def fit_terms(records, profile: HardwareProfile, clock_hz: float, *,
              fallback: CompilerTerms, source: str = "") -> tuple[CompilerTerms, list]:
  """(terms, notes) fitted to `records` (module docstring); `profile` is the base
  profile (its links are derived per record's mesh), `clock_hz` the chip's clock."""
  notes = []
  # the chunk dots of a windowed-einsum loop are priced by its own factor
  fixed, rate = fit_dots([r for r in records if not r["windowed_einsum_loops"]])
  efficiency = min(1.0, rate * clock_hz / profile.peak_flops)
  sliced = [r for r in records if ksplit_of(r) > 1]
  single = {_key(r): r for r in records if ksplit_of(r) == 1}
  extra, fractions = {}, {}
  for flow in DATAFLOWS:
    mine = [r for r in sliced if r["dataflow"] == flow and _key(r) in single]
    measured, predicted = [], []
    async_n = {"all_gather": 0, "reduce_scatter": 0}
    piped_n = {"all_gather": 0, "reduce_scatter": 0}
    for r in mine:
      base = single[_key(r)]
      nondot = (r["compute_cycles"] - r["dot_cycles"]) - (base["compute_cycles"]
                                                          - base["dot_cycles"])
      measured.append(nondot / clock_hz)
      predicted.append(_analytic_extra(r, profile_for_mesh(profile, tuple(r["mesh"]))))
      s = ksplit_of(r)
      moves = movements(problem_of(r), flow)
      for kind in async_n:
        moved = sum(1 for v in moves if v.kind == kind and v.size > 1)
        if not moved:
          continue
        name = kind.replace("_", "-")
        async_n[kind] += min(r["async"].get(name, 0), moved * (s - 1))
        piped_n[kind] += moved * (s - 1)
    if mine and sum(x * x for x in predicted) > 0:
      extra[flow] = max(0.0, float(np.dot(measured, predicted) / np.dot(predicted, predicted)))
    else:
      extra[flow] = fallback.extra_scale[flow]
      notes.append(f"{flow}: no sliced programs; extra_scale from the fallback")
    fractions[flow] = {k: (async_n[k] / piped_n[k] if piped_n[k] else
                           fallback.async_fraction[flow][k]) for k in async_n}
  max_block = {flow: _allreduce_max_block([r for r in sliced if r["dataflow"] == flow])
               for flow in DATAFLOWS}
  last_min = {flow: _last_allreduce_min_bytes(
      [r for r in sliced if r["dataflow"] == flow and _block(r) > max_block[flow]])
      for flow in DATAFLOWS}
  windowed = _fit_windowed(records, profile, clock_hz, fallback, notes)
  terms = CompilerTerms(dot_efficiency=round(efficiency, 4),
                        dot_fixed_s=round(fixed / clock_hz, 9),
                        extra_scale={k: round(v, 3) for k, v in extra.items()},
                        async_fraction={f: {k: round(v, 3) for k, v in d.items()}
                                        for f, d in fractions.items()},
                        allreduce_max_block=max_block,
                        last_allreduce_min_bytes=last_min, source=source, **windowed)
  return terms, notes


def _block(record) -> float:
  p = problem_of(record)
  return p.extent(record["dataflow"]) / (ksplit_of(record) * p.lcm)


def _allreduce_max_block(sliced) -> float:
  """The largest block up to which every sliced program had its reduce-scatters
  compiled as all-reduces (0: none was)."""
  limit = 0.0
  for r in sorted(sliced, key=_block):
    if not any("all-reduce" in r[side] for side in ("sync", "async")):
      break
    limit = _block(r)
  return limit


def _last_allreduce_min_bytes(sliced) -> dict:
  """{group size: the smallest partial-sum bytes from which on every program of that
  reduce-scatter group size had an all-reduce} ({}: none had)."""
  by_group = {}
  for r in sliced:
    scatter = [v for v in movements(problem_of(r), r["dataflow"])
               if v.kind == "reduce_scatter" and v.size > 1]
    if scatter:
      size, shard = scatter[0].size, scatter[0].shard_bytes
      converted = any("all-reduce" in r[side] for side in ("sync", "async"))
      by_group.setdefault(str(size), []).append((shard / ksplit_of(r) * size, converted))
  limits = {}
  for group, seen in sorted(by_group.items()):
    # largest first; at equal size a program that did not convert comes first
    for partial, converted in sorted(seen, key=lambda v: (-v[0], v[1])):
      if not converted:
        break
      limits[group] = partial
  return limits


def _fit_windowed(records, profile, clock_hz, fallback, notes) -> dict:
  """The windowed_* terms from "xla" programs under "async" and their "async_dense"
  twins; per dataflow from the fallback where windowed einsum never fired."""
  from .xla_baseline import windowed_movement, windowed_parts
  xla = [r for r in records if r["program"] == "xla" and r["flag_set"] == "async"]
  dense = {_key(r): r for r in records if r["program"] == "xla"
           and r["flag_set"] == "async_dense"}
  fired = [r for r in xla if r["windowed_einsum_loops"] > 0 and _key(r) in dense]
  notes.append(f"windowed einsum fired in {len(fired)} of {len(xla)} xla programs")
  out = {"windowed_min_ring": fallback.windowed_min_ring,
         "windowed_min_bytes": dict(fallback.windowed_min_bytes),
         "windowed_dot_factor": dict(fallback.windowed_dot_factor),
         "windowed_out_s": dict(fallback.windowed_out_s),
         "windowed_ring_hidden": fallback.windowed_ring_hidden}
  if not fired:
    notes.append("windowed-einsum terms come from the fallback (compile a topology whose "
                 "mesh has an axis of 8 or more devices)")
    return out
  parts = {}
  for r in fired:
    (_, size, _, shard), _ = windowed_movement(problem_of(r), r["dataflow"])
    parts[id(r)] = (size, shard, windowed_parts(problem_of(r), r["dataflow"],
                                                profile_for_mesh(profile, tuple(r["mesh"])),
                                                None))
  out["windowed_min_ring"] = min(parts[id(r)][0] for r in fired)
  for flow in DATAFLOWS:
    mine = [r for r in fired if r["dataflow"] == flow]
    if not mine:
      notes.append(f"{flow}: windowed einsum never fired; its terms from the fallback")
      continue
    out["windowed_min_bytes"][flow] = float(min(parts[id(r)][1] for r in mine))
    out["windowed_dot_factor"][flow] = round(statistics.median(
        r["dot_cycles"] / dense[_key(r)]["dot_cycles"] for r in mine), 3)
    out["windowed_out_s"][flow] = float("%.4g" % statistics.median(
        (r["compute_cycles"] - r["dot_cycles"]) / clock_hz / parts[id(r)][2][2]
        for r in mine))
  def error(hidden):
    total = 0.0
    for r in fired:
      other_s, _, out_elems, ring_s = parts[id(r)][2]
      flow = r["dataflow"]
      loop = (out["windowed_dot_factor"][flow] * dense[_key(r)]["dot_cycles"] / clock_hz
              + out_elems * out["windowed_out_s"][flow])
      predicted = other_s + loop + max(0.0, ring_s - hidden * loop)
      total += abs(predicted / r["step_s"] - 1)
    return total
  out["windowed_ring_hidden"] = min((h / 20 for h in range(21)), key=error)
  return out

