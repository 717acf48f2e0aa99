"""The routed link model (meshslice.costmodel.routed_links): collectives routed over the
directed links of the torus, the busiest link setting the time.

Hand-checked figures use the model's defaults: one link moves L = 45e9 B/s one way (the
tpu-v4 profile's topology.link_bandwidth), 10 us per collective, 1 us per hop of each
step's longest route.
"""
import json
import os
import subprocess
import sys

import pytest

from meshslice.costmodel import hlo_text, load_profile
from meshslice.costmodel import routed_links as rl
from meshslice.costmodel import tpu_schedule as ts

US = 1e-6
MiB = 1 << 20
L = 45e9


def _op(kind, group, nbytes, **kw):
  return ts.CompiledOp(name=kind, opcode=kind, kind="collective", collective=kind,
                       group=tuple(group), bytes=nbytes, **kw)


def _ring_model(n, wrap=True, **kw):
  """n chips along one torus dim of n, partition i on chip i."""
  return rl.RoutedLinks([(i,) for i in range(n)], "tpu-v4",
                        torus=rl.Torus(shape=(n,), wrap=(wrap,)), **kw)


# ------------------------------------------------- rings

def test_ring_of_neighbours_on_one_torus_dim():
  # 4 chips round a dim of 4 with wraparound; all-gather of an 8 MiB result (2 MiB a
  # member): 3 steps, each sending half a shard (1 MiB) each way round, one hop, so
  # every one of the 8 directed links carries 3 x 1 MiB
  model = _ring_model(4)
  r = model.route(_op("all-gather", range(4), 8 * MiB))
  assert r.algorithm == "ring" and r.hop_steps == 3
  assert len(r.loads) == 8 and set(r.loads.values()) == {3 * MiB}
  assert r.seconds == pytest.approx(10 * US + 3 * US + 3 * MiB / L)      # 82.9 us
  assert model.seconds(_op("all-gather", range(4), 8 * MiB)) == r.seconds
  # a reduce-scatter of a 2 MiB result moves the same (its operand is 4 shards);
  # an all-reduce of 8 MiB is a reduce-scatter then an all-gather: twice the bytes, hops
  rs = model.route(_op("reduce-scatter", range(4), 2 * MiB))
  assert rs.busiest_bytes == 3 * MiB and rs.hop_steps == 3
  ar = model.route(_op("all-reduce", range(4), 8 * MiB))
  assert ar.busiest_bytes == 6 * MiB and ar.hop_steps == 6
  assert ar.seconds == pytest.approx(10 * US + 6 * US + 6 * MiB / L)


def test_ring_on_a_line_doubles_the_link_load():
  # the same 4 chips without wraparound: the closing hop 3 -> 0 travels back over all
  # three links, so every directed link carries a whole chunk per step, not half
  r = _ring_model(4, wrap=False).route(_op("all-gather", range(4), 8 * MiB))
  assert set(r.loads.values()) == {6 * MiB}
  assert r.hop_steps == 3 * 3                          # the longest route: 3 hops
  assert r.seconds == pytest.approx(10 * US + 9 * US + 6 * MiB / L)


def test_ring_whose_neighbours_are_two_hops_apart():
  # 4 members on chips 0, 2, 4, 6 of a torus dim of 8: every step's route is 2 hops,
  # but no two routes share a link: the load is that of neighbours, the hops double
  model = rl.RoutedLinks([(0,), (2,), (4,), (6,)], "tpu-v4",
                         torus=rl.Torus(shape=(8,), wrap=(True,)))
  r = model.route(_op("all-gather", range(4), 8 * MiB))
  assert len(r.loads) == 16 and set(r.loads.values()) == {3 * MiB}
  assert r.hop_steps == 3 * 2
  assert r.seconds == pytest.approx(10 * US + 6 * US + 3 * MiB / L)
  # ring order 0, 2, 1, 3 on a line of 4 chips: the routes 0 -> 2, 1 -> 3 (and back)
  # both cross the middle link 1 <-> 2: it carries twice what the others do
  model = rl.RoutedLinks([(0,), (2,), (1,), (3,)], "tpu-v4",
                         torus=rl.Torus(shape=(4,), wrap=(False,)))
  r = model.route(_op("all-gather", range(4), 8 * MiB))
  chunk = 2 * MiB                                    # the shard each step moves
  middle = {((1,), 0, 1), ((2,), 0, -1)}
  assert {link: load / (3 * chunk) for link, load in r.loads.items()} == {
      **{link: 2.0 for link in middle},
      ((0,), 0, 1): 1.0, ((2,), 0, 1): 1.0, ((1,), 0, -1): 1.0, ((3,), 0, -1): 1.0}
  assert r.busiest_bytes == 6 * chunk and r.busiest_link in middle
  assert r.hop_steps == 3 * 3                        # 3 -> 0: three hops back


def test_nd_emitter_splits_the_gather_over_both_dims():
  # a 4-chip group on a 2x2 plane (no wraparound on dims of 2), listed as a mesh axis
  # over two torus dims is: (0,0), (0,1), (1,0), (1,1). One ring in that order: 1 or 2
  # hops a step, the busiest link a whole shard a step (3 shards). libtpu's
  # "2DAllGatherOnMajorDim" (ring_dims 2) gathers half the data along dim 0 then dim 1,
  # half the other way round: each link carries 1/2 + 1 = 1.5 shards in 2 phases of 1 hop
  coords = [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
  model = rl.RoutedLinks(coords, "tpu-v4")
  assert model.placement.torus == rl.Torus(shape=(2, 2, 1), wrap=(False, False, False))
  shard = 2 * MiB
  one = model.route(_op("all-gather", range(4), 4 * shard))
  assert one.algorithm == "ring" and one.busiest_bytes == 3 * shard and one.hop_steps == 6
  nd = model.route(_op("all-gather", range(4), 4 * shard, ring_dims=2))
  assert nd.algorithm == "nd-ring" and nd.hop_steps == 2
  assert len(nd.loads) == 8 and set(nd.loads.values()) == {1.5 * shard}
  assert nd.seconds == pytest.approx(10 * US + 2 * US + 1.5 * shard / L)
  # use_emitter=False: always the one ring
  plain = rl.RoutedLinks(coords, "tpu-v4", use_emitter=False)
  assert plain.route(_op("all-gather", range(4), 4 * shard, ring_dims=2)) == one


# ------------------------------------------------- all-to-all, permute, cores

@pytest.mark.parametrize("n, factor", [(4, 4 / 3), (8, 16 / 7)])
def test_all_to_all_costs_its_routed_load_over_a_ring_reduce_scatter(n, factor):
  # each member sends a chunk c to each other member, the shorter way round (a tie:
  # half each way); per directed link that is c * sum(min(d, n - d)) / 2, against
  # (n - 1) c / 2 for a ring reduce-scatter of a c-byte result (DESIGN.md, 2026-12)
  c = MiB
  model = _ring_model(n)
  rs = model.route(_op("reduce-scatter", range(n), c))
  a2a = model.route(_op("all-to-all", range(n), n * c))
  assert rs.busiest_bytes == (n - 1) * c / 2
  assert a2a.busiest_bytes == pytest.approx(c * sum(min(d, n - d) for d in range(n)) / 2)
  assert a2a.busiest_bytes / rs.busiest_bytes == pytest.approx(factor)
  assert a2a.algorithm == "all-to-all" and a2a.hop_steps == n // 2    # the farthest pair


def test_collective_permute_routes_each_pair():
  b = 4 * MiB
  model = _ring_model(4)
  # a shift by one round the ring: each forward link carries one transfer
  shift = model.route(_op("collective-permute", (0, 1), b,
                          pairs=((0, 1), (1, 2), (2, 3), (3, 0))))
  assert shift.loads == {((i,), 0, 1): b for i in range(4)}
  assert shift.seconds == pytest.approx(10 * US + 1 * US + b / L)
  # a shift by two: a tie, half of each transfer each way, 2 hops
  half = model.route(_op("collective-permute", (0, 2), b,
                         pairs=((0, 2), (1, 3), (2, 0), (3, 1))))
  assert len(half.loads) == 8 and set(half.loads.values()) == {b}
  assert half.hop_steps == 2
  # one pair on a 3D slice: dim 0 first, then dim 1
  model = rl.RoutedLinks([(0, 0, 0), (1, 1, 0)], "tpu-v4")
  pair = model.route(_op("collective-permute", (0, 1), b, pairs=((0, 1),)))
  assert pair.loads == {((0, 0, 0), 0, 1): b, ((1, 0, 0), 1, 1): b}
  assert pair.seconds == pytest.approx(10 * US + 2 * US + b / L)


def test_two_cores_of_a_chip_exchange_for_free():
  # TPU7x-like: two devices a chip (equal coords, core 0 and 1), chips 0 and 1 on a line
  devices = [((0, 0, 0), 0), ((0, 0, 0), 1), ((1, 0, 0), 0), ((1, 0, 0), 1)]
  model = rl.RoutedLinks(devices, "tpu-v4")
  assert model.placement.cores == (0, 1, 0, 1)
  on_chip = model.route(_op("collective-permute", (0, 1), MiB, pairs=((0, 1), (1, 0))))
  assert on_chip.loads == {} and on_chip.hop_steps == 0
  assert on_chip.seconds == pytest.approx(10 * US)
  # an all-gather over both chips (1 MiB shards): the cores of a chip pair up on-chip,
  # so the chips exchange once, core 0 with core 0 and core 1 with core 1, both over the
  # one link each way: 2 shards a link, one step of one hop
  ag = _op("all-gather", range(4), 4 * MiB)
  r = model.route(ag)
  assert r.algorithm == "nd-ring" and r.hop_steps == 1
  assert r.loads == {((0, 0, 0), 0, 1): 2 * MiB, ((1, 0, 0), 0, -1): 2 * MiB}
  # one ring in group order 0, 1, 2, 3 instead: two of its four hops are on-chip; the
  # link each way carries a whole shard a step (1 -> 2 and 0 -> 3 one way, 3 -> 0 and
  # 2 -> 1 the other, half a shard each), 3 steps
  r = rl.RoutedLinks(devices, "tpu-v4", use_emitter=False).route(ag)
  assert r.algorithm == "ring" and r.hop_steps == 3
  assert r.loads == {((0, 0, 0), 0, 1): 3 * MiB, ((1, 0, 0), 0, -1): 3 * MiB}


def test_partitions_without_a_device_are_refused():
  with pytest.raises(ValueError, match="partition 4 has no device"):
    _ring_model(4).route(_op("all-gather", (0, 4), MiB))
  with pytest.raises(ValueError, match="pass link_bandwidth="):
    rl.RoutedLinks([(0,), (1,)], "cpu")


# ------------------------------------------------- reading groups, the simulator hook

_TEXT = """
HloModule m, is_scheduled=true, num_partitions=8
ENTRY %main (p: bf16[1024,1024]) -> bf16[1024,1024] {
  %p = bf16[1024,1024]{1,0} parameter(0)
  %ag = bf16[4096,1024]{1,0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %f = bf16[1024,1024]{1,0} fusion(%ag), kind=kOutput, calls=%c, backend_config={"estimated_cycles":"1050000"}
}"""  # noqa: E501


def test_every_replica_group_is_read():
  assert hlo_text.replica_groups("replica_groups=[2,4]<=[8]", 8) == ((0, 1, 2, 3),
                                                                      (4, 5, 6, 7))
  assert hlo_text.replica_groups("replica_groups=mesh['x'=2,'y'=4] {'x'}", 8) == (
      (0, 4), (1, 5), (2, 6), (3, 7))
  a2a = ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=64], "
         "device_ids=([4,16,4]T(0,2,1)) {'axis_2':(4)16}")
  groups = hlo_text.replica_groups(a2a, 256)
  assert groups[0] == hlo_text.replica_group(a2a, 256) and len(groups) == 16
  assert sorted(p for g in groups for p in g) == list(range(256))
  ag, = [op for op in ts.read_schedule(_TEXT).expanded() if op.collective]
  assert ag.group == (0, 1, 2, 3) and ag.groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_simulate_takes_the_collective_time_and_names_the_model():
  default = ts.simulate(_TEXT, "tpu-v4")
  assert default.model == "alpha-beta"
  assert default.step_s == pytest.approx(1e-3 + ts.collective_seconds(
      ts.read_schedule(_TEXT).entries[1], load_profile("tpu-v4")))
  fixed = ts.simulate(_TEXT, "tpu-v4", collective_time=lambda op: 0.5e-3)
  assert fixed.model == "custom" and fixed.step_s == pytest.approx(1.5e-3)
  # the routed model: the two groups on two rings of 4 chips (a 4x2 slice, wraparound
  # given), each link carrying 3 x 1 MiB as in the first test
  devices = [(x, y) for y in range(2) for x in range(4)]
  routed = rl.simulate_routed(_TEXT, devices, "tpu-v4",
                              torus=rl.Torus(shape=(4, 2), wrap=(True, False)))
  assert routed.model == rl.MODEL == "routed-links" and routed.profile == "tpu-v4"
  assert routed.step_s == pytest.approx(1e-3 + 10 * US + 3 * US + 3 * MiB / L)
  hooked = ts.simulate(_TEXT, "tpu-v4", collective_time=rl.RoutedLinks(
      devices, "tpu-v4", torus=rl.Torus(shape=(4, 2), wrap=(True, False))).seconds,
      model=rl.MODEL)
  assert hooked == routed
  with pytest.raises(ValueError, match="8 partitions but 4 devices"):
    rl.simulate_routed(_TEXT, devices[:4], "tpu-v4")


# ------------------------------------------------- a compiled program

# v4:2x2x2 (8 chips, no wraparound on dims of 2) as a 2x4 mesh: `a @ b` with a split
# over (x, y) and b over y's columns gathers a's 2 MiB shards over y (8 MiB result).
# Compiled on make_mesh's mesh (y spans torus dims 0 and 1: a 2x2 plane) and on a mesh
# of the same chips whose y groups are pairwise two hops apart.
_SCRIPT = """
import json
import numpy as np
from meshslice import aot
from meshslice.costmodel import load_profile, profile_for_mesh
from meshslice.costmodel import routed_links as rl, tpu_schedule as ts
import jax, jax.numpy as jnp
jax.config.update("jax_platforms", "cpu")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
topo = aot.topology("v4:2x2x2")
meshes = {"plane": aot.make_mesh(topo, (2, 4)),
          "spread": Mesh(np.array(topo.devices)[[0, 3, 5, 6, 1, 2, 4, 7]].reshape(2, 4),
                         ("x", "y"))}
base = load_profile("tpu-v4")
prof, dims = profile_for_mesh(base, (2, 4)), ts.axis_torus_dims(base, (2, 4))
out = {}
for name, mesh in meshes.items():
  f = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P("x", "y")))
  sh = lambda s, p: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
  c, _ = aot.compile(f, sh((2048, 4096), P("x", "y")), sh((4096, 4096), P(None, "y")),
                     mesh=mesh)
  listed = getattr(getattr(c._executable, "_unloaded_executable", None), "device_list", None)
  schedule = ts.read_schedule(c.as_text())
  ops = [op for op in schedule.expanded() if op.collective]
  routed = rl.RoutedLinks(mesh, "tpu-v4")
  out[name] = {
      "assignment": None if listed is None else [d.id for d in listed],
      "mesh": [d.id for d in mesh.devices.flat],
      "ops": [[op.collective, op.bytes, op.groups, op.ring_dims] for op in ops],
      "routed": [[r.algorithm, r.busiest_bytes, r.hop_steps, r.seconds]
                 for r in map(routed.route, ops)],
      "alpha_beta": ts.simulate(schedule, prof, axis_dims=dims, clock_hz=1.05e9).step_s,
      "routed_step": rl.simulate_routed(schedule, mesh, "tpu-v4").step_s,
      "compute": ts.simulate(schedule, base).compute_s,
      "other_devices": rl.simulate_routed(
          schedule, meshes["spread" if name == "plane" else "plane"], "tpu-v4").step_s}
print("RESULT " + json.dumps(out))
"""


def test_compiled_program_under_both_models():
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                       env=env, timeout=300)
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, out.stderr[-3000:]
  got = json.loads(line[0][len("RESULT "):])
  plane, spread = got["plane"], got["spread"]
  for run in (plane, spread):
    # partition i is the mesh's i-th device: the compiled device assignment says so
    if run["assignment"] is not None:
      assert run["assignment"] == run["mesh"]
    (kind, nbytes, groups, _), = run["ops"]
    assert (kind, nbytes, groups) == ("all-gather", 8 * MiB, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert run["alpha_beta"] > run["compute"] > 0 and run["routed_step"] > run["compute"]
  # the plane: libtpu's 2D emitter, 1.5 shards (2 MiB) on the busiest link, 2 hops
  assert plane["ops"][0][3] == 2
  assert plane["routed"] == [["nd-ring", 3 * MiB, 2, pytest.approx(12 * US + 3 * MiB / L)]]
  # spread: a 1D emitter; the ring's neighbours are two hops apart and share links
  assert spread["ops"][0][3] == 1
  assert spread["routed"] == [["ring", 6 * MiB, 6, pytest.approx(16 * US + 6 * MiB / L)]]
  # the same program on other chips is another routed step (the alpha-beta model,
  # which knows only the mesh shape, cannot tell them apart)
  assert plane["other_devices"] > plane["routed_step"]
  assert plane["routed_step"] == pytest.approx(plane["compute"] + 12 * US + 3 * MiB / L)
