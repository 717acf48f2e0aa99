"""The JAX structure the rewrites read beyond JAX's documented API, one named helper each.

The pass keeps its own in `meshslice_pass/_jax_internals.py`; the rewrites must not import
the pass, so theirs live here. If a JAX upgrade moves one of these, this is the only
module of the rewrites to change.
"""
from __future__ import annotations


def varying_axes(aval) -> tuple[str, ...]:
  """The mesh axes a value traced inside a shard_map varies over, sorted: the manual axis
  type of its abstract value (e.g. of what `jax.eval_shape` returns there)."""
  return tuple(sorted(aval.manual_axis_type.varying))


def abstract_device(mesh):
  """The device an AbstractMesh was built for (its platform names the compiler the
  program is for), or None when the mesh names none."""
  return getattr(mesh, "abstract_device", None)
