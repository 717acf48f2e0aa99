"""The errors meshslice raises about what it was asked to do.

Each is a ValueError, as every such error was before these types existed, so code that
catches ValueError keeps working. The pass itself catches only these types where an
error steers what it does next (a pinned plan tried in another form, a bisection that
falls back from a plan to overrides), never a bare ValueError: one raised by JAX or by
the user's step is not the pass's to swallow.

Example:
  >>> from meshslice.pins import validate_pin
  >>> try:
  ...   validate_pin("overrides[3]", {"ksplit": 0})
  ... except MeshsliceError as e:
  ...   print(type(e).__name__, isinstance(e, ValueError))
  PinError True
"""
from __future__ import annotations


class MeshsliceError(ValueError):
  """An option, pin or plan meshslice cannot apply; the message says what to change."""


class PinError(MeshsliceError):
  """A site setting (a pin key of `pins.PIN_KEYS`, or the max_ksplit/min_block bounds)
  that is malformed, or that the site it is pinned on cannot honour, wherever it
  was given: the options, an override, or a plan entry."""


class PlanError(MeshsliceError):
  """A saved `Plan` that cannot be read or applied: malformed JSON, a site listed twice,
  no such site, or made for another program or mesh."""
