"""The TPU schedule reader and simulator (meshslice.costmodel.tpu_schedule) on hand-checked
HLO texts, and ahead-of-time TPU compiles (meshslice.aot; skipped without libtpu).

Hand-checked numbers use the shipped tpu-v4 profile (DESIGN.md section 5): all-gather on
profile dim 1: 79.751e9 B/s, 5 us per hop, 13 us base; send/recv on dim 1: 35.224e9 B/s,
50 us per hop, 13 us base; clock 1.05 GHz, so 105000 cycles = 100 us.
"""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshslice import aot, backend_flags
from meshslice.costmodel import load_profile, profile_for_mesh
from meshslice.costmodel import tpu_schedule as ts

US = 1e-6
MiB2 = 1024 * 1024 * 2            # a bf16[1024,1024] block
# all-gather of bf16[1024,1024] shards over a group of 4 on dim 1 (result bf16[4096,1024])
AG4 = 13 * US + 3 * MiB2 / 79.751e9 + 3 * 5 * US
# one collective-permute of bf16[1024,1024] on dim 1
CP = 13 * US + MiB2 / 35.224e9 + 50 * US


def _module(entry: str, *computations: str, partitions: int = 4) -> str:
  head = f"HloModule m, is_scheduled=true, num_partitions={partitions}\n\n"
  return head + "\n\n".join(textwrap.dedent(c).strip() for c in computations + (entry,))


# (HLO fixtures keep the compiler's one-instruction-a-line text: hence `noqa: E501`.)
DOT = """
%dot (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %b = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %conv = bf16[1024,1024]{1,0:T(8,128)(2,1)} convolution(%a, %b), dim_labels=bf_io->bf
}"""

SYNC = _module("""
ENTRY %main (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[4096,1024] {
  %p0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %ag = bf16[4096,1024]{1,0:T(8,128)(2,1)} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %f = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%p1, %p1), kind=kOutput, calls=%dot, backend_config={"flag_configs":[],"window_config":{"estimated_cycles":"105000"}}
  %t = bf16[1024,1024]{0,1:T(8,128)(2,1)} copy(%f), backend_config={"estimated_cycles":"21000"}
  %m = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} copy(%p1)
  ROOT %r = bf16[4096,1024]{1,0:T(8,128)(2,1)} add(%ag, %ag), backend_config={"estimated_cycles":"0"}
}""", DOT)  # noqa: E501


def test_sync_program_kinds_cycles_bytes():
  s = ts.read_schedule(SYNC)
  ops = {op.name: op for op in s.expanded()}
  assert [op.name for op in s.expanded()] == ["p0", "p1", "ag", "f", "t", "m", "r"]
  assert ops["f"].kind == "dot" and ops["f"].cycles == 105000
  assert ops["f"].cycles_source == "compiler" and ops["f"].flops == 2 * 1024 ** 3
  assert ops["t"].kind == "copy" and ops["t"].relayout        # {1,0} -> {0,1}
  assert ops["m"].kind == "other" and not ops["m"].relayout   # memory space only
  ag = ops["ag"]
  assert (ag.kind, ag.collective, ag.group, ag.link) == ("collective", "all-gather",
                                                         (0, 1, 2, 3), 1)
  assert ag.bytes == 4 * MiB2 and ag.moved_bytes == 3 * MiB2  # result * (n-1)/n
  summary = ts.summarize(s)
  assert (summary.compute_cycles, summary.dot_cycles, summary.copy_cycles) == (
      126000, 105000, 21000)
  assert summary.relayout_copies == 1
  assert summary.collective_count == {"all-gather": 1}
  assert (summary.sync_collectives, summary.async_collectives) == (1, 0)


def test_sync_collective_adds_to_compute():
  sim = ts.simulate(SYNC, "tpu-v4")
  assert sim.compute_s == pytest.approx(120 * US)              # 126000 cycles
  assert sim.step_s == pytest.approx(AG4 + 120 * US)
  assert sim.sync_collective_s == pytest.approx(AG4)
  assert sim.exposed_s == pytest.approx(AG4)


# How the dense program's reduce-scatter looks on TPU: an all-reduce dynamic-sliced to this
# device's piece, wrapped in a kCustom fusion (libtpu runs it as one reduce-scatter).
FUSED_RS = _module("""
ENTRY %main (p0: bf16[4096,1024]) -> bf16[1024,1024] {
  %p0 = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %rs = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%p0), kind=kCustom, calls=%all-reduce-scatter
}""", """
%all-reduce-scatter (input: bf16[4096,1024]) -> bf16[1024,1024] {
  %input = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %ar = bf16[4096,1024]{1,0:T(8,128)(2,1)} all-reduce(%input), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  %id = u32[] partition-id()
  %c = u32[] constant(0)
  ROOT %ds = bf16[1024,1024]{1,0:T(8,128)(2,1)} dynamic-slice(%ar, %id, %c), dynamic_slice_sizes={1024,1024}
}""")  # noqa: E501


def test_reduce_scatter_wrapped_in_a_fusion_is_a_reduce_scatter():
  op, = [op for op in ts.read_schedule(FUSED_RS).expanded() if op.name == "rs"]
  assert (op.kind, op.collective, op.group, op.link) == ("collective", "reduce-scatter",
                                                         (0, 1, 2, 3), 1)
  assert op.bytes == MiB2 and op.moved_bytes == 3 * MiB2     # result * (n-1)
  summary = ts.summarize(FUSED_RS)
  assert summary.collective_count == {"reduce-scatter": 1}
  assert summary.sync_collectives == 1
  assert ts.simulate(FUSED_RS, "tpu-v4").sync_collective_s > 0


ASYNC = _module("""
ENTRY %main (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[4096,1024] {
  %p0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %ags = (bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[4096,1024]{1,0:T(8,128)(2,1)}) all-gather-start(%p0), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %f = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%p1, %p1), kind=kOutput, calls=%dot, backend_config={"estimated_cycles":"105000"}
  %agd = bf16[4096,1024]{1,0:T(8,128)(2,1)} all-gather-done(%ags)
  ROOT %g = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%f, %p1), kind=kOutput, calls=%dot, backend_config={"estimated_cycles":"210000"}
}""", DOT)  # noqa: E501


def test_async_collective_overlaps_what_runs_between_start_and_done():
  s = ts.read_schedule(ASYNC)
  ops = {op.name: op for op in s.expanded()}
  start, done = ops["ags"], ops["agd"]
  assert (start.kind, done.kind, start.collective) == ("start", "done", "all-gather")
  assert (start.partner, done.partner) == ("agd", "ags")
  assert start.between == ("f",) and start.between_cycles == 105000
  assert start.bytes == 4 * MiB2 and start.group == (0, 1, 2, 3) and start.link == 1
  summary = ts.summarize(s)
  assert (summary.sync_collectives, summary.async_collectives) == (0, 1)
  assert summary.overlap_cycles == 105000
  sim = ts.simulate(s, "tpu-v4")
  # the gather (AG4 = 106.9 us) hides all but 6.9 us under the 100 us dot; then 200 us
  assert sim.step_s == pytest.approx(max(AG4, 100 * US) + 200 * US)
  assert sim.exposed_s == pytest.approx(AG4 - 100 * US)
  assert sim.sync_collective_s == 0


LOOP_BODY = """
%body (s: (s32[], bf16[1024,1024])) -> (s32[], bf16[1024,1024]) {
  %s = (s32[], bf16[1024,1024]{1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = bf16[1024,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%s), index=1
  %cp = bf16[1024,1024]{1,0:T(8,128)(2,1)} collective-permute(%x), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %f = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%cp, %x), kind=kOutput, calls=%dot, backend_config={"estimated_cycles":"105000"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[1024,1024]{1,0:T(8,128)(2,1)}) tuple(%next, %f)
}"""  # noqa: E501
LOOP_COND = """
%cond (s: (s32[], bf16[1024,1024])) -> pred[] {
  %s = (s32[], bf16[1024,1024]{1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""


def _loop_module(while_attrs=""):
  return _module(f"""
ENTRY %main (p0: bf16[1024,1024]) -> bf16[1024,1024] {{
  %p0 = bf16[1024,1024]{{1,0:T(8,128)(2,1)}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[1024,1024]{{1,0:T(8,128)(2,1)}}) tuple(%zero, %p0)
  %w = (s32[], bf16[1024,1024]{{1,0:T(8,128)(2,1)}}) while(%init), condition=%cond, body=%body{while_attrs}
  ROOT %r = bf16[1024,1024]{{1,0:T(8,128)(2,1)}} get-tuple-element(%w), index=1
}}""", DOT, LOOP_BODY, LOOP_COND)  # noqa: E501


def test_loop_bound_from_condition_and_windowed_einsum():
  s = ts.read_schedule(_loop_module())
  (loop,) = s.loops()
  assert (loop.name, loop.trip_count, loop.trip_count_known) == ("w", 4, True)
  assert loop.windowed_einsum                       # permutes + dots in the body
  names = [op.name for op in s.expanded()]
  assert names.count("f") == 4 and names.count("cp") == 4
  summary = ts.summarize(s)
  assert summary.dot_cycles == 4 * 105000
  assert summary.collective_count == {"collective-permute": 4}
  assert summary.collective_bytes == {"collective-permute": 4 * MiB2}
  assert (summary.loops, summary.windowed_einsum_loops) == (1, 1)
  sim = ts.simulate(s, "tpu-v4")
  assert sim.step_s == pytest.approx(4 * (CP + 100 * US))


def test_loop_counter_starting_at_its_initial_constant():
  text = _loop_module().replace("%zero = s32[] constant(0)", "%zero = s32[] constant(1)")
  assert ts.read_schedule(text).loops()[0].trip_count == 3      # i = 1, 2, 3


def test_loop_known_trip_count_wins_over_the_condition():
  s = ts.read_schedule(_loop_module(
      ', backend_config={"known_trip_count":{"n":"7"},"known_init_step":{"init":"0"}}'))
  assert s.loops()[0].trip_count == 7
  assert ts.summarize(s).dot_cycles == 7 * 105000


# libtpu's async collective fusion: start and done are kCustom fusions whose computations
# end in AsyncCollectiveStart / AsyncCollectiveDone; the overlapped dot is fused with the
# collective's continuation, reached from the done through get-tuple-elements.
TPU_ASYNC = _module("""
ENTRY %main (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[4096,1024] {
  %p0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %async-collective-start = (bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[4096,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) fusion(%p0), kind=kCustom, calls=%start_comp
  %g0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%async-collective-start), index=0
  %g1 = bf16[4096,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%async-collective-start), index=1
  %cont = (bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[4096,1024]{1,0:T(8,128)(2,1)}) fusion(%g0, %g1, %p1), kind=kOutput, calls=%cont_comp, backend_config={"window_config":{"estimated_cycles":"105000"}}
  %c1 = bf16[4096,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%cont), index=1
  %c0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%cont), index=0
  %async-collective-done = bf16[4096,1024]{1,0:T(8,128)(2,1)} fusion(%g0, %c1), kind=kCustom, calls=%done_comp
  %nocycles = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%c0, %p1), kind=kOutput, calls=%dot
  ROOT %r = bf16[4096,1024]{1,0:T(8,128)(2,1)} add(%async-collective-done, %async-collective-done)
}""", DOT, """
%start_comp (a: bf16[1024,1024]) -> (bf16[1024,1024], bf16[4096,1024], u32[]) {
  %a = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %ag = bf16[4096,1024]{1,0:T(8,128)(2,1)} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %cc = (bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[4096,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}""", """
%cont_comp (a: bf16[1024,1024], g: bf16[4096,1024], b: bf16[1024,1024]) -> (bf16[1024,1024], bf16[4096,1024]) {
  %a = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %g = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %b = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(2)
  %conv = bf16[1024,1024]{1,0:T(8,128)(2,1)} convolution(%b, %b), dim_labels=bf_io->bf
  %ag = bf16[4096,1024]{1,0:T(8,128)(2,1)} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[4096,1024]{1,0:T(8,128)(2,1)}) tuple(%conv, %ag)
}""", """
%done_comp (a: bf16[1024,1024], g: bf16[4096,1024]) -> bf16[4096,1024] {
  %a = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %g = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %ag = bf16[4096,1024]{1,0:T(8,128)(2,1)} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %cc = bf16[4096,1024]{1,0:T(8,128)(2,1)} custom-call(%a, %g, %ag), custom_call_target="AsyncCollectiveDone"
}""")  # noqa: E501


def test_tpu_async_collective_fusion_is_paired_and_overlapped():
  s = ts.read_schedule(TPU_ASYNC)
  ops = {op.name: op for op in s.expanded()}
  start, done = ops["async-collective-start"], ops["async-collective-done"]
  assert (start.kind, done.kind, start.collective, done.collective) == (
      "start", "done", "all-gather", "all-gather")
  assert start.partner == "async-collective-done" and start.between_cycles == 105000
  assert ops["cont"].kind == "dot" and ops["cont"].cycles == 105000
  # a dot fusion without an estimate: 2 * 1024^3 FLOPs at 262144 FLOPs / cycle (v4)
  assert ops["nocycles"].cycles == 8192 and ops["nocycles"].cycles_source == "flops"
  summary = ts.summarize(s)
  assert summary.collective_count == {"all-gather": 1}     # the continuation is not another
  assert summary.async_collectives == 1 and summary.flop_estimated_cycles == 8192
  sim = ts.simulate(s, "tpu-v4")
  assert sim.step_s == pytest.approx(max(AG4, 100 * US) + 8192 / 1.05e9)


def test_errors_name_what_is_wrong():
  with pytest.raises(ValueError, match="no ENTRY computation"):
    ts.read_schedule("%c (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n")
  with pytest.raises(ValueError, match="no TPU clock known for profile 'h100'"):
    ts.simulate(SYNC, "h100")
  assert ts.simulate(SYNC, "h100", clock_hz=1e9).compute_s == pytest.approx(126e-6)


def test_topology_names_and_mesh_errors():
  assert aot.parse_topology("v5e:16x16")[1] == (16, 16)
  assert aot.topology_name("v4", 1024) == "v4:16x8x8"
  with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
    aot.parse_topology("v9:2x2")
  with pytest.raises(ValueError, match="v4 is a 3D torus"):
    aot.parse_topology("v4:4x4")
  with pytest.raises(ValueError, match="exceeds the largest v6e slice"):
    aot.parse_topology("v6e:32x32")
  with pytest.raises(ValueError, match="expected '<generation>:<dims>'"):
    aot.parse_topology("v4-256")


# ---------------------------------------------------------------- ahead-of-time compiles

def _matmul(mesh, n=2048):
  s = NamedSharding(mesh, P("x", "y"))
  f = jax.jit(lambda a, b: a @ b, in_shardings=(s, s), out_shardings=s)
  return f, jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=s)


def test_aot_compile_of_a_rewritten_matmul_on_v4():
  pytest.importorskip("libtpu")
  import meshslice
  mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  assert {d.device_kind for d in mesh.devices.flat} == {"TPU v4"}
  with pytest.raises(ValueError, match="has 6 devices but topology 'v4:2x2x2' has 8"):
    aot.make_mesh("v4:2x2x2", (2, 3))
  f, x = _matmul(mesh)
  plain = aot.analyze(aot.compile(f, x, x, mesh=mesh)[0], "tpu-v4")
  fast = meshslice.transform(f, algorithm="meshslice", ksplit=2)
  compiled, seconds = aot.compile(fast, x, x, mesh=mesh)
  rewritten = aot.analyze(compiled, "tpu-v4", compile_s=seconds)
  # plain: one gather per operand; OS with S=2: two per operand, none merged back
  assert plain.summary.collective_count == {"all-gather": 2}
  assert rewritten.summary.collective_count == {"all-gather": 4}
  # the same bytes move, in slices
  assert rewritten.summary.total_collective_bytes == plain.summary.total_collective_bytes
  for r in (plain, rewritten):
    assert r.summary.dot_cycles > 0 and r.simulation.step_s > r.simulation.compute_s > 0
    assert r.peak_bytes >= 3 * 1024 * 512 * 2      # two inputs and the output, per device
  schedule = ts.read_schedule(compiled.as_text())
  dots = [op for op in schedule.expanded() if op.kind == "dot"]
  assert len(dots) >= 2 and all(op.cycles_source == "compiler" for op in dots)
  # with the mesh, collectives are timed with the links the planner derives for it
  derived = aot.analyze(compiled, "tpu-v4", mesh_shape=(2, 4))
  mesh_profile = profile_for_mesh(load_profile("tpu-v4"), (2, 4))
  assert derived.simulation.profile == mesh_profile.name != "tpu-v4"
  assert derived.row()["ici_profile"] == mesh_profile.name
  assert derived.simulation.compute_s == rewritten.simulation.compute_s
  assert derived.simulation.collective_s == pytest.approx(sum(
      ts.collective_seconds(op, mesh_profile) for op in schedule.expanded()
      if op.kind in ("collective", "start")))



def test_default_plan_of_an_all_reduce_site_compiles_to_plain_jits_program():
  """A row-parallel matmul whose result is wanted whole over y (an all-reduce site). On
  TPU the sliced psums stay synchronous and the slices cost compute (measured: S = 2 and
  4 at 8192^2 take 1.8x plain's cycles), so the best rewrite is one psum, XLA's own
  program: the site is left to XLA (a tie is no reason to rewrite), and the program is
  plain jit's."""
  pytest.importorskip("libtpu")
  import meshslice
  mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  sh = lambda *s: NamedSharding(mesh, P(*s))
  x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=sh("x", "y"))
  w = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=sh("y", None))
  f = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, sh("x", None)),
              out_shardings=sh("x", None))
  # under the flags a TPU rewrite needs (without them it is left to XLA for that reason)
  fast = meshslice.transform(f, compiler_flags=backend_flags.tpu_overlap_flags("v4"))
  with jax.set_mesh(mesh):
    site, = fast.explain(x, w).sites
  assert not site.rewritten and site.reason.startswith(
      "left to XLA: the best rewrite (collective 1d-allreduce S=1) ")
  plain, rewritten = (aot.analyze(aot.compile(g, x, w, mesh=mesh)[0], "tpu-v4").summary
                      for g in (f, fast))
  assert rewritten.collective_count == plain.collective_count == {"all-reduce": 1}
  assert rewritten.compute_cycles == plain.compute_cycles
  assert rewritten.relayout_copies == plain.relayout_copies

_ASYNC_SCRIPT = """
import jax, jax.numpy as jnp, json, meshslice
jax.config.update("jax_platforms", "cpu")
from jax.sharding import NamedSharding, PartitionSpec as P
from meshslice import aot, backend_flags
from meshslice.costmodel import tpu_schedule as ts
aot.set_flags(*meshslice.backend_flags.tpu_overlap_flags("v4"))  # not ASYNC_FLAGS: see DESIGN 6b
mesh = aot.make_mesh("v4:2x2x2", (2, 4))
s = NamedSharding(mesh, P("x", "y"))
f = jax.jit(lambda a, b: a @ b, in_shardings=(s, s), out_shardings=s)
x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=s)   # 4096: 2x the compile
c, _ = aot.compile(meshslice.transform(f, algorithm="meshslice", ksplit=4), x, x, mesh=mesh)
sched = ts.read_schedule(c.as_text())
starts = [op for op in sched.expanded() if op.kind == "start"]
print("RESULT", json.dumps({"starts": len(starts),
      "paired": all(op.partner for op in starts),
      "between": min(op.between_cycles for op in starts) if starts else 0,
      "summary": ts.summarize(sched).async_collectives}))
"""


def test_aot_async_flags_give_paired_overlapped_collectives():
  pytest.importorskip("libtpu")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", _ASYNC_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=300)
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
  assert line, out.stderr[-3000:]
  import json
  result = json.loads(line[0][len("RESULT "):])
  assert result["starts"] >= 1 and result["paired"]
  assert result["between"] > 0                 # a partial matmul runs under each
  assert result["summary"] == result["starts"]


def test_compare_candidates_hook_for_the_planner():
  pytest.importorskip("libtpu")
  mesh = aot.make_mesh("v4:2x2x1", (2, 2))
  f, x = _matmul(mesh, n=1024)
  results = aot.compare_candidates(f, x, x, mesh=mesh, candidates={
      "xla": None, "S=2": {"algorithm": "meshslice", "ksplit": 2}})
  assert set(results) == {"xla", "S=2"}
  assert results["xla"].summary.collective_count == {"all-gather": 2}
  assert results["S=2"].summary.collective_count == {"all-gather": 4}
  assert all(r.simulation.step_s > 0 for r in results.values())
  with pytest.raises(ValueError, match="candidate 'bad': expected None"):
    aot.compare_candidates(f, x, x, mesh=mesh, candidates={"bad": 3})



def _partial_dot_operand_dtypes(fn, *args):
  """Operand dtypes of the dot_generals inside the shard_map bodies of fn's jaxpr."""
  from helpers import shard_map_bodies
  return {tuple(str(v.aval.dtype) for v in eqn.invars)
          for body in shard_map_bodies(fn, *args) for eqn in body.eqns
          if eqn.primitive.name == "dot_general"}


@pytest.mark.filterwarnings("ignore:.*sliced collectives overlap the matmuls on TPU only")
def test_bf16_partial_dots_are_widened_only_for_the_cpu_compiler():
  """XLA's CPU runtime cannot run some bf16 x bf16 -> f32 dots, so on CPU meshes the
  sliced OS site widens its operands; a program traced on this CPU host for TPU devices
  must not (the target is the mesh's platform, not the host's backend)."""
  pytest.importorskip("libtpu")
  import meshslice
  from helpers import mesh as cpu_mesh
  for msh, want in ((aot.make_mesh("v4:2x2x2", (2, 4)), ("bfloat16", "bfloat16")),
                    (cpu_mesh((2, 4)), ("float32", "float32"))):
    f, x = _matmul(msh, n=256)
    fast = meshslice.transform(f, algorithm="meshslice", ksplit=2)
    with jax.set_mesh(msh):
      assert _partial_dot_operand_dtypes(fast, x, x) == {want}, msh
