"""A weight gradient's gather waits for the cotangent.

dW = x^T . dy is planned with operands swapped (RS: x is gathered). x is a forward
activation, ready long before dy, so without a data dependence XLA hoists its gather (and
the checkpointed block's recomputation) into the forward pass, and every layer's gathered
copy stays live until its backward: temp memory grew with depth (1.27x plain jit at 8
unrolled layers). `rewrites.slicing.not_before` ties the gathered operand to the other one,
bit for bit.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import backend_flags, emit
from meshslice.rewrites.platform import target_platform
from meshslice.rewrites.slicing import not_before

from helpers import assert_trees_close, mesh, shard_map_bodies


def test_not_before_returns_x_bit_for_bit_whatever_the_anchor_holds():
  x = np.array([1.5, -0.0, 0.0, np.inf, -np.inf, np.nan, -3.25], np.float32)
  for anchor in ([2.0], [np.inf], [-np.inf], [np.nan], [-0.0]):
    for dtype in (jnp.float32, jnp.bfloat16):
      got = np.asarray(not_before(jnp.asarray(x, dtype), jnp.asarray(anchor, dtype)),
                       np.float32)
      want = np.asarray(jnp.asarray(x, dtype), np.float32)
      np.testing.assert_array_equal(got, want)
      np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _depends_on(jaxpr, var, source):
  """Whether `var` is computed from `source` in `jaxpr` (no sub-jaxprs needed here)."""
  producers = {o: e for e in jaxpr.eqns for o in e.outvars}
  todo, seen = [var], set()
  while todo:
    v = todo.pop()
    if v is source:
      return True
    if v in seen or v not in producers:
      continue
    seen.add(v)
    todo.extend(i for i in producers[v].invars if not hasattr(i, "val"))
  return False


def _loss(params, x, layers):
  block = jax.checkpoint(lambda x, w1, w2: x + jnp.tanh(x @ w1) @ w2)
  for i in range(layers):
    x = block(x, params["w1"][i], params["w2"][i])
  return jnp.mean(jnp.square(x))


def _setup(layers, hidden=64, ffn=256, msh=None):
  """The jitted unrolled step and its inputs on `msh` (default: the 8 CPU devices as
  2x4, with values; a mesh of other devices gets abstract inputs)."""
  msh = msh or mesh((2, 4))
  ws = NamedSharding(msh, P(None, "x", "y"))
  xs = NamedSharding(msh, P("x", None, "y"))
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(keys[0], (layers, hidden, ffn)) / 8,
            "w2": jax.random.normal(keys[1], (layers, ffn, hidden)) / 16}
  x = jax.random.normal(keys[2], (8, 16, hidden))
  if msh.devices.flat[0].platform == "cpu":
    params = {k: jax.device_put(v, ws) for k, v in params.items()}
    x = jax.device_put(x, xs)
  else:
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=ws) for k, v in params.items()}
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=xs)

  def step(params, x):
    loss, grads = jax.value_and_grad(_loss)(params, x, layers)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  jitted = jax.jit(step, in_shardings=({"w1": ws, "w2": ws}, xs),
                   out_shardings=({"w1": ws, "w2": ws}, NamedSharding(msh, P())))
  return jitted, params, x


def _tied_gathers(fast, params, x):
  """How many shard_map bodies gather their lhs only once their rhs exists."""
  tied = 0
  for body in shard_map_bodies(fast, params, x):
    lhs, rhs = body.invars
    for eqn in body.eqns:
      if eqn.primitive.name == "all_gather" and _depends_on(body, eqn.invars[0], lhs):
        tied += _depends_on(body, eqn.invars[0], rhs)
  return tied


def test_the_weight_gradient_gather_depends_on_the_cotangent():
  jitted, params, x = _setup(layers=1)
  fast = meshslice.transform(jitted)
  weight_grads = [s for s in fast.explain(params, x).rewritten if s.swapped]
  assert weight_grads and {s.dataflow for s in weight_grads} == {"rs"}
  assert _tied_gathers(fast, params, x) == len(weight_grads)


def test_weight_gradients_are_not_tied_when_compiling_for_tpu():
  """The tie pays on the CPU compiler only: on libtpu it cost temp memory and compute
  (4 unrolled GPT-3 layers at 256 chips: 8,327 -> 9,082 MiB, 601 -> 612 Mcycles)."""
  pytest.importorskip("libtpu")
  from meshslice import aot
  tpu_mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  assert target_platform(tpu_mesh) == "tpu"
  assert target_platform(mesh((2, 4))) == "cpu"
  jitted, params, x = _setup(layers=1, msh=tpu_mesh)
  # sites rewritten even where they only tie with XLA's program (on TPU devices the
  # default plan leaves those to XLA)
  fast = meshslice.transform(jitted, xla_baseline="none",     # the flags a TPU rewrite needs
                             compiler_flags=backend_flags.tpu_overlap_flags("v4"))
  with jax.set_mesh(tpu_mesh):
    weight_grads = [s for s in fast.explain(params, x).rewritten if s.swapped]
    assert weight_grads and {s.dataflow for s in weight_grads} == {"rs"}
    assert _tied_gathers(fast, params, x) == 0


def test_weight_gradients_inside_a_scan_body_are_not_tied():
  """In a loop body a hoisted gather stays within its iteration; there the tie only
  stops XLA from sharing work between sites (measured on the TPU compiler)."""
  layers = 2
  jitted, params, x = _setup(layers)

  del jitted

  def scanned_loss(params, x):
    block = jax.checkpoint(lambda x, w: (x + jnp.tanh(x @ w[0]) @ w[1], None))
    return jnp.mean(jnp.square(jax.lax.scan(block, x, (params["w1"], params["w2"]))[0]))

  step = jax.jit(jax.value_and_grad(scanned_loss),
                 in_shardings=(jax.tree.map(lambda a: a.sharding, params), x.sharding))
  fast = meshslice.transform(step)
  weight_grads = [s for s in fast.explain(params, x).rewritten if s.swapped]
  assert weight_grads and all("scan" in s.scopes for s in weight_grads)
  assert _tied_gathers(fast, params, x) == 0
  out = fast(params, x)
  assert_trees_close(out, step(params, x))
  host = jax.tree.map(np.asarray, params)
  assert_trees_close(out, jax.jit(jax.value_and_grad(scanned_loss))(host, np.asarray(x)))


def test_unrolled_checkpointed_layers_keep_temp_memory_at_or_below_plain_jit():
  layers = 4
  jitted, params, x = _setup(layers)
  fast = meshslice.transform(jitted)
  plain_temp = jitted.lower(params, x).compile().memory_analysis().temp_size_in_bytes
  temp = fast.lower(params, x).compile().memory_analysis().temp_size_in_bytes
  assert temp <= plain_temp, (temp, plain_temp)
  new, loss = fast(params, x)
  ref_new, ref_loss = jitted(params, x)
  assert_trees_close((new, loss), (ref_new, ref_loss))
  # and against one device, no sharding at all
  host = jax.tree.map(np.asarray, params)
  one = jax.jit(lambda p, x: jax.tree.map(
      lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x, layers)))(host, np.asarray(x))
  assert_trees_close(new, one)


@pytest.mark.skipif(jax.__version_info__ >= (0, 11), reason=(
    "jax >= 0.11's CPU compiler does not hoist the untied gathers into the forward pass "
    "(4 layers, jax 0.11.2 and 0.12.0.1: temp 311,296 B tied and untied, plain jit 377,544 B)"))
def test_without_the_tie_the_hoisted_gathers_cost_memory(monkeypatch):
  """The memory test above can fail: emitted without the tie, temp exceeds plain jit."""
  layers = 4
  jitted, params, x = _setup(layers)
  plain_temp = jitted.lower(params, x).compile().memory_analysis().temp_size_in_bytes
  monkeypatch.setattr(emit, "_gathers_wait", lambda body, geometry: body)
  temp = meshslice.transform(jitted).lower(params, x).compile().memory_analysis(
  ).temp_size_in_bytes
  assert temp > plain_temp, (temp, plain_temp)


def _scanned_step(params, x):
  def scanned_loss(params, x):
    block = jax.checkpoint(lambda x, w: (x + jnp.tanh(x @ w[0]) @ w[1], None))
    return jnp.mean(jnp.square(jax.lax.scan(block, x, (params["w1"], params["w2"]))[0]))

  step = jax.jit(jax.value_and_grad(scanned_loss),
                 in_shardings=(jax.tree.map(lambda a: a.sharding, params), x.sharding))
  return scanned_loss, step


def test_hold_gathers_true_ties_weight_gradients_inside_a_scan_body_too():
  """`hold_gathers=True` ties every weight gradient, loop bodies included (on TPU it cut
  libtpu's peak for tune's GPT-3 plan at 256 chips: docs/benchmarks-log.md); values and
  gradients stay those of the original and of an unsharded run."""
  _, params, x = _setup(layers=2)
  scanned_loss, step = _scanned_step(params, x)
  fast = meshslice.transform(step, hold_gathers=True)
  weight_grads = [s for s in fast.explain(params, x).rewritten if s.swapped]
  assert weight_grads and all("scan" in s.scopes for s in weight_grads)
  assert _tied_gathers(fast, params, x) == len(weight_grads)
  assert _tied_gathers(meshslice.transform(step), params, x) == 0
  out = fast(params, x)
  assert_trees_close(out, step(params, x))
  host = jax.tree.map(np.asarray, params)
  assert_trees_close(out, jax.jit(jax.value_and_grad(scanned_loss))(host, np.asarray(x)))


def test_hold_gathers_false_never_ties():
  jitted, params, x = _setup(layers=1)
  fast = meshslice.transform(jitted, hold_gathers=False)
  assert [s for s in fast.explain(params, x).rewritten if s.swapped]
  assert _tied_gathers(fast, params, x) == 0


@pytest.mark.parametrize("value", ["always", 1, None])
def test_hold_gathers_rejects_anything_but_auto_true_false(value):
  with pytest.raises(ValueError, match=re.escape(
      f"hold_gathers must be 'auto', True or False, got {value!r}")):
    meshslice.transform(lambda x: x, hold_gathers=value)


def test_hold_gathers_as_a_site_pin_holds_that_site_only_and_a_plan_keeps_it():
  """A pin holds one weight gradient back (what tune may choose per site); the report
  says `held`, the saved plan records it, and applying the plan emits the same ties. A
  pin on a site whose operands are not swapped is not used, and the note says so."""
  _, params, x = _setup(layers=2)
  _, step = _scanned_step(params, x)
  report = meshslice.transform(step).explain(params, x)
  weight_grads = [s.index for s in report.rewritten if s.swapped]
  forward = next(s.index for s in report.rewritten if not s.swapped)
  pinned = meshslice.transform(step, overrides={weight_grads[0]: {"hold_gathers": True},
                                                forward: {"hold_gathers": True}})
  pinned_report = pinned.explain(params, x)
  by_index = {s.index: s for s in pinned_report.sites}
  assert by_index[weight_grads[0]].hold_gathers is True
  assert all(by_index[i].hold_gathers is None for i in weight_grads[1:])
  assert by_index[forward].hold_gathers is None
  assert (f"overrides[{forward}]: hold_gathers=True not used: only weight gradients "
          "(sites with swapped operands) hold their gathers back") in by_index[forward].note
  assert " held" in str(pinned_report)
  assert _tied_gathers(pinned, params, x) == 1
  plan = meshslice.Plan.from_json(pinned_report.plan.to_json())
  held = [e["index"] for e in plan.sites if e.get("hold_gathers")]
  assert held == [weight_grads[0]]
  assert _tied_gathers(meshslice.transform(step, plan=plan), params, x) == 1
  # edited back off: a False pin overrides the global option
  off = meshslice.transform(step, plan=plan.edit(weight_grads[0], hold_gathers=False),
                            hold_gathers=True)
  assert _tied_gathers(off, params, x) == len(weight_grads) - 1
  assert_trees_close(pinned(params, x), step(params, x))
