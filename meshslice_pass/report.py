"""The report of what the pass rewrote, how, and why not."""
from __future__ import annotations

import collections
import dataclasses
import re


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Report:
  """Every dot_general the pass considered, in program order.

  Example:
    >>> report = meshslice.explain(step)(params, batch)      # doctest: +SKIP
    >>> [s.dataflow for s in report.sites if s.rewritten]     # doctest: +SKIP
    ['os', 'ls', 'rs']
    >>> print(report)                                         # doctest: +SKIP
  """

  sites: tuple
  mesh_shape: dict
  profile: str = ""
  notes: tuple = ()
  hardware: object = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def plan(self):
    """The decisions as a `meshslice.Plan` (save it, edit it, pass it back)."""
    from .plan import Plan
    return Plan.from_report(self)

  @property
  def measured_on_compiled_steps(self) -> tuple:
    """The rewritten sites planned by a rule measured on compiled steps (the v4 step
    template, the tpu7x collective-over-XLA rule) rather than by the per-site model:
    `xla_sites_seconds / plan_sites_seconds` understates what they gain."""
    from .pins import COLLECTIVE_OVER_XLA_RULE, STEP_TEMPLATE_RULE
    return tuple(s for s in self.rewritten
                 if getattr(s, "rule", "") in (STEP_TEMPLATE_RULE, COLLECTIVE_OVER_XLA_RULE))

  @property
  def rewritten(self) -> tuple:
    return tuple(s for s in self.sites if s.rewritten)

  @property
  def left_alone(self) -> tuple:
    return tuple(s for s in self.sites if not s.rewritten)

  @property
  def sliced(self) -> tuple:
    """Rewritten sites whose communication is cut into slices or steps that overlap
    computation: ksplit > 1, or a ring/step algorithm (wang, cannon, summa)."""
    return tuple(s for s in self.rewritten if is_sliced(s))

  @property
  def collective(self) -> tuple:
    """Rewritten sites re-emitted as the plain collective algorithm (all-gather, matmul,
    reduce-scatter; nothing overlapped): what GSPMD would do, in a shard_map."""
    return tuple(s for s in self.rewritten if not is_sliced(s))

  def reasons(self) -> tuple:
    """The left-alone sites grouped by reason class: ((label, site indexes), ...),
    largest group first (ties in program order)."""
    return reason_groups(self.left_alone)

  def plan_counts(self, reduce_scatter: bool = False) -> dict:
    """How many rewritten sites got each plan: {"<algorithm> <dataflow> S=<ksplit>":
    count}, in key order. With `reduce_scatter`, a site whose reduce-scatter is not one
    collective has its form in the key too (" rs=all_to_all").

    Example:
      >>> report.plan_counts()                                  # doctest: +SKIP
      {'collective os S=1': 11, 'meshslice rs S=2': 6}
    """
    counts: dict = {}
    for s in self.rewritten:
      key = f"{s.algorithm} {s.dataflow} S={s.ksplit}"
      if reduce_scatter and getattr(s, "reduce_scatter", None):
        key += f" rs={s.reduce_scatter}"
      counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))

  def summary(self) -> str:
    """One line: how many matmuls are sliced, plain collective, left alone (and why)."""
    alone = self.left_alone
    why = ", ".join(f"{len(ix)} {label}" for label, ix in self.reasons())
    return (f"{len(self.sites)} matmul{'s' if len(self.sites) != 1 else ''}: "
            f"{len(self.sliced)} sliced/overlapped, {len(self.collective)} plain collective, "
            f"{len(alone)} left alone" + (f" ({why})" if why else ""))

  def write_trace(self, path: str) -> None:
    """Write the predicted schedule of every rewritten site (compute stream and each
    mesh axis's link, sites laid end to end) as Chrome/Perfetto trace JSON: open it in
    ui.perfetto.dev or chrome://tracing to see what overlaps what. Each site is timed
    with the profile the planner used for it (`costing.site_profile`: bandwidths of its
    own mesh axes, derived from the topology), so a span lasts the site's predicted time
    less any reshard the planner added before it."""
    from meshslice import costmodel
    from .costing import model_dataflow, site_profile
    schedules = []
    for s in self.rewritten:
      label = f"#{s.index} {s.algorithm} {s.dataflow} S={s.ksplit} ({s.source})"
      # the planner's own (it saw the mesh's devices: slices, DCN); recomputed only for
      # sites made elsewhere
      profile = s.profile or site_profile(self.hardware, s.geometry, self.mesh_shape)
      schedules.append((label, costmodel.schedule(s.problem, s.algorithm,
                                                  model_dataflow(s.dataflow), s.ksplit,
                                                  profile)))
    costmodel.write_trace(path, costmodel.trace_events(schedules))

  @property
  def predicted_seconds(self) -> float:
    """Predicted time of the rewritten sites under the chosen plan (one execution each)."""
    return sum(s.predicted_seconds or 0.0 for s in self.rewritten)

  @property
  def baseline_seconds(self) -> float:
    """Predicted time of the same sites with the collective algorithm."""
    return sum(s.baseline_seconds or 0.0 for s in self.rewritten)

  @property
  def predicted_step_seconds(self) -> float:
    """Predicted time of the rewritten sites in one call of the step: each site's
    predicted time times how often it runs (`Site.runs`: a site inside a scan over the
    layers is listed once but runs once per layer; a while loop counts once). Only the
    rewritten matmuls: nothing else of the step is priced."""
    return sum((s.predicted_seconds or 0.0) * _runs(s) for s in self.rewritten)

  @property
  def baseline_step_seconds(self) -> float:
    """`predicted_step_seconds` of the same sites with the collective algorithm."""
    return sum((s.baseline_seconds or 0.0) * _runs(s) for s in self.rewritten)

  @property
  def compared(self) -> list:
    """The sites the planner priced against XLA's own program for them (rewritten or
    left to XLA; `Site.xla_seconds` known): what `xla_sites_seconds` sums."""
    return [s for s in self.sites if s.xla_seconds is not None]

  @property
  def xla_sites_seconds(self) -> float:
    """Predicted time of XLA's own program for the `compared` sites in one call of the
    step (each times `Site.runs`), the planner's estimate of what the plan replaces."""
    return sum(s.xla_seconds * _runs(s) for s in self.compared)

  @property
  def plan_sites_seconds(self) -> float:
    """Predicted time of the plan for the same sites (a site left to XLA at XLA's
    time). `xla_sites_seconds / plan_sites_seconds` is the speed-up the per-site model
    predicts for them; the step's other work (attention, elementwise, optimizer) is not
    priced, so the step's own ratio is nearer 1 (docs/benchmarks.md compares the two)."""
    return sum((s.predicted_seconds or s.xla_seconds) * _runs(s) for s in self.compared)

  def __str__(self) -> str:
    # size-1 axes (MaxText's mesh has ten of them) shard nothing: named only by count
    shown = {k: v for k, v in self.mesh_shape.items() if v != 1}
    mesh = " x ".join(f"{k}={v}" for k, v in shown.items()) or "none"
    if len(shown) < len(self.mesh_shape):
      ones = len(self.mesh_shape) - len(shown)
      mesh += f" (+{ones} {'axes' if ones > 1 else 'axis'} of size 1)"
    head = (f"meshslice report: mesh {mesh}"
            f"{', profile ' + self.profile if self.profile else ''}; {self.summary()}")
    cols = ("#", "source", "module", "dir", "where", "lhs", "rhs", "out", "plan", "pred us",
            "coll us", "reason / note")
    rows = []
    for s in self.sites:
      if s.rewritten:
        axes = (f"r={s.mesh_axes[0] or '-'} c={s.mesh_axes[1] or '-'}"
                if len(s.mesh_axes) == 2 else f"axis={s.mesh_axes[0]}")
        plan = f"{s.algorithm} {s.dataflow} S={s.ksplit} {axes}"
        if getattr(s, "reduce_scatter", None):
          plan += f" rs={s.reduce_scatter}"
        if getattr(s, "hold_gathers", None):
          plan += " held"
      else:
        plan = "left alone"
      rows.append((str(s.index), s.source, getattr(s, "module", ""), s.direction[:3],
                   s.context,
                   f"{_shape(s.lhs_shape)} {s.lhs_spec}", f"{_shape(s.rhs_shape)} {s.rhs_spec}",
                   s.out_spec, plan, _us(s.predicted_seconds), _us(s.baseline_seconds),
                   _why(s)))
    widths = [max(len(c), *(len(r[k]) for r in rows)) if rows else len(c)
              for k, c in enumerate(cols)]
    fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
    lines = [head, *(f"note: {n}" for n in self.notes), fmt(cols),
             fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    if self.rewritten:
      pred, base = self.predicted_seconds, self.baseline_seconds
      lines.append(f"total predicted for the rewritten sites: {pred * 1e6:.1f} us vs "
                   f"{base * 1e6:.1f} us with the collective algorithm "
                   f"({base / pred if pred else 1.0:.2f}x)")
    if self.compared:
      xla, plan = self.xla_sites_seconds, self.plan_sites_seconds
      lines.append(f"the {len(self.compared)} sites priced against XLA's own program: "
                   f"{plan * 1e6:.1f} us vs {xla * 1e6:.1f} us per step "
                   f"({xla / plan if plan else 1.0:.2f}x; nothing else of the step priced)")
      measured = self.measured_on_compiled_steps
      if measured:
        lines.append(f"{len(measured)} of them follow a plan chosen on compiled steps, not "
                     "on this per-site model, whose gain is in the step's schedule and "
                     "not in this sum (docs/tpu.md)")
    groups = self.reasons()
    if groups:
      lines.append("left alone, by reason:")
      by_index = {s.index: s for s in self.left_alone}
      for label, indexes in groups:
        example = by_index[indexes[0]].reason
        lines.append(f"  {len(indexes)} x {label}: sites {_ranges(indexes)}"
                     + (f" (e.g. {example})" if example != label else ""))
    return "\n".join(lines)


def _runs(site) -> int:
  """How often `site` runs per call (`Site.runs`; 1 for a site that does not say)."""
  return getattr(site, "runs", 1) or 1


def _why(site) -> str:
  """The reason / note column: a left-alone site's reason, and what its pins did not do
  (`Site.pin_notes`); a rewritten site's note (which holds those too)."""
  if not site.reason:
    return site.note
  return "; ".join((site.reason, *getattr(site, "pin_notes", ())))


def _us(seconds) -> str:
  return "" if seconds is None else f"{seconds * 1e6:.1f}"


def _shape(shape) -> str:
  return "[" + ",".join(map(str, shape)) + "]"


_STEP_ALGORITHMS = ("wang", "cannon", "summa")


def is_sliced(site) -> bool:
  """Whether a rewritten site overlaps communication with computation."""
  return bool(site.rewritten) and ((site.ksplit or 1) > 1
                                   or site.algorithm in _STEP_ALGORITHMS)


def reason_class(reason: str) -> str:
  """A left-alone reason without its particulars, to group sites by: the clause before
  the first ': ', or, when that clause names particulars (axis names, numbers), the
  clause after it up to the first ',' or ';'; quoted names become '…', numbers N, and
  bracketed or parenthesised parts are dropped."""
  reason = reason.strip() or "no reason given"
  head, _, rest = reason.partition(": ")
  if rest and re.search(r"['\"\d]", head):
    head = re.split(r"[,;]", re.sub(r"\([^)]*\)", "", rest), maxsplit=1)[0]
  head = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", head)
  head = re.sub(r"\[[^\]]*\]|\([^)]*\)", "", head)
  head = re.sub(r"\d+", "N", head)
  return re.sub(r"\s+", " ", head).strip()[:80]


def reason_groups(sites) -> tuple:
  """((reason class, site indexes), ...) of not-rewritten `sites`, largest first."""
  groups = collections.OrderedDict()
  for s in sites:
    groups.setdefault(reason_class(s.reason), []).append(s.index)
  ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
  return tuple((label, tuple(ix)) for label, ix in ordered)


def _ranges(indexes) -> str:
  out, start = [], None
  for k, i in enumerate(indexes):
    if start is None:
      start = i
    if k + 1 == len(indexes) or indexes[k + 1] != i + 1:
      out.append(str(start) if start == i else f"{start}-{i}")
      start = None
  return ", ".join(out)
