"""Plans as data (JSON round trip, editing, applying) and per-site overrides."""
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import assert_trees_close, mesh


def _mlp(x, w1, w2):
  return jnp.sum(jnp.tanh(x @ w1) @ w2)


def _program(shape=(2, 4)):
  msh = mesh(shape)
  s = NamedSharding(msh, P("x", "y"))
  args = tuple(jax.device_put(jax.random.normal(jax.random.key(i), sh) / 8, s)
               for i, sh in enumerate([(16, 64), (64, 128), (128, 64)]))
  return jax.jit(jax.grad(_mlp, argnums=(1, 2)), in_shardings=(s, s, s)), args


def test_plan_round_trips_and_applies(tmp_path):
  f, args = _program()
  report = meshslice.explain(f)(*args)
  plan = report.plan
  path = tmp_path / "plan.json"
  plan.save(str(path))
  loaded = meshslice.Plan.load(str(path))
  assert loaded == plan and loaded.to_json() == plan.to_json()
  edited = loaded.edit(0, ksplit=8).edit(3, algorithm="collective")
  out = meshslice.explain(f, plan=edited)(*args)
  assert out.sites[0].ksplit == 8
  assert (out.sites[3].algorithm, out.sites[3].ksplit) == ("collective", 1)
  assert [s.ksplit for s in out.sites[1:3]] == [s.ksplit for s in report.sites[1:3]]
  assert_trees_close(meshslice.transform(f, plan=str(path))(*args), f(*args))
  alone = meshslice.explain(f, plan=loaded.edit(1, rewrite=False))(*args)
  assert alone.sites[1].reason == "left alone as requested (override or plan)"


def test_edited_plans_with_bool_pins_save_and_load(tmp_path):
  """rewrite=False (what every plan of `meshslice.tune` holds) and hold_gathers survive
  the JSON round trip and apply the same after it."""
  f, args = _program()
  plan = meshslice.explain(f)(*args).plan.edit(1, rewrite=False).edit(2, hold_gathers=True)
  path = tmp_path / "plan.json"
  plan.save(str(path))
  loaded = meshslice.Plan.load(str(path))
  assert loaded == plan
  assert loaded.pin_for(1) == {"rewrite": False}
  assert loaded.pin_for(2)["hold_gathers"] is True
  assert meshslice.explain(f, plan=loaded)(*args).sites[1].reason == (
      "left alone as requested (override or plan)")


def test_malformed_and_mismatched_plans(tmp_path):
  f, args = _program()
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match=r"plan file '.*bad.json' is not valid JSON"):
    meshslice.transform(f, plan=str(bad))
  data = json.loads(meshslice.explain(f)(*args).plan.to_json())
  del data["sites"][2]["source"]
  bad.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=re.escape("sites[2] is missing field 'source'")):
    meshslice.transform(f, plan=str(bad))
  data["sites"][2]["source"] = "elsewhere.py:1"
  bad.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=re.escape(
      "plan does not match this program: site #2 was a matmul at 'elsewhere.py:1'")):
    meshslice.explain(f, plan=str(bad))(*args)
  with pytest.raises(ValueError, match="plan must be a meshslice.Plan or the path"):
    meshslice.transform(f, plan=3)


def test_overrides_by_index_and_location():
  f, args = _program()
  line = _mlp.__code__.co_firstlineno + 1
  overrides = {0: {"ksplit": 2}, f"test_plans.py:{line}": {"algorithm": "collective"}}
  report = meshslice.explain(f, overrides=overrides)(*args)
  assert all(s.algorithm == "collective" for s in report.sites)   # every site is on that line
  report = meshslice.explain(f, overrides={0: {"ksplit": 2}, 4: {"rewrite": False}})(*args)
  assert report.sites[0].ksplit == 2 and not report.sites[4].rewritten
  with pytest.raises(ValueError, match=re.escape("ksplit=3 does not fit site #0")):
    meshslice.explain(f, overrides={0: {"ksplit": 3}})(*args)
  # a dataflow the layouts do not give is reached by resharding an operand first
  pinned = meshslice.explain(f, overrides={0: {"dataflow": "ls"}})(*args).sites[0]
  assert pinned.dataflow == "ls" and "ls instead of os: reshards rhs" in pinned.note
  with pytest.raises(ValueError, match=re.escape("overrides[0] has unknown key 'slices'")):
    meshslice.transform(f, overrides={0: {"slices": 2}})


def test_unservable_algorithm_falls_back_or_errors_when_pinned():
  f, args = _program((2, 4))
  report = meshslice.explain(f, algorithm="cannon")(*args)
  assert {s.algorithm for s in report.rewritten} <= {"meshslice", "collective"}
  assert report.sites[0].note == (
      "cannon needs a square mesh (R == C), got 2x4 over ('x', 'y'); use meshslice, wang or "
      "summa on this mesh; chose among collective, meshslice")
  with pytest.raises(ValueError, match=re.escape("algorithm='cannon' cannot serve site #0 (")):
    meshslice.explain(f, overrides={0: {"algorithm": "cannon"}})(*args)


def test_plans_are_identical_across_processes(tmp_path):
  script = textwrap.dedent("""
      import os, sys
      os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
      import jax
      jax.config.update("jax_platforms", "cpu")
      import meshslice
      from meshslice.gpt import ModelConfig, make_mesh, make_step
      from jax.sharding import NamedSharding, PartitionSpec as P
      from meshslice.gpt import param_specs, batch_specs, init_params, init_batch
      cfg = ModelConfig(layers=1, batch=4, seq=16, hidden=64, heads=4, ffn=128)
      mesh = make_mesh((2, 4))
      abstract = lambda tree, specs: jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
          tree, specs)
      shapes = lambda init: jax.eval_shape(lambda k: init(cfg, k), jax.random.key(0))
      params = abstract(shapes(init_params), param_specs())
      batch = abstract(shapes(init_batch), batch_specs())
      sys.stdout.write(meshslice.explain(make_step(cfg, mesh))(params, batch).plan.to_json())
  """)
  outs = []
  for seed in ("1", "2"):
    env = dict(os.environ, PYTHONHASHSEED=seed)
    outs.append(subprocess.run([sys.executable, "-c", script], env=env, check=True,
                               capture_output=True, text=True).stdout)
  assert outs[0] == outs[1] and '"rewritten": true' in outs[0]


def test_predicted_timeline_trace(tmp_path):
  f, args = _program()
  report = meshslice.explain(f, ksplit=2)(*args)
  assert all(s.predicted_seconds > 0 and s.baseline_seconds > 0 for s in report.rewritten)
  assert report.predicted_seconds == pytest.approx(
      sum(s.predicted_seconds for s in report.rewritten))
  assert "total predicted for the rewritten sites" in str(report)
  path = tmp_path / "trace.json"
  report.write_trace(str(path))
  events = json.loads(path.read_text())["traceEvents"]
  spans = [e for e in events if e.get("ph") == "X"]
  assert spans and all(e["dur"] >= 0 for e in spans)
  names = {e["name"] for e in spans}
  assert any("all" in n.lower() or "gather" in n.lower() for n in names)


def test_profile_without_overlap_never_slices(tmp_path):
  # GPT-3-sized abstract operands: on tpu-v4 slicing pays; on a backend whose collectives
  # cannot overlap computation (the CPU profile says overlap: false) it never does
  from meshslice.costmodel import load_profile, save_profile
  import dataclasses
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s)
  args = (spec((16384, 12288)), spec((12288, 49152)), spec((49152, 12288)))
  f = jax.jit(_mlp)
  tpu = meshslice.explain(f)(*args)
  assert {(x.algorithm, x.ksplit > 1) for x in tpu.rewritten} == {("meshslice", True)}
  serial = dataclasses.replace(load_profile("tpu-v4"), name="tpu-v4-serial", overlap=False)
  path = tmp_path / "serial.json"
  save_profile(serial, str(path))
  assert load_profile(str(path)).overlap is False
  report = meshslice.explain(f, profile=str(path))(*args)
  assert {(x.algorithm, x.ksplit) for x in report.rewritten} == {("collective", 1)}
  assert load_profile("cpu").overlap is False
  data = json.loads(path.read_text())
  data["overlap"] = "no"
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=re.escape("profile: ") + r".*field 'overlap' must be "
                     "true or false, got 'no'"):
    meshslice.transform(f, profile=str(path))


def test_saved_plan_reapplies_to_swapped_weight_gradients():
  # A weight gradient planned on swapped operands (rs, S=2) whose unswapped form cannot
  # take S=2: the plan must still apply (found by examples/maxtext_style_step.py).
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
  import maxtext_style_step as example
  from jax.sharding import AxisType
  msh = jax.make_mesh((1, 2, 4), ("data", "x", "y"), axis_types=(AxisType.Auto,) * 3,
                      devices=jax.devices()[:8])
  step, abstract, _, _ = example.make_step(example.TINY, msh)
  report = meshslice.explain(step, ksplit=2)(*abstract)
  swapped = [s for s in report.rewritten if s.swapped and s.ksplit == 2]
  assert swapped
  again = meshslice.explain(step, plan=report.plan)(*abstract)
  assert again.plan.to_json() == report.plan.to_json()


def test_repeated_sites_are_planned_once_and_keep_their_own_identity():
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=s)
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=s)

  def two_layers(x, w):
    h = x @ w
    return h @ w

  report = meshslice.explain(jax.jit(two_layers), overrides={1: {"ksplit": 2}})(x, w)
  first, second = report.sites
  assert (first.index, second.index) == (0, 1)
  assert first.source != second.source
  assert (first.ksplit, second.ksplit) == (1, 2)     # different requests, different plans
  plain = meshslice.explain(jax.jit(two_layers))(x, w)
  assert plain.sites[0].source != plain.sites[1].source
  assert dataclasses.replace(plain.sites[1], index=0, path=plain.sites[0].path,
                             source=plain.sites[0].source) == plain.sites[0]
