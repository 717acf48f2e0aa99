"""Cannon's algorithm on a square R x R mesh: skew once, then shift neighbour to neighbour.

Every transfer is a `ppermute` to a mesh neighbour (after the skew), so no step needs a
collective over a whole axis. The price is traffic: the skew (and for ls/rs the unskew
of the partial sums) comes on top of the R - 1 neighbour shifts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._local import accumulation_dtype, finish, local_dot, reduction_dtype
from .geometry import GemmGeometry, extent_reason, ksplit_reason
from .rings import shift
from .slicing import pipeline_barrier


def unsupported(geometry: GemmGeometry, ksplit: int = 1) -> str:
  """Why `build_cannon` cannot serve `geometry` (with `ksplit`), or ""."""
  if geometry.row_size != geometry.col_size:
    return (f"cannon needs a square mesh (R == C), got {geometry.row_size}x"
            f"{geometry.col_size} over ({geometry.row_axis!r}, {geometry.col_axis!r}); "
            "use meshslice, wang or summa on this mesh")
  reason = extent_reason(geometry)
  if reason:
    return f"cannon: {reason}"
  return ksplit_reason(geometry, ksplit, "cannon")


def build_cannon(geometry: GemmGeometry, ksplit: int = 1):
  """Shard_map body of Cannon's algorithm for `geometry.dataflow` on an R x R mesh.

  Same layouts as `build_meshslice`. Device (i, j) = (row, col) index; blocks are the
  R blocks of the communicated dim (K for os, N for ls, M for rs):

    os:  X = ppermute(X, skew: (i, k) -> (i, k - i));  W = ppermute(W, skew: (k, j) -> (k - j, j))
         for t in 0..R-1:  Y += X . W                     # both hold K-block i + j + t
                           X <- from (i, j+1);  W <- from (i+1, j)
    ls:  (W moves along row = a, partial sums along col = b)
         W = ppermute(W, skew: (a, b) -> (a - b, b))     # (a, b) holds N-block a + b + t
         for t in 0..R-1:  acc = (t ? acc from (a, b+1) : 0) + X . W;  W <- from (a+1, b)
         Y = ppermute(acc, unskew: (a, b) -> (a, b + a - 1))   # N-block a + b - 1 goes home
    rs:  as ls with X moving along col (= a) and partial sums along row (= b).

  ksplit cuts each block into ksplit contiguous chunks; a chunk is shifted while the
  next one is multiplied (for ls/rs the partial sum of chunk c is passed on beside the
  matmul of chunk c + 1).

  Requires: R == C; ksplit * R divides the communicated extent.
  Bytes per device: R - 1 shifted blocks per moving matrix, as the collective's ring
  all-gather / reduce-scatter moves, plus the skew (and for ls/rs the unskew), which
  moves a block on (R - 1) / R of the devices: about (1 + 1/R) x the collective's bytes
  (1.5x measured on 2 x 2).
  """
  reason = unsupported(geometry, ksplit)
  if reason:
    raise ValueError(reason)
  if geometry.dataflow == "os":
    return lambda lhs, rhs: _os(geometry, ksplit, lhs, rhs)
  return lambda lhs, rhs: _stationary(geometry, ksplit, lhs, rhs,
                                      moving_is_lhs=geometry.dataflow == "rs")


def _grid_permute(x, g: GemmGeometry, dest_of):
  """ppermute over both axes; dest_of maps a source (row, col) to its destination."""
  r = g.row_size
  # JAX numbers devices of a multi-axis ppermute in *mesh* axis order, whatever the order
  # of the names passed, so linearise (row, col) the way the mesh lays them out.
  names = jax.sharding.get_abstract_mesh().axis_names
  row_major = names.index(g.row_axis) < names.index(g.col_axis)
  linear = (lambda i, j: i * r + j) if row_major else (lambda i, j: j * r + i)
  pairs = []
  for i in range(r):
    for j in range(r):
      di, dj = dest_of(i, j)
      pairs.append((linear(i, j), linear(di % r, dj % r)))
  axes = (g.row_axis, g.col_axis) if row_major else (g.col_axis, g.row_axis)
  return lax.ppermute(x, axes, pairs)


def _chunks(x, dim, ksplit):
  if ksplit == 1:
    return [x]
  size = x.shape[dim] // ksplit
  return [lax.slice_in_dim(x, c * size, (c + 1) * size, axis=dim) for c in range(ksplit)]


def _os(g: GemmGeometry, ksplit, lhs, rhs):
  r = g.row_size
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  # Skew: row i's X moves left by i, column j's W moves up by j -> both hold K-block i+j.
  x = _grid_permute(lhs, g, lambda i, k: (i, k - i))
  w = _grid_permute(rhs, g, lambda k, j: (k - j, j))
  xs, ws = _chunks(x, g.lhs_dim, ksplit), _chunks(w, g.rhs_dim, ksplit)
  acc = None
  for t in range(r):
    last = t + 1 == r
    for c in range(ksplit):
      if not last:
        x_next = shift(xs[c], g.col_axis, r, -1)
        w_next = shift(ws[c], g.row_axis, r, -1)
      part = local_dot(g, xs[c], ws[c], acc_dtype)
      acc = part if acc is None else acc + part
      if not last:
        xs[c], ws[c] = x_next, w_next
        # Later chunks' shifts start from the barrier's output: no collective combining.
        xs, ws, acc = pipeline_barrier((xs, ws, acc))
  return finish(g, acc, lhs, rhs)


def _stationary(g: GemmGeometry, ksplit, lhs, rhs, *, moving_is_lhs):
  """The moving operand travels along axis a, the partial sums along axis b:
  ls: a = row, b = col (W moves); rs: a = col, b = row (X moves)."""
  r = g.row_size
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  wire_dtype = reduction_dtype(g, lhs.dtype, rhs.dtype)
  roles = g.stationary_roles(moving_is_lhs)
  a_axis, b_axis = roles.gather_axis, roles.scatter_axis
  # (a, b) -> (row, col): a swap for rs, the identity for ls
  to_grid = (lambda a, b: (b, a)) if moving_is_lhs else (lambda a, b: (a, b))
  from_grid = to_grid                      # a swap (or identity) is its own inverse

  def permute(x, dest_of_ab):
    return _grid_permute(x, g, lambda i, j: to_grid(*dest_of_ab(*from_grid(i, j))))

  def multiply(piece):
    return local_dot(g, *roles.operands(piece, lhs, rhs), acc_dtype)

  # Skew: device (a, b) gets block a + b, from (a + b, b).
  ms = _chunks(permute(roles.moving(lhs, rhs), lambda a, b: (a - b, b)), roles.dim, ksplit)
  accs, done = [None] * ksplit, [None] * ksplit
  pending = []          # (chunk, partial sum, is final) to send during the next stage
  for t in range(r):
    last = t + 1 == r
    for c in range(ksplit):
      # Pass on the previous stage's partial sum (the last one goes home) beside this matmul.
      sent = [(pc, final, permute(v, lambda a, b: (a, b + a - 1)) if final
               else shift(v, b_axis, r, -1)) for pc, v, final in pending]
      if not last:
        m_next = shift(ms[c], a_axis, r, -1)
      part = multiply(ms[c])
      if not last:
        ms[c] = m_next
      ms, received, part = pipeline_barrier((ms, [v for *_, v in sent], part))
      for (pc, final, _), v in zip(sent, received):
        (done if final else accs)[pc] = v
      total = part if t == 0 else accs[c].astype(part.dtype) + part
      pending = [(c, total.astype(wire_dtype), last)]
  for pc, v, _ in pending:     # the last chunk's unskew is the epilogue
    done[pc] = permute(v, lambda a, b: (a, b + a - 1))
  out = done[0] if ksplit == 1 else jnp.concatenate(done, axis=g.out_dim)
  return finish(g, out, lhs, rhs)
