"""How a plan is chosen for one site: the autotuner's rule and the pass's, side by side.

  best_plan(problem, profile)       the autotuner's: the fastest predicted (algorithm,
                                    dataflow, ksplit, options); ties to the earlier
  choose(problem, profile, flow, ...)  the pass's: among the plans that fit the chip's
                                    memory, the fewest slices predicted within NEAR_TIE
                                    of the fastest (`predict`: with the compiler terms)
  leave_to_xla(seconds, ..., xla)   the pass's second step: XLA's own program for the
                                    site (`xla_program`) runs it unless the plan is
                                    predicted faster by more than XLA_MARGIN

Why a module of its own: both rules read the cost model only (`timing`, `memory`,
`xla_baseline`), so they live in the cost model, where the mesh study (`mesh_study`) and
the pass (`meshslice.costing`, which re-exports the pass's names) both reach them; one
file shows where and why they differ (`best_plan`). Nothing here reads the environment
or the program: a choice is a function of the problem, the profile and the arguments.
"""
from __future__ import annotations

import dataclasses
import typing

from . import timing, xla_baseline
from .memory import gib as _gib
from .memory import site_memory, site_peak_bytes, why_too_big
from .profiles import HardwareProfile, load_profile
# `predict` below is the pass's (seconds, re-priced with compiler terms); the model's own,
# which both rules rank by, is called as timing.predict
from .timing import ALGORITHMS, DATAFLOWS, Cost, GemmProblem, wang_ring_axis, why_invalid

# The default candidates: the algorithms the pass chooses among by itself
# (meshslice.costing.AUTO_ALGORITHMS is this tuple, re-exported). cannon, wang and
# summa are emitted only when pinned, so a default that ranked them would recommend plans
# the pass never makes unasked.
EMITTABLE = ("collective", "meshslice")

# Two predictions within this fraction of each other are a near tie (inside the model's
# error): the pass's `choose` takes the fewest slices among the plans within it of the
# fastest, and the mesh study marks a runner-up mesh shape within it
# (`mesh_study.MeshRecommendation.near_tie`).
NEAR_TIE = 0.02


# ----------------------------------------------------------------------------- autotuner's rule

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
  """The autotuner's pick for one site.

  Attributes:
    algorithm, dataflow, ksplit: what to emit.
    options: the algorithm's keyword options as sorted (name, value) pairs, e.g.
      (("bidirectional", True), ("ring", "row")) for wang; pass them on with
      `**dict(choice.options)` (to `predict`, `schedule` or rewrites.build_body).
    cost: its predicted Cost.
    baseline: the predicted Cost of the plain collective algorithm, same dataflow.

  Example:
    >>> p = GemmProblem(m=65536, n=12288, k=12288, rows=8, cols=8)
    >>> c = best_plan(p, "tpu-v4", dataflows=("os",))
    >>> c.algorithm, c.dataflow, c.ksplit, c.options, c.speedup > 1
    ('meshslice', 'os', 8, (), True)
  """

  algorithm: str
  dataflow: str
  ksplit: int
  options: tuple[tuple[str, object], ...] = ()
  cost: Cost
  baseline: Cost

  @property
  def speedup(self) -> float:
    """baseline time / predicted time."""
    return self.baseline.total_s / self.cost.total_s if self.cost.total_s else 1.0

  @property
  def label(self) -> str:
    """The algorithm with its options, e.g. "wang(bidirectional=True, ring=row)"."""
    if not self.options:
      return self.algorithm
    return f"{self.algorithm}({', '.join(f'{k}={v}' for k, v in self.options)})"


def _check_choices(values, allowed, name):
  values = tuple(values)
  if not values:
    raise ValueError(f"{name} must not be empty; choose from {allowed}")
  for v in values:
    if v not in allowed:
      raise ValueError(f"{name} must be drawn from {allowed}, got {v!r}")
  return values


def _check_positive(value, name):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def variants(problem: GemmProblem, algorithm: str) -> tuple[dict, ...]:
  """The option sets the autotuner tries for `algorithm`, in its fixed order.

  wang: ring over row, then col (no ring option on a 1D problem: its one real axis is
  the default), each unidirectional then bidirectional. Others: no options.

  Example:
    >>> variants(GemmProblem(m=8, n=8, k=8, rows=2, cols=2), "wang")[:2]
    ({'ring': 'row', 'bidirectional': False}, {'ring': 'row', 'bidirectional': True})
  """
  if algorithm != "wang":
    return ({},)
  rings = ("row", "col") if min(problem.rows, problem.cols) > 1 else (None,)
  return tuple({**({"ring": r} if r else {}), "bidirectional": b}
               for r in rings for b in (False, True))


def _block(problem, algorithm, dataflow, ksplit, options) -> int:
  """Elements of the communicated dim in one slice / chunk of one device's block."""
  extent = problem.extent(dataflow)
  if algorithm == "wang":
    n = problem.rows if wang_ring_axis(problem, options.get("ring")) == "row" else problem.cols
    return extent // (n * ksplit * (2 if options.get("bidirectional") else 1))
  return extent // (ksplit * problem.lcm)


def valid_ksplits(problem: GemmProblem, dataflow: str, max_ksplit: int = 16,
                  min_block: int = 1, algorithm: str = "meshslice",
                  **options) -> tuple[int, ...]:
  """The ksplits <= max_ksplit that `algorithm` (with `options`) can use on `problem`
  (see `why_invalid`), keeping only those whose slices / chunks hold >= min_block
  elements of the communicated dim (ksplit = 1 is always kept when valid). For
  meshslice: S * lcm(R, C) divides the extent and B = extent / (S * lcm(R, C)).

  Example:
    >>> p = GemmProblem(m=64, n=64, k=96, rows=2, cols=4)
    >>> valid_ksplits(p, "os", 16)
    (1, 2, 3, 4, 6, 8, 12)
    >>> valid_ksplits(p, "os", 16, algorithm="wang", ring="col", bidirectional=True)
    (1, 2, 3, 4, 6, 12)
  """
  _check_positive(max_ksplit, "max_ksplit")
  _check_positive(min_block, "min_block")
  return tuple(s for s in range(1, max_ksplit + 1)
               if not why_invalid(problem, algorithm, dataflow, s, **options)
               and (s == 1 or _block(problem, algorithm, dataflow, s, options) >= min_block))


def best_plan(problem: GemmProblem, profile: HardwareProfile | str, *,
              dataflows=DATAFLOWS, algorithms=EMITTABLE, max_ksplit: int = 16,
              min_block: int = 1, memory_budget: float | None = None) -> Choice:
  """The fastest predicted (algorithm, dataflow, ksplit, options) for `problem`.

  Args:
    dataflows: the dataflows the site's layouts allow (a transformer's forward matmul
      is "os", backward-data "ls", backward-weight "rs").
    algorithms: candidates, by name; default `EMITTABLE` (collective, meshslice: what
      the pass chooses among without a pinned algorithm). Each algorithm tries its
      `variants` and every `valid_ksplits` value.
    max_ksplit, min_block: bounds on slicing (see `valid_ksplits`).
    memory_budget: bytes per device the site's output and communication buffers may
      take (`memory.site_memory`); candidates that need more are skipped. None: no limit.

  Candidates are tried in a fixed order (ALGORITHMS, DATAFLOWS, variants, ksplit
  ascending) and only a strictly faster one replaces the best so far, so ties go to the
  earlier: collective before meshslice with S = 1 (the same program), smaller ksplit
  before larger.

  The rule: the fastest prediction wins outright. The pass decides its sites by another
  (`site_choice.choose`): the fewest slices among the plans predicted within NEAR_TIE of the
  fastest, then XLA's own program unless the plan beats it by more than XLA_MARGIN
  (`leave_to_xla`). They differ on purpose. The pass emits its pick, and every extra
  slice costs the compiled program more than the model prices (docs/tpu.md, "Fewer
  slices on thin margins"), so it takes no gain inside the model's error. best_plan
  answers what the model predicts is fastest: the question the mesh study asks of every
  GEMM (`recommend_mesh`, `compare_algorithms`), and the one the original autotuner
  answered, which `assume="paper"` reproduces. So among the same candidates it may pick
  more slices than the pass would, and it never weighs XLA's program.

  Raises:
    ValueError: bad arguments, or no candidate can run the problem (the message says
      why each could not).

  Example:
    >>> tiny = GemmProblem(m=64, n=64, k=64, rows=2, cols=2)   # compute is negligible
    >>> c = best_plan(tiny, "tpu-v4", dataflows=("os",))
    >>> c.algorithm, c.ksplit
    ('collective', 1)
  """
  profile = load_profile(profile)
  dataflows = _check_choices(dataflows, DATAFLOWS, "dataflows")
  algorithms = _check_choices(algorithms, ALGORITHMS, "algorithms")
  _check_positive(max_ksplit, "max_ksplit")
  _check_positive(min_block, "min_block")
  best, reasons, short = None, {}, {}
  for algorithm in (a for a in ALGORITHMS if a in algorithms):
    for dataflow in (d for d in DATAFLOWS if d in dataflows):
      for options in variants(problem, algorithm):
        ksplits = valid_ksplits(problem, dataflow, max_ksplit, min_block, algorithm,
                                **options)
        if not ksplits:
          reason = why_invalid(problem, algorithm, dataflow, 1, **options)
          reasons.setdefault(f"{algorithm}/{dataflow}: {reason}", None)
        for ksplit in ksplits:
          if memory_budget is not None:
            need = site_memory(problem, algorithm, dataflow, ksplit, **options)
            if need > memory_budget:
              key = f"{algorithm}/{dataflow}"
              short[key] = min(short.get(key, need), need)
              continue
          cost = timing.predict(problem, algorithm, dataflow, ksplit, profile, **options)
          if best is None or cost.total_s < best.cost.total_s:
            best = Choice(algorithm=algorithm, dataflow=dataflow, ksplit=ksplit,
                          options=tuple(sorted(options.items())), cost=cost, baseline=cost)
  for key, need in short.items():
    reasons.setdefault(f"{key}: needs at least {_gib(need)} of buffers, "
                       f"{_gib(memory_budget)} free", None)
  if best is None:
    raise ValueError(f"no candidate can run {problem}: " + "; ".join(reasons))
  baseline = timing.predict(problem, "collective", best.dataflow, 1, profile)
  return dataclasses.replace(best, baseline=baseline)


# ----------------------------------------------------------------------------- pass's rule

# A rewrite is emitted only when it is predicted faster than XLA's own program for the
# site (under the same flags) by more than this fraction: inside it the prediction
# cannot tell them apart, and leaving the site to XLA costs nothing (the program compiles
# as plain jit would). Larger than NEAR_TIE, the margin between two rewrites: a rewrite
# also pays what the per-site model does not see (pipeline fill and drain at site
# boundaries, barriers that stop XLA's scheduler overlapping independent work across
# sites, docs/tpu.md), which XLA's own program does not.
XLA_MARGIN = 0.05

# Prefix of the reason a site is left alone with when none of its plans fits HBM.
NO_PLAN_FITS = "no plan fits HBM"


def predict(problem, profile, algorithm, dataflow, ksplit, terms=None,
            offloaded=frozenset(), forward=False) -> float:
  """Predicted seconds of a candidate plan: the analytic model, re-priced with the
  compiler terms when given (`xla_baseline.compiled_seconds`). With collectives
  offloaded to the SparseCore (`offloaded`, v5p / v6e: `backend_flags.sparse_core_offload`)
  the collective and meshslice algorithms, whose collectives libtpu offloads as it does
  XLA's, are priced at their overlap limit, or for a forward-pass site (`forward`) with
  its activations' collectives waited on (`xla_baseline.offloaded_seconds`)."""
  if offloaded and algorithm in ("collective", "meshslice"):
    return float(xla_baseline.offloaded_seconds(problem, dataflow, profile, terms, offloaded,
                                                algorithm, ksplit, forward=forward))
  if terms is not None:
    return float(xla_baseline.compiled_seconds(problem, algorithm, dataflow, ksplit,
                                               profile, terms))
  return float(timing.predict(problem, algorithm, dataflow, ksplit, profile).total_s)


def xla_program(problem, profile, dataflow, baseline, terms,
                windowed_off=frozenset(), offloaded=frozenset(),
                forward=False) -> xla_baseline.XlaProgram:
  """XLA's own program for the site under `baseline` ("windowed" or "dense"). Windowed
  einsum loops an all-gather or a reduce-scatter, never an all-reduce, so an all-reduce
  site gets XLA's dense program either way; nor does it fire for a collective the
  user's libtpu flags turn it off for (`windowed_off`: a subset of {"all_gather",
  "reduce_scatter"}, `backend_flags.windowed_einsum_off`), which XLA then runs dense.
  When the flags offload collectives to the SparseCore (`offloaded`, v5p / v6e:
  `backend_flags.sparse_core_offload`), XLA's dense program runs the offloaded ones
  beside its compute (`xla_baseline.offloaded_seconds`; `forward`: a forward-pass site,
  whose activations' collectives are waited on).

  Example:
    >>> from meshslice.costmodel import GemmProblem, load_profile
    >>> p = GemmProblem(m=65536, n=8192, k=8192, rows=8, cols=8)
    >>> terms = xla_baseline.builtin_terms("tpu-v4")
    >>> xla_program(p, load_profile("tpu-v4"), "ls", "windowed", terms).windowed
    True
    >>> xla_program(p, load_profile("tpu-v4"), "ls", "windowed", terms,
    ...             windowed_off={"reduce_scatter"}).windowed
    False
  """
  if problem.reduction == "all_reduce" or _gathers_a_contracting_dim_only(problem, dataflow):
    baseline = "dense"
  elif baseline == "windowed" and windowed_off:
    (kind, *_), _ = xla_baseline.windowed_movement(problem, dataflow)
    if kind in windowed_off:
      baseline = "dense"
  xla = xla_baseline.xla_seconds(problem, dataflow, profile, terms, baseline)
  if offloaded and not xla.windowed:
    seconds = xla_baseline.offloaded_seconds(problem, dataflow, profile, terms, offloaded,
                                             forward=forward)
    names = [k.replace("_", "-") + "s" for k in sorted(offloaded)]
    kinds = " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))
    return xla_baseline.XlaProgram(
        seconds=min(seconds, xla.seconds), windowed=False,
        description=f"dense program, {kinds} offloaded to the SparseCore")
  return xla


def _gathers_a_contracting_dim_only(problem, dataflow: str) -> bool:
  """An OS site with one axis of size 1 (an FSDP weight, or a sequence-parallel weight
  gradient's operand, gathered along its contracting dim). XLA all-gathers that operand
  and runs a local dot; it does not window it. Measured (docs/tpu.md, "One-axis
  meshes"): GPT-3's layer on v4:2x2x2 as 8x1 under libtpu 0.0.42.1 with windowed einsum
  on made none of its weight gathers a windowed loop. Priced as windowed einsum (16.5 ms
  where XLA's gather and dot take 2.6), they were rewritten, and the step compiled 1.32x
  slower than XLA's under the same flags (1.31x routed)."""
  return dataflow == "os" and 1 in (problem.rows, problem.cols)


def leave_to_xla(best_seconds, best_is_collective, xla, margin=XLA_MARGIN, *,
                 same_program=False) -> bool:
  """Whether XLA's program should run the site rather than the best rewrite: unless the
  rewrite is predicted faster than XLA's program by more than `margin` (a fraction of
  the rewrite's time: best * (1 + margin) < xla), the site is left to XLA.

  same_program: the collective rewrite compiles to the very program XLA would run for
  the site (CPU and GPU meshes: the same synchronous all-gathers, dot and
  reduce-scatter), so a tie with XLA's dense program keeps it. Not on TPU, where XLA
  schedules its own collectives under the async flags and may partition differently, so
  re-emitting such ties can make a step slower than XLA's (docs/benchmarks-log.md, "Fair
  rivals under safe flags").

  Example:
    >>> from meshslice.costmodel.xla_baseline import XlaProgram
    >>> xla = XlaProgram(seconds=1.0, windowed=False, description="dense program")
    >>> leave_to_xla(0.97, False, xla), leave_to_xla(0.90, False, xla)
    (True, False)
    >>> leave_to_xla(1.0, True, xla), leave_to_xla(1.0, True, xla, same_program=True)
    (True, False)
  """
  if best_is_collective and same_program and not xla.windowed:
    return best_seconds > xla.seconds * (1 + 1e-9)
  return not best_seconds * (1 + margin) < xla.seconds


class PlanChoice(typing.NamedTuple):
  """What `choose` picked: the plan, its predicted seconds and a note. When no candidate
  fits the chip's memory, algorithm, ksplit and seconds are None and note says why
  ("no plan fits HBM: ...")."""

  algorithm: str | None
  ksplit: int | None
  seconds: float | None
  note: str


def choose(problem, profile, dataflow, *, algorithms, ksplits, terms=None,
           offloaded=frozenset(), forward=False) -> PlanChoice:
  """Among the candidates that fit the chip's memory (`costmodel.why_too_big` with the
  profile's HBM capacity; a profile without one excludes nothing), the one with the
  fewest slices (candidate order: collective, then meshslice by ascending ksplit) whose
  predicted time is within `NEAR_TIE` of the fastest, as a `PlanChoice`. The note says when
  that overrode the fastest prediction, else names a runner-up within `NEAR_TIE` (a
  decision on a thin margin), and the candidates excluded for memory. None when no
  candidate can run the problem.

  `ksplits` are the slice counts the site's geometry can realise exactly; the cost
  model is asked only about those; `offloaded` and `forward` are `predict`'s.

  Example:
    >>> from meshslice.costmodel import GemmProblem, load_profile
    >>> p = GemmProblem(m=524288, n=81920, k=20480, rows=2, cols=128)   # 40 GiB unsliced
    >>> pick = choose(p, load_profile("tpu-v4"), "ls", algorithms=EMITTABLE,
    ...               ksplits=(1, 2, 4, 16))
    >>> pick.algorithm, pick.ksplit      # S=16 is predicted 0.0% faster: inside the error
    ('meshslice', 4)
    >>> pick.note.split("; ")[-1]                       # doctest: +NORMALIZE_WHITESPACE
    'excluded for memory: collective S=1 needs 40.4 GiB per chip (input shards 92.5 MiB,
     output and buffers 40.3 GiB), 32.0 GiB free of 32.0 GiB HBM (+1 more)'
  """
  # meshslice with one slice emits the collective algorithm: not a different plan
  same = lambda a, k: ("collective", 1) if a == "meshslice" and k == 1 else (a, k)
  ranked, too_big = [], {}
  for algorithm in algorithms:
    for ksplit in ((1,) if algorithm == "collective" else ksplits):
      if why_invalid(problem, algorithm, dataflow, ksplit):
        continue
      why = why_too_big(problem, algorithm, dataflow, ksplit, profile)
      if why:
        too_big.setdefault(same(algorithm, ksplit), why)
        continue
      ranked.append((predict(problem, profile, algorithm, dataflow, ksplit, terms, offloaded,
                             forward), len(ranked), algorithm, ksplit))
  if not ranked and too_big:
    # the plan nearest to fitting says how far off the site is
    (algorithm, ksplit), why = min(too_big.items(), key=lambda item: site_peak_bytes(
        problem, item[0][0], dataflow, item[0][1]))
    return PlanChoice(None, None, None, f"{NO_PLAN_FITS}: {algorithm} S={ksplit} {why}")
  if not ranked:
    return None
  ranked.sort()   # ties keep candidate order: the simpler algorithm, the smaller ksplit
  fastest = ranked[0]
  # Inside the model's error the simplest candidate wins (candidate order: collective,
  # then fewer slices). Every extra slice costs the compiled program more than the model
  # prices (cutting lane-dim slices, float32 partial-sum passes, thinner dots; measured
  # on the TPU compiler, docs/tpu.md), so a predicted gain this small is not one.
  simplest = min((r for r in ranked if r[0] <= fastest[0] * (1 + NEAR_TIE)),
                 key=lambda r: r[1])
  best, _, algorithm, ksplit = simplest
  rest = [r for r in ranked if same(r[2], r[3]) != same(algorithm, ksplit)]
  notes = []
  if simplest is not fastest:
    notes.append(f"fewer slices than {fastest[2]} S={fastest[3]} (predicted "
                 f"{(best / fastest[0] - 1) * 100:.1f}% faster, within the model's "
                 f"{NEAR_TIE:.0%} error)")
  elif rest and best > 0 and rest[0][0] / best - 1 < NEAR_TIE:
    _, _, other, other_k = rest[0]
    notes.append(f"near tie: {other} S={other_k} predicted within "
                 f"{(rest[0][0] / best - 1) * 100:.1f}%")
  if too_big:
    (first, first_k), why = next(iter(too_big.items()))
    more = f" (+{len(too_big) - 1} more)" if len(too_big) > 1 else ""
    notes.append(f"excluded for memory: {first} S={first_k} {why}{more}")
  return PlanChoice(algorithm, ksplit, best, "; ".join(notes))
