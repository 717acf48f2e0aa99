"""Sharding specs as the analysis sees them.

A `Spec` is a tuple with one entry per array dim; each entry is a tuple of mesh axis
names (empty: that dim is not split). `None` in place of a Spec means "unknown".
Axes of size 1 are dropped: they never split anything.
"""
from __future__ import annotations

from typing import Optional

from jax.sharding import NamedSharding, PartitionSpec

Spec = tuple
MaybeSpec = Optional[tuple]


def replicated(ndim: int) -> Spec:
  return ((),) * ndim


def from_partition_spec(pspec, ndim: int, axis_sizes: dict) -> Spec:
  entries = list(pspec) + [None] * (ndim - len(pspec))
  out = []
  for entry in entries[:ndim]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      out.append(())
    else:
      names = entry if isinstance(entry, tuple) else (entry,)
      out.append(tuple(n for n in names if axis_sizes.get(n, 1) > 1))
  return tuple(out)


def from_sharding(sharding, ndim: int, axis_sizes: dict) -> MaybeSpec:
  """Spec of a NamedSharding; None for anything else (unspecified, opaque)."""
  if isinstance(sharding, NamedSharding):
    return from_partition_spec(sharding.spec, ndim, axis_sizes)
  return None


def to_partition_spec(spec: Spec) -> PartitionSpec:
  entries = []
  for entry in spec:
    if not entry:
      entries.append(None)
    elif len(entry) == 1:
      entries.append(entry[0])
    else:
      entries.append(entry)
  return PartitionSpec(*entries)


def axes_of(spec: Spec) -> list:
  return [a for entry in spec for a in entry]


def merge(specs) -> MaybeSpec:
  """Combine specs of values that share a layout (operands of an elementwise op).

  Per dim the sharded entry wins over an unsplit one; an axis may be used once only.
  """
  known = [s for s in specs if s is not None]
  if not known:
    return None
  ndim = len(known[0])
  if any(len(s) != ndim for s in known):
    return None
  out, used = [], set()
  for d in range(ndim):
    choice = ()
    for s in known:
      if s[d] and not (set(s[d]) & used):
        choice = s[d]
        break
    used.update(choice)
    out.append(choice)
  return tuple(out)


def describe(spec: MaybeSpec) -> str:
  if spec is None:
    return "?"
  return str(to_partition_spec(spec)).replace("PartitionSpec", "P")
