"""Collective matmul (Wang et al., ASPLOS'23): one axis's collective becomes a ring.

The collective of one mesh axis (the *ring axis*) is decomposed into n - 1 `ppermute`
steps, each overlapped with the partial matmul of the block that just arrived (an
all-gather ring), or with the partial matmul whose sum is passed on next (a
reduce-scatter ring). The other axis keeps its plain all_gather / psum_scatter.
Bidirectional: each ring block is cut in halves that travel opposite ways, so each step
uses both links of a ring and moves half the bytes per link.

The ring engines themselves (`ring_all_gather`, `ring_reduce_scatter`) live in `rings.py`,
shared with Cannon's shifts and the 1D collective matmuls in `oned.py`.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._local import accumulation_dtype, finish, local_dot, reduction_dtype
from .geometry import GemmGeometry, extent_reason
from .rings import ring_all_gather, ring_reduce_scatter
from .rings import shift as shift  # re-exported: the ring engines were defined here

RINGS = ("row", "col")


def ring_axis(geometry: GemmGeometry, ring: str | None) -> str:
  """The axis ("row" or "col") whose collective becomes the ring. Default: the larger
  axis (more steps to hide behind); col on a tie."""
  if ring is None:
    return "row" if geometry.row_size > geometry.col_size else "col"
  return ring


def unsupported(geometry: GemmGeometry, ksplit: int = 1, bidirectional: bool = False,
                ring: str | None = None) -> str:
  """Why `build_wang` cannot serve these arguments, or ""."""
  if ring not in (None,) + RINGS:
    return f"wang: ring must be one of {RINGS} or None, got {ring!r}"
  reason = extent_reason(geometry)
  if reason:
    return f"wang: {reason}"
  which = ring_axis(geometry, ring)
  n = geometry.row_size if which == "row" else geometry.col_size
  name = geometry.row_axis if which == "row" else geometry.col_axis
  block = geometry.global_extent // n
  parts = ksplit * (2 if bidirectional else 1)
  if not isinstance(ksplit, int) or ksplit < 1 or block % parts:
    what = f"2 * ksplit = {parts}" if bidirectional else f"ksplit={ksplit}"
    return (f"wang: {what} must divide the ring block: the communicated extent "
            f"{geometry.global_extent} / {n} devices on ring axis {name!r} = {block}")
  return ""


def build_wang(geometry: GemmGeometry, ksplit: int = 1, bidirectional: bool = False,
               ring: str | None = None):
  """Shard_map body of the collective matmul (Wang et al.) for `geometry.dataflow`.

  `ring` ("row", "col" or None = the larger axis, col on a tie) picks the axis whose
  collective becomes a ring of ppermutes (`ring_all_gather` / `ring_reduce_scatter`);
  the other axis keeps a plain collective. Same layouts as `build_meshslice`:

    os, ring col:  Wf = all_gather(W, row, K)
                   for t: Y += X_blk(t) . Wf[K of blk(t)];  X_blk(t+1) = ppermute(X_blk(t), col)
    os, ring row:  Xf = all_gather(X, col, K); ring W over row likewise
    ls, ring row:  P[:, N of blk(t)] = X . W_blk(t), W ringed over row;  Y = psum_scatter(P, col, N)
    ls, ring col:  Wf = all_gather(W, row, N)
                   for t: acc = ppermute(acc, col) + X . Wf[:, N of blk(me-1-t)]   # Y = acc
    rs, ring col:  P[M of blk(t)] = X_blk(t) . W, X ringed over col;   Y = psum_scatter(P, row, M)
    rs, ring row:  Xf = all_gather(X, col, M); reduce-scatter ring over row likewise

  ksplit cuts each ring block into ksplit chunks (2 * ksplit when bidirectional), each
  sent while the previous one is multiplied.

  Requires: lcm(R, C) divides the communicated extent; ksplit (x2 if bidirectional)
  divides extent / n_ring. Bytes per device equal the collective algorithm's (a ring
  all-gather / reduce-scatter is what the collective does anyway), in n_ring - 1 steps.
  """
  reason = unsupported(geometry, ksplit, bidirectional, ring)
  if reason:
    raise ValueError(reason)
  which = ring_axis(geometry, ring)
  if geometry.dataflow == "os":
    return lambda lhs, rhs: _os(geometry, ksplit, bidirectional, which, lhs, rhs)
  return lambda lhs, rhs: _stationary(geometry, ksplit, bidirectional, which, lhs, rhs,
                                      moving_is_lhs=geometry.dataflow == "rs")


def _os(g: GemmGeometry, ksplit, bidirectional, which, lhs, rhs):
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  # which == "col": X's K-gather over col is the ring and W is gathered whole over row;
  # "row": the mirror image
  ring_is_lhs = which == "col"
  ring, ring_dim, ring_axis, ring_size = (
      (lhs, g.lhs_dim, g.col_axis, g.col_size) if ring_is_lhs else
      (rhs, g.rhs_dim, g.row_axis, g.row_size))
  other_dim = g.rhs_dim if ring_is_lhs else g.lhs_dim
  other = lax.all_gather(rhs if ring_is_lhs else lhs,
                         g.row_axis if ring_is_lhs else g.col_axis, axis=other_dim, tiled=True)

  def consume(acc, piece, start):
    matching = lax.dynamic_slice_in_dim(other, start, piece.shape[ring_dim], axis=other_dim)
    a, b = (piece, matching) if ring_is_lhs else (matching, piece)
    part = local_dot(g, a, b, acc_dtype)
    return part if acc is None else acc + part

  acc = ring_all_gather(ring, ring_dim, ring_axis, ring_size, ksplit, bidirectional, consume)
  return finish(g, acc, lhs, rhs)


def _stationary(g: GemmGeometry, ksplit, bidirectional, which, lhs, rhs, *, moving_is_lhs):
  """ls (rhs gathered over row, partials scattered over col) and rs (lhs gathered over
  col, partials scattered over row): the same code with the roles swapped."""
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  wire_dtype = reduction_dtype(g, lhs.dtype, rhs.dtype)
  roles = g.stationary_roles(moving_is_lhs)
  moving, move_dim = roles.moving(lhs, rhs), roles.dim

  def multiply(piece):
    return local_dot(g, *roles.operands(piece, lhs, rhs), acc_dtype)

  if which == roles.gather_link:   # all-gather ring, then the plain reduce-scatter
    def consume(buf, piece, start):
      part = multiply(piece).astype(wire_dtype)
      if buf is None:
        shape = list(part.shape)
        shape[g.out_dim] = g.global_extent
        # Derive zeros from `part` so the buffer varies over the same mesh axes.
        buf = jnp.zeros_like(part, shape=shape)
      return lax.dynamic_update_slice_in_dim(buf, part, start, axis=g.out_dim)

    buf = ring_all_gather(moving, move_dim, roles.gather_axis, roles.gather_size, ksplit,
                          bidirectional, consume)
    out = lax.psum_scatter(buf, roles.scatter_axis, scatter_dimension=g.out_dim, tiled=True)
  else:                            # the plain all-gather, then a reduce-scatter ring
    full = lax.all_gather(moving, roles.gather_axis, axis=move_dim, tiled=True)

    def produce(start, size):
      return multiply(lax.dynamic_slice_in_dim(full, start, size, axis=move_dim))

    out = ring_reduce_scatter(produce, roles.scatter_axis, roles.scatter_size,
                              g.global_extent // roles.scatter_size, g.out_dim, ksplit,
                              bidirectional, wire_dtype)
  return finish(g, out, lhs, rhs)
