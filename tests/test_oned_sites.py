"""1D tensor/sequence parallelism (one mesh axis): the Megatron MLP's all-gather input and
reduce-scatter output become sliced collective matmuls too."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import assert_trees_close, mesh


def _setup():
  m = mesh((2, 4))
  sh = lambda *s: NamedSharding(m, P(*s))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)), sh("y", None))
  w1 = jax.device_put(jax.random.normal(jax.random.key(1), (32, 128)) / 6, sh(None, "y"))
  w2 = jax.device_put(jax.random.normal(jax.random.key(2), (128, 32)) / 6, sh("y", None))

  def mlp(x, w1, w2):   # sequence-parallel in and out, column- then row-parallel weights
    y = jax.nn.gelu(x @ w1) @ w2
    return jax.lax.with_sharding_constraint(y, sh("y", None))

  return mlp, (x, w1, w2)


@pytest.mark.parametrize("algorithm", ["meshslice", "wang"])
def test_megatron_mlp_gather_and_scatter(algorithm):
  mlp, args = _setup()
  f = jax.jit(mlp)
  report = meshslice.explain(f, algorithm=algorithm, ksplit=2)(*args)
  plans = [(s.dataflow, s.algorithm, s.ksplit, s.mesh_axes, s.out_spec) for s in report.sites]
  assert plans == [("1d-gather", algorithm, 2, ("y",), "P(None, 'y')"),
                   ("1d-scatter", algorithm, 2, ("y",), "P('y', None)")]
  assert_trees_close(meshslice.transform(f, algorithm=algorithm, ksplit=2)(*args), f(*args))


def test_megatron_mlp_gradients():
  mlp, args = _setup()
  g = jax.jit(jax.grad(lambda *a: jnp.sum(mlp(*a) ** 2), argnums=(0, 1, 2)))
  report = meshslice.explain(g, ksplit=2)(*args)
  assert {s.dataflow for s in report.rewritten} == {"1d-gather", "1d-scatter", "os",
                                                    "1d-allreduce"}
  # the weight gradients gather the sequence-split operand along the contracted sequence
  # dim: OS with the other axis absent
  weight_grads = {s.mesh_axes for s in report.rewritten if s.dataflow == "os"}
  assert weight_grads == {(None, "y"), ("y", None)}
  # the backward-data matmul of the column-parallel layer contracts the split hidden dim
  # and its result joins the replicated input gradient: psums of slices (1d-allreduce)
  reduced = [s for s in report.rewritten if s.dataflow == "1d-allreduce"]
  assert [(s.mesh_axes, s.out_spec) for s in reduced] == [(("y",), "P(None, None)")]
  assert not report.left_alone
  assert_trees_close(meshslice.transform(g, ksplit=2)(*args), g(*args))
  assert_trees_close(meshslice.transform(g, algorithm="collective")(*args), g(*args))
