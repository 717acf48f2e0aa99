"""Which matmuls of a jaxpr are terms of one sum of matmul results.

A gradient often sums several projections' products (dx = dq Wq^T + dk Wk^T + dv Wv^T,
the gated MLP's two input projections). XLA partitions such a sum as one value and
reduces the partial products once; a per-site rewrite sends one collective per term.
The planner asks `summed_matmuls` which sites are such terms (`Site.summed`) to price
them as XLA would (planning's step template rule for summed terms).
"""
from __future__ import annotations

from ._jax_internals import is_literal

# What a matmul's result may pass through on its way into a sum and stay one term of it.
_SUM_TRANSPARENT = frozenset({"convert_element_type", "reshape", "transpose", "copy",
                              "sharding_constraint", "squeeze", "expand_dims"})
_SUM_PRIMITIVES = frozenset({"add_any", "add"})


def summed_matmuls(jaxpr) -> frozenset:
  """Indices of the dot_generals of `jaxpr` whose result, through layout-only ops, is one
  of two or more matmul results added together (directly or in a chain of adds): XLA
  partitions such a sum as one value, reducing the partial products once (one
  reduce-scatter for dx = dq Wq^T + dk Wk^T + dv Wv^T) where per-site rewrites send one
  collective a term.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.ones((4, 4))
    >>> jaxpr = jax.make_jaxpr(lambda a, b, c: a @ b + (a @ c).T)(x, x, x).jaxpr
    >>> sorted(summed_matmuls(jaxpr))
    [0, 1]
    >>> sorted(summed_matmuls(jax.make_jaxpr(lambda a, b: a + a @ b)(x, x).jaxpr))
    []
  """
  producer, uses = {}, {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.outvars:
      producer[v] = i
    for v in eqn.invars:
      if not is_literal(v):
        uses[v] = uses.get(v, 0) + 1
  for v in jaxpr.outvars:
    if not is_literal(v):
      uses[v] = uses.get(v, 0) + 1

  def sole(v):
    # a value used elsewhere too is needed whole (a residual stream): no term of a sum
    return not is_literal(v) and v in producer and uses.get(v) == 1

  def through_layout_ops(v):
    while sole(v):
      eqn = jaxpr.eqns[producer[v]]
      if eqn.primitive.name not in _SUM_TRANSPARENT or len(eqn.invars) != 1:
        return v
      v = eqn.invars[0]
    return v

  def source(v):
    # the equation a value is one term of a sum from, or None when it is needed elsewhere
    v = through_layout_ops(v)
    return producer[v] if sole(v) else None

  sums = {i for i, eqn in enumerate(jaxpr.eqns) if eqn.primitive.name in _SUM_PRIMITIVES}
  inner = {j for i in sums for x in jaxpr.eqns[i].invars if (j := source(x)) in sums}
  summed = set()
  for root in sorted(sums - inner):
    # walk the tree of adds below the root (each inner add has one consumer: visited once)
    dots, stack = [], [root]
    while stack:
      for x in jaxpr.eqns[stack.pop()].invars:
        j = source(x)
        if j is None:
          continue
        if jaxpr.eqns[j].primitive.name == "dot_general":
          dots.append(j)
        elif j in sums:
          stack.append(j)
    if len(dots) >= 2:
      summed.update(dots)
  return frozenset(summed)
