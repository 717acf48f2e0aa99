"""meshslice on a Keras 3 (JAX backend) keras-hub Gemma trained with ModelParallel.

The model is a tiny keras-hub `GemmaCausalLM`; its kernels are laid out by keras-hub's
own `GemmaBackbone.get_layout_map` on a (batch, model) = 2x4 mesh, the data split over
`batch` by `keras.distribution.ModelParallel`. The train step is built the way Keras's
`JAXTrainer.make_train_function` builds it: `jax.jit(model.train_step, donate_argnums=0,
out_shardings=(None, state_shardings))` over the state tuple (trainable,
non-trainable, optimizer and metrics variable values) and the distributed batch
(x, y, sample_weight). The script runs `meshslice.explain` on it, `meshslice.transform`
once, and `meshslice.check` (plain jit and an unsharded run, slicing forced with
--ksplit), and prints the sites per plan.

With --norm-output-layout it adds one LayoutMap entry keras-hub does not ship, a layout
for the outputs of the pre-attention / pre-ffw norms (`("batch", None, "model")`, the
embedding dim over `model`): Keras constrains each such layer's output, and the query /
key / value / gating projections become full 2D OS sites instead of OS with a gathered
kernel (docs/frameworks.md).

Needs: pip install keras keras-hub (with jax 0.10.2 pinned; see docs/frameworks.md).
Run:   python examples/keras_model_parallel.py [--norm-output-layout] [--ksplit 2]
(on a CPU-only machine it emulates 8 devices). Exits 0 with a message when keras or
keras-hub is missing, non-zero if the check fails.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")   # before keras is imported

import jax                                      # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)     # 8 emulated devices when running on CPU

import numpy as np                              # noqa: E402

import meshslice                                # noqa: E402


def build(norm_output_layout: bool, vocab=128, layers=2, hidden=64, heads=4, head_dim=16,
          batch=8, seq=16):
  """The keras-hub model under ModelParallel, compiled; returns (step, state, data)."""
  import keras
  import keras_hub
  from keras.src.backend.jax.trainer import _distribute_data

  if keras.backend.backend() != "jax":
    raise SystemExit(f"KERAS_BACKEND is {keras.backend.backend()!r}; this needs 'jax'")
  devices = keras.distribution.list_devices()[:8]
  mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
  layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
  if norm_output_layout:
    layout_map["decoder_block.*pre_(attention|ffw)_norm/output"] = ("batch", None, "model")
  keras.distribution.set_distribution(
      keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
  backbone = keras_hub.models.GemmaBackbone(
      vocabulary_size=vocab, num_layers=layers, num_query_heads=heads,
      num_key_value_heads=heads, hidden_dim=hidden, intermediate_dim=2 * hidden,
      head_dim=head_dim)
  model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
  model.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=[])
  rng = np.random.default_rng(0)
  x = {"token_ids": rng.integers(0, vocab, (batch, seq)).astype("int32"),
       "padding_mask": np.ones((batch, seq), "int32")}
  y = rng.integers(0, vocab, (batch, seq)).astype("int32")
  # what fit()/train_on_batch do before the first step: distribute the batch over the
  # data axis, build the model and the optimizer, collect the state values
  data = _distribute_data((x, y, np.ones((batch, seq), "float32")))
  model._symbolic_build(data_batch=data)
  model.optimizer.build(model.trainable_variables)
  state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                               optimizer_variables=True, metrics_variables=True)
  # JAXTrainer.make_train_function, verbatim in what it passes to jax.jit
  step = jax.jit(model.train_step, donate_argnums=0,
                 out_shardings=(None, model._get_state_sharding_spec()))
  return step, state, data


def plan_counts(report) -> collections.Counter:
  """Sites per plan: 'os r=batch c=model', 'ls ...', '1d-scatter ...', or the reason."""
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
  parser.add_argument("--norm-output-layout", action="store_true",
                      help="add a LayoutMap entry for the norms' outputs (2D OS sites)")
  parser.add_argument("--ksplit", type=int, default=2, help="slices per site in the check")
  args = parser.parse_args(argv)
  try:
    import keras      # noqa: F401
    import keras_hub  # noqa: F401
  except ImportError as e:
    print(f"skipped: this example needs keras and keras-hub ({e}); "
          "see docs/frameworks.md for the install steps")
    return 0
  import keras
  import keras_hub
  print(f"keras {keras.__version__}, keras-hub {keras_hub.__version__}, jax {jax.__version__}")
  step, state, data = build(args.norm_output_layout)
  report = meshslice.explain(step)(state, data)
  print(report)
  print("sites per plan:")
  for plan, n in sorted(plan_counts(report).items()):
    print(f"  {n:3d}  {plan}")
  # the transformed step is a drop-in: same state in, same state out (it donates its
  # state like Keras's own step, so pass a fresh one)
  fast = meshslice.transform(step)
  logs, _ = fast(jax.tree.map(lambda a: a.copy(), state), data)
  print(f"transformed step ran: loss {float(logs['loss']):.4f}")
  result = meshslice.check(step, ksplit=args.ksplit)(state, data)
  print(result)
  return 0 if result.ok else 1


if __name__ == "__main__":
  sys.exit(main())
