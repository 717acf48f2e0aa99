"""Figures read off compiled HLO text: collectives by kind, and bytes each device moves.

The text is read by `meshslice.costmodel.hlo_text`, the one HLO text parser (shared with
the TPU schedule reader). Bytes moved per device assume ring algorithms over a group of n
devices, from the result shape (compiled HLO text does not always type the operands):
all-gather result * (n-1)/n, reduce-scatter result * (n-1) (its operand is n results),
all-reduce 2 * result * (n-1)/n, all-to-all result * (n-1)/n, collective-permute result
(`hlo_text.moved_bytes`). These are the communication volumes of docs/costmodel.md, for
comparing programs, not a timing.

Loops. A collective inside a `while` runs once per iteration, so it is counted (and its
bytes added) trip-count times; nested loops multiply. The trip count is read from what
XLA states on the while instruction -- compiled HLO of `lax.fori_loop` / `lax.scan`
prints

  %while.13 = (s32[], f32[], ...) while(%tuple.19), condition=%region_2..., body=%region_0...,
      backend_config={..."known_init_step":{"init":"0","step":"1"},"known_trip_count":{"n":"5"}}

-- or, where there is no such annotation (e.g. lowered, unoptimized HLO), recognised
from the loop itself: the condition compares tuple element i of its parameter with an
integer constant (directly or inside a fusion), element i of the initial tuple is a
constant, and the body's root tuple sets element i to element i plus a constant (any
step; LT / LE / GT / GE / NE; `hlo_text.trip_count`). A loop whose trip count is neither
stated nor recognised counts once (a lower bound); see `while_trip_counts`. Branches of
a `conditional` all count (an upper bound).

Example:
  >>> text = jax.jit(f).lower(x).compile().as_text()      # doctest: +SKIP
  >>> collective_stats(text)["bytes"]                       # doctest: +SKIP
  >>> while_trip_counts(text)                               # doctest: +SKIP
  {'while.13': 5}
"""
from __future__ import annotations

from meshslice.costmodel import hlo_text as parser

KINDS = parser.COLLECTIVES


def _computations(module: parser.Module) -> list:
  """Every computation of the module, loose lines (a fragment) as a nameless one."""
  return list(module.computations.values()) + ([module.loose] if module.loose else [])


def _multiplicities(module: parser.Module) -> tuple[dict, dict]:
  """(times each computation runs per program execution, trip count of each while).

  Computations not reachable from ENTRY (or all of them, in text without one) run once.
  """
  comps = _computations(module)
  edges, trips = {}, {}
  for comp in comps:
    out = edges.setdefault(comp.name, [])
    for instr in comp.instrs.values():
      if instr.opcode in ("async-update", "async-done"):
        continue          # may repeat async-start's calls=; the wrapped op runs once
      calls = instr.called()
      if not calls:
        continue
      trip = None
      if instr.opcode == "while":
        trip = trips[instr.name] = parser.trip_count(module, comp, instr)
      for role, callees in calls.items():
        factor = 1
        if trip is not None and role == "body":
          factor = trip
        elif trip is not None and role == "condition":
          factor = trip + 1           # the condition also runs on exit
        out.extend((callee, factor) for callee in callees if callee in module.computations)
  entry = module.entry
  times = {c.name: 1 for c in comps}
  if entry is None:
    return times, trips
  # Reverse DFS post-order from ENTRY is a topological order of the (acyclic) call graph.
  order, seen = [], set()

  def visit(name):
    seen.add(name)
    for callee, _ in edges.get(name, ()):
      if callee not in seen:
        visit(callee)
    order.append(name)

  visit(entry)
  reached = {name: 0 for name in order}
  reached[entry] = 1
  for name in reversed(order):
    for callee, factor in edges.get(name, ()):
      reached[callee] += reached[name] * factor
  times.update(reached)
  return times, trips


def while_trip_counts(hlo_text: str) -> dict:
  """{while instruction name: trip count, or None where neither stated nor recognised}.

  Example:
    >>> text = jax.jit(shard_map(lambda a: lax.fori_loop(0, 5, body, a), ...)
    ...                ).lower(x).compile().as_text()      # doctest: +SKIP
    >>> while_trip_counts(text)                              # doctest: +SKIP
    {'while.13': 5}
  """
  return _multiplicities(parser.parse(hlo_text))[1]


def collective_stats(hlo_text: str, *, loops: bool = True) -> dict:
  """{'count': {kind: n}, 'bytes': {kind: bytes}, 'total_bytes': float} per device, for
  one execution of the program: collectives inside while loops count once per iteration
  (`loops=False`: every collective in the text counts once, the figures before loops
  were understood).

  Example (a loop of 5 all-gathers of f32[8,8] over 4 devices, see tests/test_hlo.py):
    >>> collective_stats(text)                        # doctest: +SKIP
    {'count': {'all-gather': 5, ...}, 'bytes': {'all-gather': 3840.0, ...}, ...}
  """
  module = parser.parse(hlo_text)
  times = _multiplicities(module)[0] if loops else {}
  count = {k: 0 for k in KINDS}
  moved = {k: 0.0 for k in KINDS}
  for comp in _computations(module):
    runs = times.get(comp.name, 1)
    for instr in comp.instrs.values():
      kind = parser.collective_kind(instr.opcode)
      if kind is None:
        continue
      count[kind] += runs
      if runs == 0:
        continue
      group = parser.replica_group(instr.attrs, module.devices)
      result = parser.nbytes(parser.collective_output_type(instr.opcode, instr.type_text))
      moved[kind] += runs * parser.moved_bytes(kind, result, len(group))
  return {"count": count, "bytes": moved, "total_bytes": float(sum(moved.values()))}
