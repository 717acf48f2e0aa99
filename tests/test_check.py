"""meshslice.check: plain vs transformed vs unsharded reference, and bisection to the
site responsible for a disagreement."""
import importlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import emit

from helpers import mesh


def _mlp_step(m, explicit=False):
  """A 2-layer MLP training step on a 2D layout: forward OS, backward LS and RS sites."""
  xs, ws = NamedSharding(m, P("x", "y")), NamedSharding(m, P("x", "y"))

  def loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = jax.lax.with_sharding_constraint(h, xs) if not explicit else h
    return jnp.sum(jnp.sin(h @ params["w2"]))

  step = jax.value_and_grad(loss)
  if explicit:
    return jax.jit(step), (xs, ws)
  return jax.jit(step, in_shardings=({"w1": ws, "w2": ws}, xs)), (xs, ws)


def _inputs(m, xs, ws, d=32):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.device_put(jax.random.normal(k1, (d, d)) / 6, ws),
            "w2": jax.device_put(jax.random.normal(k2, (d, d)) / 6, ws)}
  return params, jax.device_put(jax.random.normal(k3, (16, d)), xs)


def test_check_agrees_and_names_outputs():
  m = mesh((2, 4))
  step, (xs, ws) = _mlp_step(m)
  params, x = _inputs(m, xs, ws)
  result = meshslice.check(step, ksplit=2)(params, x)
  assert result.ok, str(result)
  assert result.reference == "ran"
  assert result.culprit is None
  assert len(result.report.rewritten) >= 3
  paths = [leaf.path for leaf in result.leaves]
  assert paths == ["[0]", "[1][0]['w1']", "[1][0]['w2']"] or paths == [
      "[0]", "[1]['w1']", "[1]['w2']"]
  assert all(leaf.vs_reference.ok and leaf.vs_plain.ok for leaf in result.leaves)
  text = str(result)
  assert text.startswith("meshslice.check: OK: 3 of 3 outputs agree with the unsharded "
                         "reference")
  assert "['w1']" in text
  result.assert_ok()


def test_check_reference_skipped_when_too_large():
  m = mesh((2, 2))
  step, (xs, ws) = _mlp_step(m)
  params, x = _inputs(m, xs, ws, d=16)
  result = meshslice.check(step, max_reference_bytes=100)(params, x)
  assert result.ok
  assert result.reference.startswith("inputs total ")
  assert "over max_reference_bytes=100" in result.reference
  assert all(leaf.vs_reference is None for leaf in result.leaves)
  assert "unsharded reference skipped" in str(result)


def test_check_explicit_mode():
  m = mesh((2, 2), explicit=True)
  xs, ws = NamedSharding(m, P("x", None)), NamedSharding(m, P(None, "y"))

  def loss(w, x):
    return jnp.sum(jnp.tanh(jnp.matmul(x, w, out_sharding=P("x", "y"))) ** 2)

  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  k1, k2 = jax.random.split(jax.random.key(1))
  w = jax.device_put(jax.random.normal(k1, (16, 16)), ws)
  x = jax.device_put(jax.random.normal(k2, (16, 16)), xs)
  with jax.set_mesh(m):
    result = meshslice.check(step)(w, x)
  assert result.ok, str(result)
  assert result.reference == "ran"


def test_check_reference_evaluates_scan_and_checkpoint():
  m = mesh((2, 2))
  xs, ws = NamedSharding(m, P("x", "y")), NamedSharding(m, P(None, "x", "y"))

  def loss(w, x):
    def body(h, wi):
      return jax.checkpoint(lambda h, wi: jnp.tanh(h @ wi))(h, wi), None
    h, _ = jax.lax.scan(body, x, w)
    h = jax.lax.with_sharding_constraint(h, xs)
    return jnp.sum(jax.lax.cond(jnp.sum(h) > 0, jnp.sin, jnp.cos, h))

  step = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=(ws, xs))
  k1, k2 = jax.random.split(jax.random.key(2))
  w = jax.device_put(jax.random.normal(k1, (2, 16, 16)) / 4, ws)
  x = jax.device_put(jax.random.normal(k2, (16, 16)), xs)
  result = meshslice.check(step)(w, x)
  assert result.ok, str(result)
  assert result.reference == "ran"
  for leaf in result.leaves:
    assert leaf.plain_vs_reference.ok


def test_check_bisects_to_the_wrong_site(monkeypatch):
  m = mesh((2, 4))
  step, (xs, ws) = _mlp_step(m)
  params, x = _inputs(m, xs, ws)
  report = meshslice.explain(step, algorithm="collective")(params, x)
  ls_sites = [s.index for s in report.rewritten if s.dataflow == "ls"]
  assert ls_sites, str(report)
  real = emit.build_body

  def corrupted(algorithm, geometry, ksplit, **kw):
    body = real(algorithm, geometry, ksplit, **kw)
    if getattr(geometry, "dataflow", None) != "ls":
      return body
    return lambda a, b: body(a, b) * 1.5       # a wrong rewrite of every LS site

  monkeypatch.setattr(emit, "build_body", corrupted)
  result = meshslice.check(step, algorithm="collective")(params, x)
  assert not result.ok
  assert result.culprit is not None, str(result)
  assert result.culprit.index == ls_sites[0]
  assert result.culprit.dataflow == "ls"
  text = str(result)
  assert "DISAGREES" in text
  assert f"responsible: site #{ls_sites[0]}" in text
  assert f"overrides={{{ls_sites[0]}: {{'rewrite': False}}}}" in text
  with pytest.raises(AssertionError, match="DISAGREES"):
    result.assert_ok()


def test_check_without_bisection_and_plain_judge(monkeypatch):
  m = mesh((2, 2))
  step, (xs, ws) = _mlp_step(m)
  params, x = _inputs(m, xs, ws, d=16)
  real = emit.build_body
  monkeypatch.setattr(emit, "build_body",
                      lambda *a, **k: (lambda f: lambda x, y: f(x, y) + 1.0)(real(*a, **k)))
  result = meshslice.check(step, algorithm="collective", reference=False, bisect=False)(
      params, x)
  assert not result.ok
  assert result.reference == "turned off (reference=False)"
  assert result.culprit is None and result.suspects == ()


def test_check_rejects_bad_arguments():
  with pytest.raises(TypeError, match="expects a callable"):
    meshslice.check(3)
  with pytest.raises(ValueError, match="ksplit must be a positive int"):
    meshslice.check(lambda x: x, ksplit=0)


def test_check_plain_function_and_pytree_outputs():
  m = mesh((2, 2))
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8) / 64, NamedSharding(m, P("x", "y")))
  result = meshslice.check(lambda a: {"gram": a @ a.T, "sum": jnp.sum(a)})(x)
  assert result.ok, str(result)
  assert [leaf.path for leaf in result.leaves] == ["['gram']", "['sum']"]
  assert result.leaves[1].shape == ()


def test_check_does_not_blame_a_site_when_plain_jit_is_wrong_too(monkeypatch):
  """A stand-in GSPMD bug (the reference shifted): plain and transformed are equally far
  from it, so the pass adds no error: OK, nobody blamed, plain jit's distance noted."""
  check_module = importlib.import_module("meshslice.check")   # the function shadows it
  m = mesh((2, 2))
  step, (xs, ws) = _mlp_step(m)
  params, x = _inputs(m, xs, ws, d=16)
  real = check_module._reference

  def shifted(*a, **k):      # stands in for a GSPMD bug: plain and transformed both off
    outs, why, moved = real(*a, **k)
    shift = lambda hs: [check_module._Host(h.value + 1.0, h.dtype) for h in hs]
    return shift(outs), why, shift(moved)

  monkeypatch.setattr(check_module, "_reference", shifted)
  result = meshslice.check(step, algorithm="collective")(params, x)
  assert result.ok, str(result)
  assert result.plain_disagrees_with_reference
  assert result.culprit is None and result.note == ""
  assert all(leaf.judged == "plain's distance" for leaf in result.leaves)
  assert ("note: plain jax.jit itself is beyond tolerance of the unsharded reference on 3 "
          "outputs ([0], [1][0]['w1'], [1][0]['w2']); the transformed program is judged "
          "against plain jit's own distance.") in str(result) or (
          "note: plain jax.jit itself is beyond tolerance of the unsharded reference on 3 "
          "outputs ([0], [1]['w1'], [1]['w2']); the transformed program is judged "
          "against plain jit's own distance.") in str(result)
  assert "GSPMD partitioning bug in plain jit" not in str(result)


def test_check_reference_runs_scatter_add_and_bisects_under_pattern_pins(monkeypatch):
  """An embedding gradient (scatter-add) runs in the reference; bisection pins sites
  through a plan, so a user pin by source location does not clash with it."""
  m = mesh((2, 4))
  xs, ws = NamedSharding(m, P("x", "y")), NamedSharding(m, P("x", "y"))

  def loss(params, ids):
    x = jnp.take(params["emb"], ids, axis=0)
    h = jnp.tanh(x @ params["w1"])
    h = jax.lax.with_sharding_constraint(h, xs)
    return jnp.sum(jnp.sin(h @ params["w2"]))

  step = jax.jit(jax.value_and_grad(loss),
                 in_shardings=({"emb": ws, "w1": ws, "w2": ws}, NamedSharding(m, P("x"))))
  k = jax.random.split(jax.random.key(3), 3)
  params = {"emb": jax.device_put(jax.random.normal(k[0], (32, 32)) / 6, ws),
            "w1": jax.device_put(jax.random.normal(k[1], (32, 32)) / 6, ws),
            "w2": jax.device_put(jax.random.normal(k[2], (32, 32)) / 6, ws)}
  ids = jax.device_put(jnp.arange(16) % 32, NamedSharding(m, P("x")))
  ok = meshslice.check(step)(params, ids)
  assert ok.ok and ok.reference == "ran", str(ok)

  report = meshslice.explain(step, algorithm="collective")(params, ids)
  ls_sites = [s for s in report.rewritten if s.dataflow == "ls"]
  assert ls_sites, str(report)
  real = emit.build_body
  monkeypatch.setattr(emit, "build_body", lambda alg, geo, ks, **kw: (
      (lambda f: (lambda a, b: f(a, b) * 1.5))(real(alg, geo, ks, **kw))
      if getattr(geo, "dataflow", None) == "ls" else real(alg, geo, ks, **kw)))
  pins = {s.source: {"algorithm": "collective"} for s in report.rewritten}
  result = meshslice.check(step, algorithm="collective", overrides=pins)(params, ids)
  assert not result.ok
  assert result.culprit is not None and result.culprit.index == ls_sites[0].index, str(result)


def test_check_names_a_gspmd_bug_only_where_the_rewrite_matches_the_reference(monkeypatch):
  """Plain jit off the reference on one output where the transformed program is within
  tolerance: the only case the printout calls a GSPMD partitioning bug."""
  check_module = importlib.import_module("meshslice.check")
  m = mesh((2, 4))
  step, (xs, ws) = _mlp_step(m)
  params, x = _inputs(m, xs, ws)
  real = check_module._host_outputs
  calls = []

  def plain_loss_off(tree):       # stands in for a GSPMD bug in plain jit's loss only
    paths, outs = real(tree)
    calls.append(None)
    if len(calls) == 2:           # transformed first, then plain
      outs[0] = check_module._Host(outs[0].value + 1.0, outs[0].dtype)
    return paths, outs

  monkeypatch.setattr(check_module, "_host_outputs", plain_loss_off)
  result = meshslice.check(step, algorithm="collective")(params, x)
  assert result.ok and result.culprit is None, str(result)
  assert len(result.report.rewritten) >= 3
  assert result.leaves[0].judged == "reference" and result.leaves[0].plain_off_reference
  assert str(result).endswith(
      "note: plain jax.jit itself is beyond tolerance of the unsharded reference on 1 "
      "output ([0]), where the transformed program is within tolerance: likely a GSPMD "
      "partitioning bug in plain jit, not the pass")
