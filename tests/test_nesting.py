"""On the CPU compiler a pipelined site runs as its own computation (`rewrites.nesting`):
XLA's CPU runtime builds one dependency graph per computation, in more than linear time,
so many sliced sites in one computation made compiles of deep unrolled models grow
steeply (docs/benchmarks-log.md). Not for TPU targets, and not when the transformed function
is traced (it may be transformed further)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice.rewrites.nesting import in_own_computation

from helpers import assert_trees_close, mesh, shard_map_bodies
from test_gather_hoisting import _loss, _setup


def _conditionals(fn, *args):
  return fn.lower(*args).compile().as_text().count(" conditional(")


def _lowered_conds(fn, *args):
  """How many conditionals the lowered (not yet compiled) program holds."""
  return fn.lower(*args).as_text().count("stablehlo.case")


def test_sliced_sites_compile_as_one_conditional_each_with_the_same_values():
  layers = 2
  jitted, params, x = _setup(layers)
  fast = meshslice.transform(jitted, ksplit=2)
  report = fast.explain(params, x)
  sliced = [s for s in report.rewritten if s.ksplit > 1]
  assert len(sliced) == len(report.rewritten) > 6
  assert _conditionals(fast, params, x) == len(sliced)
  # traced by make_jaxpr (with tracers) the program is emitted flat: it may be
  # transformed further (test_rewrites: vmap with spmd_axis_name, then grad)
  assert shard_map_bodies(fast, params, x)
  assert "cond" not in str(jax.make_jaxpr(fast)(params, x))
  assert _conditionals(jitted, params, x) == 0
  new, loss = fast(params, x)
  assert_trees_close((new, loss), jitted(params, x))
  host = jax.tree.map(np.asarray, params)
  one = jax.jit(lambda p, x: jax.tree.map(
      lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x, layers)))(host, np.asarray(x))
  assert_trees_close(new, one)


def test_collective_sites_are_not_nested_and_loop_bodies_are():
  jitted, params, x = _setup(layers=1)
  collective = meshslice.transform(jitted, algorithm="collective")
  assert _conditionals(collective, params, x) == 0

  def scanned_loss(params, x):
    block = lambda x, w: (x + jnp.tanh(x @ w[0]) @ w[1], None)
    return jnp.mean(jnp.square(lax.scan(block, x, (params["w1"], params["w2"]))[0]))

  step = jax.jit(jax.value_and_grad(scanned_loss),
                 in_shardings=(jax.tree.map(lambda a: a.sharding, params), x.sharding))
  fast = meshslice.transform(step, ksplit=2)
  sites = fast.explain(params, x).rewritten
  assert sites and all(s.ksplit == 2 and "scan" in s.context for s in sites)
  assert 0 < _conditionals(fast, params, x) <= len(sites)   # XLA may merge equal sites
  out = fast(params, x)
  assert_trees_close(out, step(params, x))
  host = jax.tree.map(np.asarray, params)
  assert_trees_close(out, jax.jit(jax.value_and_grad(scanned_loss))(host, np.asarray(x)))


def test_sites_compiled_for_tpu_are_not_nested():
  pytest.importorskip("libtpu")
  from meshslice import aot
  tpu_mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  jitted, params, x = _setup(layers=1, msh=tpu_mesh)
  fast = meshslice.transform(jitted, ksplit=2)
  with jax.set_mesh(tpu_mesh):
    assert all(s.ksplit == 2 for s in fast.explain(params, x).rewritten)
    assert _lowered_conds(fast, params, x) == 0
  cpu_step, cpu_params, cpu_x = _setup(layers=1)
  assert _lowered_conds(meshslice.transform(cpu_step, ksplit=2), cpu_params, cpu_x) > 0


def test_a_result_that_varies_over_no_axis_is_left_unnested():
  msh = mesh((2, 4))
  summed = lambda a, b: lax.psum(a @ b, ("x", "y"))
  f = jax.jit(jax.shard_map(in_own_computation(summed), mesh=msh,
                            in_specs=(P("x", "y"), P("y", None)), out_specs=P()))
  a = np.arange(32, dtype=np.float32).reshape(4, 8)
  b = np.ones((8, 3), np.float32)
  assert "cond" not in str(jax.make_jaxpr(f)(a, b))
  np.testing.assert_allclose(np.asarray(f(a, b)), (a @ b)[:2] + (a @ b)[2:], rtol=1e-6)
