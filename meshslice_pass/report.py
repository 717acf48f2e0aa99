"""The report of what the pass rewrote, how, and why not."""
from __future__ import annotations

import dataclasses


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
  def rewritten(self) -> tuple:
    return tuple(s for s in self.sites if s.rewritten)

  @property
  def left_alone(self) -> tuple:
    return tuple(s for s in self.sites if not s.rewritten)

  def write_trace(self, path: str) -> None:
    """Write the predicted schedule of every rewritten site (compute stream and each
    mesh axis's link, sites laid end to end) as Chrome/Perfetto trace JSON: open it in
    ui.perfetto.dev or chrome://tracing to see what overlaps what."""
    from meshslice import costmodel
    from .costing import model_dataflow
    schedules = []
    for s in self.rewritten:
      label = f"#{s.index} {s.algorithm} {s.dataflow} S={s.ksplit} ({s.source})"
      schedules.append((label, costmodel.schedule(s.problem, s.algorithm,
                                                  model_dataflow(s.dataflow), s.ksplit,
                                                  self.hardware)))
    costmodel.write_trace(path, costmodel.trace_events(schedules))

  @property
  def predicted_seconds(self) -> float:
    """Predicted time of the rewritten sites under the chosen plan (one execution each)."""
    return sum(s.predicted_seconds or 0.0 for s in self.rewritten)

  @property
  def baseline_seconds(self) -> float:
    """Predicted time of the same sites with the collective algorithm."""
    return sum(s.baseline_seconds or 0.0 for s in self.rewritten)

  def __str__(self) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items()) or "none"
    head = (f"meshslice report: {len(self.rewritten)} of {len(self.sites)} matmuls "
            f"rewritten (mesh {mesh}{', profile ' + self.profile if self.profile else ''})")
    cols = ("#", "source", "dir", "where", "lhs", "rhs", "out", "plan", "pred us", "coll us",
            "reason / note")
    rows = []
    for s in self.sites:
      if s.rewritten:
        axes = (f"r={s.mesh_axes[0] or '-'} c={s.mesh_axes[1] or '-'}"
                if len(s.mesh_axes) == 2 else f"axis={s.mesh_axes[0]}")
        plan = f"{s.algorithm} {s.dataflow} S={s.ksplit} {axes}"
      else:
        plan = "left alone"
      rows.append((str(s.index), _short(s.source), s.direction[:3], s.context,
                   f"{_shape(s.lhs_shape)} {s.lhs_spec}", f"{_shape(s.rhs_shape)} {s.rhs_spec}",
                   s.out_spec, plan, _us(s.predicted_seconds), _us(s.baseline_seconds),
                   s.reason or s.note))
    widths = [max(len(c), *(len(r[k]) for r in rows)) if rows else len(c)
              for k, c in enumerate(cols)]
    fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
    lines = [head, *(f"note: {n}" for n in self.notes), fmt(cols), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    if self.rewritten:
      pred, base = self.predicted_seconds, self.baseline_seconds
      lines.append(f"total predicted for the rewritten sites: {pred * 1e6:.1f} us vs "
                   f"{base * 1e6:.1f} us with the collective algorithm "
                   f"({base / pred if pred else 1.0:.2f}x)")
    return "\n".join(lines)


def _us(seconds) -> str:
  return "" if seconds is None else f"{seconds * 1e6:.1f}"


def _shape(shape) -> str:
  return "[" + ",".join(map(str, shape)) + "]"


def _short(source: str) -> str:
  if "/" not in source:
    return source
  return source.rsplit("/", 1)[1]
