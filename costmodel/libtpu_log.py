"""libtpu's own estimate of a compile: its latency-hiding scheduler's statistics, read
from the compile's stderr.

  read_scheduler_log(text) -> [SchedulerTotals]: one record per computation scheduled
  scheduler_entry / scheduler_cycles(log)  the entry computation's record / total
  scheduler_loop_cycles(log, schedule)     the loop bodies' totals times their trips
  capture_stderr()                         collects the log around a compile

Why a module of its own: this is not the compiled program but a log libtpu writes while
making it (only with SCHEDULER_LOG_ENV set before libtpu loads), in the units of the
scheduler's own cost model (`SchedulerTotals`). It is a second opinion set beside
`tpu_simulate`'s prediction, not an input to it, and needs of the reader (`tpu_read`)
only its loops. `tpu_schedule` re-exports it under the old names.
"""
from __future__ import annotations

import dataclasses
import os
import re

from .tpu_read import CompiledSchedule, Loop

# Environment that makes libtpu log its latency-hiding scheduler's statistics on stderr
# at compile time (set before libtpu loads, i.e. in a fresh process).
SCHEDULER_LOG_ENV = {"TPU_VMODULE": "latency_hiding_scheduler=1",
                     "TPU_STDERR_LOG_LEVEL": "0", "TPU_MIN_LOG_LEVEL": "0"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerTotals:
  """What libtpu's latency-hiding scheduler logged for one computation it scheduled.

  Units: the scheduler's own cost model ("cycles"), which is *not* the backend's
  `estimated_cycles` (measured on libtpu 0.0.42, docs/tpu.md "Our simulator against
  libtpu's"): elementwise fusions come out at 0.8-1.6x their estimated cycles, local
  bf16 dots at 1.5x (1024^3), 2.3x (2048^3), 6.1x (4096^3), 3.1x (8192^3), and an
  all-gather on v4:2x2x2 at 3/128 per operand byte whatever the group (2 or 4 chips).
  A `while` counts as one node of the entry computation, its body is logged on its own
  (`scheduler_loop_cycles`). So the total is libtpu's ranking signal, not a step time.

  Attributes:
    module, computation: as logged ("jit_f(0)", "main.0_spmd").
    cycles, wasted_cycles: "Total cycles" / "Total wasted cycles" after scheduling
      (before scheduling: `cycles_before`, `wasted_before`).
    wasted_by_kind: "Wasted cycles for <kind>" after scheduling (non-zero ones).
    memory_peak_bytes: "Memory pressure peak (bytes)" after scheduling.
  """

  module: str
  computation: str
  cycles: float = 0.0
  wasted_cycles: float = 0.0
  cycles_before: float = 0.0
  wasted_before: float = 0.0
  wasted_by_kind: dict = dataclasses.field(default_factory=dict)
  memory_peak_bytes: int = 0


_LHS_LINE = re.compile(r"latency_hiding_scheduler\.cc:\d+\]\s*"
                       r"(?:\[latency-hiding-scheduler\]\s*)?(.*)$")


def read_scheduler_log(text: str) -> list[SchedulerTotals]:
  """libtpu's latency-hiding-scheduler statistics in a compile's stderr (logged with
  SCHEDULER_LOG_ENV), one SchedulerTotals per (module, computation), in log order.

  Example:
    >>> log = '''x latency_hiding_scheduler.cc:4337] Statistics after scheduling:
    ... x latency_hiding_scheduler.cc:4341] For computation: main.0_spmd, module jit_f(0)
    ... x latency_hiding_scheduler.cc:4341] Total wasted cycles: 171851
    ... x latency_hiding_scheduler.cc:4341] Wasted cycles for all-gather: 171851
    ... x latency_hiding_scheduler.cc:4341] Total cycles: 1.0357e+06'''
    >>> t, = read_scheduler_log(log)
    >>> t.computation, t.cycles, t.wasted_by_kind
    ('main.0_spmd', 1035700.0, {'all-gather': 171851.0})
  """
  records, order, phase, key = {}, [], "after", None
  for raw in text.splitlines():
    match = _LHS_LINE.search(raw)
    if not match:
      continue
    line = match.group(1).strip()
    when = re.match(r"Statistics (before|after) scheduling", line)
    if when:
      phase, key = when.group(1), None
      continue
    comp = re.match(r"For computation:\s*([^,\s]+),?\s*(?:module\s+(\S+))?", line)
    if comp:
      key = (comp.group(2) or "", comp.group(1))
      if key not in records:
        records[key] = {"module": key[0], "computation": key[1], "wasted_by_kind": {}}
        order.append(key)
      continue
    value = re.search(r":\s*([-+0-9.eE]+)\s*$", line)
    if key is None or not value:
      continue
    rec, number = records[key], float(value.group(1))
    if line.startswith("Total cycles"):
      rec["cycles" if phase == "after" else "cycles_before"] = number
    elif line.startswith("Total wasted cycles"):
      rec["wasted_cycles" if phase == "after" else "wasted_before"] = number
    elif line.startswith("Wasted cycles for") and phase == "after" and number:
      rec["wasted_by_kind"][re.match(r"Wasted cycles for (.*?):", line).group(1)] = number
    elif line.startswith("Memory pressure peak") and phase == "after":
      rec["memory_peak_bytes"] = int(number)
  return [SchedulerTotals(**records[k]) for k in order]


def scheduler_entry(log, entry: str | None = None) -> SchedulerTotals | None:
  """libtpu's scheduler record for the entry computation of one compile's log (text or
  `read_scheduler_log`'s list): the record named `entry` (the HLO's ENTRY computation
  name) when present, else the last one logged; None when nothing was logged (libtpu logs
  only computations with async work to schedule)."""
  totals = read_scheduler_log(log) if isinstance(log, str) else list(log)
  if not totals:
    return None
  named = [t for t in totals if entry is not None and t.computation == entry]
  return (named or totals)[-1]


def scheduler_cycles(log, entry: str | None = None) -> float | None:
  """libtpu's scheduler "Total cycles" (after scheduling) for the entry computation
  (`scheduler_entry`); None when nothing was logged."""
  record = scheduler_entry(log, entry)
  return None if record is None else record.cycles


def scheduler_loop_cycles(log, schedule: "CompiledSchedule") -> float:
  """What libtpu's scheduler logged for the bodies of the schedule's `while` loops, each
  body's "Total cycles" times the times it runs (trip counts, nested loops multiplied);
  bodies it did not log count 0. The entry computation's total counts a `while` as one
  node whose cost is not that (measured on an XLA windowed-einsum GEMM, v4:4x4x4: the
  loop node 1.13M, its body 479k per trip x 8 trips), so put this beside it.

  Example:
    >>> log = '''x latency_hiding_scheduler.cc:1] Statistics after scheduling:
    ... x latency_hiding_scheduler.cc:1] For computation: body, module m(0)
    ... x latency_hiding_scheduler.cc:1] Total cycles: 100'''
    >>> loop = Loop(name="w", trip_count=8, trip_count_known=True, body=(),
    ...             body_computation="body")
    >>> scheduler_loop_cycles(log, CompiledSchedule(entries=(loop,)))
    800.0
  """
  totals = read_scheduler_log(log) if isinstance(log, str) else list(log)
  per_body = {t.computation: t.cycles for t in totals}
  def visit(entries, times):
    total = 0.0
    for e in entries:
      if isinstance(e, Loop):
        total += times * e.trip_count * per_body.get(e.body_computation, 0.0)
        total += visit(e.body, times * e.trip_count)
    return total
  return visit(schedule.entries, 1)


class capture_stderr:
  """Collect what this process (libtpu included: it writes to file descriptor 2) prints
  on stderr inside the `with` block, as `.text` afterwards.

  libtpu logs its scheduler only when SCHEDULER_LOG_ENV was in the environment before it
  loaded: use it in a fresh process (tests/test_tpu_schedule_reader.py does).

  Example:
    >>> with capture_stderr() as log:                              # doctest: +SKIP
    ...   compiled = jax.jit(f).lower(*args).compile()
    >>> scheduler_cycles(log.text)                                   # doctest: +SKIP
  """

  def __enter__(self):
    import sys
    import tempfile
    sys.stderr.flush()
    self._file = tempfile.TemporaryFile(mode="w+b")
    self._saved = os.dup(2)
    os.dup2(self._file.fileno(), 2)
    self.text = ""
    return self

  def __exit__(self, *exc):
    import sys
    sys.stderr.flush()
    os.dup2(self._saved, 2)
    os.close(self._saved)
    self._file.seek(0)
    self.text = self._file.read().decode("utf-8", "replace")
    self._file.close()
    return False
