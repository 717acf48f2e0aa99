"""The MeshSlice algorithm: sliced, software-pipelined 2D GEMM (and its S = 1 case, the
plain collective algorithm GSPMD would emit).

Each builder returns a shard_map *body*: a function of the local lhs and rhs blocks that
returns the local output block. The caller supplies the shard_map and its specs (see
`geometry.py` for the layouts of each dataflow).

Pipelining: the collective for slice s+1 is issued beside the matmul of slice s, and an
`optimization_barrier` (`slicing.pipeline_barrier`) joins them before step s+1 starts.
Slice s+2 is cut from the barrier's output, so its collective depends on the barrier and
XLA's collective combiner cannot merge the S sliced collectives back into one.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._local import finish, local_dot
# defined here before _local existed; re-exported for their callers
from ._local import accumulation_dtype as accumulation_dtype
from ._local import reduction_dtype as reduction_dtype
from .geometry import GemmGeometry
from .scatter import (pieces_contiguous, reduce_scatter, scatter_pieces, split_dim,
                      split_dimension_numbers)
from .slicing import assemble_slices, pipeline_barrier, take_slices


def build_meshslice(geometry: GemmGeometry, ksplit: int, *, scatter: str = "reduce_scatter"):
  """Shard_map body of the sliced MeshSlice GEMM for `geometry.dataflow`.

  With B = geometry.block_size(ksplit) and slice(x, s) the block-cyclic slice s:

    os:  for s: Xs = all_gather(slice(X, s), col, K); Ws = all_gather(slice(W, s), row, K)
                Y += Xs . Ws                                   # Y stays put
         (one of row/col may be None with size 1: that operand is not gathered)
    ls:  for s: Ws = all_gather(slice(W, s), row, N)
                Y[slice s] = reduce_scatter(X . Ws, col, N)    # X stays put
    rs:  for s: Xs = all_gather(slice(X, s), col, M)
                Y[slice s] = reduce_scatter(Xs . W, row, M)    # W stays put

  where the collective of slice s+1 runs beside the matmul of slice s.

  Requires: ksplit * lcm(R, C) divides the communicated global extent.

  scatter: how ls / rs reduce-scatter each slice's partial product (`scatter.SCATTER_FORMS`:
  one reduce-scatter, or an all-to-all and a local sum, which TPU v4 runs asynchronously).

  Example (by hand, inside your own shard_map):
    >>> body = build_meshslice(geometry, ksplit=4)      # doctest: +SKIP
    >>> y = jax.shard_map(body, mesh=mesh, in_specs=(P("x", "y"), P("x", "y")),
    ...                   out_specs=P("x", "y"))(x, w)   # doctest: +SKIP
  """
  block = geometry.block_size(ksplit)
  if geometry.dataflow == "os":
    return lambda lhs, rhs: _output_stationary(geometry, ksplit, block, lhs, rhs)
  if geometry.dataflow == "ls":
    return lambda lhs, rhs: _operand_stationary(geometry, ksplit, block, [(lhs, rhs)],
                                                moving_is_lhs=False, scatter=scatter)
  return lambda lhs, rhs: _operand_stationary(geometry, ksplit, block, [(lhs, rhs)],
                                              moving_is_lhs=True, scatter=scatter)


def build_collective(geometry: GemmGeometry, *, scatter: str = "reduce_scatter"):
  """Shard_map body of the plain collective GEMM (GSPMD's algorithm, no slicing).

    os:  Y = all_gather(X, col, K) . all_gather(W, row, K)
    ls:  Y = reduce_scatter(X . all_gather(W, row, N), col, N)
    rs:  Y = reduce_scatter(all_gather(X, col, M) . W, row, M)

  It is `build_meshslice(geometry, 1, scatter=scatter)`: one slice, nothing to pipeline.
  """
  return build_meshslice(geometry, 1, scatter=scatter)


def _gather(x, axis, dim):
  # axis None: that operand holds the dim whole already (the 1D case of OS, where one
  # mesh axis has size 1 -- e.g. a sequence-parallel weight gradient)
  return x if axis is None else lax.all_gather(x, axis, axis=dim, tiled=True)


def _output_stationary(g: GemmGeometry, ksplit, block, lhs, rhs):
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  # every slice is cut up front (one pass over each operand, see slicing.take_slices);
  # the slices not yet gathered travel through the barriers, so the gather of slice s+1
  # still depends on step s and the S gathers stay S collectives
  xs, ws = (take_slices(lhs, g.lhs_dim, ksplit, block),
            take_slices(rhs, g.rhs_dim, ksplit, block))

  def gather(s):
    return _gather(xs[s], g.col_axis, g.lhs_dim), _gather(ws[s], g.row_axis, g.rhs_dim)

  x_cur, w_cur = gather(0)
  acc = None
  for s in range(ksplit):
    last = s + 1 == ksplit
    if not last:
      x_next, w_next = gather(s + 1)
    # the partial sum accumulates in the dot's f32 output (XLA fuses the add into it)
    part = local_dot(g, x_cur, w_cur, acc_dtype)
    acc = part if acc is None else acc + part
    if not last:
      x_rest, w_rest, x_cur, w_cur, acc = pipeline_barrier(
          (xs[s + 2:], ws[s + 2:], x_next, w_next, acc))
      xs, ws = xs[:s + 2] + x_rest, ws[:s + 2] + w_rest
  return finish(g, acc, lhs, rhs)


def build_meshslice_sum(geometry: GemmGeometry, ksplit: int, terms: int, *,
                        scatter: str = "reduce_scatter"):
  """Shard_map body of the sum of `terms` ls / rs GEMMs of one geometry, reduce-scattered
  once: body(lhs_1, rhs_1, ..., lhs_n, rhs_n) = sum_t lhs_t . rhs_t.

  A reduce-scatter is linear, so the partial products of the terms are added on each
  device (in the accumulation dtype) before the one collective: where a gradient sums
  several projections (dx = dq Wq^T + dk Wk^T + dv Wv^T) this sends one reduce-scatter a
  slice instead of one a term, as XLA's own program does for such a sum. Each term's
  gathers are sliced and pipelined as in `build_meshslice`.

  Example (three terms, by hand, inside your own shard_map):
    >>> body = build_meshslice_sum(geometry, 2, 3)          # doctest: +SKIP
    >>> dx = jax.shard_map(body, mesh=mesh, in_specs=(P("x", "y"), P("x", "y")) * 3,
    ...                    out_specs=P("x", "y"))(dq, wq, dk, wk, dv, wv)  # doctest: +SKIP
  """
  if geometry.dataflow == "os":
    raise ValueError("build_meshslice_sum: an os GEMM reduces nothing across devices "
                     "(dataflow must be ls or rs)")
  block = geometry.block_size(ksplit)

  def body(*operands):
    if len(operands) != 2 * terms:
      raise ValueError(f"build_meshslice_sum: expected {2 * terms} operands "
                       f"({terms} lhs, rhs pairs), got {len(operands)}")
    pairs = list(zip(operands[::2], operands[1::2]))
    return _operand_stationary(geometry, ksplit, block, pairs,
                               moving_is_lhs=geometry.dataflow == "rs", scatter=scatter)
  return body


def _operand_stationary(g: GemmGeometry, ksplit, block, pairs, *, moving_is_lhs,
                        scatter="reduce_scatter"):
  """ls (rhs moves over row, partials scatter over col) and rs (lhs moves over col,
  partials scatter over row) are the same loop with the roles swapped. `pairs`: the
  (lhs, rhs) terms, one for a GEMM, several for a sum whose partial products are added
  before each reduce-scatter."""
  lhs, rhs = pairs[0]
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  wire_dtype = reduction_dtype(g, lhs.dtype, rhs.dtype)
  roles = g.stationary_roles(moving_is_lhs)

  def gather(ms, s):
    # the slice s of every term's moving operand
    return [lax.all_gather(m[s], roles.gather_axis, axis=roles.dim, tiled=True) for m in ms]

  n = roles.scatter_size
  # the all-to-all form where the scattered dim does not lead the partial: cut the moving
  # operand's dim into (n, extent / n) before the dot, so that the dot writes the partial
  # pieces-major (no relayout before the all-to-all; docs/tpu.md)
  split = scatter == "all_to_all" and n > 1 and not pieces_contiguous(
      _partial_shape(g, lhs, rhs), g.out_dim)

  def multiply_term(m_slice, lhs, rhs):
    if not split:
      return local_dot(g, *roles.operands(m_slice, lhs, rhs), acc_dtype)
    operand = 0 if roles.moving_is_lhs else 1
    numbers = split_dimension_numbers(g.dimension_numbers, operand, roles.dim)
    pieces = local_dot(g, *roles.operands(split_dim(m_slice, roles.dim, n), lhs, rhs),
                       acc_dtype, dimension_numbers=numbers)
    return jnp.moveaxis(pieces, g.out_dim, 0)

  def multiply(m_slices):
    # the terms' partial products summed in the accumulation dtype, sent in the wire's
    total = multiply_term(m_slices[0], *pairs[0])
    for m_slice, (lhs, rhs) in zip(m_slices[1:], pairs[1:]):
      total = total + multiply_term(m_slice, lhs, rhs)
    return total.astype(wire_dtype)

  def scatter_slice(partial):
    if split:
      return scatter_pieces(partial, roles.scatter_axis)
    return reduce_scatter(partial, roles.scatter_axis, g.out_dim, scatter)

  # every term's slices, cut all at once as in OS: m[t][s] is slice s of term t
  m = [take_slices(roles.moving(*pair), roles.dim, ksplit, block) for pair in pairs]
  m_cur = gather(m, 0)
  pieces, pending = [], None
  for s in range(ksplit):
    last = s + 1 == ksplit
    if not last:
      m_next = gather(m, s + 1)
    if pending is not None:
      pieces.append(scatter_slice(pending))   # reduce-scatter of slice s-1 beside matmul s
    part = multiply(m_cur)
    if not last:
      later = [t[s + 2:] for t in m]
      if pieces:
        later, m_cur, part, pieces[-1] = pipeline_barrier((later, m_next, part, pieces[-1]))
      else:
        later, m_cur, part = pipeline_barrier((later, m_next, part))
      m = [t[:s + 2] + rest for t, rest in zip(m, later)]
    elif pieces:
      # the last partial waits for the previous slice's reduce-scatter, else XLA combines
      # the two trailing reduce-scatters into one collective (seen on TPU with S = 2)
      part, pieces[-1] = pipeline_barrier((part, pieces[-1]))
    pending = part
  pieces.append(scatter_slice(pending))
  out = assemble_slices(pieces, g.out_dim, block)
  return finish(g, out, lhs, rhs)


def _partial_shape(g: GemmGeometry, lhs, rhs) -> tuple:
  """The dims of the local partial product before `g.out_dim` (batch dims, then lhs free
  dims, then rhs free dims, as dot_general orders its output)."""
  (lc, rc), (lb, rb) = g.dimension_numbers
  free = lambda x, c, b: [x.shape[d] for d in range(x.ndim) if d not in c and d not in b]
  dims = [lhs.shape[d] for d in lb] + free(lhs, lc, lb) + free(rhs, rc, rb)
  return tuple(dims[:g.out_dim])
