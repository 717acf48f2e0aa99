"""A weight gradient is computed in the result layout that gathers its narrower operand,
then resharded (`planning._other_output_layouts`).

The step: an MLP whose down projection `wo` [mlp, embed] is laid out like the up
projection, [mlp over fsdp, embed over tensor], on activations [batch over fsdp, ...,
features over tensor]. Its weight gradient h^T @ dy, in wo's own layout, must gather the
mlp-wide activations h over tensor; in the transposed layout it gathers the embed-wide
output gradient dy instead, and only the small summed result is resharded. (On MaxText's
Llama2-70B the wanted layout was the analysis's guess and the gathered operand 3.5x the
other: docs/benchmarks.md, "MaxText's Llama2-70B on v4".)
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import meshslice
from meshslice import aot

from helpers import mesh


def _mlp_step(msh):
  sh = lambda *spec: NamedSharding(msh, P(*spec))

  def loss(params, x):
    h = jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", x, params["wi"]),
                                         sh("fsdp", None, "tensor"))
    y = jnp.einsum("bsf,fd->bsd", jax.nn.relu(h), params["wo"])
    y = jax.lax.with_sharding_constraint(y, sh("fsdp", None, "tensor"))
    return jnp.mean(y.astype(jnp.float32) ** 2)

  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.5 * g.astype(p.dtype), params, grads)

  weights = {"wi": sh("fsdp", "tensor"), "wo": sh("fsdp", "tensor")}
  return jax.jit(step, out_shardings=weights), weights, sh("fsdp", None, "tensor")


def _abstract(weights, data, batch, seq, embed, mlp, dtype=jnp.bfloat16):
  params = {"wi": jax.ShapeDtypeStruct((embed, mlp), dtype, sharding=weights["wi"]),
            "wo": jax.ShapeDtypeStruct((mlp, embed), dtype, sharding=weights["wo"])}
  return params, jax.ShapeDtypeStruct((batch, seq, embed), dtype, sharding=data)


def _planned_on_v4(**sizes):
  """The MLP step planned for TPU v4 under the step template's flags, at `sizes`."""
  step, weights, data = _mlp_step(mesh((2, 4), ("fsdp", "tensor")))
  flags = aot.preset_flags("dense,async,all_to_all", "v4")
  return meshslice.transform(step, profile="tpu-v4", compiler_flags=flags).explain(
      *_abstract(weights, data, **sizes))


def test_the_down_projections_gradient_gathers_the_narrower_operand():
  report = _planned_on_v4(batch=16, seq=512, embed=1024, mlp=8192)
  wo_grad = next(s for s in report.sites if s.swapped and s.lhs_shape[-1] == 8192)
  wi_grad = next(s for s in report.sites if s.swapped and s.lhs_shape[-1] == 1024)
  # wo's gradient: lhs-stationary over the transposed mesh, so the result is laid out
  # [mlp over tensor, embed over fsdp], then resharded into wo's layout
  assert wo_grad.rewritten and wo_grad.dataflow == "ls", str(report)
  assert wo_grad.mesh_axes == ("tensor", "fsdp")
  assert wo_grad.out_spec == "P('tensor', 'fsdp')"
  assert ("ls into result layout P('tensor', 'fsdp') instead of P('fsdp', 'tensor'), then "
          "resharded (~") in wo_grad.note
  assert " us as rs" in wo_grad.note       # what the wanted layout would have cost
  # wi's gradient gathers the embed-wide input in its own layout: kept
  assert wi_grad.dataflow == "rs" and wi_grad.out_spec == "P('fsdp', 'tensor')"
  assert "into result layout" not in wi_grad.note


def test_no_layout_leaves_the_result_narrower_than_a_vreg():
  # embed 192 over fsdp=2 would leave 96 of the 128 lanes: wo's gradient keeps its layout
  report = _planned_on_v4(batch=16, seq=2048, embed=192, mlp=8192)
  wo_grad = next(s for s in report.sites if s.swapped and s.lhs_shape[-1] == 8192)
  assert wo_grad.out_spec == "P('fsdp', 'tensor')", str(report)
  assert "into result layout" not in wo_grad.note


def test_a_small_weight_gradient_keeps_its_layout():
  # the reshard's latency outweighs the bytes saved
  msh = mesh((2, 4), ("fsdp", "tensor"))
  step, weights, data = _mlp_step(msh)
  report = meshslice.transform(step, profile="tpu-v4").explain(
      *_abstract(weights, data, batch=8, seq=256, embed=256, mlp=2048))
  assert all(s.dataflow == "rs" for s in report.sites if s.swapped), str(report)


def test_the_transposed_layout_computes_the_same_step():
  """The program the choice emits (pinned here at a size the CPU runs quickly): values
  against plain jit and an unsharded run."""
  msh = mesh((2, 4), ("fsdp", "tensor"))
  step, weights, data = _mlp_step(msh)
  rng = np.random.default_rng(0)
  params = {"wi": jax.device_put(jnp.asarray(rng.normal(size=(32, 64)) / 6, jnp.float32),
                                 weights["wi"]),
            "wo": jax.device_put(jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float32),
                                 weights["wo"])}
  x = jax.device_put(jnp.asarray(rng.normal(size=(4, 8, 32)), jnp.float32), data)
  report = meshslice.explain(step)(params, x)
  wo_grad = next(s for s in report.sites if s.swapped and s.lhs_shape[-1] == 64)
  result = meshslice.check(step, overrides={wo_grad.index: {"dataflow": "ls"}})(params, x)
  assert result.ok, str(result)
  assert result.reference == "ran"
  pinned = next(s for s in result.report.sites if s.index == wo_grad.index)
  assert pinned.rewritten and pinned.dataflow == "ls" and pinned.out_spec == "P('tensor', 'fsdp')"
  assert all(leaf.ok and leaf.vs_reference is not None for leaf in result.leaves)
