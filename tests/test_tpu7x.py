"""TPU7x (Ironwood) as a supported generation: topology names as libtpu spells them, two
devices per chip (one per TensorCore) and the mesh that keeps a chip's cores together,
the `tpu-v7x` profile, its libtpu flags, the schedule reader on its SparseCore-offloaded
collectives, and `python -m meshslice aot` on it. The compiling tests need libtpu and
compile on tpu7x:2x2x1 (4 chips, 8 devices); flag sets each get a fresh process."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from meshslice import aot, backend_flags
from meshslice.costmodel import describe_axes, load_profile, profile_for_mesh, tpu_schedule
from meshslice.costmodel.profiles import save_profile
from meshslice.costmodel.topology import chip_mesh_shape, core_axis


def test_topology_names_as_libtpu_spells_them():
  gen, dims = aot.parse_topology("tpu7x:4x4x4")
  assert (gen.name, gen.profile, gen.device_kind, dims) == ("tpu7x", "tpu-v7x", "TPU7x",
                                                            (4, 4, 4))
  assert math.prod(dims) * gen.devices_per_chip == 128          # one device per TensorCore
  assert aot.GENERATIONS["v4"].devices_per_chip == 1
  assert aot.parse_topology("tpu7x:2x2x1")[1] == (2, 2, 1)
  assert aot.device_count("tpu7x:2x2x1") == 8 and aot.device_count("v4:2x2x2") == 8
  # libtpu refuses the v7x / v7 spellings: say which one it takes
  with pytest.raises(ValueError) as e:
    aot.parse_topology("v7x:2x2x1")
  assert str(e.value) == ("topology 'v7x:2x2x1': libtpu names Ironwood 'tpu7x' (it refuses "
                          "'v7x'); use 'tpu7x:2x2x1'")
  with pytest.raises(ValueError, match="tpu7x is a 3D torus"):
    aot.parse_topology("tpu7x:4x4")
  with pytest.raises(ValueError, match="exceeds the largest tpu7x slice"):
    aot.parse_topology("tpu7x:32x32x16")
  assert aot.topology_name("tpu7x", 64) == "tpu7x:4x4x4"


def test_generation_flags_and_names():
  assert backend_flags.tpu_generation("TPU7x") == "tpu7x"
  assert backend_flags.profile_generation("tpu-v7x@2x4") == "tpu7x"
  flags = backend_flags.tpu_overlap_flags("tpu7x")
  assert flags == backend_flags.TPU7X_FLAGS == aot.preset_flags("async", "tpu7x")
  assert flags[:5] == backend_flags.SAFE_ASYNC_FLAGS
  assert set(backend_flags.SPARSE_CORE_OFFLOAD_FLAGS) <= set(flags)
  assert not any("2a886c8_chip_config_name" in f for f in flags)      # libtpu: unknown
  # libtpu offloads to the SparseCore on tpu7x without being asked; a flag turns it off
  every = {"all_gather", "reduce_scatter", "all_reduce"}
  assert backend_flags.sparse_core_offload("", "tpu7x") == every
  assert backend_flags.sparse_core_offload(
      "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=false",
      "tpu7x") == every - {"reduce_scatter"}
  # so the recommended flags are missing only where the environment says otherwise
  assert backend_flags.missing_overlap_flags("tpu", {}, generation="tpu7x") == ()
  off = "--xla_tpu_enable_sparse_core_collective_offload_all_gather=false"
  assert backend_flags.missing_overlap_flags("tpu", {"LIBTPU_INIT_ARGS": off},
                                             generation="tpu7x") == (
      "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",)
  # continuation fusion of all-gathers: refused off v5e by the newest libtpu
  assert backend_flags.unsafe_flags("tpu7x", aot.ASYNC_FLAGS) == (
      "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",)


def test_profile_is_per_tensorcore_with_its_sources(tmp_path):
  p = load_profile("tpu-v7x")
  assert p.devices_per_chip == 2
  # per device = per TensorCore = the published per-chip figure / 2
  assert p.peak_flops == 2307e12 / 2
  assert p.hbm_bandwidth == 7380e9 / 2
  assert p.hbm_capacity == 192 * 2**30 / 2
  assert p.topology.physical_dims == 3 and p.topology.max_chips == 9216
  assert p.topology.link_bandwidth == 1200e9 / 2 / 6             # per link, one way
  assert p.core_link_bandwidth > 0
  text = " ".join(p.sources)
  for fact in ("2,307 TFLOP/s bf16", "4,614 TFLOP/s fp8", "192 GiB", "7,380 GB/s",
               "1,200 GB/s", "docs.cloud.google.com/tpu/docs/tpu7x", "per chip",
               "per device", "no public figure"):
    assert fact in text, fact
  assert tpu_schedule.CLOCK_HZ["tpu-v7x"] == 2.2e9
  assert tpu_schedule.FLOPS_PER_CYCLE["tpu-v7x"] * 2.2e9 == pytest.approx(p.peak_flops,
                                                                         rel=1e-3)
  save_profile(p, tmp_path / "v7x.json")
  assert load_profile(tmp_path / "v7x.json") == p
  # one-device chips keep their files as they were
  assert "devices_per_chip" not in load_profile("tpu-v6e").to_json_dict()
  data = p.to_json_dict()
  data["devices_per_chip"] = 0
  (tmp_path / "bad.json").write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'devices_per_chip' must be a positive int"):
    load_profile(tmp_path / "bad.json")
  data["devices_per_chip"], data["core_link_bandwidth"] = 2, 0
  (tmp_path / "bad.json").write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'core_link_bandwidth' must be > 0"):
    load_profile(tmp_path / "bad.json")


def test_links_of_a_mesh_of_core_pairs():
  p = load_profile("tpu-v7x")
  link, d2d, (ag, rs, pp) = 1e11, p.core_link_bandwidth, p.topology.efficiency
  assert core_axis((2, 4), 2) == 1 and core_axis((8, 1), 2) == 0
  assert chip_mesh_shape(p, (2, 4)) == (2, 2)
  # 2 x 4 on 4 chips: y = 2 chips x their 2 cores (a ring through both cores of each
  # chip: one link each way between the two chips); x = 2 chips on a line, its link
  # shared by the chips' two cores
  assert describe_axes(p, (2, 4)) == ("2 line, shared by 2 cores", "2 cores x 2 line")
  q = profile_for_mesh(p, (2, 4))
  assert q.all_gather.bandwidth == (pytest.approx(ag * link / 2), pytest.approx(ag * link))
  assert q.reduce_scatter.bandwidth == (pytest.approx(rs * link / 2),
                                        pytest.approx(rs * link))
  # 4 x 2: y is the core pair alone, the die-to-die link
  r = profile_for_mesh(p, (4, 2))
  assert r.all_gather.bandwidth[1] == pytest.approx(ag * d2d)
  assert r.permute.bandwidth[1] == pytest.approx(pp * d2d)
  # 128 devices on a 4x4x4 cube as 16 x 8: y = 4 chips on a wrapped dim x 2 cores
  s = profile_for_mesh(p, (16, 8))
  assert s.all_gather.bandwidth == (pytest.approx(ag * 4 * link / 2),
                                    pytest.approx(ag * 2 * link))
  assert tpu_schedule.axis_torus_dims(p, (16, 8)) == (2, 1)
  assert tpu_schedule.axis_torus_dims(p, (4, 2)) == (2, 1)


# ----------------------------------------------------------------------------- compiled

def _flag_process(code: str, flags: str, timeout: int = 300):
  env = dict(os.environ, LIBTPU_INIT_ARGS=flags)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=timeout)
  line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
  return out, (json.loads(line[0][len("RESULT "):]) if line else None)


def test_make_mesh_puts_a_chips_cores_next_to_each_other():
  pytest.importorskip("libtpu")
  topo = aot.topology("tpu7x:2x2x1")
  devices = list(topo.devices)
  assert len(devices) == 8 and {d.device_kind for d in devices} == {"TPU7x"}
  assert sorted((tuple(d.coords), d.core_on_chip) for d in devices) == [
      ((x, y, 0), c) for x in (0, 1) for y in (0, 1) for c in (0, 1)]
  for shape in ((2, 4), (4, 2), (1, 8), (8, 1), (2, 2, 2)):
    grid = aot.make_mesh(topo, shape, ("a", "b", "c")[:len(shape)]).devices
    assert sorted(d.id for d in grid.flat) == sorted(d.id for d in devices)
    axis = core_axis(shape, 2)
    assert axis == (0 if shape == (8, 1) else len(shape) - 1)
    lines = np.moveaxis(grid, axis, -1).reshape(-1, shape[axis])
    for core0, core1 in zip(lines[:, 0::2].flat, lines[:, 1::2].flat):
      assert tuple(core0.coords) == tuple(core1.coords), shape
      assert (core0.core_on_chip, core1.core_on_chip) == (0, 1), shape
  # the rows of 2 x 4 are two neighbouring chips, the columns a chip's neighbour across
  mesh = aot.make_mesh(topo, (2, 4))
  for row in mesh.devices:
    first, second = {tuple(d.coords) for d in row}
    assert sum(a != b for a, b in zip(first, second)) == 1
  with pytest.raises(ValueError, match="pick a shape whose product is 8"):
    aot.make_mesh(topo, (2, 2))


def test_default_plan_does_not_reshard_on_its_own_under_tpu7x_offload():
  """Forward reshards under SparseCore offload were measured to pay on v5p / v6e only;
  on tpu7x (GPT-3 at seq 256, tpu7x:2x2x1 as 2x4) the default plan that resharded its six
  forward sites compiled 1.47x slower than XLA's program. Planning only, nothing compiles:
  every site is left to XLA there, the forward ones named as such, and a pinned dataflow
  still reshards."""
  pytest.importorskip("libtpu")
  import meshslice
  mesh = aot.make_mesh("tpu7x:2x2x1", (2, 4))
  step, params, batch = aot.model_step("gpt3", mesh, batch=8, seq=256)
  flags = aot.preset_flags("dense,async", "tpu7x")
  report = meshslice.explain(step, profile="tpu-v7x", compiler_flags=flags)(params, batch)
  assert not report.rewritten
  forward = [s for s in report.sites if s.direction == "forward" and
             s.reason.startswith("left to XLA")]
  assert len(forward) == 6 and not any("reshards" in (s.note or "") for s in forward)
  pinned = meshslice.explain(step, profile="tpu-v7x", compiler_flags=flags,
                             overrides={0: {"dataflow": "rs", "rewrite": True}})(params, batch)
  assert pinned.sites[0].rewritten and pinned.sites[0].dataflow == "rs"


def test_default_plan_takes_the_collective_rewrite_over_a_tie_with_xla_on_tpu7x():
  """On tpu7x under SparseCore offload the plain collective rewrite compiled faster than
  XLA's program wherever no other dataflow moves less (GPT-3 layer at seq 2048 on
  tpu7x:2x2x1: the default plan 1.166x / 1.133x, alpha-beta / routed). The sites the
  model prices as tying with XLA are rewritten as collective S=1 in their own layout
  (ring reduce-scatters), each saying why; a site whose operands another dataflow would
  move less of stays XLA's; without the offload flags every site is left to XLA as
  before. Planning only: nothing compiles."""
  pytest.importorskip("libtpu")
  import meshslice
  mesh = aot.make_mesh("tpu7x:2x2x1", (2, 4))
  step, params, batch = aot.model_step("gpt3", mesh, batch=8)
  flags = aot.preset_flags("dense,async,all_to_all", "tpu7x")
  report = meshslice.explain(step, profile="tpu-v7x", compiler_flags=flags)(params, batch)
  taken = [s for s in report.sites if s.rewritten and "compiled faster than XLA" in s.note]
  assert [s.index for s in taken] == [0, 1, 2, 5, 6, 8, 9, 10, 13, 14, 17, 18]
  assert {(s.algorithm, s.ksplit, s.reduce_scatter) for s in taken} == {("collective", 1, None)}
  assert all(s.predicted_seconds == s.xla_seconds == s.baseline_seconds for s in taken)
  assert "collective S=1 rather than XLA's own program" in taken[0].note
  assert {s.rule for s in taken} == {"collective_over_xla"}
  assert len(report.rewritten) == 12
  assert report.measured_on_compiled_steps == tuple(taken)
  assert "12 of them follow a plan chosen on compiled steps" in str(report)
  assert all(s.reason.startswith("left to XLA") for s in report.sites
             if not s.rewritten and s.index not in (3, 4, 11, 12, 21, 22, 23, 24))
  # libtpu's defaults on tpu7x offload too, but keep windowed einsum: not what was measured
  plain = meshslice.explain(step, profile="tpu-v7x", compiler_flags=())(params, batch)
  assert not plain.rewritten


def test_a_step_too_small_for_the_collective_rewrite_leaves_its_ties_to_xla_on_tpu7x():
  """The tie rule above needs a step one of whose matmuls computes for 0.5 ms: a
  32-head layer (hidden 4096, largest 0.27 ms) compiled 0.897x XLA with it on
  tpu7x:4x4x2 as 16x4, GPT-3 at 0.60 ms 1.10x. On a 32-head layer of 8 TensorCores the
  sites it would take are left to XLA, each saying why; GPT-3's (seq 2048) still take it.
  Planned with the mesh's own profile (none named). Planning only: nothing compiles."""
  pytest.importorskip("libtpu")
  import meshslice
  from meshslice.costmodel.autotune import ModelSpec
  mesh = aot.make_mesh("tpu7x:2x2x1", (2, 4))
  flags = aot.preset_flags("dense,async,all_to_all", "tpu7x")
  small = ModelSpec(name="32x128", heads=32, head_dim=128, seq=2048)
  step, params, batch = aot.model_step(small, mesh, batch=8, seq=2048)
  report = meshslice.explain(step, compiler_flags=flags)(params, batch)
  assert report.profile == "tpu-v7x" and not report.rewritten
  noted = [s for s in report.sites if "not the collective rewrite over a tie" in (s.note or "")]
  assert len(noted) == 12
  assert all(s.reason.startswith("left to XLA: the best rewrite (collective ") for s in noted)
  step, params, batch = aot.model_step("gpt3", mesh, batch=8)
  report = meshslice.explain(step, compiler_flags=flags)(params, batch)
  assert {s.rule for s in report.rewritten} == {"collective_over_xla"}
  assert len(report.rewritten) == 12


_READER = """
import jax, jax.numpy as jnp, json
jax.config.update("jax_platforms", "cpu")
from jax.sharding import NamedSharding, PartitionSpec as P
import meshslice
from meshslice import aot
from meshslice.costmodel import tpu_schedule as ts
mesh = aot.make_mesh("tpu7x:2x2x1", (2, 4))
s = NamedSharding(mesh, P("x", "y"))
f = jax.jit(lambda a, b: a @ b, in_shardings=(s, s), out_shardings=s)
x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=s)
fast = meshslice.transform(f, algorithm="meshslice", ksplit=2, profile="tpu-v7x")
c, _ = aot.compile(fast, x, x, mesh=mesh)
r = aot.analyze(c, "tpu-v7x", mesh_shape=(2, 4))
ops = [op for op in r.schedule.expanded() if op.collective]
print("RESULT", json.dumps({
    "ops": [[op.kind, op.collective, op.opcode, list(op.group), op.link, op.emitter,
             op.ring_dims, op.partner, op.between_cycles] for op in ops],
    "step_s": r.simulation.step_s, "compute_s": r.simulation.compute_s,
    "clock": r.simulation.clock_hz, "profile": r.simulation.profile,
    "async": r.summary.async_collectives, "sync": r.summary.sync_collectives}))
"""


def test_recommended_flags_compile_and_the_reader_reads_offloaded_collectives():
  """TPU7X_FLAGS in a fresh process: libtpu 0.0.42.1 takes them, the sliced program's
  all-gathers run on the SparseCore (call-start / call-done), and the reader pairs them,
  names the ring (the minor axis's ring through both cores of each chip) and times them."""
  pytest.importorskip("libtpu")
  out, result = _flag_process(_READER, " ".join(backend_flags.TPU7X_FLAGS))
  assert result is not None, out.stderr[-3000:]
  ops = result["ops"]
  # libtpu 0.0.50 starts an offloaded collective with a call-update after an
  # operand-less call-start (the reader takes the update as the start)
  starts_by = "call-update" if any(o == "call-update" for _, _, o, *_ in ops) else "call-start"
  assert {(k, c, o) for k, c, o, *_ in ops} == {("start", "all-gather", starts_by),
                                                ("done", "all-gather", "call-done")}
  starts = [op for op in ops if op[0] == "start"]
  assert len(starts) == 4 and result["async"] == 4 and result["sync"] == 0
  assert all(op[7] for op in starts)                              # paired with a done
  assert any(op[8] > 0 for op in starts)                          # a partial dot under it
  minor = [op for op in starts if op[3] == [0, 1, 2, 3]]
  major = [op for op in starts if op[3] == [0, 4]]
  assert minor and major and all(op[4] == 1 for op in minor) and all(op[4] == 0 for op in major)
  assert all(op[5].startswith("SparseCoreOffload{") and op[5].endswith("+core pair}")
             for op in minor)
  assert all("+core pair" not in op[5] and op[6] == 1 for op in major)
  assert (result["clock"], result["profile"]) == (2.2e9, "tpu-v7x@2x4")
  assert result["step_s"] > result["compute_s"] > 0


def test_libtpu_refuses_the_chip_config_flag_maxtext_sets():
  """MaxText's SparseCore group ends in `--2a886c8_chip_config_name=megachip_tccontrol`,
  which libtpu 0.0.42.1 does not know: the process aborts as soon as libtpu loads."""
  pytest.importorskip("libtpu")
  code = ("import jax; jax.config.update('jax_platforms', 'cpu'); from meshslice import aot; "
          "print('RESULT', len(aot.topology('tpu7x:2x2x1').devices))")
  out, result = _flag_process(code, "--2a886c8_chip_config_name=megachip_tccontrol",
                              timeout=120)
  assert result is None and out.returncode != 0
  assert "Unknown command line flag '2a886c8_chip_config_name'" in out.stderr + out.stdout


def test_aot_cli_on_tpu7x(tmp_path):
  """`python -m meshslice aot` on Ironwood, the smallest model the CLI has (the tiny
  whole-step preset, one layer: 68 collectives, 42 async; libtpu compiles it in ~15 s,
  where the layer step's smallest, gpt3 at 32 tokens, took ~40 s: its 12288-wide
  weights): the rewrite's variant only, planned and simulated with tpu-v7x, compiled
  under TPU7X_FLAGS. The layer step's own TPU compile is bench/tpu_models.py's
  (test_bench_models), its path through the CLI test_fresh_process's."""
  pytest.importorskip("libtpu")
  out = tmp_path / "rows.json"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "meshslice", "aot", "--whole", "--model", "tiny", "--layers",
       "1", "--topology", "tpu7x:2x2x1", "--mesh", "2x4", "--variants", "meshslice",
       f"--json={out}"],
      capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  row = json.loads(out.read_text())["meshslice"]
  assert row["ici_profile"] == "tpu-v7x@2x4" and row["step_s"] > row["compute_s"] > 0
  assert row["flags"] == " ".join(backend_flags.TPU7X_FLAGS)
  assert row["async_collectives"] > 0                       # offloaded to the SparseCore
  assert ("tiny whole step (embeddings, 1 layer(s), fwd+bwd, loss, Adam) on tpu7x:2x2x1"
          in proc.stdout)
  assert "meshslice report: mesh x=2 x y=4, profile tpu-v7x" in proc.stdout


_TUNE = """
import jax, json
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import meshslice
from meshslice import aot
mesh = aot.make_mesh("tpu7x:2x2x1", (2, 4))
# a two-matmul MLP step, every operand in the 2D layout (rows over x, columns over y):
# small enough that libtpu compiles it in seconds: 2 forward, 1 data- and 2 weight-
# gradient sites
def step(w1, w2, x):
  def loss(w1, w2):
    return jnp.mean(jnp.square(jnp.tanh(x @ w1) @ w2))
  g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
  return w1 - 0.1 * g1, w2 - 0.1 * g2
layout = NamedSharding(mesh, P("x", "y"))
step = jax.jit(step, in_shardings=(layout,) * 3, out_shardings=(layout,) * 2)
args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=layout)
        for s in ((1024, 2048), (2048, 1024), (2048, 1024))]
report = meshslice.explain(step, profile="tpu-v7x")(*args)
results = {}
plan = meshslice.tune(step, *args, mesh=mesh, refine=0, results=results,
                      candidates={"ksplit=2": {"algorithm": "meshslice", "ksplit": 2}})
with jax.set_mesh(mesh):
  tuned = meshslice.transform(step, plan=plan).explain(*args)
print("RESULT", json.dumps({
    "head": str(report).splitlines()[0], "sites": len(report.sites),
    "plan": len(plan.sites), "tuned": len(tuned.sites), "compiled": sorted(results),
    "chosen": [n for n, c in results.items() if c.plan == plan],
    "profiles": sorted({c.result.simulation.profile for c in results.values()}),
    "step_s": {n: c.step_s for n, c in results.items()},
    "sliced": sum(e.get("ksplit") == 2 for e in results["ksplit=2"].plan.sites),
    "flags": results["xla"].result.flags}))
"""


def test_tune_and_explain_on_tpu7x():
  """meshslice.explain and meshslice.tune on Ironwood (tpu7x:2x2x1 as 2x4: 4 chips, 8
  TensorCores), on a two-matmul MLP step (5 sites; libtpu compiles it in seconds, where
  the tiny whole step took ~16 s a program: `aot --whole` on tpu7x is
  test_aot_cli_on_tpu7x's): explain plans it with tpu-v7x, tune compiles XLA's program
  and one sliced candidate under TPU7X_FLAGS, simulates both with the 2x4 mesh's links,
  and returns the faster as a Plan that transform takes."""
  pytest.importorskip("libtpu")
  flags = " ".join(backend_flags.TPU7X_FLAGS)
  out, result = _flag_process(_TUNE, flags, timeout=600)
  assert result is not None, out.stderr[-3000:]
  assert result["head"].startswith("meshslice report: mesh x=2 x y=4, profile tpu-v7x; "
                                   "5 matmuls:")
  assert result["sites"] == result["plan"] == result["tuned"] == 5
  assert result["compiled"] == ["ksplit=2", "xla"] and result["sliced"] == 5
  assert result["profiles"] == ["tpu-v7x@2x4"] and result["flags"] == flags
  steps = result["step_s"]
  assert all(s > 0 for s in steps.values())
  assert result["chosen"] == [min(steps, key=lambda n: (steps[n], n != "xla"))]
