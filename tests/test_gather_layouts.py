"""Layouts through embedding lookups (gather) and their gradients (scatter-add), also
inside a nested jit, as GSPMD propagates them (issue 20 item 1): the matmuls after a
lookup are 2D sites, not "operand sharding unknown"; values and gradients match plain
jit and an unsharded float64 run."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import assert_trees_close, mesh


def _lookup_nested(table, ids):
  return jax.jit(lambda t, i: jnp.take(t, i, axis=0))(table, ids)


def _lookup_indexing(table, ids):
  return table[ids]


def _inputs(msh):
  s = lambda *spec: NamedSharding(msh, P(*spec))
  keys = jax.random.split(jax.random.key(0), 2)
  table = jax.device_put(jax.random.normal(keys[0], (50, 64)), s(None, "y"))
  ids = jax.device_put(jnp.arange(16, dtype=jnp.int32) * 3 % 50, s("x"))
  w = jax.device_put(jax.random.normal(keys[1], (64, 128)) / 8, s("x", "y"))
  return table, ids, w


@pytest.mark.parametrize("lookup", [_lookup_nested, _lookup_indexing])
def test_matmuls_after_an_embedding_lookup_are_2d_sites(lookup):
  msh = mesh((2, 4))
  table, ids, w = _inputs(msh)

  def loss(table, w, ids):
    return jnp.sum(jnp.tanh(lookup(table, ids) @ w) ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  report = meshslice.explain(step, ksplit=2)(table, w, ids)
  assert not [s for s in report.sites if s.reason.startswith("operand sharding unknown")]
  forward = report.sites[0]
  assert forward.rewritten and forward.dataflow == "os"
  assert "[16,64] P('x', 'y')" in str(report).splitlines()[3]
  fast = meshslice.transform(step, ksplit=2)
  (value, grads), (ref_value, ref_grads) = fast(table, w, ids), step(table, w, ids)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(grads, ref_grads)
  # an unsharded float64 run
  t, m, i = (np.asarray(jax.device_get(a), np.float64) for a in (table, w, ids))
  h = t[i.astype(int)]
  y = np.tanh(h @ m)
  np.testing.assert_allclose(value, np.sum(y ** 2), rtol=1e-4)
  dy = 2 * y * (1 - y ** 2)
  np.testing.assert_allclose(grads[1], h.T @ dy, rtol=1e-4, atol=1e-5)
  dtable = np.zeros_like(t)
  np.add.at(dtable, i.astype(int), dy @ m.T)
  np.testing.assert_allclose(grads[0], dtable, rtol=1e-4, atol=1e-5)


def test_an_unknown_layout_says_where_it_was_lost_and_how_to_fix_it():
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=s)
  w = jax.ShapeDtypeStruct((128, 512), jnp.float32, sharding=s)

  def f(x, w):
    h = jax.lax.top_k(x, 128)[0]           # no layout rule for top_k
    return jnp.sum(jnp.tanh(h @ w))

  site = meshslice.explain(jax.jit(f))(x, w).sites[0]
  assert site.reason.startswith("operand sharding unknown")
  line = f.__code__.co_firstlineno + 1
  assert re.search(
      r"; lhs: the layout is lost at `top_k` \((tests/)?test_gather_layouts\.py:" + str(line)
      + re.escape("), whose inputs have layouts but no layout rule carries them to its "
                  "[64x128] result; add jax.lax.with_sharding_constraint on that result")
      + "$", site.reason)
  # with the constraint the hint asks for, the site is planned
  def fixed(x, w):
    h = jax.lax.with_sharding_constraint(jax.lax.top_k(x, 128)[0], s)
    return jnp.sum(jnp.tanh(h @ w))
  assert meshslice.explain(jax.jit(fixed))(x, w).sites[0].lhs_spec == "P('x', 'y')"
  # an input no sharding reaches
  bare = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  site = meshslice.explain(jax.jit(lambda a, b: a @ b))(bare, w).sites[0]
  assert site.reason.endswith(
      "; lhs: it comes from input 0 of this (sub)program, which no in_shardings, committed "
      "array or constraint reaches")
