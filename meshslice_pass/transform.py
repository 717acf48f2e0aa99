"""`meshslice.transform`: a `jax.jit` whose trace analyses, plans and re-emits the program."""
from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from typing import Any, Callable

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from . import analysis as A
from . import planning
from .backend_flags import overlap_note
from . import specs as S
from ._jax_internals import (abstractify, jit_function, jit_info, jit_kwargs, jit_params,
                             known_value, make_jaxpr_arguments, rejit, trace_context,
                             trace_state_clean, traced_consts)
from .emit import Emitter
from .nnx_jit import is_nnx_jit, transform_nnx_jit
from .param_names import ParamNames, key_paths
from .options import Options, check_overrides
from .report import Report


@dataclasses.dataclass(frozen=True)
class _Planned:
  """What the pass decided for one input signature (the program, its sites, the report)."""
  closed: Any               # the original program, traced
  consts: tuple             # its leading operands: what it closes over from outer traces
  out_tree: Any
  sites: tuple
  mesh: Any
  report: Report
  abstract: bool = False    # planned on an AbstractMesh: nothing to run
  # seconds per phase: trace, analysis, planning (at planning); emission and lowering
  # once `lower` ran them
  timings: dict = dataclasses.field(default_factory=dict, compare=False)


def _is_jitted(fn) -> bool:
  return jit_info(fn) is not None and hasattr(fn, "trace")


class Transformed:
  """A drop-in replacement for a (jitted) function with its 2D matmuls rewritten.

  Behind it is a real `jax.jit`, made with the original's own jit parameters (static
  args, donation, in/out shardings, keep_unused, compiler_options), whose function runs
  the pass inside jit's trace: jit's cache, config contexts, argument checks, stages
  (`.trace/.lower/.eval_shape`), `jax.export` and error messages are JAX's own. One such
  jit is kept per layout of the committed input arrays, which jit's trace cannot see.

  Call it like the original; `.explain(*args)` returns the `Report` for that input
  signature (abstract inputs are fine).

  Example:
    >>> fast_step = meshslice.transform(jax.jit(step, donate_argnums=0))   # doctest: +SKIP
    >>> params, loss = fast_step(params, batch)                            # doctest: +SKIP
    >>> jax.export.export(fast_step)(params, batch)                        # doctest: +SKIP
  """

  def __init__(self, fn: Callable, options: Options):
    self._fn = fn
    self._jitted = fn if _is_jitted(fn) else jax.jit(fn)
    info = jit_info(self._jitted)
    self._static_argnums = tuple(info.static_argnums) if info else ()
    self._static_argnames = tuple(info.static_argnames) if info else ()
    jit_kwargs(self._jitted)      # unsupported jit parameters fail here, not at call
    self._options = options
    self._jits = {}           # (input layouts, traced) -> the jax.jit running the pass
    self._plans = {}          # input signature -> _Planned, for explain and timings
    self._warned = False
    functools.update_wrapper(self, fn, updated=())

  # -- input signature handling
  def _split(self, args, kwargs):
    """(static args, (dynamic args, dynamic kwargs)), as jit splits them."""
    n = len(args)
    static_pos = {i % n for i in self._static_argnums if -n <= i < n}
    static = (tuple((i, args[i]) for i in sorted(static_pos)),
              tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_argnames)))
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
    return static, (dyn_args, dyn_kwargs)

  def _layouts(self, args, kwargs):
    """What jit's trace cannot see but the analysis needs: the shardings of committed
    input arrays (also behind grad/jvp tracers), and whether an outer trace is on."""
    _, dynamic = self._split(args, kwargs)
    leaves, tree = jax.tree.flatten(dynamic)
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    # the mesh of `jax.set_mesh` also places uncommitted inputs (Explicit mode)
    context = jax.sharding.get_mesh() if not traced and trace_state_clean() else None
    context = context if getattr(context, "axis_names", ()) else None
    shardings = tuple(_leaf_sharding(x) for x in leaves)
    if traced and not any(shardings):
      shardings = self._make_jaxpr_layouts(tree, len(leaves)) or shardings
    return shardings + (context,), traced

  def _make_jaxpr_layouts(self, tree, count):
    """Under `jax.make_jaxpr(fast_step)(*args)` the step sees tracers without their
    shardings; the arrays the user passed have them. Their layouts, when the structure
    is the one traced here; None otherwise."""
    outer = make_jaxpr_arguments(self)
    if outer is None:
      return None
    leaves, outer_tree = jax.tree.flatten(self._split(*outer)[1])
    if outer_tree != tree or len(leaves) != count:
      return None
    return tuple(_leaf_sharding(x) for x in leaves)

  def _jit_for(self, args, kwargs, layouts=None):
    """The real `jax.jit` that runs the pass for inputs laid out like `args`."""
    layouts, traced = self._layouts(args, kwargs) if layouts is None else layouts
    key = (layouts, traced)
    jitted = self._jits.get(key)
    if jitted is None:
      jitted = rejit(self._rewriting(layouts, traced), self._jitted)
      self._jits[key] = jitted
    return jitted

  def _rewriting(self, layouts, outer_traced):
    """The function jit traces: the original, with its planned sites rewritten."""

    def rewritten(*args, **kwargs):
      planned = self._planned(args, kwargs, (layouts, outer_traced))
      if planned.report.notes and outer_traced and not self._warned:
        self._warned = True
        warnings.warn(f"meshslice.transform({_name(self._fn)}): "
                      + " ".join(planned.report.notes), stacklevel=4)
      _, dynamic = self._split(args, kwargs)
      leaves = jax.tree.leaves(dynamic)
      if planned.abstract:       # traced (eval_shape, .trace) without devices: as is
        outs = jax.core.eval_jaxpr(planned.closed.jaxpr, planned.closed.consts,
                                   *planned.consts, *leaves)
      else:
        # Called with tracers, the program may be transformed further (vmap, grad): it
        # is emitted without the CPU-only nesting of sites (`Emitter`), which JAX 0.10.2
        # cannot differentiate under vmap(spmd_axis_name=...).
        emitter = Emitter(planned.sites, planned.mesh, nest_sites=not outer_traced)
        outs = emitter.run(planned.closed, *planned.consts, *leaves)
      return jax.tree.unflatten(planned.out_tree, list(outs))

    functools.update_wrapper(rewritten, jit_function(self._jitted))
    return rewritten

  def _plan(self, args, kwargs, layouts, outer_traced) -> "_Planned":
    """Trace the original on `args` (arrays, tracers or ShapeDtypeStructs), analyse and
    plan it; `layouts` are the input arrays' shardings as the caller sees them."""
    clock = _Clock()
    traced = self._jitted.trace(*args, **kwargs)
    clock.lap("trace")
    params = jit_params(traced)
    closed = traced.jaxpr
    consts = traced_consts(traced)
    layouts = tuple(_leaf_sharding(c) for c in consts) + layouts   # operand order
    mesh = _find_mesh(params, layouts[:-1], closed, context=layouts[-1])
    axis_sizes = dict(mesh.shape) if mesh is not None else {}
    in_specs = []
    for sharding, leaf_sharding, aval in zip(params["in_shardings"], layouts,
                                             closed.in_avals):       # (context last)
      ndim = len(getattr(aval, "shape", ()))
      spec = S.from_sharding(sharding, ndim, axis_sizes)
      if spec is None:
        spec = S.from_sharding(leaf_sharding, ndim, axis_sizes)
      in_specs.append(spec)
    out_specs = [S.from_sharding(sh, len(getattr(aval, "shape", ())), axis_sizes)
                 for sh, aval in zip(params["out_shardings"], closed.out_avals)]
    analysis = A.analyze(closed, in_specs, out_specs, A.Context(axis_sizes=axis_sizes))
    clock.lap("analysis")
    options = self._options.for_mesh(mesh)      # the mesh's chip's profile, if none given
    outputs = jax.tree.unflatten(traced.out_tree, range(len(closed.out_avals)))
    names = ParamNames(closed.jaxpr,
                       [None] * len(consts) + key_paths(self._split(args, kwargs)[1]),
                       key_paths(outputs))
    context = planning.Context(axis_sizes=axis_sizes, options=options, mesh=mesh,
                               param_names=names)
    sites = planning.plan_program(closed, analysis, context)
    clock.lap("planning")
    if options.plan is not None:
      options.plan.check_matches(sites, axis_sizes)
    check_overrides(options, sites)
    blind = _blind_spots(sites, outer_traced)
    report = Report(sites=sites, mesh_shape=axis_sizes,
                    profile=getattr(options.profile, "name", ""),
                    hardware=options.profile,
                    notes=blind + planning.step_notes(context) + overlap_note(
                        sites, mesh, dict(os.environ,
                                          LIBTPU_INIT_ARGS=" ".join(options.compiler_flags))))
    planned = _Planned(closed=closed, consts=tuple(consts), out_tree=traced.out_tree,
                       sites=tuple(sites),
                       mesh=mesh, report=report,
                       abstract=isinstance(mesh, AbstractMesh) and not outer_traced,
                       timings=clock.times)
    return planned

  def _planned(self, args, kwargs, layouts=None) -> "_Planned":
    """The plan for these inputs, planned once per input signature: by `explain` on the
    caller's values, or inside jit's trace on its tracers (`layouts` then given), which
    key alike, so a step explained and then called is planned once."""
    layouts, traced = self._layouts(args, kwargs) if layouts is None else layouts
    static, dynamic = self._split(args, kwargs)
    leaves, tree = jax.tree.flatten(dynamic)
    key = (_static_key(static), tree, tuple(abstractify(x) for x in leaves), layouts,
           traced, jax.sharding.get_abstract_mesh(), trace_context())
    planned = self._plans.get(key)
    if planned is None:
      planned = self._plan(args, kwargs, layouts, traced)
      if not planned.consts:     # values of an enclosing trace must not outlive it
        self._plans[key] = planned
    return planned

  def _require_devices(self, args, kwargs, what, layouts=None):
    layouts, traced = self._layouts(args, kwargs) if layouts is None else layouts
    if traced or not any(isinstance(getattr(s, "mesh", None), AbstractMesh) for s in layouts):
      return               # the common case: no need to plan here
    planned = self._planned(args, kwargs)
    if planned.abstract:
      raise ValueError(
          f"cannot {what} a program planned on an AbstractMesh "
          f"({' x '.join(f'{k}={v}' for k, v in planned.report.mesh_shape.items())}): "
          "running or lowering needs a concrete jax.sharding.Mesh of devices. Use "
          "meshslice.explain (the report and .plan) on abstract inputs, and transform "
          "with a concrete mesh")

  # -- public surface: what jax.jit offers
  def __call__(self, *args, **kwargs):
    layouts = self._layouts(args, kwargs)      # once per call: this is the hot path
    self._require_devices(args, kwargs, "call", layouts)
    return self._jit_for(args, kwargs, layouts)(*args, **kwargs)

  def trace(self, *args, **kwargs) -> jax.stages.Traced:
    """Trace like `jax.jit(f).trace`: the rewritten program's `jax.stages.Traced`."""
    return self._jit_for(args, kwargs).trace(*args, **kwargs)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """Lower like `jax.jit(f).lower`: a `jax.stages.Lowered` of the rewritten program
    (`.as_text()`, `.cost_analysis()`, `.compile()`), with `f`'s pytrees."""
    self._require_devices(args, kwargs, "lower")
    clock = _Clock()
    traced = self.trace(*args, **kwargs)     # runs the pass and the emitter
    clock.lap("emission")
    lowered = traced.lower()
    clock.lap("lowering")
    self._planned(args, kwargs).timings.update(clock.times)
    return lowered

  def eval_shape(self, *args, **kwargs):
    """Like `jax.jit(f).eval_shape`: the output's shapes, dtypes and shardings."""
    return self._jit_for(args, kwargs).eval_shape(*args, **kwargs)

  def _cache_size(self) -> int:
    """Compiled programs kept, like `jax.jit(f)._cache_size()`."""
    return sum(jitted._cache_size() for jitted in self._jits.values())

  def clear_cache(self):
    """Drop every trace, compiled program and plan kept for this function."""
    for jitted in self._jits.values():
      jitted.clear_cache()
    self._jits.clear()
    self._plans.clear()

  def explain(self, *args, **kwargs) -> Report:
    """The report for this input signature (abstract inputs are fine)."""
    return self._planned(args, kwargs).report

  def timings(self, *args, **kwargs) -> dict:
    """Seconds spent per phase for this input signature: "trace" (jax tracing of the
    original), "analysis", "planning"; after `.lower(...)` also "emission" (tracing the
    rewritten program) and "lowering" (to StableHLO). Phases not run yet are absent."""
    return dict(self._planned(args, kwargs).timings)


class _Clock:
  """Seconds per named phase, lap after lap."""

  def __init__(self):
    self.times, self._last = {}, time.perf_counter()

  def lap(self, name):
    now = time.perf_counter()
    self.times[name] = self.times.get(name, 0.0) + now - self._last
    self._last = now


def _hashable(value):
  try:
    hash(value)
    return value
  except TypeError:
    return repr(value)


def _static_key(static):
  """Static arguments as jit keys them: by type as well as value (1, 1.0 and True are
  equal in Python but trace differently)."""
  positional, named = static
  return (tuple((i, type(v), _hashable(v)) for i, v in positional),
          tuple((k, type(v), _hashable(v)) for k, v in named))


def _leaf_sharding(x):
  """The sharding an input leaf is known to have: a committed array's (also behind the
  tracers of an outer jax.grad/jvp), a ShapeDtypeStruct's; None when unknown."""
  if isinstance(x, jax.core.Tracer):
    x = known_value(x)
  if isinstance(x, jax.core.Tracer):
    return None
  return getattr(x, "sharding", None)


def _find_mesh(params, leaf_shardings, closed, context=None):
  """The mesh the program is sharded over: a concrete one where one is known, else an
  AbstractMesh (planning only, or tracing inside an outer transformation)."""
  candidates = list(params["in_shardings"]) + list(params["out_shardings"])
  candidates += list(leaf_shardings)
  named = [s.mesh for s in candidates if isinstance(s, NamedSharding) and s.mesh.axis_names]
  for mesh in named:
    if isinstance(mesh, Mesh):
      return mesh
  # only then the program's own sharding constraints (walking them all is not free)
  inner = [eqn.params.get("sharding") for eqn in _all_eqns(closed.jaxpr)]
  named += [s.mesh for s in inner if isinstance(s, NamedSharding) and s.mesh.axis_names]
  for mesh in named:
    if isinstance(mesh, Mesh):
      return mesh
  ctx = params.get("ctx_mesh")
  if isinstance(ctx, Mesh) and ctx.axis_names:
    return ctx
  if isinstance(context, Mesh) and (ctx is None or context.abstract_mesh == ctx
                                    or not getattr(ctx, "axis_names", ())):
    return context          # the caller's `jax.set_mesh` mesh (outside the trace)
  if named:
    return named[0]
  if ctx is not None and getattr(ctx, "axis_names", ()):
    return ctx
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.axis_names:
    return abstract
  for aval in list(closed.in_avals) + list(closed.out_avals):
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is not None and mesh.axis_names:
      return mesh
  return None


def _blind_spots(sites, outer_traced) -> tuple:
  """Header notes when matmuls could not be analysed because the layouts are hidden from
  this trace (the pass called inside an outer jit/grad/vmap with Auto-mode inputs)."""
  blind = [s for s in sites if not s.rewritten and s.reason.startswith(
      ("operand sharding unknown", "no multi-device mesh"))]
  if not blind or not outer_traced:
    return ()
  return (f"{len(blind)} of {len(sites)} matmuls left alone: traced inside an outer JAX "
          "transformation (jit, grad, vmap, ...) whose input shardings are not visible "
          "here, so the operand layouts are unknown. Apply meshslice.transform to the "
          "outermost jitted step (with in_shardings), use Explicit mesh axes, or add "
          "jax.lax.with_sharding_constraint on the inputs. To see the program a call "
          "runs, trace the step itself: jax.make_jaxpr(fast_step)(*args) or "
          "fast_step.trace(*args).jaxpr, not make_jaxpr of a function around it.",)


def _name(fn) -> str:
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _all_eqns(jaxpr, seen=None):
  """Every equation of `jaxpr` and its sub-jaxprs, each shared body visited once."""
  seen = set() if seen is None else seen
  for eqn in jaxpr.eqns:
    yield eqn
    for _, sub in A.sub_jaxprs(eqn):
      if id(sub) not in seen:
        seen.add(id(sub))
        yield from _all_eqns(sub, seen)


def transform(fn: Callable, **options) -> Transformed:
  """Rewrite the 2D-sharded matmuls of `fn` into sliced, pipelined shard_map code.

  `fn` is a plain function or a `jax.jit`-wrapped one (its in/out shardings, donation
  and static args are kept). The result is called like `fn`, lowers with `.lower(...)`,
  and computes the same values and gradients up to float reassociation.

  The keyword options are the fields of `meshslice.Options`, each documented there once
  (the API reference renders it); an unknown one is a TypeError that lists them all.

  Example:
    >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)  # doctest: +SKIP
    >>> step = jax.jit(train_step, in_shardings=..., out_shardings=...)   # doctest: +SKIP
    >>> fast_step = meshslice.transform(step)                             # doctest: +SKIP
    >>> loss = fast_step(params, batch)                                   # doctest: +SKIP
  """
  if not callable(fn):
    raise TypeError("meshslice.transform expects a callable (a function or a "
                    f"jax.jit-wrapped function) as fn, got {type(fn).__name__}")
  if isinstance(fn, Transformed) or isinstance(getattr(fn, "jitted_fn", None), Transformed):
    raise TypeError("fn is already a meshslice.transform result; transform the original")
  parsed = Options.from_kwargs("meshslice.transform", options)
  if is_nnx_jit(fn):        # keep NNX's in-place updates: swap the jit inside its wrapper
    return transform_nnx_jit(fn, lambda jitted: Transformed(jitted, parsed))
  return Transformed(fn, parsed)


def explain(fn: Callable, *, timings: bool = False, **options) -> Callable[..., Report]:
  """Return a function that, given `fn`'s inputs, reports what `transform` would do.

  Takes `transform`'s options (the fields of `meshslice.Options`). Works on abstract
  inputs (`jax.ShapeDtypeStruct` with shardings): nothing is allocated.

  With `timings=True` the function returns `(report, seconds)`, `seconds` a dict of the
  pass's phases: "trace", "analysis", "planning" and, on a concrete mesh, "emission"
  (tracing the rewritten program; nothing is lowered or compiled). `Transformed.timings`
  also reports lowering and XLA compile once they ran.

  Example:
    >>> report = meshslice.explain(step)(params, batch)       # doctest: +SKIP
    >>> print(report)                                          # doctest: +SKIP
  """
  if not callable(fn):
    raise TypeError("meshslice.explain expects a callable (a function or a "
                    f"jax.jit-wrapped function) as fn, got {type(fn).__name__}")
  parsed = Options.from_kwargs("meshslice.explain", options)
  if is_nnx_jit(fn):
    if timings:
      raise ValueError("meshslice.explain(timings=True) is not available for nnx.jit "
                       "steps; use timings=False, or explain the step's jax.jit")
    return transform_nnx_jit(fn, lambda jitted: Transformed(jitted, parsed)).explain
  transformed = Transformed(fn, parsed)
  if not timings:
    return transformed.explain

  def explain_timed(*args, **kwargs):
    planned = transformed._planned(args, kwargs)
    if not planned.abstract and "emission" not in planned.timings:
      clock = _Clock()
      transformed.trace(*args, **kwargs)
      clock.lap("emission")
      planned.timings.update(clock.times)
    return planned.report, dict(planned.timings)

  return explain_timed
