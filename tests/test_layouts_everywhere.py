"""Layouts wherever users put them (issue 19, deliverable 3).

- A committed, 2D-sharded array the step closes over is a jaxpr constant
  (`ClosedJaxpr.consts`), not an argument: its layout is its own `jax.Array.sharding`,
  at the top level and inside nested `jit` / `scan` bodies.
- Explicit mode types values `unreduced` (partial sums) or `reduced` over mesh axes; the
  pass leaves the matmuls that read or write them to JAX, with a reason, and the program
  computes what plain `jax.jit` computes.

Numerics are compared with plain jit *and* an unsharded single-device run (plain GSPMD
is not a reference on its own: docs/DESIGN.md section 6).
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import analysis as A
from meshslice import specs as S

from helpers import assert_trees_close, mesh

_REDUCED_REASON = ("the {name} is reduced over 'x' (its gradient stays unreduced) in its "
                   "Explicit-mode type: sites reading or writing unreduced/reduced values "
                   "are left to JAX")
_UNREDUCED_REASON = ("the result is unreduced over {axis} (each device holds a partial sum) "
                     "in its Explicit-mode type: sites reading or writing unreduced/reduced "
                     "values are left to JAX")


def _normal(seed, shape, scale=1.0):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape)) * scale


def _on_one_device(tree):
  """The same values, committed to a single device: the unsharded reference run."""
  return jax.tree.map(lambda a: jax.device_put(np.asarray(a), jax.devices()[0]), tree)


# ----------------------------------------------------------- closed-over constants

def _closed_over_program(msh):
  s = NamedSharding(msh, P("x", "y"))
  w = jax.device_put(_normal(1, (64, 128), 1 / 8), s)
  x = jax.device_put(_normal(0, (32, 64)), s)

  def make(weight):
    def loss(x):
      return jnp.sum(jnp.tanh(x @ weight))
    return loss

  return make, w, x


def test_closed_over_sharded_weight_keeps_its_layout():
  msh = mesh((2, 4))
  make, w, x = _closed_over_program(msh)
  loss = make(w)
  report = meshslice.explain(loss, ksplit=2)(x)
  site, = report.sites
  # today: rhs [64,128] P(None, None), left alone ("axis 'y' appears at lhs K-dim 1")
  assert (site.lhs_spec, site.rhs_spec, site.out_spec) == ("P('x', 'y')",) * 3
  assert site.rewritten and (site.algorithm, site.dataflow, site.ksplit) == ("meshslice", "os", 2)

  fast = meshslice.transform(loss, ksplit=2)
  reference = make(_on_one_device(w))(_on_one_device(x))
  assert_trees_close(fast(x), jax.jit(loss)(x))
  assert_trees_close(fast(x), reference)
  # gradients: transform of grad (the backward matmuls read the constant too) and grad
  # of transform
  grad_report = meshslice.explain(jax.grad(loss), ksplit=2)(x)
  assert [s.rhs_spec for s in grad_report.sites] == ["P('x', 'y')", "P('x', 'y')"]
  assert all(s.rewritten for s in grad_report.sites)
  g_ref = jax.grad(make(_on_one_device(w)))(_on_one_device(x))
  g_plain = jax.jit(jax.grad(loss))(x)
  for g in (meshslice.transform(jax.grad(loss), ksplit=2)(x),
            jax.grad(meshslice.transform(loss, ksplit=2))(x)):
    assert_trees_close(g, g_plain)
    assert_trees_close(g, g_ref)


def test_closed_over_constants_inside_nested_jit_and_scan_bodies():
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  w1 = jax.device_put(_normal(1, (64, 128), 1 / 8), s)
  w2 = jax.device_put(_normal(2, (128, 128), 1 / 8), s)
  x = jax.device_put(_normal(0, (32, 64)), s)

  def make(w1, w2):
    inner = jax.jit(lambda a: a @ w1)        # a jit whose ClosedJaxpr holds w1

    def loss(x):
      def body(c, _):
        return jnp.tanh(c @ w2), None          # a scan body closing over w2
      y, _ = jax.lax.scan(body, jnp.tanh(inner(x)), None, length=2)
      return jnp.sum(y)
    return loss

  loss = make(w1, w2)
  report = meshslice.explain(loss, ksplit=2)(x)
  assert [(s.lhs_spec, s.rhs_spec) for s in report.sites] == [("P('x', 'y')",) * 2] * 2
  assert all(s.rewritten for s in report.sites)
  fast = meshslice.transform(loss, ksplit=2)
  reference = make(*_on_one_device((w1, w2)))(_on_one_device(x))
  assert_trees_close(fast(x), jax.jit(loss)(x))
  assert_trees_close(fast(x), reference)
  g = meshslice.transform(jax.grad(loss), ksplit=2)(x)
  assert_trees_close(g, jax.jit(jax.grad(loss))(x))
  assert_trees_close(g, jax.grad(make(*_on_one_device((w1, w2))))(_on_one_device(x)))


def test_analysis_reads_constants_from_the_closed_jaxpr():
  """`analyze` itself takes the constants' layouts from `closed.consts` (the caller passes
  specs for the arguments only)."""
  msh = mesh((2, 4))
  make, w, x = _closed_over_program(msh)
  closed = jax.jit(make(w)).trace(x).jaxpr
  assert len(closed.consts) == 1
  axis_sizes = {"x": 2, "y": 4}
  found = A.analyze(closed, [(("x",), ("y",))], [None], A.Context(axis_sizes=axis_sizes))
  assert found.specs[closed.jaxpr.constvars[0]] == (("x",), ("y",))
  # an uncommitted / single-device constant is the same on every device: replicated
  single = jax.jit(make(_on_one_device(w))).trace(x).jaxpr
  found = A.analyze(single, [(("x",), ("y",))], [None], A.Context(axis_sizes=axis_sizes))
  assert found.specs[single.jaxpr.constvars[0]] == ((), ())


def test_constant_sharded_over_other_axes_is_unknown_not_replicated():
  other = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                        devices=jax.devices()[:8])
  w = jax.device_put(_normal(1, (64, 128)), NamedSharding(other, P("a", "b")))
  assert A._value_spec(w, 2, A.Context(axis_sizes={"x": 2, "y": 4})) is None
  assert A._value_spec(w, 2, A.Context(axis_sizes={"a": 2, "b": 4})) == (("a",), ("b",))
  assert A._value_spec(np.ones((4, 4)), 2, A.Context(axis_sizes={"x": 2})) == ((), ())
  # a sharding that is neither named nor replicated says nothing we can read
  split = types.SimpleNamespace(sharding=types.SimpleNamespace(is_fully_replicated=False))
  assert A._value_spec(split, 2, A.Context(axis_sizes={"x": 2})) is None
  # a value of an enclosing trace (transform called inside another jit) is unknown
  seen = []
  jax.jit(lambda a: seen.append(A._value_spec(a, 2, A.Context(axis_sizes={"a": 2}))))(w)
  assert seen == [None]


def test_closed_over_weight_in_explicit_mode():
  """Explicit mode types the constant itself; still right after the change."""
  msh = mesh((2, 4), explicit=True)
  w = jax.device_put(_normal(1, (64, 128), 1 / 8), NamedSharding(msh, P("y", None)))
  x = jax.device_put(_normal(0, (32, 64)), NamedSharding(msh, P("x", "y")))

  def make(weight):
    def loss(x):
      return jnp.sum(jnp.sin(jnp.dot(x, weight, out_sharding=P("x", "y"))))
    return loss

  with jax.set_mesh(msh):
    site, = meshslice.explain(make(w), ksplit=2)(x).sites
    assert site.rhs_spec == "P('y', None)" and site.rewritten
    g = meshslice.transform(jax.grad(make(w)), ksplit=2)(x)
    g_plain = jax.jit(jax.grad(make(w)))(x)
  assert_trees_close(g, g_plain)
  g_ref = jax.grad(lambda a: jnp.sum(jnp.sin(a @ _on_one_device(w))))(_on_one_device(x))
  assert_trees_close(g, g_ref)


# --------------------------------------------------- Explicit reduced / unreduced

def _explicit_operands():
  msh = mesh((2, 4), explicit=True)
  x = jax.device_put(_normal(0, (32, 64)), NamedSharding(msh, P("x", "y")))
  w = jax.device_put(_normal(1, (64, 128), 1 / 8), NamedSharding(msh, P("y", None)))
  return msh, x, w


def test_unreduced_out_sharding_inside_the_step():
  msh, x, w = _explicit_operands()

  def step(x, w):
    partial = jnp.dot(x, w, out_sharding=P("x", None, unreduced={"y"}))
    return jnp.tanh(jax.sharding.reshard(partial, P("x", None)))

  with jax.set_mesh(msh):
    report = meshslice.explain(step, ksplit=2)(x, w)     # today: ValueError "Using *pspec..."
    site, = report.sites
    assert not site.rewritten
    assert site.out_spec == "P('x', None, unreduced={'y'})"
    assert site.reason == _UNREDUCED_REASON.format(axis="'y'")
    out = meshslice.transform(step, ksplit=2)(x, w)
    plain = jax.jit(step)(x, w)
  assert jax.typeof(out) == jax.typeof(plain)
  assert_trees_close(out, plain)
  assert_trees_close(out, jnp.tanh(_on_one_device(x) @ _on_one_device(w)))


def test_unreduced_output_of_the_jitted_step():
  msh, x, w = _explicit_operands()
  step = jax.jit(lambda x, w: jnp.dot(x, w, out_sharding=P("x", None, unreduced={"y"})))
  with jax.set_mesh(msh):
    out = meshslice.transform(step, ksplit=2)(x, w)     # today: ValueError "Using *pspec..."
    plain = step(x, w)
    assert jax.typeof(out) == jax.typeof(plain)         # still unreduced over y
    out, plain = (jax.sharding.reshard(v, P("x", None)) for v in (out, plain))
  assert_trees_close(out, plain)
  assert_trees_close(out, _on_one_device(x) @ _on_one_device(w))


def test_reduced_weight_under_grad():
  msh = mesh((2, 4), explicit=True)
  x = jax.device_put(_normal(0, (32, 64)), NamedSharding(msh, P("x", "y")))
  w = jax.device_put(_normal(1, (64, 128), 1 / 8),
                     NamedSharding(msh, P("y", None, reduced={"x"})))

  def loss(w, x):
    return jnp.sum(jnp.sin(jnp.dot(x, w, out_sharding=P("x", None))))

  grad = jax.jit(jax.grad(loss))
  with jax.set_mesh(msh):
    report = meshslice.explain(grad, ksplit=2)(w, x)     # today: ValueError "Using *pspec..."
    forward, backward = report.sites
    assert forward.rhs_spec == "P('y', None, reduced={'x'})"
    assert forward.reason == _REDUCED_REASON.format(name="rhs")
    assert backward.out_spec == "P('y', None, unreduced={'x'})"
    assert backward.reason == _UNREDUCED_REASON.format(axis="'x'")
    assert not forward.rewritten and not backward.rewritten
    g = meshslice.transform(grad, ksplit=2)(w, x)
    g_plain = grad(w, x)
    assert jax.typeof(g) == jax.typeof(g_plain)          # the cotangent stays unreduced
    g, g_plain = (jax.sharding.reshard(v, P("y", None)) for v in (g, g_plain))
  assert_trees_close(g, g_plain)
  unsharded = lambda w, x: jnp.sum(jnp.sin(x @ w))
  assert_trees_close(g, jax.grad(unsharded)(*_on_one_device((w, x))))


def test_typed_specs_never_equal_plain_ones():
  """Caches keyed by specs (the planner's decisions, the analysis memo) must not give a
  site over an unreduced value the plan of a plain one."""
  axis_sizes = {"x": 2, "y": 4}
  plain = S.from_partition_spec(P("x", None), 2, axis_sizes)
  typed = S.from_partition_spec(P("x", None, unreduced={"y"}), 2, axis_sizes)
  assert plain == (("x",), ())
  assert typed != plain and plain != typed and hash(typed) != hash(plain)
  assert tuple(typed) == plain and typed.unreduced == {"y"} and typed.reduced == frozenset()
  assert S.to_partition_spec(typed) == P("x", None, unreduced={"y"})
  assert S.describe(S.from_partition_spec(P(None, "y", reduced={"x"}), 2, axis_sizes)) == (
      "P(None, 'y', reduced={'x'})")
  # size-1 axes are dropped from the entries, never from the type
  assert S.from_partition_spec(P(None, unreduced={"z"}), 1, {"z": 1}).unreduced == {"z"}
  assert S.typed_reason("lhs", plain) == ""


@pytest.mark.parametrize("spec", [P("x", None, unreduced={"y"}), P(None, "y", reduced={"x"})])
def test_leaf_and_jit_shardings_with_typed_specs_do_not_crash(spec):
  msh = mesh((2, 4), explicit=True)
  assert S.from_sharding(NamedSharding(msh, spec), 2, {"x": 2, "y": 4}) is not None
