"""The demo GPT-style training step, transformed, against the untransformed step.

Tolerance: float32 1e-4, bfloat16 2e-2, each relative to the largest entry of the tensor
compared (sliced partial sums are added in a different order; see docs/guide.md, "Numerics").
"""
import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import gpt
from meshslice.gpt import ModelConfig, make_mesh, make_step, place

from helpers import assert_trees_close, collective_counts

CASES = [((2, 4), False, "float32"), ((4, 2), False, "float32"), ((2, 2), False, "float32"),
         ((2, 4), True, "float32"), ((2, 2), True, "bfloat16"), ((2, 4), False, "bfloat16")]


def _step_with_grads(cfg, mesh):
  """`gpt.make_step`'s SGD step (`gpt.train_step`: one value_and_grad of `gpt.loss_fn`,
  then the update) that also returns the gradients it applied, under make_step's
  shardings (the gradients under the params', as `gpt.make_grad_step` returns them). One
  program checks the new params, the loss and the gradients themselves (to the
  gradients' own scale, not lr times it): two compiles per case (plain, transformed)
  instead of four for make_step and make_grad_step, with the same matmul sites."""
  row, col = mesh.axis_names[-2:]
  ps = jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.param_specs(row, col))
  bs = jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.batch_specs(row, col))

  def step(params, batch):
    loss, grads = jax.value_and_grad(lambda p: gpt.loss_fn(cfg, p, batch))(params)
    new = jax.tree.map(lambda p, g: (p - cfg.learning_rate * g).astype(p.dtype), params,
                       grads)
    return new, loss, grads

  return jax.jit(step, in_shardings=(ps, bs), out_shardings=(ps, NamedSharding(mesh, P()), ps))


@pytest.mark.parametrize("shape,explicit,dtype", CASES)
def test_training_step_matches(shape, explicit, dtype):
  cfg = ModelConfig(dtype=dtype, layers=2, batch=4, seq=16, hidden=64, heads=4, ffn=128)
  mesh = make_mesh(shape, explicit=explicit)
  step = _step_with_grads(cfg, mesh)
  with jax.set_mesh(mesh):
    params, batch = place(cfg, mesh)
    fast = meshslice.transform(step)
    report = fast.explain(params, batch)
    ref_params, ref_loss, ref_grads = step(params, batch)
    new_params, new_loss, new_grads = fast(params, batch)
  assert_trees_close(new_loss, ref_loss, dtype)
  assert_trees_close(new_grads, ref_grads, dtype)
  assert_trees_close(new_params, ref_params, dtype)
  flows = {s.dataflow for s in report.rewritten}
  assert flows == {"os", "ls", "rs"}
  by_direction = {(s.direction, s.dataflow) for s in report.rewritten}
  assert ("forward", "os") in by_direction
  assert ("backward", "ls") in by_direction and ("backward", "rs") in by_direction


def test_rewritten_jaxpr_and_hlo_structure():
  cfg = ModelConfig(layers=1, batch=4, seq=16, hidden=64, heads=4, ffn=128)
  mesh = make_mesh((2, 4))
  step = make_step(cfg, mesh, donate=False)
  params, batch = place(cfg, mesh)
  fast = meshslice.transform(step, ksplit=2)
  text = str(jax.make_jaxpr(fast)(params, batch))
  assert "shard_map" in text and "all_gather" in text and "reduce_scatter" in text
  report = fast.explain(params, batch)
  assert all(s.ksplit == 2 for s in report.rewritten)
  sliced = collective_counts(fast.lower(params, batch).compile().as_text())
  plain = meshslice.transform(step, algorithm="collective")
  unsliced = collective_counts(plain.lower(params, batch).compile().as_text())
  # every sliced collective survives compilation: S=2 doubles them, none merged back
  assert unsliced["all-gather"] > 0 and unsliced["reduce-scatter"] > 0
  assert sliced["all-gather"] >= 2 * unsliced["all-gather"]
  assert sliced["reduce-scatter"] == 2 * unsliced["reduce-scatter"]
