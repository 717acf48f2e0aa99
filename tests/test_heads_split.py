"""An os site whose result is only split into attention heads, `(x @ w).reshape(b, s, n,
d)`, writes the split result itself (`emit._heads_reshape`): its rhs's free dim is split
before the shard_map, so the local dot returns (b, s, n, d) and XLA can lay it out for
the scores matmul as it does when it folds the reshape. Same values and gradients as
plain jit and an unsharded run; left as it was wherever the pattern does not hold."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import assert_trees_close, mesh, shard_map_bodies

B, S, H, HEADS = 4, 8, 32, 8


def _inputs(m):
  rng = np.random.RandomState(0)
  x = jax.device_put(jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32),
                     NamedSharding(m, P("x", None, "y")))
  w = jax.device_put(jnp.asarray(rng.standard_normal((H, H)) / np.sqrt(H), jnp.float32),
                     NamedSharding(m, P("x", "y")))
  return x, w


def _scores(x, w, also_return_q=False):
  q = x @ w
  heads = q.reshape(B, S, HEADS, H // HEADS)
  scores = jnp.einsum("bsnd,btnd->bnst", heads, heads)
  loss = jnp.sum(jax.nn.softmax(scores, axis=-1) * scores)
  return (loss, q) if also_return_q else loss


def _os_outputs(fast, x, w):
  """The output shapes of the shard_map bodies' dot_generals with an os-style 3-d rhs."""
  return [str(eqn.outvars[0].aval.shape) for body in shard_map_bodies(fast, x, w)
          for eqn in body.eqns if eqn.primitive.name == "dot_general"]


def test_the_projection_writes_its_heads_and_keeps_values_and_gradients():
  m = mesh((2, 4))
  x, w = _inputs(m)
  step = jax.jit(jax.value_and_grad(_scores, argnums=(0, 1)),
                 in_shardings=(x.sharding, w.sharding))
  fast = meshslice.transform(step, algorithm="collective")
  report = fast.explain(x, w)
  assert any(s.dataflow == "os" and not s.swapped for s in report.rewritten), str(report)
  # the forward projection's local dot: (B/2, S, HEADS/4, head) from a (H, HEADS/4, head) rhs
  bodies = shard_map_bodies(fast, x, w)
  split = [eqn for body in bodies for eqn in body.eqns if eqn.primitive.name == "dot_general"
           and eqn.invars[1].aval.shape == (H, HEADS // 4, H // HEADS)]
  assert split and split[0].outvars[0].aval.shape == (B // 2, S, HEADS // 4, H // HEADS)
  jaxpr = str(jax.make_jaxpr(fast)(x, w))
  assert f"f32[{H},{HEADS},{H // HEADS}]" in jaxpr          # the weight, split before the map
  assert f"reshape[dimensions=None new_sizes=({B}, {S}, {HEADS}, {H // HEADS})" not in jaxpr
  new, old = fast(x, w), step(x, w)
  assert_trees_close(new, old)
  with jax.default_device(jax.devices()[0]):     # one device: no sharding at all
    single = jax.jit(jax.value_and_grad(_scores, argnums=(0, 1)))(*jax.device_get((x, w)))
  assert_trees_close(new, single)


def test_a_result_with_another_use_is_not_split():
  m = mesh((2, 4))
  x, w = _inputs(m)
  step = jax.jit(lambda a, b: _scores(a, b, also_return_q=True),
                 in_shardings=(x.sharding, w.sharding))
  fast = meshslice.transform(step, algorithm="collective")
  assert fast.explain(x, w).rewritten
  rhs_shapes = [eqn.invars[1].aval.ndim for body in shard_map_bodies(fast, x, w)
                for eqn in body.eqns if eqn.primitive.name == "dot_general"]
  assert rhs_shapes and all(n == 2 for n in rhs_shapes), rhs_shapes
  assert_trees_close(fast(x, w), step(x, w))
