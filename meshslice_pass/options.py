"""User options of `meshslice.transform` / `meshslice.explain`, validated up front."""
from __future__ import annotations

import dataclasses

from meshslice.rewrites import ALGORITHMS

DEFAULT_PROFILE = "tpu-v4"


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
    overrides: pin single sites: {site index or "file:line": {"algorithm": ...,
      "dataflow": ..., "ksplit": ..., "rewrite": bool}}. A pinned request a site cannot
      honour is always an error naming the site.
    plan: a `Plan` (or the path of a plan JSON file) saved from an earlier run; its
      per-site choices are applied as overrides, matched by site index (program order)
      and checked against each site's source location.
    profile: the hardware profile the cost model plans for: a shipped name
      ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "cpu"), a profile JSON path, or
      a `meshslice.costmodel.HardwareProfile`.
  """

  algorithm: str | None = None
  ksplit: int | None = None
  max_ksplit: int = 4
  min_block: int = 8
  strict: bool = False
  overrides: dict | None = None
  plan: object = None
  profile: object = DEFAULT_PROFILE

  @classmethod
  def from_kwargs(cls, caller: str, kwargs: dict) -> "Options":
    allowed = [f.name for f in dataclasses.fields(cls)]
    for name in kwargs:
      if name not in allowed:
        raise TypeError(f"{caller} got an unknown option {name!r}; allowed options: "
                        f"{', '.join(allowed)}")
    plan = kwargs.get("plan")
    if plan is not None:
      from .plan import Plan
      if isinstance(plan, str):
        kwargs = dict(kwargs, plan=Plan.load(plan))
      elif not isinstance(plan, Plan):
        raise ValueError("plan must be a meshslice.Plan or the path of a plan JSON file, got "
                         f"{type(plan).__name__}")
    from meshslice.costmodel import load_profile
    try:
      kwargs = dict(kwargs, profile=load_profile(kwargs.get("profile", DEFAULT_PROFILE)))
    except ValueError as e:
      raise ValueError(f"profile: {e}") from None
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
    if self.overrides is not None:
      if not isinstance(self.overrides, dict):
        raise ValueError("overrides must be a dict {site index or 'file:line': {...}}, got "
                         f"{type(self.overrides).__name__}")
      for key, pin in self.overrides.items():
        if not isinstance(key, (int, str)) or isinstance(key, bool):
          raise ValueError(f"overrides key {key!r} must be a site index (int) or a source "
                           "location 'file:line' (str)")
        _validate_pin(f"overrides[{key!r}]", pin)

  def request_for(self, *, index: int, source: str) -> "SiteRequest":
    """What the user asked for this site: global options, then plan, then overrides."""
    pin = {}
    if self.plan is not None:
      pin.update(self.plan.pin_for(index))
    for key, value in (self.overrides or {}).items():
      if key == index or (isinstance(key, str) and _same_location(source, key)):
        pin.update(value)
    return SiteRequest(
        rewrite=pin.get("rewrite"), dataflow=pin.get("dataflow"),
        algorithm=pin.get("algorithm", self.algorithm),
        ksplit=pin.get("ksplit", self.ksplit),
        strict=self.strict or bool({"algorithm", "ksplit"} & set(pin)))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SiteRequest:
  """The request for one site after merging options, plan and overrides."""
  rewrite: bool | None = None
  algorithm: str | None = None
  dataflow: str | None = None
  ksplit: int | None = None
  strict: bool = False


_PIN_KEYS = ("algorithm", "dataflow", "ksplit", "rewrite")


def _validate_pin(where: str, pin):
  if not isinstance(pin, dict):
    raise ValueError(f"{where} must be a dict with keys from {', '.join(_PIN_KEYS)}, got "
                     f"{type(pin).__name__}")
  for name, value in pin.items():
    if name not in _PIN_KEYS:
      raise ValueError(f"{where} has unknown key {name!r}; allowed: {', '.join(_PIN_KEYS)}")
  Options(algorithm=pin.get("algorithm"), ksplit=pin.get("ksplit")).validate()
  if pin.get("dataflow") not in (None, "os", "ls", "rs"):
    raise ValueError(f"{where}: dataflow must be one of 'os', 'ls', 'rs', got "
                     f"{pin['dataflow']!r}")
  if "rewrite" in pin and not isinstance(pin["rewrite"], bool):
    raise ValueError(f"{where}: rewrite must be True or False, got {pin['rewrite']!r}")


def _same_location(source: str, wanted: str) -> bool:
  return bool(source) and (source == wanted or source.endswith("/" + wanted))
