"""1D sites: a matmul sharded over one mesh axis, as a sliced or ring collective matmul.

The one-axis special case of the 2D machinery (docs/design.md, "1D sites"), for the two
patterns of 1D tensor / sequence parallelism (layouts in `OneDGeometry`):

  all_gather:     Y = all_gather(X, a, M) . W        the gathered operand moves
  reduce_scatter: Y = reduce_scatter(X . W, a, N)    the partial sums move
  all_reduce:     Y = psum(X . W, a)                 the partial sums move, Y stays whole
                  (a reduce_scatter geometry with all_reduce=True)

Three forms, all with the same layouts:
  `build_oned_collective`  one blocking collective (what GSPMD emits)
  `build_oned_sliced`      ksplit sliced collectives, each beside the previous slice's
                           matmul (MeshSlice with one axis)
  `build_oned_ring`        a ring of n - 1 ppermutes (collective matmul, as in Wang et al.
                           and PyTorch async TP), optionally bidirectional; not for
                           all_reduce (a ring all-reduce is two rings; the sliced psum is
                           what XLA already runs as one)

check_vma: when an all_gather site's output is replicated over the axis (the other
operand does not vary over it, e.g. Y[M, N] = all_gather(X[M:a, K]) . W[K, N]), only the
collective form type-checks under `check_vma=True`; wrap the sliced and ring forms in a
shard_map with `check_vma=False`: JAX types ppermute results, and everything passed
through an `optimization_barrier` with a varying value, as varying over the axis.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._local import accumulation_dtype, finish, local_dot, reduction_dtype, result_dtype
from .geometry import OneDGeometry, extent_reason
from .rings import ring_all_gather, ring_reduce_scatter
from .slicing import assemble_slices, pipeline_barrier, take_slice


def output_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
  """The dot_general output's dims as ("batch" | "lhs" | "rhs", operand dim) in order:
  batch dims, then lhs free dims, then rhs free dims.

  >>> output_dims((((1,), (0,)), ((), ())), 2, 2)
  (('lhs', 0), ('rhs', 1))
  """
  (lc, rc), (lb, _) = dimension_numbers
  lhs_free = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rhs_used = set(rc) | set(dimension_numbers[1][1])
  rhs_free = [d for d in range(rhs_ndim) if d not in rhs_used]
  return (tuple(("batch", d) for d in lb) + tuple(("lhs", d) for d in lhs_free)
          + tuple(("rhs", d) for d in rhs_free))


def _source(g: OneDGeometry, lhs_ndim: int, rhs_ndim: int):
  """(operand, dim) that out_dim comes from, checked against lhs_dim / rhs_dim."""
  dims = output_dims(g.dimension_numbers, lhs_ndim, rhs_ndim)
  if not 0 <= g.out_dim < len(dims) or dims[g.out_dim][0] == "batch":
    raise ValueError(f"out_dim={g.out_dim} must name a free (non-batch) output dim of "
                     f"this dot_general; its output dims are {dims}")
  operand, dim = dims[g.out_dim]
  if g.kind == "all_gather":
    want = ("lhs", g.lhs_dim) if g.lhs_dim is not None else ("rhs", g.rhs_dim)
    if (operand, dim) != want:
      raise ValueError(f"out_dim={g.out_dim} is {operand} dim {dim}, but the gathered dim "
                       f"is {want[0]} dim {want[1]}: out_dim must be its output position")
  return operand, dim


def unsupported(geometry: OneDGeometry, ksplit: int = 1, bidirectional: bool = False,
                ring: bool = False) -> str:
  """Why the 1D builders (the ring builder when `ring`) cannot serve these arguments, or ""."""
  if ring and geometry.all_reduce:
    return ("wang: an all-reduce site keeps its result whole, there is no ring to pass "
            "blocks around; use meshslice (sliced psums) or collective")
  reason = extent_reason(geometry)
  if reason:
    return f"1D {geometry.kind}: {reason}"
  parts = ksplit * (2 if bidirectional else 1)
  if not isinstance(ksplit, int) or ksplit < 1 or not geometry.valid_ksplit(parts):
    what = f"2 * ksplit = {parts}" if bidirectional else f"ksplit={ksplit}"
    return (f"1D {geometry.kind}: {what} must divide the per-device block "
            f"{geometry.global_extent} / {geometry.axis_size} = "
            f"{geometry.global_extent // geometry.axis_size} of mesh axis {geometry.axis!r}")
  return ""


def build_oned_collective(geometry: OneDGeometry):
  """Shard_map body of the plain 1D collective matmul (no slicing):

    all_gather:     Y = all_gather(X, a, dim) . W
    reduce_scatter: Y = psum_scatter(X . W, a, out_dim)

  It is `build_oned_sliced(geometry, 1)`.
  """
  return build_oned_sliced(geometry, 1)


def build_oned_sliced(geometry: OneDGeometry, ksplit: int):
  """Shard_map body of the sliced, pipelined 1D collective matmul (B = extent / (S n)):

    all_gather:     for s: Xs = all_gather(chunk s of X, a)          # chunk s of every block
                           Y[rows of Xs] = Xs . W                     # beside gather s+1
    reduce_scatter: for s: Y[chunk s] = psum_scatter(X[rows of slice s] . W, a)
                                                                      # beside matmul s+1
    all_reduce:     for s: Y[chunk s] = psum(X[rows of slice s] . W, (a,) + reduce_axes)
                                                                      # beside matmul s+1
  (X stands for whichever operand holds the communicated dim.)

  Requires: ksplit * n divides the communicated extent. Bytes: those of the collective.

  Example (a row-parallel layer whose result is wanted replicated over "x"):
    >>> g = OneDGeometry(dimension_numbers=(((1,), (0,)), ((), ())), kind="reduce_scatter",
    ...                  all_reduce=True, axis="x", axis_size=2, lhs_dim=1, rhs_dim=0,
    ...                  out_dim=0, global_extent=16)
    >>> body = build_oned_sliced(g, 2)   # in jax.shard_map(body, in_specs=(P(None, "x"),
    ...                                  #   P("x", None)), out_specs=P())
  """
  reason = unsupported(geometry, ksplit)
  if reason:
    raise ValueError(reason)
  block = geometry.block_size(ksplit)
  if geometry.kind == "all_gather":
    return lambda lhs, rhs: _sliced_gather(geometry, ksplit, block, lhs, rhs)
  if geometry.all_reduce:
    return lambda lhs, rhs: _sliced_all_reduce(geometry, ksplit, block, lhs, rhs)
  return lambda lhs, rhs: _sliced_scatter(geometry, ksplit, block, lhs, rhs)


def build_oned_ring(geometry: OneDGeometry, ksplit: int = 1, bidirectional: bool = False):
  """Shard_map body of the ring collective matmul over the one axis a (size n):

    all_gather:     for t in 0..n-1: Y[rows of block me - t] = X_blk . W
                                     X_blk = ppermute(X_blk, a, +1)   # beside the matmul
    reduce_scatter: for t in 0..n-1: acc = ppermute(acc, a, +1) + (X . W)[block me - 1 - t]
                    Y = acc                                           # block me, summed

  ksplit cuts each block into ksplit chunks (2 * ksplit with halves travelling both ways
  when bidirectional), each sent while the previous one is multiplied.

  Requires: ksplit (x2 if bidirectional) * n divides the communicated extent.
  Bytes per device: those of the collective, in n - 1 neighbour steps.
  """
  reason = unsupported(geometry, ksplit, bidirectional, ring=True)
  if reason:
    raise ValueError(reason)
  if geometry.kind == "all_gather":
    return lambda lhs, rhs: _ring_gather(geometry, ksplit, bidirectional, lhs, rhs)
  return lambda lhs, rhs: _ring_scatter(geometry, ksplit, bidirectional, lhs, rhs)


def _multiply(g, which, piece, lhs, rhs, dtype):
  """The local product with `piece` standing in for operand `which`."""
  a, b = (piece, rhs) if which == "lhs" else (lhs, piece)
  return local_dot(g, a, b, dtype)


def _sliced_gather(g: OneDGeometry, ksplit, block, lhs, rhs):
  which, dim = _source(g, lhs.ndim, rhs.ndim)
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  moving = lhs if which == "lhs" else rhs

  def gather(m, s):
    # Invariant: every device gets the same slice, so a replicated output type-checks.
    return lax.all_gather(take_slice(m, dim, ksplit, block, s), g.axis, axis=dim, tiled=True,
                          to="invarying")

  m, cur, parts = moving, gather(moving, 0), []
  for s in range(ksplit):
    last = s + 1 == ksplit
    if not last:
      nxt = gather(m, s + 1)
    part = _multiply(g, which, cur, lhs, rhs, acc_dtype)
    if not last:
      # Slice s+2 is cut from the barrier's output: its gather cannot be combined.
      m, cur, part = pipeline_barrier((m, nxt, part))
    parts.append(part)
  return finish(g, assemble_slices(parts, g.out_dim, block), lhs, rhs)


def _sliced_scatter(g: OneDGeometry, ksplit, block, lhs, rhs):
  scatter = lambda partial: lax.psum_scatter(partial, g.axis, scatter_dimension=g.out_dim,
                                             tiled=True)
  return finish(g, _pipelined_reduction(g, ksplit, block, lhs, rhs, scatter), lhs, rhs)


def _sliced_all_reduce(g: OneDGeometry, ksplit, block, lhs, rhs):
  """Cut the output's free dim out_dim into slices (through the operand that supplies it);
  the psum of slice s runs beside the matmul of slice s+1. Every slice is summed over all
  the axes splitting the contraction at once, so nothing is left for `finish` to sum."""
  axes = (g.axis,) + tuple(g.reduce_axes)
  out_dtype = result_dtype(g, lhs.dtype, rhs.dtype)
  return _pipelined_reduction(g, ksplit, block, lhs, rhs,
                              lambda part: lax.psum(part, axes)).astype(out_dtype)


def _pipelined_reduction(g: OneDGeometry, ksplit, block, lhs, rhs, reduce):
  """The partial product of output slice s, `reduce`d (reduce-scatter or all-reduce) beside
  the matmul of slice s+1; the reduced slices reassembled into the local output."""
  which, dim = _source(g, lhs.ndim, rhs.ndim)
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  wire_dtype = reduction_dtype(g, lhs.dtype, rhs.dtype)

  def multiply(src, s):
    piece = take_slice(src, dim, ksplit, block, s)
    # reduced in the dtype the unsliced program's collective sums in
    return _multiply(g, which, piece, lhs, rhs, acc_dtype).astype(wire_dtype)

  src, pieces, pending = lhs if which == "lhs" else rhs, [], None
  for s in range(ksplit):
    last = s + 1 == ksplit
    if pending is not None:
      pieces.append(reduce(pending))     # the collective of slice s-1 beside matmul s
    part = multiply(src, s)
    if not last:
      if pieces:
        src, part, pieces[-1] = pipeline_barrier((src, part, pieces[-1]))
      else:
        src, part = pipeline_barrier((src, part))
    pending = part
  pieces.append(reduce(pending))
  return assemble_slices(pieces, g.out_dim, block)


def _ring_gather(g: OneDGeometry, ksplit, bidirectional, lhs, rhs):
  which, dim = _source(g, lhs.ndim, rhs.ndim)
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)

  def consume(buf, piece, start):
    part = _multiply(g, which, piece, lhs, rhs, acc_dtype)
    if buf is None:
      shape = list(part.shape)
      shape[g.out_dim] = g.global_extent
      buf = jnp.zeros_like(part, shape=shape)    # varies over the same axes as `part`
    return lax.dynamic_update_slice_in_dim(buf, part, start, axis=g.out_dim)

  moving = lhs if which == "lhs" else rhs
  out = ring_all_gather(moving, dim, g.axis, g.axis_size, ksplit, bidirectional, consume)
  return finish(g, out, lhs, rhs)


def _ring_scatter(g: OneDGeometry, ksplit, bidirectional, lhs, rhs):
  which, dim = _source(g, lhs.ndim, rhs.ndim)
  acc_dtype = accumulation_dtype(g, lhs.dtype, rhs.dtype)
  wire_dtype = reduction_dtype(g, lhs.dtype, rhs.dtype)
  source = lhs if which == "lhs" else rhs

  def produce(start, size):
    piece = lax.dynamic_slice_in_dim(source, start, size, axis=dim)
    return _multiply(g, which, piece, lhs, rhs, acc_dtype)

  out = ring_reduce_scatter(produce, g.axis, g.axis_size, g.global_extent // g.axis_size,
                            g.out_dim, ksplit, bidirectional, wire_dtype)
  return finish(g, out, lhs, rhs)
