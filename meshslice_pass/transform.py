"""`meshslice.transform`: trace once per input signature, analyse, plan, re-emit, jit."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from typing import Any, Callable

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from . import analysis as A
from . import planning
from .backend_flags import overlap_note
from . import specs as S
from ._jax_internals import jit_info, jit_params, known_value, trace_state_clean
from .emit import Emitter
from .options import Options, check_overrides
from .report import Report


@dataclasses.dataclass(frozen=True)
class _Entry:
  """Everything built for one input signature."""
  jitted: Callable          # jax.jit over the flat dynamic args
  in_tree: Any              # tree of (dynamic args, dynamic kwargs)
  out_tree: Any
  report: Report
  abstract: bool = False    # planned on an AbstractMesh: nothing to run
  # seconds per phase: trace, analysis, planning (at build); emission, lowering, compile
  # (when `lower` / `.compile()` run them)
  timings: dict = dataclasses.field(default_factory=dict, compare=False)


def _is_jitted(fn) -> bool:
  return jit_info(fn) is not None and hasattr(fn, "trace")


class Transformed:
  """A drop-in replacement for a (jitted) function with its 2D matmuls rewritten.

  Call it like the original; `.lower(*args)` lowers like a jitted function;
  `.explain(*args)` returns the `Report` for that input signature.
  """

  def __init__(self, fn: Callable, options: Options):
    self._fn = fn
    self._jitted = fn if _is_jitted(fn) else jax.jit(fn)
    info = jit_info(self._jitted)
    self._static_argnums = tuple(info.static_argnums) if info else ()
    self._static_argnames = tuple(info.static_argnames) if info else ()
    self._options = options
    self._cache = {}
    self._warned = False
    functools.update_wrapper(self, fn, updated=())

  # -- input signature handling
  def _split(self, args, kwargs):
    n = len(args)
    static_pos = {i % n for i in self._static_argnums if -n <= i < n}
    static = (tuple((i, args[i]) for i in sorted(static_pos)),
              tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_argnames)))
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
    return static, (dyn_args, dyn_kwargs)

  def _entry(self, args, kwargs):
    static, dynamic = self._split(args, kwargs)
    leaves, tree = jax.tree.flatten(dynamic)
    # Called with tracers, the program may be transformed further (vmap, grad): it is
    # emitted without the CPU-only nesting of sites (`Emitter`), which JAX 0.10.2 cannot
    # differentiate under vmap(spmd_axis_name=...).
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    # the mesh context changes the trace (explicit-mode types, the jit's ctx_mesh)
    key = (_hashable(static), tree, tuple(_signature(x) for x in leaves),
           jax.sharding.get_abstract_mesh(), traced)
    entry = self._cache.get(key)
    if entry is None:
      entry = self._build(args, kwargs, leaves, tree, nest_sites=not traced)
      self._cache[key] = entry
    if entry.report.notes and not trace_state_clean() and not self._warned:
      self._warned = True
      warnings.warn(f"meshslice.transform({_name(self._fn)}): " + " ".join(entry.report.notes),
                    stacklevel=3)
    return entry, leaves

  def _build(self, args, kwargs, leaves, in_tree, nest_sites):
    clock = _Clock()
    traced = self._jitted.trace(*args, **kwargs)
    clock.lap("trace")
    params = jit_params(traced)
    closed = traced.jaxpr
    leaf_shardings = [_leaf_sharding(x) for x in leaves]
    mesh = _find_mesh(params, leaf_shardings, closed)
    axis_sizes = dict(mesh.shape) if mesh is not None else {}
    in_specs = []
    for sharding, leaf_sharding, aval in zip(params["in_shardings"], leaf_shardings,
                                             closed.in_avals):
      ndim = len(getattr(aval, "shape", ()))
      spec = S.from_sharding(sharding, ndim, axis_sizes)
      if spec is None:
        spec = S.from_sharding(leaf_sharding, ndim, axis_sizes)
      in_specs.append(spec)
    out_specs = [S.from_sharding(sh, len(getattr(aval, "shape", ())), axis_sizes)
                 for sh, aval in zip(params["out_shardings"], closed.out_avals)]
    analysis = A.analyze(closed, in_specs, out_specs, A.Context(axis_sizes=axis_sizes))
    clock.lap("analysis")
    sites = planning.plan_program(
        closed, analysis,
        planning.Context(axis_sizes=axis_sizes, options=self._options, mesh=mesh))
    clock.lap("planning")
    if self._options.plan is not None:
      self._options.plan.check_matches(sites, axis_sizes)
    check_overrides(self._options, sites)
    report = Report(sites=sites, mesh_shape=axis_sizes,
                    profile=getattr(self._options.profile, "name", ""),
                    hardware=self._options.profile,
                    notes=_blind_spots(sites, leaves) + overlap_note(sites, mesh))
    if isinstance(mesh, AbstractMesh) and not any(isinstance(x, jax.core.Tracer)
                                                  for x in leaves):
      # planned for a mesh that has no devices here (e.g. a 16x16 cluster from a laptop)
      return _Entry(jitted=None, in_tree=in_tree, out_tree=traced.out_tree, report=report,
                    abstract=True, timings=clock.times)
    emitter = Emitter(sites, mesh, nest_sites=nest_sites)

    def emitted(*flat):
      return tuple(emitter.run(closed, *flat))

    donated = tuple(i for i, d in enumerate(params["donated_invars"]) if d)
    jitted = jax.jit(emitted, in_shardings=_none_if_unspecified(params["in_shardings"]),
                     out_shardings=_none_if_unspecified(params["out_shardings"]),
                     donate_argnums=donated, keep_unused=True)
    ctx_mesh = params.get("ctx_mesh")
    if ctx_mesh is not None and getattr(ctx_mesh, "axis_names", ()):
      jitted = _with_mesh(jitted, ctx_mesh)
    return _Entry(jitted=jitted, in_tree=in_tree, out_tree=traced.out_tree, report=report,
                  timings=clock.times)

  # -- public surface
  def __call__(self, *args, **kwargs):
    entry, leaves = self._entry(args, kwargs)
    _require_devices(entry, "call")
    return jax.tree.unflatten(entry.out_tree, entry.jitted(*leaves))

  def lower(self, *args, **kwargs):
    """Lower like `jax.jit(f).lower`: `.as_text()`, `.cost_analysis()`, `.compile()`; the
    compiled object is called with the same (pytree) arguments as `f`, static ones
    dropped, and returns `f`'s output pytree."""
    entry, leaves = self._entry(args, kwargs)
    _require_devices(entry, "lower")
    clock = _Clock()
    traced = entry.jitted.trace(*leaves)      # runs the emitter: the rewritten program
    clock.lap("emission")
    lowered = traced.lower()
    clock.lap("lowering")
    entry.timings.update(clock.times)
    return Lowered(lowered, entry.in_tree, entry.out_tree, entry.timings)

  def explain(self, *args, **kwargs) -> Report:
    """The report for this input signature (abstract inputs are fine)."""
    entry, _ = self._entry(args, kwargs)
    return entry.report

  def timings(self, *args, **kwargs) -> dict:
    """Seconds spent per phase for this input signature: "trace" (jax tracing of the
    original), "analysis", "planning"; after `.lower(...)` also "emission" (re-tracing
    with the sites rewritten) and "lowering" (to StableHLO); after `.compile()` of that,
    "compile" (XLA). Phases not run yet are absent."""
    entry, _ = self._entry(args, kwargs)
    return dict(entry.timings)


class _Wrapped:
  """Forwards everything except what the subclass defines to the JAX object."""

  def __init__(self, inner, in_tree, out_tree):
    self._inner, self._in_tree, self._out_tree = inner, in_tree, out_tree

  def __getattr__(self, name):
    return getattr(self._inner, name)

  @property
  def in_tree(self):
    return self._in_tree

  @property
  def out_tree(self):
    return self._out_tree


class Lowered(_Wrapped):
  """`Transformed.lower(...)`: a `jax.stages.Lowered` of the rewritten program whose
  `.compile()` takes and returns the original function's pytrees."""

  def __init__(self, inner, in_tree, out_tree, timings=None):
    super().__init__(inner, in_tree, out_tree)
    self._timings = {} if timings is None else timings

  def compile(self, *args, **kwargs) -> "Compiled":
    start = time.perf_counter()
    compiled = self._inner.compile(*args, **kwargs)
    self._timings["compile"] = time.perf_counter() - start
    return Compiled(compiled, self._in_tree, self._out_tree)


class Compiled(_Wrapped):
  """A compiled rewritten program, called like `jax.jit(f).lower(...).compile()`: with
  `f`'s dynamic arguments (static ones dropped), returning `f`'s output pytree."""

  def __call__(self, *args, **kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))
    if tree != self._in_tree:
      raise TypeError(
          "the compiled meshslice program was called with arguments of another structure "
          f"than it was lowered for: got {tree}, expected {self._in_tree}. Pass the same "
          "pytrees as to .lower(...), without the static arguments")
    return jax.tree.unflatten(self._out_tree, self._inner(*leaves))


class _with_mesh:
  """Run (and lower) a jitted function under the mesh context the original was traced in
  (explicit-sharding programs need it)."""

  def __init__(self, jitted, mesh):
    self._jitted, self._mesh = jitted, mesh

  def _ctx(self):
    mesh = self._mesh
    if isinstance(mesh, Mesh) and trace_state_clean():
      return jax.set_mesh(mesh)
    # Under an outer trace (jit, grad, vmap, make_jaxpr, eval_shape) `jax.set_mesh` is not
    # allowed; the abstract mesh is what tracing needs, and it is often already current.
    abstract = mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh
    if jax.sharding.get_abstract_mesh() == abstract:
      return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(abstract)

  def __call__(self, *a):
    with self._ctx():
      return self._jitted(*a)

  def lower(self, *a):
    with self._ctx():
      return self._jitted.lower(*a)

  def trace(self, *a):
    with self._ctx():
      return _TracedInMesh(self._jitted.trace(*a), self)


class _TracedInMesh:
  """A `jax.stages.Traced` whose `.lower()` runs under the original's mesh context."""

  def __init__(self, traced, owner):
    self._traced, self._owner = traced, owner

  def lower(self):
    with self._owner._ctx():
      return self._traced.lower()


class _Clock:
  """Seconds per named phase, lap after lap."""

  def __init__(self):
    self.times, self._last = {}, time.perf_counter()

  def lap(self, name):
    now = time.perf_counter()
    self.times[name] = self.times.get(name, 0.0) + now - self._last
    self._last = now


def _none_if_unspecified(shardings):
  return tuple(s if isinstance(s, jax.sharding.Sharding) else None for s in shardings)


def _signature(x):
  """What a leaf contributes to the trace-cache key: its type (shape, dtype, weak type,
  sharding) for arrays, tracers and ShapeDtypeStructs; its Python type otherwise."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)), x.sharding)
  if isinstance(x, (jax.Array, jax.core.Tracer)):
    aval = jax.typeof(x)
    sharding = aval.sharding if isinstance(x, jax.core.Tracer) else x.sharding
    return (tuple(aval.shape), str(aval.dtype), bool(aval.weak_type), sharding)
  if hasattr(x, "shape") and hasattr(x, "dtype"):          # numpy arrays and scalars
    return (tuple(x.shape), str(x.dtype), False, None)
  return (type(x).__name__,)


def _hashable(value):
  try:
    hash(value)
    return value
  except TypeError:
    return repr(value)


def _leaf_sharding(x):
  """The sharding an input leaf is known to have: a committed array's (also behind the
  tracers of an outer jax.grad/jvp), a ShapeDtypeStruct's; None when unknown."""
  if isinstance(x, jax.core.Tracer):
    x = known_value(x)
  if isinstance(x, jax.core.Tracer):
    return None
  return getattr(x, "sharding", None)


def _find_mesh(params, leaf_shardings, closed):
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
  if named:
    return named[0]
  if ctx is not None and getattr(ctx, "axis_names", ()):
    return ctx
  context = jax.sharding.get_abstract_mesh()
  if context.axis_names:
    return context
  for aval in list(closed.in_avals) + list(closed.out_avals):
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is not None and mesh.axis_names:
      return mesh
  return None


def _blind_spots(sites, leaves) -> tuple:
  """Header notes when matmuls could not be analysed because the layouts are hidden from
  this trace (the pass called inside an outer jit/grad/vmap with Auto-mode inputs)."""
  blind = [s for s in sites if not s.rewritten and s.reason.startswith(
      ("operand sharding unknown", "no multi-device mesh"))]
  if not blind or not any(isinstance(x, jax.core.Tracer) for x in leaves):
    return ()
  return (f"{len(blind)} of {len(sites)} matmuls left alone: traced inside an outer JAX "
          "transformation (jit, grad, vmap, ...) whose input shardings are not visible "
          "here, so the operand layouts are unknown. Apply meshslice.transform to the "
          "outermost jitted step (with in_shardings), use Explicit mesh axes, or add "
          "jax.lax.with_sharding_constraint on the inputs.",)


def _require_devices(entry, what):
  if entry.abstract:
    raise ValueError(
        f"cannot {what} a program planned on an AbstractMesh "
        f"({' x '.join(f'{k}={v}' for k, v in entry.report.mesh_shape.items())}): running "
        "or lowering needs a concrete jax.sharding.Mesh of devices. Use meshslice.explain "
        "(the report and .plan) on abstract inputs, and transform with a concrete mesh")


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

  Options: algorithm, ksplit (slices per site), max_ksplit, min_block, strict,
  overrides (pin single sites), plan (apply a saved plan); see `meshslice.Options`.

  Example:
    >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    >>> step = jax.jit(train_step, in_shardings=..., out_shardings=...)   # doctest: +SKIP
    >>> fast_step = meshslice.transform(step)                             # doctest: +SKIP
    >>> loss = fast_step(params, batch)                                   # doctest: +SKIP
  """
  if not callable(fn):
    raise TypeError("meshslice.transform expects a callable (a function or a "
                    f"jax.jit-wrapped function) as fn, got {type(fn).__name__}")
  if isinstance(fn, Transformed):
    raise TypeError("fn is already a meshslice.transform result; transform the original")
  return Transformed(fn, Options.from_kwargs("meshslice.transform", options))


def explain(fn: Callable, *, timings: bool = False, **options) -> Callable[..., Report]:
  """Return a function that, given `fn`'s inputs, reports what `transform` would do.

  Works on abstract inputs (`jax.ShapeDtypeStruct` with shardings): nothing is allocated.

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
  transformed = Transformed(fn, Options.from_kwargs("meshslice.explain", options))
  if not timings:
    return transformed.explain

  def explain_timed(*args, **kwargs):
    entry, leaves = transformed._entry(args, kwargs)
    if not entry.abstract and "emission" not in entry.timings:
      clock = _Clock()
      entry.jitted.trace(*leaves)
      clock.lap("emission")
      entry.timings.update(clock.times)
    return entry.report, dict(entry.timings)

  return explain_timed
