"""Plans as data: what the pass decided per site, saved as JSON, edited, passed back.

    plan = meshslice.explain(step)(*args).plan          # decide once
    plan.save("plan.json")                               # review, commit, share
    plan = meshslice.Plan.load("plan.json").edit(3, ksplit=2)
    fast = meshslice.transform(step, plan=plan)          # apply exactly that plan

The JSON is deterministic (sorted keys, fixed float formatting), so two processes that
plan the same program produce byte-identical files.
"""
from __future__ import annotations

import dataclasses
import json
import os

from .errors import PinError, PlanError
from .param_names import without_positions
from .pins import (unknown_key, validate_algorithm, validate_count, validate_pin,
                   validate_reduce_scatter)

_FIELDS = {"index": int, "path": list, "source": str, "rewritten": bool}
_OPTIONAL = {"algorithm": (str, type(None)), "dataflow": (str, type(None)),
             "ksplit": (int, type(None)), "rewrite": (bool,), "module": (str,),
             "reduce_scatter": (str, type(None)), "hold_gathers": (bool,),
             "predicted_seconds": (float, int, type(None)),
             "baseline_seconds": (float, int, type(None)),
             # set by `Plan.edit`: the entry pins what it holds even if not rewritten
             "edited": (bool,)}
# Every key a plan may hold, at the top level and in a site entry: any other is an error
# (a hand-edited "ksplits": 2 would otherwise apply the plan without it). `mesh_shape`
# maps the user's axis names to sizes, so its keys are data, not names.
_TOP_LEVEL = ("mesh_shape", "sites", "version")
_ENTRY_KEYS = tuple(sorted((*_FIELDS, *_OPTIONAL)))
VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
  """Per-site decisions of one program on one mesh.

  `sites` holds one dict per dot_general: index, path (position in the nested jaxpr),
  source, module, rewritten, algorithm, dataflow, ksplit (and predictions when known).
  `source` is portable ('file:line' relative to the project, or 'package/path.py:line'
  for installed code) and `module` is the module path, so a plan saved on one host
  applies on every host running the same program from another folder or virtualenv.
  """

  mesh_shape: dict
  sites: tuple

  @classmethod
  def from_report(cls, report) -> "Plan":
    entries = []
    for s in report.sites:
      entry = {"index": s.index, "path": [list(p) if isinstance(p, tuple) else p
                                          for p in s.path],
               "source": s.source, "module": getattr(s, "module", ""),
               "rewritten": s.rewritten, "algorithm": s.algorithm,
               "dataflow": s.dataflow, "ksplit": s.ksplit}
      # written only when set, so plans of the default form stay byte-identical
      if s.rewritten and getattr(s, "reduce_scatter", None):
        entry["reduce_scatter"] = s.reduce_scatter
      if s.rewritten and getattr(s, "hold_gathers", None) is not None:
        entry["hold_gathers"] = s.hold_gathers
      for name in ("predicted_seconds", "baseline_seconds"):
        value = getattr(s, name, None)
        if value is not None:
          entry[name] = float(value)
      entries.append(entry)
    return cls(mesh_shape=dict(report.mesh_shape), sites=tuple(entries))

  # -- JSON
  def to_json(self) -> str:
    return json.dumps({"version": VERSION, "mesh_shape": self.mesh_shape,
                       "sites": list(self.sites)}, sort_keys=True, indent=1)

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      f.write(self.to_json() + "\n")

  @classmethod
  def from_json(cls, text: str, where: str = "plan") -> "Plan":
    if not isinstance(text, (str, bytes, bytearray)):
      raise TypeError(f"Plan.from_json expects the plan's JSON text (str), got "
                      f"{type(text).__name__}; to read a plan file use Plan.load(path)")
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise PlanError(f"{where} is not valid JSON: {e}") from None
    for name in data if isinstance(data, dict) else ():
      if name not in _TOP_LEVEL:
        raise PlanError(unknown_key(where, name, _TOP_LEVEL))
    if not isinstance(data, dict) or data.get("version") != VERSION:
      raise PlanError(f"{where}: expected a JSON object with \"version\": {VERSION}")
    mesh_shape = data.get("mesh_shape")
    if not isinstance(mesh_shape, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1
        for v in mesh_shape.values()):
      raise PlanError(f"{where}: field 'mesh_shape' must be an object {{axis: size}} with "
                      f"positive int sizes, got {mesh_shape!r}")
    sites = data.get("sites")
    if not isinstance(sites, list):
      raise PlanError(f"{where}: field 'sites' must be a list")
    for k, entry in enumerate(sites):
      if not isinstance(entry, dict):
        raise PlanError(f"{where}: sites[{k}] must be an object")
      for name in entry:
        if name not in _ENTRY_KEYS:
          index = entry.get("index")
          site = (f" (site #{index})" if isinstance(index, int)
                  and not isinstance(index, bool) else "")
          raise PlanError(unknown_key(f"{where}: sites[{k}]{site}", name, _ENTRY_KEYS))
      for name, kind in _FIELDS.items():
        if name not in entry:
          raise PlanError(f"{where}: sites[{k}] is missing field {name!r}")
        if not isinstance(entry[name], kind) or (kind is int and isinstance(entry[name], bool)):
          raise PlanError(f"{where}: sites[{k}].{name} must be {kind.__name__}, got "
                          f"{entry[name]!r}")
      for name, kinds in _OPTIONAL.items():
        if name in entry and (not isinstance(entry[name], kinds) or (
            isinstance(entry[name], bool) and bool not in kinds)):
          raise PlanError(f"{where}: sites[{k}].{name} has the wrong type: {entry[name]!r}")
      _check_entry(f"{where}: sites[{k}]", entry)
    _check_unique(where, sites)
    return cls(mesh_shape=data["mesh_shape"], sites=tuple(sites))

  @classmethod
  def load(cls, path: str) -> "Plan":
    if not isinstance(path, (str, os.PathLike)):
      raise TypeError(f"Plan.load expects the path of a plan JSON file (str or "
                      f"os.PathLike), got {type(path).__name__} {path!r}; for JSON text use "
                      "Plan.from_json(text)")
    try:
      with open(path) as f:
        text = f.read()
    except OSError as e:
      raise PlanError(f"plan file {path!r} cannot be read: {e.strerror}") from None
    return cls.from_json(text, where=f"plan file {path!r}")

  # -- editing and applying
  def edit(self, index: int, **pin) -> "Plan":
    """A copy with site `index` pinned: algorithm=, dataflow=, ksplit=, rewrite=,
    reduce_scatter=, hold_gathers=."""
    where = f"Plan.edit(site {index!r})"
    for name, value in pin.items():
      if value is None:
        raise PinError(f"{where}: {name}=None cannot be pinned; give a value (ksplit: a "
                       "positive int, algorithm: a name, dataflow: 'os'/'ls'/'rs', "
                       "rewrite: True/False), or leave the key out")
    validate_pin(where, pin)
    if not any(e["index"] == index for e in self.sites):
      indexes = ", ".join(str(e["index"]) for e in self.sites) or "none"
      raise PlanError(f"the plan has no site #{index!r} (it has {len(self.sites)} sites: "
                      f"{indexes})")
    def edited(entry):
      new = dict(entry, **pin, edited=True)
      # asking a collective site for slices means: slice it
      if (pin.get("ksplit") or 1) > 1 and "algorithm" not in pin \
          and new["algorithm"] == "collective":
        new["algorithm"] = "meshslice"
      return new
    sites = tuple(edited(e) if e["index"] == index else e for e in self.sites)
    return dataclasses.replace(self, sites=sites)

  def pin_for(self, index: int) -> dict:
    """What this plan fixes for site `index` ({} when nothing). Sites are matched by
    their position in program order (checked against the source by `check_matches`),
    not by jaxpr path, which shifts when e.g. a mesh context adds a top-level reshard."""
    for entry in self.sites:
      if entry["index"] == index:
        if entry.get("rewrite") is False:
          return {"rewrite": False}
        if not entry["rewritten"] and not entry.get("edited"):
          return {}
        pin = {k: entry[k] for k in ("algorithm", "dataflow", "ksplit", "reduce_scatter")
               if entry.get(k)}
        if pin.get("algorithm") and entry["rewritten"]:
          # a site without a recorded form was planned with one reduce-scatter: so it
          # stays, whatever "auto" would pick under other flags (an edited left-alone
          # entry was not planned: it pins what the edit gave, no form)
          pin.setdefault("reduce_scatter", "reduce_scatter")
        if "hold_gathers" in entry:             # a bool: False is a pin too
          pin["hold_gathers"] = entry["hold_gathers"]
        return pin
    return {}

  def check_matches(self, sites, mesh_shape=None) -> None:
    """Raise if this plan was made for another program or another mesh."""
    if mesh_shape is not None and dict(self.mesh_shape) != dict(mesh_shape):
      fmt = lambda m: " x ".join(f"{k}={v}" for k, v in m.items()) or "none"
      raise PlanError(f"plan was made for mesh {fmt(self.mesh_shape)}, this program runs on "
                      f"mesh {fmt(mesh_shape)}: a plan only applies to the mesh shape it was "
                      "made for; re-plan with meshslice.explain(...).plan on this mesh")
    _check_unique("plan", self.sites)
    for k, entry in enumerate(self.sites):
      _check_entry(f"plan sites[{k}]", entry)
    here = {s.index: s for s in sites}
    for entry in self.sites:
      site = here.get(entry["index"])
      if site is None or not _same_site(entry, site):
        found = f"{_where(site.source, site.module)}" if site else "no matmul"
        raise PlanError(f"plan does not match this program: site #{entry['index']} was a "
                        f"matmul at {_where(entry['source'], entry.get('module', ''))}, this "
                        f"program has {found} there; re-plan with "
                        "meshslice.explain(...).plan")


# every dataflow a report can name (matching.py): the 2D ones and the 1D site kinds
_DATAFLOWS = ("os", "ls", "rs", "1d-gather", "1d-scatter", "1d-allreduce")


def _where(source: str, module: str = "") -> str:
  return f"{source!r}" + (f" (module {module})" if module else "")


def _same_site(entry: dict, site) -> bool:
  """Whether plan `entry` describes `site`: the same module path (when both have one;
  a path saved before list positions were named, 'layers/mlp/wo', matches
  'layers/1/mlp/wo') and the same source, compared as portable paths; a path that is a
  '/'-suffix of the other matches (a plan saved with absolute paths, or from another
  project root), and with equal module paths the file name and line suffice."""
  module, saved = getattr(site, "module", ""), entry.get("module", "")
  if saved and module and saved not in (module, without_positions(module)):
    return False
  a, b = entry["source"], site.source
  if a == b or (a and b and (a.endswith("/" + b) or b.endswith("/" + a))):
    return True
  return bool(saved and module and a and b
              and a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1])


def _check_entry(where: str, entry: dict) -> None:
  """The values of one plan entry: what the pass could apply."""
  validate_count(f"{where}.ksplit", entry.get("ksplit"), automatic_allowed=True,
                 unset=" or null")
  validate_algorithm(entry.get("algorithm"), f"{where}.algorithm", unset=" or null")
  validate_reduce_scatter(entry.get("reduce_scatter"), f"{where}.reduce_scatter")
  dataflow = entry.get("dataflow")
  if dataflow is not None and dataflow not in _DATAFLOWS:
    raise PinError(f"{where}.dataflow must be one of {', '.join(map(repr, _DATAFLOWS))} "
                   f"or null, got {dataflow!r}")
  if entry.get("index", 0) < 0:
    raise PlanError(f"{where}.index must be >= 0, got {entry['index']!r}")


def _check_unique(where: str, sites) -> None:
  seen = set()
  for entry in sites:
    index = entry.get("index")
    if index in seen:
      raise PlanError(f"{where}: site index {index} appears more than once; each site "
                      "must have one entry (re-plan with meshslice.explain(...).plan)")
    seen.add(index)
