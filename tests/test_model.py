"""The demo GPT-style training step, transformed, against the untransformed step.

Tolerance: float32 1e-4, bfloat16 2e-2, each relative to the largest entry of the tensor
compared (sliced partial sums are added in a different order; see docs/guide.md, "Numerics").
"""
import jax
import pytest

import meshslice
from meshslice.gpt import ModelConfig, make_grad_step, make_mesh, make_step, place

from helpers import assert_trees_close, collective_counts

CASES = [((2, 4), False, "float32"), ((4, 2), False, "float32"), ((2, 2), False, "float32"),
         ((2, 4), True, "float32"), ((2, 2), True, "bfloat16"), ((2, 4), False, "bfloat16")]


@pytest.mark.parametrize("shape,explicit,dtype", CASES)
def test_training_step_matches(shape, explicit, dtype):
  cfg = ModelConfig(dtype=dtype, layers=2, batch=4, seq=16, hidden=64, heads=4, ffn=128)
  mesh = make_mesh(shape, explicit=explicit)
  step = make_step(cfg, mesh, donate=False)
  grad_step = make_grad_step(cfg, mesh)
  with jax.set_mesh(mesh):
    params, batch = place(cfg, mesh)
    fast = meshslice.transform(step)
    report = fast.explain(params, batch)
    ref_params, ref_loss = step(params, batch)
    new_params, new_loss = fast(params, batch)
    ref_grads = grad_step(params, batch)
    new_grads = meshslice.transform(grad_step)(params, batch)
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
