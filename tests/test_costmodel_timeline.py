"""Predicted schedules as trace events (costmodel.timeline). No JAX needed."""
import json

from meshslice.costmodel.timeline import trace_events, write_trace
from meshslice.costmodel.timing import schedule

from test_costmodel import OS, PROF


def test_trace_events_follow_the_schedule(tmp_path):
  s = schedule(OS, "meshslice", "os", 2, PROF)
  events = trace_events([("site a", s), ("site b", s)])
  spans = [e for e in events if e["ph"] == "X"]
  site_spans = [e for e in spans if e["tid"] == 3]
  # two sites end to end, each 11.537 ms (see test_meshslice_os_by_hand): the prologue
  # gathers X (col, 1.526 ms) then W (row, 2.011 ms), one after the other
  assert [(e["name"], e["ts"], e["dur"]) for e in site_spans] == [
      ("site a", 0.0, 11537.0), ("site b", 11537.0, 11537.0)]
  matmuls = [(e["ts"], e["dur"]) for e in spans if e["tid"] == 0]
  assert matmuls[:2] == [(3537.0, 4000.0), (7537.0, 4000.0)]
  gathers_w = [(e["ts"], e["dur"]) for e in spans if e["tid"] == 1][:2]
  assert gathers_w == [(1526.0, 2011.0), (3537.0, 2011.0)]
  write_trace(tmp_path / "t.json", events)
  assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] == events
