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
  producer, uses = _producers_and_uses(jaxpr)

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


def shared_reductions(jaxpr, key_of) -> dict:
  """The sums of `jaxpr` whose every term is a matmul that can share one reduction with
  the others: {index of the sum's last add: (the terms' dot_general indices, in program
  order; the indices of the sum's other adds)}.

  A sum qualifies when it adds two or more dot_general results directly (no op between a
  dot and its add; each result and each inner add used once, by the sum), with nothing
  else added in, and `key_of(i)` gives one and the same key, not None, for every term:
  the caller's way of saying the terms are planned alike (`emit.Emitter` keys them by
  their plan and operand types). Such terms' partial products can be added before the
  reduce-scatter that each would send (`rewrites.build_summed_body`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.ones((4, 4))
    >>> jaxpr = jax.make_jaxpr(lambda a, b, c: a @ b + a @ c + b @ c)(x, x, x).jaxpr
    >>> shared_reductions(jaxpr, lambda i: "alike")
    {4: ((0, 1, 3), (2,))}
    >>> shared_reductions(jaxpr, lambda i: i)       # planned differently: no sharing
    {}
    >>> shared_reductions(jax.make_jaxpr(lambda a, b: a @ b + a)(x, x).jaxpr, lambda i: 0)
    {}
  """
  producer, uses = _producers_and_uses(jaxpr)

  def direct_source(v):
    # the equation whose result v is, when only the sum reads it
    if is_literal(v) or v not in producer or uses.get(v) != 1:
      return None
    return producer[v]

  sums = {i for i, eqn in enumerate(jaxpr.eqns) if eqn.primitive.name in _SUM_PRIMITIVES}
  inner = {j for i in sums for x in jaxpr.eqns[i].invars
           if (j := direct_source(x)) in sums}
  shared = {}
  for root in sorted(sums - inner):
    dots, adds, stack, pure = [], [], [root], True
    while stack and pure:
      i = stack.pop()
      if i != root:
        adds.append(i)
      for x in jaxpr.eqns[i].invars:
        j = direct_source(x)
        if j is not None and j in sums:
          stack.append(j)
        elif (j is not None and jaxpr.eqns[j].primitive.name == "dot_general"
              and key_of(j) is not None):
          dots.append(j)
        else:
          pure = False         # something else is added in: the sum is not the terms'
    # one key for all terms; the sum's dtype is the terms' (no promotion in the adds)
    if (pure and len(dots) >= 2 and len({key_of(j) for j in dots}) == 1
        and len({jaxpr.eqns[j].outvars[0].aval.dtype for j in dots + [root]}) == 1):
      shared[root] = (tuple(sorted(dots)), tuple(sorted(adds)))
  return shared


def _producers_and_uses(jaxpr) -> tuple[dict, dict]:
  """({variable: index of the equation that produces it}, {variable: how many equations
  and outputs read it})."""
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
  return producer, uses
