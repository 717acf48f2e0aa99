"""Per-mesh-axis bandwidths from the interconnect's geometry (costmodel.topology). No JAX
needed."""
import dataclasses

import pytest

from meshslice.costmodel import autotune, timing, topology
from meshslice.costmodel.autotune import evaluate_mesh, mesh_shapes
from meshslice.costmodel.profiles import load_profile
from meshslice.costmodel.timing import GemmProblem

from test_costmodel import PROF, _pair, approx


def test_axis_assignment_matches_create_device_mesh():
  np = pytest.importorskip("numpy")
  try:   # the routine behind jax.experimental.mesh_utils.create_device_mesh on TPU
    from jax._src.mesh_utils import _create_device_mesh_for_nd_torus as torus_mesh
  except ImportError:
    pytest.skip("this jax has no _create_device_mesh_for_nd_torus")
  t = load_profile("tpu-v4").topology
  for chips in (64, 256, 1024):
    shape = topology.physical_shape(t, chips)
    for mesh in mesh_shapes(chips):
      _, a = torus_mesh(np.arange(chips).reshape(shape), mesh, allow_split_physical_axes=True)
      theirs = tuple(tuple(p for p in range(len(shape)) if a[p, axis] > 1)
                     for axis in range(len(mesh)))
      assert topology.assign_axes(t, mesh) == theirs, (chips, mesh)


def test_per_axis_bandwidth_from_the_torus_by_hand():
  v4 = load_profile("tpu-v4")
  assert topology.physical_shape(v4.topology, 256) == (8, 8, 4)
  # (32, 8): row axis on the 8 x 4 plane (two wrap-around dims, 4 links), column axis on
  # one 8-long torus dim (2 links); link 4.5e10 B/s one way
  p = topology.profile_for_mesh(v4, (32, 8))
  assert p.all_gather.bandwidth == (approx(0.886 * 4 * 4.5e10), approx(0.886 * 2 * 4.5e10))
  assert p.reduce_scatter.bandwidth == (approx(0.702 * 4 * 4.5e10),
                                        approx(0.702 * 2 * 4.5e10))
  assert p.permute.bandwidth == (approx(0.783 * 4.5e10), approx(0.783 * 4.5e10))
  # swapping the mesh axes swaps the bandwidths
  q = topology.profile_for_mesh(v4, (8, 32))
  assert q.all_gather.bandwidth == (p.all_gather.bandwidth[1], p.all_gather.bandwidth[0])
  # latencies and overheads are kept
  assert p.all_gather.hop_latency == v4.all_gather.hop_latency
  # (16, 16) needs a physical dim split between the axes: the split dim is a line
  assert topology.describe_axes(v4, (16, 16)) == ("8 (split) line x 4 torus",
                                                  "8 torus x 8 (split) line")
  s = topology.profile_for_mesh(v4, (16, 16))
  assert s.all_gather.bandwidth == _pair(approx(0.886 * 3 * 4.5e10))
  assert s.permute.bandwidth == _pair(approx(0.783 * 4.5e10 / 2))
  # a slice smaller than a 4x4x4 cube has no wrap-around: every dim is a line
  # (the last mesh axis is placed first and prefers more physical dims)
  assert topology.describe_axes(v4, (4, 4)) == ("4 line", "2 line x 2 line")
  # the other way of asking for the axes: a 3-axis mesh, axes 1 and 2
  assert topology.profile_for_mesh(v4, (1, 32, 8), axes=(1, 2)).all_gather == p.all_gather
  # no topology, or a paper profile: unchanged
  assert topology.profile_for_mesh(PROF, (32, 8)) is PROF
  assert autotune.paper_assumptions().topology is None


def test_islands_and_network_limits():
  h = load_profile("h100")
  assert topology.describe_axes(h, (4, 8)) == ("across nodes", "inside a node")
  assert topology.describe_axes(h, (8, 4)) == ("across nodes", "inside a node")
  assert topology.describe_axes(h, (2, 16)) == ("across nodes", "across nodes")
  inside = topology.profile_for_mesh(h, (16, 8))
  assert inside.all_gather.bandwidth == h.all_gather.bandwidth     # (IB, NVLink)
  across = topology.profile_for_mesh(h, (8, 16))
  assert across.all_gather.bandwidth == _pair(h.all_gather.bandwidth[0])
  assert across.all_gather.hop_latency == _pair(h.all_gather.hop_latency[0])
  # one v5e pod holds 256 chips; more would need the data-centre network
  with pytest.raises(ValueError, match="tpu-v5e: 1024 chips exceed one network of 256"):
    topology.profile_for_mesh(load_profile("tpu-v5e"), (32, 32))
  r = evaluate_mesh("gpt3", 1024, (32, 32), "tpu-v5e", check_memory=False)
  assert r.reason.startswith("topology: tpu-v5e: 1024 chips exceed")
  assert evaluate_mesh("gpt3", 1024, (32, 32), "tpu-v5e", check_memory=False,
                       topology=False).feasible


def test_an_axis_across_slices_gets_the_dcn_figures():
  v4 = load_profile("tpu-v4")
  one = topology.profile_for_mesh(v4, (32, 8))                       # one 256-chip slice
  two = topology.profile_for_mesh(v4, (64, 8), dcn_shape=(2, 1))     # two of them
  assert two.name == "tpu-v4@64x8/2slices"
  for kind in ("all_gather", "reduce_scatter", "permute"):
    c = two.collective(kind)
    assert c.bandwidth[0] == v4.topology.dcn_bandwidth == 6.25e9
    assert c.hop_latency[0] == v4.topology.dcn_latency
    # the column axis stays inside each slice: the same as on one slice
    assert c.bandwidth[1] == one.collective(kind).bandwidth[1]
    assert c.hop_latency[1] == one.collective(kind).hop_latency[1]
  # slices along the column axis instead: the row axis keeps its ICI figure
  cols = topology.profile_for_mesh(v4, (32, 16), dcn_shape=(1, 2))
  assert cols.all_gather.bandwidth == (one.all_gather.bandwidth[0], 6.25e9)
  # the same site is slower when its row axis crosses the DCN
  p = GemmProblem(m=65536, n=12288, k=12288, rows=64, cols=8)
  assert timing.predict(p, "collective", "os", 1, two).comm_s > \
      5 * timing.predict(p, "collective", "os", 1, topology.profile_for_mesh(v4, (64, 8))).comm_s
  # v5e: 512 chips do not fit one pod, but do as two 256-chip slices
  v5e = load_profile("tpu-v5e")
  with pytest.raises(ValueError, match="need dcn_shape"):
    topology.profile_for_mesh(v5e, (32, 16))
  assert topology.profile_for_mesh(v5e, (32, 16), dcn_shape=(2, 1)).all_gather.bandwidth[0] \
      == 3.125e9
  with pytest.raises(ValueError, match="must give, per mesh axis"):
    topology.profile_for_mesh(v4, (6, 8), dcn_shape=(4, 1))
  no_dcn = dataclasses.replace(v4, topology=dataclasses.replace(v4.topology, dcn_bandwidth=0.0))
  with pytest.raises(ValueError, match="no DCN bandwidth"):
    topology.profile_for_mesh(no_dcn, (64, 8), dcn_shape=(2, 1))
  assert topology.profile_for_mesh(no_dcn, (32, 8), dcn_shape=(1, 1)).all_gather == \
      one.all_gather


def test_slices_per_axis_from_the_devices():
  import types

  import numpy as np
  dev = lambda s: types.SimpleNamespace(slice_index=s)
  # 2 slices stacked along axis 0 (how create_hybrid_device_mesh with (2, 1) lays them)
  grid = np.array([[dev(0)] * 8] * 32 + [[dev(1)] * 8] * 32, dtype=object)
  assert topology.dcn_shape_of(grid) == (2, 1)
  assert topology.dcn_shape_of(grid.T) == (1, 2)
  v4 = load_profile("tpu-v4")
  assert topology.profile_for_devices(v4, grid) == \
      topology.profile_for_mesh(v4, (64, 8), dcn_shape=(2, 1))
  # no slice_index (one slice, CPU or GPU devices): nothing crosses slices
  plain = np.array([[object()] * 8] * 32, dtype=object)
  assert topology.dcn_shape_of(plain) == (1, 1)
  assert topology.profile_for_devices(v4, plain) == topology.profile_for_mesh(v4, (32, 8))
