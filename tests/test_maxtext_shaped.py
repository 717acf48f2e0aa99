"""A training step shaped like MaxText's, without MaxText (issue 20 item 3).

MaxText needs Python >= 3.12, jax >= 0.11.1 and about 250 packages, so the suite tests
the integration on a step of our own built the way MaxText builds its own
(`examples/maxtext_train.py` runs the real one by hand, docs/maxtext.md):

- a decoder whose parameters carry logical axis names ('embed', 'mlp', 'heads', ...),
  resolved by MaxText's default rules onto a (data, fsdp, tensor) = 1x2x4 mesh:
  activations [batch over (data, fsdp), ..., embed over tensor], kernels [embed over
  fsdp, mlp / heads / vocab over tensor];
- the layers stacked on a leading axis and run by `lax.scan` over a rematerialized
  (`jax.checkpoint`, remat_policy 'full') block;
- a train state like MaxText's TrainStateNNX as a pytree: {'model': parameters and an
  `Rngs`-like stream holding a typed PRNG key (`jax.random.key`), 'optimizer': step and
  optax state}, with the parameter paths MaxText gives (`decoder/layers/mlp/wo/kernel`);
- `train_step(state, data)` jitted as `maxtext_utils.get_functional_train_with_signature`
  jits it: in_shardings (state, batch), out_shardings (state, None), donate_argnums=0.

And the `source` column where no frame is the user's (MaxText's model is MaxText's own
code): the enclosing layer's line that calls the projection (`Attention.__call__`'s
`query = self.query_projection(...)`), not the one `dot_general` line all projections share.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import NamedSharding

import meshslice
from meshslice import aot

from helpers import mesh

LAYERS, BATCH, SEQ, EMBED, HEADS, HEAD_DIM, MLP, VOCAB = 2, 8, 8, 32, 4, 8, 64, 64
# MaxText's base.yml rules, the ones these shapes use (first mesh axis that exists wins)
RULES = (("activation_batch", ("data", "fsdp")), ("activation_embed", "tensor"),
         ("activation_mlp", "tensor"), ("activation_heads", "tensor"),
         ("activation_kv", None), ("activation_vocab", "tensor"), ("activation_length", None),
         ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv", None),
         ("vocab", "tensor"), ("norm", None), ("layers", None))
# parameter: (shape, logical axes) -- the per-layer ones get a leading 'layers' axis
LAYER_PARAMS = {
    "self_attention": {
        "query": ((EMBED, HEADS, HEAD_DIM), ("embed", "heads", "kv")),
        "key": ((EMBED, HEADS, HEAD_DIM), ("embed", "heads", "kv")),
        "value": ((EMBED, HEADS, HEAD_DIM), ("embed", "heads", "kv")),
        "out": ((HEADS, HEAD_DIM, EMBED), ("heads", "kv", "embed"))},
    "mlp": {"wi_0": ((EMBED, MLP), ("embed", "mlp")), "wi_1": ((EMBED, MLP), ("embed", "mlp")),
            "wo": ((MLP, EMBED), ("mlp", "embed"))},
    "pre_self_attention_layer_norm": {"scale": ((EMBED,), ("norm",))},
    "post_self_attention_layer_norm": {"scale": ((EMBED,), ("norm",))},
}
PROJECTIONS = ("self_attention/query", "self_attention/key", "self_attention/value",
               "self_attention/out", "mlp/wi_0", "mlp/wi_1", "mlp/wo")


def _spec(*logical):
  return nn_partitioning.logical_to_mesh_axes(logical, RULES)


def _is_leaf(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def _param_table():
  """{path: (shape, logical axes)} as nested dicts, each kernel under 'kernel', the
  layers' parameters stacked on a leading 'layers' axis (MaxText's scan_layers)."""
  stacked = lambda shape, axes: ((LAYERS, *shape), ("layers", *axes))
  layers = {block: {name: (stacked(*e) if name == "scale" else {"kernel": stacked(*e)})
                    for name, e in params.items()}
            for block, params in LAYER_PARAMS.items()}
  return {"token_embedder": {"embedding": ((VOCAB, EMBED), ("vocab", "embed"))},
          "decoder": {"layers": layers,
                      "decoder_norm": {"scale": ((EMBED,), ("norm",))},
                      "logits_dense": {"kernel": ((EMBED, VOCAB), ("embed", "vocab"))}}}


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * scale


def _dense_general(x, kernel, contract=1):
  """MaxText's DenseGeneral: the last `contract` dims of x against the kernel's first
  ones, by `lax.dot_general` (no einsum: nothing on JAX's name stack)."""
  dims = tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))
  return jax.lax.dot_general(x, kernel, (dims, ((), ())))


def _decoder_layer(constrain, x, layer):
  """MaxText's llama2 block: pre-norm attention and gated-SiLU MLP, residuals."""
  attn, mlp = layer["self_attention"], layer["mlp"]
  h = _rms_norm(x, layer["pre_self_attention_layer_norm"]["scale"])
  heads = lambda w: constrain(_dense_general(h, w["kernel"]),
                              "activation_batch", "activation_length", "activation_heads",
                              "activation_kv")
  q, k, v = heads(attn["query"]), heads(attn["key"]), heads(attn["value"])
  scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(HEAD_DIM)
  scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores, -1e9)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bnqk,bknh->bqnh", probs, v)
  x = x + constrain(_dense_general(out, attn["out"]["kernel"], contract=2),
                    "activation_batch", "activation_length", "activation_embed")
  h = _rms_norm(x, layer["post_self_attention_layer_norm"]["scale"])
  gate = (jax.nn.silu(_dense_general(h, mlp["wi_0"]["kernel"]))
          * _dense_general(h, mlp["wi_1"]["kernel"]))
  gate = constrain(gate, "activation_batch", "activation_length", "activation_mlp")
  return x + constrain(_dense_general(gate, mlp["wo"]["kernel"]), "activation_batch",
                       "activation_length", "activation_embed")


def _make_train_step(msh):
  """(jitted step, state shardings, data sharding, optimizer) on `msh`, the step jitted
  as MaxText's `get_functional_train_with_signature` asks: state and batch shardings in,
  state sharding out, the state donated."""
  constrain = lambda t, *axes: jax.lax.with_sharding_constraint(
      t, NamedSharding(msh, _spec(*axes)))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))

  def loss_fn(params, data):
    x = jnp.take(params["token_embedder"]["embedding"], data["inputs"], axis=0)
    x = constrain(x, "activation_batch", "activation_length", "activation_embed")
    block = jax.checkpoint(lambda c, layer: _decoder_layer(constrain, c, layer),
                           policy=jax.checkpoint_policies.nothing_saveable)
    x, _ = jax.lax.scan(lambda c, layer: (block(c, layer), None), x,
                        params["decoder"]["layers"])
    x = _rms_norm(x, params["decoder"]["decoder_norm"]["scale"])
    logits = constrain(_dense_general(x, params["decoder"]["logits_dense"]["kernel"]),
                       "activation_batch",
                       "activation_length", "activation_vocab")
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, data["targets"][..., None], axis=-1))

  def train_step(state, data):
    model, optimizer = state["model"], state["optimizer"]
    params = {k: v for k, v in model.items() if k != "rngs"}
    # an NNX Rngs stream: the step's dropout key is fold_in(key, count), count advances
    stream = model["rngs"]["dropout"]
    dropout_key = jax.random.fold_in(stream["key"], stream["count"])
    loss, grads = jax.value_and_grad(loss_fn)(params, data)
    updates, opt_state = tx.update(grads, optimizer["opt_state"], params)
    params = optax.apply_updates(params, updates)
    new_state = {"model": {**params, "rngs": {"dropout": {"key": stream["key"],
                                                          "count": stream["count"] + 1}}},
                 "optimizer": {"step": optimizer["step"] + 1, "opt_state": opt_state}}
    key_data = jax.random.key_data(dropout_key).astype(jnp.float32)
    return new_state, {"loss": loss, "key_sum": jnp.sum(key_data)}

  table = _param_table()
  param_sh = jax.tree.map(lambda e: NamedSharding(msh, _spec(*e[1])), table, is_leaf=_is_leaf)
  replicated = NamedSharding(msh, _spec())
  abstract_params = jax.tree.map(lambda e: jax.ShapeDtypeStruct(e[0], jnp.float32), table,
                                 is_leaf=_is_leaf)
  # the optimizer state's moments are laid out like their parameters (as MaxText's
  # get_abstract_state finds them), its counters replicated
  by_path = {jax.tree_util.keystr(path): sh
             for path, sh in jax.tree_util.tree_leaves_with_path(param_sh)}
  def like_param(path, _):
    text = jax.tree_util.keystr(path)
    return next((sh for p, sh in by_path.items() if text.endswith(p)), replicated)
  opt_sh = jax.tree_util.tree_map_with_path(like_param, jax.eval_shape(tx.init, abstract_params))
  state_sh = {"model": {**param_sh, "rngs": {"dropout": {"key": replicated,
                                                         "count": replicated}}},
              "optimizer": {"step": replicated, "opt_state": opt_sh}}
  data_sh = NamedSharding(msh, _spec("activation_batch", "activation_length"))
  step = jax.jit(train_step, in_shardings=(state_sh, data_sh), out_shardings=(state_sh, None),
                 donate_argnums=0)
  return step, state_sh, data_sh, tx


def _init_state(tx, state_sh, data_sh):
  table = _param_table()
  leaves, tree = jax.tree.flatten(table, is_leaf=_is_leaf)
  keys = jax.random.split(jax.random.key(0), len(leaves) + 1)
  params = jax.tree.unflatten(tree, [
      jnp.ones(shape) if axes[-1] == "norm" else jax.random.normal(k, shape) / np.sqrt(EMBED)
      for k, (shape, axes) in zip(keys, leaves)])
  state = {"model": {**params, "rngs": {"dropout": {"key": jax.random.key(7),
                                                    "count": jnp.uint32(0)}}},
           "optimizer": {"step": jnp.int32(0), "opt_state": tx.init(params)}}
  state = jax.device_put(state, state_sh)
  tokens = jax.random.randint(keys[-1], (BATCH, SEQ + 1), 0, VOCAB)
  data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  return state, jax.device_put(data, data_sh)


@pytest.fixture(scope="module")
def built():
  msh = mesh((1, 2, 4), ("data", "fsdp", "tensor"))
  step, state_sh, data_sh, tx = _make_train_step(msh)
  state, data = _init_state(tx, state_sh, data_sh)
  return step, state, data


def test_projections_are_2d_sites_named_by_parameter_path(built):
  step, state, data = built
  report = meshslice.explain(step)(state, data)
  assert str(report).startswith("meshslice report: mesh fsdp=2 x tensor=4 (+1 axis of size 1)")
  by_module = {}
  for s in report.sites:
    by_module.setdefault(s.module, []).append(s)
  for projection in PROJECTIONS:
    sites = by_module[f"decoder/layers/{projection}"]
    # one name for the forward matmul, its recompute in the backward pass (remat; XLA
    # drops it for mlp/wo, whose output the backward pass does not need), the
    # backward-data matmul and the weight gradient (reduce-scattered: an RS site)
    assert [s.direction for s in sites].count("forward") == 1
    assert len(sites) == (3 if projection == "mlp/wo" else 4), [s.index for s in sites]
    assert [s.dataflow for s in sites].count("rs") == 1
    assert all(s.rewritten and sorted(s.mesh_axes) == ["fsdp", "tensor"] for s in sites)
    assert {s.dataflow for s in sites} <= {"os", "ls", "rs"}
  assert all(s.context.startswith("scan") for s in by_module["decoder/layers/mlp/wo"])
  assert len(by_module["decoder/logits_dense"]) == 3
  # nothing is unknown: every matmul has its layouts
  assert not any("unknown" in s.reason for s in report.sites)


def test_a_module_override_pins_exactly_one_projection(built):
  step, state, data = built
  fast = meshslice.transform(step, overrides={"*/mlp/wo": {"ksplit": 2}})
  pinned = fast.explain(state, data)
  assert {s.module for s in pinned.sites if s.ksplit == 2} == {"decoder/layers/mlp/wo"}
  assert sum(s.ksplit == 2 for s in pinned.sites) == 3      # forward, backward, gradient


def test_a_ksplit_pin_another_dataflow_cannot_take_is_taken_by_the_sites_own(built):
  # the query projection's forward site is os; its ls alternative (after a reshard)
  # cannot take ksplit=2, which must rule out that alternative, not the pin
  step, state, data = built
  pinned = meshslice.explain(step, overrides={"*/self_attention/query": {"ksplit": 2}})(
      state, data)
  query = [s for s in pinned.sites if s.module == "decoder/layers/self_attention/query"]
  assert query and all(s.ksplit == 2 for s in query)
  assert {s.module for s in pinned.sites if s.ksplit == 2} == {
      "decoder/layers/self_attention/query"}


def test_transformed_step_matches_plain_jit_and_an_unsharded_run(built):
  """`check` runs the three programs (transformed with every projection sliced in two,
  plain jit, and the step on one device fed unsharded copies) and compares every output
  leaf: the updated parameters, Adam's moments (the gradients), the loss, and the
  dropout stream (keys compared bit for bit, by `key_data`). One run of the three, not
  a second set of compiles for a hand-written comparison."""
  step, state, data = built
  before = jax.tree.leaves(state)
  result = meshslice.check(step, ksplit=2)(state, data)
  assert result.ok, str(result)
  assert result.reference == "ran"
  assert len(result.report.sliced) >= 3 * len(PROJECTIONS)
  assert not any(a.is_deleted() for a in before)       # check copied the donated state
  leaves = {leaf.path: leaf for leaf in result.leaves}
  stream = "[0]['model']['rngs']['dropout']"
  key, count = leaves[f"{stream}['key']"], leaves[f"{stream}['count']"]
  assert "key<" in key.dtype and key.judged == "reference" and key.tolerance == 0
  assert count.judged == "reference" and count.tolerance == 0     # equal, not close
  # every parameter, moment and the loss is judged against the unsharded run (Adam's
  # update of a near-zero gradient, mlp/wi_0 here, by the reference's own sensitivity
  # or plain jit's distance to it, check's rules for ill-conditioned outputs), none
  # against plain jit alone
  floats = [l for l in result.leaves if "float" in l.dtype]
  assert floats and all(l.ok and l.vs_reference is not None and l.judged != "plain"
                        for l in floats)
  assert any(p.startswith("[0]['optimizer']") for p in leaves) and "[1]['loss']" in leaves


@pytest.mark.skipif(not aot.have_libtpu(), reason="libtpu not installed (pip install -e '.[tpu]')")
def test_aot_compiles_plain_and_transformed_for_a_small_tpu_topology():
  tpu = aot.make_mesh("v4:2x2x1", (1, 2, 2), ("data", "fsdp", "tensor"))
  step, state_sh, data_sh, tx = _make_train_step(tpu)
  shaped = jax.eval_shape(lambda: _init_state(tx, None, None))
  state, data = aot.abstract_args(shaped, (state_sh, {"inputs": data_sh, "targets": data_sh}))
  fast = meshslice.transform(step, profile="tpu-v4", ksplit=2)
  assert fast.explain(state, data).sliced
  results = {}
  for name, fn in (("plain", step), ("meshslice", fast)):
    compiled, seconds = aot.compile(fn, state, data, mesh=tpu)
    results[name] = aot.analyze(compiled, "tpu-v4", compile_s=seconds)
  assert all(r.summary.compute_cycles > 0 for r in results.values())
  assert "simulated step (ms)" in aot.format_table(results)


# -- the source column when no frame is the user's (MaxText's model is MaxText's code) ------

_FRAMEWORK = '''
class DenseGeneral:
  def __call__(self, x):
    return dot_general(x)

class Attention:
  def query_projection(self, x):
    return self.query(x)

  def __call__(self, x):
    query = self.query_projection(x)
    return query

def error_handler(*args):
  return fn(*args)

class Layer:
  def __call__(self, x):
    return error_handler(x)
'''


def _framework_code(root):
  """Code objects of `_FRAMEWORK` as if installed under `root`, by qualified name."""
  code = compile(_FRAMEWORK, f"{root}/fakefw/layers.py", "exec")
  found = {}
  def collect(c):
    found[c.co_qualname] = c
    for const in c.co_consts:
      if hasattr(const, "co_qualname"):
        collect(const)
  collect(code)
  return found


def test_the_source_falls_back_to_the_enclosing_layers_line_calling_the_projection():
  from meshslice import provenance
  code = _framework_code("/venv/lib/python3.12/site-packages")
  # innermost first: DenseGeneral.__call__ <- Attention.query_projection <- Attention.__call__
  chain = [code["DenseGeneral.__call__"], code["Attention.query_projection"],
           code["Attention.__call__"]]
  assert provenance.enclosing_layer_call(chain) == 2
  # a layer called straight from the enclosing layer's __call__ (RMSNorm in a decoder layer)
  assert provenance.enclosing_layer_call(chain[:1] + chain[2:]) == 1
  # dispatch through a wrapper function (Keras's Layer.__call__ -> error_handler ->
  # Operation.__call__): no layer line, JAX's own guess stays
  assert provenance.enclosing_layer_call(
      [code["DenseGeneral.__call__"], code["error_handler"], code["Layer.__call__"]]) is None
  # layers of the core libraries (flax, equinox, ...) are not a framework's model code
  import flax
  inside_flax = _framework_code(os.path.dirname(flax.__file__))
  assert provenance.enclosing_layer_call(
      [inside_flax["DenseGeneral.__call__"], inside_flax["Attention.__call__"]]) is None
