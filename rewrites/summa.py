"""SUMMA: broadcast-based 2D GEMM in lcm(R, C) * ksplit panel steps.

The communicated dim is cut into P = ksplit * lcm(R, C) panels in global order; panel q
lives whole on one device of each axis (its *owner*), so every step is a broadcast from
the owner (os, and the moving operand of ls/rs) or a reduction to the owner (the partial
sums of ls/rs).

Broadcast and reduction are both a masked `psum`: the owner contributes its panel,
everyone else zeros (`bcast`), or everyone contributes and only the owner keeps the sum
(`keep`). That is one all-reduce per panel, which a ring moves as 2 (n - 1) / n panels
per device, about twice the (n - 1) / n of the collective algorithm's all-gather /
reduce-scatter for the same data (a true pipelined broadcast moves about 1x; `all_gather`
+ select would move n - 1 panels). So SUMMA here costs ~2x the collective's bytes, in
P small steps. The panels run in a `fori_loop` (owner and slot computed from the loop
index); with P = 2 XLA inlines the one-trip loop and may merge the first two broadcasts.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._local import accumulation_dtype, finish, local_dot, reduction_dtype
from .geometry import GemmGeometry, extent_reason, ksplit_reason


def unsupported(geometry: GemmGeometry, ksplit: int = 1) -> str:
  """Why `build_summa` cannot serve `geometry` (with `ksplit`), or ""."""
  reason = extent_reason(geometry)
  if reason:
    return f"summa: {reason}"
  return ksplit_reason(geometry, ksplit, "summa")


def build_summa(geometry: GemmGeometry, ksplit: int = 1):
  """Shard_map body of SUMMA for `geometry.dataflow`, with P = ksplit * lcm(R, C) panels.

  Same layouts as `build_meshslice`. bcast(x, axis, q) = psum(x's panel q if I own it
  else 0, axis); panel q of an extent sharded n ways is owned by index q // (P / n):

    os:  for q: Y += bcast(X, col, K-panel q) . bcast(W, row, K-panel q)
    ls:  for q: S = psum(X . bcast(W, row, N-panel q), col)
                the owner column of N-panel q keeps S as its output panel q mod (P / C)
    rs:  for q: S = psum(bcast(X, col, M-panel q) . W, row)
                the owner row of M-panel q keeps S as its output panel q mod (P / R)

  The broadcast of panel q + 1 (and, for ls/rs, the reduction of panel q - 1) runs beside
  the matmul of panel q, inside a `fori_loop` over the panels (one broadcast per
  iteration keeps XLA from merging them; the owner is computed from the loop index).

  Requires: ksplit * lcm(R, C) divides the communicated extent.
  Bytes per device: about 2x the collective algorithm's (see the module docstring).
  """
  reason = unsupported(geometry, ksplit)
  if reason:
    raise ValueError(reason)
  panels = ksplit * geometry.lcm
  if geometry.dataflow == "os":
    return lambda lhs, rhs: _os(geometry, panels, lhs, rhs)
  return lambda lhs, rhs: _stationary(geometry, panels, lhs, rhs,
                                      moving_is_lhs=geometry.dataflow == "rs")


def _owner(q, panels, n):
  """(owner index along an axis of size n, panel slot on the owner) of global panel q."""
  per = panels // n
  return q // per, q % per


def bcast(x, dim, axis, n, q, panels):
  """Global panel q (may be traced) of `x`, sharded n ways along `dim` over `axis`, on
  every device of the axis."""
  owner, slot = _owner(q, panels, n)
  size = x.shape[dim] * n // panels
  piece = lax.dynamic_slice_in_dim(x, slot * size, size, axis=dim)
  mine = lax.axis_index(axis) == owner
  return lax.psum(jnp.where(mine, piece, jnp.zeros_like(piece)), axis)


def _zeros_of_product(g: GemmGeometry, a, b, dtype):
  """Zeros typed exactly like the local product a . b (shape, dtype, varying mesh axes):
  the product over an empty slice of the first contracting dim, which costs nothing."""
  (lc, rc), _ = g.dimension_numbers
  if lc:
    a = lax.slice_in_dim(a, 0, 0, axis=lc[0])
    b = lax.slice_in_dim(b, 0, 0, axis=rc[0])
  return jnp.zeros_like(local_dot(g, a, b, dtype))


def _pipeline(panels, first, fetch, compute, state):
  """state = compute(q, fetch(q), state) for q in 0..P-1 (first = fetch(0)), with
  fetch(q + 1) issued beside compute(q).

  Steps 0..P-2 are a `fori_loop` whose first fetch happens before it: one broadcast per
  iteration, so no two broadcasts can be merged by XLA's combiners (unrolled, they are
  merged on CPU: optimization barriers are expanded before the all-reduce combiner runs).
  """
  def step(q, carry):
    cur, state = carry
    return fetch(q + 1), compute(q, cur, state)

  cur, state = lax.fori_loop(0, panels - 1, step, (first, state))
  return compute(panels - 1, cur, state)


def _os(g: GemmGeometry, panels, lhs, rhs):
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)

  def fetch(q):
    return (bcast(lhs, g.lhs_dim, g.col_axis, g.col_size, q, panels),
            bcast(rhs, g.rhs_dim, g.row_axis, g.row_size, q, panels))

  def compute(q, cur, acc):
    return acc + local_dot(g, *cur, acc_dtype)

  first = fetch(0)
  acc = _zeros_of_product(g, *first, acc_dtype)
  return finish(g, _pipeline(panels, first, fetch, compute, acc), lhs, rhs)


def _stationary(g: GemmGeometry, panels, lhs, rhs, *, moving_is_lhs):
  """ls (W broadcast over row, sums reduced over col) and rs (X broadcast over col, sums
  reduced over row): the same loop with the roles swapped."""
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  wire_dtype = reduction_dtype(g, lhs.dtype, rhs.dtype)
  roles = g.stationary_roles(moving_is_lhs)
  moving = roles.moving(lhs, rhs)
  me = lax.axis_index(roles.scatter_axis)

  def keep(q, partial, out):
    """Reduce panel q's partial sums over the scatter axis; its owner keeps the total."""
    total = lax.psum(partial, roles.scatter_axis)
    owner, slot = _owner(q, panels, roles.scatter_size)
    size = total.shape[g.out_dim]
    old = lax.dynamic_slice_in_dim(out, slot * size, size, axis=g.out_dim)
    new = jnp.where(me == owner, total, old)
    return lax.dynamic_update_slice_in_dim(out, new, slot * size, axis=g.out_dim)

  def fetch(q):
    return bcast(moving, roles.dim, roles.gather_axis, roles.gather_size, q, panels)

  def multiply(cur):
    return local_dot(g, *roles.operands(cur, lhs, rhs), acc_dtype).astype(wire_dtype)

  def compute(q, cur, state):
    pending, out = state
    # The previous panel's reduction runs beside this panel's matmul (none before panel 0).
    if isinstance(q, int):           # the epilogue, q = P - 1 (0 on a 1 x 1 mesh)
      out = keep(q - 1, pending, out) if q > 0 else out
    else:
      out = lax.cond(q > 0, lambda: keep(q - 1, pending, out), lambda: out)
    return multiply(cur), out

  first = fetch(0)
  part = _zeros_of_product(g, *roles.operands(first, lhs, rhs), wire_dtype)
  shape = list(part.shape)
  shape[g.out_dim] *= panels // roles.scatter_size
  state = (part, jnp.zeros_like(part, shape=shape))
  pending, out = _pipeline(panels, first, fetch, compute, state)
  return finish(g, keep(panels - 1, pending, out), lhs, rhs)
