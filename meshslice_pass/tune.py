"""Compiler-verified plans: compile candidate plans ahead of time for the target TPU
topology, simulate each compiled program, keep the fastest.

The planner's per-site model can be wrong about a whole step (it does not see how XLA
schedules independent work across sites, nor every cost of a slice). `tune` spends
compile time instead: each candidate plan is frozen into a `Plan` (every site pinned:
rewritten as planned, or `rewrite=False`), compiled with libtpu for the mesh's topology
(no TPU needed, `meshslice.aot`), read with `costmodel.tpu_schedule` and simulated; the
fastest simulated step wins. Plain XLA (every site left alone) is always a candidate
and wins ties, so a tuned plan is never slower than XLA on the simulated schedule of
the compiler's own program.

    import meshslice
    from meshslice import aot
    aot.set_flags(*aot.preset_flags("async", "v4"))          # before libtpu loads
    mesh = aot.make_mesh("v4:2x2x2", (2, 4))
    plan = meshslice.tune(step, *aot.abstract_args(args, shardings_on(mesh)), mesh=mesh)
    fast_step = meshslice.transform(step, plan=plan)        # on the real pod

Candidates ({name: transform options}, `CANDIDATES`): "xla" (always added), "default"
(the default plan: its reduce-scatter form "auto"), "collective" (one reduce-scatter
per site), "collective+all_to_all" (its reduce-scatters as an all-to-all and a local
sum), "ksplit=2", "ksplit=4", and "collective+all_to_all, ls ksplit=2" (that plan with
only its ls sites sliced, `SlicedSites`), and that plan with every weight gradient's
gathers held back (`HeldGathers`, for a memory budget: `max_peak`). `refine=N` then
searches locally from the fastest candidate within the budget, a move at a time
(`_moves`: one module's sites of one dataflow sliced one ksplit step finer or coarser,
a group of weight gradients held or released), keeping each faster program. The plan is
a deterministic function of the program, the mesh, the candidates, `refine` and the
libtpu in use: nothing runs on a device, nothing is timed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import re
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING

from .errors import MeshsliceError, PinError
from .param_names import module_matches
from .pins import _did_you_mean, validate_count

if TYPE_CHECKING:
  from .aot import AotResult
  from .plan import Plan

@dataclasses.dataclass(frozen=True, slots=True)
class SlicedSites:
  """A candidate made from an earlier candidate's plan: its rewritten sites of one
  dataflow sliced (`meshslice`, `ksplit`), all of them or those whose module path matches
  one of `modules` (fnmatch patterns); every other site as that plan has it.

  The per-site model cannot see which sites' gathers are left exposed in the compiled
  schedule; slicing only those can pay where slicing every site does not (on GPT-3, the
  ls sites, whose weight gathers libtpu had left synchronous: docs/benchmarks-log.md,
  "The tuned plan: only the ls sites sliced").

  >>> SlicedSites("collective+all_to_all", "ls", 2).dataflow
  'ls'
  """

  base: str
  dataflow: str
  ksplit: int
  modules: tuple = ()


@dataclasses.dataclass(frozen=True, slots=True)
class HeldGathers:
  """A candidate made from an earlier candidate's plan: its rewritten weight gradients
  (sites with swapped operands) hold their gathers back until their cotangent exists
  (the `hold_gathers` pin), all of them or those whose module path matches one of
  `modules` (fnmatch patterns); every other site as that plan has it.

  It trades step time for memory, which `tune(max_peak=...)` lets a user ask for: a held
  weight gradient no longer shares its activation's gather with the recomputed forward
  site, so the gathered copy is not live across the layer's backward (what each group
  saves and costs on a GPT-3 layer: docs/benchmarks-log.md, the tuned plan with gathers
  held back).

  >>> HeldGathers("collective", ("*w_up",)).modules
  ('*w_up',)
  """

  base: str
  modules: tuple = ()


CANDIDATES = {
    "default": {},
    # the form spelled out: "auto" would follow the libtpu flags
    "collective": {"algorithm": "collective", "reduce_scatter": "reduce_scatter"},
    # reduce-scatters as all-to-all + sum: async on v4 with --xla_tpu_enable_async_all_to_all
    "collective+all_to_all": {"algorithm": "collective", "reduce_scatter": "all_to_all"},
    "ksplit=2": {"algorithm": "meshslice", "ksplit": 2},
    "ksplit=4": {"algorithm": "meshslice", "ksplit": 4},
    "collective+all_to_all, ls ksplit=2": SlicedSites("collective+all_to_all", "ls", 2),
    # for a peak budget (max_peak): the plan above with every weight gradient held back
    "collective+all_to_all, ls ksplit=2, gathers held":
        HeldGathers("collective+all_to_all, ls ksplit=2"),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
  """One compiled candidate: its frozen plan and what the compiler made of it."""

  name: str
  plan: Plan
  result: AotResult

  @property
  def step_s(self) -> float:
    return self.result.simulation.step_s


def _frozen(report):
  """The report's plan with every site pinned: left-alone sites as rewrite=False."""
  plan = report.plan
  for site in report.sites:
    if not site.rewritten:
      plan = plan.edit(site.index, rewrite=False)
  return plan


def _module_matches(module: str, patterns: tuple) -> bool:
  """Whether a site's module path matches one of `patterns` (`module_matches`: fnmatch,
  on the whole path or the path without list positions); () matches all."""
  return not patterns or any(module_matches(module, p) for p in patterns)


def _sliced(report, plan, request: SlicedSites):
  """`plan` with `report`'s rewritten `request.dataflow` sites sliced, where that
  ksplit slices them exactly; None when no site is."""
  sites = [s for s in report.rewritten if s.dataflow == request.dataflow
           and s.geometry.valid_ksplit(request.ksplit)
           and _module_matches(s.module, request.modules)]
  for site in sites:
    plan = plan.edit(site.index, algorithm="meshslice", ksplit=request.ksplit)
  return plan if sites else None


def _held(report, plan, request: HeldGathers):
  """`plan` with its rewritten weight gradients (those `request.modules` match, or all)
  holding their gathers back; None when no site is."""
  swapped = {s.index for s in report.sites if s.swapped}
  indexes = [e["index"] for e in plan.sites
             if e["index"] in swapped and e["rewritten"] and e.get("rewrite") is not False
             and _module_matches(e.get("module", ""), request.modules)]
  for index in indexes:
    plan = plan.edit(index, hold_gathers=True)
  return plan if indexes else None


# public names of the candidate builders, for code that builds a candidate's plan as tune
# does (bench/tpu_models.py)
frozen_plan = _frozen
sliced_plan = _sliced


def _peak(candidate) -> int:
  """libtpu's peak for the candidate's program, or the bytes formula where it gives none."""
  result = candidate.result
  return result.libtpu_peak_bytes or result.peak_bytes


def _decisions(plan) -> tuple:
  """What a frozen plan compiles: per site, left alone or (algorithm, dataflow, ksplit,
  reduce-scatter form, gathers held)."""
  return tuple((e["index"], None if e.get("rewrite") is False
                else (e.get("algorithm"), e.get("dataflow"), e.get("ksplit"),
                      e.get("reduce_scatter"), e.get("hold_gathers")))
               for e in plan.sites)


_NEIGHBOUR_KSPLITS = {1: (2,), 2: (1, 4), 4: (2,)}


def _moves(report, plan) -> list:
  """The moves a refinement sweep tries on `plan`, in a fixed order, as (label, site
  indexes, pin): per module (program order) and dataflow of its rewritten sites, those
  sites sliced one step finer or coarser (ksplit 1 <-> 2 <-> 4, where it slices them
  exactly); then, held or released together, the weight gradients with the same
  operand shapes in the same context (a layer's q, k and v projections read one
  activation: holding one alone measured slower than holding none); then each module's
  weight gradients alone. A pin of None toggles hold_gathers on the plan it meets."""
  entries = {e["index"]: e for e in plan.sites
             if e["rewritten"] and e.get("rewrite") is not False}
  sites = [s for s in report.sites if s.index in entries]
  modules = list(dict.fromkeys(s.module for s in sites))
  moves = []
  for module in modules:
    for dataflow in ("os", "ls", "rs"):
      group = [s for s in sites if s.module == module and entries[s.index]["dataflow"] == dataflow]
      algorithms = {entries[s.index]["algorithm"] for s in group}
      ksplits = {e["ksplit"] if e["algorithm"] == "meshslice" else 1
                 for e in (entries[s.index] for s in group)}
      # mixed, other algorithms (cannon, summa, wang) or no site: left as they are
      if len(ksplits) != 1 or not algorithms <= {"collective", "meshslice"}:
        continue
      for ksplit in _NEIGHBOUR_KSPLITS.get(ksplits.pop(), ()):
        if all(s.geometry.valid_ksplit(ksplit) for s in group):
          pin = ({"algorithm": "collective", "ksplit": 1} if ksplit == 1
                 else {"algorithm": "meshslice", "ksplit": ksplit})
          moves.append((f"{module or '(unnamed)'} {dataflow} S={ksplit}",
                        tuple(s.index for s in group), pin))
  swapped = [s for s in sites if s.swapped]
  by_shapes = {}
  for s in swapped:
    by_shapes.setdefault((s.context, s.lhs_shape, s.rhs_shape), []).append(s)
  for group in by_shapes.values():
    names = list(dict.fromkeys(s.module or "(unnamed)" for s in group))
    if len(names) > 1:
      moves.append((" ".join(names) + " held/released", tuple(s.index for s in group), None))
  for module in modules:
    group = tuple(s.index for s in swapped if s.module == module)
    if group:
      moves.append((f"{module or '(unnamed)'} held/released", group, None))
  return moves


def _apply(plan, indexes, pin):
  """`plan` with `pin` on each of `indexes` (pin None: every one held, unless all of
  them are, then every one released); None when that changes nothing."""
  entries = {e["index"]: e for e in plan.sites}
  if pin is None:
    pin = {"hold_gathers": not all(entries[i].get("hold_gathers") is True for i in indexes)}
  if all(all(entries[i].get(k) == v for k, v in pin.items()) for i in indexes):
    return None
  for index in indexes:
    plan = plan.edit(index, **pin)
  return plan


def _generation(mesh):
  from .backend_flags import tpu_generation
  kinds = {getattr(d, "device_kind", "") for d in mesh.devices.flat}
  return next((g for g in map(tpu_generation, kinds) if g), None)


# ----------------------------------------------------------------------------- arguments
# tune checks every argument and every candidate before it loads libtpu or compiles: a
# mistake costs no compile, and a run of many compiles does not fail at its end.

_DATAFLOWS = ("os", "ls", "rs")
# the names refine= gives the plans it compiles: f"refine {sweep}: {move}"
_REFINED_NAME = re.compile(r"refine \d+: ")


def _check_keywords(step, *, echo, results, max_peak, refine) -> None:
  """tune's step and its keywords other than mesh, topology, profile and candidates."""
  if not callable(step):
    raise MeshsliceError("tune: step must be a callable (the jitted training step), got "
                         f"{type(step).__name__}")
  if echo is not None and not callable(echo):
    raise MeshsliceError("tune: echo must be a print-like callable (e.g. echo=print) or "
                         f"None for no output, got {type(echo).__name__} {echo!r}")
  if results is not None and not isinstance(results, MutableMapping):
    raise MeshsliceError("tune: results must be a dict (it receives {name: Candidate}) or "
                         f"None, got {type(results).__name__}; pass results={{}}")
  if max_peak is not None and (isinstance(max_peak, bool) or not isinstance(
      max_peak, numbers.Real) or not max_peak > 0):
    raise MeshsliceError("tune: max_peak must be a positive number (a multiple of XLA's "
                         f"program's peak memory, e.g. 1.10) or None, got {max_peak!r}")
  if isinstance(refine, bool) or not isinstance(refine, int) or refine < 0:
    raise MeshsliceError("tune: refine must be a non-negative int (sweeps of local search "
                         f"after the candidates; 0 for none), got {refine!r}")


def _target(mesh, topology) -> tuple:
  """(TPU generation name, mesh shape) of tune's mesh= and topology=; the shape is None
  for a concrete mesh."""
  from jax.sharding import Mesh
  from . import aot
  if isinstance(mesh, Mesh):
    if topology is not None:
      raise MeshsliceError(
          f"tune: topology={topology!r} goes with a mesh shape (mesh=(2, 4), "
          "topology='v4:2x2x2'), but mesh is a concrete Mesh, whose devices are its "
          "topology; drop topology=, or pass the mesh's shape")
    generation = _generation(mesh)
    if generation is None:
      raise MeshsliceError("tune: the mesh's devices are not TPUs; tune compiles for a TPU "
                           "topology (meshslice.aot.make_mesh)")
    return generation, None
  if topology is None:
    raise MeshsliceError(
        "tune: mesh must be a concrete jax.sharding.Mesh of TPU devices (aot.make_mesh), "
        "or a shape tuple together with topology=, e.g. mesh=(2, 4), topology='v4:2x2x2'; "
        f"got {type(mesh).__name__} {mesh!r}")
  if not isinstance(mesh, (tuple, list)) or not mesh or not all(
      isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 for v in mesh):
    raise MeshsliceError("tune: mesh shape must be a tuple of positive ints, one size per "
                         f"mesh axis (e.g. (2, 4)), got {mesh!r}")
  if not isinstance(topology, str):
    raise MeshsliceError("tune: topology must be a TPU topology name such as 'v4:2x2x2', "
                         f"got {type(topology).__name__} {topology!r}")
  try:
    gen, dims = aot.parse_topology(topology)
  except ValueError as e:
    raise MeshsliceError(f"tune: {e}") from None
  shape = tuple(int(v) for v in mesh)
  devices = math.prod(dims) * gen.devices_per_chip       # two per chip on tpu7x
  if math.prod(shape) != devices:
    per_chip = f" ({gen.devices_per_chip} per chip)" if gen.devices_per_chip > 1 else ""
    raise MeshsliceError(
        f"tune: mesh shape {shape} has {math.prod(shape)} devices but topology "
        f"{topology!r} has {devices}{per_chip}; pick a shape whose product is {devices}")
  return gen.name, shape


def _is_array(leaf) -> bool:
  import jax
  return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))


def _axis_names(args, shape: tuple, topology: str) -> tuple:
  """The axis names of the mesh the arguments' NamedShardings are over, which a mesh
  `shape` on `topology` takes."""
  import jax
  from jax.sharding import NamedSharding
  names = list(dict.fromkeys(
      tuple(a.sharding.mesh.axis_names) for a in jax.tree.leaves(args)
      if _is_array(a) and isinstance(getattr(a, "sharding", None), NamedSharding)))
  if not names:
    raise MeshsliceError(
        f"tune: mesh={shape} with topology= moves the arguments' NamedShardings onto "
        f"{topology!r}, but no argument has one; shard the arguments over a mesh with "
        f"{len(shape)} axes, or pass a concrete mesh, mesh=aot.make_mesh({topology!r}, "
        f"{shape}, axis_names)")
  if len(names) > 1:
    raise MeshsliceError(
        "tune: the arguments' NamedShardings are over meshes with different axis names, "
        f"{names[0]} and {names[1]}; tune moves them onto one mesh of {topology!r}: shard "
        "every argument over one mesh's axes")
  if len(names[0]) != len(shape):
    raise MeshsliceError(
        f"tune: mesh={shape} has {len(shape)} axes but the arguments' NamedShardings are "
        f"over {len(names[0])}, {names[0]}; give one size per axis")
  return names[0]


def _onto(mesh, args):
  """`args` for `mesh` (a topology's): each array with a NamedSharding abstract, that
  sharding's spec on `mesh`; each other array (a sharding on one device, or none)
  abstract and unsharded, which jit places replicated, as on a concrete mesh; every
  other leaf (static arguments, Python scalars, numpy values) as it is."""
  import jax
  from jax.sharding import NamedSharding

  def move(leaf):
    if not _is_array(leaf):
      return leaf
    sharding = getattr(leaf, "sharding", None)
    return jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, weak_type=getattr(leaf, "weak_type", False),
        sharding=NamedSharding(mesh, sharding.spec)
        if isinstance(sharding, NamedSharding) else None)

  return jax.tree.map(move, args)


def _check_profile(profile, generation: str):
  """tune's profile=, or the generation's profile where it is None."""
  from meshslice.costmodel import HardwareProfile, known_profiles
  from . import aot
  from .options import Options
  if profile is None:
    return aot.GENERATIONS[generation].profile
  if not isinstance(profile, (str, os.PathLike, HardwareProfile)):
    raise MeshsliceError(
        f"tune: profile must be a shipped hardware profile name ({', '.join(known_profiles())}),"
        " the path of a profile JSON file, a meshslice.costmodel.HardwareProfile, or None "
        f"for the topology's generation's, got {type(profile).__name__} {profile!r}")
  try:
    Options.from_kwargs("tune", {"profile": profile})
  except ValueError as e:
    raise MeshsliceError(f"tune: {e}") from None
  return profile


def _check_derived(name: str, request, earlier: list, later: list) -> None:
  """A SlicedSites or HeldGathers candidate: its base an earlier candidate (not "xla"),
  its dataflow and ksplit valid pins, its modules a tuple of patterns."""
  kind = type(request).__name__
  verb = "slices" if isinstance(request, SlicedSites) else "holds the gathers of"
  base = request.base
  if not isinstance(base, str):
    raise MeshsliceError(f"tune: candidate {name!r}: {kind} base must be the name (str) "
                         f"of an earlier candidate, got {base!r}")
  if base == "xla":
    raise MeshsliceError(
        f"tune: candidate {name!r} {verb} the plan of 'xla', XLA's own program, which "
        "rewrites no site; base it on an earlier candidate of transform options, e.g. "
        "'collective': {'algorithm': 'collective'}")
  if base not in earlier:
    hint = (f"; put {base!r} before {name!r}" if base in later
            else _did_you_mean(base, earlier))
    raise MeshsliceError(f"tune: candidate {name!r} {verb} the plan of {base!r}, which "
                         f"must be an earlier candidate{hint}")
  if isinstance(request, SlicedSites):
    if request.dataflow not in _DATAFLOWS:
      raise PinError(
          f"tune: candidate {name!r}: SlicedSites dataflow must be one of "
          f"{', '.join(map(repr, _DATAFLOWS))}, got {request.dataflow!r}"
          f"{_did_you_mean(request.dataflow, _DATAFLOWS)}")
    validate_count(f"tune: candidate {name!r}: SlicedSites ksplit", request.ksplit)
  modules = request.modules
  if not isinstance(modules, (tuple, list)) or not all(isinstance(p, str) for p in modules):
    raise MeshsliceError(
        f"tune: candidate {name!r}: {kind} modules must be a tuple of module-path patterns "
        f"(fnmatch), e.g. ('*w_up',), or () for every site, got {modules!r}")


def _check_candidates(candidates, profile) -> dict:
  """tune's candidates=, each checked as `tune` documents (options by transform's own
  validation, under the candidate's name)."""
  from .options import Options
  if not isinstance(candidates, Mapping):
    raise MeshsliceError("tune: candidates must be a mapping of name -> options, got "
                         f"{type(candidates).__name__}; pass {{'mine': {{...}}}}")
  names = list(candidates)
  for position, (name, options) in enumerate(candidates.items()):
    if not isinstance(name, str) or not name.strip():
      raise MeshsliceError(f"tune: a candidate's name must be a non-empty str, got {name!r}; "
                           "e.g. {'ksplit=2': {'ksplit': 2}}")
    if name == "xla":
      raise MeshsliceError(
          "tune: the candidate name 'xla' is reserved for XLA's own program (every site "
          "left alone), which tune always compiles first and which wins ties; name yours "
          "otherwise")
    if _REFINED_NAME.match(name):
      raise MeshsliceError(
          f"tune: the candidate name {name!r} is reserved: 'refine <sweep>: <move>' names "
          "the plans refine= compiles; name yours otherwise")
    if isinstance(options, (SlicedSites, HeldGathers)):
      _check_derived(name, options, names[:position], names[position + 1:])
    elif isinstance(options, dict):
      try:
        Options.from_kwargs("meshslice.transform", {"profile": profile, **options})
      except (TypeError, ValueError) as e:
        error = type(e) if isinstance(e, MeshsliceError) else MeshsliceError
        raise error(f"tune: candidate {name!r}: {e}") from None
    else:
      hint = ("; XLA's own program is the 'xla' candidate, always compiled" if options is None
              else "; e.g. {'algorithm': 'collective'}")
      raise MeshsliceError(
          f"tune: candidate {name!r} must be a dict of meshslice.transform options, a "
          f"SlicedSites or a HeldGathers, got {options!r}{hint}")
  return dict(candidates)


@contextlib.contextmanager
def _default_flags(generation: str):
  """The generation's async libtpu flags in LIBTPU_INIT_ARGS while libtpu loads, when
  neither they are set nor libtpu is loaded (otherwise nothing changes).

  On an error before libtpu loaded (read them), LIBTPU_INIT_ARGS is unset again: the
  process is as it was. Once libtpu has loaded, they are this process's libtpu flags for
  good (read once per process), and LIBTPU_INIT_ARGS keeps saying so, error or not: the
  planner and `aot.analyze` read it as the flags the compiler runs with."""
  from . import aot
  if aot.flags_at_load() is not None or "LIBTPU_INIT_ARGS" in os.environ:
    yield
    return
  aot.set_flags(*aot.preset_flags("async", generation))
  try:
    yield
  except BaseException:
    if aot.flags_at_load() is None:              # libtpu did not load: the flags never took
      os.environ.pop("LIBTPU_INIT_ARGS", None)
    raise


def tune(step, *args, mesh, topology: str | None = None, candidates=None,
         profile: str | None = None, echo=None, results: dict | None = None,
         max_peak: float | None = None, refine: int = 0, cache_dir=None):
  """The fastest of the candidate plans for `step` on `mesh`, as a `meshslice.Plan`.

  step: the user's jitted step; args: its arguments, as it takes them: abstract arrays
  (ShapeDtypeStructs with shardings on `mesh`; one without a sharding is placed
  replicated, as jit places it), and static or Python values, passed on as they are.
  mesh: a concrete `jax.sharding.Mesh` of TPU devices (e.g.
  `aot.make_mesh("v4:8x8x4", (64, 4))`), or a shape tuple with `topology` (a name such
  as "v4:8x8x4", as many chips as the shape has devices). Given a shape, the arguments'
  NamedShardings (all over one mesh's axes, as many as the shape has) are moved onto
  the topology's mesh with the same axis names and specs; every other argument goes to
  the step as it would on a concrete mesh: an array with no NamedSharding (none, or one
  device's) abstract and unsharded, static and Python values unchanged.
  candidates: a mapping {name: meshslice.transform options (a dict), or a `SlicedSites`
  or `HeldGathers` of an earlier candidate} (default `CANDIDATES`); "xla" (every site
  left alone) is always compiled first and wins ties, so no candidate may take that name
  (nor a refine= name, "refine <sweep>: <move>"). profile: for planning and the
  simulator (default: the topology's generation). echo: a print-like callable for one
  line per candidate, or None. results: a dict (any mutable mapping) to receive
  {name: Candidate}, or None.
  max_peak: a memory budget, as a multiple of the "xla" program's peak per device
  (libtpu's `peak_memory_in_bytes`), e.g. 1.10: only candidates within it are chosen
  ("xla" always is). None: no budget. refine: sweeps of local search after the
  candidates (default 0, none). A sweep starts from the fastest candidate within the
  budget and tries one move at a time (`_moves`: one module's sites of one dataflow
  sliced one step finer or coarser, a group of weight gradients held or released),
  keeping each move that makes a faster program within the budget; the next sweep
  starts from where it ended, and a sweep that keeps nothing ends the search. A sweep
  compiles about two programs per module and dataflow (GPT-3's layer: ~30).
  cache_dir: a directory of compiled programs (`compile_cache.CompileCache`), or None
  (the default: compile every candidate). A candidate whose program was compiled before
  (the same lowered program, mesh devices, libtpu flags and jax / jaxlib / libtpu
  versions) is read from it instead of compiled, every figure the original compile's;
  each new compile is added. A second run with the same arguments compiles nothing and
  returns the same plan. The closing line counts the programs compiled and those read.

  Every argument and every candidate is checked before libtpu loads or anything
  compiles: a candidate's options by transform's own validation, its error prefixed with
  the candidate's name; a SlicedSites' dataflow is exactly "os", "ls" or "rs" and its
  ksplit a positive int; a SlicedSites' or HeldGathers' base is an earlier candidate
  other than "xla" and its modules a tuple of patterns.

  libtpu reads its flags once per process: set them before the first compile (when
  neither LIBTPU_INIT_ARGS is set nor libtpu loaded, the generation's async flags are
  set here, `aot.preset_flags("async", generation)`; should tune fail before libtpu
  loaded, LIBTPU_INIT_ARGS is unset again, while once libtpu has loaded they stay set,
  as the flags it runs with).

  Raises:
    MeshsliceError (a ValueError): an argument above is invalid (named, with the rule);
      PinError (a MeshsliceError) for a candidate's invalid pin (ksplit, dataflow,
      algorithm). Errors from tracing or compiling the step propagate unchanged.
  """
  import jax
  from . import aot
  from .compile_cache import CompileCache
  from .transform import transform
  _check_keywords(step, echo=echo, results=results, max_peak=max_peak, refine=refine)
  try:
    cache = None if cache_dir is None else CompileCache(cache_dir)
  except MeshsliceError as e:
    raise MeshsliceError(f"tune: {e}") from None
  generation, shape = _target(mesh, topology)
  names = None if shape is None else _axis_names(args, shape, topology)
  profile = _check_profile(profile, generation)
  wanted = {"xla": None, **_check_candidates(
      CANDIDATES if candidates is None else candidates, profile)}
  flags = contextlib.nullcontext() if shape is None else _default_flags(generation)
  with flags:
    if shape is not None:
      mesh = aot.make_mesh(topology, shape, names)
      args = _onto(mesh, args)
    mesh_shape = mesh.devices.shape if mesh.devices.ndim == 2 else None
    out, reports, skipped = {}, {}, set()
    compiles = 0     # programs compiled (a candidate with an earlier one's decisions is not)

    def evaluate(name, plan, xla):
      """Compile `plan` (XLA's own program when `xla`) unless a candidate already has its
      decisions; record, echo and return its Candidate."""
      nonlocal compiles
      same = next((c for c in out.values() if _decisions(c.plan) == _decisions(plan)), None)
      if same is not None:
        out[name] = dataclasses.replace(same, name=name)   # the same program: not recompiled
      else:
        fn = step if xla else transform(step, profile=profile, plan=plan)
        if cache is None:
          compiled, seconds = aot.compile(fn, *args, mesh=mesh)
          compiles += 1
        else:
          compiled, seconds, hit = cache.compile(fn, *args, mesh=mesh)
          compiles += not hit
        out[name] = Candidate(name=name, plan=plan, result=aot.analyze(
            compiled, profile, compile_s=seconds, mesh_shape=mesh_shape))
        del compiled
      c = out[name]
      if echo is not None:
        rewritten = sum(1 for e in c.plan.sites if e.get("rewrite") is not False)
        echo(f"  {name:<12} simulated step {c.step_s * 1e3:9.3f} ms  peak "
             f"{_peak(c) / 2**30:.2f} GiB  ({rewritten} of {len(c.plan.sites)} sites "
             "rewritten)")
      return c

    for name, options in wanted.items():
      if isinstance(options, (SlicedSites, HeldGathers)):
        if options.base in skipped:              # its base made no program of its own
          skipped.add(name)
          continue
        # the same program's sites: a derived candidate derives from its base's report
        report = reports[name] = reports[options.base]
        derive = _sliced if isinstance(options, SlicedSites) else _held
        plan = derive(report, out[options.base].plan, options)
        if plan is None:                         # no site to change: nothing new to compile
          skipped.add(name)
          continue
      else:
        with jax.set_mesh(mesh):
          report = reports[name] = transform(
              step, **{"profile": profile, **(options or {})}).explain(*args)
        plan = report.plan
        if options is None:                      # XLA's own program: every site left alone
          for site in report.sites:
            plan = plan.edit(site.index, rewrite=False)
        else:
          plan = _frozen(report)
      evaluate(name, plan, xla=options is None)
    budget = None if max_peak is None else max_peak * _peak(out["xla"])

    def within(c):
      return budget is None or c.name == "xla" or _peak(c) <= budget

    for sweep in range(refine):
      start = min(filter(within, out.values()), key=lambda c: c.step_s)
      current = start
      for label, indexes, pin in _moves(reports[start.name], start.plan):
        plan = _apply(current.plan, indexes, pin)
        if plan is None:                         # the move changes nothing here
          continue
        c = evaluate(f"refine {sweep + 1}: {label}", plan, xla=False)
        if within(c) and c.step_s < current.step_s:
          current = c                            # first improvement: keep it, go on
      if current is start:                       # a whole sweep found nothing faster
        break
  eligible = [c for c in out.values() if within(c)]
  best = min(eligible, key=lambda c: c.step_s)          # first (xla) wins ties
  if results is not None:
    results.update(out)
  if echo is not None:
    xla = out["xla"].step_s
    budget_note = "" if budget is None else (
        f"; {len(eligible)} of {len(out)} candidates within max_peak={max_peak:g}x XLA's "
        f"peak, {budget / 2**30:.2f} GiB")
    read = "" if cache is None else f", {cache.hits} read from {cache.directory}"
    echo(f"tuned: {best.name} ({xla / best.step_s:.3f}x XLA's program{budget_note}; "
         f"{compiles} of {len(out)} candidates compiled{read}, the rest the same program "
         f"as an earlier one; flags: {out['xla'].result.flags or '(libtpu defaults)'})")
  return best.plan
