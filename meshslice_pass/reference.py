"""The unsharded reference: a traced program evaluated on one device with every sharding
annotation dropped, the judge `meshslice.check` holds the transformed program against.

Each equation is bound again without its shardings (`sharding` / `out_sharding` params
set to None; sharding constraints, reshards and device_puts pass their operand through),
inside one `jax.jit` that runs on a single device. Higher-order primitives
(`_jax_internals.HIGHER_ORDER`) are evaluated through their bodies, so that the
annotations inside go too: calls inline their bodies, scan, while and cond become
`lax.scan`, `lax.while_loop` and `lax.switch` over the evaluated bodies. A program with a
shard_map (manual collectives) cannot run unsharded: `NoReference`, as for any equation
that will not bind without its sharding.

Example:
  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 2, x))(1.0)
  >>> [float(y) for y in evaluate(closed.jaxpr, closed.consts, [1.5])]
  [12.0]
"""
from __future__ import annotations

import textwrap

import jax

from ._jax_internals import (HigherOrder, consts_of, higher_order, is_literal, open_jaxpr,
                             scan_counts, while_counts)

_MESSAGE_LIMIT = 1000    # characters of a quoted exception message (cut between words)

# params that carry a sharding (set to None), and primitives that only place a value
_STRIPPED = ("sharding", "out_sharding")
_IDENTITY = ("sharding_constraint", "reshard", "device_put", "mesh_cast")


class NoReference(Exception):
  """The program cannot be evaluated unsharded (the message says why)."""


def shorten(text: str, limit: int = _MESSAGE_LIMIT) -> str:
  """The first line of an exception message, cut between words when over `limit`."""
  first = (str(text).strip().splitlines() or [""])[0]
  return textwrap.shorten(first, width=limit, placeholder=" [...]") if len(first) > limit \
      else first


def evaluate(jaxpr, consts, args) -> list:
  """Evaluate a jaxpr with its sharding annotations dropped (one device): its outputs.

  Raises NoReference when an equation cannot be evaluated so."""
  env = {}
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [_read(env, v) for v in eqn.invars]
    h = higher_order(eqn)
    if h is not None:
      outs = _BY_KIND[h.kind](eqn, h, invals)
    elif eqn.primitive.name in _IDENTITY:
      outs = invals[:len(eqn.outvars)]
    else:     # everything else (scatter-add's update_jaxpr included) binds as is
      outs = _bind_unsharded(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [_read(env, v) for v in jaxpr.outvars]


def _read(env, v):
  return v.val if is_literal(v) else env[v]


def _bind_unsharded(eqn, invals) -> list:
  params = {k: (None if k in _STRIPPED else p) for k, p in eqn.params.items()}
  try:
    outs = eqn.primitive.bind(*invals, **params)
  except Exception as e:  # noqa: BLE001
    raise NoReference(f"no unsharded evaluation of {eqn.primitive.name}: "
                      f"{type(e).__name__}: {shorten(e)}") from None
  return outs if eqn.primitive.multiple_results else [outs]


def _body(sub):
  """(jaxpr, consts) of a sub-jaxpr param."""
  return open_jaxpr(sub), consts_of(sub)


def _call(eqn, h: HigherOrder, invals):
  param, = h.bodies
  return evaluate(*_body(eqn.params[param]), invals)


def _scan(eqn, h: HigherOrder, invals):
  p = eqn.params
  nc, nk = scan_counts(p)
  jaxpr, consts = _body(p["jaxpr"])
  cs, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

  def body(carry, x):
    outs = evaluate(jaxpr, consts, list(cs) + list(carry) + list(x))
    return outs[:nk], outs[nk:]

  carry, ys = jax.lax.scan(body, list(init), list(xs), length=p["length"],
                           reverse=p["reverse"])
  return list(carry) + list(ys)


def _while(eqn, h: HigherOrder, invals):
  p = eqn.params
  cn, bn = while_counts(p)
  cj, cc = _body(p["cond_jaxpr"])
  bj, bc = _body(p["body_jaxpr"])
  ccs, bcs, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  return jax.lax.while_loop(lambda c: evaluate(cj, cc, list(ccs) + list(c))[0],
                            lambda c: evaluate(bj, bc, list(bcs) + list(c)), list(init))


def _cond(eqn, h: HigherOrder, invals):
  branches = [(lambda *ops, br=br: evaluate(*_body(br), ops)) for br in eqn.params["branches"]]
  return jax.lax.switch(invals[0], branches, *invals[1:])


def _shard_map(eqn, h: HigherOrder, invals):
  raise NoReference("the program contains a shard_map (manual collectives), which cannot "
                    "run unsharded")


_BY_KIND = {"call": _call, "scan": _scan, "while": _while, "cond": _cond,
            "shard_map": _shard_map}
