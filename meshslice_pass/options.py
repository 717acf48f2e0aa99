"""User options of `meshslice.transform` / `meshslice.explain`, validated up front."""
from __future__ import annotations

import dataclasses

from meshslice.rewrites import ALGORITHMS


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Options:
  """What the user asked for.

  Attributes:
    algorithm: "meshslice" or "collective"; None picks automatically ("meshslice").
    ksplit: slices per site (1 = no slicing); None picks by the ksplit rule. A value a
      site cannot use falls back to the nearest valid one, noted in the report.
    max_ksplit: upper bound for the automatic choice.
    min_block: smallest block (elements of the communicated dim per slice and device
      group) the automatic choice accepts; smaller slices waste matmul efficiency.
    strict: when True, a request a site cannot honour (ksplit, algorithm) is an error
      naming the site instead of a reported fallback.
  """

  algorithm: str | None = None
  ksplit: int | None = None
  max_ksplit: int = 4
  min_block: int = 8
  strict: bool = False

  @classmethod
  def from_kwargs(cls, caller: str, kwargs: dict) -> "Options":
    allowed = [f.name for f in dataclasses.fields(cls)]
    for name in kwargs:
      if name not in allowed:
        raise TypeError(f"{caller} got an unknown option {name!r}; allowed options: "
                        f"{', '.join(allowed)}")
    opts = cls(**kwargs)
    opts.validate()
    return opts

  def validate(self):
    if self.algorithm is not None and self.algorithm not in ALGORITHMS:
      raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))} "
                       f"(or None for automatic), got {self.algorithm!r}")
    for name in ("ksplit", "max_ksplit", "min_block"):
      value = getattr(self, name)
      if value is None and name == "ksplit":
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " or None for automatic" if name == "ksplit" else ""
        raise ValueError(f"{name} must be a positive int (1 = no slicing){hint}, "
                         f"got {value!r}")
    if not isinstance(self.strict, bool):
      raise ValueError(f"strict must be True or False, got {self.strict!r}")
