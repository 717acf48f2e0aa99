"""The API surface keeps its promises (issue 8): transform under outer transformations,
`.lower().compile()` like jax.jit, no silent no-ops, abstract meshes, and inputs that are
never dropped silently (overrides, plans) nor answered with bare Python errors."""
import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice.__main__ import main as cli

from helpers import assert_trees_close, mesh


def _arrays(msh, m=16, k=64, n=128):
  s = NamedSharding(msh, P("x", "y"))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (m, k)), s)
  w = jax.device_put(jax.random.normal(jax.random.key(1), (k, n)) / 8, s)
  return s, x, w


def _has_shard_map(closed) -> bool:
  return "shard_map" in str(closed)


# -- 2: Explicit mode under any outer transformation ---------------------------------------

def test_explicit_mode_under_outer_transformations():
  msh = mesh((2, 4), explicit=True)
  s, x, w = _arrays(msh)

  def f(x, w):
    return jnp.sum(jnp.tanh(jnp.matmul(x, w, out_sharding=s)) ** 2)

  with jax.set_mesh(msh):
    for outer in (jax.make_jaxpr, jax.jit, jax.grad, jax.eval_shape):
      fast = meshslice.transform(f, ksplit=2)      # fresh: first traced under `outer`
      (outer(fast)(x, w) if outer is not jax.eval_shape else outer(fast, x, w))
    # the README's line: jax.make_jaxpr(fast_step)(params, batch)
    assert _has_shard_map(jax.make_jaxpr(fast)(x, w))
    np.testing.assert_allclose(jax.jit(fast)(x, w), f(x, w), rtol=1e-5)
    assert_trees_close(jax.grad(fast, argnums=(0, 1))(x, w), jax.grad(f, argnums=(0, 1))(x, w))
    shape = jax.eval_shape(fast, x, w)
    assert shape.shape == () and shape.dtype == jnp.float32
    xs = jax.device_put(jnp.stack([x, 2 * x, -x]), NamedSharding(msh, P(None, "x", "y")))
    assert_trees_close(jax.vmap(fast, in_axes=(0, None))(xs, w),
                       jax.vmap(f, in_axes=(0, None))(xs, w))
  # without a mesh context: make_jaxpr and jit of the transformed function
  fast = meshslice.transform(f, ksplit=2)
  assert _has_shard_map(jax.make_jaxpr(fast)(x, w))
  np.testing.assert_allclose(jax.jit(fast)(x, w), f(x, w), rtol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_mesh_context_with_pjit_partition_specs():
  # EasyLM style: `with mesh:` around pjit(..., in_shardings=PartitionSpecs), then outer jits
  from jax.experimental.pjit import pjit
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)
  g = lambda x, w: jnp.sum(jnp.tanh(x @ w))
  with msh:
    step = pjit(g, in_shardings=(P("x", "y"), P("x", "y")))
    for outer in (jax.make_jaxpr, jax.jit, jax.grad):
      fast = meshslice.transform(step, ksplit=2)
      outer(fast)(x, w)
    assert len(fast.explain(x, w).rewritten) == 1
    assert _has_shard_map(jax.make_jaxpr(fast)(x, w))
    np.testing.assert_allclose(jax.jit(fast)(x, w), g(x, w), rtol=1e-5)
    assert_trees_close(jax.grad(fast)(x, w), jax.grad(g)(x, w))
    np.testing.assert_allclose(fast(x, w), g(x, w), rtol=1e-5)


# -- 3: .lower(...).compile() behaves like jax.jit's ---------------------------------------

def test_lower_compile_takes_and_returns_the_original_pytrees():
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)

  def f(inputs, scale, *, weights, square):
    y = jnp.tanh(inputs["x"] @ weights) * scale
    return {"y": y, "aux": (jnp.sum(y ** 2) if square else jnp.sum(y),)}

  jitted = jax.jit(f, static_argnums=1, static_argnames="square")
  fast = meshslice.transform(jitted, ksplit=2)
  lowered = fast.lower({"x": x}, 3.0, weights=w, square=True)
  assert "all-gather" in lowered.as_text() or "all_gather" in lowered.as_text()
  compiled = lowered.compile()
  reference = jitted.lower({"x": x}, 3.0, weights=w, square=True).compile()
  out, ref = compiled({"x": x}, weights=w), reference({"x": x}, weights=w)
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  assert_trees_close(out, ref)
  assert "all-gather" in compiled.as_text()
  assert compiled.cost_analysis() is not None and compiled.memory_analysis() is not None
  # called with another structure: the error jax.jit's own compiled program gives
  with pytest.raises(TypeError) as plain_error:
    reference({"x": x}, w)
  with pytest.raises(TypeError) as fast_error:
    compiled({"x": x}, w)
  assert str(fast_error.value) == str(plain_error.value)
  assert "does not match the input pytree" in str(fast_error.value)


# -- 4: no silent no-op under outer traces --------------------------------------------------

def test_inside_outer_jit_auto_mode_warns_once_and_reports_why():
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)
  f = lambda x, w: jnp.sum(jnp.tanh(x @ w))
  fast = meshslice.transform(f)
  reports = []

  def outer(x, w):
    reports.append(fast.explain(x, w))
    return fast(x, w)

  with pytest.warns(UserWarning, match=re.escape(
      "1 of 1 matmuls left alone: traced inside an outer JAX transformation (jit, grad, "
      "vmap, ...) whose input shardings are not visible here, so the operand layouts are "
      "unknown. Apply meshslice.transform to the outermost jitted step")):
    out = jax.jit(outer, in_shardings=(s, s))(x, w)
  np.testing.assert_allclose(out, f(x, w), rtol=1e-5)
  report = reports[0]
  assert report.mesh_shape == {"x": 2, "y": 4}
  assert report.sites[0].reason.startswith("operand sharding unknown")
  assert "note: 1 of 1 matmuls left alone: traced inside an outer JAX" in str(report)
  with warnings.catch_warnings():
    warnings.simplefilter("error")      # once per Transformed object
    jax.jit(outer)(x, 2 * w)


def test_committed_arrays_behind_grad_and_jit_without_in_shardings():
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)
  f = lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2)
  # a step jitted without in_shardings: the layouts come from the committed arrays
  report = meshslice.explain(jax.jit(f))(x, w)
  assert [site.dataflow for site in report.rewritten] == ["os"]
  # transform(f) inside jax.grad sees the committed arrays behind the grad tracers
  for fn in (f, jax.jit(f)):
    fast = meshslice.transform(fn, ksplit=2)
    reports = []

    def loss(w):
      reports.append(fast.explain(x, w))
      return fast(x, w)

    with warnings.catch_warnings():
      warnings.simplefilter("error")
      grad = jax.grad(loss)(w)
    assert [site.dataflow for site in reports[0].rewritten] == ["os"]
    assert not reports[0].notes
    assert_trees_close(grad, jax.grad(f, argnums=1)(x, w))


# -- 5: abstract meshes plan exactly like concrete ones -------------------------------------

def _plan_on(msh, explicit, shape_m=256):
  s = NamedSharding(msh, P("x", "y"))
  out = s if explicit else None

  def loss(x, w1, w2):
    h = jnp.tanh(jnp.matmul(x, w1, out_sharding=out))
    return jnp.sum(jnp.matmul(h, w2, out_sharding=out))

  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s)
  step = jax.jit(jax.grad(loss, argnums=(1, 2)))
  # no "leave it to XLA" candidate: planned for TPU (an AbstractMesh) the collective
  # sites would go to XLA, on CPU devices they are kept (costing.leave_to_xla)
  return meshslice.explain(step, xla_baseline="none")(
      spec((shape_m, 1024)), spec((1024, 4096)), spec((4096, 1024)))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_abstract_mesh_plans_like_a_concrete_mesh(kind):
  explicit = kind == AxisType.Explicit
  abstract = _plan_on(AbstractMesh((2, 4), ("x", "y"), axis_types=(kind, kind)), explicit)
  concrete = _plan_on(mesh((2, 4), explicit=explicit), explicit)
  assert len(abstract.rewritten) == len(abstract.sites) == 5
  assert str(abstract) == str(concrete)
  assert abstract.plan.to_json() == concrete.plan.to_json()
  # a 16x16 cluster planned from this 8-device machine
  big = _plan_on(AbstractMesh((16, 16), ("x", "y"), axis_types=(kind, kind)), explicit, 4096)
  assert big.mesh_shape == {"x": 16, "y": 16}
  # the layouts' own dataflows, unless the cost model chose another one after a reshard
  natural = [s.note.split(" instead of ")[1].split(":")[0] if " instead of " in s.note
             else s.dataflow for s in big.rewritten]
  assert sorted(natural) == ["ls", "os", "os", "rs", "rs"]


def test_running_on_an_abstract_mesh_asks_for_a_concrete_one():
  am = AbstractMesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  spec = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(am, P("x", "y")))
  fast = meshslice.transform(lambda a, b: a @ b.T)
  message = re.escape("cannot lower a program planned on an AbstractMesh (x=2 x y=4): running "
                      "or lowering needs a concrete jax.sharding.Mesh of devices")
  with pytest.raises(ValueError, match=message):
    fast.lower(spec, spec)
  with pytest.raises(ValueError, match=message.replace("lower", "call", 1)):
    fast(spec, spec)


# -- 11: overrides and plans are never dropped silently -------------------------------------

def _program(shape=(2, 4)):
  msh = mesh(shape)
  s, x, w = _arrays(msh, n=64)

  def f(x, w, v):
    h = jnp.tanh(x @ w)         # site 0: 2D (os)
    return jnp.sum(h @ v)       # site 1: runs locally, left alone

  v = jax.device_put(jnp.ones((64, 8)), NamedSharding(msh, P()))
  return jax.jit(f, in_shardings=(s, s, NamedSharding(msh, P())),
                 out_shardings=None), (x, w, v)


SEE = re.escape("see the site indexes and sources with print(meshslice.explain(fn)(*args))")


@pytest.mark.parametrize("key,message", [
    (7, r"overrides\[7\]: site index 7 matches no matmul of this program \(it has 2 sites, "
        r"indexes 0\.\.1\); " + SEE),
    ("nowhere.py:3", r"overrides\['nowhere.py:3'\]: source location 'nowhere.py:3' matches no "
                     r"matmul of this program \(it has 2 sites, indexes 0\.\.1\); " + SEE),
])
def test_overrides_matching_no_site_are_errors(key, message):
  f, args = _program()
  with pytest.raises(ValueError, match=message):
    meshslice.explain(f, overrides={key: {"ksplit": 2}})(*args)
  with pytest.raises(ValueError, match=message):
    meshslice.transform(f, overrides={key: {"rewrite": False}})(*args)


@pytest.mark.parametrize("key,message", [
    (-1, r"overrides key -1 is negative: site indexes count from 0 in program order; " + SEE),
    ("3", r"overrides key '3' is neither a site index \(int\) nor a source location "
          r"'file:line' \(e\.g\. 'model\.py:41'\); for site #3 use the int 3; " + SEE),
])
def test_malformed_override_keys_are_errors(key, message):
  with pytest.raises(ValueError, match=message):
    meshslice.transform(lambda a: a, overrides={key: {"ksplit": 2}})


@pytest.mark.parametrize("strict", [False, True])
def test_pins_on_sites_that_cannot_be_rewritten_are_errors(strict):
  f, args = _program()
  report = meshslice.explain(f)(*args)
  assert [s.rewritten for s in report.sites] == [True, False]
  with pytest.raises(ValueError, match=re.escape(
      "overrides[1] pins ksplit=2 on site #1 (") + r".*\), which cannot be rewritten: "
      + re.escape(report.sites[1].reason + ". Remove the pin (or pin {'rewrite': False}); ")
      + SEE):
    meshslice.explain(f, overrides={1: {"ksplit": 2}}, strict=strict)(*args)
  line = f"test_api_trust.py:{int(report.sites[1].source.rsplit(':', 1)[1])}"
  with pytest.raises(ValueError, match=re.escape(
      f"overrides[{line!r}] pins algorithm='collective' on site #1 (")):
    meshslice.explain(f, overrides={line: {"algorithm": "collective"}}, strict=strict)(*args)
  # asking to leave it alone is fine; so is a line pin that one matmul on the line honours
  meshslice.explain(f, overrides={1: {"rewrite": False}}, strict=strict)(*args)
  one_line = jax.jit(lambda x, w, v: jnp.sum(jnp.tanh(x @ w) @ v))
  line = meshslice.explain(one_line)(*args).sites[1].source.rsplit("/", 1)[1]
  pinned = meshslice.explain(one_line, overrides={line: {"ksplit": 2}}, strict=strict)(*args)
  assert [(s.rewritten, s.ksplit) for s in pinned.sites] == [(True, 2), (False, None)]
  with pytest.raises(ValueError, match=re.escape("plan site #1 pins algorithm='collective' on "
                                                 "site #1 (")):
    meshslice.explain(f, plan=report.plan.edit(1, algorithm="collective"))(*args)


def _plan_json(plan, edit):
  data = json.loads(plan.to_json())
  edit(data)
  return json.dumps(data)


def test_plans_for_another_mesh_or_with_bad_entries_are_errors():
  f24, args24 = _program((2, 4))
  f42, args42 = _program((4, 2))
  plan = meshslice.explain(f24)(*args24).plan
  with pytest.raises(ValueError, match=re.escape(
      "plan was made for mesh x=2 x y=4, this program runs on mesh x=4 x y=2: a plan only "
      "applies to the mesh shape it was made for; re-plan with meshslice.explain(...).plan "
      "on this mesh")):
    meshslice.explain(f42, plan=plan)(*args42)
  edited = meshslice.Plan.from_json(_plan_json(plan, lambda d: d["mesh_shape"].update(y=8)))
  with pytest.raises(ValueError, match=re.escape("plan was made for mesh x=2 x y=8, this program "
                                                 "runs on mesh x=2 x y=4")):
    meshslice.explain(f24, plan=edited)(*args24)
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match=re.escape(
        "plan: sites[0].ksplit must be a positive int (1 = no slicing) or null, got "
        f"{bad!r}") + "|" + re.escape(f"plan: sites[0].ksplit has the wrong type: {bad!r}")):
      meshslice.Plan.from_json(_plan_json(plan, lambda d: d["sites"][0].update(ksplit=bad)))
  with pytest.raises(ValueError, match=re.escape(
      "plan: site index 0 appears more than once; each site must have one entry")):
    meshslice.Plan.from_json(_plan_json(plan, lambda d: d["sites"].append(d["sites"][0])))
  with pytest.raises(ValueError, match=re.escape(
      "plan: field 'mesh_shape' must be an object {axis: size} with positive int sizes, got "
      "{'x': 2, 'y': 0}")):
    meshslice.Plan.from_json(_plan_json(plan, lambda d: d["mesh_shape"].update(y=0)))


# -- 12: errors name the argument, state the rule, suggest the fix --------------------------

@pytest.mark.parametrize("profile", [None, 3, {"name": "tpu-v4"}])
def test_bad_profile_type(profile):
  with pytest.raises(TypeError, match=re.escape(
      "profile must be a shipped hardware profile name (cpu, h100, tpu-v4, tpu-v5e, tpu-v5p, "
      "tpu-v6e, tpu-v7x), the path of a profile JSON file, or a "
      "meshslice.costmodel.HardwareProfile, "
      f"got {type(profile).__name__} {profile!r}; omit it for the default 'tpu-v4'")):
    meshslice.transform(lambda a: a, profile=profile)


def test_plan_api_errors(tmp_path):
  f, args = _program()
  plan = meshslice.explain(f)(*args).plan
  with pytest.raises(ValueError, match=re.escape(
      "Plan.edit(site 0): ksplit=None cannot be pinned; give a value (ksplit: a positive int")):
    plan.edit(0, ksplit=None)
  with pytest.raises(ValueError, match=re.escape("the plan has no site #5 (it has 2 sites: 0, 1)")):
    plan.edit(5, ksplit=2)
  with pytest.raises(TypeError, match=re.escape(
      "Plan.from_json expects the plan's JSON text (str), got NoneType; to read a plan file "
      "use Plan.load(path)")):
    meshslice.Plan.from_json(None)
  path = tmp_path / "plan.json"
  plan.save(str(path))
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(TypeError, match=re.escape(
        f"Plan.load expects the path of a plan JSON file (str or os.PathLike), got int {fd}; "
        "for JSON text use Plan.from_json(text)")):
      meshslice.Plan.load(fd)
    os.fstat(fd)            # the caller's file descriptor is still open
  finally:
    os.close(fd)
  assert meshslice.Plan.load(path) == plan      # a pathlib.Path is a path


@pytest.mark.parametrize("argv,message", [
    (["--ksplit", "0"], "error: --ksplit must be a positive int (1 = no slicing) or 'auto', "
                        "got '0'"),
    (["--ksplit", "many"], "error: --ksplit must be a positive int (1 = no slicing) or 'auto', "
                           "got 'many'"),
    (["--profile", "nope"], "error: --profile: unknown hardware profile 'nope'; known profiles: "
                            "cpu, h100"),
])
def test_demo_command_line_usage_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli(["demo"] + argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: python -m meshslice demo") and message in err
