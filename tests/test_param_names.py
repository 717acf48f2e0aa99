"""Sites named by the parameter they read or make (issue 20 item 2): where JAX's name stack
holds no module names (plain-JAX params dicts, NNX, scan over stacked layers), the module
column is the parameter's path in the step's own pytrees, so an override can pin exactly
one projection; the pinned program still computes plain jit's values."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice.param_names import module_of_key_path

from helpers import assert_trees_close, mesh


def test_module_of_key_path_drops_positions_collections_and_leaf_names():
  assert module_of_key_path("[0]['params']['decoder']['layers']['mlp']['wo']['kernel']") \
      == "decoder/layers/mlp/wo"
  assert module_of_key_path("[1][0].mu['attn']['query']['kernel'].value") == "attn/query"
  assert module_of_key_path("[0][2]") == ""            # a data input: no module


def _stacked_mlp_step(msh):
  s = NamedSharding(msh, P("x", "y"))
  layers = 3

  def loss(params, x):
    def layer(h, p):
      h = jnp.tanh(h @ p["mlp"]["wi"])
      return h @ p["mlp"]["wo"], None
    h, _ = jax.lax.scan(layer, x, params["layers"])
    return jnp.mean(h ** 2)

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  stacked = NamedSharding(msh, P(None, "x", "y"))
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"layers": {"mlp": {
      "wi": jax.device_put(jax.random.normal(keys[0], (layers, 64, 128)) / 8, stacked),
      "wo": jax.device_put(jax.random.normal(keys[1], (layers, 128, 64)) / 11, stacked)}}}
  x = jax.device_put(jax.random.normal(keys[2], (32, 64)), s)
  return jax.jit(step), params, x


def test_scanned_layers_are_named_by_their_stacked_parameters():
  step, params, x = _stacked_mlp_step(mesh((2, 4)))
  report = meshslice.explain(step)(params, x)
  modules = [s.module for s in report.sites]
  assert sorted(set(modules)) == ["layers/mlp/wi", "layers/mlp/wo"]
  # the forward, backward-data and weight-gradient matmul of each
  assert modules.count("layers/mlp/wo") == 3 and modules.count("layers/mlp/wi") == 3
  fast = meshslice.transform(step, overrides={"layers/mlp/wo": {"ksplit": 2}})
  pinned = fast.explain(params, x)
  assert {s.module for s in pinned.sites if s.ksplit == 2} == {"layers/mlp/wo"}
  assert sum(s.ksplit == 2 for s in pinned.sites) == 3
  (new, value), (ref_new, ref_value) = fast(params, x), step(params, x)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(new, ref_new)
  # an unsharded float64 forward pass
  h = np.asarray(x, np.float64)
  for wi, wo in zip(np.asarray(params["layers"]["mlp"]["wi"], np.float64),
                    np.asarray(params["layers"]["mlp"]["wo"], np.float64)):
    h = np.tanh(h @ wi) @ wo
  np.testing.assert_allclose(value, np.mean(h ** 2), rtol=1e-4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Labelled:
  """A variable that names itself, as penzai's ParameterValue does."""
  value: jax.Array
  label: str = dataclasses.field(metadata=dict(static=True))


def test_labelled_variables_name_their_matmuls_over_index_only_scopes():
  # penzai keeps parameters in a flat tuple (positions name nothing) and scopes each
  # Sequential sublayer by its index: the label must name the site
  m = mesh((2, 4))
  x = jax.device_put(jnp.ones((16, 32)), NamedSharding(m, P("x", "y")))
  params = (_Labelled(jax.device_put(jnp.ones((32, 64)), NamedSharding(m, P("x", "y"))),
                      "transformer/block_0/mlp/gating_linear.weights"),
            _Labelled(jax.device_put(jnp.ones((64, 32)), NamedSharding(m, P("x", "y"))),
                      "transformer/block_0/mlp/out_linear.weights"))

  @jax.jit
  def step(params, x):
    def loss(params):
      with jax.named_scope("1"), jax.named_scope("0"):
        h = jnp.tanh(x @ params[0].value)
      with jax.named_scope("1"), jax.named_scope("1"):
        return jnp.sum(h @ params[1].value)
    return jax.grad(loss)(params)

  report = meshslice.explain(step)(params, x)
  modules = {s.module for s in report.sites}
  assert modules == {"transformer/block_0/mlp/gating_linear",
                     "transformer/block_0/mlp/out_linear"}, modules
  # a name stack with names keeps priority over the parameter
  @jax.jit
  def named(params, x):
    with jax.named_scope("mlp"):
      return x @ params[0].value

  assert {s.module for s in meshslice.explain(named)(params, x).sites} == {"mlp"}
