"""What a user may pin on a site, its validation, and the rule every pin is judged by once
the sites are planned: shared by `options` (global options, overrides), `plan` (saved
plans, `Plan.edit`) and `planning`, which applies the rule.

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

The pin rule
------------
Every setting a site's request pins (by an override key or a plan entry) gets, on every
site, one of three verdicts from its rule in `PIN_RULES`, the one table of what each pin
key means; `planning` judges every site by it once the program is planned (`judge`).
Settings from the global options are meant for the sites they apply to, and a pin of
None (or reduce_scatter "auto") asks for the automatic choice: neither is judged.

- honoured: the planned site does what the key asks;
- noted: the key does not apply to what the site became (its kind, or the pin's own
  rewrite=False): "<where>: <key>=<value> not used: <why>" in the site's `note` and
  `pin_notes` (the report's table shows them for left-alone sites too);
- an error (`PinError`) naming where it was pinned, the key, the site, why, and the fix:
  "<where> pins <key>=<value> on site #k (<source>), which cannot be rewritten: <reason>.
  Remove the pin (or pin {'rewrite': False}); see the site indexes ...".

  key             on a rewritten site                        on a site left alone
  --------------  -----------------------------------------  ---------------------------
  algorithm       honoured [1]                               error [2]
  dataflow        honoured [1] (reached by a reshard)        error [2]
  ksplit          honoured [1]; noted on the collective      error [2]
                  algorithm (it does not slice)
  rewrite         True: honoured                             True: error [2];
                                                             False: honoured
  reduce_scatter  honoured on the ls / rs sites of           error [2]
                  meshslice and collective; "all_to_all"
                  noted elsewhere ("reduce_scatter", one
                  collective, is what those sites do)
  hold_gathers    honoured on weight gradients (sites with   error [2]
                  swapped operands); noted elsewhere

  [1] A value the site's kind cannot take (an algorithm that cannot serve it, a ksplit
      that does not divide it, a dataflow no reshard gives) is an error while planning,
      where another dataflow may still take it.
  [2] Noted when the pin itself leaves the site alone (rewrite=False in the same pin);
      an error "which is left alone as requested by <where> (rewrite=False)" when
      another pin does; for a site left to XLA (`LEFT_TO_XLA`), an error whose fix is
      pinning {'rewrite': True} as well; for any other reason (no communication needed,
      operand sharding unknown, no plan fits HBM, ...), the error above.

A pin given once for several sites (a 'file:line' or module-pattern key) must be taken
(honoured or noted) by one of them at least: its error on the others is then a note
("<where>: <key>=<value> not used: the site cannot be rewritten (see its reason)").
A pin key is a key of `PIN_RULES` (`PIN_KEYS`): a new one is added there, with its rule.
"""
from __future__ import annotations

import dataclasses
import difflib

from meshslice.rewrites import ALGORITHMS
from meshslice.rewrites.scatter import SCATTER_FORMS

from .errors import PinError


def _did_you_mean(value, choices) -> str:
  """"; did you mean 'x'?" for the nearest of `choices` to a mistyped str, else ""."""
  if not isinstance(value, str):
    return ""
  close = ([c for c in choices if c.lower() == value.lower()]
           or difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6))
  return f"; did you mean {close[0]!r}?" if close else ""


def unknown_key(where: str, name, allowed) -> str:
  """The error text for a key of a pin, plan or plan entry that is not one of `allowed`:
  where, the key, the nearest allowed key, every allowed key.

  >>> print(unknown_key("plan: sites[2]", "hold_gather", ("ksplit", "hold_gathers")))
  plan: sites[2] has unknown key 'hold_gather' (did you mean 'hold_gathers'?); allowed: ksplit,
  hold_gathers
  """
  hint = _did_you_mean(name, allowed)
  hint = f" (did you mean {hint[len('; did you mean '):-1]}?)" if hint else ""
  return f"{where} has unknown key {name!r}{hint}; allowed: {', '.join(allowed)}"


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
      raise PinError(unknown_key(where, name, PIN_KEYS))
  validate_algorithm(pin.get("algorithm"), f"{where}: algorithm")
  validate_count(f"{where}: ksplit", pin.get("ksplit"), automatic_allowed=True)
  if pin.get("dataflow") not in (None, "os", "ls", "rs"):
    raise PinError(f"{where}: dataflow must be one of 'os', 'ls', 'rs', got "
                   f"{pin['dataflow']!r}{_did_you_mean(pin['dataflow'], ('os', 'ls', 'rs'))}")
  validate_reduce_scatter(pin.get("reduce_scatter"), f"{where}: reduce_scatter")
  for name in ("rewrite", "hold_gathers"):
    if name in pin and not isinstance(pin[name], bool):
      raise PinError(f"{where}: {name} must be True or False, got {pin[name]!r}")


# ------------------------------------------------------------------------ the pin rule
# (the module docstring says it in words; `judge` applies it to a planned program)

SEE_SITES = "see the site indexes and sources with print(meshslice.explain(fn)(*args))"

# The start of the reason of a site whose rewrite is not predicted faster than XLA's own
# program (`planning._versus_xla`): a {'rewrite': True} pin rewrites it anyway.
LEFT_TO_XLA = "left to XLA"

# The rules measured on compiled steps that can plan a site instead of the per-site model
# (`planning.Site.rule`): the v4 step template (`planning._STEP_TEMPLATE_MEASURED`), its
# guard for steps with too little compute (unsliced, own layout), and the tpu7x
# collective-over-XLA rule (`planning._COLLECTIVE_OVER_XLA_MEASURED`). The report says its
# per-site sum does not hold the first and last rules' gain
# (`Report.measured_on_compiled_steps`).
STEP_TEMPLATE_RULE = "step_template"
STEP_TEMPLATE_GUARD_RULE = "step_template_guard"
COLLECTIVE_OVER_XLA_RULE = "collective_over_xla"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
  """What a planned site made of one pinned key: `kind` is "honoured", "note" (`why`
  follows "not used: ") or "error" (`why` follows "which ", `fix` says what to change,
  and `instead` follows "not used: " when another site the pin matched takes it)."""

  kind: str
  why: str = ""
  fix: str = ""
  instead: str = ""


HONOURED = Verdict(kind="honoured")


def _note(why: str) -> Verdict:
  return Verdict(kind="note", why=why)


def _error(why: str, fix: str = "Remove the pin", instead: str = "") -> Verdict:
  return Verdict(kind="error", why=why, fix=fix, instead=instead or f"the site {why}")


def _left_alone(where: str, site, request) -> Verdict:
  """The verdict of every key but rewrite=False on a site that is not rewritten."""
  if request.rewrite is False:
    by = request.pinned_by("rewrite")
    if not by or by == where:                 # the pin itself leaves the site alone
      return _note("the site is left alone as requested (rewrite=False)")
    return _error(f"is left alone as requested by {by} (rewrite=False)",
                  f"Remove the pin, or the rewrite=False of {by}")
  # (the site's reason is in the report next to the note, so the note does not repeat it)
  if site.reason.startswith(LEFT_TO_XLA):
    return _error(f"is not rewritten: {site.reason}",
                  "Pin {'rewrite': True} as well to rewrite it anyway, or remove the pin",
                  "the site is left to XLA (see its reason)")
  return _error(f"cannot be rewritten: {site.reason}",
                "Remove the pin (or pin {'rewrite': False})",
                "the site cannot be rewritten (see its reason)")


def _planned_as(site) -> str:
  return f"is planned as {site.algorithm} {site.dataflow} S={site.ksplit}"


def _algorithm_rule(value, where, site, request) -> Verdict:
  if not site.rewritten:
    return _left_alone(where, site, request)
  return HONOURED if site.algorithm == value else _error(_planned_as(site))


def _dataflow_rule(value, where, site, request) -> Verdict:
  if not site.rewritten:
    return _left_alone(where, site, request)
  return HONOURED if site.dataflow == value else _error(_planned_as(site))


def _ksplit_rule(value, where, site, request) -> Verdict:
  if not site.rewritten:
    return _left_alone(where, site, request)
  if site.ksplit == value:
    return HONOURED
  if site.algorithm == "collective":
    by = request.pinned_by("algorithm") or "the algorithm option"
    return _note(f"the collective algorithm ({by}) does not slice; pin "
                 "algorithm='meshslice' as well to slice this site")
  return _error(_planned_as(site))


def _rewrite_rule(value, where, site, request) -> Verdict:
  if value is False:
    return HONOURED if not site.rewritten else _error("is rewritten")
  return HONOURED if site.rewritten else _left_alone(where, site, request)


def takes_reduce_scatter(algorithm, dataflow) -> bool:
  """Whether a site planned as `algorithm` / `dataflow` reduce-scatters partial products
  in a form the reduce_scatter option or pin chooses."""
  return dataflow in ("ls", "rs") and algorithm in ("meshslice", "collective")


def _reduce_scatter_rule(value, where, site, request) -> Verdict:
  if value == "auto":                        # the planner's choice: asks for nothing
    return HONOURED
  if not site.rewritten:
    return _left_alone(where, site, request)
  if takes_reduce_scatter(site.algorithm, site.dataflow):
    return (HONOURED if (site.reduce_scatter or "reduce_scatter") == value
            else _error(f"reduce-scatters as {site.reduce_scatter or 'reduce_scatter'}"))
  if value == "reduce_scatter":              # one collective: what every other site does
    return HONOURED
  return _note(f"only the ls / rs sites of meshslice and collective take it (this is "
               f"{site.algorithm} {site.dataflow})")


def _hold_gathers_rule(value, where, site, request) -> Verdict:
  if not site.rewritten:
    return _left_alone(where, site, request)
  if not site.swapped:
    return _note("only weight gradients (sites with swapped operands) hold their gathers "
                 "back")
  return HONOURED if site.hold_gathers is value else _error(
      f"has hold_gathers={site.hold_gathers!r}")


# The pin rule, one entry per pin key: (value, where it was pinned, planned site, the
# site's `options.SiteRequest`) -> Verdict. A key is a pin key by being here.
PIN_RULES = {
    "algorithm": _algorithm_rule,
    "dataflow": _dataflow_rule,
    "ksplit": _ksplit_rule,
    "rewrite": _rewrite_rule,
    "reduce_scatter": _reduce_scatter_rule,
    "hold_gathers": _hold_gathers_rule,
}
PIN_KEYS = tuple(PIN_RULES)


def judge(sites, request_for) -> dict:
  """Apply the pin rule to every pinned setting of every planned site (`request_for(site)`
  gives its `options.SiteRequest`, whose `origin` says which settings are pinned where).
  Raises the first error (program order, then PIN_KEYS order) as a PinError; returns
  {site index: (note, ...)} for the notes."""
  judged = []                                # (site, name, value, where, verdict)
  taken = set()                              # (where, name) honoured or noted somewhere
  for site in sites:
    request = request_for(site)
    pinned = dict(request.origin)
    for name in PIN_KEYS:
      value = getattr(request, name)
      if name not in pinned or value is None:
        continue
      where = pinned[name]
      verdict = PIN_RULES[name](value, where, site, request)
      judged.append((site, name, value, where, verdict))
      if verdict.kind != "error":
        taken.add((where, name))
  notes = {}
  for site, name, value, where, verdict in judged:
    if verdict.kind == "error" and (where, name) not in taken:
      asked = ", ".join(f"{n}={v!r}" for s, n, v, w, other in judged
                        if s is site and w == where and other == verdict
                        and (w, n) not in taken)
      raise PinError(f"{where} pins {asked} on {site.label}, which {verdict.why}. "
                     f"{verdict.fix}; {SEE_SITES}")
    if verdict.kind != "honoured":
      # an error on one of several sites a pin matched, when another takes it: a note
      why = verdict.why if verdict.kind == "note" else verdict.instead
      notes.setdefault(site.index, []).append(f"{where}: {name}={value!r} not used: {why}")
  return {index: tuple(texts) for index, texts in notes.items()}
