"""The one reader of HLO text: computations, instructions, types, replica groups, trip counts.

Both readers of compiled programs sit on this module: the TPU schedule reader
(`costmodel.tpu_schedule`) and the collective statistics of `meshslice.hlo`. It reads
the text `compiled.as_text()` (or `lowered.as_text(dialect="hlo")`) prints:

  parse(text)          -> Module: computations by name, in text order, each an ordered
                          {name: Instr}; the entry's name; num_partitions / replica_count
                          / is_scheduled from the HloModule line. Instruction lines
                          outside any computation (a fragment) land in `Module.loose`.
  arrays, nbytes       the arrays of a (tuple) type and their bytes; `ITEMSIZE` covers
                          every XLA element type (s4 / u4 are half a byte, token 0).
  replica_group        the first replica group of a collective, as partition ids, in
                          every spelling XLA prints (see its docstring); `replica_groups`
                          all of them.
  moved_bytes          what one device sends in a collective (ring algorithms).
  trip_count           the trip count of a `while`: stated by XLA, or recognised from
                          the loop's induction variable (any constant step, LT / LE / GT
                          / GE / NE).

Comments (`/*index=5*/`) are dropped before a line is read, and quoted strings (metadata,
string backend configs) are ignored where called computations are looked for.

Example:
  >>> module = parse('''HloModule m, num_partitions=4
  ... ENTRY %main (p: s4[64]) -> s4[256] {
  ...   ROOT %ag = s4[256]{0} all-gather(s4[64]{0} %p), replica_groups=[1,4]<=[4], dimensions={0}
  ... }''')
  >>> ag = module.computations["main"].instrs["ag"]
  >>> ag.operands, nbytes(ag.type_text), replica_group(ag.attrs, module.devices)
  (('p',), 128, (0, 1, 2, 3))
  >>> moved_bytes("all-gather", 128, 4)
  96.0
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
               "collective-permute")

# Bytes per element of every XLA element type (primitive_type.proto); sub-byte types pack.
ITEMSIZE = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
            "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
            "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
            "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "token": 0}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# a quoted string (kept as it is) or a /* comment */ (dropped): comments inside strings stay
_STRING_OR_COMMENT = re.compile(r'("(?:[^"\\]|\\.)*")|/\*.*?\*/')
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(%{]+)\s*(?:\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_CALLS = re.compile(r"\b(calls|to_apply|condition|body|branch_computations|"
                    r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
# backend_config is printed as JSON, or (older / lowered text) as a string of escaped JSON
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
_LITERAL_ARGS = frozenset(("constant", "parameter", "iota"))


# ----------------------------------------------------------------------------- structure

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Instr:
  """One instruction line.

  Attributes:
    name, opcode: as printed (without the `%`).
    type_text: the result type, e.g. "f32[8,32]{1,0}" or "(s32[], f32[])".
    args: the text inside the operand parentheses (a constant's literal, a parameter's
      number, the operands).
    operands: the operand instruction names (none for constant / parameter / iota).
    attrs: everything after the operand parentheses.
    root: the line starts with ROOT.
  """

  name: str
  type_text: str
  opcode: str
  args: str
  operands: tuple[str, ...]
  attrs: str
  root: bool

  def called(self) -> dict[str, list[str]]:
    """{role: [computation names]} this instruction calls (calls=, to_apply=, body=,
    condition=, branch_computations=, ...); quoted strings are not looked into."""
    out = {}
    for role, names in _CALLS.findall(_STRING.sub('""', self.attrs)):
      out.setdefault(role, []).extend(re.findall(r"%?([\w.\-]+)", names.strip("{}")))
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Computation:
  """A computation: its instructions by name in text (for scheduled HLO: run) order."""

  name: str
  entry: bool
  instrs: dict[str, Instr]
  root: str | None          # name of the ROOT instruction


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Module:
  """Parsed HLO text.

  Attributes:
    computations: {name: Computation} in text order.
    entry: the ENTRY computation's name (None in a fragment).
    loose: instruction lines outside any computation (a fragment of text), or None.
    num_partitions, replica_count, is_scheduled: from the HloModule line (1, 1, False
      when it does not say).
  """

  computations: dict[str, Computation]
  entry: str | None = None
  loose: Computation | None = None
  num_partitions: int = 1
  replica_count: int = 1
  is_scheduled: bool = False

  @property
  def devices(self) -> int:
    """Devices the program runs on: an empty replica group `{}` means all of them."""
    return self.num_partitions * self.replica_count


def _depths(text: str, depth: int = 0):
  """(index, char, bracket depth after it) over `text`: the one bracket scanner."""
  for i, ch in enumerate(text):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    yield i, ch, depth


def close_paren(text: str) -> int:
  """Index of the bracket closing one already open before `text` (len(text) if none)."""
  return next((i for i, _, depth in _depths(text, 1) if depth == 0), len(text))


def split_top_level(text: str, sep: str = ",") -> list[str]:
  """`text` split at `sep` outside any (), [], {}; parts stripped, empty ones dropped."""
  parts, start = [], 0
  for i, ch, depth in _depths(text):
    if ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def tuple_elements(type_text: str) -> list[str]:
  """Elements of a tuple type '(a, b, ...)', or [type_text] for an array type."""
  text = type_text.strip()
  return split_top_level(text[1:-1]) if text.startswith("(") else [text]


def strip_comments(line: str) -> str:
  """The line without its /* comments */ (strings untouched)."""
  if "/*" not in line:
    return line                     # most lines: skip the regex (it is on every line)
  return _STRING_OR_COMMENT.sub(lambda m: m.group(1) or "", line)


def parse_instr(line: str) -> Instr | None:
  """The instruction on one line (comments already stripped), or None."""
  match = _INSTR.match(line)
  if not match:
    return None
  root, name, type_text, opcode, rest = match.groups()
  end = close_paren(rest)
  args, attrs = rest[:end], rest[end + 1:]
  if opcode in _LITERAL_ARGS:
    operands = ()                   # literal arguments, not instructions
  elif "%" in args:
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
  else:                             # unoptimized text: bare names, maybe typed
    operands = tuple(p.split()[-1] for p in split_top_level(args))
  return Instr(name=name, type_text=type_text.strip(), opcode=opcode, args=args,
               operands=operands, attrs=attrs, root=bool(root))


def _computation(name: str, entry: bool, instrs: dict) -> Computation:
  root = next((n for n, i in instrs.items() if i.root), None)
  return Computation(name=name, entry=entry, instrs=instrs, root=root)


def parse(text: str) -> Module:
  """The computations and module attributes of HLO text (see the module docstring)."""
  comps, loose, attrs = {}, {}, {}
  entry, current, instrs = None, None, None
  for raw in text.splitlines():
    if raw.startswith("HloModule"):
      attrs = {k: int(v) for k, v in re.findall(r"\b(num_partitions|replica_count)=(\d+)",
                                                 raw)}
      attrs["is_scheduled"] = "is_scheduled=true" in raw
      continue
    line = strip_comments(raw)
    header = None if line[:1].isspace() else _HEADER.match(line)
    if header:
      current, instrs = header.group(2), {}
      if header.group(1):
        entry = current
      continue
    # a computation ends at "}"; one run on another execution thread (SparseCore
    # collective offload) at '}, execution_thread="sparsecore"'
    if current is not None and (line.strip() == "}" or line.startswith("},")):
      comps[current] = _computation(current, current == entry, instrs)
      current = None
      continue
    instr = parse_instr(line)
    if instr is not None:
      (instrs if current is not None else loose)[instr.name] = instr
  return Module(computations=comps, entry=entry,
                loose=_computation("", False, loose) if loose else None, **attrs)


# ----------------------------------------------------------------------------- types

def arrays(type_text: str) -> list[tuple[str, tuple[int, ...], str]]:
  """[(dtype, dims, layout text)] of every array of a known element type in a (possibly
  tuple) type."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(type_text):
    if dtype in ITEMSIZE:
      out.append((dtype, tuple(int(d) for d in dims.split(",") if d), layout or ""))
  return out


def nbytes(type_text: str) -> int:
  """Bytes of every array in a (possibly tuple) type."""
  return int(sum(math.prod(dims) * ITEMSIZE[dtype] for dtype, dims, _ in arrays(type_text)))


def collective_output_type(opcode: str, type_text: str) -> str:
  """The type of a collective's output. An async `<collective>-start` returns
  (operands, outputs[, contexts]): element 1; all-reduce-start returns the output itself."""
  if opcode.endswith("-start") and opcode != "all-reduce-start":
    parts = tuple_elements(type_text)
    if len(parts) >= 2:
      return parts[1]
  return type_text


def collective_kind(opcode: str) -> str | None:
  """The collective (COLLECTIVES) a synchronous collective or an async `-start` runs; None
  for anything else (a `-done` only waits)."""
  base = opcode.removesuffix("-start")
  return base if base in COLLECTIVES else None


# ----------------------------------------------------------------------------- groups

def _iota_ids(dims: str, perm: str | None) -> np.ndarray:
  """0..n-1 reshaped to `dims` ("4,16,4"), transposed by `perm` ("0,2,1"), flattened."""
  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  if perm:
    ids = ids.transpose([int(p) for p in perm.split(",")])
  return ids.ravel()


def _mesh_device_ids(text: str, size: int) -> np.ndarray | None:
  """The partition ids of a `mesh[...]` replica group's `device_ids=(...)`, in mesh
  order: an iota `[4,16,4]T(0,2,1)` (0..n-1 reshaped to those dims, transposed, read
  out; as libtpu 0.0.42 prints them), `[a,b]<=[n]` / `<=[a,b]T(1,0)`, or a flat list of
  ints; None when unread."""
  text = text.strip()
  iota = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text) or \
      re.search(r"<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
  if iota:
    ids = _iota_ids(iota.group(1), iota.group(2))
  else:
    ids = np.array([int(v) for v in re.findall(r"-?\d+", text)], dtype=np.int64)
  return ids if ids.size == size else None


def _mesh_groups(mesh: re.Match) -> tuple[tuple[int, ...], ...]:
  """Every group of a `mesh[...] {...}` replica group (ordered by the other axes'
  indices, major to minor); each group lists its members in mesh order."""
  axes = [(a, int(n)) for a, n in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", mesh.group(1))]
  shape = [n for _, n in axes] or [1]
  ids = np.arange(math.prod(shape))
  if mesh.group(2) is not None:
    given = _mesh_device_ids(mesh.group(2), ids.size)
    ids = given if given is not None else ids
  # chosen axes: full ('y') or a sub-axis ('y':(p)k: the axis of size n seen as
  # [p, k, n / (p k)] major to minor, the group varying the middle one)
  chosen = {}
  for name, sub in re.findall(r"'?([\w.\-]+)'?\s*(:\(\d+\)\d+)?", mesh.group(3)):
    size = re.match(r":\((\d+)\)(\d+)", sub) if sub else None
    chosen[name] = (int(size.group(1)), int(size.group(2))) if size else None
  split, in_group = [], []           # the mesh's axes, sub-axes split out; group axes
  for a, n in axes:
    if a not in chosen:
      split.append(n)
      in_group.append(False)
    elif chosen[a] is None:
      split.append(n)
      in_group.append(True)
    else:
      pre, k = chosen[a]
      split += [pre, k, max(1, n // (pre * k))]
      in_group += [False, True, False]
  if math.prod(split) != ids.size:       # a sub-axis that does not divide: first group only
    return (_first_mesh_group(ids.reshape(shape), axes, chosen),)
  order = [i for i, g in enumerate(in_group) if not g] + [i for i, g in enumerate(in_group) if g]
  size = math.prod(n for n, g in zip(split, in_group) if g)
  rows = ids.reshape(split).transpose(order).reshape(-1, size)
  return tuple(tuple(int(v) for v in row) for row in rows)


def _first_mesh_group(ids: np.ndarray, axes, chosen) -> tuple[int, ...]:
  index = []
  for a, n in axes:
    if a not in chosen:
      index.append(0)
    elif chosen[a] is None:
      index.append(slice(None))
    else:
      pre, k = chosen[a]
      stride = max(1, n // (pre * k))
      index.append(slice(0, stride * k, stride))
  return tuple(int(v) for v in ids[tuple(index)].ravel())


def replica_groups(attrs: str, devices: int) -> tuple[tuple[int, ...], ...]:
  """Every replica group of a collective, as partition ids (each as `replica_group`
  lists the first; () if unknown, and for collective-permutes, whose pairs
  `source_target_pairs` reads).

  Example:
    >>> replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", 4)
    ((0, 2), (1, 3))
    >>> replica_groups("replica_groups=mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y'}", 4)
    ((0, 2), (1, 3))
    >>> replica_groups("replica_groups={{0,1},{2,3}}", 4), replica_groups("replica_groups={}", 2)
    (((0, 1), (2, 3)), ((0, 1),))
  """
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*,?\s*"
                   r"(?:device_ids=\((.*?)\)\s*)?\{([^}]*)\}", attrs)
  if mesh:
    return _mesh_groups(mesh)
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
  if iota:
    groups, size = int(iota.group(1)), int(iota.group(2))
    ids = _iota_ids(iota.group(3), iota.group(4))
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(groups, size))
  explicit = re.search(r"replica_groups=\{(\{[0-9,\s{}]*\})\}", attrs)
  if explicit:
    return tuple(tuple(int(v) for v in g.split(",") if v.strip())
                 for g in re.findall(r"\{([0-9,\s]*)\}", explicit.group(1)))
  if re.search(r"replica_groups=\{\}", attrs):
    return (tuple(range(devices)),)
  return ()


def replica_group(attrs: str, devices: int) -> tuple[int, ...]:
  """The first replica group of a collective, as partition ids (empty if unknown).

  Forms read: `{{0,1},{2,3}}`, iota `[2,2]<=[4]T(1,0)`, `{}` (all `devices`), mesh axes
  `mesh['x'=2,'y'=4] {'y'}` (quoted or not; sub-axes `{'y':(2)2}`) with an optional
  `device_ids=(...)` (the mesh's partition ids in mesh order, printed when they are not
  0..n-1; with or without a comma after the mesh), and for collective-permutes the first
  source/target pair.

  Example:
    >>> replica_group("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", 4)
    (0, 2)
    >>> replica_group("replica_groups=mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y'}", 4)
    (0, 2)
  """
  groups = replica_groups(attrs, devices)
  if groups:
    return groups[0]
  pairs = re.search(r"source_target_pairs=\{\{(\d+),(\d+)\}", attrs)
  if pairs:
    return (int(pairs.group(1)), int(pairs.group(2)))
  return ()


def source_target_pairs(attrs: str) -> tuple[tuple[int, int], ...]:
  """All (source, target) pairs of a collective-permute."""
  block = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if not block:
    return ()
  text = block.group(0)[len("source_target_pairs="):]
  return tuple((int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text))


def moved_bytes(collective: str, result_bytes: int, group_size: int) -> float:
  """Bytes one device sends in a collective with a result of `result_bytes` over a group
  of n devices, assuming ring algorithms (docs/costmodel.md): all-gather and all-to-all
  result * (n-1)/n, reduce-scatter result * (n-1) (its operand is n results), all-reduce
  2 * result * (n-1)/n, collective-permute the result.

  Example:
    >>> [moved_bytes(k, 1024, 4) for k in COLLECTIVES]
    [768.0, 3072.0, 1536.0, 768.0, 1024.0]
  """
  if collective == "collective-permute":
    return float(result_bytes)
  n = max(1, group_size)
  if collective in ("all-gather", "all-to-all"):
    return result_bytes * (n - 1) / n
  if collective == "reduce-scatter":
    return float(result_bytes * (n - 1))
  if collective == "all-reduce":
    return 2 * result_bytes * (n - 1) / n
  raise ValueError(f"moved_bytes: unknown collective {collective!r} (known: {COLLECTIVES})")


# ----------------------------------------------------------------------------- trip counts

_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _expr(comps: dict, comp: Computation, name: str, params=None, depth: int = 0):
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
    called = instr.called().get("calls", [])
    inner = comps.get(called[0]) if called else None
    if inner is not None and inner.root is not None:
      return _expr(comps, inner, inner.root, [sub(n) for n in instr.operands], depth + 1)
  return ("?",)


def _trips(direction: str | None, start: int, bound: int, step: int) -> int | None:
  """Trips of `for (i = start; i <direction> bound; i += step)`; None when it never ends
  or the direction does not fit the step."""
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


def induction_trip_count(module: Module, caller: Computation, instr: Instr) -> int | None:
  """Trip count of the `while` `instr` (in `caller`) read from the loop itself: the
  condition compares tuple element i of its parameter with an integer constant (directly
  or inside a fusion), element i of the initial tuple is a constant, and the body's root
  tuple sets element i to element i plus or minus a constant. None when not recognised."""
  comps = module.computations
  names = {role: callees[0] for role, callees in instr.called().items() if callees}
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
  return _trips(direction, start[1], bound, step)


def stated_trip_count(instr: Instr) -> int | None:
  """The `known_trip_count` XLA states in a while's backend config, or None."""
  stated = _TRIP.search(instr.attrs)
  return int(stated.group(1)) if stated else None


def trip_count(module: Module, caller: Computation, instr: Instr) -> int | None:
  """Trips of the `while` `instr` in `caller`: the `known_trip_count` XLA states, else the
  one `induction_trip_count` recognises, else None.

  Compiled `lax.fori_loop` / `lax.scan` print
    %while.13 = (s32[], f32[], ...) while(%tuple.19), condition=%region_2..., body=...,
        backend_config={..."known_init_step":{"init":"0","step":"1"},"known_trip_count":{"n":"5"}}
  lowered, unoptimized HLO (and libtpu's compiled text) states nothing; there the
  induction variable is followed.
  """
  stated = stated_trip_count(instr)
  return stated if stated is not None else induction_trip_count(module, caller, instr)
