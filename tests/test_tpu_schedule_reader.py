"""The TPU schedule reader (meshslice.costmodel.tpu_schedule) on what libtpu really emits:
continuation fusions carrying compute, collective-permutes in either direction, the
collective algorithm libtpu chose (its emitter / strategy), mesh-axes replica groups with
device_ids, and libtpu's own latency-hiding-scheduler totals and peak memory.

The HLO snippets are trimmed from programs compiled with libtpu 0.0.42 (jax 0.10.2) for
v4:2x2x2 and v4:4x4x4; the backend-config strings are verbatim. Hand-checked figures use
the shipped tpu-v4 profile (costmodel/profiles/tpu-v4.json): all-gather on profile dim 1:
79.751e9 B/s, 5 us per hop, 13 us base; send/recv: dim 0 38.801e9 B/s, dim 1 35.224e9,
50 us per hop, 13 us base; clock 1.05 GHz (105000 cycles = 100 us).
"""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from meshslice.costmodel import hlo_text, load_profile, profile_for_mesh
from meshslice.costmodel import tpu_schedule as ts
from meshslice.costmodel.timing import all_reduce_time

US = 1e-6
MiB2 = 1024 * 1024 * 2                      # a bf16[1024,1024] block
L = "{1,0:T(8,128)(2,1)}"                  # the usual bf16 tiled layout
AG4 = 13 * US + 3 * MiB2 / 79.751e9 + 3 * 5 * US      # all-gather, 4 x 2 MiB, dim 1
CP0 = 13 * US + MiB2 / 38.801e9 + 50 * US             # permute of 2 MiB on dim 0
CP1 = 13 * US + MiB2 / 35.224e9 + 50 * US             # permute of 2 MiB on dim 1


def _module(entry: str, *computations: str, partitions: int = 8) -> str:
  head = f"HloModule m, is_scheduled=true, num_partitions={partitions}\n\n"
  body = "\n\n".join(textwrap.dedent(c).strip() for c in computations + (entry,))
  return head + body.replace("{L}", L)


# ------------------------------------------------- 1. compute in continuation fusions

# libtpu's async all-gather fusion (start / continuation / done, the start's outputs
# flowing into the continuation): the continuation holds the all-gather again *and* an
# elementwise softmax-like fusion with 52500 estimated cycles (50 us), no dot.
# (HLO fixtures keep the compiler's one-instruction-a-line text: hence `noqa: E501`.)
_START = """
%start_comp (a: bf16[1024,1024]) -> (bf16[1024,1024], bf16[4096,1024], u32[]) {
  %a = bf16[1024,1024]{L} parameter(0)
  %ag = bf16[4096,1024]{L} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true, backend_config={"async_collective_fusion_config":{"flag_start":"-1","flag_end":"-1"}}
  ROOT %cc = (bf16[1024,1024]{L}, bf16[4096,1024]{L}, u32[]{:S(2)}) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}"""  # noqa: E501
_CONT = """
%CONT_NAME (a: bf16[1024,1024], g: bf16[4096,1024], x: f32[2048,1024]) -> (f32[2048,1024], bf16[4096,1024]) {
  %a = bf16[1024,1024]{L} parameter(0)
  %g = bf16[4096,1024]{L} parameter(1)
  %x = f32[2048,1024]{1,0:T(8,128)} parameter(2)
  %e = f32[2048,1024]{1,0:T(8,128)} exponential(%x)
  %ag = bf16[4096,1024]{L} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %t = (f32[2048,1024]{1,0:T(8,128)}, bf16[4096,1024]{L}) tuple(%e, %ag)
}"""  # noqa: E501
_DONE = """
%done_comp (a: bf16[1024,1024], g: bf16[4096,1024]) -> bf16[4096,1024] {
  %a = bf16[1024,1024]{L} parameter(0)
  %g = bf16[4096,1024]{L} parameter(1)
  %ag = bf16[4096,1024]{L} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %cc = bf16[4096,1024]{L} custom-call(%a, %g, %ag), custom_call_target="AsyncCollectiveDone"
}"""  # noqa: E501
_ENTRY = """
ENTRY %main (p0: bf16[1024,1024], p1: f32[2048,1024]) -> bf16[4096,1024] {
  %p0 = bf16[1024,1024]{L} parameter(0)
  %p1 = f32[2048,1024]{1,0:T(8,128)} parameter(1)
  %async-collective-start = (bf16[1024,1024]{L}, bf16[4096,1024]{L}, u32[]{:S(2)}) fusion(%p0), kind=kCustom, calls=%start_comp
  %g0 = bf16[1024,1024]{L} get-tuple-element(%async-collective-start), index=0
  %g1 = bf16[4096,1024]{L} get-tuple-element(%async-collective-start), index=1
  %fusion.27 = (f32[2048,1024]{1,0:T(8,128)}, bf16[4096,1024]{L}) fusion(%g0, %g1, %p1), kind=kOutput, calls=%CONT_NAME, backend_config={"flag_configs":[],"window_config":{"estimated_cycles":"52500"}}
  %c1 = bf16[4096,1024]{L} get-tuple-element(%fusion.27), index=1
  ROOT %async-collective-done = bf16[4096,1024]{L} fusion(%g0, %c1), kind=kCustom, calls=%done_comp
}"""  # noqa: E501


def _continuation_module(name="async_collective_fusion.27"):
  return _module(_ENTRY.replace("CONT_NAME", name), _START, _CONT.replace("CONT_NAME", name),
                 _DONE)


@pytest.mark.parametrize("name", ["async_collective_fusion.27", "fused_computation.9"])
def test_continuation_fusion_without_a_dot_is_compute_not_a_collective(name):
  """Read by name (libtpu's `async_collective_fusion.N`) or, renamed, by its operands
  (outputs of an AsyncCollectiveStart fusion). Before the fix the fusion was a second,
  synchronous all-gather and its 52500 cycles were dropped (compute 0, two all-gathers,
  step 213.8 us)."""
  s = ts.read_schedule(_continuation_module(name))
  ops = {op.name: op for op in s.expanded()}
  cont = ops["fusion.27"]
  assert (cont.kind, cont.continuation, cont.cycles, cont.collective) == (
      "other", True, 52500, "")
  summary = ts.summarize(s)
  assert summary.compute_cycles == 52500 and summary.other_cycles == 52500
  assert summary.collective_count == {"all-gather": 1}           # the start / done pair
  assert (summary.sync_collectives, summary.async_collectives) == (0, 1)
  assert ops["async-collective-start"].between_cycles == 52500
  sim = ts.simulate(s, "tpu-v4")
  # the gather (group {0,1,2,3}: dim 1) starts at 0 and takes AG4 = 13 + 78.9 + 15 =
  # 106.9 us; the 50 us softmax runs under it; the done waits for the rest.
  assert sim.compute_s == pytest.approx(50 * US)
  assert sim.step_s == pytest.approx(AG4) == pytest.approx(106.9 * US, abs=0.05 * US)
  assert sim.exposed_s == pytest.approx(AG4 - 50 * US)
  assert sim.sync_collective_s == 0


def test_sync_collective_fusion_fed_by_a_continuation_stays_a_collective():
  """The dense reduce-scatter (a kCustom fusion around an all-reduce, dynamic-sliced)
  consuming a continuation's result is a synchronous reduce-scatter, not a continuation
  (seen in the GPT-3 64x4 rewrite)."""
  rs = """
%all-reduce-scatter (input: f32[2048,1024]) -> f32[512,1024] {
  %input = f32[2048,1024]{1,0:T(8,128)} parameter(0)
  %ar = f32[2048,1024]{1,0:T(8,128)} all-reduce(%input), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %id = u32[] partition-id()
  %c = u32[] constant(0)
  ROOT %ds = f32[512,1024]{1,0:T(8,128)} dynamic-slice(%ar, %id, %c), dynamic_slice_sizes={512,1024}
}"""  # noqa: E501
  text = _continuation_module().replace(
      "  ROOT %async-collective-done",
      "  %c0 = f32[2048,1024]{1,0:T(8,128)} get-tuple-element(%fusion.27), index=0\n"
      "  %rs = f32[512,1024]{1,0:T(8,128)} fusion(%c0), kind=kCustom, calls=%all-reduce-scatter\n"
      "  ROOT %async-collective-done") + "\n\n" + textwrap.dedent(rs).strip()
  ops = {op.name: op for op in ts.read_schedule(text).expanded()}
  assert (ops["rs"].kind, ops["rs"].collective, ops["rs"].continuation) == (
      "collective", "reduce-scatter", False)
  assert ops["fusion.27"].continuation


def test_continuation_with_a_dot_stays_a_dot():
  text = _continuation_module().replace(
      "%e = f32[2048,1024]{1,0:T(8,128)} exponential(%x)",
      "%e = f32[2048,1024]{1,0:T(8,128)} convolution(%x, %x), dim_labels=bf_io->bf")
  cont = {op.name: op for op in ts.read_schedule(text).expanded()}["fusion.27"]
  assert (cont.kind, cont.continuation, cont.cycles) == ("dot", True, 52500)


# ------------------------------------------------- 2. collective-permute links

# The backward shift along the minor (column) axis of a 2x4 mesh, as libtpu prints it:
# its first pair {0,3} is three partitions apart, but every ring it forms ({0,1,2,3},
# {4,5,6,7}) is a run of consecutive partitions: the column link (dim 1). The row shift
# pairs partitions four apart: dim 0.
PERMUTES = _module("""
ENTRY %main (p0: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{L} parameter(0)
  %back = (bf16[1024,1024]{L}, bf16[1024,1024]{L}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%p0), channel_id=2, source_target_pairs={{0,3},{1,0},{2,1},{3,2},{4,7},{5,4},{6,5},{7,6}}
  %row = (bf16[1024,1024]{L}, bf16[1024,1024]{L}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%p0), channel_id=3, source_target_pairs={{0,4},{1,5},{2,6},{3,7},{4,0},{5,1},{6,2},{7,3}}
  %back-done = bf16[1024,1024]{L} collective-permute-done(%back)
  %row-done = bf16[1024,1024]{L} collective-permute-done(%row)
  ROOT %r = bf16[1024,1024]{L} add(%back-done, %row-done)
}""")  # noqa: E501


def test_backward_column_permute_travels_the_column_link():
  ops = {op.name: op for op in ts.read_schedule(PERMUTES).expanded()}
  assert (ops["back"].kind, ops["back"].link) == ("start", 1)    # was 0: |3 - 0| != 1
  assert (ops["row"].kind, ops["row"].link) == ("start", 0)
  assert ts._permute_link([(0, 1), (1, 2), (2, 3), (3, 0)]) == 1    # forward ring
  assert ts._permute_link([(0, 1), (2, 3)]) == 1                    # partial shifts
  assert ts._permute_link([(0, 2), (2, 0)]) == 0
  sim = ts.simulate(PERMUTES, "tpu-v4")
  # both start at 0 on different links and overlap: the step is the slower one,
  # max(CP1 = 13 + 59.5 + 50 = 122.5 us, CP0 = 13 + 54.0 + 50 = 117.0 us); the old
  # reading put both on dim 0, where they queued: 2 * 117.0 = 234.1 us.
  assert sim.step_s == pytest.approx(max(CP0, CP1)) == pytest.approx(122.5 * US, abs=0.05 * US)
  assert sim.collective_s == pytest.approx(CP0 + CP1)


# ------------------------------------------------- 3. the algorithm libtpu chose

# Backend configs verbatim from v4:4x4x4 compiles (a 16x4 mesh: the 16-chip axis spans
# two torus dims, the 4-chip axis one).
AG_1D = ('{"flag_configs":[],"barrier_config":{"barrier_type":"CUSTOM","id":"0"},'
         '"scoped_memory_configs":[],"collective_algorithm_config":{"emitter":'
         '"1DAllGatherNonMajorDimImbalanced","debug":"\\ngroup_size = 16 \\n'
         'has_reordering_map: false \\nper_stride_size = 2097152 bytes \\nshard_size = '
         '2097152 bytes "},"used_scoped_memory_configs":[]}')
AG_2D = AG_1D.replace("1DAllGatherNonMajorDimImbalanced", "2DAllGatherOnMajorDim")
AR_ND = ('{"collective_algorithm_config":{"emitter":"RotatedPincerEmitter","strategy":'
         '"UniDirectionNDRingStrategy","debug":"\\nUniDirectionNDRingStrategy{colors:4 '
         'phases:2 cores:{4 4},{4 4},{4 4},{4 4} nophase0:0 reserved_sflags:0 '
         'cross_module_on_2d_plane:0 has_reordering_map:0 use_routing_table_indices:0 '
         'num_dims:2 active_dims:101 dim_sizes:4,4 dim_used:{2 0},{0 2},{0 0},{0 0}}"},'
         '"used_scoped_memory_configs":[]}')
AR_1D = ('{"collective_algorithm_config":{"emitter":"RotatedPincerEmitter","strategy":'
         '"UniDirection1DRingStrategy","debug":"\\nUniDirection1DRingStrategy{colors:2 '
         'phases:1 cores:{4},{4} nophase0:0 reserved_sflags:0"}}')
RS_RING = ('{"collective_algorithm_config":{"emitter":"SingleInputAllReduceScatterFusion",'
           '"strategy":"StrategyRing","debug":"\\nStrategyRing{colors:1 phases:1 '
           'cores:{16} nophase0:0 reserved_sflags:0 cross_module_on_2d_plane:0 '
           'has_reordering_map:0 use_routing_table_indices:0}\\n"}}')


def test_strategy_names_and_torus_dims():
  assert ts._strategy(AG_1D) == ("1DAllGatherNonMajorDimImbalanced", 1)
  assert ts._strategy(AG_2D) == ("2DAllGatherOnMajorDim", 2)
  assert ts._strategy(AR_ND) == ("RotatedPincerEmitter/UniDirectionNDRingStrategy", 2)
  assert ts._strategy(AR_1D) == ("RotatedPincerEmitter/UniDirection1DRingStrategy", 1)
  assert ts._strategy(RS_RING) == ("SingleInputAllReduceScatterFusion/StrategyRing", 1)
  nd = ('{"collective_algorithm_config":{"emitter":"RotatedPincerEmitter","strategy":'
        '"StrategyND","debug":"\\nStrategyND{colors:3 phases:3 cores:{8 8 4},{8 4 8},'
        '{4 8 8} nophase0:0 reserved_sflags:1"}}')          # GPT-3 64x4: all 256 chips
  assert ts._strategy(nd) == ("RotatedPincerEmitter/StrategyND", 3)
  assert ts._strategy('{"collective_algorithm_config":{"emitter":'
                      '"SinglePhaseRingSumEmitter"}}') == ("SinglePhaseRingSumEmitter", 1)
  assert ts._strategy('{"collective_algorithm_config":{"emitter":"AllToAllEmitter"}}') == (
      "AllToAllEmitter", 0)
  assert ts._strategy('{"flag_configs":[]}') == ("", 0)


ND_256 = ('{"collective_algorithm_config":{"emitter":"RotatedPincerEmitter","strategy":'
          '"StrategyND","debug":"\\nStrategyND{colors:3 phases:3 cores:{8 8 4},{8 4 8},'
          '{4 8 8} nophase0:0 reserved_sflags:1"}}')


def test_nd_all_reduce_is_priced_per_phase():
  """The GPT-3 step's scalar loss psum over 256 chips (v4:8x8x4): libtpu runs StrategyND
  over rings of 8, 8 and 4, one phase per torus dim. Priced as one 256-chip ring it cost
  2.6 ms of hop latency; per phase it is three small all-reduces."""
  assert ts._strategy_cores(ND_256) == (8, 8, 4)
  assert ts._strategy_cores(AR_ND) == (4, 4)
  assert ts._strategy_cores(AR_1D) == () and ts._strategy_cores(AG_1D) == ()
  text = _module(f"""
ENTRY %main (p0: f32[1024]) -> f32[1024] {{
  %p0 = f32[1024]{{0}} parameter(0)
  ROOT %ar = f32[1024]{{0}} all-reduce(%p0), channel_id=1, replica_groups=[1,256]<=[256], use_global_device_ids=true, to_apply=%add, backend_config={ND_256}
}}""", partitions=256)  # noqa: E501
  op, = [op for op in ts.read_schedule(text).expanded() if op.name == "ar"]
  assert (op.group_size, op.ring_cores, op.ring_dims) == (256, (8, 8, 4), 3)
  v4 = load_profile("tpu-v4")
  phases = (all_reduce_time(v4, op.link, 8, 4096) + all_reduce_time(v4, op.link, 8, 512)
            + all_reduce_time(v4, op.link, 4, 64))
  assert ts.collective_seconds(op, v4) == pytest.approx(phases)
  one_ring = all_reduce_time(v4, op.link, 256, 4096)
  assert one_ring > 2.5e-3 and phases < 0.4e-3
  # the bytes on the wire are a single ring's: only the hop latency changes
  big = dataclasses.replace(op, bytes=2 ** 30)
  latency = lambda sizes: sum(all_reduce_time(v4, op.link, n, 0.0) for n in sizes)
  assert ts.collective_seconds(big, v4) - latency((8, 8, 4)) == pytest.approx(
      all_reduce_time(v4, op.link, 256, 2 ** 30) - latency((256,)), rel=1e-9)


def _row_gather(config: str) -> str:
  # 256 partitions as a 64x4 mesh; gather over the 64-chip row axis (partitions 4
  # apart: dim 0) of bf16[512,1024] shards (1 MiB) into bf16[32768,1024].
  return _module(f"""
ENTRY %main (p0: bf16[512,1024]) -> bf16[32768,1024] {{
  %p0 = bf16[512,1024]{{L}} parameter(0)
  ROOT %ag = bf16[32768,1024]{{L}} all-gather(%p0), channel_id=1, replica_groups=[4,64]<=[64,4]T(1,0), dimensions={{0}}, use_global_device_ids=true, backend_config={config}
}}""", partitions=256)  # noqa: E501


def test_two_torus_dim_axis_with_a_1d_emitter_gets_one_ring():
  v4 = load_profile("tpu-v4")
  prof = profile_for_mesh(v4, (64, 4))       # the 64-chip axis on two wrapped dims of 8x8x4
  bw = prof.all_gather.bandwidth[0]          # four links' worth, ~159.5 GB/s
  assert bw == pytest.approx(159.5e9, rel=1e-3)
  dims = ts.axis_torus_dims(v4, (64, 4))
  assert dims == (2, 1)
  op, = [op for op in ts.read_schedule(_row_gather(AG_1D)).expanded() if op.name == "ag"]
  assert (op.group_size, op.link, op.ring_dims) == (64, 0, 1)
  shard = 2 ** 20
  # one bidirectional ring over the 64 chips: half the summed rate (79.74 GB/s):
  # 13 us + 63 * 1 MiB / 79.74e9 (828.4 us) + 63 * 5 us = 1156.4 us; four links
  # (159.5 GB/s): 13 + 414.2 + 315 = 742.2 us
  one_ring = 13 * US + 63 * shard / (bw / 2) + 63 * 5 * US
  four_links = 13 * US + 63 * shard / bw + 63 * 5 * US
  assert ts.collective_seconds(op, prof, dims) == pytest.approx(one_ring)
  assert one_ring == pytest.approx(1156.4 * US, abs=0.1 * US)
  assert ts.collective_seconds(op, prof) == pytest.approx(four_links)    # no axis_dims
  assert four_links == pytest.approx(742.2 * US, abs=0.1 * US)
  simulate = lambda text: ts.simulate(text, prof, clock_hz=1.05e9, axis_dims=dims).step_s
  assert simulate(_row_gather(AG_1D)) == pytest.approx(one_ring)
  # a 2D emitter on the same axis keeps both dims' links
  assert simulate(_row_gather(AG_2D)) == pytest.approx(four_links)


def test_async_gather_without_a_config_takes_its_sync_siblings_algorithm():
  """libtpu's async collective fusions print no algorithm; one over the same group
  shape as a synchronous 1D all-gather is priced as that 1D ring."""
  text = _module(f"""
ENTRY %main (p0: bf16[512,1024], p1: bf16[512,1024]) -> bf16[32768,1024] {{
  %p0 = bf16[512,1024]{{L}} parameter(0)
  %p1 = bf16[512,1024]{{L}} parameter(1)
  %ag = bf16[32768,1024]{{L}} all-gather(%p0), channel_id=1, replica_groups=[4,64]<=[64,4]T(1,0), dimensions={{0}}, backend_config={AG_1D}
  %ags = (bf16[512,1024]{{L}}, bf16[32768,1024]{{L}}) all-gather-start(%p1), channel_id=2, replica_groups=[4,64]<=[64,4]T(1,0), dimensions={{0}}
  %agd = bf16[32768,1024]{{L}} all-gather-done(%ags)
  ROOT %r = bf16[32768,1024]{{L}} add(%ag, %agd)
}}""", partitions=256)  # noqa: E501
  ops = {op.name: op for op in ts.read_schedule(text).expanded()}
  assert (ops["ag"].ring_dims, ops["ag"].ring_dims_source) == (1, "config")
  assert (ops["ags"].ring_dims, ops["ags"].ring_dims_source, ops["ags"].emitter) == (
      1, "same-axis", "")
  prof = profile_for_mesh(load_profile("tpu-v4"), (64, 4))
  # both on the row link, one after the other, each a one-ring 1156.4 us gather
  sim = ts.simulate(text, prof, clock_hz=1.05e9, axis_dims=(2, 1))
  assert sim.step_s == pytest.approx(2 * 1156.4 * US, abs=0.2 * US)


# ------------------------------------------------- 4. all-to-all over mesh device_ids

def _all_to_all(groups: str) -> str:
  return _module(f"""
ENTRY %main (p0: bf16[4096,1024]) -> bf16[4096,1024] {{
  %p0 = bf16[4096,1024]{{L}} parameter(0)
  ROOT %a2a = bf16[4096,1024]{{L}} all-to-all(%p0), channel_id=1, replica_groups={groups}, dimensions={{0}}, backend_config={{"collective_algorithm_config":{{"emitter":"AllToAllEmitter"}}}}
}}""")  # noqa: E501


@pytest.mark.parametrize("groups", [
    "mesh['x'=2,'y'=4] device_ids=(0,2,1,3,4,6,5,7) {'y'}",
    "mesh['x'=2,'y'=4], device_ids=(0,2,1,3,4,6,5,7) {'y'}",
    "mesh[x=2,y=4], device_ids=(0,2,1,3,4,6,5,7) {y}",
])
def test_all_to_all_with_mesh_device_ids_is_timed(groups):
  op, = [op for op in ts.read_schedule(_all_to_all(groups)).expanded() if op.name == "a2a"]
  # the y axis in the mesh's device order: partitions 0, 2, 1, 3 (a column group: dim 1)
  assert (op.group, op.link, op.collective) == ((0, 2, 1, 3), 1, "all-to-all")
  assert op.moved_bytes == 8 * 2 ** 20 * 3 / 4
  # timed as a ring all-gather of the 2 MiB per-peer block: 13 us + 3 * 2 MiB /
  # 79.751e9 (78.9 us) + 15 us = 106.9 us (was 0: the group was not read)
  assert ts.simulate(_all_to_all(groups), "tpu-v4").step_s == pytest.approx(AG4)


def test_mesh_groups_iota_and_sub_axes():
  assert hlo_text.replica_group("replica_groups=mesh['x'=2,'y'=4] {'x'}", 8) == (0, 4)
  assert hlo_text.replica_group("replica_groups=mesh['x'=2,'y'=4] {'y'}", 8) == (0, 1, 2, 3)
  assert hlo_text.replica_group(
      "replica_groups=mesh['x'=2,'y'=4] device_ids=([2,4]<=[4,2]T(1,0)) {'y'}", 8) == (
          0, 2, 4, 6)
  # verbatim from the GPT-3 64x4 rewrite's all-to-all (256 v4 chips): the mesh's ids are
  # iota(256) reshaped to [4,16,4], transposed (0,2,1); the group, 16 of axis_2 from
  # pre-size 4, is 16 rows of the 64x4 mesh (partitions 4 apart: the row link)
  a2a = ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=64], "
         "device_ids=([4,16,4]T(0,2,1)) {'axis_2':(4)16}")
  assert hlo_text.replica_group(a2a, 256) == tuple(range(0, 64, 4))
  # sub-axis x:(p)k of an axis of n: [p, k, n / (p k)] major to minor, the group along k
  assert hlo_text.replica_group("replica_groups=mesh['x'=8] {'x':(1)2}", 8) == (0, 4)
  assert hlo_text.replica_group("replica_groups=mesh['x'=8] {'x':(2)2}", 8) == (0, 2)
  assert hlo_text.replica_group("replica_groups=mesh['x'=8] {'x':(4)2}", 8) == (0, 1)


# ------------------------------------------------- 5. libtpu's scheduler totals

# Verbatim (timestamps cut) from compiling, with --xla_enable_async_all_gather=true, a
# program whose only communication is one all-gather of a bf16[1024,1024] (2 MiB) shard
# over the 2-chip axis of v4:2x2x2 as 2x4: libtpu charges it 49151 = 2 MiB * 3 / 128 - 1
# of its "cycles" (the same over the 4-chip axis: group size does not enter).
LHS_LOG = """\
I1201 7713 latency_hiding_scheduler.cc:4268] [latency-hiding-scheduler] Statistics before scheduling:
I1201 7713 latency_hiding_scheduler.cc:4271] For computation: main.0_spmd, module jit_g(0)
I1201 7713 latency_hiding_scheduler.cc:4271] Total wasted cycles: 49151
I1201 7713 latency_hiding_scheduler.cc:4271] Wasted cycles for all-reduce: 0
I1201 7713 latency_hiding_scheduler.cc:4271] Wasted cycles for all-gather: 49151
I1201 7713 latency_hiding_scheduler.cc:4271] Total cycles: 62093.6
I1201 7713 latency_hiding_scheduler.cc:4271] Memory pressure peak (bytes): 27263488
I1201 7713 latency_hiding_scheduler.cc:4325] [latency-hiding-scheduler] LatencyHidingScheduler current memory usage: 34604032 bytes. Current limit: 31348394188
I1201 7713 latency_hiding_scheduler.cc:4337] [latency-hiding-scheduler] Statistics after scheduling:
I1201 7713 latency_hiding_scheduler.cc:4341] For computation: main.0_spmd, module jit_g(0)
I1201 7713 latency_hiding_scheduler.cc:4341] Total wasted cycles: 48393.2
I1201 7713 latency_hiding_scheduler.cc:4341] Wasted cycles for all-gather: 48393.2
I1201 7713 latency_hiding_scheduler.cc:4341] Total cycles: 1.13401e+06
I1201 7713 latency_hiding_scheduler.cc:4341] Memory pressure peak (bytes): 34604032
"""  # noqa: E501


def test_scheduler_log_is_read():
  t, = ts.read_scheduler_log("noise\n" + LHS_LOG + "more noise\n")
  assert (t.module, t.computation) == ("jit_g(0)", "main.0_spmd")
  assert (t.cycles_before, t.wasted_before) == (62093.6, 49151.0)
  assert (t.cycles, t.wasted_cycles) == (1134010.0, 48393.2)     # "1.13401e+06"
  assert t.wasted_by_kind == {"all-gather": 48393.2}
  assert t.memory_peak_bytes == 34604032
  assert ts.scheduler_cycles(LHS_LOG, "main.0_spmd") == 1134010.0
  assert ts.scheduler_cycles(LHS_LOG, "other") == 1134010.0      # falls back to the last
  assert ts.scheduler_cycles("no scheduler here") is None


def test_scheduler_loop_bodies_times_their_trips():
  """libtpu logs each while body as its own computation; the entry's total counts the
  loop as one node (on an XLA windowed-einsum GEMM, v4:4x4x4 as 16x4: a 1.13M node for
  a body of 479131 per trip, 8 trips), so the bodies are added up separately."""
  log = LHS_LOG.replace("main.0_spmd", "wide.windowed_dot_general_body_ag.clone.sunk")
  log = log.replace("Total cycles: 1.13401e+06", "Total cycles: 479131")
  inner = ts.Loop(name="w2", trip_count=3, trip_count_known=True, body=(),
                  body_computation="unlogged")
  loop = ts.Loop(name="w", trip_count=8, trip_count_known=True, body=(inner,),
                 body_computation="wide.windowed_dot_general_body_ag.clone.sunk")
  assert ts.scheduler_loop_cycles(log, ts.CompiledSchedule(entries=(loop,))) == 8 * 479131
  assert ts.scheduler_loop_cycles(log, ts.CompiledSchedule(entries=())) == 0


# One real compile: v4:2x2x2 as 2x4, an async all-gather (2 MiB shard over x) beside an
# independent local 1024^3 dot, in a fresh process with the scheduler log on.
_SCRIPT = """
import json, sys
from meshslice import aot
from meshslice.costmodel import tpu_schedule as ts
from meshslice.costmodel.timing import all_reduce_time
aot.set_flags("--xla_enable_async_all_gather=true")
import jax, jax.numpy as jnp
jax.config.update("jax_platforms", "cpu")
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = aot.make_mesh("v4:2x2x2", (2, 4))
spec = P(("x", "y"))
def g(a, b, c):
  return a @ b, jax.lax.all_gather(c, "x", axis=0, tiled=True)
f = jax.jit(jax.shard_map(g, mesh=mesh, in_specs=(spec, P(), spec), out_specs=(spec, spec),
                          check_vma=False))
sh = lambda s, p: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
with ts.capture_stderr() as log:
  c, secs = aot.compile(f, sh((8192, 1024), spec), sh((1024, 1024), P()),
                        sh((8192, 1024), spec), mesh=mesh)
r = aot.analyze(c, "tpu-v4", compile_s=secs, mesh_shape=(2, 4), scheduler_log=log.text)
totals = ts.read_scheduler_log(log.text)
dots = [op.cycles for op in ts.read_schedule(c.as_text()).expanded() if op.kind == "dot"]
print("RESULT " + json.dumps({"row": r.row(), "dots": dots,
      "wasted_before": [t.wasted_before for t in totals],
      "starts": ts.summarize(c.as_text()).async_collectives}))
"""


def test_aot_scheduler_totals_and_libtpu_peak_beside_the_simulation():
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(ts.SCHEDULER_LOG_ENV)
  out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                       env=env, timeout=300)
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, out.stderr[-3000:]
  got = json.loads(line[0][len("RESULT "):])
  row = got["row"]
  assert got["starts"] == 1                              # the all-gather runs async
  # libtpu charges the 2 MiB all-gather 2 MiB * 3 / 128 - 1 = 49151 scheduler cycles
  assert got["wasted_before"] == [49151.0]
  assert row["scheduler_cycles"] > 0
  assert row["scheduler_s"] == pytest.approx(row["scheduler_cycles"] / 1.05e9)
  assert row["scheduler_loop_cycles"] == 0                # no while loops here
  assert 0 <= row["scheduler_wasted_cycles"] <= row["scheduler_cycles"]
  # its total is not the backend's estimate: the 1024^3 dot alone (~15k estimated
  # cycles) is charged ~22.6k; the sum exceeds our compute
  assert len(got["dots"]) == 1 and 10_000 < got["dots"][0] < 20_000
  assert row["scheduler_cycles"] > row["compute_cycles"]
  # libtpu's own peak is reported beside the project's args + outputs + temps formula
  # (on this small program libtpu's is the larger: 18.9 MB against 12.6 MB)
  assert row["libtpu_peak_bytes"] > 0 and row["peak_bytes"] > 0
  assert row["step_s"] > 0


# ------------------------------------------------- 5. SparseCore collective offload

# v5p and v6e with --xla_tpu_enable_sparse_core_collective_offload_all_gather=true: the
# all-gather runs on the SparseCore, in a computation on another execution thread
# (closed by '}, execution_thread="sparsecore"'), called asynchronously. Trimmed from a
# v5p:2x2x1 (2x2) compile; the collective's backend config is verbatim but for its
# constant literals. The dot fusion between start and done runs under the gather.
_SC_AG_CONFIG = ('{"flag_configs":[],"barrier_config":{"barrier_type":"CUSTOM","id":"-1"},'
                 '"device_type":"DEVICE_TYPE_SPARSECORE","collective_offload_config":{'
                 '"all_gather_offload_config":{"use_single_sparse_core":true,'
                 '"ici_strategy_config":{"color_strategies":[{"phase_rings":[{"ring_type":'
                 '"ICI_RING_TYPE_UNIDIR_CW","core_count":"2","ring_neighbor":'
                 '"ICI_RING_NEIGHBOR_EXPLICIT","ring_neighbor_table_offset":"0","barrier_id":'
                 '"0","has_reordering_map":false,"explicit_strategy_ring_dim":'
                 '"ICI_RING_DIM_Y_MESH","partner_transfers_outside_the_ring":false}]},'
                 '{"phase_rings":[{"ring_type":"ICI_RING_TYPE_UNIDIR_CCW","core_count":"2",'
                 '"ring_neighbor":"ICI_RING_NEIGHBOR_EXPLICIT","ring_neighbor_table_offset":'
                 '"0","barrier_id":"0","has_reordering_map":false,"explicit_strategy_ring_dim":'
                 '"ICI_RING_DIM_Y_MESH","partner_transfers_outside_the_ring":false}]}]},'
                 '"physical_core_indices":[0],"tensor_split_factor":1,'
                 '"use_n_dimension_strategy":true},"is_conditional_collective_offload":false,'
                 '"custom_call_async_collective_config":""},"used_scoped_memory_configs":[]}')
_SC_CALLED = """
%called_computation (param_0.20: bf16[1024,512]) -> bf16[1024,1024] {
  %param_0.20 = bf16[1024,512]{L} parameter(0)
  ROOT %all-gather.3 = bf16[1024,1024]{L} all-gather(%param_0.20), channel_id=1, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={1}, use_global_device_ids=true, backend_config=CONFIG
}, execution_thread="sparsecore"

%fused_dot (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{L} parameter(0)
  %b = bf16[1024,1024]{L} parameter(1)
  ROOT %d = bf16[1024,1024]{L} convolution(%a, %b), dim_labels=bf_io->bf
}""".replace("CONFIG", _SC_AG_CONFIG)  # noqa: E501
_SC_DOT = ('  %fusion.6 = bf16[1024,1024]{L} fusion(%p1, %p1), kind=kOutput, calls=%fused_dot, '
           'backend_config={"flag_configs":[],"window_config":{"estimated_cycles":"CYCLES"}}')
# libtpu 0.0.42.1: call-start(input, token) ... call-done(start)
_SC_OLD = """
ENTRY %main (p0: bf16[1024,512], p1: bf16[1024,1024]) -> (bf16[1024,1024], bf16[1024,1024]) {
  %p0 = bf16[1024,512]{L} parameter(0)
  %p1 = bf16[1024,1024]{L} parameter(1)
  %prepare_start = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %prepare_done = token[] custom-call(%prepare_start), custom_call_target="PrepareAsyncCallDone"
  %all-gather.4.call-start = ((bf16[1024,512]{L}, token[]), bf16[1024,1024]{L}) call-start(%p0, %prepare_done), async_execution_thread="sparsecore", to_apply=%called_computation
DOT
  %all-gather.4.call-done = bf16[1024,1024]{L} call-done(%all-gather.4.call-start)
  ROOT %t = (bf16[1024,1024]{L}, bf16[1024,1024]{L}) tuple(%all-gather.4.call-done, %fusion.6)
}"""  # noqa: E501
# libtpu 0.0.50.1: call-start() without operands, call-update(start, input), call-done(update)
_SC_NEW = """
ENTRY %main (p0: bf16[1024,512], p1: bf16[1024,1024]) -> (bf16[1024,1024], bf16[1024,1024]) {
  %p0 = bf16[1024,512]{L} parameter(0)
  %p1 = bf16[1024,1024]{L} parameter(1)
  %all-gather.4.call-start = ((), (), (s32[1]{0:T(128)S(2)})) call-start(), async_execution_thread="sparsecore", to_apply=%called_computation
  %all-gather.4.call-update = ((bf16[1024,512]{L}), bf16[1024,1024]{L}) call-update(%all-gather.4.call-start, %p0)
DOT
  %all-gather.4.call-done = bf16[1024,1024]{L} call-done(%all-gather.4.call-update)
  ROOT %t = (bf16[1024,1024]{L}, bf16[1024,1024]{L}) tuple(%all-gather.4.call-done, %fusion.6)
}"""  # noqa: E501


def _sc_module(entry: str, cycles: int) -> str:
  return _module(entry.replace("DOT", _SC_DOT.replace("CYCLES", str(cycles))), _SC_CALLED,
                 partitions=4)


def test_sparse_core_computation_ends_at_its_execution_thread_line():
  module = hlo_text.parse(_sc_module(_SC_NEW, 1000))
  assert {"called_computation", "fused_dot", "main"} <= set(module.computations)
  called = module.computations["called_computation"]
  assert [i.opcode for i in called.instrs.values()] == ["parameter", "all-gather"]
  assert module.computations["fused_dot"].instrs["d"].opcode == "convolution"


@pytest.mark.parametrize("entry, start", [(_SC_OLD, "all-gather.4.call-start"),
                                          (_SC_NEW, "all-gather.4.call-update")],
                         ids=["libtpu-0.0.42", "libtpu-0.0.50"])
def test_sparse_core_offloaded_gather_is_an_async_pair(entry, start):
  """Before: call-start / call-done were "other" ops and the gather was not seen at all
  (a v5p program under the offload flags simulated with no collective time)."""
  text = _sc_module(entry, 1000)
  ops = {op.name: op for op in ts.read_schedule(text).expanded()}
  pair = ops[start], ops["all-gather.4.call-done"]
  assert [(op.kind, op.collective) for op in pair] == [("start", "all-gather"),
                                                       ("done", "all-gather")]
  # the gather's group (partitions 0 and 2 of a 2x2 mesh: the row axis, dim 0), its
  # result bytes and the ring libtpu chose: one bidirectional ring of 2 cores
  op = pair[0]
  assert (op.group, op.link, op.bytes) == ((0, 2), 0, 2 * 2 ** 20)
  assert (op.emitter, op.ring_dims) == ("SparseCoreOffload{colors:2 phases:1 cores:2}", 1)
  assert op.between_cycles == 1000
  if entry is _SC_NEW:          # the operand-less start issues nothing
    assert ops["all-gather.4.call-start"].kind == "other"
  summary = ts.summarize(text)
  assert summary.collective_count == {"all-gather": 1}
  assert (summary.sync_collectives, summary.async_collectives) == (0, 1)


@pytest.mark.parametrize("entry", [_SC_OLD, _SC_NEW], ids=["libtpu-0.0.42", "libtpu-0.0.50"])
def test_sparse_core_gather_overlaps_the_dot_between(entry):
  v5p = load_profile("tpu-v5p")
  op, = [op for op in ts.read_schedule(_sc_module(entry, 1000)).expanded()
         if op.kind == "start"]
  gather = ts.collective_seconds(op, v5p)
  clock = ts.simulate(_sc_module(entry, 1000), v5p).clock_hz
  for dot_s in (gather / 2, gather * 2):          # a dot shorter, then longer than it
    sim = ts.simulate(_sc_module(entry, round(dot_s * clock)), v5p)
    assert sim.step_s == pytest.approx(max(gather, dot_s), rel=1e-3)
    assert sim.exposed_s == pytest.approx(max(0.0, gather - dot_s), rel=1e-3, abs=1e-9)
    assert sim.sync_collective_s == 0


def test_sparse_core_strategy_names_and_torus_dims():
  assert ts._strategy(_SC_AG_CONFIG) == ("SparseCoreOffload{colors:2 phases:1 cores:2}", 1)
  # an all-reduce's implicit rings name their torus dim instead of a size
  implicit = ('{"collective_offload_config":{"all_reduce_offload_config":{'
              '"ici_strategy_config":{"color_strategies":[{"phase_rings":[{"ring_type":'
              '"ICI_RING_TYPE_UNIDIR_CW","ring_neighbor":"ICI_RING_NEIGHBOR_IMPLICIT",'
              '"ring_dim":"ICI_RING_DIM_X_MESH","barrier_id":"1"}]},{"phase_rings":[{'
              '"ring_type":"ICI_RING_TYPE_UNIDIR_CCW","ring_neighbor":'
              '"ICI_RING_NEIGHBOR_IMPLICIT","ring_dim":"ICI_RING_DIM_X_MESH","barrier_id":'
              '"1"}]}]}}}}')
  assert ts._strategy(implicit) == ("SparseCoreOffload{colors:2 phases:1 dims:X_MESH}", 1)
  # a 2D gather (v5p:8x8x4 as 64x4, the 64-chip axis): 4 colors of two phase rings
  ring = '{"ring_type":"ICI_RING_TYPE_UNIDIR_CW","core_count":"8","barrier_id":"0"}'
  color = '{"phase_rings":[' + ring + "," + ring + "]}"
  two_d = ('{"collective_offload_config":{"all_gather_offload_config":{'
           '"ici_strategy_config":{"color_strategies":[' + ",".join([color] * 4) + "]}}}}")
  assert ts._strategy(two_d) == ("SparseCoreOffload{colors:4 phases:2 cores:8 8}", 2)


# ------------------------------------------------- 6. where the exposed time goes

def test_exposed_time_is_attributed_to_the_collective_waited_on():
  """The continuation program: the gather (AG4 = 106.9 us) hides 50 us of softmax; its
  done waits the rest. That one wait is all the exposed time."""
  sim = ts.simulate(_continuation_module(), "tpu-v4")
  wait, = sim.waits
  assert (wait.name, wait.collective, wait.sync, wait.group_size, wait.link) == (
      "async-collective-start", "all-gather", False, 4, 1)
  assert wait.seconds == pytest.approx(AG4)
  assert wait.between_s == pytest.approx(50 * US)
  assert wait.waited_s == pytest.approx(AG4 - 50 * US) == pytest.approx(sim.exposed_s)
  assert sim.exposed_by() == [("async all-gather n=4 link 1", pytest.approx(AG4 - 50 * US), 1)]
  # all of it at an async done: the sync / async split of the exposed time
  assert sim.async_exposed_s == pytest.approx(AG4 - 50 * US) and sim.sync_exposed_s == 0
  assert sim.async_collective_s == pytest.approx(AG4) == pytest.approx(sim.collective_s)


def test_a_done_that_finds_its_collective_finished_is_no_wait():
  """Two permutes in flight on different links, waited on back to back: the column one
  (CP1 = 122.5 us) is waited for; the row one (CP0 = 117.1 us) has finished under it."""
  sim = ts.simulate(PERMUTES, "tpu-v4")
  assert CP1 > CP0
  wait, = sim.waits
  assert (wait.name, wait.collective, wait.link) == ("back", "collective-permute", 1)
  assert wait.waited_s == pytest.approx(CP1) == pytest.approx(sim.exposed_s)


def test_sync_collectives_wait_from_issue_and_queue_on_their_link():
  """A sync gather after an async one on the same link starts when the link frees:
  its wait is the async gather's remaining time plus its own duration."""
  text = _module("""
ENTRY %main (p0: bf16[1024,1024]) -> bf16[4096,1024] {
  %p0 = bf16[1024,1024]{L} parameter(0)
  %ags = (bf16[1024,1024]{L}, bf16[4096,1024]{L}) all-gather-start(%p0), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %f = bf16[1024,1024]{L} fusion(%p0), kind=kLoop, calls=%c, backend_config={"flag_configs":[],"estimated_cycles":"21000"}
  %ag = bf16[4096,1024]{L} all-gather(%f), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %agd = bf16[4096,1024]{L} all-gather-done(%ags)
  ROOT %r = bf16[4096,1024]{L} add(%agd, %ag)
}""")  # noqa: E501
  sim = ts.simulate(text, "tpu-v4")
  # 20 us of compute; the sync gather starts at AG4 (the link is busy) and ends at 2 AG4;
  # the async done then finds its gather long finished
  wait, = sim.waits
  assert (wait.name, wait.sync) == ("ag", True)
  assert wait.waited_s == pytest.approx(2 * AG4 - 20 * US)
  assert sim.step_s == pytest.approx(2 * AG4)
  assert sum(w.waited_s for w in sim.waits) == pytest.approx(sim.exposed_s)
  assert sim.exposed_by(top=1) == [("sync all-gather n=4 link 1", pytest.approx(wait.waited_s), 1)]
  # the sync gather's wait (its link's queue included) is sync exposed time; the async
  # gather it queued behind counts as async collective time, none of it exposed
  assert sim.sync_exposed_s == pytest.approx(wait.waited_s) and sim.async_exposed_s == 0
  assert sim.async_collective_s == pytest.approx(AG4) == pytest.approx(sim.sync_collective_s)
  figures = sim.figures()
  assert figures["sync_exposed_s"] + figures["async_exposed_s"] == pytest.approx(
      figures["exposed_s"])
  assert figures["exposed_by"] == [list(g) for g in sim.exposed_by()]


_BIDIRECTIONAL = """
ENTRY %main (p0: bf16[1024,1024]) -> bf16[1024,1024] {{
  %p0 = bf16[1024,1024]{{L}} parameter(0)
  %fwd = (bf16[1024,1024]{{L}}, bf16[1024,1024]{{L}}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%p0), channel_id=1, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}},{{4,5}},{{5,6}},{{6,7}},{{7,4}}}}
  %other = (bf16[1024,1024]{{L}}, bf16[1024,1024]{{L}}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%p0), channel_id=2, source_target_pairs={second}
  %fd = bf16[1024,1024]{{L}} collective-permute-done(%fwd)
  %od = bf16[1024,1024]{{L}} collective-permute-done(%other)
  ROOT %r = bf16[1024,1024]{{L}} add(%fd, %od)
}}"""  # noqa: E501
_BACKWARD_PAIRS = "{{0,3},{1,0},{2,1},{3,2},{4,7},{5,4},{6,5},{7,6}}"
_FORWARD_PAIRS = "{{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}"


@pytest.mark.parametrize("second,step", [
    (_BACKWARD_PAIRS, CP1),          # opposite directions: both links at once
    (_FORWARD_PAIRS, 2 * CP1),       # the same direction: one after the other
])
def test_opposite_permutes_move_at_once_on_full_duplex_links(second, step):
  """XLA's bidirectional windowed einsum sends a chunk each way round the ring; ICI links
  are full duplex, so the +1 and -1 permutes do not queue behind each other (2 MiB on
  dim 1: CP1 each); two permutes the same way do."""
  text = _module(_BIDIRECTIONAL.format(second=second))
  sim = ts.simulate(text, "tpu-v4")
  assert sim.step_s == pytest.approx(step)
  assert sim.collective_s == pytest.approx(2 * CP1)


def test_a_one_axis_mesh_is_priced_on_the_links_its_axis_spans():
  """Pure fsdp (a 64 x 1 mesh): every collective's group is consecutive partitions, so
  the reader files it under profile dim 1. `aot.analyze` reads such a mesh as (1, 64),
  so dim 1 is the 64-chip axis (three torus dims of v4:4x4x4), not the size-1 axis: as
  (64, 1) a 64 MiB all-reduce was priced on one torus dim's links, several times slower
  (MaxText's 22B on 64 v4 chips, docs/benchmarks.md "Anchored on v4 too")."""
  from meshslice import aot
  from meshslice.costmodel import profile_for_mesh
  text = _module("""
ENTRY %main (p0: f32[16777216]) -> f32[16777216] {
  %p0 = f32[16777216]{0} parameter(0)
  ROOT %ar = f32[16777216]{0} all-reduce(%p0), channel_id=1, replica_groups=[1,64]<=[64], use_global_device_ids=true, to_apply=%add
}""", partitions=64)  # noqa: E501
  op, = [op for op in ts.read_schedule(text).expanded() if op.name == "ar"]
  assert (op.group_size, op.link) == (64, 1)
  assert ts.link_mesh_shape((64, 1)) == (1, 64) and ts.link_mesh_shape((16, 4)) == (16, 4)
  v4 = load_profile("tpu-v4")
  schedule = ts.read_schedule(text)

  def step(shape):
    return ts.simulate(schedule, profile_for_mesh(v4, shape), clock_hz=ts.CLOCK_HZ["tpu-v4"],
                       axis_dims=ts.axis_torus_dims(v4, shape)).step_s
  assert step((64, 1)) > 2 * step((1, 64))

  class Compiled:       # what analyze reads of a compiled program
    def as_text(self):
      return text

    def memory_analysis(self):
      return None
  analyzed = aot.analyze(Compiled(), "tpu-v4", mesh_shape=(64, 1)).simulation.step_s
  assert analyzed == pytest.approx(step((1, 64)))
