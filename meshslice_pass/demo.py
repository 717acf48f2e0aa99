"""The demo (`python -m meshslice demo`) of the GPT-style training step of meshslice.gpt.

The demo tells two parts of one story: (1) plan the step at GPT-3 size for a TPU v4 pod
on abstract inputs (nothing is allocated) and show what the cost model predicts there;
(2) run the same step, small, on an emulated 8-device CPU mesh with slicing forced on,
and check every number against the untransformed step.

The model's names (ModelConfig, GPT3_LAYER, make_step, place, ...) are re-exported here
from meshslice.gpt, where they live, for code that imports them from `meshslice.demo`;
the project's benches, tests and examples import `meshslice.gpt`.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from .gpt import GPT3_LAYER as GPT3_LAYER
from .gpt import WEIGHTS as WEIGHTS
from .gpt import ModelConfig as ModelConfig
from .gpt import abstract_inputs as abstract_inputs
from .gpt import batch_specs as batch_specs
from .gpt import init_batch as init_batch
from .gpt import init_params as init_params
from .gpt import layernorm as layernorm
from .gpt import loss_fn as loss_fn
from .gpt import make_grad_step as make_grad_step
from .gpt import make_mesh as make_mesh
from .gpt import make_step as make_step
from .gpt import param_specs as param_specs
from .gpt import place as place
from .gpt import train_step as train_step
# the old private names (bench/transform_bench.py imported `_block`). To be removed:
# nothing in the project reads them any more; import meshslice.gpt's public names
# (result_layout, block, layernorm) instead.
from .gpt import result_layout as _result_layout  # noqa: F401
from .gpt import block as _block  # noqa: F401
from .gpt import layernorm as _layernorm  # noqa: F401
from . import backend_flags, pins
from .transform import explain, transform


# `aot.model_step`'s one-layer models, by the name its CLI takes, and how they are called
_NAMED_LAYERS = {"gpt3": "GPT-3", "megatron": "Megatron-NLG"}


def _named_layer(cfg: ModelConfig, chips: int) -> str | None:
  """The `aot.model_step` model whose one-layer step at `chips` chips (one sequence per
  chip, bf16) `cfg` is, or None: the caption names it and the `aot` command compiles it."""
  from meshslice.costmodel import model_spec
  from .aot import layer_config
  # the learning rate does not change what is planned or compiled: not compared
  return next((name for name in _NAMED_LAYERS if cfg == dataclasses.replace(
      layer_config(model_spec(name), chips), learning_rate=cfg.learning_rate)), None)


def plan_at_scale(cfg: ModelConfig = GPT3_LAYER, mesh_shape=(64, 4), echo=print,
                  flags: str | None = "dense,async,all_to_all", **options):
  """Plan `cfg`'s training step for a pod of prod(mesh_shape) chips from this machine
  and print the verdict. Returns the `Report`.

  `flags` are the libtpu flag presets (`aot.preset_flags`) the step would be compiled
  under on the profile's TPU generation, as the project's TPU results are: planning
  depends on them (on v4 the `dense,async,all_to_all` preset gives the step template,
  docs/tpu.md). None plans without compiler flags. `options` go to `meshslice.explain`.

  Example:
    >>> report = plan_at_scale(echo=lambda line: None)        # doctest: +SKIP
    >>> report.plan_counts()                                   # doctest: +SKIP
    {'collective os S=1': 10, 'collective rs S=1': 6, 'collective ls S=1': 3,
     'meshslice ls S=2': 1, 'meshslice ls S=4': 2, 'meshslice os S=2': 1}
  """
  options.setdefault("profile", "tpu-v4")
  generation = backend_flags.profile_generation(options["profile"])
  if flags and generation:
    options.setdefault("compiler_flags", backend_flags.preset_flags(flags, generation))
    if backend_flags.async_all_to_all(options["compiler_flags"]):
      # what reduce_scatter="auto" means on a TPU mesh under async all-to-all; an
      # AbstractMesh names no platform, so it is said here
      options.setdefault("reduce_scatter", "all_to_all")
  mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), ("x", "y"),
                                   axis_types=(AxisType.Auto,) * 2)
  report = explain(make_step(cfg, mesh), **options)(*abstract_inputs(cfg, mesh))
  plans = report.plan_counts()
  chips = int(np.prod(mesh_shape))
  named = _named_layer(cfg, chips)
  under = f", libtpu flags of the {flags!r} preset" if flags and generation else ""
  what = (f"one {_NAMED_LAYERS[named]} layer" if named
          else f"{cfg.layers} layer{'s' if cfg.layers > 1 else ''}")
  echo(f"part 1 -- plan for the real target: {what} (hidden {cfg.hidden}, ffn "
       f"{cfg.ffn}, {cfg.batch} x {cfg.seq} tokens, {cfg.dtype}), fwd + bwd, on {chips} "
       f"chips as a {mesh_shape[0]}x{mesh_shape[1]} mesh, profile {report.profile}{under}")
  echo(f"  {len(report.rewritten)} of {len(report.sites)} matmuls planned: "
       + ", ".join(f"{n} x {k}" for k, n in plans.items())
       + f"; {len(report.left_alone)} left alone (attention einsums: nothing to "
         "communicate)")
  if report.rewritten and all(s.rule == pins.STEP_TEMPLATE_RULE for s in report.rewritten):
    echo(f"  the step template: the plan measured fastest on compiled {generation} steps, "
         "ahead of XLA's program and of the per-site model's choices; the per-site cost "
         "model cannot price its gain (docs/tpu.md, docs/benchmarks.md)")
    if named is None:       # not a layer `aot --model` builds: no command to suggest
      return report
    from . import aot
    try:
      topology = aot.topology_name(generation, chips)
    except ValueError:      # no usual slice of that many chips: nothing to suggest
      return report
    echo(f"  compile it: python -m meshslice aot --model {named} --topology {topology} "
         f"--mesh {mesh_shape[0]}x{mesh_shape[1]} --flags {flags}   (pip install -e "
         "'.[tpu]')")
    return report
  gain = report.baseline_seconds / report.predicted_seconds if report.predicted_seconds else 1
  echo(f"  predicted time of those matmuls: {report.predicted_seconds * 1e3:.1f} ms vs "
       f"{report.baseline_seconds * 1e3:.1f} ms with the plain collective algorithm "
       f"({gain:.2f}x, cost model only; `python -m meshslice aot` shows what the TPU "
       "compiler makes of it)")
  return report


def _time(fn, args_fn, repeats):
  out = fn(*args_fn())
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    args = args_fn()
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def run_demo(mesh_shape=(2, 4), dtype="float32", explicit=False, repeats=5, echo=print,
             target=(64, 4), **options):
  """Plan at scale (`target` mesh, None to skip), then transform the small demo step,
  print the report, check it, time it. Returns the max relative error.

  `options` go to `meshslice.transform` (e.g. ksplit=4, profile="cpu")."""
  if target is not None:
    plan_at_scale(GPT3_LAYER, target, echo=echo,
                  **{k: v for k, v in options.items() if k == "profile"})
    echo("")
  cfg = ModelConfig(dtype=dtype)
  mesh = make_mesh(mesh_shape, explicit=explicit)
  step = make_step(cfg, mesh)
  fast = transform(step, **options)
  with jax.set_mesh(mesh):
    params, batch = place(cfg, mesh)
    echo(f"part 2 -- check the numbers on this machine: {cfg.layers}-layer GPT-style step, "
         f"hidden {cfg.hidden}, ffn {cfg.ffn}, "
         f"batch {cfg.batch}x{cfg.seq}, {dtype}, mesh {dict(mesh.shape)} "
         f"({'Explicit' if explicit else 'Auto'} axes), options {options or 'default'}")
    if options.get("ksplit", 1) > 1:
      echo(f"  slicing is forced (ksplit={options['ksplit']}) so that the sliced pipeline "
           "runs here; at these sizes the cost model would not slice, and the 'pred us' "
           "column says so")
    echo(str(fast.explain(params, batch)))
    copy = lambda: jax.tree.map(jnp.copy, params)
    ref_params, ref_loss = step(copy(), batch)
    new_params, new_loss = fast(copy(), batch)
    grad_step = make_grad_step(cfg, mesh)
    ref_grads = grad_step(params, batch)
    new_grads = transform(grad_step, **options)(params, batch)
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
                             / (np.max(np.abs(np.asarray(a, np.float32))) + 1e-30))
    loss_err = abs(float(ref_loss) - float(new_loss)) / abs(float(ref_loss))
    grad_err = max(rel(ref_grads[k], new_grads[k]) for k in ref_grads)
    param_err = max(rel(ref_params[k], new_params[k]) for k in ref_params)
    echo(f"loss: original {float(ref_loss):.6f}  transformed {float(new_loss):.6f}  "
         f"(rel diff {loss_err:.2e})")
    echo(f"gradients: max difference {grad_err:.2e} of each gradient's largest entry")
    echo(f"updated parameters: max difference {param_err:.2e} of each tensor's largest entry")
    worst = max(loss_err, grad_err, param_err)
    t_ref = _time(step, lambda: (copy(), batch), repeats)
    t_new = _time(fast, lambda: (copy(), batch), repeats)
    echo(f"step time (median of {repeats}): original {t_ref * 1e3:.1f} ms, transformed "
         f"{t_new * 1e3:.1f} ms, ratio {t_new / t_ref:.2f}x (CPU: no real interconnect, "
         "so no overlap gain is possible here)")
  return worst
