"""Figures read off compiled HLO text: collectives by kind, and bytes each device moves.

Bytes moved per device assume ring algorithms over a group of n devices, from the
result shape (compiled HLO text does not always type the operands): all-gather
result * (n-1)/n, reduce-scatter result * (n-1) (its operand is n results), all-reduce
2 * result * (n-1)/n, all-to-all result * (n-1)/n, collective-permute result. These are the
communication volumes of docs/costmodel.md, for comparing programs, not a timing.

Loops. A collective inside a `while` runs once per iteration, so it is counted (and its
bytes added) trip-count times; nested loops multiply. The trip count is read from what
XLA states on the while instruction -- compiled HLO of `lax.fori_loop` / `lax.scan`
prints

  %while.13 = (s32[], f32[], ...) while(%tuple.19), condition=%region_2..., body=%region_0...,
      backend_config={..."known_init_step":{"init":"0","step":"1"},"known_trip_count":{"n":"5"}}

-- or, where there is no such annotation (e.g. lowered, unoptimized HLO), recognised
from the loop itself: the condition compares tuple element i of its parameter with an
integer constant (directly or inside a fusion), element i of the initial tuple is a
constant, and the body's root tuple sets element i to element i plus a constant. A loop
whose trip count is neither stated nor recognised counts once (a lower bound); see
`while_trip_counts`. Branches of a `conditional` all count (an upper bound).

Example:
  >>> text = jax.jit(f).lower(x).compile().as_text()      # doctest: +SKIP
  >>> collective_stats(text)["bytes"]                       # doctest: +SKIP
  >>> while_trip_counts(text)                               # doctest: +SKIP
  {'while.13': 5}
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1}
_TYPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(%{]+)\s*(?:\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\b(condition|body|to_apply|calls|branch_computations|"
                    r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Instr:
  name: str
  type_text: str          # the result type, e.g. "f32[8,32]{1,0}" or "(s32[], f32[])"
  opcode: str
  args: str               # text inside the operand parentheses
  operands: tuple         # operand instruction names
  attrs: str              # everything after the operand parentheses
  root: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Computation:
  name: str
  entry: bool
  instrs: dict            # name -> _Instr, in text order
  root: str | None


def _split_args(rest: str) -> tuple[str, str]:
  """'a, b), attrs' -> ('a, b', ', attrs'): the operand text up to its closing paren."""
  depth = 1
  for i, ch in enumerate(rest):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
      if depth == 0:
        return rest[:i], rest[i + 1:]
  return rest, ""


def _top_level(text: str, sep: str = ",") -> list[str]:
  """Split at `sep` outside any (), [], {}."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str) -> _Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  root, name, type_text, opcode, rest = m.groups()
  args, attrs = _split_args(rest)
  if opcode in ("constant", "parameter", "iota"):
    operands = ()                   # literal arguments, not instructions
  elif "%" in args:
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
  else:                             # unoptimized text: bare names, maybe typed
    operands = tuple(p.split()[-1] for p in _top_level(args))
  return _Instr(name=name, type_text=type_text, opcode=opcode, args=args,
                operands=operands, attrs=attrs, root=bool(root))


def _parse(hlo_text: str) -> tuple[list, dict]:
  """(computations in text order, module attributes from the HloModule line).

  Instruction lines outside any computation (a fragment of text) land in a nameless
  computation, so they still count once.
  """
  comps, module = [], {}
  loose = {}
  current = None
  for line in hlo_text.splitlines():
    if line.startswith("HloModule"):
      module = dict(re.findall(r"\b(num_partitions|replica_count)=(\d+)", line))
      continue
    header = None if line[:1].isspace() else _HEADER.match(line)
    if header:
      current = (header.group(2), bool(header.group(1)), {})
      continue
    if current is not None and line.strip() == "}":
      instrs = current[2]
      root = next((n for n, i in instrs.items() if i.root), None)
      comps.append(_Computation(name=current[0], entry=current[1], instrs=instrs, root=root))
      current = None
      continue
    instr = _parse_instr(line)
    if instr is not None:
      (current[2] if current is not None else loose)[instr.name] = instr
  if loose:
    comps.append(_Computation(name="", entry=False, instrs=loose, root=None))
  return comps, {k: int(v) for k, v in module.items()}


# ---- trip counts ----------------------------------------------------------------------

def _expr(comps: dict, comp: _Computation, name: str, params=None, depth: int = 0):
  """A small symbolic value of instruction `name`: ('const', v), ('param', k),
  ('gte', i, of), ('tuple', [..]), (opcode, direction, a, b) for add / subtract / compare,
  or ('?',). Looks through copies, bitcasts, converts and fusions (whose parameters
  stand for the fusion's operands, given as `params`)."""
  instr = comp.instrs.get(name)
  if instr is None or depth > 12:
    return ("?",)
  sub = lambda n: _expr(comps, comp, n, params, depth + 1)
  op = instr.opcode
  if op == "constant":
    try:
      return ("const", int(instr.args.strip()))
    except ValueError:
      return ("?",)
  if op == "parameter":
    k = int(instr.args.strip())
    return params[k] if params is not None and k < len(params) else ("param", k)
  if op in ("copy", "bitcast", "convert", "reshape") and instr.operands:
    return sub(instr.operands[0])
  if op == "get-tuple-element" and instr.operands:
    index = re.search(r"\bindex=(\d+)", instr.attrs)
    of = sub(instr.operands[0])
    if of[0] == "tuple" and index and int(index.group(1)) < len(of[1]):
      return of[1][int(index.group(1))]
    return ("gte", int(index.group(1)), of) if index else ("?",)
  if op == "tuple":
    return ("tuple", [sub(n) for n in instr.operands])
  if op in ("add", "subtract", "compare") and len(instr.operands) == 2:
    direction = re.search(r"\bdirection=([A-Z]+)", instr.attrs)
    return (op, direction.group(1) if direction else None, sub(instr.operands[0]),
            sub(instr.operands[1]))
  if op == "fusion":
    called = re.search(r"\bcalls=%?([\w.\-]+)", instr.attrs)
    inner = comps.get(called.group(1)) if called else None
    if inner is not None and inner.root is not None:
      return _expr(comps, inner, inner.root, [sub(n) for n in instr.operands], depth + 1)
  return ("?",)


def _induction_trip_count(comps: dict, caller: _Computation, instr: _Instr) -> int | None:
  """Trip count of `for (i = init; i <op> bound; i += step)` recognised in the loop."""
  names = dict((k, v.strip("%{} ")) for k, v in _CALLS.findall(_STRING.sub('""', instr.attrs)))
  cond, body = comps.get(names.get("condition")), comps.get(names.get("body"))
  if cond is None or body is None or cond.root is None or body.root is None:
    return None
  test = _expr(comps, cond, cond.root)
  if test[0] != "compare":
    return None
  _, direction, a, b = test
  if b[:1] == ("gte",) and a[:1] == ("const",):
    a, b, direction = b, a, _FLIP.get(direction)
  if not (a[0] == "gte" and a[2] == ("param", 0) and b[0] == "const"):
    return None
  index, bound = a[1], b[1]
  init = _expr(comps, caller, instr.operands[0]) if instr.operands else ("?",)
  update = _expr(comps, body, body.root)
  if init[0] != "tuple" or update[0] != "tuple" or index >= min(len(init[1]), len(update[1])):
    return None
  start, nxt = init[1][index], update[1][index]
  if start[0] != "const" or nxt[0] not in ("add", "subtract"):
    return None
  same = ("gte", index, ("param", 0))
  if nxt[2] == same and nxt[3][0] == "const":
    step = nxt[3][1] if nxt[0] == "add" else -nxt[3][1]
  elif nxt[0] == "add" and nxt[3] == same and nxt[2][0] == "const":
    step = nxt[2][1]
  else:
    return None
  start = start[1]
  if direction == "LT" and step > 0:
    return max(0, -(-(bound - start) // step))
  if direction == "LE" and step > 0:
    return max(0, (bound - start) // step + 1)
  if direction == "GT" and step < 0:
    return max(0, -(-(start - bound) // -step))
  if direction == "GE" and step < 0:
    return max(0, (start - bound) // -step + 1)
  if direction == "NE" and step and (bound - start) % step == 0 and (bound - start) // step >= 0:
    return (bound - start) // step
  return None


def _trip_count(comps: dict, caller: _Computation, instr: _Instr) -> int | None:
  stated = _TRIP.search(instr.attrs)
  if stated:
    return int(stated.group(1))
  return _induction_trip_count(comps, caller, instr)


def _multiplicities(comps: list) -> tuple[dict, dict]:
  """(times each computation runs per program execution, trip count of each while).

  Computations not reachable from ENTRY (or all of them, in text without one) run once.
  """
  by_name = {c.name: c for c in comps}
  edges, trips = {}, {}
  for comp in comps:
    out = edges.setdefault(comp.name, [])
    for instr in comp.instrs.values():
      if instr.opcode in ("async-update", "async-done"):
        continue          # may repeat async-start's calls=; the wrapped op runs once
      calls = _CALLS.findall(_STRING.sub('""', instr.attrs))
      if not calls:
        continue
      trip = None
      if instr.opcode == "while":
        trip = trips[instr.name] = _trip_count(by_name, comp, instr)
      for role, names in calls:
        factor = 1
        if trip is not None and role == "body":
          factor = trip
        elif trip is not None and role == "condition":
          factor = trip + 1           # the condition also runs on exit
        for callee in re.findall(r"%?([\w.\-]+)", names):
          if callee in by_name:
            out.append((callee, factor))
  entry = next((c.name for c in comps if c.entry), None)
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
  return _multiplicities(_parse(hlo_text)[0])[1]


# ---- bytes ----------------------------------------------------------------------------

def _bytes_of(types_text: str) -> list:
  out = []
  for dtype, dims in _TYPE.findall(types_text):
    if dtype in _ITEMSIZE:
      n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
      out.append(n * _ITEMSIZE[dtype])
  return out


def _result_bytes(type_text: str, opcode: str) -> int:
  """Bytes of the collective's result: every output of a (possibly combined, variadic)
  collective; for an async *-start, element 1 of its tuple, which holds the outputs
  ((operands, outputs[, contexts])) -- except all-reduce-start, whose result is the
  output itself."""
  text = type_text.strip()
  if opcode.endswith("-start") and opcode != "all-reduce-start" and text.startswith("("):
    parts = _top_level(text[1:-1])
    if len(parts) >= 2:
      text = parts[1]
  return int(sum(_bytes_of(text)))


def _group_size(line: str, devices: int = 1) -> int:
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if mesh:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
    return int(np.prod([int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2))]))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if iota:
    return int(iota.group(2))
  explicit = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if explicit:
    return len([v for v in explicit.group(1).split(",") if v])
  if re.search(r"replica_groups=\{\}", line):
    return devices                  # empty groups: one group of every device
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", line)
  if pairs:
    return 2
  return 1


def _kind(opcode: str) -> str | None:
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in KINDS else None


def collective_stats(hlo_text: str, *, loops: bool = True) -> dict:
  """{'count': {kind: n}, 'bytes': {kind: bytes}, 'total_bytes': float} per device, for
  one execution of the program: collectives inside while loops count once per iteration
  (`loops=False`: every collective in the text counts once, the figures before loops
  were understood).

  Example (a loop of 5 all-gathers of f32[8,8] over 4 devices, see tests/test_hlo.py):
    >>> collective_stats(text)                        # doctest: +SKIP
    {'count': {'all-gather': 5, ...}, 'bytes': {'all-gather': 3840.0, ...}, ...}
  """
  comps, module = _parse(hlo_text)
  devices = module.get("num_partitions", 1) * module.get("replica_count", 1)
  times = _multiplicities(comps)[0] if loops else {}
  count = {k: 0 for k in KINDS}
  moved = {k: 0.0 for k in KINDS}
  for comp in comps:
    runs = times.get(comp.name, 1)
    for instr in comp.instrs.values():
      kind = _kind(instr.opcode)
      if kind is None:
        continue
      count[kind] += runs
      n = _group_size(instr.attrs, devices)
      if n <= 1 or runs == 0:
        continue
      result = _result_bytes(instr.type_text, instr.opcode)
      if kind in ("all-gather", "all-to-all"):
        per_run = result * (n - 1) / n
      elif kind == "reduce-scatter":
        per_run = result * (n - 1)
      elif kind == "all-reduce":
        per_run = 2 * result * (n - 1) / n
      else:
        per_run = result
      moved[kind] += runs * per_run
  return {"count": count, "bytes": moved, "total_bytes": float(sum(moved.values()))}
