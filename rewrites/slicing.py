"""Block-cyclic slicing of a local shard, and its inverse.

A local extent L along `axis` is viewed as (L / (S*B), S, B): slice s is index s on the
middle axis. When the global extent is cut into blocks of B and S*B*lcm(R, C) divides it,
gathering slice s over any mesh axis yields exactly the global blocks whose index is
congruent to s modulo S, in global order (docs/design.md, "Slicing"). That is what lets two
operands sharded over different axes (R != C) deliver matching pieces of K.
"""
from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
from jax import lax
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import ad, batching, mlir


def take_slice(x, axis: int, ksplit: int, block: int, index: int):
  """Slice `index` of `ksplit` block-cyclic slices of `x` along `axis`.

  >>> import numpy as np
  >>> take_slice(np.arange(8), 0, 2, 2, 1).tolist()   # blocks [0 1][2 3][4 5][6 7]
  [2, 3, 6, 7]
  """
  if ksplit == 1:
    return x
  blocks = x.shape[axis] // (ksplit * block)
  if axis < x.ndim - 1:
    # A (blocks, S, B) view of a dim other than the last is a bitcast in TPU's tiled
    # layouts (tiles cover the two minor dims, B is a multiple of the tile rows).
    view = x.reshape(x.shape[:axis] + (blocks, ksplit, block) + x.shape[axis + 1:])
    piece = lax.index_in_dim(view, index, axis=axis + 1, keepdims=False)
    return piece.reshape(x.shape[:axis] + (blocks * block,) + x.shape[axis + 1:])
  # The last (lane) dim: reshaping it to (blocks, S, B) makes TPU transpose the whole
  # operand (a relayout copy) to keep the view a bitcast; static slices of it do not.
  chunks = [lax.slice_in_dim(x, (b * ksplit + index) * block,
                             (b * ksplit + index + 1) * block, axis=axis)
            for b in range(blocks)]
  return chunks[0] if blocks == 1 else lax.concatenate(chunks, axis)


def take_slices(x, axis: int, ksplit: int, block: int) -> list:
  """All `ksplit` block-cyclic slices of `x` along `axis`, cut at once.

  Cut together, the slices are sibling slices of one operand, which XLA fuses into one
  multi-output copy (one pass over `x`) instead of one copy per slice; on TPU every
  collective operand that is a slice of a larger buffer is materialised.

  >>> import numpy as np
  >>> [a.tolist() for a in take_slices(np.arange(8), 0, 2, 2)]
  [[0, 1, 4, 5], [2, 3, 6, 7]]
  """
  return [take_slice(x, axis, ksplit, block, s) for s in range(ksplit)]


def assemble_slices(pieces, axis: int, block: int):
  """Inverse of `take_slices`: interleave per-slice pieces back into one shard.

  One concatenation of the pieces' blocks in (block, slice) order: a single copy,
  whichever dim `axis` is (no (blocks, S, B) view, which TPU would relayout).

  >>> import numpy as np
  >>> assemble_slices([np.array([0, 1, 4, 5]), np.array([2, 3, 6, 7])], 0, 2).tolist()
  [0, 1, 2, 3, 4, 5, 6, 7]
  """
  if len(pieces) == 1:
    return pieces[0]
  blocks = pieces[0].shape[axis] // block
  if blocks == 1:
    return lax.concatenate(list(pieces), axis)
  chunks = [lax.slice_in_dim(p, b * block, (b + 1) * block, axis=axis)
            for b in range(blocks) for p in pieces]
  return lax.concatenate(chunks, axis)

# The pipelining barrier. `lax.optimization_barrier` requires, inside a type-checked
# shard_map (check_vma=True), that all its operands vary over the same manual axes; a
# pipeline step joins values that legitimately differ -- and the difference may only
# appear after the body is traced: `jax.vmap(..., spmd_axis_name="b")` of a traced
# shard_map makes the batched activations vary over "b" while an unbatched weight does
# not, and no cast at trace time can anticipate that. So the barrier is its own
# primitive: the same HLO op, every operand keeping its own type (vma included).
pipeline_barrier_p = jax.extend.core.Primitive("pipeline_barrier")
pipeline_barrier_p.multiple_results = True
pipeline_barrier_p.def_impl(jax.jit(lambda *args: pipeline_barrier_p.bind(*args)))
pipeline_barrier_p.def_abstract_eval(lambda *avals: avals)


def _barrier_lowering(ctx, *args):
  del ctx
  return stablehlo.OptimizationBarrierOp(list(args)).results


def _barrier_batcher(args, dims):
  return pipeline_barrier_p.bind(*args), dims


def _barrier_jvp(primals, tangents):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return pipeline_barrier_p.bind(*primals), pipeline_barrier_p.bind(*tangents)


def _barrier_transpose(cts, *primals):
  del primals
  return pipeline_barrier_p.bind(*[ad.instantiate_zeros(ct) for ct in cts])


mlir.register_lowering(pipeline_barrier_p, _barrier_lowering)
batching.primitive_batchers[pipeline_barrier_p] = _barrier_batcher
ad.primitive_jvps[pipeline_barrier_p] = _barrier_jvp
ad.primitive_transposes[pipeline_barrier_p] = _barrier_transpose


def not_before(x, anchor):
  """`x`, bit for bit, as a value XLA can only compute once `anchor` exists.

  `x + z` where z is -0.0 computed from one element of `anchor` (x + -0.0 == x for every
  x, signed zeros, infinities and NaNs included; z is -0.0 whatever that element holds).
  Unlike a barrier, which the CPU compiler removes before scheduling, this is a data
  dependence every backend keeps. The pass uses it so that a weight gradient's gather of
  a forward activation, whose value is ready early, is not scheduled long before its
  matmul can run: XLA otherwise hoists such gathers, and each gathered copy stays live
  until its use.

  >>> import numpy as np
  >>> f32 = np.float32
  >>> not_before(np.array([1.0, -0.0, np.inf], f32), np.array([np.nan], f32)).tolist()
  [1.0, -0.0, inf]
  """
  first = jnp.ravel(anchor)[:1]
  zero = -jnp.abs(first * 0)                      # -0.0, or NaN if `first` is inf / NaN
  zero = jnp.where(jnp.isnan(zero), -jnp.zeros_like(zero), zero)
  return x + zero.astype(x.dtype)[0]


def pipeline_barrier(values):
  """An optimization barrier over the pytree `values` (XLA may neither move work across
  it nor merge what is computed on either side), whose leaves may vary over different
  manual mesh axes.

  Every pipelining step of the algorithms joins the collective of the next slice with the
  matmul of the current one through this barrier. It lowers to the same HLO
  `opt-barrier` as `lax.optimization_barrier`, but each leaf keeps its own type, so it
  also works where the leaves' varying axes differ (see `pipeline_barrier_p`).
  """
  leaves, tree = jax.tree.flatten(values)
  return jax.tree.unflatten(tree, pipeline_barrier_p.bind(*leaves))
