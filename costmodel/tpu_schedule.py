"""Read what the TPU compiler made of a program, and predict its step time: the import
path of the compiled-schedule tools (docs/tpu.md, `meshslice.aot`, the benches).

  read_schedule(text)  -> CompiledSchedule: a CompiledOp per instruction of the entry
                          computation, in order, with `while` loops as Loop entries
  summarize(schedule)  -> Summary: compute cycles, collectives by kind, loops
  simulate(schedule, profile) -> Simulation: the predicted step time
  read_scheduler_log(log) -> [SchedulerTotals]: libtpu's own scheduler's totals

The code lives in three modules split by job; every name is re-exported here, so
`from meshslice.costmodel.tpu_schedule import X` keeps working:

  tpu_read      scheduled HLO as CompiledOp / Loop / CompiledSchedule records, Summary,
                and the chip table (CLOCK_HZ, FLOPS_PER_CYCLE)
  tpu_simulate  the step-time walk: Simulation, Wait, collective_seconds,
                axis_torus_dims, link_mesh_shape
  libtpu_log    libtpu's latency-hiding scheduler statistics: SchedulerTotals,
                read_scheduler_log, scheduler_*, capture_stderr, SCHEDULER_LOG_ENV

This module holds no code of its own: the simulator and the log reader import the
reader, so a reader that also re-exported them would import in a circle
(tests/test_layering.py). The old names `Op` and `Schedule` (timing has its own `Op` and
`Schedule`) still answer here, with a DeprecationWarning naming `CompiledOp` /
`CompiledSchedule`.

Example (the reader's own example is in `tpu_read`'s docstring):
  >>> from meshslice.costmodel import tpu_read, tpu_simulate
  >>> read_schedule is tpu_read.read_schedule, simulate is tpu_simulate.simulate
  (True, True)
"""
import warnings

from .hlo_text import COLLECTIVES
from .libtpu_log import (SCHEDULER_LOG_ENV, SchedulerTotals, capture_stderr, read_scheduler_log,
                         scheduler_cycles, scheduler_entry, scheduler_loop_cycles)
from .tpu_read import (CLOCK_HZ, FLOPS_PER_CYCLE, KINDS, CompiledOp, CompiledSchedule, Entry,
                       Loop, Summary, parse_module, read_schedule, summarize)
from .tpu_simulate import (Simulation, Wait, axis_torus_dims, collective_seconds,
                           link_mesh_shape, simulate)
# private helpers the reader's tests check here
from .tpu_read import _Reader, _permute_link, _strategy, _strategy_cores  # noqa: F401

# Deprecated names -> what replaced them (module __getattr__, PEP 562: only these warn).
_DEPRECATED = {"Op": ("CompiledOp", CompiledOp),
               "Schedule": ("CompiledSchedule", CompiledSchedule)}


def __getattr__(name: str):
  if name in _DEPRECATED:
    new, value = _DEPRECATED[name]
    warnings.warn(f"meshslice.costmodel.tpu_schedule.{name} is deprecated; use {new}",
                  DeprecationWarning, stacklevel=2)
    return value
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CLOCK_HZ", "COLLECTIVES", "FLOPS_PER_CYCLE", "KINDS", "SCHEDULER_LOG_ENV",
           "CompiledOp", "CompiledSchedule", "Entry", "Loop",
           "SchedulerTotals", "Simulation", "Summary", "Wait", "axis_torus_dims",
           "link_mesh_shape",
           "capture_stderr", "collective_seconds", "parse_module", "read_schedule",
           "read_scheduler_log", "scheduler_cycles", "scheduler_entry",
           "scheduler_loop_cycles", "simulate", "summarize"]
