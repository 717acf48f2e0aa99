"""meshslice on a penzai llama-like transformer trained with `StatefulTrainer`.

The model is penzai's own `build_llamalike_transformer` (tiny config); its parameters
are laid out by name with `sharding_util.name_to_name_device_put` on an (x, y) = 2x4
mesh (embedding -> x; heads, neurons, vocabulary -> y: 2D kernels such as
P('x', 'y', None)), the tokens by their batch axis over x. penzai's
`StatefulTrainer.build` jits its step as `jax.jit(_stateful_trainer_step,
static_argnames=["loss_fn", "optimizer_def"])` and `trainer.step(**kwargs)` calls it
with keyword arguments only: the script makes that same call through
`meshslice.explain`, `meshslice.check` (plain jit and an unsharded run, slicing forced
with --ksplit) and `meshslice.transform`, then puts the transformed step into the
trainer (`dataclasses.replace(trainer, step_fn=fast)`) and trains one step with it.

With --constrain-residual it inserts penzai's own `ConstrainShardingByName` layer
(batch -> x, embedding -> y) in front of every transformer block: the residual stream's
embedding dim over y, and the projections become full 2D OS sites instead of OS with a
gathered kernel (docs/frameworks.md).

Needs: pip install penzai (with jax 0.10.2 pinned; see docs/frameworks.md).
Run:   python examples/penzai_stateful.py [--constrain-residual] [--ksplit 2]
(on a CPU-only machine it emulates 8 devices). Exits 0 with a message when penzai is
missing, non-zero if the check fails.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)     # 8 emulated devices when running on CPU

import jax.numpy as jnp                         # noqa: E402
import numpy as np                              # noqa: E402
import optax                                    # noqa: E402
from jax.sharding import AxisType               # noqa: E402

import meshslice                                # noqa: E402

PARAM_RULES = {"embedding": "x", "heads": "y", "kv_heads": "y", "neurons": "y",
               "vocabulary": "y"}
DATA_RULES = {"batch": "x"}
RESIDUAL_RULES = {"batch": "x", "embedding": "y"}


def loss_fn(*, model, state, rng, tokens):
  """Next-token cross-entropy, in penzai's LossFunction signature."""
  from penzai import pz
  del rng
  logits = model(tokens)
  log_probs = pz.nx.nmap(jax.nn.log_softmax)(logits.untag("vocabulary")).tag("vocabulary")
  targets = pz.nx.nmap(jnp.roll)(tokens.untag("seq"), -1).tag("seq")
  nll = -pz.nx.nmap(lambda lp, t: lp[t])(log_probs.untag("vocabulary"), targets)
  loss = nll.untag("batch", "seq").unwrap().mean()
  return loss, state, {"loss": loss}


def build(constrain_residual: bool, vocab=128, layers=2, embed=64, heads=4, head_dim=16,
          mlp=128, batch=8, seq=16):
  """The sharded model and its trainer; returns (trainer, kwargs of the step call)."""
  from penzai import pz
  from penzai.models.transformer import model_parts
  from penzai.models.transformer.variants import llamalike_common
  from penzai.toolshed import basic_training, sharding_util

  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=heads, query_head_multiplier=1, embedding_dim=embed,
      projection_dim=head_dim, mlp_hidden_dim=mlp, num_decoder_blocks=layers,
      vocab_size=vocab, mlp_variant="swiglu", tie_embedder_and_logits=False)
  model = llamalike_common.build_llamalike_transformer(config,
                                                       init_base_rng=jax.random.key(0))
  if constrain_residual:
    constrain = sharding_util.ConstrainShardingByName(mesh, RESIDUAL_RULES)
    model = (pz.select(model).at_instances_of(model_parts.TransformerBlock)
             .apply(lambda block: pz.nn.Sequential([constrain, block])))
  # lay the parameters out by their axis names (the values are frozen for device_put)
  stateless, params = pz.unbind_params(model, freeze=True)
  params = sharding_util.name_to_name_device_put(params, mesh, PARAM_RULES)
  model = pz.bind_variables(stateless, params, unfreeze_as_copy=True)
  trainer = basic_training.StatefulTrainer.build(
      root_rng=jax.random.key(1), model=model, optimizer_def=optax.adam(1e-3),
      loss_fn=loss_fn)
  tokens = pz.nx.wrap(np.random.default_rng(0).integers(0, vocab, (batch, seq))
                      .astype(np.int32)).tag("batch", "seq")
  tokens = sharding_util.name_to_name_device_put(tokens, mesh, DATA_RULES)
  return trainer, step_kwargs(trainer, tokens=tokens)


def step_kwargs(trainer, **kwargs) -> dict:
  """The keyword arguments `StatefulTrainer.step(**kwargs)` passes to `trainer.step_fn`."""
  from penzai import pz
  stateless_model, variables = pz.unbind_variables(trainer.model)
  trainable = [v for v in variables if isinstance(v, pz.Parameter)
               and v.metadata.get("trainable", True)]
  frozen = [v for v in variables if isinstance(v, pz.Parameter)
            and not v.metadata.get("trainable", True)]
  states = [v for v in variables if isinstance(v, pz.StateVariable)]
  return dict(root_rng=trainer.root_rng, state=trainer.state.value,
              stateless_model=stateless_model,
              trainable_params=pz.freeze_variables(tuple(trainable)),
              frozen_params=pz.freeze_variables(tuple(frozen)),
              state_vars=pz.freeze_variables(tuple(states)),
              loss_fn=trainer.loss_fn, optimizer_def=trainer.optimizer_def, kwargs=kwargs)


def plan_counts(report) -> collections.Counter:
  from meshslice.report import reason_class
  out = collections.Counter()
  for s in report.sites:
    if s.rewritten:
      axes = (f"r={s.mesh_axes[0] or '-'} c={s.mesh_axes[1] or '-'}"
              if len(s.mesh_axes) == 2 else f"axis={s.mesh_axes[0]}")
      out[f"{s.dataflow} {axes}"] += 1
    else:
      out[f"left alone: {reason_class(s.reason)}"] += 1
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--constrain-residual", action="store_true",
                      help="ConstrainShardingByName(batch->x, embedding->y) before each block")
  parser.add_argument("--ksplit", type=int, default=2, help="slices per site in the check")
  args = parser.parse_args(argv)
  try:
    import penzai
  except ImportError as e:
    print(f"skipped: this example needs penzai ({e}); see docs/frameworks.md for the "
          "install steps")
    return 0
  print(f"penzai {penzai.__version__}, jax {jax.__version__}")
  trainer, kwargs = build(args.constrain_residual)
  step = trainer.step_fn                   # the jax.jit StatefulTrainer.build made
  report = meshslice.explain(step)(**kwargs)
  print(report)
  print("sites per plan:")
  for plan, n in sorted(plan_counts(report).items()):
    print(f"  {n:3d}  {plan}")
  result = meshslice.check(step, ksplit=args.ksplit)(**kwargs)
  print(result)
  # the transformed step in the trainer: StatefulTrainer.step calls it as it called jit's
  trainer = dataclasses.replace(trainer, step_fn=meshslice.transform(step))
  aux = trainer.step(tokens=kwargs["kwargs"]["tokens"])
  print(f"trainer.step with the transformed step: loss {float(aux['loss']):.4f}, "
        f"trainer step counter {int(trainer.state.value.step)}")
  return 0 if result.ok else 1


if __name__ == "__main__":
  sys.exit(main())
