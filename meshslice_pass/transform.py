"""`meshslice.transform`: trace once per input signature, analyse, plan, re-emit, jit."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from . import analysis as A
from . import planning
from . import specs as S
from ._jax_internals import jit_info, jit_params
from .emit import Emitter
from .options import Options
from .report import Report


@dataclasses.dataclass(frozen=True)
class _Entry:
  """Everything built for one input signature."""
  jitted: Callable          # jax.jit over the flat dynamic args
  out_tree: Any
  report: Report


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
    key = (_hashable(static), tree, tuple(_signature(x) for x in leaves))
    entry = self._cache.get(key)
    if entry is None:
      entry = self._build(args, kwargs, leaves)
      self._cache[key] = entry
    return entry, leaves

  def _build(self, args, kwargs, leaves):
    traced = self._jitted.trace(*args, **kwargs)
    params = jit_params(traced)
    closed = traced.jaxpr
    mesh = _find_mesh(params, leaves, closed)
    axis_sizes = dict(mesh.shape) if mesh is not None else {}
    in_specs = []
    for leaf, sharding, aval in zip(leaves, params["in_shardings"], closed.in_avals):
      ndim = len(getattr(aval, "shape", ()))
      spec = S.from_sharding(sharding, ndim, axis_sizes)
      if spec is None:
        spec = S.from_sharding(getattr(leaf, "sharding", None), ndim, axis_sizes)
      in_specs.append(spec)
    out_specs = [S.from_sharding(sh, len(getattr(aval, "shape", ())), axis_sizes)
                 for sh, aval in zip(params["out_shardings"], closed.out_avals)]
    analysis = A.analyze(closed, in_specs, out_specs, A.Context(axis_sizes=axis_sizes))
    sites = planning.plan_program(
        closed, analysis, planning.Context(axis_sizes=axis_sizes, options=self._options))
    if self._options.plan is not None:
      self._options.plan.check_matches(sites)
    report = Report(sites=sites, mesh_shape=axis_sizes,
                    profile=getattr(self._options.profile, "name", ""),
                    hardware=self._options.profile)
    emitter = Emitter(sites, mesh)

    def emitted(*flat):
      return tuple(emitter.run(closed, *flat))

    donated = tuple(i for i, d in enumerate(params["donated_invars"]) if d)
    jitted = jax.jit(emitted, in_shardings=_none_if_unspecified(params["in_shardings"]),
                     out_shardings=_none_if_unspecified(params["out_shardings"]),
                     donate_argnums=donated, keep_unused=True)
    ctx_mesh = params.get("ctx_mesh")
    if ctx_mesh is not None and getattr(ctx_mesh, "axis_names", ()):
      jitted = _with_mesh(jitted, ctx_mesh)
    return _Entry(jitted=jitted, out_tree=traced.out_tree, report=report)

  # -- public surface
  def __call__(self, *args, **kwargs):
    entry, leaves = self._entry(args, kwargs)
    return jax.tree.unflatten(entry.out_tree, entry.jitted(*leaves))

  def lower(self, *args, **kwargs):
    """Lower like `jax.jit(f).lower`: `.as_text()`, `.compile()`, ..."""
    entry, leaves = self._entry(args, kwargs)
    return entry.jitted.lower(*leaves)

  def explain(self, *args, **kwargs) -> Report:
    """The report for this input signature (abstract inputs are fine)."""
    entry, _ = self._entry(args, kwargs)
    return entry.report


class _with_mesh:
  """Run (and lower) a jitted function under the mesh context the original was traced in
  (explicit-sharding programs need it)."""

  def __init__(self, jitted, mesh):
    self._jitted, self._mesh = jitted, mesh

  def _ctx(self):
    return jax.set_mesh(self._mesh)

  def __call__(self, *a):
    with self._ctx():
      return self._jitted(*a)

  def lower(self, *a):
    with self._ctx():
      return self._jitted.lower(*a)


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


def _find_mesh(params, leaves, closed):
  """The device mesh the program is sharded over (concrete where one is known)."""
  candidates = list(params["in_shardings"]) + list(params["out_shardings"])
  candidates += [getattr(x, "sharding", None) for x in leaves]
  for s in candidates:
    if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh) and s.mesh.axis_names:
      return s.mesh
  for eqn in _all_eqns(closed.jaxpr):
    sh = eqn.params.get("sharding")
    if isinstance(sh, NamedSharding) and isinstance(sh.mesh, Mesh):
      return sh.mesh
  ctx = params.get("ctx_mesh")
  if ctx is not None and getattr(ctx, "axis_names", ()):
    return ctx
  for aval in closed.in_avals:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is not None and mesh.axis_names and any(
        t == AxisType.Explicit for t in mesh.axis_types):
      return mesh
  return None


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for _, sub in A.sub_jaxprs(eqn):
      yield from _all_eqns(sub)


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


def explain(fn: Callable, **options) -> Callable[..., Report]:
  """Return a function that, given `fn`'s inputs, reports what `transform` would do.

  Works on abstract inputs (`jax.ShapeDtypeStruct` with shardings): nothing is allocated.

  Example:
    >>> report = meshslice.explain(step)(params, batch)       # doctest: +SKIP
    >>> print(report)                                          # doctest: +SKIP
  """
  if not callable(fn):
    raise TypeError("meshslice.explain expects a callable (a function or a "
                    f"jax.jit-wrapped function) as fn, got {type(fn).__name__}")
  transformed = Transformed(fn, Options.from_kwargs("meshslice.explain", options))
  return transformed.explain
