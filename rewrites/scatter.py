"""How a partial product is reduce-scattered over one mesh axis: one reduce-scatter
collective, or an all-to-all followed by a local sum.

The two compute the same thing (the sum of the n devices' partials, piece i on device
i). They differ in what the compiler does with them: on TPU v4 libtpu keeps every
reduce-scatter synchronous, while an all-to-all becomes an async start/done pair under
`--xla_tpu_enable_async_all_to_all=true`, so it can hide under independent compute (a
weight gradient's reduce-scatter, under the rest of the backward pass). The all-to-all
form pays a local sum of the n pieces.

Where the form pays off depends on the layout (measured with libtpu on v4, docs/tpu.md).
When the scattered dim is the local partial's leading dim (every dim before it has size
1, as for a weight gradient scattered over its first dim), the n pieces are contiguous:
the all-to-all sends them as they are, and the sum is written as n - 1 elementwise adds
of its pieces, which XLA fuses into the consumer (the optimizer's update). Anywhere else
the pieces are strided: libtpu copies the partial into a pieces-major layout first and the
sum is a separate reduction, together more than the synchronous reduce-scatter costs.
`all_to_all_pays(shape, dim)` is that rule; the planner applies the option only there.

Example:
  >>> SCATTER_FORMS
  ('reduce_scatter', 'all_to_all')
  >>> all_to_all_pays((1, 6144, 12288), 1), all_to_all_pays((4, 2048, 49152), 2)
  (True, False)
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

SCATTER_FORMS = ("reduce_scatter", "all_to_all")


def all_to_all_pays(shape, dim: int) -> bool:
  """Whether the all-to-all form needs no relayout of the local partial `shape` scattered
  over `dim`: every dim before `dim` has size 1 (module docstring)."""
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
  pieces = x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:])
  received = lax.all_to_all(pieces, axis_name, split_axis=dim, concat_axis=dim, tiled=False)
  if not all_to_all_pays(x.shape, dim):
    return jnp.sum(received, axis=dim, dtype=x.dtype)
  # contiguous pieces: adds (which fuse into the consumer) instead of a reduction (which
  # does not; measured 1.6M cycles for a 2-piece 151 MB sum on v4 against ~0 fused)
  total = lax.index_in_dim(received, 0, dim, keepdims=False)
  for j in range(1, n):
    total = total + lax.index_in_dim(received, j, dim, keepdims=False)
  return total
