"""Figures read off compiled HLO text: collectives by kind, and bytes each device moves.

Bytes moved per device assume ring algorithms over a group of n devices, from the
result shape (compiled HLO text does not always type the operands): all-gather
result * (n-1)/n, reduce-scatter result * (n-1) (its operand is n results), all-reduce
2 * result * (n-1)/n, all-to-all result * (n-1)/n, collective-permute result. These are the
communication volumes of DESIGN.md section 5, for comparing programs, not a timing.

Example:
  >>> text = jax.jit(f).lower(x).compile().as_text()      # doctest: +SKIP
  >>> collective_stats(text)["bytes"]                       # doctest: +SKIP
"""
from __future__ import annotations

import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1}
_TYPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\((.*)$")


def _bytes_of(types_text: str) -> list:
  out = []
  for dtype, dims in _TYPE.findall(types_text):
    if dtype in _ITEMSIZE:
      n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
      out.append(n * _ITEMSIZE[dtype])
  return out


def _group_size(line: str) -> int:
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
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", line)
  if pairs:
    return 2
  return 1


def collective_stats(hlo_text: str) -> dict:
  """{'count': {kind: n}, 'bytes': {kind: bytes}, 'total_bytes': float} per device."""
  count = {k: 0 for k in KINDS}
  moved = {k: 0.0 for k in KINDS}
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    result_types, kind, _, _ = m.groups()
    results = _bytes_of(result_types)
    result = results[-1] if results else 0     # async *-start results end with the output
    n = _group_size(line)
    count[kind] += 1
    if n <= 1:
      continue
    if kind in ("all-gather", "all-to-all"):
      moved[kind] += result * (n - 1) / n
    elif kind == "reduce-scatter":
      moved[kind] += result * (n - 1)
    elif kind == "all-reduce":
      moved[kind] += 2 * result * (n - 1) / n
    else:
      moved[kind] += result
  return {"count": count, "bytes": moved, "total_bytes": float(sum(moved.values()))}
