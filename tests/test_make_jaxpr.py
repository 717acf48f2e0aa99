"""`jax.make_jaxpr(fast_step)` shows the program a call of the step runs, also when the
layouts come only from the committed input arrays (a `jax.jit` without in_shardings,
Auto mesh axes), where make_jaxpr's tracers carry no sharding."""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import mesh


def _train(params, batch):
  def loss(params):
    hidden = jnp.tanh(batch @ params["w1"])
    return jnp.mean((hidden @ params["w2"]) ** 2)
  value, grads = jax.value_and_grad(loss)(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def _committed():
  layout = NamedSharding(mesh((2, 4)), P("x", "y"))
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.device_put(jax.random.normal(keys[0], (64, 256)) / 8, layout),
            "w2": jax.device_put(jax.random.normal(keys[1], (256, 64)) / 16, layout)}
  batch = jax.device_put(jax.random.normal(keys[2], (128, 64)), layout)
  return params, batch


def _gathers(jaxpr) -> int:
  return len(re.findall(r"\ball_gather\b", str(jaxpr)))


def test_make_jaxpr_of_a_step_without_in_shardings_shows_the_rewritten_program():
  params, batch = _committed()
  fast = meshslice.transform(jax.jit(_train), ksplit=2)
  ran = _gathers(fast.trace(params, batch).jaxpr)       # what a call runs
  assert ran > 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")          # no "left alone: outer transformation" warning
    shown = jax.make_jaxpr(fast)(params, batch)
  assert _gathers(shown) == ran
  assert "shard_map" in str(shown)
  # the shown program computes what the step computes
  out = jax.core.eval_jaxpr(shown.jaxpr, shown.consts, *jax.tree.leaves((params, batch)))
  ref_params, ref_value = jax.jit(_train)(params, batch)
  assert jnp.allclose(out[-1], ref_value, rtol=1e-5)
  for got, want in zip(out[:-1], jax.tree.leaves(ref_params)):
    assert jnp.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_make_jaxpr_with_static_arguments_and_keywords():
  params, batch = _committed()

  def train(params, lr, *, batch):
    new, value = _train(params, batch)
    return jax.tree.map(lambda p, q: p + lr * (q - p), params, new), value

  fast = meshslice.transform(jax.jit(train, static_argnums=1))
  ran = _gathers(fast.trace(params, 0.5, batch=batch).jaxpr)
  shown = jax.make_jaxpr(fast, static_argnums=1)(params, 0.5, batch=batch)
  assert ran > 0 and _gathers(shown) == ran


def test_make_jaxpr_around_the_step_still_warns_and_says_what_to_trace_instead():
  params, batch = _committed()
  fast = meshslice.transform(jax.jit(_train))
  around = functools.partial(lambda p, b: fast(p, b)[1])
  with pytest.warns(UserWarning, match=re.escape(
      "To see the program a call runs, trace the step itself: "
      "jax.make_jaxpr(fast_step)(*args) or fast_step.trace(*args).jaxpr, not make_jaxpr "
      "of a function around it.")):
    shown = jax.make_jaxpr(around)(params, batch)
  assert _gathers(shown) == 0            # left alone, as the warning says
