"""The local matmul every algorithm runs, and the dtypes around it.

Each algorithm multiplies local pieces (`local_dot`), adds the pieces' products up in
`accumulation_dtype`, sends partial sums across devices in `reduction_dtype`, and ends
with `finish`: the sum over `reduce_axes`, cast to `result_dtype`, the dtype the
original dot_general returns. Both geometries (`GemmGeometry`, `OneDGeometry`) carry
the fields these read.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .platform import target_platform


def result_dtype(geometry, lhs_dtype, rhs_dtype):
  """The dtype of the original dot_general's result: `geometry.out_dtype`, or the
  operands' promoted dtype when the geometry does not say.

  >>> import numpy as np
  >>> from meshslice.rewrites import OneDGeometry
  >>> g = OneDGeometry(dimension_numbers=(((1,), (0,)), ((), ())), kind="all_gather",
  ...                  axis="x", axis_size=2, lhs_dim=0, rhs_dim=None, out_dim=0,
  ...                  global_extent=8)
  >>> str(result_dtype(g, np.float16, np.float32))
  'float32'
  """
  return jnp.dtype(geometry.out_dtype or jnp.result_type(lhs_dtype, rhs_dtype))


def accumulation_dtype(geometry, lhs_dtype, rhs_dtype):
  """Float results narrower than 32 bits are accumulated across slices in float32."""
  out = jnp.dtype(geometry.preferred_element_type
                  or result_dtype(geometry, lhs_dtype, rhs_dtype))
  if jnp.issubdtype(out, jnp.floating) and out.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return out


def reduction_dtype(geometry, lhs_dtype, rhs_dtype):
  """The dtype partial sums are summed across devices in: the output dtype, as XLA's
  own program sums them on TPU; on CPU the accumulation dtype, because XLA's CPU
  compiler sums bf16 / f16 partials in float32 (it promotes those all-reduces and keeps
  the dot's float32 result unrounded until then). Rounding the partials first made bf16
  results drift from plain jit's on CPU (a cancelling loss off by 22 %)."""
  out = result_dtype(geometry, lhs_dtype, rhs_dtype)
  if target_platform() == "cpu":
    return jnp.promote_types(out, accumulation_dtype(geometry, lhs_dtype, rhs_dtype))
  return out


def local_dot(geometry, lhs, rhs, dtype, *, dimension_numbers=None):
  """The geometry's dot_general of two local pieces, with a `dtype` result
  (`dimension_numbers`: instead of the geometry's, for operands reshaped to fit)."""
  if (target_platform() == "cpu" and jnp.dtype(dtype).itemsize > lhs.dtype.itemsize
      and jnp.issubdtype(lhs.dtype, jnp.floating)):
    # XLA's CPU runtime cannot run some bf16 x bf16 -> f32 dots ("Unsupported element
    # type for DotThunk"); widening the operands first computes the same products.
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
  return lax.dot_general(lhs, rhs, dimension_numbers or geometry.dimension_numbers,
                         precision=geometry.precision, preferred_element_type=dtype)


def finish(geometry, out, lhs, rhs):
  """The local output `out` as the original dot_general returns it: summed over
  `geometry.reduce_axes` (in `reduction_dtype`), then cast to `result_dtype`."""
  if geometry.reduce_axes:
    out = lax.psum(out.astype(reduction_dtype(geometry, lhs.dtype, rhs.dtype)),
                   geometry.reduce_axes)
  return out.astype(result_dtype(geometry, lhs.dtype, rhs.dtype))
