"""Sharding specs as the analysis sees them.

A `Spec` is a tuple with one entry per array dim; each entry is a tuple of mesh axis
names (empty: that dim is not split). `None` in place of a Spec means "unknown".
Axes of size 1 are dropped: they never split anything.

Explicit mode can also type a value `unreduced` over some axes (each device holds a
partial sum; `jnp.dot(..., out_sharding=P(..., unreduced={"y"}))`) or `reduced` over them
(replicated, but its cotangent stays unreduced: `P(..., reduced={"x"})`). Such a value's
spec is a `TypedSpec`: the same per-dim entries, plus those axis sets, and it never
compares equal to a plain spec. The pass leaves every matmul that reads or writes one to
JAX (`typed_reason` says why): a rewritten site would produce or consume reduced values.
"""
from __future__ import annotations

from typing import Optional

from jax.sharding import NamedSharding, PartitionSpec

from . import _jax_internals as _ji

Spec = tuple
MaybeSpec = Optional[tuple]


def replicated(ndim: int) -> Spec:
  return ((),) * ndim


class TypedSpec(tuple):
  """A spec whose value is also unreduced and/or reduced over some mesh axes (Explicit
  mode; module docstring). Equality and hashing include those axes, so a cache keyed by
  specs never confuses it with the plain spec of the same entries.

  Example:
    >>> s = TypedSpec(((), ()), unreduced={"y"})
    >>> s == ((), ()), s == TypedSpec(((), ()), unreduced={"y"})
    (False, True)
    >>> describe(s)
    "P(None, None, unreduced={'y'})"
  """

  def __new__(cls, entries, *, unreduced=frozenset(), reduced=frozenset()):
    self = super().__new__(cls, tuple(entries))
    self.unreduced, self.reduced = frozenset(unreduced), frozenset(reduced)
    return self

  def __eq__(self, other):
    return (isinstance(other, TypedSpec) and tuple.__eq__(self, other)
            and (self.unreduced, self.reduced) == (other.unreduced, other.reduced))

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return hash(("TypedSpec", tuple(self), self.unreduced, self.reduced))

  def __repr__(self):
    return (f"TypedSpec({tuple(self)!r}, unreduced={set(self.unreduced)!r}, "
            f"reduced={set(self.reduced)!r})")

  def __reduce__(self):
    return (_typed_spec, (tuple(self), self.unreduced, self.reduced))


def _typed_spec(entries, unreduced, reduced):
  return TypedSpec(entries, unreduced=unreduced, reduced=reduced)


def _axis_set(names) -> frozenset:
  # size-1 axes are kept here: the type still says unreduced/reduced, and the program
  # must see a value of that type
  return frozenset(n for n in names if n is not None)


def from_partition_spec(pspec, ndim: int, axis_sizes: dict) -> Spec:
  """The spec of a PartitionSpec (a `TypedSpec` when it names unreduced/reduced axes).

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> from_partition_spec(P("x"), 2, {"x": 2, "y": 4})
    (('x',), ())
    >>> from_partition_spec(P("x", None, unreduced={"y"}), 2, {"x": 2, "y": 4}).unreduced
    frozenset({'y'})
  """
  # `*pspec` raises on a PartitionSpec with unreduced/reduced axes: read its partitions
  parts = tuple(getattr(pspec, "partitions", pspec))
  entries = list(parts) + [None] * (ndim - len(parts))
  out = []
  for entry in entries[:ndim]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      out.append(())
    else:
      names = entry if isinstance(entry, tuple) else (entry,)
      out.append(tuple(n for n in names if axis_sizes.get(n, 1) > 1))
  unreduced = _axis_set(getattr(pspec, "unreduced", ()))
  reduced = _axis_set(getattr(pspec, "reduced", ()))
  if unreduced or reduced:
    return TypedSpec(out, unreduced=unreduced, reduced=reduced)
  return tuple(out)


def named_axes(pspec) -> set:
  """Every mesh axis a PartitionSpec names (partitions, unreduced and reduced)."""
  names = set(getattr(pspec, "unreduced", ())) | set(getattr(pspec, "reduced", ()))
  for entry in getattr(pspec, "partitions", pspec):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      continue
    names.update(entry if isinstance(entry, tuple) else (entry,))
  return names


def typed_reason(name: str, spec) -> str:
  """Why a matmul reading (`name` "lhs"/"rhs") or writing ("result") a value of this spec
  is left to JAX: "" for a plain spec."""
  if not isinstance(spec, TypedSpec):
    return ""
  parts = []
  if spec.unreduced:
    parts.append(f"unreduced over {_names(spec.unreduced)} (each device holds a partial "
                 "sum)")
  if spec.reduced:
    parts.append(f"reduced over {_names(spec.reduced)} (its gradient stays unreduced)")
  return (f"the {name} is {' and '.join(parts)} in its Explicit-mode type: sites reading or "
          "writing unreduced/reduced values are left to JAX")


def _names(axes) -> str:
  return ", ".join(repr(a) for a in sorted(axes))


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
  if isinstance(spec, TypedSpec):
    return PartitionSpec(*entries, unreduced=set(spec.unreduced), reduced=set(spec.reduced))
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
  return _ji.partition_spec_text(to_partition_spec(spec)).replace("PartitionSpec", "P")
