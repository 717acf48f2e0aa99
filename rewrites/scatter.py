"""How a partial product is reduce-scattered over one mesh axis: one reduce-scatter
collective, or an all-to-all followed by a local sum.

The two compute the same thing (the sum of the n devices' partials, piece i on device
i). They differ in what the compiler does with them: on TPU v4 libtpu keeps every
reduce-scatter synchronous, while an all-to-all becomes an async start/done pair under
`--xla_tpu_enable_async_all_to_all=true`, so it can hide under independent compute (a
weight gradient's reduce-scatter, under the rest of the backward pass). The all-to-all
form pays a local sum of the n pieces.

How the pieces are laid out decides what the form costs (measured with libtpu on v4,
docs/tpu.md). When the scattered dim leads the local partial (every dim before it has
size 1, as for a weight gradient scattered over its first dim: `pieces_contiguous`),
the n pieces are contiguous: `reduce_scatter` sends them as they are and sums them with n - 1
elementwise adds, which XLA fuses into the consumer (the optimizer's update). Anywhere
else the pieces are strided; cut after the matmul, libtpu copies the whole partial into a
pieces-major layout before the all-to-all and the sum is a separate reduction, together
more than the synchronous reduce-scatter costs. The algorithms therefore cut such a site
*before* its matmul: the moving operand's dim is split into (n, extent / n)
(`split_dim`, `split_dimension_numbers`), the dot writes the partial pieces-major, and
`scatter_pieces` does the all-to-all and the adds.

Example:
  >>> SCATTER_FORMS
  ('reduce_scatter', 'all_to_all')
  >>> pieces_contiguous((1, 6144, 12288), 1), pieces_contiguous((4, 2048, 49152), 2)
  (True, False)
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

SCATTER_FORMS = ("reduce_scatter", "all_to_all")


def pieces_contiguous(shape, dim: int) -> bool:
  """Whether the n pieces of a local partial `shape` cut along `dim` are contiguous, so
  that the all-to-all form needs no relayout of it: every dim before `dim` has size 1
  (module docstring)."""
  return all(size == 1 for size in shape[:dim])


def reduce_scatter(x, axis_name, dim: int, form: str = "reduce_scatter"):
  """Sum `x` over mesh axis `axis_name` and keep this device's 1/n of dim `dim` (as
  `lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)`), in `form`."""
  if form == "reduce_scatter":
    return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)
  if form != "all_to_all":
    raise ValueError(f"reduce-scatter form must be one of {SCATTER_FORMS}, got {form!r}")
  n = lax.psum(1, axis_name)
  if n == 1:
    return x
  # piece j of dim `dim` goes to device j; what lands at index i of the new dim came from
  # device i, so summing that dim leaves this device's piece summed over all devices
  received = lax.all_to_all(split_dim(x, dim, n), axis_name, split_axis=dim,
                            concat_axis=dim, tiled=False)
  if not pieces_contiguous(x.shape, dim):
    return jnp.sum(received, axis=dim, dtype=x.dtype)
  return _sum_pieces(received, dim)


def _sum_pieces(received, dim: int):
  """The sum of `received` over its pieces dim `dim`, as adds: they fuse into the
  consumer, a reduction does not (measured on v4: 1.6M cycles for a 2-piece 151 MB sum
  as a reduce, ~0 fused into the SGD update)."""
  total = lax.index_in_dim(received, 0, dim, keepdims=False)
  for j in range(1, received.shape[dim]):
    total = total + lax.index_in_dim(received, j, dim, keepdims=False)
  return total


def split_dim(x, dim: int, n: int):
  """`x` with dim `dim` cut into (n, extent / n): piece j of it is x's j-th chunk."""
  return x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:])


def split_dimension_numbers(dimension_numbers, operand: int, dim: int):
  """A dot_general's dimension numbers after free dim `dim` of operand 0 (lhs) or 1 (rhs)
  is cut in two (`split_dim`): that operand's dims after it move up by one."""
  (contract, batch) = dimension_numbers
  bump = lambda dims: tuple(d + 1 if d > dim else d for d in dims)
  contract = tuple(bump(c) if i == operand else tuple(c) for i, c in enumerate(contract))
  batch = tuple(bump(b) if i == operand else tuple(b) for i, b in enumerate(batch))
  return (contract, batch)


def scatter_pieces(pieces, axis_name):
  """The all-to-all form on a partial already cut into pieces along its leading dim (piece
  j for device j): this device's piece summed over the axis. A matmul that writes its
  output pieces-major this way (the moving operand's dim split before the dot) needs no
  relayout of the partial before the all-to-all."""
  received = lax.all_to_all(pieces, axis_name, split_axis=0, concat_axis=0, tiled=False)
  return _sum_pieces(received, 0)
