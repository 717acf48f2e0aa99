"""meshslice on MaxText's own training step: from a MaxText config to the compiled pod program.

Takes a MaxText config the way MaxText's own CLI does (a yml file and key=value
overrides) and gets the training step exactly as MaxText's trainer builds it
(`train_utils.setup_train_loop`, `nnx.split`, `sharding.maybe_update_params_sharding_with_opt`,
`train_utils.jit_train_and_eval_step`: `train.train_step` jitted with the state's
shardings, donating the state; NNX `Rngs` keys inside the state), then:

  1. `meshslice.explain`: the report (every matmul, its plan or why it is left alone, its
     module path such as `decoder/layers/mlp/wo`);
  2. an override (`--pin`: a module-path glob, default '*/mlp/wo', or a 'file:line')
     and the sites it pins;
  3. `meshslice.check`: the transformed step against plain jit and an unsharded run on
     one device (slicing forced with --ksplit so the sliced pipeline really runs; the
     donated state is copied by check);
  4. `meshslice.transform`: one training step with the transformed step;
  5. when libtpu is installed and the config names a `compile_topology`: an ahead-of-time
     compile of plain and transformed for that topology, built from MaxText's own
     `train_compile` pieces (`get_topology_mesh`, `get_shaped_inputs`,
     `get_functional_train_with_signature`, the jit of `jit_and_compile`), and a
     side-by-side table of what libtpu made of each (`meshslice.aot.analyze`).

Needs MaxText (Python >= 3.12): install steps in docs/maxtext.md. In short:
  python3.12 -m venv .venv-maxtext
  .venv-maxtext/bin/pip install "maxtext[tpu]==0.2.5" "jax[tpu]==0.12.0.1"
  .venv-maxtext/bin/pip install -e . --no-deps
Run:
  .venv-maxtext/bin/python examples/maxtext_train.py [CONFIG.yml] [key=value ...]
      [--pin GLOB|FILE:LINE] [--ksplit N] [--aot-ksplit N] [--no-aot | --aot-only]
      [--no-tiny]
CONFIG defaults to MaxText's configs/base.yml. Unless --no-tiny, tiny defaults come first
(llama2 with 2 layers of embed 64, 8 tokens x 16 per step, fsdp=2 x tensor=4 on 8 emulated
CPU devices, compile_topology=v4-16), your key=value overrides after them. Runs on the
CPU (JAX_PLATFORMS=cpu unless set). --aot-only skips 1-4: the compile needs no memory
for the model, so a full-size config works. Exits 0 with a message when MaxText is
missing, non-zero when the check fails.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the AOT part needs no TPU backend
# as MaxText's train.py / train_compile.py do, before libtpu loads: its RNG is unsafe_rbg
if "xla_tpu_spmd_rng_bit_generator_unsafe" not in os.environ.get("LIBTPU_INIT_ARGS", ""):
  os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "")
                                    + " --xla_tpu_spmd_rng_bit_generator_unsafe=true").strip()

import jax                                      # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)     # 8 emulated devices when running on CPU
jax.config.update("jax_default_prng_impl", "unsafe_rbg")    # MaxText's train.py does this

import meshslice                                # noqa: E402
from meshslice import aot                       # noqa: E402

INSTALL = """\
skipped: this example needs MaxText ({error}). MaxText needs Python >= 3.12; install it
in its own virtual environment, with a jax meshslice supports (0.10.2 to 0.12.x):
  python3.12 -m venv .venv-maxtext
  .venv-maxtext/bin/pip install "maxtext[tpu]==0.2.5" "jax[tpu]==0.12.0.1"
  .venv-maxtext/bin/pip install -e . --no-deps      # meshslice, from this checkout
then run  .venv-maxtext/bin/python examples/maxtext_train.py  (docs/maxtext.md)"""

# A llama2 small enough for 8 emulated CPU devices; MaxText's own keys.
TINY = {
    "model_name": "llama2-7b", "override_model_config": "True",
    "base_emb_dim": "64", "base_num_query_heads": "4", "base_num_kv_heads": "4",
    "head_dim": "16", "base_mlp_dim": "128", "base_num_decoder_layers": "2",
    "vocab_size": "128", "max_target_length": "16", "per_device_batch_size": "1",
    "dtype": "float32", "attention": "dot_product",
    "ici_fsdp_parallelism": "-1", "ici_tensor_parallelism": "4",   # fsdp=2 x tensor=4
    "dataset_type": "synthetic", "packing": "False", "tokenizer_path": "",
    "hardware": "cpu", "steps": "1", "enable_checkpointing": "False",
    "skip_jax_distributed_system": "True", "enable_goodput_recording": "False",
    "jax_cache_dir": "",                        # no persistent cache in your home folder
    "compile_topology": "v4-16", "compile_topology_num_slices": "1",   # v4:2x2x2, 8 chips
}
# What the script needs whatever the config says (it writes nothing of its own).
ALWAYS = {"run_name": "meshslice", "enable_checkpointing": "False"}


def maxtext_config(config_path: str | None, overrides: list, tiny: bool):
  """MaxText's HyperParameters from a yml and key=value overrides, as its CLI reads them."""
  import maxtext
  from maxtext.configs import pyconfig
  path = config_path or os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  given = dict(o.split("=", 1) for o in overrides)
  settings = {**(TINY if tiny else {}), **ALWAYS, **given}
  settings.setdefault("base_output_directory", tempfile.mkdtemp(prefix="maxtext_meshslice_"))
  return pyconfig.initialize(["maxtext_train.py", path]
                             + [f"{k}={v}" for k, v in settings.items()])


def maxtext_train_step(config):
  """(jitted train step, state, batch, mesh) exactly as MaxText's `train.train_loop` sets
  them up before its first step."""
  from flax import nnx
  from maxtext.trainers.pre_train import train
  from maxtext.utils import sharding, train_utils
  (_, _, state_mesh_shardings, _, mesh, _, _, data_loader, _, eval_data_iterator,
   state) = train_utils.setup_train_loop(config, None)
  jit_model, state = nnx.split(state)
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
      config, state_mesh_shardings)
  p_train_step, _ = train_utils.jit_train_and_eval_step(
      config, jit_model, mesh, state, state_mesh_shardings, train.train_step, train.eval_step,
      eval_data_iterator, params_shardings)
  return p_train_step, state, data_loader.load_next_batch(), mesh


def maxtext_aot_step(config):
  """(jitted train step, abstract args, compile-only mesh, compiler options) for the
  config's `compile_topology`, from MaxText's own train_compile.py pieces; the jit is
  the one `train_compile.jit_and_compile` makes (kept, so it can be transformed)."""
  from flax.linen import partitioning as nn_partitioning
  from maxtext.trainers.pre_train import train, train_compile
  from maxtext.utils import max_utils, maxtext_utils, sharding
  aot.topology("v4:2x2x1")      # meshslice's libtpu settings, before MaxText loads libtpu
  train_compile.validate_config(config)
  mesh = train_compile.get_topology_mesh(config)
  shaped_args, shaped_kwargs, state_mesh_shardings, _, model = (
      train_compile.get_shaped_inputs(mesh, config))
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
      config, state_mesh_shardings)
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(
      config, state_mesh_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  func, in_shard, out_shard, static_argnums, donate_argnums = (
      maxtext_utils.get_functional_train_with_signature(
          train.train_step, data_sharding, input_shardings, model, config, params_shardings))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    jitted = jax.jit(func, in_shardings=in_shard, out_shardings=out_shard,
                     static_argnums=static_argnums, donate_argnums=donate_argnums)
  options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
  return jitted, shaped_args, shaped_kwargs, mesh, options


def plan_counts(report) -> collections.Counter:
  """Sites per plan ('os r=fsdp c=tensor', '1d-allreduce axis=fsdp') or reason class."""
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


def run_aot(config, ksplit):
  """Compile plain and transformed for the config's compile_topology; print the table."""
  from flax.linen import partitioning as nn_partitioning
  step, args, kwargs, mesh, compiler_options = maxtext_aot_step(config)
  profile = aot.mesh_profile(mesh)        # what meshslice.transform plans with by default
  options = {"profile": profile, **({"ksplit": ksplit} if ksplit else {})}
  fast = meshslice.transform(step, **options)
  results = {}
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    print(f"aot plan for {config.compile_topology} "
          f"({', '.join(f'{k}={v}' for k, v in options.items())}): "
          f"{fast.explain(*args, **kwargs).summary()}")
    for name, fn in (("plain", step), ("meshslice", fast)):
      start = time.perf_counter()
      compiled = fn.lower(*args, **kwargs).compile(compiler_options=compiler_options)
      results[name] = aot.analyze(compiled, profile, compile_s=time.perf_counter() - start)
  print(f"aot: {config.compile_topology}, mesh "
        f"{' x '.join(f'{k}={v}' for k, v in mesh.shape.items() if v > 1)}:")
  print(aot.format_table(results))


def run_step(config, args):
  """Explain, pin, check and run MaxText's step on this machine's devices; the check."""
  from flax.linen import partitioning as nn_partitioning
  step, state, batch, mesh = maxtext_train_step(config)
  # MaxText calls its step inside these two contexts; so does everything below
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    report = meshslice.explain(step)(state, batch)
    print(report)
    print("sites per plan:")
    for plan, n in sorted(plan_counts(report).items()):
      print(f"  {n:3d}  {plan}")

    pin = {args.pin: {"ksplit": 2}}
    try:
      pinned = [s for s in meshslice.transform(step, overrides=pin).explain(state, batch).sites
                if s.ksplit == 2]
      print(f"overrides={pin} pins {len(pinned)} sites: "
            + ", ".join(f"#{s.index} {s.module} ({s.direction})" for s in pinned))
    except ValueError as e:             # a pin the site cannot take is refused, with why
      print(f"overrides={pin} refused: {e}")

    result = meshslice.check(step, ksplit=args.ksplit)(state, batch)
    print(result)
    print(f"forced ksplit={args.ksplit}: {result.report.summary()}")

    # the transformed step is a drop-in for MaxText's p_train_step: it donates the state
    fast = meshslice.transform(step)
    state, metrics = fast(state, batch)
    print(f"transformed step ran: loss {float(metrics['scalar']['learning/loss']):.5f}")
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("config", nargs="*", metavar="CONFIG.yml | key=value",
                      help="a MaxText yml (default: its configs/base.yml) and overrides")
  parser.add_argument("--pin", default="*/mlp/wo",
                      help="a module-path glob or 'file:line' to pin with ksplit=2 "
                           "(default '*/mlp/wo')")
  parser.add_argument("--ksplit", type=int, default=2, help="slices per site in the check")
  parser.add_argument("--aot-ksplit", type=int, default=None,
                      help="force this ksplit in the AOT-compiled transformed step "
                           "(default: the cost model's plan)")
  parser.add_argument("--no-aot", action="store_true", help="skip the TPU ahead-of-time part")
  parser.add_argument("--aot-only", action="store_true",
                      help="only the ahead-of-time part: abstract inputs, so a full-size "
                           "config needs no memory on this machine")
  parser.add_argument("--no-tiny", action="store_true",
                      help="do not apply the tiny defaults (your config as it is)")
  parser.add_argument("--tiny", action="store_true", help="the tiny defaults (the default)")
  args = parser.parse_args(argv)
  paths = [c for c in args.config if "=" not in c]
  overrides = [c for c in args.config if "=" in c]
  if len(paths) > 1:
    parser.error(f"one config file, got {paths}")
  try:
    import maxtext
    from maxtext.trainers.pre_train import train  # noqa: F401
  except ImportError as e:
    print(INSTALL.format(error=e))
    return 0
  print(f"maxtext {getattr(maxtext, '__version__', '?')}, jax {jax.__version__}, "
        f"{len(jax.devices())} {jax.devices()[0].platform} devices")
  config = maxtext_config(paths[0] if paths else None, overrides, tiny=not args.no_tiny)
  result = None if args.aot_only else run_step(config, args)

  if args.no_aot:
    print("aot: skipped (--no-aot)")
  elif not aot.have_libtpu():
    print("aot: skipped (libtpu not installed: pip install 'jax[tpu]' at your jax version)")
  elif not config.compile_topology:
    print("aot: skipped (no compile_topology in the config; e.g. compile_topology=v4-16 "
          "compile_topology_num_slices=1)")
  else:
    run_aot(config, args.aot_ksplit)

  if result is not None and not result.ok:
    print("FAILED: the transformed step disagrees with the reference", file=sys.stderr)
    return 1
  print("OK")
  return 0


if __name__ == "__main__":
  sys.exit(main())
