"""How a partial product is reduce-scattered over one mesh axis: one reduce-scatter
collective, or an all-to-all followed by a local sum.

The two compute the same thing (the sum of the n devices' partials, piece i on device
i). They differ in what the compiler does with them: on TPU v4 libtpu keeps every
reduce-scatter synchronous, while an all-to-all becomes an async start/done pair under
`--xla_tpu_enable_async_all_to_all=true`, so it can hide under independent compute (a
weight gradient's reduce-scatter, under the rest of the backward pass). The all-to-all
form pays a local sum of the n pieces. docs/tpu.md has the measurements.

Example:
  >>> SCATTER_FORMS
  ('reduce_scatter', 'all_to_all')
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

SCATTER_FORMS = ("reduce_scatter", "all_to_all")


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
  return jnp.sum(received, axis=dim, dtype=x.dtype)
