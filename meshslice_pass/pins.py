"""What a user may pin on a site, and its validation: shared by `options` (global options,
overrides) and `plan` (saved plans, `Plan.edit`), which otherwise do not depend on each
other.

Example:
  >>> validate_pin("overrides[3]", {"ksplit": 2, "dataflow": "ls"})
  >>> validate_pin("overrides[3]", {"slices": 2})
  Traceback (most recent call last):
  ...
  meshslice.errors.PinError: overrides[3] has unknown key 'slices'; allowed: algorithm, dataflow,
  ksplit, rewrite, reduce_scatter, hold_gathers
  >>> validate_pin("overrides[3]", {"ksplit": 0})
  Traceback (most recent call last):
  ...
  meshslice.errors.PinError: overrides[3]: ksplit must be a positive int (1 = no slicing) or None
  for automatic, got 0
"""
from __future__ import annotations

import difflib

from meshslice.rewrites import ALGORITHMS
from meshslice.rewrites.scatter import SCATTER_FORMS

from .errors import PinError

PIN_KEYS = ("algorithm", "dataflow", "ksplit", "rewrite", "reduce_scatter", "hold_gathers")


def _did_you_mean(value, choices) -> str:
  """"; did you mean 'x'?" for the nearest of `choices` to a mistyped str, else ""."""
  if not isinstance(value, str):
    return ""
  close = ([c for c in choices if c.lower() == value.lower()]
           or difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6))
  return f"; did you mean {close[0]!r}?" if close else ""


def validate_algorithm(value, name: str = "algorithm",
                       unset: str = " (or None for automatic)") -> None:
  if value is not None and value not in ALGORITHMS:
    raise PinError(f"{name} must be one of {', '.join(map(repr, ALGORITHMS))}{unset}, "
                   f"got {value!r}{_did_you_mean(value, ALGORITHMS)}")


def validate_count(name: str, value, *, automatic_allowed: bool = False,
                   unset: str = " or None for automatic") -> None:
  """ksplit / max_ksplit / min_block: a positive int (None = automatic where allowed)."""
  if value is None and automatic_allowed:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    hint = unset if automatic_allowed else ""
    raise PinError(f"{name} must be a positive int (1 = no slicing){hint}, got {value!r}")


# what the reduce_scatter option and pin take: a form, or "auto" (the planner's choice)
SCATTER_CHOICES = SCATTER_FORMS + ("auto",)


def validate_reduce_scatter(value, name: str = "reduce_scatter") -> None:
  """How ls / rs sites reduce-scatter their partial products: one of SCATTER_CHOICES, or
  None for the default ("auto": the planner picks the form)."""
  if value is not None and value not in SCATTER_CHOICES:
    raise PinError(f"{name} must be one of {', '.join(map(repr, SCATTER_CHOICES))} (or None "
                   f"for 'auto'), got {value!r}{_did_you_mean(value, SCATTER_CHOICES)}")


def validate_pin(where: str, pin) -> None:
  """A per-site pin {algorithm, dataflow, ksplit, rewrite, reduce_scatter, hold_gathers};
  `where` names it in errors."""
  if not isinstance(pin, dict):
    raise PinError(f"{where} must be a dict with keys from {', '.join(PIN_KEYS)}, got "
                   f"{type(pin).__name__}")
  for name in pin:
    if name not in PIN_KEYS:
      hint = _did_you_mean(name, PIN_KEYS)
      hint = f" (did you mean {hint[len('; did you mean '):-1]}?)" if hint else ""
      raise PinError(f"{where} has unknown key {name!r}{hint}; allowed: "
                     f"{', '.join(PIN_KEYS)}")
  validate_algorithm(pin.get("algorithm"), f"{where}: algorithm")
  validate_count(f"{where}: ksplit", pin.get("ksplit"), automatic_allowed=True)
  if pin.get("dataflow") not in (None, "os", "ls", "rs"):
    raise PinError(f"{where}: dataflow must be one of 'os', 'ls', 'rs', got "
                   f"{pin['dataflow']!r}{_did_you_mean(pin['dataflow'], ('os', 'ls', 'rs'))}")
  validate_reduce_scatter(pin.get("reduce_scatter"), f"{where}: reduce_scatter")
  for name in ("rewrite", "hold_gathers"):
    if name in pin and not isinstance(pin[name], bool):
      raise PinError(f"{where}: {name} must be True or False, got {pin[name]!r}")
