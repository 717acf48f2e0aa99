"""Sums of rewritten matmuls share one reduce-scatter (option share_reductions).

The demo's backward pass sums the attention projections' input gradients, dhn = dq Wq^T
+ dk Wk^T + dv Wv^T. Its three sites are planned alike (ls), so the emitter adds their
partial products on each device and reduce-scatters the sum once. Same values and
gradients as plain jit and an unsharded run; two reduce-scatters fewer in the compiled
program; the report says which sites share one; share_reductions=False sends one a
term; which sums qualify (`matmul_sums.shared_reductions`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import gpt
from meshslice.matmul_sums import shared_reductions
from meshslice.rewrites import build_summed_body, summable

from helpers import assert_trees_close, collective_counts, mesh, shard_map_bodies

# the demo's attention input-gradient sites (v, k, q): ls, summed into dhn
_INPUT_GRADIENTS = (26, 28, 30)


@pytest.fixture(scope="module")
def demo_run():
  """The demo step, its outputs under plain jit and on one device (no sharding)."""
  cfg = gpt.ModelConfig()
  m = gpt.make_mesh((2, 4))
  step = gpt.make_step(cfg, m, donate=False)
  params, batch = gpt.place(cfg, m)
  plain = step(params, batch)
  with jax.default_device(jax.devices()[0]):
    single = jax.jit(lambda p, b: gpt.train_step(cfg, p, b))(
        *jax.device_get((params, batch)))
  return step, params, batch, plain, single


def _pinned(plan):
  return {i: dict(plan, dataflow="ls") for i in _INPUT_GRADIENTS}


@pytest.mark.parametrize("plan", [{"algorithm": "collective"},
                                  {"algorithm": "meshslice", "ksplit": 2},
                                  {"algorithm": "meshslice", "ksplit": 2,
                                   "reduce_scatter": "all_to_all"}],
                         ids=["collective", "meshslice-S2", "meshslice-S2-all_to_all"])
def test_shared_sum_matches_plain_jit_and_the_unsharded_run(plan, demo_run):
  step, params, batch, plain, single = demo_run
  fast = meshslice.transform(step, overrides=_pinned(plan))
  report = fast.explain(params, batch)
  for i in _INPUT_GRADIENTS:
    others = ", ".join(f"#{k}" for k in _INPUT_GRADIENTS if k != i)
    assert (f"one reduce-scatter with sites {others}: their results are only summed"
            in report.sites[i].note)
  assert not any("one reduce-scatter with" in s.note for s in report.sites
                 if s.index not in _INPUT_GRADIENTS)
  new = fast(params, batch)
  assert_trees_close(new, plain)
  assert_trees_close(new, single)


def test_one_shard_map_and_two_reduce_scatters_fewer(demo_run):
  step, params, batch, plain, _ = demo_run
  overrides = _pinned({"algorithm": "collective"})
  shared = meshslice.transform(step, overrides=overrides)
  apart = meshslice.transform(step, overrides=overrides, share_reductions=False)
  # the three sites are one shard_map taking their six operands
  six = [b for b in shard_map_bodies(shared, params, batch) if len(b.invars) == 6]
  assert len(six) == 1
  assert not [b for b in shard_map_bodies(apart, params, batch) if len(b.invars) == 6]
  counts = {name: collective_counts(fn.lower(params, batch).compile().as_text())
            for name, fn in (("shared", shared), ("apart", apart))}
  assert counts["shared"]["reduce-scatter"] == counts["apart"]["reduce-scatter"] - 2
  assert counts["shared"]["all-gather"] == counts["apart"]["all-gather"]
  assert not any("one reduce-scatter with" in s.note
                 for s in apart.explain(params, batch).sites)
  assert_trees_close(apart(params, batch), plain)


def test_bfloat16_sum_within_the_documented_tolerance():
  """In bf16 the shared sum adds the partial products in float32 before rounding once,
  where each term's result was rounded: within the bf16 tolerance of plain jit."""
  cfg = gpt.ModelConfig(dtype="bfloat16")
  m = gpt.make_mesh((2, 4))
  step = gpt.make_step(cfg, m, donate=False)
  params, batch = gpt.place(cfg, m)
  fast = meshslice.transform(step, overrides=_pinned({"algorithm": "meshslice",
                                                      "ksplit": 2}))
  assert "one reduce-scatter with" in fast.explain(params, batch).sites[26].note
  assert_trees_close(fast(params, batch), step(params, batch), dtype=jnp.bfloat16)


def test_only_whole_sums_of_alike_terms_qualify():
  x = jnp.ones((8, 8))
  alike = lambda i: "ls"

  def sums(fn, key_of=alike, n=3):
    return shared_reductions(jax.make_jaxpr(fn)(*[x] * n).jaxpr, key_of)

  assert sums(lambda a, b, c: a @ b + a @ c) == {2: ((0, 1), ())}
  assert sums(lambda a, b, c: (a @ b + a @ c) + b @ c) == {4: ((0, 1, 3), (2,))}
  # a residual added in: the sum is not the terms' alone
  assert sums(lambda a, b, c: a @ b + a @ c + c) == {}
  # an op between a term and the sum (a transpose, a scale)
  assert sums(lambda a, b, c: (a @ b).T + a @ c) == {}
  assert sums(lambda a, b, c: 2 * (a @ b) + a @ c) == {}
  # a term's result used elsewhere too
  assert sums(lambda a, b, c: (lambda t: (t + a @ c) * t)(a @ b)) == {}
  # terms planned differently, or not rewritten (key None)
  assert sums(lambda a, b, c: a @ b + a @ c, key_of=lambda i: i) == {}
  assert sums(lambda a, b, c: a @ b + a @ c, key_of=lambda i: None) == {}
  # one term alone is no sharing
  assert sums(lambda a, b: a @ b + b, n=2) == {}


def test_summed_body_equals_the_sum_of_products():
  m = mesh((2, 4))
  rng = np.random.RandomState(5)
  geometry = meshslice.rewrites.GemmGeometry(
      dimension_numbers=(((1,), (0,)), ((), ())), dataflow="ls", row_axis="x",
      col_axis="y", row_size=2, col_size=4, lhs_dim=None, rhs_dim=1, out_dim=1,
      global_extent=64)
  assert summable("meshslice", geometry) and not summable("cannon", geometry)
  lhs = [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(3)]
  rhs = [rng.standard_normal((32, 64)).astype(np.float32) for _ in range(3)]
  want = sum(a @ b for a, b in zip(lhs, rhs))
  specs = (P("x", "y"), P("y", "x")) * 3
  operands = [jax.device_put(v, NamedSharding(m, s))
              for v, s in zip([v for pair in zip(lhs, rhs) for v in pair], specs)]
  for algorithm, ksplit in (("collective", 1), ("meshslice", 2)):
    body = build_summed_body(algorithm, geometry, ksplit, 3)
    got = jax.jit(jax.shard_map(body, mesh=m, in_specs=specs,
                                out_specs=P("x", "y")))(*operands)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="build_meshslice_sum: expected 6 operands"):
    jax.jit(jax.shard_map(build_summed_body("collective", geometry, 1, 3), mesh=m,
                          in_specs=specs[:4], out_specs=P("x", "y")))(*operands[:4])
  os_geometry = meshslice.rewrites.GemmGeometry(
      dimension_numbers=(((1,), (0,)), ((), ())), dataflow="os", row_axis="x",
      col_axis="y", row_size=2, col_size=4, lhs_dim=1, rhs_dim=0, out_dim=None,
      global_extent=32)
  with pytest.raises(ValueError, match="has no summed form"):
    build_summed_body("collective", os_geometry, 1, 2)


def test_not_shared_where_reduce_scatters_are_offloaded():
  """Under SparseCore offload (tpu7x's default flags) the reduce-scatters already run
  beside the TensorCore's work: each term keeps its own (a Llama-shaped step on tpu7x
  compiled 0.2 % slower shared). Without offload (v4's flags) they share. Planning only.
  The mesh's axes are Auto on every jax (0.12 makes an AbstractMesh's default Explicit,
  which the GPT step's matmuls reject)."""
  pytest.importorskip("libtpu")
  from jax.sharding import AbstractMesh, AxisType
  from meshslice import aot
  cfg = gpt.ModelConfig()
  am = AbstractMesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  step = gpt.make_step(cfg, am, donate=False)
  args = gpt.abstract_inputs(cfg, am)
  notes = {}
  for generation, profile in (("v4", "tpu-v4"), ("tpu7x", "tpu-v7x")):
    report = meshslice.explain(step, profile=profile,
                               compiler_flags=aot.preset_flags("dense,async", generation),
                               overrides=_pinned({"algorithm": "collective"}))(*args)
    notes[generation] = [i for i in _INPUT_GRADIENTS
                         if report.sites[i].shared_reduction == _INPUT_GRADIENTS]
  assert notes == {"v4": list(_INPUT_GRADIENTS), "tpu7x": []}
