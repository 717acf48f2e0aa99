"""Multi-slice TPU meshes: the cost model reads which mesh axes cross slices from the
devices libtpu describes (compile-only topology with num_slices > 1; needs libtpu)."""
import pytest

from meshslice import aot
from meshslice.costmodel import load_profile, topology

pytestmark = pytest.mark.skipif(not aot.have_libtpu(), reason="needs libtpu")


def test_devices_of_two_v4_slices_put_the_dcn_on_the_axis_that_crosses_them():
  from jax.experimental import mesh_utils
  devices = aot.topology("v4:2x2x2", num_slices=2).devices
  assert sorted({d.slice_index for d in devices}) == [0, 1]
  v4 = load_profile("tpu-v4")
  # JAX's own hybrid layout: slices along the first axis, or along the second
  rows = mesh_utils.create_hybrid_device_mesh((2, 4), (2, 1), devices)
  cols = mesh_utils.create_hybrid_device_mesh((4, 2), (1, 2), devices)
  assert topology.dcn_shape_of(rows) == (2, 1) and topology.dcn_shape_of(cols) == (1, 2)
  across_rows = topology.profile_for_devices(v4, rows)
  across_cols = topology.profile_for_devices(v4, cols)
  dcn = v4.topology.dcn_bandwidth
  assert across_rows.all_gather.bandwidth[0] == dcn != across_rows.all_gather.bandwidth[1]
  assert across_cols.all_gather.bandwidth[1] == dcn != across_cols.all_gather.bandwidth[0]
  # inside a slice the axis gets the 8-chip slice's ICI figure (2x2x2: lines)
  assert across_rows.all_gather.bandwidth[1] == \
      topology.profile_for_mesh(v4, (2, 4)).all_gather.bandwidth[1]
  # aot.make_mesh on a 2-slice topology orders slice 0's devices first
  mesh = aot.make_mesh(aot.topology("v4:2x2x2", num_slices=2), (4, 4))
  assert topology.profile_for_devices(v4, mesh.devices).name == "tpu-v4@4x4/2slices"
