"""The few private JAX APIs the pass needs, in one place.

Everything else in the package uses public `jax.*` names. If a JAX upgrade moves one of
these, this is the only file to change.
"""
from __future__ import annotations

from jax._src import api_util as _api_util
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as _pe

ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
Literal = _core.Literal
Var = _core.Var
DropVar = _core.DropVar


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


def hoist_consts(closed: ClosedJaxpr):
  """Turn a ClosedJaxpr's consts into leading invars: returns (open jaxpr, consts)."""
  return _pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def rebind_context(eqn):
  """Context that re-binds `eqn` with its user traceback and name stack (so the emitted
  program keeps file:line and the jvp/transpose markers telling forward from backward)."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def source_location(eqn) -> str:
  """'file:line' of the user code that produced `eqn` ('' when unknown)."""
  frame = source_info_util.user_frame(eqn.source_info.traceback)
  if frame is None:
    return ""
  return f"{frame.file_name}:{frame.start_line}"


def name_stack(eqn) -> str:
  return str(eqn.source_info.name_stack)


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


def jit_params(traced) -> dict:
  """The params of the `jit` equation a `jax.jit(...).trace(...)` call produced."""
  return dict(traced._params)


def jit_info(jitted):
  """The static_argnums/static_argnames/... record of a `jax.jit`-wrapped function."""
  return getattr(jitted, "_jit_info", None)


# -- scan's parameters changed shape across JAX versions: jax <= 0.10 has num_consts /
# num_carry / linear; jax 0.11 describes the operands with flat trees (ft_in, ft_out).

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
