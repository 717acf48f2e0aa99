"""Emission re-uses what it traced: identical sites share one shard_map body, identical
`jax.checkpoint` bodies with the same plans are rewritten once, and anything that differs
(shape, plan) gets its own. Values always match the untransformed program."""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import analysis

from helpers import assert_trees_close, mesh


def _eqns(jaxpr):
  """Every equation of `jaxpr` and of its sub-jaxprs (shard_map bodies excluded)."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name == "shard_map":
      continue
    for _, sub in analysis.sub_jaxprs(eqn):
      yield from _eqns(sub)


def _of(jaxpr, name):
  return [e for e in _eqns(jaxpr) if e.primitive.name == name]


def _inputs(layers=3, k=64):
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (16, k)), s)
  ws = [jax.device_put(jax.random.normal(jax.random.key(i + 1), (k, k)) / 8, s)
        for i in range(layers)]
  return s, x, ws


def _loss(x, ws):
  block = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))
  for w in ws:
    x = block(x, w)
  return jnp.sum(x)


def test_identical_checkpointed_layers_share_one_rewritten_body():
  s, x, ws = _inputs()
  step = jax.jit(jax.grad(_loss, argnums=1), in_shardings=(s, [s] * len(ws)))
  original = jax.make_jaxpr(step)(x, ws).jaxpr
  before = {id(e.params["jaxpr"]) for e in _of(original, "remat2")}
  # what the sharing relies on: JAX gives each backward block the same body object
  assert len(_of(original, "remat2")) == 3 and len(before) < 3

  fast = meshslice.transform(step, ksplit=2)
  assert all(site.ksplit == 2 for site in fast.explain(x, ws).rewritten)
  emitted = jax.make_jaxpr(fast)(x, ws).jaxpr
  remats = _of(emitted, "remat2")
  after = {id(e.params["jaxpr"]) for e in remats}
  assert len(remats) == 3 and len(after) == len(before)
  # sites of one plan and operand types share one shard_map body: no two body objects
  # read the same, and there are fewer bodies than sites
  maps = _of(emitted, "shard_map")
  bodies = {id(e.params["jaxpr"]): str(e.params["jaxpr"]) for e in maps}
  assert len(set(bodies.values())) == len(bodies) < len(maps)
  assert_trees_close(fast(x, ws), jax.grad(_loss, argnums=1)(x, ws))


def test_a_different_plan_in_one_layer_gets_its_own_body():
  s, x, ws = _inputs()
  step = jax.jit(jax.grad(_loss, argnums=1), in_shardings=(s, [s] * len(ws)))
  report = meshslice.explain(step, ksplit=2)(x, ws)
  # pin one backward site (inside a shared body) to another number of slices
  inside = [site for site in report.rewritten if len(site.path) > 1]
  pinned = inside[0]
  fast = meshslice.transform(step, ksplit=2, overrides={pinned.index: {"ksplit": 4}})
  planned = {site.path: site.ksplit for site in fast.explain(x, ws).rewritten}
  assert planned[pinned.path] == 4
  assert sorted(set(planned.values())) == [2, 4]
  remats = _of(jax.make_jaxpr(fast)(x, ws).jaxpr, "remat2")
  plain = _of(jax.make_jaxpr(meshslice.transform(step, ksplit=2))(x, ws).jaxpr, "remat2")
  # the pinned layer's body is rewritten on its own: one more distinct body
  assert (len({id(e.params["jaxpr"]) for e in remats})
          == len({id(e.params["jaxpr"]) for e in plain}) + 1)
  assert_trees_close(fast(x, ws), jax.grad(_loss, argnums=1)(x, ws))


def test_sites_of_another_shape_do_not_share_a_body():
  s, x, (wa, wb) = _inputs(layers=2)
  wc = jax.device_put(jax.random.normal(jax.random.key(9), (64, 128)) / 8, s)

  def f(x, wa, wb, wc):
    return x @ wa, x @ wb, x @ wc

  fast = meshslice.transform(jax.jit(f, in_shardings=(s,) * 4))
  maps = _of(jax.make_jaxpr(fast)(x, wa, wb, wc).jaxpr, "shard_map")
  assert len(maps) == 3
  bodies = [id(e.params["jaxpr"]) for e in maps]
  assert bodies[0] == bodies[1] != bodies[2]
  assert [e.outvars[0].aval.shape for e in maps] == [(16, 64), (16, 64), (16, 128)]
  assert_trees_close(fast(x, wa, wb, wc), f(x, wa, wb, wc))


def _body_analyses(layers):
  """(remat equations, distinct analyses of their bodies) of the `layers`-deep model."""
  s, x, ws = _inputs(layers=layers)
  step = jax.jit(jax.grad(_loss, argnums=1), in_shardings=(s, [s] * len(ws)))
  closed = step.trace(x, ws).jaxpr
  specs = [(("x",), ("y",))] * (1 + len(ws))
  result = analysis.analyze(closed, specs, [None] * len(ws),
                            analysis.Context(axis_sizes={"x": 2, "y": 4}))
  children = [result.children[(i, "jaxpr", 0)] for i, eqn in enumerate(closed.jaxpr.eqns)
              if eqn.primitive.name == "remat2"]
  for child, eqn in zip(children, [e for e in closed.jaxpr.eqns if e.primitive.name == "remat2"]):
    # each is a complete analysis: every matmul operand inside has a layout
    dots = [e for e in eqn.params["jaxpr"].eqns if e.primitive.name == "dot_general"]
    assert dots and all(child.specs.get(v) is not None for e in dots for v in e.invars)
  return len(children), len({id(c) for c in children})


def test_identical_checkpoint_bodies_share_their_analysis():
  # layers that see the same boundary layouts in the same order share one analysis, so
  # the work does not grow with depth (the first and last layers differ: their inputs or
  # outputs are the program's own)
  shallow, deep = _body_analyses(4), _body_analyses(8)
  assert shallow[0] == 4 and deep[0] == 8
  assert deep[1] == shallow[1] < 4


def test_equations_with_effects_are_rebound():
  s, x, (w,) = _inputs(layers=1)
  seen = []

  def f(x, w):
    y = x @ w
    jax.debug.callback(lambda v: seen.append(float(v)), jnp.sum(y))
    return jnp.tanh(y) @ w

  expected = jax.block_until_ready(f(x, w))
  seen.clear()
  fast = meshslice.transform(jax.jit(f, in_shardings=(s, s)))
  assert len(fast.explain(x, w).rewritten) == 2
  out = jax.block_until_ready(fast(x, w))
  assert_trees_close(out, expected)
  assert len(seen) == 1 and abs(seen[0] - float(jnp.sum(x @ w))) < 1e-2 * max(1.0, abs(seen[0]))
  assert len(_of(jax.make_jaxpr(fast)(x, w).jaxpr, "debug_callback")) == 1
