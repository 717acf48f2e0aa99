"""meshslice.check on steps shaped like real trainers: donated train states, typed PRNG
keys, integer and complex outputs, Adam in bf16 (plain jit itself off the unsharded
run), steps with no site rewritten, and the `tolerance=` argument.

Every test compares the transformed program with plain jit and with the unsharded
reference (`check` runs all three); where it matters, the test also runs plain jit and
a single-device run itself.
"""
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import emit

from helpers import mesh

check_module = importlib.import_module("meshslice.check")   # the function shadows it


def _constrain(h, xs):
  """`with_sharding_constraint`, or nothing for the unsharded version (xs None)."""
  return h if xs is None else jax.lax.with_sharding_constraint(h, xs)


def _loss(xs):
  def loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = _constrain(h, xs)
    return jnp.sum(jnp.sin(h @ params["w2"]).astype(jnp.float32))
  return loss


def _params(ws, d=32, dtype=jnp.float32, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.device_put((jax.random.normal(k1, (d, d)) / 6).astype(dtype), ws),
          "w2": jax.device_put((jax.random.normal(k2, (d, d)) / 6).astype(dtype), ws)}


def _batch(xs, d=32, dtype=jnp.float32, seed=3):
  return jax.device_put(jax.random.normal(jax.random.key(seed), (16, d)).astype(dtype), xs)


def _corrupt_sites(monkeypatch, factor=1.5, dataflow="ls"):
  """Every site of `dataflow` (None: every site) gets a rewrite that multiplies its
  result by `factor` (a wrong rewrite)."""
  real = emit.build_body

  def corrupted(algorithm, geometry, ksplit, **kw):
    body = real(algorithm, geometry, ksplit, **kw)
    if dataflow is not None and getattr(geometry, "dataflow", None) != dataflow:
      return body
    return lambda a, b: body(a, b) * factor

  monkeypatch.setattr(emit, "build_body", corrupted)


def _edit_reference(monkeypatch, edit):
  """Apply `edit` to every output value of the unsharded reference (its run on moved
  inputs too, so the reference's sensitivity stays what it is)."""
  real = check_module._reference

  def edited(*a, **k):
    outs, why, moved = real(*a, **k)
    fix = lambda hs: None if hs is None else [check_module._Host(edit(h.value), h.dtype)
                                              for h in hs]
    return fix(outs), why, fix(moved)

  monkeypatch.setattr(check_module, "_reference", edited)


def _unsharded(fn, *args):
  """`fn` (built without sharding constraints) on one device, every input a host copy."""
  host = jax.tree.map(lambda x: np.asarray(x) if not jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x, args)
  with jax.default_device(jax.devices()[0]):
    return jax.jit(fn)(*host)


# ------------------------------------------------------------------------ donation
def test_check_copies_donated_inputs_and_the_callers_arrays_survive():
  m = mesh((2, 4))
  xs = ws = NamedSharding(m, P("x", "y"))
  def make(xs):
    def step(state, x):
      l, g = jax.value_and_grad(_loss(xs))(state["params"], x)
      params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], g)
      return l, {"params": params, "step": state["step"] + 1}
    return step

  step = make(xs)

  sh = {"params": {"w1": ws, "w2": ws}, "step": None}
  donating = jax.jit(step, in_shardings=(sh, xs), donate_argnums=0)
  state = {"params": _params(ws), "step": jnp.int32(7)}
  x = _batch(xs)
  before = jax.tree.map(np.asarray, state)
  result = meshslice.check(donating, algorithm="collective")(state, x)
  assert result.ok, str(result)
  assert result.reference == "ran"
  assert len(result.report.rewritten) >= 3
  # the caller's arrays were never handed to a donating program
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)
  assert [l.path for l in result.leaves][-1] == "[1]['step']"
  assert result.leaves[-1].vs_reference.mismatched == 0
  # and the step does donate: plain jit deletes what it is given
  copy = jax.tree.map(lambda a: a.copy(), state)
  plain_out = donating(copy, x)
  assert copy["params"]["w1"].is_deleted()
  ref_out = _unsharded(make(None), before, np.asarray(x))
  np.testing.assert_allclose(plain_out[0], ref_out[0], rtol=1e-4)
  assert int(plain_out[1]["step"]) == int(ref_out[1]["step"]) == 8

  # donated by name, the same
  named = jax.jit(step, in_shardings=(sh, xs), donate_argnames="state")
  result = meshslice.check(named, algorithm="collective")(state, x)
  assert result.ok, str(result)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


# ------------------------------------------------------------------------ keys, ints
def _keyed_step(xs, ws):
  """A train state holding a typed key (as Flax/MaxText states do); the step takes a
  key, returns the next one, an int32 step count and an int32 'accuracy' count."""
  loss = _loss(xs)

  def step(state, x, dropout_key):
    keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, 1), 0.9, x.shape)
    x = jnp.where(keep, x / 0.9, 0.0)
    l, g = jax.value_and_grad(loss)(state["params"], x)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], g)
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    correct = jnp.sum(jnp.argmax(logits, axis=-1) == jnp.arange(16) % 32).astype(jnp.int32)
    rng, _ = jax.random.split(state["rng"])
    return ({"params": params, "rng": rng, "step": state["step"] + 1},
            {"loss": l, "correct": correct, "next_key": jax.random.fold_in(dropout_key, 2)})

  sh = {"params": {"w1": ws, "w2": ws}, "rng": None, "step": None}
  return step, (None if xs is None else jax.jit(step, in_shardings=(sh, xs, None)))


def test_check_handles_typed_prng_keys_as_inputs_outputs_and_state_leaves():
  m = mesh((2, 4))
  xs = ws = NamedSharding(m, P("x", "y"))
  step, jitted = _keyed_step(xs, ws)
  state = {"params": _params(ws), "rng": jax.random.key(5), "step": jnp.int32(0)}
  x, key = _batch(xs), jax.random.key(9)
  result = meshslice.check(jitted, algorithm="collective")(state, x, key)
  assert result.ok, str(result)
  assert result.reference == "ran"
  by_path = {l.path: l for l in result.leaves}
  for path in ("[0]['rng']", "[1]['next_key']"):
    leaf = by_path[path]
    assert leaf.dtype == "key<fry>" and leaf.shape == ()
    assert leaf.vs_plain.mismatched == leaf.vs_reference.mismatched == 0
    assert leaf.judged == "reference"
  for path in ("[0]['step']", "[1]['correct']"):
    assert by_path[path].dtype == "int32" and by_path[path].vs_reference.mismatched == 0
  assert "key<fry>  equal" in str(result)
  # the keys check compared are the keys plain jit and a single-device run return
  plain_state, _ = jitted(state, x, key)
  ref_state, _ = _unsharded(_keyed_step(None, None)[0], state, x, key)
  np.testing.assert_array_equal(jax.random.key_data(plain_state["rng"]),
                                jax.random.key_data(ref_state["rng"]))


def test_check_compares_keys_and_integers_exactly(monkeypatch):
  """Outputs that are only a key and integers, both derived from a rewritten matmul: a
  wrong rewrite shows up in them, compared exactly (keys by their key_data)."""
  m = mesh((2, 4))
  xs = ws = NamedSharding(m, P("x", "y"))

  def make(xs):
    def step(w, x, key):
      h = _constrain(x @ w, xs)
      bucket = jnp.floor(jnp.sum(jnp.abs(h)) * 4).astype(jnp.int32)
      return jax.random.fold_in(key, bucket), bucket, jnp.argmax(h, axis=-1)
    return step

  jitted = jax.jit(make(xs), in_shardings=(ws, xs, None))
  w, x = _params(ws)["w1"], _batch(xs)
  key = jax.random.key(1)
  ok = meshslice.check(jitted, algorithm="collective")(w, x, key)
  assert ok.ok, str(ok)
  assert [l.dtype for l in ok.leaves] == ["key<fry>", "int32", "int32"]
  assert all(l.vs_reference.mismatched == 0 for l in ok.leaves)
  plain = jitted(w, x, key)
  ref = _unsharded(make(None), w, x, key)
  assert int(plain[1]) == int(ref[1])
  np.testing.assert_array_equal(jax.random.key_data(plain[0]), jax.random.key_data(ref[0]))

  report = meshslice.explain(jitted, algorithm="collective")(w, x, key)
  assert len(report.rewritten) == 1, str(report)
  _corrupt_sites(monkeypatch, dataflow=None)
  bad = meshslice.check(jitted, algorithm="collective")(w, x, key)
  assert not bad.ok
  assert [l.ok for l in bad.leaves] == [False, False, True]    # argmax(1.5 h) is argmax(h)
  assert bad.leaves[0].vs_reference.mismatched == 1
  assert bad.leaves[0].vs_plain.mismatched == 1
  assert bad.culprit is not None and bad.culprit.index == report.rewritten[0].index
  assert "key<fry>  1 differ DIFFERS" in str(bad)


# ------------------------------------------------------------------------ complex
def _complex_step(xs, ws):
  def step(w, x, v, y):
    h = _constrain(x @ w, xs)                          # K = 32
    g = _constrain(jnp.tanh(y) @ v, xs)                # K = 64
    return jax.lax.complex(h, g), jax.lax.complex(x, g)   # (both parts, imag only)
  return step, (None if xs is None else jax.jit(step, in_shardings=(ws,) * 4))


def _complex_inputs(ws):
  k = jax.random.split(jax.random.key(6), 4)
  shapes = ((32, 32), (16, 32), (64, 32), (16, 64))
  return [jax.device_put(jax.random.normal(ki, s) / 4, ws) for ki, s in zip(k, shapes)]


def test_check_compares_complex_outputs_on_both_parts_with_a_tolerance(monkeypatch):
  m = mesh((2, 4))
  ws = NamedSharding(m, P("x", "y"))
  step, jitted = _complex_step(ws, ws)
  args = _complex_inputs(ws)
  result = meshslice.check(jitted, algorithm="collective")(*args)
  assert result.ok, str(result)
  assert len(result.report.rewritten) == 2
  assert [l.dtype for l in result.leaves] == ["complex64", "complex64"]
  assert all(l.judged == "reference" for l in result.leaves)
  # float reassociation in both parts (the last bits of a sharded sum; XLA versions
  # differ in whether this program shows any): within complex64's tolerance
  _edit_reference(monkeypatch, lambda v: v * (1 + 3e-6) + 2e-6j * np.abs(v).max())
  noisy = meshslice.check(jitted, algorithm="collective")(*args)
  assert noisy.ok, str(noisy)
  assert all(l.vs_reference.max_abs > 0 and l.judged == "reference" for l in noisy.leaves)
  monkeypatch.undo()
  plain = jitted(*args)
  ref = _unsharded(_complex_step(None, None)[0], *args)
  np.testing.assert_allclose(np.asarray(plain[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
  assert float(np.abs(np.asarray(plain[0]) - np.asarray(ref[0])).max()) == pytest.approx(
      result.leaves[0].plain_vs_reference.max_abs)


def test_check_catches_a_wrong_imaginary_part(monkeypatch):
  m = mesh((2, 4))
  ws = NamedSharding(m, P("x", "y"))
  _, jitted = _complex_step(ws, ws)
  args = _complex_inputs(ws)
  real = emit.build_body

  def imaginary_site_wrong(algorithm, geometry, ksplit, **kw):     # g = tanh(y) @ v
    body = real(algorithm, geometry, ksplit, **kw)
    if getattr(geometry, "global_extent", None) != 64:
      return body
    return lambda a, b: body(a, b) * 1.5

  monkeypatch.setattr(emit, "build_body", imaginary_site_wrong)
  result = meshslice.check(jitted, algorithm="collective")(*args)
  assert not result.ok, str(result)
  second = result.leaves[1]          # complex(x, g): only the imaginary part is wrong
  assert not second.ok and not second.vs_reference.ok and not second.vs_plain.ok
  assert second.plain_vs_reference.ok
  assert result.culprit is not None and result.culprit.lhs_shape[-1] == 64, str(result)


# ------------------------------------------------------------------------ error model
LR = 0.05


def _adam_step(xs, ws, real_gradients=False):
  """bf16 params, Adam's first step (bias-corrected: the update is lr * g / |g|). The
  batch's second half negates the first and h = tanh(x @ w1) is odd in x, so the
  gradients through sin (odd) cancel to ~0: whichever order a program sums in decides
  their sign, as with a real model's near-zero gradients. With `real_gradients`, the
  last 16 columns of w2's output go through cos (even) instead, which gives every
  weight a real gradient too."""

  def loss(params, x):
    h = _constrain(jnp.tanh(x @ params["w1"]), xs)
    y = (h @ params["w2"]).astype(jnp.float32)
    if not real_gradients:
      return jnp.sum(jnp.sin(y))
    return jnp.sum(jnp.sin(y[:, :16])) + jnp.sum(jnp.cos(y[:, 16:]))

  def step(params, opt, x):
    l, g = jax.value_and_grad(loss)(params, x)
    g = jax.tree.map(lambda g: g.astype(jnp.float32), g)
    m1 = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], g)
    v1 = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], g)
    upd = jax.tree.map(lambda m, v: (m / 0.1) / (jnp.sqrt(v / 0.001) + 1e-8), m1, v1)
    new = jax.tree.map(lambda p, u: (p - LR * u).astype(p.dtype), params, upd)
    return l, new, {"m": m1, "v": v1}

  sh = {"w1": ws, "w2": ws}
  return step, (None if xs is None else jax.jit(step, in_shardings=(sh, {"m": sh, "v": sh},
                                                                    xs)))


def _adam_inputs(ws, xs):
  params = _params(ws, dtype=jnp.bfloat16)
  zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  opt = jax.device_put({"m": zeros(), "v": zeros()}, {"m": {"w1": ws, "w2": ws},
                                                     "v": {"w1": ws, "w2": ws}})
  half = jax.random.normal(jax.random.key(3), (8, 32), jnp.bfloat16)
  return params, opt, jax.device_put(jnp.concatenate([half, -half]), xs)


def test_check_bf16_adam_step_agrees_when_plain_jit_is_as_far_from_the_reference():
  m = mesh((2, 4))
  xs = ws = NamedSharding(m, P("x", "y"))
  step, jitted = _adam_step(xs, ws)
  params, opt, x = _adam_inputs(ws, xs)
  result = meshslice.check(jitted, algorithm="collective")(params, opt, x)
  assert result.ok, str(result)
  assert result.reference == "ran" and len(result.report.rewritten) >= 3
  assert result.culprit is None and result.suspects == () and result.note == ""
  by_path = {l.path: l for l in result.leaves}
  w2 = by_path["[1]['w2']"]
  # plain jit itself is beyond bf16's tolerance of the unsharded run: Adam's +-lr ...
  assert not w2.plain_vs_reference.ok
  assert w2.plain_vs_reference.max_abs > LR / 2
  # ... and the rewrite exactly as far: it agrees, judged by plain jit's own distance
  assert w2.vs_reference.max_abs == w2.plain_vs_reference.max_abs
  assert w2.ok and w2.judged == "plain's distance"
  text = str(result)
  assert text.startswith("meshslice.check: OK: 7 of 7 outputs agree with the unsharded "
                         "reference (")
  assert "GSPMD partitioning bug in plain jit" not in text
  assert "responsible:" not in text
  # the distances check reports are the ones plain jit and a single-device run give
  plain_new = np.asarray(jitted(params, opt, x)[1]["w2"], np.float32)
  ref_new = np.asarray(_unsharded(_adam_step(None, None)[0], params, opt, x)[1]["w2"],
                       np.float32)
  assert float(np.abs(plain_new - ref_new).max()) == pytest.approx(
      w2.plain_vs_reference.max_abs)


def test_check_bf16_adam_step_still_blames_a_wrong_site(monkeypatch):
  """The error model does not hide a wrong rewrite: with real gradients, Adam's moments
  are within tolerance for plain jit, so a site that scales its result is caught and
  named (and the correct rewrite agrees, the +-lr of w2's cancelling columns or not)."""
  m = mesh((2, 4))
  xs = ws = NamedSharding(m, P("x", "y"))
  _, jitted = _adam_step(xs, ws, real_gradients=True)
  params, opt, x = _adam_inputs(ws, xs)
  assert meshslice.check(jitted, algorithm="collective", bisect=False)(params, opt, x).ok
  report = meshslice.explain(jitted, algorithm="collective")(params, opt, x)
  os_sites = [s.index for s in report.rewritten if s.dataflow == "os"]
  assert os_sites, str(report)
  _corrupt_sites(monkeypatch, dataflow="os")
  result = meshslice.check(jitted, algorithm="collective")(params, opt, x)
  assert not result.ok
  assert result.culprit is not None and result.culprit.index in os_sites, str(result)
  assert result.note.startswith("bisection: ") and "with every site left alone the " \
      "outputs agree, with only this site rewritten they still disagree" in result.note
  bad = {l.path for l in result.leaves if not l.ok}
  assert "[2]['m']['w1']" in bad and result.leaves[3].plain_vs_reference.ok


def test_check_names_no_site_when_plain_jit_is_off_everywhere_it_fails(monkeypatch):
  """Plain jit beyond tolerance of the reference on every output (the reference shifted
  by 1), the rewrite farther still: DISAGREES, bisection points at a site, but without
  an output where plain jit is right the evidence does not single it out."""
  m = mesh((2, 4))
  xs = ws = NamedSharding(m, P("x", "y"))
  loss = _loss(xs)
  step = jax.jit(jax.value_and_grad(loss), in_shardings=({"w1": ws, "w2": ws}, xs))
  params, x = _params(ws), _batch(xs)
  _edit_reference(monkeypatch, lambda v: v + 1.0)
  _corrupt_sites(monkeypatch, factor=3.0)
  result = meshslice.check(step, algorithm="collective")(params, x)
  assert not result.ok, str(result)
  assert result.culprit is None
  assert len(result.suspects) == 1
  assert result.note.endswith(
      f"point at site {result.suspects[0]}, but plain jit is itself beyond tolerance of "
      "the reference on every output the transformed program gets wrong, so amplified "
      "float noise cannot be told from a wrong rewrite; no site is blamed")
  assert "responsible:" not in str(result)


# ------------------------------------------------------------------------ 0 sites
def test_check_with_no_site_rewritten_cannot_disagree_because_of_the_pass():
  """No 2D matmul (as a penzai step's sites were all left alone): the transformed
  program is plain jit's, so plain jit's distance to the reference is not the pass's."""
  m = mesh((2, 4))
  xs = NamedSharding(m, P(("x", "y")))
  half = jax.random.normal(jax.random.key(4), (512,))

  def step(v):
    return jnp.sum(jnp.sin(v) * jnp.cos(v)), jnp.cumsum(jnp.sin(v))

  jitted = jax.jit(step, in_shardings=(xs,))
  v = jax.device_put(jnp.concatenate([half, -half]), xs)
  result = meshslice.check(jitted)(v)
  assert len(result.report.rewritten) == 0
  assert result.ok, str(result)
  assert result.leaves[0].judged == "plain"
  assert str(result).startswith("meshslice.check: OK: 2 of 2 outputs agree with the "
                                "unsharded reference (no site rewritten, 2 with plain jit); "
                                "0 of 0 matmuls rewritten")
  assert str(result).endswith("note: plain jax.jit itself is beyond tolerance of the "
                              "unsharded reference on 1 output ([0]); no site is rewritten, "
                              "so that is plain jit's own error, not the pass's")
  # plain jit really is off the reference on the cancelling sum
  assert not result.leaves[0].plain_vs_reference.ok
  plain = float(jitted(v)[0])
  ref = float(_unsharded(step, v)[0])
  assert plain != ref
  assert result.leaves[0].vs_reference.max_abs == pytest.approx(abs(plain - ref))


# ------------------------------------------------------------------------ tolerance=
def test_check_tolerance_argument():
  m = mesh((2, 4))
  xs = ws = NamedSharding(m, P("x", "y"))
  step = jax.jit(jax.value_and_grad(_loss(xs)), in_shardings=({"w1": ws, "w2": ws}, xs))
  params, x = _params(ws), _batch(xs)
  loose = meshslice.check(step, algorithm="collective", tolerance=1e-3)(params, x)
  assert loose.ok and all(l.judged == "reference" for l in loose.leaves), str(loose)
  exact = meshslice.check(step, algorithm="collective", tolerance={"float32": 0.0})(
      params, x)
  assert not exact.leaves[0].vs_reference.ok        # a zero tolerance is applied ...
  assert exact.ok and exact.leaves[0].judged == "plain's distance"   # ... judged by plain
  assert meshslice.check(step, tolerance={jnp.bfloat16: 0.1, "float32": 2e-4}) is not None

  def raises(exc, message, tolerance):
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
      meshslice.check(step, tolerance=tolerance)

  raises(TypeError, "meshslice.check: tolerance= must be a number (used for every floating "
         "and complex dtype) or a dict from dtype name to number, e.g. {'bfloat16': 5e-2}; "
         "got str", "1e-3")
  raises(ValueError, "meshslice.check: tolerance= must be a non-negative finite number, "
         "got -0.001", -1e-3)
  raises(ValueError, "meshslice.check: tolerance= must be a non-negative finite number, "
         "got nan", float("nan"))
  raises(ValueError, "meshslice.check: tolerance key 'float33' is not a dtype name (e.g. "
         "'float32', 'bfloat16')", {"float33": 1e-3})
  raises(ValueError, "meshslice.check: tolerance['int32']: int32 outputs are compared "
         "exactly; tolerances apply to floating and complex dtypes", {"int32": 1})
  raises(TypeError, "meshslice.check: tolerance['bfloat16'] must be a non-negative number, "
         "got str 'big'", {"bfloat16": "big"})
  raises(TypeError, "meshslice.check: tolerance= must be a number (used for every floating "
         "and complex dtype) or a dict from dtype name to number, e.g. {'bfloat16': 5e-2}; "
         "got bool", True)


# ------------------------------------------------------------------------ messages, scan
def test_check_skip_reason_is_not_cut_mid_word():
  """A primitive that has no unsharded evaluation: the reference is skipped with the
  whole reason (its first line), not 200 characters of it."""
  from jax.extend.core import Primitive
  from jax.interpreters import mlir

  words = " ".join(f"word{i}" for i in range(40))       # ~300 characters
  prim = Primitive("needs_sharding")

  def abstract(x, *, sharding):
    if sharding is None:
      raise ValueError(f"needs_sharding needs its sharding: {words} end\nsecond line")
    return jax.core.ShapedArray(x.shape, x.dtype)

  prim.def_abstract_eval(abstract)
  mlir.register_lowering(prim, mlir.lower_fun(lambda x, sharding: [x * 2],
                                              multiple_results=True))
  m = mesh((2, 2))
  s = NamedSharding(m, P("x", "y"))
  step = jax.jit(lambda a: prim.bind(a, sharding="tag") @ a, in_shardings=(s,))
  a = jax.device_put(jnp.ones((8, 8)), s)
  result = meshslice.check(step)(a)
  assert result.ok, str(result)
  assert result.reference == ("no unsharded evaluation of needs_sharding: ValueError: "
                              f"needs_sharding needs its sharding: {words} end")
  assert f"(unsharded reference skipped: {result.reference})" in str(result)


def test_check_scan_reference_reads_scan_params_through_the_shim(monkeypatch):
  counted = []
  reference_module = importlib.import_module("meshslice.reference")
  real = reference_module.scan_counts
  monkeypatch.setattr(reference_module, "scan_counts",
                      lambda params: counted.append(1) or real(params))
  m = mesh((2, 2))
  xs, ws = NamedSharding(m, P("x", "y")), NamedSharding(m, P(None, "x", "y"))

  def loss(w, x):
    h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
    return jnp.sum(jax.lax.with_sharding_constraint(h, xs) ** 2)

  step = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=(ws, xs))
  w = jax.device_put(jax.random.normal(jax.random.key(2), (2, 16, 16)) / 4, ws)
  x = jax.device_put(jax.random.normal(jax.random.key(3), (16, 16)), xs)
  result = meshslice.check(step)(w, x)
  assert result.ok and result.reference == "ran", str(result)
  assert len(counted) >= 2          # the forward and the backward scan


def test_check_rejects_an_nnx_jit_step_with_what_to_do():
  nnx = pytest.importorskip("flax.nnx")
  step = nnx.jit(lambda model, x: jnp.sum(model(x)))
  with pytest.raises(TypeError, match="^" + re.escape(
      "meshslice.check cannot run an nnx.jit step: each call updates its Modules in "
      "place, and check runs the step several times on the same inputs. Check the "
      "functional step instead: graphdef, state = nnx.split((model, optimizer)), then "
      "meshslice.check(jax.jit(pure_step))(state, batch) with pure_step merging, "
      "stepping and splitting again") + "$"):
    meshslice.check(step)
  # what the message suggests runs: the functional step, model state as a pytree
  m = mesh((2, 4))
  model = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  xs = NamedSharding(m, P("x", "y"))

  def pure_step(state, x):
    model = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(
        lambda model: jnp.sum(jnp.sin(jax.lax.with_sharding_constraint(model(x), xs))))(model)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model), grads))
    return loss, nnx.state(model)

  state = jax.device_put(state, jax.tree.map(
      lambda v: NamedSharding(m, P("x", "y") if v.ndim == 2 else P("y")), state))
  result = meshslice.check(jax.jit(pure_step, donate_argnums=0), algorithm="collective")(
      state, _batch(xs))
  assert result.ok and result.reference == "ran", str(result)
  assert len(result.report.rewritten) == 2, str(result)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_check_judges_an_ill_conditioned_output_by_the_references_sensitivity(monkeypatch):
  """0.05 * sign(x @ w) on small integers: every program sums exactly (plain jit equals
  the reference), but the exact zeros flip to +-0.05 when the inputs move by one
  rounding step. A rewrite's output off by such a flip agrees ('sensitivity'); one off
  by ten times that does not."""
  m = mesh((2, 4))
  s = NamedSharding(m, P("x", "y"))
  k1, k2 = jax.random.split(jax.random.key(7))
  x = jax.device_put(jax.random.randint(k1, (16, 32), -1, 2).astype(jnp.float32), s)
  w = jax.device_put(jax.random.randint(k2, (32, 32), -1, 2).astype(jnp.float32), s)

  def make(xs):
    return lambda w, x: 0.05 * jnp.sign(_constrain(x @ w, xs))

  step = jax.jit(make(s), in_shardings=(s, s))
  exact = np.asarray(_unsharded(make(None), w, x))
  zero = tuple(np.argwhere(exact == 0)[0])
  assert np.array_equal(np.asarray(step(w, x)), exact)       # plain jit sums exactly too
  real = check_module._host_outputs

  def rewrite_off_by(delta):
    calls = []

    def outputs(tree):           # the transformed program's outputs (its run is first)
      paths, outs = real(tree)
      calls.append(None)
      if len(calls) == 1:
        value = outs[0].value.copy()
        value[zero] += delta
        outs[0] = check_module._Host(value, outs[0].dtype)
      return paths, outs
    monkeypatch.setattr(check_module, "_host_outputs", outputs)

  rewrite_off_by(0.05)
  result = meshslice.check(step, algorithm="collective")(w, x)
  leaf = result.leaves[0]
  assert result.ok, str(result)
  assert leaf.plain_vs_reference.max_abs == 0 and not leaf.vs_reference.ok
  assert leaf.judged == "sensitivity" and leaf.sensitivity == pytest.approx(0.05)
  assert str(result).endswith(
      "note: <out>: the unsharded run itself moves by more than the tolerance when its "
      "inputs move by one rounding step of the rewritten matmuls' dtype; judged against "
      "that")
  rewrite_off_by(0.5)
  bad = meshslice.check(step, algorithm="collective", bisect=False)(w, x)
  assert not bad.ok and bad.leaves[0].judged == "", str(bad)
