"""User options of `meshslice.transform` / `meshslice.explain`, validated up front."""
from __future__ import annotations

import dataclasses
import json
import os
import re

from meshslice.costmodel import HardwareProfile, known_profiles, load_profile, xla_baseline

from . import backend_flags
from .errors import PinError
from .param_names import module_matches
from .plan import Plan
from .pins import validate_algorithm, validate_count, validate_pin, validate_reduce_scatter

DEFAULT_PROFILE = "tpu-v4"

# The generations whose meshes plan with their own profile when none is given
# (`Options.for_mesh`): those whose default plans were compiled against XLA's over a grid
# of layers and meshes (docs/tpu.md, "The never-slower sweep on v5p, v6e and Ironwood").
# v5e is not among them: with tpu-v5e the per-site model sliced every GPT-3 step on
# v5e:8x8 and four of six compiled slower than XLA (0.920-0.941x: seq 512 on 16x4, 8x8
# and 32x2, seq 2048 on 32x2), where tpu-v4's plan leaves every site to XLA.
_MESH_PROFILE_GENERATIONS = ("v4", "v5p", "v6e", "tpu7x")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Options:
  """What the user asked for.

  Attributes:
    algorithm: the algorithm for every site, one of `meshslice.rewrites.ALGORITHMS`
      ("collective", "meshslice", "cannon", "wang", "summa"); a site it cannot serve
      falls back to the cost model's choice, noted in the report (an error when
      `strict`). None (default): the cost model chooses per site among
      `meshslice.costing.AUTO_ALGORITHMS` ("collective", "meshslice").
    ksplit: slices per site (1 = no slicing); None picks by the ksplit rule. A value a
      site cannot use falls back to the nearest valid one, noted in the report.
    max_ksplit: upper bound for the automatic choice.
    min_block: smallest block (elements of the communicated dim per slice and device
      group) the automatic choice accepts; smaller slices waste matmul efficiency.
    strict: when True, a request a site cannot honour (ksplit, algorithm) is an error
      naming the site instead of a reported fallback.
    relayout: when True (default), the planner may reshard an operand first to run a
      site in another dataflow with the same output layout, if the cost model predicts
      that more than 10% faster (noted in the report); False keeps every site in the
      dataflow its operands' layouts give (a pinned `dataflow` is still honoured).
    overrides: pin sites: {key: {"algorithm": ..., "dataflow": ..., "ksplit": ...,
      "rewrite": bool, "reduce_scatter": ..., "hold_gathers": bool}}. A key is a site
      index (int), a source location "file:line" (the user's line; matched as a path
      suffix, e.g. "model.py:41"), or a module-path
      glob pattern (fnmatch, matched against the whole path, e.g. "*/MlpBlock_*/Dense_1",
      or against the path without its list positions: "layers/mlp/wo" matches
      "layers/1/mlp/wo"; `param_names.module_matches`).
      Settings merge per key, the more specific key winning: index > file:line > module
      pattern > plan > the global options. Several patterns matching one site merge; two
      of them giving one setting different values is an error. A key that matches no
      site, or a pinned request a site cannot honour, is an error naming it.
    plan: a `Plan` (or the path of a plan JSON file) saved from an earlier run; its
      per-site choices are applied as overrides, matched by site index (program order)
      and checked against each site's source location and module path (portable: a plan
      saved in one checkout or virtualenv applies in another).
    profile: the hardware profile the cost model plans for: a shipped name
      ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7x", "h100", "cpu"), a profile JSON
      path, or a `meshslice.costmodel.HardwareProfile`. Omitted: the shipped profile of
      the mesh's TPU generation (a v5p mesh plans with "tpu-v5p", an Ironwood one with
      "tpu-v7x", v6e with "tpu-v6e"; `for_mesh`), and "tpu-v4" on any other mesh (CPU,
      GPU, and v5e, where its own profile's plans compiled slower than XLA: docs/tpu.md).
    xla_baseline: the program XLA itself would run for a site, which every automatic
      plan must beat to be emitted ("leave it to XLA" is a candidate; a site whose best
      rewrite is not predicted faster is left alone, the reason naming both times):
      "windowed" (libtpu's default: XLA's windowed einsum where it fires, its dense
      program elsewhere), "dense" (windowed einsum turned off), "none" (no such
      candidate), or "auto" (default): "windowed" for profiles with TPU compiler terms
      (the tpu-* profiles, calibrated profile files), "none" otherwise (cpu, h100). The
      collective rewrite compiles to XLA's dense program, so it is kept on a tie.
      Sites with a pinned algorithm, ksplit or dataflow are not compared.
    source_packages: installed packages that hold *your* model code (e.g.
      ("keras_hub",) or ("maxtext",)): their frames count as yours in the report's
      `source` column, which otherwise skips every installed package (frameworks) as it
      skips JAX's internals.
    reduce_scatter: how ls / rs sites of the meshslice and collective algorithms
      reduce-scatter their partial products: "reduce_scatter" (one reduce-scatter
      collective per slice), "all_to_all" (an all-to-all and a local sum, laid out so
      that neither copies the partial: `meshslice.rewrites.scatter`), or "auto" (None,
      the default): "all_to_all" when the mesh is TPU and `compiler_flags`
      turn on `--xla_tpu_enable_async_all_to_all=true`, else
      "reduce_scatter". On TPU v4 libtpu keeps reduce-scatters synchronous but runs those
      all-to-alls asynchronously, so a weight gradient's reduce-scatter hides under the
      rest of the backward pass; the sum fuses into its consumer (docs/tpu.md). Also a
      per-site pin key.
    hold_gathers: whether each rewritten weight gradient (a site planned with its
      operands swapped) gathers its forward activation only once its cotangent exists
      (`rewrites.slicing.not_before`, bit for bit the same values). "auto" (default): on
      the CPU compiler, outside loop bodies. True: everywhere, loop bodies and TPU
      included. It trades step time for memory: inside the scanned layer XLA otherwise
      shares the activation's gather between the recomputed forward site and the late
      weight gradient, and the gathered copy stays live through the attention backward
      (what it saves and costs on a GPT-3 layer: docs/benchmarks-log.md). False: never.
      Also a per-site pin key (True / False); a saved plan records it where set.
    compiler_flags: the flags the program will be compiled with (libtpu's
      LIBTPU_INIT_ARGS), as a string or a sequence of "--flag=value" strings: they
      decide XLA's program every rewrite must beat (windowed einsum on or off, collectives
      offloaded to the SparseCore) and the reduce-scatter form "auto" takes. None
      (default): this process's LIBTPU_INIT_ARGS, read once, when `transform` / `explain`
      / `check` is called. Planning itself reads no environment: a plan is a function of
      the program, the mesh, the options and these flags. Give them explicitly to plan
      on one machine for a job compiled with other flags.
    share_reductions: when True (default), rewritten matmuls whose results are only
      added together (a gradient summed over projections, dx = dq Wq^T + dk Wk^T +
      dv Wv^T) and which are planned alike (the same ls or rs plan, operand types and
      layouts) add their partial products on each device and send one reduce-scatter
      a slice for the sum, as XLA's own program does for such a sum; the report notes
      it on each of them. Not where the compiler flags offload reduce-scatters to the
      SparseCore (tpu7x's default, v5p / v6e with the offload flags): there they run
      beside the TensorCore's work already. False: one reduce-scatter a term.
    compiler_terms: what compiled TPU programs add to the analytic model per site
      (`meshslice.costmodel.xla_baseline.CompilerTerms`: dot efficiency, per-slice
      overheads, which sliced collectives overlap, windowed einsum's cost). None
      (default): the profile's, i.e. a calibrated profile file's "compiler_terms" section
      (`python -m meshslice calibrate --aot v4:2x2x2`), else the built-in terms of a
      tpu-* profile, else none; False: the analytic model alone.
  """

  algorithm: str | None = None
  ksplit: int | None = None
  max_ksplit: int = 4
  min_block: int = 8
  strict: bool = False
  overrides: dict | None = None
  plan: Plan | None = None
  profile: object = DEFAULT_PROFILE
  relayout: bool = True
  xla_baseline: str = "auto"
  compiler_terms: object = None
  source_packages: tuple = ()
  reduce_scatter: str | None = None
  hold_gathers: object = "auto"
  compiler_flags: tuple | None = None
  share_reductions: bool = True
  # the keywords as given, when `profile` was not among them (None otherwise):
  # `for_mesh` builds the options again with the mesh's generation's profile
  _without_profile: dict | None = dataclasses.field(default=None, repr=False,
                                                    compare=False)

  @classmethod
  def names(cls) -> tuple:
    """The option names (the fields a user sets; not the private bookkeeping ones)."""
    return tuple(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))

  @classmethod
  def from_kwargs(cls, caller: str, kwargs: dict) -> "Options":
    allowed = cls.names()
    given = None if "profile" in kwargs else dict(kwargs)
    for name in kwargs:
      if name not in allowed:
        raise TypeError(f"{caller} got an unknown option {name!r}; allowed options: "
                        f"{', '.join(allowed)}")
    plan = kwargs.get("plan")
    if plan is not None:
      if isinstance(plan, (str, os.PathLike)):
        kwargs = dict(kwargs, plan=Plan.load(plan))
      elif not isinstance(plan, Plan):
        raise ValueError("plan must be a meshslice.Plan or the path of a plan JSON file, got "
                         f"{type(plan).__name__}")
    profile = kwargs.get("profile", DEFAULT_PROFILE)
    if not isinstance(profile, (str, os.PathLike, HardwareProfile)):
      raise TypeError(
          f"profile must be a shipped hardware profile name ({', '.join(known_profiles())}), "
          "the path of a profile JSON file, or a meshslice.costmodel.HardwareProfile, got "
          f"{type(profile).__name__} {profile!r}; omit it for the default {DEFAULT_PROFILE!r}")
    terms = kwargs.get("compiler_terms")
    try:
      # the profile first: it checks the whole file (JSON, keys, field types) and names
      # the file and the field; the terms reader assumes a well-formed file
      loaded = load_profile(profile)
      if terms is None:
        try:
          terms = xla_baseline.read_terms(profile)
        except (TypeError, AttributeError, KeyError) as e:
          raise ValueError(f"hardware profile {os.fspath(profile)!r}: section "
                           f"{xla_baseline.SECTION!r} is malformed ({e})") from None
      kwargs = dict(kwargs, profile=loaded, compiler_terms=terms or None)
    except ValueError as e:
      raise ValueError(f"profile: {e}") from None
    if kwargs.get("xla_baseline", "auto") == "auto":
      kwargs["xla_baseline"] = "windowed" if kwargs["compiler_terms"] else "none"
    packages = kwargs.get("source_packages", ())
    if isinstance(packages, str):
      packages = (packages,)
    if not isinstance(packages, (tuple, list)) or not all(
        isinstance(p, str) and p.isidentifier() for p in packages):
      raise ValueError("source_packages must be a tuple of top-level package names, e.g. "
                       f"('maxtext',), got {packages!r}")
    kwargs = dict(kwargs, source_packages=tuple(packages),
                  compiler_flags=_compiler_flags(kwargs.get("compiler_flags")),
                  _without_profile=given)
    opts = cls(**kwargs)
    opts.validate()
    return opts

  def for_mesh(self, mesh, caller: str = "meshslice.transform") -> "Options":
    """These options as they plan on `mesh`: where no profile was given and the mesh's
    devices are TPUs of a known generation (`backend_flags.mesh_generation`), the same
    options with that generation's shipped profile (and its compiler terms); else self.
    A plan is thus a function of program, mesh and options, whichever chip the host is.

    Example:
      >>> Options.from_kwargs("t", {}).for_mesh(None).profile.name
      'tpu-v4'
    """
    generation = backend_flags.mesh_generation(mesh)
    if self._without_profile is None or generation not in _MESH_PROFILE_GENERATIONS:
      return self
    name = backend_flags.GENERATIONS[generation].profile
    if name == self.profile.name:
      return self
    # the flags and plan as read when the options were made (the environment is read
    # once, at option time)
    return Options.from_kwargs(caller, dict(self._without_profile, profile=name,
                                            compiler_flags=self.compiler_flags,
                                            plan=self.plan))

  def validate(self):
    validate_algorithm(self.algorithm)
    validate_reduce_scatter(self.reduce_scatter)
    for name in ("ksplit", "max_ksplit", "min_block"):
      validate_count(name, getattr(self, name), automatic_allowed=name == "ksplit")
    if not (isinstance(self.hold_gathers, bool) or self.hold_gathers == "auto"):
      raise ValueError("hold_gathers must be 'auto', True or False, got "
                       f"{self.hold_gathers!r}")
    for name in ("strict", "relayout", "share_reductions"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    choices = ("auto",) + xla_baseline.BASELINES
    if self.xla_baseline not in choices:
      raise ValueError(f"xla_baseline must be {_one_of(choices)}, got {self.xla_baseline!r}")
    if self.compiler_terms is not None and not isinstance(self.compiler_terms,
                                                          xla_baseline.CompilerTerms):
      raise ValueError("compiler_terms must be None (the profile's), False (none) or a "
                       "meshslice.costmodel.xla_baseline.CompilerTerms, got "
                       f"{self.compiler_terms!r}")
    if self.overrides is not None:
      if not isinstance(self.overrides, dict):
        raise ValueError("overrides must be a dict {site index, 'file:line' or module "
                         "pattern: {...}}, got "
                         f"{type(self.overrides).__name__}")
      for key, pin in self.overrides.items():
        _validate_override_key(key)
        validate_pin(f"overrides[{key!r}]", pin)

  def request_for(self, *, index: int, source: str, module: str = "") -> "SiteRequest":
    """What the user asked for this site: global options, then plan, then overrides
    by module pattern, by 'file:line', by index (each setting from the most specific)."""
    pin, origin = {}, {}

    def take(values: dict, where):
      for name, value in values.items():
        pin[name] = value
        origin[name] = where(name) if callable(where) else where

    if self.plan is not None:
      take(self.plan.pin_for(index), f"plan site #{index}")
    overrides = self.overrides or {}
    patterns = {}
    take(_pattern_pin(overrides, index, module, patterns),
         lambda name: f"overrides[{patterns[name]!r}]")
    for key, value in overrides.items():
      if _key_kind(key) == "location" and _same_location(source, key):
        take(value, f"overrides[{key!r}]")
    for key, value in overrides.items():
      if _key_kind(key) == "index" and key == index:
        take(value, f"overrides[{key!r}]")
    hold = pin.get("hold_gathers", self.hold_gathers)
    return SiteRequest(
        rewrite=pin.get("rewrite"), dataflow=pin.get("dataflow"),
        algorithm=pin.get("algorithm", self.algorithm),
        ksplit=pin.get("ksplit", self.ksplit),
        reduce_scatter=pin.get("reduce_scatter", self.reduce_scatter),
        hold_gathers=None if hold == "auto" else hold,
        strict=self.strict or bool({"algorithm", "ksplit"} & set(pin)),
        origin=tuple(sorted(origin.items())))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SiteRequest:
  """The request for one site after merging options, plan and overrides.

  `origin` says where each pinned setting came from, as (setting, where) pairs, e.g.
  (("ksplit", "overrides[0]"),); settings from the global options are absent.
  `pinned_by(name)` gives that text, for errors about a setting the site cannot honour.
  """
  rewrite: bool | None = None
  algorithm: str | None = None
  dataflow: str | None = None
  ksplit: int | None = None
  reduce_scatter: str | None = None
  # True / False pinned or set globally; None: the emitter's default rule ("auto")
  hold_gathers: bool | None = None
  strict: bool = False
  # not compared: sites with the same request share one planning decision
  origin: tuple = dataclasses.field(default=(), compare=False)

  def pinned_by(self, name: str) -> str:
    """Where setting `name` was pinned ("overrides[0]", "plan site #3"), "" if it was not
    (the global options)."""
    return dict(self.origin).get(name, "")


_SEE_SITES = "see the site indexes and sources with print(meshslice.explain(fn)(*args))"


def _one_of(choices) -> str:
  """"'a', 'b' or 'c'": the choices for an error message."""
  return ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"


def _key_kind(key) -> str:
  """'index', 'location' ('file:line') or 'module' (a module-path glob pattern)."""
  if isinstance(key, int) and not isinstance(key, bool):
    return "index"
  return "location" if re.fullmatch(r".+:\d+", key) else "module"


def options_from_json(text: str, where: str = "options") -> dict:
  """`meshslice.transform` keyword options from a JSON object (a bench flag, a config
  file). JSON keys are strings, so an `overrides` key of digits is taken as the site index
  it names. Raises ValueError naming `where` for text that is not a JSON object.

    >>> options_from_json('{"overrides": {"7": {"ksplit": 2}}, "max_ksplit": 4}')
    {'overrides': {7: {'ksplit': 2}}, 'max_ksplit': 4}
  """
  try:
    options = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not JSON ({e})") from None
  if not isinstance(options, dict):
    raise ValueError(f"{where}: a JSON object of transform options is needed, got "
                     f"{type(options).__name__}")
  if isinstance(options.get("overrides"), dict):
    options["overrides"] = {int(k) if k.strip().isdigit() else k: v
                            for k, v in options["overrides"].items()}
  return options


def _validate_override_key(key):
  if isinstance(key, bool) or not isinstance(key, (int, str)):
    raise ValueError(f"overrides key {key!r} must be a site index (int), a source location "
                     f"'file:line' (str) or a module-path pattern (str, e.g. "
                     f"'*/MlpBlock_*/Dense_1'); {_SEE_SITES}")
  if isinstance(key, int) and key < 0:
    raise ValueError(f"overrides key {key} is negative: site indexes count from 0 in "
                     f"program order; {_SEE_SITES}")
  if isinstance(key, str) and (not key.strip() or key.strip().isdigit()):
    hint = (f"; for site #{key} use the int {int(key)}" if key.strip().isdigit() else "")
    raise ValueError(f"overrides key {key!r} is neither a site index (int) nor a source "
                     f"location 'file:line' (e.g. 'model.py:41'){hint}; {_SEE_SITES} "
                     "(a str key that is not 'file:line' is a module-path pattern such as "
                     "'*/MlpBlock_*/Dense_1')")


# Besides --flags, LIBTPU_INIT_ARGS takes libtpu settings spelt NAME=VALUE: MaxText's v4
# scripts set TPU_MEGACORE=MEGACORE_DENSE there. Planning reads flags only; such a
# setting is kept as given. (Lower case without the dashes is a mistyped flag.)
_LIBTPU_SETTING = re.compile(r"[A-Z][A-Z0-9_]*=\S*")


def _compiler_flags(flags) -> tuple:
  """`compiler_flags` as a tuple of flags; None: this process's LIBTPU_INIT_ARGS (the one
  place the environment is read, at option time, never while planning)."""
  if flags is None:
    flags = backend_flags.flags_in_effect()
  if isinstance(flags, str):
    flags = flags.split()
  if not isinstance(flags, (tuple, list)) or not all(
      isinstance(f, str) and (f.startswith("--") or _LIBTPU_SETTING.fullmatch(f))
      for f in flags):
    raise ValueError("compiler_flags must be a LIBTPU_INIT_ARGS string or a sequence of "
                     "'--flag=value' strings (and libtpu's NAME=VALUE settings; or None: "
                     f"this process's), got {flags!r}; "
                     "e.g. compiler_flags=aot.preset_flags('dense,async', 'v4')")
  return tuple(flags)


def _module_matches(module: str, pattern: str) -> bool:
  return bool(module) and module_matches(module, pattern)


def _pattern_pin(overrides: dict, index: int, module: str, origin=None) -> dict:
  """The merged pins of the module patterns matching `module`; an error when two of them
  give one setting different values. `origin` (filled in) maps each setting to its key."""
  pin = {}
  origin = {} if origin is None else origin
  for key, value in overrides.items():
    if _key_kind(key) != "module" or not _module_matches(module, key):
      continue
    for name, setting in value.items():
      if name in pin and pin[name] != setting:
        raise PinError(
            f"overrides[{origin[name]!r}] and overrides[{key!r}] both match site #{index} "
            f"(module {module}) and pin {name} differently ({pin[name]!r} vs {setting!r}); "
            "narrow the patterns, or pin the site by index or 'file:line', which take "
            f"precedence over module patterns; {_SEE_SITES}")
      pin[name], origin[name] = setting, key
  return pin


def _matching_sites(sites, key) -> list:
  kind = _key_kind(key)
  if kind == "index":
    return [s for s in sites if s.index == key]
  if kind == "location":
    return [s for s in sites if _same_location(s.source, key)]
  return [s for s in sites if _module_matches(getattr(s, "module", ""), key)]


def check_overrides(options: Options, sites) -> None:
  """Raise when an override names no site of this program, or pins a site the pass
  cannot rewrite (a pinned request is never dropped silently)."""
  indexes = f"0..{len(sites) - 1}" if sites else "none"
  for key, pin in (options.overrides or {}).items():
    matched = _matching_sites(sites, key)
    if not matched:
      kind = _key_kind(key)
      what = {"index": f"site index {key}", "location": f"source location {key!r}",
              "module": f"module pattern {key!r}"}[kind]
      hint = ""
      if kind == "module":
        modules = sorted({s.module for s in sites if getattr(s, "module", "")})
        hint = (f"; the module paths are {', '.join(modules[:6])}"
                f"{', ...' if len(modules) > 6 else ''} (a pattern must match the whole "
                "path: start it with '*/')" if modules else
                "; no matmul of this program has a module path")
      raise PinError(
          f"overrides[{key!r}]: {what} matches no matmul of this program (it has "
          f"{len(sites)} site{'s' if len(sites) != 1 else ''}, indexes {indexes}){hint}; "
          f"{_SEE_SITES}")
    _check_pinned(f"overrides[{key!r}]", pin, matched)
  plan = options.plan
  if plan is not None:
    for entry in plan.sites:
      pin = plan.pin_for(entry["index"])
      _check_pinned(f"plan site #{entry['index']}", pin,
                    [s for s in sites if s.index == entry["index"]])


def _check_pinned(where: str, pin: dict, sites) -> None:
  """A pin on one site (an index) must be honoured; a pin on a source line or module
  pattern matching several matmuls must be honoured by at least one of them (the others
  keep their reasons)."""
  asked = {k: v for k, v in pin.items() if k in ("algorithm", "dataflow", "ksplit")
           and v is not None}
  if pin.get("rewrite") is True:
    asked["rewrite"] = True
  if not asked or pin.get("rewrite") is False or any(s.rewritten for s in sites):
    return
  for site in sites:
    if not site.rewritten:
      wanted = ", ".join(f"{k}={v!r}" for k, v in asked.items())
      raise PinError(
          f"{where} pins {wanted} on {site.label}, which cannot be rewritten: "
          f"{site.reason}. Remove the pin (or pin {{'rewrite': False}}); {_SEE_SITES}")


def _same_location(source: str, wanted: str) -> bool:
  """`source` ('file:line', portable) is `wanted`, or ends with it after a '/'; an
  absolute `wanted` is first made portable the same way."""
  if not source:
    return False
  if os.path.isabs(wanted.rsplit(":", 1)[0]):
    from .provenance import portable_path
    file, line = wanted.rsplit(":", 1)
    wanted = f"{portable_path(file)}:{line}"
  return source == wanted or source.endswith("/" + wanted)
