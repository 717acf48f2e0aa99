"""Block-cyclic slicing of a local shard, and its inverse.

A local extent L along `axis` is viewed as (L / (S*B), S, B): slice s is index s on the
middle axis. When the global extent is cut into blocks of B and S*B*lcm(R, C) divides it,
gathering slice s over any mesh axis yields exactly the global blocks whose index is
congruent to s modulo S, in global order (DESIGN.md section 4). That is what lets two
operands sharded over different axes (R != C) deliver matching pieces of K.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def take_slice(x, axis: int, ksplit: int, block: int, index: int):
  """Slice `index` of `ksplit` block-cyclic slices of `x` along `axis`.

  >>> import numpy as np
  >>> take_slice(np.arange(8), 0, 2, 2, 1).tolist()   # blocks [0 1][2 3][4 5][6 7]
  [2, 3, 6, 7]
  """
  if ksplit == 1:
    return x
  length = x.shape[axis]
  view = x.reshape(x.shape[:axis] + (length // (ksplit * block), ksplit, block)
                   + x.shape[axis + 1:])
  piece = lax.index_in_dim(view, index, axis=axis + 1, keepdims=False)
  return piece.reshape(x.shape[:axis] + (length // ksplit,) + x.shape[axis + 1:])


def assemble_slices(pieces, axis: int, block: int):
  """Inverse of `take_slice`: interleave per-slice pieces back into one shard.

  >>> import numpy as np
  >>> assemble_slices([np.array([0, 1, 4, 5]), np.array([2, 3, 6, 7])], 0, 2).tolist()
  [0, 1, 2, 3, 4, 5, 6, 7]
  """
  if len(pieces) == 1:
    return pieces[0]
  ksplit = len(pieces)
  shape = pieces[0].shape
  blocked = [p.reshape(shape[:axis] + (shape[axis] // block, block) + shape[axis + 1:])
             for p in pieces]
  stacked = jnp.stack(blocked, axis=axis + 1)
  return stacked.reshape(shape[:axis] + (shape[axis] * ksplit,) + shape[axis + 1:])
