"""The bridge from a planned site to the cost model: describe it as a `GemmProblem`
(`problem_for`) on the profile of its mesh axes (`site_profile`), with the dataflow the
model prices (`model_dataflow`), and price resharding an operand (`reshard_seconds`).

The rule that picks the plan, with the predictions it ranks, lives in the cost model
(`meshslice.costmodel.site_choice`, beside the autotuner's rule, which differs): predict
candidate plans (re-priced with the profile's TPU compiler terms when it has them), keep
the fewest slices within NEAR_TIE of the fastest (`choose`), and leave the site to XLA's
own program unless the plan beats it by more than XLA_MARGIN (`xla_program`,
`leave_to_xla`). Those names are re-exported here, where the planner calls them.

What enters is data: the site's shapes, dtypes and layouts (the program), the mesh's
axis sizes and, for a concrete mesh, its devices' TPU slices (`site_profile`), the
hardware profile, and the options, among them the compiler flags
(`Options.compiler_flags`: the planner hands `xla_program` the collectives they keep out
of windowed einsum or offload to the SparseCore). Nothing here times anything or reads
the environment, so the choice is a function of (program, mesh, options, profile).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from meshslice import costmodel
# the plan-choice rule's names, at their old home (the planner, tests and benches use them)
from meshslice.costmodel.site_choice import (  # noqa: F401
    EMITTABLE, NEAR_TIE, NO_PLAN_FITS, XLA_MARGIN, PlanChoice, choose, leave_to_xla, predict,
    xla_program)
from meshslice.costmodel.timing import copy_time, permute_time

# Candidates tried in this order; a later one must be strictly faster to win, so ties go
# to the simpler algorithm and the smaller ksplit. The cost model's default candidates
# (`site_choice.EMITTABLE`), one tuple: the autotuner ranks what the pass chooses among.
AUTO_ALGORITHMS = EMITTABLE


def model_dataflow(dataflow: str) -> str:
  """The cost model predicts 1D sites as the 2D formulas with one axis of size 1 ("rs"),
  with M standing for whichever free dim the site communicates (see `problem_for`)."""
  return "rs" if dataflow.startswith("1d") else dataflow


def site_profile(profile, geometry, axis_sizes, devices=None):
  """`profile` with its dim 0 / dim 1 derived for this site's mesh axes (row, col; or the
  one axis of a 1D site) from the profile's topology and the mesh's device order. A
  profile without a topology, or a mesh bigger than its network, comes back unchanged.

  devices: the concrete mesh's device grid (`Mesh.devices`), or None (an AbstractMesh).
  With it, a mesh axis whose devices lie on several TPU slices (their `slice_index`)
  gets the data-centre network's figures (`costmodel.topology.profile_for_devices`).

  Example:
    >>> from meshslice.costmodel import load_profile
    >>> from meshslice.rewrites import OneDGeometry
    >>> g = OneDGeometry(dimension_numbers=(((1,), (0,)), ((), ())), kind="all_gather",
    ...                  axis="y", axis_size=8, lhs_dim=0, rhs_dim=None, out_dim=0,
    ...                  global_extent=64)
    >>> site_profile(load_profile("tpu-v4"), g, {"x": 32, "y": 8}).name
    'tpu-v4@32x8'
  """
  if getattr(profile, "topology", None) is None or len(axis_sizes) < 2:
    return profile
  order = list(axis_sizes)
  axes = ((geometry.axis,) * 2 if _one_d(geometry) else (geometry.row_axis, geometry.col_axis))
  if any(a is None for a in axes):     # OS with one axis absent: both dims are that axis
    axes = (next(a for a in axes if a is not None),) * 2
  axes = tuple(order.index(a) for a in axes)
  try:
    if devices is not None:
      return costmodel.topology.profile_for_devices(profile, devices, axes=axes)
    return costmodel.profile_for_mesh(profile, tuple(axis_sizes.values()), axes=axes)
  except ValueError:
    return profile


def _one_d(geometry) -> bool:
  return not hasattr(geometry, "row_axis")


def problem_for(geometry, lhs_shape, rhs_shape, lhs_spec, rhs_spec, lhs_dtype, out_dtype,
                axis_sizes, profile=None) -> costmodel.GemmProblem:
  """The site as the cost model sees it. Dims split over extra mesh axes (data, fsdp)
  shrink the per-device problem without any communication, so they divide the sizes."""
  (lc, rc), (lb, rb) = geometry.dimension_numbers
  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  one_d = _one_d(geometry)
  tp = {geometry.axis} if one_d else {geometry.row_axis, geometry.col_axis}

  def size(shape, spec, dims):
    total = 1
    for d in dims:
      extra = math.prod(axis_sizes[a] for a in spec[d] if a not in tp)
      total *= shape[d] // extra
    return total

  sizes = dict(m=size(lhs_shape, lhs_spec, lf), n=size(rhs_shape, rhs_spec, rf),
               k=size(lhs_shape, lhs_spec, lc), batch=size(lhs_shape, lhs_spec, lb),
               in_bytes=jnp.dtype(lhs_dtype).itemsize, out_bytes=jnp.dtype(out_dtype).itemsize)
  mesh_order = list(axis_sizes)
  # a profile from `site_profile` already has dim 0 = row axis, dim 1 = col axis
  derived = getattr(profile, "topology", None) is not None and len(axis_sizes) >= 2
  if one_d:
    # The 1D model communicates M ("rs" with one axis of size 1). When the emitted code
    # moves an rhs free dim instead (a gathered weight, partial sums scattered along N),
    # the same product with M and N exchanged is the one that is emitted.
    if _moves_rhs_free_dim(geometry, len(lb), len(lf)):
      sizes["m"], sizes["n"] = sizes["n"], sizes["m"]
    # an all-reduce site psums its partial sums: both halves of the all-reduce are priced
    collective = "all_reduce" if getattr(geometry, "all_reduce", False) else geometry.kind
    return costmodel.GemmProblem.one_d(
        size=geometry.axis_size, collective=collective,
        profile_dim=0 if derived else min(mesh_order.index(geometry.axis), 1), **sizes)
  position = lambda axis: mesh_order.index(axis) if axis in mesh_order else len(mesh_order)
  row_first = derived or position(geometry.row_axis) < position(geometry.col_axis)
  return costmodel.GemmProblem(
      rows=geometry.row_size, cols=geometry.col_size,
      row_profile_dim=0 if row_first else 1, col_profile_dim=1 if row_first else 0, **sizes)


def _moves_rhs_free_dim(geometry, n_batch, n_lhs_free) -> bool:
  if geometry.kind == "all_gather":
    return geometry.lhs_dim is None
  return geometry.out_dim >= n_batch + n_lhs_free


def reshard_seconds(shape, dtype, new_spec, axis_sizes, profile) -> float:
  """Predicted time to reshard an operand into `new_spec` before a site, priced
  conservatively: a reshard that swaps which axis splits which dim is an all-to-all over
  the whole mesh, so every device's shard crosses both mesh dims, and is packed and
  unpacked in memory on the way (the TPU compiler emits relayout copies for it)."""
  devices = math.prod(axis_sizes[a] for entry in new_spec for a in entry)
  nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize / devices
  return (sum(permute_time(profile, dim, nbytes) for dim in (0, 1))
          + 2 * copy_time(profile, nbytes))


# The old name, kept for importers; PlanChoice tells it apart from costmodel.autotune.Choice.
Choice = PlanChoice
