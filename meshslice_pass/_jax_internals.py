"""The few private JAX APIs the pass needs, in one place.

Everything else in the package uses public `jax.*` names. If a JAX upgrade moves one of
these, this is the only file to change.

Supported: jax 0.10.2 (Python 3.11) through 0.12.x (Python 3.12, 3.13), the range
pyproject.toml declares. Where those releases differ, a compat shim here gives one
behaviour on all of them (each is labelled "compat shim" and names the jax it is for):
`ClosedJaxpr` (jax 0.12 merged it into `Jaxpr`), `partition_spec_text` (jax 0.11's
PartitionSpec prints `unreduced_kind`), `scan_counts` / `scan_params_with_consts` (jax
0.11's scan describes its operands with flat trees). tests/test_jax_versions.py checks
them and that no other module imports `jax._src`.

The structure of equations is read here too, so that the pass's three interpreters
(analysis, emission, the unsharded reference) never spell it out: `HIGHER_ORDER`, the
one table of the higher-order primitives and where their sub-jaxprs are, with
`sub_jaxprs`, `scan_counts`, `scan_length` and `while_counts`; `bind`, `eqn_context`,
`eqn_name_stack` and `is_literal`.
"""
from __future__ import annotations

import dataclasses

import jax as _jax

try:
  from jax._src import api_util as _api_util
  from jax._src import config as _config
  from jax._src import core as _core
  from jax._src import linear_util as _lu
  from jax._src import source_info_util
  from jax._src.interpreters import partial_eval as _pe
  from jax._src.named_sharding import UnspecifiedValue as _UnspecifiedValue

  # compat shim (jax >= 0.12): ClosedJaxpr was merged into Jaxpr, which now carries its
  # own consts; `Jaxpr(jaxpr, consts)` is the legacy ClosedJaxpr constructor and
  # `.jaxpr` / `.consts` still read as before. jax <= 0.11 keeps the two classes.
  ClosedJaxpr = getattr(_core, "ClosedJaxpr", None) or _core.Jaxpr
  Literal = _core.Literal
except (ImportError, AttributeError) as _e:    # a jax outside the supported range
  raise ImportError(
      f"meshslice supports jax 0.10.2 through 0.12.x; this jax ({_jax.__version__}) lacks "
      f"an internal API it needs ({_e}). Install a supported one: "
      "pip install 'jax>=0.10.2,<0.13'") from _e


def retrace(fun, in_avals, debug_info):
  """Trace `fun` over abstract values, keeping vma/weak_type/sharding of `in_avals`.

  Returns a ClosedJaxpr whose consts are whatever `fun` closed over.
  """
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
      _lu.wrap_init(fun, debug_info=debug_info), list(in_avals))
  return ClosedJaxpr(jaxpr, consts)


def trace_once(fun, *args) -> ClosedJaxpr:
  """Trace `fun` over the abstract values of `args` (tracers welcome)."""
  avals = [_core.typeof(a) for a in args]
  info = _api_util.debug_info("meshslice", fun, args, {})
  return retrace(fun, avals, info)


def eval_closed(closed: ClosedJaxpr, *args):
  return _core.jaxpr_as_fun(closed)(*args)


def inline_closed(closed: ClosedJaxpr, *args):
  """Apply `closed` to `args` by copying its equations into the jaxpr being traced.

  Unlike `eval_closed`, nested bodies are not traced again: re-binding a shard_map
  re-traces its whole body, which made emitting many identical sites cost one body trace
  each. The copied equations take the caller's traceback and name stack (plus their own
  relative name stack), as if traced here. Outside a jaxpr trace (or one that lowers
  high-level types) this is `eval_closed`.
  """
  trace = _core.trace_ctx.trace
  if not isinstance(trace, _pe.DynamicJaxprTrace) or trace.requires_low:
    return eval_closed(closed, *args)
  src = source_info_util.current()
  tracers = [trace.to_jaxpr_tracer(a, src) for a in args]
  return _pe.inline_jaxpr_into_trace(trace, src, closed.jaxpr, closed.consts, *tracers)


def copy_eqn(eqn, invals):
  """Stage `eqn` into the jaxpr being traced as it is, on `invals`: its outputs, or None
  when it must be re-bound instead.

  Re-binding runs the primitive's staging rule and abstract evaluation again, which is
  most of emission's cost on a large program; when the inputs have exactly the types the
  equation was traced with (everything but the rewritten sites and what follows from
  them, which keep their types too), the equation is valid as it stands. Call it under
  `rebind_context(eqn)`: the copy takes the current traceback and name stack.
  """
  trace = _core.trace_ctx.trace
  if (eqn.effects or not isinstance(trace, _pe.DynamicJaxprTrace) or trace.requires_low):
    return None
  src = source_info_util.current()
  tracers = []
  for v, x in zip(eqn.invars, invals):
    t = trace.to_jaxpr_tracer(x, src)
    if t.aval != v.aval:
      return None
    tracers.append(t)
  return trace.emit_eqn(tracers, [v.aval for v in eqn.outvars], eqn.primitive, eqn.params,
                        eqn.effects, src, eqn.ctx)


def hoist_consts(closed: ClosedJaxpr):
  """Turn a ClosedJaxpr's consts into leading invars: returns (open jaxpr, consts)."""
  return _pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def rebind_context(eqn):
  """Context that re-binds `eqn` with its user traceback and name stack (so the emitted
  program keeps file:line and the jvp/transpose markers telling forward from backward)."""
  name_stack = source_info_util.current_name_stack() + eqn_name_stack(eqn)
  return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def eqn_context(eqn):
  """Context that restores the JAX state `eqn` was traced under (its compute type and
  thread resources, e.g. a `compute_on` region), for binding it again."""
  return eqn.ctx.manager


def eqn_name_stack(eqn):
  """The JAX name stack `eqn` was traced under (module scopes, jvp/transpose markers):
  JAX's own object, for `scope_names` and for extending a name stack."""
  return eqn.source_info.name_stack


def eqn_traceback(eqn):
  """The Python traceback `eqn` was traced with (None when JAX kept none)."""
  return eqn.source_info.traceback


def is_literal(v) -> bool:
  """Whether `v`, an operand of an equation, is a literal (its value is `v.val`) rather
  than a variable."""
  return isinstance(v, Literal)


def bind(eqn, invals, params=None) -> list:
  """Bind `eqn`'s primitive on `invals` with `params` (its own when None): its outputs,
  as a list. As `jax.core.eval_jaxpr` does, the params are first turned into what `bind`
  takes (a call primitive's sub-jaxpr becomes a function, e.g. custom_vjp_call's)."""
  prim = eqn.primitive
  outs = prim.bind(*invals, **prim.get_bind_params(eqn.params if params is None else params))
  return outs if prim.multiple_results else [outs]


def raw_frames(traceback):
  """(code objects, last instructions) of a JAX traceback, innermost first."""
  return traceback.raw_frames()


def frame_of(code, lasti):
  """A JAX source frame (file_name, start_line, ...) for one raw frame."""
  return source_info_util.raw_frame_to_frame(code, lasti)


def jax_user_frame(traceback):
  """JAX's own guess at the user's frame of a traceback (its filtering of internals)."""
  return source_info_util.user_frame(traceback)


def scope_names(stack) -> list:
  """The names of the module scopes (`jax.named_scope`, Flax Linen modules) on a JAX
  name stack, transformation wrappers (jvp, transpose) left out."""
  return [e.name for e in getattr(stack, "stack", ())
          if isinstance(e, source_info_util.Scope)]


def trace_state_clean() -> bool:
  """True outside of any JAX trace (jit, grad, vmap, make_jaxpr, eval_shape)."""
  return _core.trace_state_clean()


def known_value(x):
  """The value behind the tracers of forward-mode/linearize traces (jax.grad, jax.jvp,
  jax.vjp), whose primal is the caller's concrete array; `x` itself otherwise."""
  while isinstance(x, _core.Tracer):
    primal = getattr(x, "primal", None)
    if primal is None or getattr(primal, "shape", None) != getattr(x, "shape", ()):
      return x
    x = primal
  return x


def make_jaxpr_arguments(fn, depth: int = 64):
  """The caller's arguments `(args, kwargs)` when `fn` is the very function an enclosing
  `jax.make_jaxpr(fn)(*args, **kwargs)` call is tracing; None otherwise.

  `jax.make_jaxpr` traces through `jit(fn).trace(...)`, which turns committed arrays into
  tracers without their shardings (Auto mesh axes): a transformed step asks here for the
  arrays the user passed, so that `make_jaxpr` shows the program a call would run. Found
  by the frame of JAX's `make_jaxpr_f` (jax/_src/api.py, every supported jax) whose `fun`
  is `fn`, itself or behind the argument-free `functools.partial` make_jaxpr wraps
  unhashable callables in.
  """
  import functools
  import sys
  frame = sys._getframe(1)
  for _ in range(depth):
    frame = frame.f_back
    if frame is None:
      return None
    code = frame.f_code
    if code.co_name != "make_jaxpr_f" or not code.co_filename.endswith(
        ("jax/_src/api.py", "jax\\_src\\api.py")):
      continue
    local = frame.f_locals
    fun = local.get("fun")
    if isinstance(fun, functools.partial) and not fun.args and not fun.keywords:
      fun = fun.func
    if fun is not fn:
      return None            # make_jaxpr of something else around fn (grad, vmap, ...)
    return tuple(local.get("args", ())), dict(local.get("kwargs", {}))
  return None


def partition_spec_text(pspec) -> str:
  """`str(pspec)`, as every supported jax prints it.

  compat shim (jax >= 0.11): PartitionSpec gained `unreduced_kind` (default `sum`), which
  its repr always shows once `unreduced` is set ("P(None, unreduced={'y'},
  unreduced_kind=sum)"); the default is left out, so reports and messages read the same
  on jax 0.10.2 and 0.11+.
  """
  text = str(pspec)
  kind = getattr(pspec, "unreduced_kind", None)
  if kind is not None and getattr(kind, "name", None) == "sum":
    text = text.replace(", unreduced_kind=sum", "")
  return text


def traced_consts(traced) -> list:
  """The values a `jax.jit(...).trace(...)` hoisted out of the function (what it closes
  over from an enclosing trace): they are the leading operands of its jaxpr."""
  return list(getattr(traced, "_consts", ()) or ())


def jit_params(traced) -> dict:
  """The params of the `jit` equation a `jax.jit(...).trace(...)` call produced."""
  return dict(traced._params)


def jit_info(jitted):
  """The static_argnums/static_argnames/... record of a `jax.jit`-wrapped function."""
  return getattr(jitted, "_jit_info", None)


def jit_function(jitted):
  """The Python function a `jax.jit`-wrapped function wraps."""
  return getattr(jitted, "_fun", None) or getattr(jitted, "__wrapped__", jitted)


def jit_kwargs(jitted) -> dict:
  """The `jax.jit(...)` keyword arguments `jitted` was made with, as `jax.jit` takes them:
  `jax.jit(g, **jit_kwargs(jitted))` for a `g` with the same signature behaves like it
  (static args, donation, shardings, keep_unused, compiler_options, ...)."""
  info = jit_info(jitted)
  if info is None:
    return {}
  if any(l is not None for l in tuple(info.in_layouts_leaves) + tuple(info.out_layouts_leaves)):
    raise NotImplementedError(
        "meshslice.transform does not support jax.jit in_shardings/out_shardings given as "
        "jax.sharding.Format (layouts); pass plain shardings")
  kwargs = dict(static_argnums=tuple(info.static_argnums),
                static_argnames=tuple(info.static_argnames),
                donate_argnums=tuple(info.donate_argnums),
                donate_argnames=tuple(info.donate_argnames),
                keep_unused=info.keep_unused, inline=info.inline)
  for name in ("in_shardings", "out_shardings"):
    leaves = getattr(info, f"{name}_leaves")
    if not any(isinstance(l, _UnspecifiedValue) for l in leaves):
      kwargs[name] = getattr(info, f"{name}_treedef").unflatten(leaves)
  if info.device is not None:
    kwargs["device"] = info.device
  if info.backend is not None:
    kwargs["backend"] = info.backend
  if info.compiler_options_kvs:
    kwargs["compiler_options"] = dict(info.compiler_options_kvs)
  return kwargs


def rejit(fun, jitted):
  """`fun` jitted with `jitted`'s parameters: `jax.jit(fun, **jit_kwargs(jitted))`, or
  `pjit` for a function made by `jax.experimental.pjit.pjit` (its PartitionSpecs resolve
  against the legacy `with mesh:` context, which `jax.jit` does not read)."""
  info = jit_info(jitted)
  if info is not None and info.use_resource_env:
    import warnings
    from jax.experimental.pjit import pjit
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return pjit(fun, **jit_kwargs(jitted))
  import jax
  return jax.jit(fun, **jit_kwargs(jitted))


def abstractify(x):
  """The abstract value `jax.jit` traces `x` as (an array, tracer, ShapeDtypeStruct or
  Python scalar): its shape, dtype, weak type and, in Explicit mode, sharding type."""
  if isinstance(x, _core.Tracer):
    return x.aval
  return _core.shaped_abstractify(x)


def trace_context():
  """The JAX config state that jit's own trace cache keys on (matmul precision, dtype
  promotion, x64, ...): equal contexts trace equally."""
  return _config.trace_context()


# -- compat shim (jax >= 0.11): scan's parameters changed shape across JAX versions:
# jax <= 0.10 has num_consts / num_carry / linear; jax 0.11 describes the operands with
# flat trees (ft_in, ft_out).

def scan_counts(params) -> tuple[int, int]:
  """(number of consts, number of carries) of a scan equation's operands."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def scan_params_with_consts(params, extra: int, jaxpr: ClosedJaxpr) -> dict:
  """Scan params for `jaxpr`, whose first `extra` invars are new leading consts."""
  new = dict(params, jaxpr=jaxpr)
  if "num_consts" in params:
    new["num_consts"] = params["num_consts"] + extra
    if "linear" in params:
      new["linear"] = (False,) * extra + tuple(params["linear"])
    return new
  from jax._src import flattree   # jax >= 0.11 only
  consts, carry, xs = params["ft_in"].unpack()
  new["ft_in"] = flattree.pack((flattree.nones(len(consts) + extra), carry, xs))
  return new


# -- while's operands (the same on every supported jax)

def while_counts(params) -> tuple[int, int]:
  """(number of cond consts, number of body consts) of a while equation's operands,
  which come in that order, before the carries."""
  return params["cond_nconsts"], params["body_nconsts"]


def while_params_with_consts(params, cond_extra: int, cond_jaxpr: ClosedJaxpr,
                             body_extra: int, body_jaxpr: ClosedJaxpr) -> dict:
  """While params for `cond_jaxpr` and `body_jaxpr`, whose first `cond_extra` /
  `body_extra` invars are new leading consts (of the cond and of the body)."""
  cond_consts, body_consts = while_counts(params)
  return dict(params, cond_jaxpr=cond_jaxpr, body_jaxpr=body_jaxpr,
              cond_nconsts=cond_consts + cond_extra, body_nconsts=body_consts + body_extra)


# ---------------------------------------------------------------- higher-order primitives

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HigherOrder:
  """Where a higher-order primitive keeps its sub-jaxprs, and how its operands reach them.

  `kind` says how operands and results map onto the bodies:
    "call": the operands are the body's inputs and its outputs the results;
    "scan": consts, carries and stacked xs (`scan_counts`) are the body's inputs, its
      outputs the carries and one slice of each stacked y;
    "while": cond consts, body consts (`while_counts`), then the carries, which are the
      body's outputs and the results; the cond reads its consts and the carries;
    "cond": operand 0 picks the branch, the others are every branch's inputs;
    "shard_map": a per-device body with manual collectives.
  `bodies` are the params holding the sub-jaxprs ("branches" holds a tuple of them);
  `closed` says whether they are ClosedJaxprs, which carry their own consts (else an
  open Jaxpr, e.g. remat's). With `traversed`, the pass analyses, plans and rewrites the
  matmuls inside; without, it treats the equation as opaque, and only the unsharded
  reference evaluator looks in.
  """
  kind: str
  bodies: tuple
  closed: bool = True
  traversed: bool = True


_JIT = HigherOrder(kind="call", bodies=("jaxpr",))
_REMAT = HigherOrder(kind="call", bodies=("jaxpr",), closed=False)
_CUSTOM = HigherOrder(kind="call", bodies=("call_jaxpr",))

#: The higher-order primitives, by name: the one list of them the pass reads.
HIGHER_ORDER = {
    "jit": _JIT,
    "remat2": _REMAT,
    "custom_jvp_call": _CUSTOM, "custom_vjp_call": _CUSTOM,
    "scan": HigherOrder(kind="scan", bodies=("jaxpr",)),
    "while": HigherOrder(kind="while", bodies=("body_jaxpr", "cond_jaxpr")),
    "cond": HigherOrder(kind="cond", bodies=("branches",)),
    # the pass leaves these as they are (a shard_map is partitioned by hand already)
    "shard_map": HigherOrder(kind="shard_map", bodies=("jaxpr",), closed=False,
                             traversed=False),
    "closed_call": HigherOrder(kind="call", bodies=("call_jaxpr",), traversed=False),
    # names from older jax releases (jit was "pjit", remat2 "checkpoint"); no supported
    # jax emits them
    "checkpoint": _REMAT,
    "pjit": HigherOrder(kind="call", bodies=("jaxpr",), traversed=False),
    "core_call": HigherOrder(kind="call", bodies=("call_jaxpr",), closed=False,
                             traversed=False),
}


def higher_order(eqn) -> HigherOrder | None:
  """`HIGHER_ORDER`'s entry for `eqn`'s primitive (None: a first-order primitive)."""
  return HIGHER_ORDER.get(eqn.primitive.name)


def scan_length(eqn) -> int | None:
  """How many times a scan equation runs its body (its `length`); None for any other
  equation (a while loop's trip count is not in the program)."""
  h = higher_order(eqn)
  if h is None or h.kind != "scan":
    return None
  return int(eqn.params["length"])


def traversed_names(kind: str) -> tuple:
  """The names of the primitives of `kind` whose bodies the pass looks into."""
  return tuple(name for name, h in HIGHER_ORDER.items() if h.kind == kind and h.traversed)


def open_jaxpr(sub):
  """The Jaxpr of a sub-jaxpr param, closed or open."""
  return sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


def consts_of(sub) -> tuple:
  """The consts a sub-jaxpr param closes over (none for an open Jaxpr)."""
  return tuple(sub.consts) if isinstance(sub, ClosedJaxpr) else ()


def sub_jaxprs(eqn) -> list:
  """((param, branch index), Jaxpr) of each sub-jaxpr the pass looks into (`traversed`),
  in `HIGHER_ORDER`'s order: the keys that `Site.path` and the analyses' children use."""
  h = higher_order(eqn)
  if h is None or not h.traversed:
    return []
  found = []
  for param in h.bodies:
    sub = eqn.params[param]
    subs = sub if isinstance(sub, (tuple, list)) else (sub,)     # cond's branches
    found += [((param, b), open_jaxpr(s)) for b, s in enumerate(subs)]
  return found
