"""`meshslice.transform(step)` behaves like the `jax.jit` step it replaces (issue 19).

Each test runs the same thing on plain `jax.jit` and on the transformed step, side by
side: static-argument types, config contexts, meshes, compiler options, keep_unused,
donation, stages metadata, `.trace/.eval_shape/.clear_cache`, `jax.export`, error
messages, module names; values are checked against plain jit and an unsharded numpy run.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import assert_trees_close, mesh


def _arrays(msh, m=16, k=64, n=128):
  s = NamedSharding(msh, P("x", "y"))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (m, k)), s)
  w = jax.device_put(jax.random.normal(jax.random.key(1), (k, n)) / 8, s)
  return s, x, w


def _unsharded(x):
  return np.asarray(jax.device_get(x), dtype=np.float64)


def test_static_args_equal_in_value_but_not_in_type_trace_apart():
  msh = mesh((2, 4))
  _, x, w = _arrays(msh)

  def step(x, w, scale):
    return jnp.tanh(x @ w), jnp.asarray(scale)

  jitted = jax.jit(step, static_argnums=2)
  fast = meshslice.transform(jitted, ksplit=2)
  for scale in (1, 1.0, True):           # equal and same hash in Python
    out, ref = fast(x, w, scale), jitted(x, w, scale)
    assert out[1].dtype == ref[1].dtype, scale
    assert_trees_close(out[0], ref[0])
  np.testing.assert_allclose(fast(x, w, 1)[0], np.tanh(_unsharded(x) @ _unsharded(w)),
                             rtol=2e-5, atol=2e-5)
  assert len(fast.explain(x, w, 1).rewritten) == 1


def test_config_contexts_are_honoured_after_a_call_outside_them():
  msh = mesh((2, 4))
  _, x, w = _arrays(msh)
  f = lambda x, w, i: jnp.sum(x @ w) + i
  jitted, fast = jax.jit(f), meshslice.transform(jax.jit(f), ksplit=2)
  i = jnp.int32(3)
  np.testing.assert_allclose(fast(x, w, i), jitted(x, w, i), rtol=1e-5)
  with jax.numpy_dtype_promotion("strict"):
    with pytest.raises(jax.dtypes.TypePromotionError) as plain_error:
      jitted(x, w, i)
    with pytest.raises(jax.dtypes.TypePromotionError) as fast_error:
      fast(x, w, i)
  assert str(fast_error.value) == str(plain_error.value)
  g = lambda x, w: jnp.tanh(x @ w)
  plain_g, fast_g = jax.jit(g), meshslice.transform(jax.jit(g), ksplit=2)
  fast_g(x, w)
  with jax.default_matmul_precision("highest"):
    plain_text, fast_text = plain_g.lower(x, w).as_text(), fast_g.lower(x, w).as_text()
  assert "HIGHEST" in plain_text
  assert "HIGHEST" in fast_text
  assert "HIGHEST" not in fast_g.lower(x, w).as_text()


def test_a_same_shape_mesh_on_other_devices_runs_on_those_devices():
  devices = np.array(jax.devices()[:8])
  meshes = [jax.sharding.Mesh(devices[:4].reshape(2, 2), ("x", "y")),
            jax.sharding.Mesh(devices[4:].reshape(2, 2), ("x", "y"))]
  f = lambda x, w: jnp.tanh(x @ w)
  fast = meshslice.transform(f, ksplit=2)
  for msh in meshes:
    _, x, w = _arrays(msh)
    out = fast(x, w)
    assert out.sharding.mesh == msh
    assert set(out.sharding.device_set) == set(msh.devices.flat)
    np.testing.assert_allclose(out, jax.jit(f)(x, w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, np.tanh(_unsharded(x) @ _unsharded(w)),
                               rtol=2e-5, atol=2e-5)


def test_compiler_options_keep_unused_and_donation_are_passed_on():
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)
  f = lambda x, w, unused: jnp.tanh(x @ w)
  bad = jax.jit(f, compiler_options={"not_an_xla_option_anywhere": True})
  with pytest.raises(Exception, match="not_an_xla_option_anywhere") as plain_error:
    bad(x, w, x)
  with pytest.raises(Exception, match="not_an_xla_option_anywhere") as fast_error:
    meshslice.transform(bad, ksplit=2)(x, w, x)
  assert type(fast_error.value) is type(plain_error.value)
  for keep in (False, True):
    jitted = jax.jit(f, keep_unused=keep)
    fast = meshslice.transform(jitted, ksplit=2)
    plain_args = _main_arguments(jitted.lower(x, w, x).as_text())
    fast_args = _main_arguments(fast.lower(x, w, x).as_text())
    assert fast_args == plain_args == (3 if keep else 2)
  g = lambda x, w: (jnp.tanh(x @ w), w * 0.5)
  donating = jax.jit(g, donate_argnames="w")
  fast = meshslice.transform(donating, ksplit=2)
  plain_copy, fast_copy = jnp.copy(w), jnp.copy(w)
  ref, out = donating(x, plain_copy), fast(x, fast_copy)
  assert plain_copy.is_deleted() and fast_copy.is_deleted() and not x.is_deleted()
  assert_trees_close(out, ref)


def _main_arguments(stablehlo: str) -> int:
  header = next(line for line in stablehlo.splitlines() if "func.func public @main(" in line)
  return len(re.findall(r"%arg\d+:", header))


def test_stages_metadata_are_the_users_pytrees():
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)

  def step(batch, params):
    h = jnp.tanh(batch["x"] @ params["w"])
    return {"loss": jnp.sum(h), "h": h}

  jitted = jax.jit(step, out_shardings={"loss": None, "h": s})
  fast = meshslice.transform(jitted, ksplit=2)
  args = ({"x": x}, {"w": w})
  plain_lowered, fast_lowered = jitted.lower(*args), fast.lower(*args)
  assert jax.tree.structure(fast_lowered.out_info) == jax.tree.structure(plain_lowered.out_info)
  assert jax.tree.structure(fast_lowered.args_info) == jax.tree.structure(plain_lowered.args_info)
  plain_compiled, fast_compiled = plain_lowered.compile(), fast_lowered.compile()
  assert fast_compiled.input_shardings == plain_compiled.input_shardings
  assert fast_compiled.output_shardings == plain_compiled.output_shardings
  assert "all-gather" in fast_compiled.as_text()
  assert_trees_close(fast_compiled(*args), plain_compiled(*args))
  # the module is named after the user's function, as jit names it
  assert re.search(r"module @jit_step\b", fast_lowered.as_text())
  shapes = fast.eval_shape(*args)
  assert shapes == jitted.eval_shape(*args)
  traced = fast.trace(*args)
  assert isinstance(traced, jax.stages.Traced)
  assert "shard_map" in str(traced.jaxpr)
  assert_trees_close(fast(*args), jitted(*args))
  assert fast._cache_size() == 1
  fast.clear_cache()
  assert fast._cache_size() == 0


def test_jax_export_takes_the_transformed_step():
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)
  f = lambda x, w: jnp.tanh(x @ w)
  fast = meshslice.transform(jax.jit(f, in_shardings=(s, s), out_shardings=s), ksplit=2)
  exported = jax.export.export(fast)(x, w)
  assert "all_gather" in exported.mlir_module()
  restored = exported            # (serialize() needs the flatbuffers package)
  np.testing.assert_allclose(restored.call(x, w), jax.jit(f)(x, w), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(restored.call(x, w), np.tanh(_unsharded(x) @ _unsharded(w)),
                             rtol=2e-5, atol=2e-5)


def test_call_errors_name_the_users_arguments_as_jit_does():
  msh = mesh((2, 4))
  _, x, w = _arrays(msh)

  def step(inputs, weights):
    return jnp.tanh(inputs @ weights)

  jitted, fast = jax.jit(step), meshslice.transform(jax.jit(step))
  with pytest.raises(TypeError) as plain_error:
    jitted(x, "not an array")
  with pytest.raises(TypeError) as fast_error:
    fast(x, "not an array")
  no_address = lambda e: re.sub(r" at 0x[0-9a-f]+", "", str(e.value))
  assert no_address(fast_error) == no_address(plain_error)
  assert "weights" in str(fast_error.value)
  assert "emitted" not in str(fast_error.value)


# -- nnx.jit: the model's and optimizer's in-place updates are kept ---------------------------

def _nnx_model_and_optimizer(nnx, optax, msh):
  kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("x", "y"))

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(32, 64, use_bias=False, kernel_init=kernel, rngs=rngs)
      self.down = nnx.Linear(64, 32, use_bias=False, kernel_init=kernel, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x, out_sharding=P("x", "y"))),
                       out_sharding=P("x", "y"))

  model = Mlp(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.parametrize("graph", [True, False])
def test_nnx_jit_step_keeps_in_place_model_and_optimizer_updates(graph):
  nnx = pytest.importorskip("flax.nnx")
  optax = pytest.importorskip("optax")
  msh = mesh((2, 4), explicit=True)

  def train_step(model, optimizer, x):
    loss_fn = lambda m: jnp.mean(m(x) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  with jax.set_mesh(msh):
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), P("x", "y"))
    runs = {}
    for name in ("plain", "transformed"):
      model, optimizer = _nnx_model_and_optimizer(nnx, optax, msh)
      step = nnx.jit(train_step, graph=graph)
      if name == "transformed":
        step = meshslice.transform(step, ksplit=2)
        report = step.explain(model, optimizer, x)
        assert len(report.rewritten) >= 2
      before = np.asarray(model.up.kernel[...])
      down = np.asarray(model.down.kernel[...])
      losses = [float(step(model, optimizer, x)) for _ in range(3)]
      assert not np.allclose(np.asarray(model.up.kernel[...]), before)   # it trains
      # the first loss against an unsharded float64 run of the initial model
      hidden = np.maximum(_unsharded(x) @ before.astype(np.float64), 0)
      np.testing.assert_allclose(losses[0], np.mean((hidden @ down) ** 2), rtol=1e-4)
      runs[name] = (losses, np.asarray(model.up.kernel[...]),
                    np.asarray(model.down.kernel[...]), int(optimizer.step[...]))
  (plain_losses, *plain_state, plain_steps), (losses, *state, steps) = (
      runs["plain"], runs["transformed"])
  assert steps == plain_steps == 3
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
  assert losses[2] < losses[0]
  for got, want in zip(state, plain_state):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_step_closing_over_a_value_of_an_enclosing_trace():
  msh = mesh((2, 4))
  s, x, w = _arrays(msh)
  reference = lambda x, w: jnp.tanh(x @ w)

  def outer(x, w):
    return meshslice.transform(lambda x: jnp.tanh(x @ w), ksplit=2)(x)   # w: a tracer

  out = jax.jit(outer)(x, w)
  np.testing.assert_allclose(out, jax.jit(reference)(x, w), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, np.tanh(_unsharded(x) @ _unsharded(w)),
                             rtol=2e-5, atol=2e-5)
  grad = jax.grad(lambda w: jnp.sum(outer(x, w) ** 2))(w)
  assert_trees_close(grad, jax.grad(lambda w: jnp.sum(reference(x, w) ** 2))(w))
