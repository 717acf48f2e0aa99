"""Module paths of NNX steps and of lists of layers: an `nnx.jit` step (graph mode, with
or without graph updates, and tree mode) is named by its parameters' attribute paths, as
`jax.jit` over `nnx.split` state is (`up`, `down`; not NNX's containers `states`,
`_values`, `__state__`), for forward and weight-gradient sites alike; a list of layers is
named per position (`layers/1/mlp/wo`), while a pattern without positions
(`layers/mlp/wo`) still matches every layer's site. Pinned programs compute the
untransformed step's values."""
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice.param_names import module_of_key_path

from helpers import assert_trees_close, mesh

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")


# -- the naming rule and the matching rule ---------------------------------------------------

def test_positions_are_kept_after_a_name_and_dropped_elsewhere():
  assert module_of_key_path("[0]['layers'][1]['mlp']['wo']['kernel']") == "layers/1/mlp/wo"
  # its optimizer state names the same module (argument and chain positions name nothing)
  assert module_of_key_path("[1][0].mu['layers'][1]['mlp']['wo']['kernel']") \
      == "layers/1/mlp/wo"
  assert module_of_key_path("[0][1].opt_state[0].mu['down']['kernel'].value") == "down"
  # NNX tree mode: attributes; `.value` is the Variable's array only at the end
  assert module_of_key_path("[0][0].layers[0].down.kernel.value") == "layers/0/down"
  assert module_of_key_path("[0][0].attn.value.kernel.value") == "attn/value"
  # layers stacked along a leading axis (scan) are one parameter: one name
  assert module_of_key_path("[0]['layers']['mlp']['wo']['kernel']") == "layers/mlp/wo"


def test_patterns_match_the_whole_path_or_the_path_without_positions():
  from meshslice.param_names import module_matches
  for pattern in ("layers/1/mlp/wo", "layers/1/*", "layers/mlp/wo", "*/mlp/wo",
                  "layers/*/wo", "*wo"):
    assert module_matches("layers/1/mlp/wo", pattern), pattern
  for pattern in ("layers/0/*", "mlp/wo", "layers/mlp", "wo"):
    assert not module_matches("layers/1/mlp/wo", pattern), pattern
  # tune's HeldGathers / SlicedSites(modules=...) match alike
  tune = importlib.import_module("meshslice.tune")      # (meshslice.tune: the function)
  assert tune._module_matches("layers/1/mlp/wo", ("layers/mlp/wo",))
  assert not tune._module_matches("layers/1/mlp/wo", ("layers/0/mlp/wo",))


# -- a list of layers in a params tree -------------------------------------------------------

def _layer_list_step(msh):
  s = NamedSharding(msh, P("x", "y"))
  keys = jax.random.split(jax.random.key(0), 5)
  layers = [{"mlp": {"wi": jax.device_put(jax.random.normal(keys[2 * k], (64, 128)) / 8, s),
                     "wo": jax.device_put(jax.random.normal(keys[2 * k + 1], (128, 64)) / 11,
                                          s)}}
            for k in range(2)]
  x = jax.device_put(jax.random.normal(keys[4], (32, 64)), s)

  def loss(params, x):
    h = x
    for p in params["layers"]:
      h = jnp.tanh(h @ p["mlp"]["wi"]) @ p["mlp"]["wo"]
    return jnp.mean(h ** 2)

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  return jax.jit(step), {"layers": layers}, x


def test_a_list_of_layers_is_named_per_position_and_pinned_per_layer():
  step, params, x = _layer_list_step(mesh((2, 4)))
  report = meshslice.explain(step)(params, x)
  modules = [s.module for s in report.sites]
  assert set(modules) == {"layers/0/mlp/wi", "layers/0/mlp/wo", "layers/1/mlp/wi",
                          "layers/1/mlp/wo"}, modules
  # forward, backward-data and weight gradient of each layer's wo
  assert modules.count("layers/0/mlp/wo") == modules.count("layers/1/mlp/wo") == 3
  sites_of = lambda name: {s.index for s in report.sites if s.module == name}

  # one layer pinned by its position: only its sites change
  fast = meshslice.transform(step, overrides={"layers/1/mlp/wo": {"ksplit": 2}})
  pinned = fast.explain(params, x)
  assert {s.index for s in pinned.sites if s.ksplit == 2} == sites_of("layers/1/mlp/wo")
  for old, new in zip(report.sites, pinned.sites):
    if new.module != "layers/1/mlp/wo":
      assert (new.algorithm, new.ksplit) == (old.algorithm, old.ksplit), new.module
  (new_params, value), (ref_params, ref_value) = fast(params, x), step(params, x)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(new_params, ref_params)

  # patterns written without positions match every layer, as before
  for pattern in ("layers/mlp/wo", "*/mlp/wo"):
    every = meshslice.transform(step, overrides={pattern: {"ksplit": 2}}).explain(params, x)
    assert {s.index for s in every.sites if s.ksplit == 2} \
        == sites_of("layers/0/mlp/wo") | sites_of("layers/1/mlp/wo"), pattern


def test_a_plan_saved_without_positions_still_applies(tmp_path):
  # plans saved before positions were named record 'layers/mlp/wo'
  step, params, x = _layer_list_step(mesh((2, 4)))
  plan = meshslice.explain(step)(params, x).plan.edit(0, ksplit=2)
  data = json.loads(plan.to_json())
  assert {e["module"] for e in data["sites"]} >= {"layers/0/mlp/wo", "layers/1/mlp/wo"}
  for entry in data["sites"]:
    entry["module"] = "/".join(p for p in entry["module"].split("/") if not p.isdigit())
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(data))
  replanned = meshslice.transform(step, plan=str(path)).explain(params, x)
  assert replanned.sites[0].ksplit == 2
  # a plan of another module is still refused
  data["sites"][0]["module"] = "layers/attn"
  path.write_text(json.dumps(data))
  with pytest.raises(meshslice.errors.PlanError, match="plan does not match"):
    meshslice.transform(step, plan=str(path)).explain(params, x)


# -- nnx.jit, graph and tree mode ------------------------------------------------------------

_OUT = P("x", "y")


def _kernel():
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), ("x", "y"))


class Block(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(32, 64, use_bias=False, kernel_init=_kernel(), rngs=rngs)
    self.down = nnx.Linear(64, 32, use_bias=False, kernel_init=_kernel(), rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x, out_sharding=_OUT)), out_sharding=_OUT)


class Stack(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([Block(rngs), Block(rngs)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def _train_step(model, optimizer, x):
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
  optimizer.update(model, grads)
  return loss


def _model(kind=Block):
  model = kind(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _named(report):
  """(module, weight gradient?) per site, in program order."""
  return [(s.module, s.swapped) for s in report.sites]


@pytest.mark.parametrize("mode", [{}, {"graph_updates": False}, {"graph": False}],
                         ids=["graph", "graph-no-updates", "tree"])
def test_nnx_jit_sites_are_named_by_their_parameters_and_pinned_by_them(mode):
  with jax.set_mesh(mesh((2, 4), explicit=True)):
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), _OUT)
    model, optimizer = _model()
    step = nnx.jit(_train_step, **mode)
    report = meshslice.explain(step)(model, optimizer, x)
    forward = {s.module for s in report.sites if s.direction == "forward"}
    weight_grads = sorted(s.module for s in report.sites if s.swapped)
    assert forward == {"up", "down"} and weight_grads == ["down", "up"], _named(report)
    assert {s.module for s in report.sites} == {"up", "down"}
    assert " down " in str(report)
    assert not {"states", "_values", "__state__"} & set(str(report).split())

    # the names `jax.jit` over `nnx.split` state gets, site for site
    graphdef, state = nnx.split(model)

    @jax.jit
    def functional(state, x):
      return jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))(state)

    assert sorted(_named(meshslice.explain(functional)(state, x))) == sorted(_named(report))

    # one projection pinned by name: exactly its forward, input- and weight-gradient sites
    fast = meshslice.transform(step, overrides={"down": {"ksplit": 2, "hold_gathers": True}})
    pinned = fast.explain(model, optimizer, x)
    down = {s.index for s in report.sites if s.module == "down"}
    assert len(down) == 3
    assert {s.index for s in pinned.sites if s.ksplit == 2} == down
    assert [(s.module, s.swapped) for s in pinned.sites if s.hold_gathers] == [("down", True)]
    for old, new in zip(report.sites, pinned.sites):
      if new.module != "down":
        assert (new.algorithm, new.ksplit, new.hold_gathers) == (
            old.algorithm, old.ksplit, old.hold_gathers)

    # the pinned step trains the model as the untransformed one does
    runs = []
    for wrapped in (fast, step):
      model, optimizer = _model()
      losses = [float(wrapped(model, optimizer, x)) for _ in range(2)]
      runs.append((losses, nnx.state(model, nnx.Param)))
  (losses, state), (ref_losses, ref_state) = runs
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert losses[1] < losses[0]
  assert_trees_close(state, ref_state)


def test_nnx_list_of_layers_is_named_per_position():
  with jax.set_mesh(mesh((2, 4), explicit=True)):
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), _OUT)
    model, optimizer = _model(Stack)
    step = nnx.jit(_train_step)
    report = meshslice.explain(step)(model, optimizer, x)
    assert {s.module for s in report.sites} == {"layers/0/up", "layers/0/down",
                                               "layers/1/up", "layers/1/down"}
    assert sorted(s.module for s in report.sites if s.swapped) == [
        "layers/0/down", "layers/0/up", "layers/1/down", "layers/1/up"]
    one = meshslice.transform(step, overrides={"layers/1/down": {"ksplit": 2}})
    assert {s.module for s in one.explain(model, optimizer, x).sites if s.ksplit == 2} \
        == {"layers/1/down"}
    every = meshslice.transform(step, overrides={"layers/down": {"ksplit": 2}})
    assert {s.module for s in every.explain(model, optimizer, x).sites if s.ksplit == 2} \
        == {"layers/0/down", "layers/1/down"}
