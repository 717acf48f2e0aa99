"""The unsharded reference evaluator (`meshslice.reference`) on the higher-order primitives
of `_jax_internals.HIGHER_ORDER`, that table itself, and the typed errors
(`meshslice.errors`) that `check` and planning catch instead of any ValueError."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import _jax_internals as internals
from meshslice import emit, errors, reference

from helpers import mesh

check_module = importlib.import_module("meshslice.check")   # the function shadows it


def _only(closed, name):
  eqn, = [e for e in closed.jaxpr.eqns if e.primitive.name == name]
  return eqn


def _evaluate(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  return closed, reference.evaluate(closed.jaxpr, closed.consts, list(args))


def test_scan_reads_its_operands_through_scan_counts(monkeypatch):
  """jax 0.11 replaced scan's num_consts/num_carry with flat trees: the reference splits
  a scan's operands through the shim, as the analysis and the emitter do."""
  counted = []
  real = reference.scan_counts
  monkeypatch.setattr(reference, "scan_counts",
                      lambda params: counted.append(params) or real(params))
  c = jnp.arange(3.0) / 3

  def f(h, xs):
    return jax.lax.scan(lambda h, x: (jnp.tanh(h * c + x), h.sum()), h, xs)

  h, xs = jnp.ones(3), jnp.arange(12.0).reshape(4, 3) / 12
  closed, (carry, ys) = _evaluate(f, h, xs)
  assert internals.scan_counts(_only(closed, "scan").params) == (1, 1)
  want_carry, want_ys = f(h, xs)
  np.testing.assert_allclose(carry, want_carry, rtol=1e-6)
  np.testing.assert_allclose(ys, want_ys, rtol=1e-6)
  assert len(counted) == 1


def test_while_splits_cond_and_body_consts():
  def f(n, w, x):
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * w + 1.0),
                              (0, x))

  args = (jnp.int32(4), jnp.float32(0.5), jnp.arange(3.0))
  closed, outs = _evaluate(f, *args)
  assert internals.while_counts(_only(closed, "while").params) == (1, 1)
  want = f(*args)
  assert int(outs[0]) == int(want[0]) == 4
  np.testing.assert_allclose(outs[1], want[1], rtol=1e-6)


def test_cond_drops_the_shardings_inside_its_branches():
  m = mesh((2, 2))
  s = NamedSharding(m, P("x", "y"))

  def f(p, x):
    return jax.lax.cond(p, lambda x: jax.lax.with_sharding_constraint(x @ x.T, s),
                        lambda x: -x, x)

  x = jnp.arange(16.0).reshape(4, 4) / 16
  for p in (True, False):
    closed, (out,) = _evaluate(f, p, x)
    np.testing.assert_allclose(out, x @ x.T if p else -x, rtol=1e-6)


def test_calls_and_remat_inline_their_bodies():
  w = jnp.arange(9.0).reshape(3, 3) / 9

  @jax.custom_jvp
  def g(x):
    return jnp.sin(x)

  g.defjvp(lambda primals, tangents: (g(*primals), jnp.cos(*primals) * tangents[0]))

  def f(x):
    y = jax.jit(lambda x: x @ w)(x)
    return jax.checkpoint(lambda y: g(y) * 2)(y)

  x = jnp.ones((2, 3))
  closed, (out,) = _evaluate(f, x)
  names = {e.primitive.name for e in closed.jaxpr.eqns}
  assert {"jit", "remat2"} <= names
  np.testing.assert_allclose(out, f(x), rtol=1e-6)


def test_a_shard_map_cannot_run_unsharded():
  m = mesh((2, 2))
  f = jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=m, in_specs=P("x", "y"),
                    out_specs=P(None, "y"))
  closed = jax.make_jaxpr(f)(jnp.ones((4, 4)))
  with pytest.raises(reference.NoReference, match="contains a shard_map"):
    reference.evaluate(closed.jaxpr, closed.consts, [jnp.ones((4, 4))])


def test_sub_jaxprs_keys_per_kind():
  """The keys every interpreter (and `Site.path`) uses, read off the one table."""
  def f(p, x, xs):
    y = jax.jit(lambda x: x * 2)(x)
    y = jax.checkpoint(jnp.sin)(y)
    y, _ = jax.lax.scan(lambda h, a: (h + a, None), y, xs)
    y = jax.lax.while_loop(lambda c: c.sum() < 10.0, lambda c: c + 1.0, y)
    return jax.lax.cond(p, jnp.cos, jnp.tanh, y)

  closed = jax.make_jaxpr(f)(True, jnp.ones(2), jnp.ones((3, 2)))
  keys = {e.primitive.name: [k for k, _ in internals.sub_jaxprs(e)]
          for e in closed.jaxpr.eqns}
  assert keys["jit"] == keys["remat2"] == keys["scan"] == [("jaxpr", 0)]
  assert keys["while"] == [("body_jaxpr", 0), ("cond_jaxpr", 0)]
  assert keys["cond"] == [("branches", 0), ("branches", 1)]
  assert all(keys[n] == [] for n in keys if n not in internals.HIGHER_ORDER)
  from meshslice import analysis
  assert analysis.sub_jaxprs is internals.sub_jaxprs     # the old import path


def test_the_pass_looks_into_the_same_primitives_as_before():
  looked_into = {n for n, h in internals.HIGHER_ORDER.items() if h.traversed}
  assert looked_into == {"jit", "remat2", "checkpoint", "custom_jvp_call",
                         "custom_vjp_call", "scan", "while", "cond"}
  assert internals.HIGHER_ORDER["shard_map"].traversed is False


# ------------------------------------------------------------------ typed errors

def test_the_errors_are_value_errors_with_the_same_messages():
  assert issubclass(errors.PinError, errors.MeshsliceError)
  assert issubclass(errors.PlanError, errors.MeshsliceError)
  assert issubclass(errors.MeshsliceError, ValueError)
  with pytest.raises(errors.PlanError, match='^plan: expected a JSON object with "version": 1$'):
    meshslice.Plan.from_json("[]")
  with pytest.raises(errors.PinError, match="^ksplit must be a positive int"):
    meshslice.transform(lambda a: a, ksplit=0)
  with pytest.raises(ValueError, match="^overrides\\[0\\] has unknown key 'slices'"):
    meshslice.transform(lambda a: a, overrides={0: {"slices": 2}})


def _mlp(m):
  xs, ws = NamedSharding(m, P("x", "y")), NamedSharding(m, P("x", "y"))
  armed = []

  def loss(params, x):
    if armed:       # a JAX ValueError raised inside the user's step, once
      armed.clear()
      jnp.split(x, 3)
    h = jax.lax.with_sharding_constraint(jnp.tanh(x @ params["w1"]), xs)
    return jnp.sum(jnp.sin(h @ params["w2"]))

  step = jax.jit(jax.value_and_grad(loss), in_shardings=({"w1": ws, "w2": ws}, xs))
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.device_put(jax.random.normal(k1, (32, 32)) / 6, ws),
            "w2": jax.device_put(jax.random.normal(k2, (32, 32)) / 6, ws)}
  return step, (params, jax.device_put(jax.random.normal(k3, (16, 32)), xs)), armed


def _wrong_ls_sites(monkeypatch):
  real = emit.build_body
  monkeypatch.setattr(emit, "build_body", lambda alg, geo, ks, **kw: (
      (lambda f: (lambda a, b: f(a, b) * 1.5))(real(alg, geo, ks, **kw))
      if getattr(geo, "dataflow", None) == "ls" else real(alg, geo, ks, **kw)))


def test_bisection_lets_a_value_error_from_the_step_through(monkeypatch):
  """While bisecting, only the pass's own errors mean "the plan cannot be re-applied":
  a ValueError JAX raises inside the step is not swallowed (and retried)."""
  step, args, armed = _mlp(mesh((2, 4)))
  _wrong_ls_sites(monkeypatch)
  real = check_module.transform

  def arming(fn, **options):
    if "plan" in options:      # the first re-transform of the bisection
      armed.append(True)
      jax.clear_caches()       # so that it traces the step again (else JAX's cache hits)
    return real(fn, **options)

  monkeypatch.setattr(check_module, "transform", arming)
  with pytest.raises(ValueError, match="array split does not result in an equal division"):
    meshslice.check(step, algorithm="collective")(*args)


def test_bisection_falls_back_to_overrides_when_the_plan_cannot_be_applied(monkeypatch):
  step, args, _ = _mlp(mesh((2, 4)))
  ls = [s.index for s in meshslice.explain(step, algorithm="collective")(*args).rewritten
        if s.dataflow == "ls"]
  _wrong_ls_sites(monkeypatch)
  real = check_module.transform

  def plan_refused(fn, **options):
    if "plan" in options:
      raise errors.PlanError("stand-in: the plan does not apply")
    return real(fn, **options)

  monkeypatch.setattr(check_module, "transform", plan_refused)
  result = meshslice.check(step, algorithm="collective")(*args)
  assert not result.ok
  assert result.culprit is not None and result.culprit.index in ls, str(result)
