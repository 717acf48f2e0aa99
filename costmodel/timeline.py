"""Predicted schedules as Chrome / Perfetto trace JSON (open in ui.perfetto.dev or
chrome://tracing).

One process per trace, four tracks: the compute unit, the row-axis link, the
column-axis link, and a "sites" track with one span per site. Every operation of a
`timing.Schedule` becomes a complete ("ph": "X") event; ts and dur are microseconds.
Sites passed together are laid end to end, in order.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from .timing import Schedule

_TRACKS = {"compute": 0, "row": 1, "col": 2, "sites": 3}


def _us(seconds: float) -> float:
  # Nanosecond resolution keeps the files small and their text deterministic.
  return round(seconds * 1e6, 3)


def trace_events(schedules: Iterable[Schedule | tuple[str, Schedule]], *, pid: int = 1,
                 process_name: str = "meshslice (predicted)",
                 start_us: float = 0.0) -> list[dict]:
  """Trace events of `schedules` (each a Schedule or a (label, Schedule) pair), laid end
  to end from `start_us`.

  Example:
    >>> from meshslice.costmodel.timing import GemmProblem, schedule
    >>> s = schedule(GemmProblem(m=4096, n=4096, k=4096, rows=2, cols=2), "meshslice",
    ...              "os", 2, "tpu-v4")
    >>> events = trace_events([("qkv/forward", s)])
    >>> sorted({e["ph"] for e in events}), [e["name"] for e in events if e["tid"] == 0
    ...                                     and e["ph"] == "X"][:3]
    (['M', 'X'], ['cut slices[0]', 'matmul[0]', 'matmul[1]'])
  """
  items = [(f"site {i}", s) if isinstance(s, Schedule) else s for i, s in enumerate(schedules)]
  events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": process_name}}]
  first = items[0][1].problem if items else None
  track_names = {
      "compute": "compute",
      "row": (f"row link (R={first.rows}, profile dim {first.row_profile_dim})"
              if first else "row link"),
      "col": (f"col link (C={first.cols}, profile dim {first.col_profile_dim})"
              if first else "col link"),
      "sites": "sites",
  }
  for stream, tid in _TRACKS.items():
    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                   "args": {"name": track_names[stream]}})
    events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                   "args": {"sort_index": tid}})
  t = start_us * 1e-6
  for label, sched in items:
    site_start = t
    category = f"{sched.algorithm}/{sched.dataflow}"
    seen = {}     # op name -> how many so far: "matmul[0]", "matmul[1]", ...
    index = 0
    for stage in sched.stages:
      for _ in range(stage.repeat):     # a repeated stage is drawn every time it runs
        cursor = {stream: t for stream in ("compute", "row", "col")}
        for op in stage.ops:
          number = seen.get(op.name, 0)
          seen[op.name] = number + 1
          events.append({"name": f"{op.name}[{number}]", "cat": category, "ph": "X",
                         "pid": pid, "tid": _TRACKS[op.stream], "ts": _us(cursor[op.stream]),
                         "dur": _us(op.seconds), "args": {"site": label, "stage": index}})
          cursor[op.stream] += op.seconds   # one stream runs its ops back to back
        t += stage.duration
        index += 1
    cost = sched.cost()
    events.append({"name": label, "cat": category, "ph": "X", "pid": pid,
                   "tid": _TRACKS["sites"], "ts": _us(site_start), "dur": _us(t - site_start),
                   "args": {"algorithm": sched.algorithm, "dataflow": sched.dataflow,
                            "ksplit": sched.ksplit, "options": dict(sched.options),
                            "note": sched.note,
                            "compute_us": _us(cost.compute_s),
                            "exposed_comm_us": _us(cost.exposed_comm_s)}})
  return events


def write_trace(path: str | os.PathLike, events: list[dict]) -> None:
  """Write `events` as `{"traceEvents": [...]}` JSON to `path`.

  Example:
    >>> import tempfile, os, json
    >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
    >>> write_trace(path, [{"name": "x", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 1}])
    >>> json.load(open(path))["traceEvents"][0]["dur"]
    1
  """
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, indent=1)
    f.write("\n")
