"""`python -m meshslice aot`: compile a transformer training step for a TPU topology
ahead of time as XLA's four programs (plain and dense, each with libtpu defaults and with
the async collective flags) and the meshslice rewrite, each variant in its own process
under its own libtpu flags, and print what the compiler made of each side by side. The
step is the GPT-style layer step (`aot.model_step`), or with `--whole` the whole
training step (`whole_step`: embeddings, scanned layers, loss, Adam).

The compiling, reading and the table are meshslice.aot's (`compare`, `VARIANTS`,
`variant_flags`, `format_table`), and so is the fresh process per variant
(`run_in_fresh_process`); this module is the command line. `aot.main` still resolves
here, and `format_table` is still importable from here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# format_table (and its rows) moved back to aot; importable from here as before
from .aot import (_ROWS, VARIANTS, FreshProcessError, _largest_wait,  # noqa: F401
                  compare, format_table, have_libtpu, parse_topology, preset_flags,
                  run_in_fresh_process, set_flags, variant_flags, versus_best_xla)
from .backend_flags import rewrite_presets


def _variant_worker(args, gen, shape, options) -> int:
  """Compile one variant in this process under its flags, print its report (meshslice)
  and write its row as JSON to args.json."""
  use_pass, _ = VARIANTS[args.variant]
  set_flags(*variant_flags(args.variant, gen.name, args.flags if use_pass else "async"))
  import jax
  jax.config.update("jax_platforms", "cpu")      # the host runs nothing but the compiler
  results = compare(args.model, args.topology, shape, layers=args.layers, batch=args.batch,
                    seq=args.seq, variants=("meshslice" if use_pass else "plain",),
                    echo=print, whole=args.whole, **options)
  row = next(iter(results.values())).row()
  with open(args.json, "w") as f:
    json.dump(row, f)
  return 0


ONE_LAYER_MODELS = ("gpt3", "megatron")         # model_step's layer step (model_spec)


def _models(whole: bool) -> tuple:
  """The --model choices: the layer step's, or with --whole the whole step's presets."""
  if not whole:
    return ONE_LAYER_MODELS
  from .whole_step import PRESETS
  return tuple(PRESETS)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m meshslice aot",
      description="Compile a transformer training step for a TPU topology ahead of time "
                  "(libtpu, no TPU needed): XLA's plain and dense programs, each with "
                  "libtpu defaults and with the async collective flags, and the "
                  "meshslice-transformed step, each in its own process; print what the "
                  "compiler made of each side by side, and the rewrite against the best "
                  "XLA variant.")
  parser.add_argument("--model", default="gpt3",
                      help="gpt3 or megatron (the layer step; default gpt3); with --whole "
                           "a preset of meshslice.whole_step.PRESETS, e.g. gpt3, llama70b, "
                           "tiny (float32, small: compiles in seconds)")
  parser.add_argument("--whole", action="store_true",
                      help="compile the whole training step (meshslice.whole_step: one-hot "
                           "token embedding, scanned checkpointed layers, logits, softmax "
                           "cross-entropy, Adam) instead of the layer step (fwd + bwd + SGD)")
  parser.add_argument("--topology", required=True,
                      help="TPU topology, e.g. v4:2x2x2, v4:8x8x4 (256 chips), v5e:16x16, "
                           "tpu7x:2x2x1 (Ironwood: 4 chips, 8 devices, one per TensorCore)")
  parser.add_argument("--mesh", required=True,
                      help="mesh shape RxC (axes x, y) in devices, e.g. 32x8 (on tpu7x the "
                           "two TensorCores of a chip are next to each other along y)")
  parser.add_argument("--layers", type=int, default=None,
                      help="layers in the step (default: 1; with --whole 4, so that the "
                           "simulator sees the scan's steady state)")
  parser.add_argument("--batch", type=int, default=None,
                      help="sequences per step (default: one per device)")
  parser.add_argument("--seq", type=int, default=None,
                      help="tokens per sequence (default: the model's, 2048 for gpt3); "
                           "smaller compiles faster")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="programs to compile, comma-separated, from: "
                           + ", ".join(VARIANTS) + " (default: all)")
  parser.add_argument("--flags", default=None,
                      help="libtpu flag presets for the meshslice variants, comma-separated: "
                           "default (none), async (the generation's async collective flags: "
                           "no all-gather continuation fusion on v4/v5p/v6e, docs/tpu.md), "
                           "fusion (MaxText's continuation-fusion group), safe_async, dense "
                           "(windowed einsum off), all_to_all (async all-to-all: "
                           "reduce-scatters sent as all-to-alls); default: the generation's "
                           "(async,all_to_all on v4, async elsewhere; meshslice_dense adds "
                           "dense). The XLA variants use defaults / dense, each also with "
                           "async")
  parser.add_argument("--profile", default=None,
                      help="hardware profile for planning and the simulator (default: the "
                           "topology's generation)")
  parser.add_argument("--ksplit", default="auto", help="slices per site, or auto")
  parser.add_argument("--json", default=None, help="also write the figures as JSON here")
  parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)   # internal
  args = parser.parse_args(argv)
  if args.model not in _models(args.whole):
    parser.error(f"--model: {args.model!r} is not one of "
                 f"{', '.join(_models(args.whole))}"
                 + (" (the whole step's presets, --whole)" if args.whole else
                    "; the whole step's presets (" + ", ".join(_models(True))
                    + ") need --whole"))
  if args.layers is not None and args.layers < 1:
    parser.error(f"--layers must be a positive int, got {args.layers}")
  args.layers = args.layers or (4 if args.whole else 1)
  try:
    gen, _ = parse_topology(args.topology)
    shape = tuple(int(v) for v in args.mesh.lower().split("x"))
    if len(shape) != 2:
      raise ValueError
  except ValueError as e:
    parser.error(str(e) if str(e) else f"--mesh must be RxC, got {args.mesh!r}")
  if args.whole:                 # sizes that do not divide the mesh: a usage error here
    import jax
    from . import whole_step as ws
    try:
      cfg = ws.config(args.model, layers=args.layers, batch=args.batch or shape[0] * shape[1],
                      seq=args.seq)
      ws._check_divides(cfg, jax.sharding.AbstractMesh(shape, ("x", "y")))
    except ValueError as e:
      parser.error(f"--whole --model {args.model}: {e}")
  if args.flags is None:
    args.flags = rewrite_presets(gen.name)
  try:
    meshslice_flags = preset_flags(args.flags, gen.name)
  except ValueError as e:
    parser.error(f"--flags: {e}")
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown or not variants:
    parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
  if not have_libtpu():
    print("python -m meshslice aot needs libtpu: pip install -e '.[tpu]'", file=sys.stderr)
    return 2
  options = {"profile": args.profile or gen.profile}
  if args.ksplit != "auto":
    if not args.ksplit.isdigit() or int(args.ksplit) < 1:
      parser.error(f"--ksplit must be a positive int or 'auto', got {args.ksplit!r}")
    options.update(ksplit=int(args.ksplit), algorithm="meshslice")
  if args.variant is not None:
    return _variant_worker(args, gen, shape, options)
  del meshslice_flags
  flags_of = {v: variant_flags(v, gen.name, args.flags if VARIANTS[v][0] else "async")
              for v in variants}
  tokens = f", {args.seq} tokens per sequence" if args.seq else ""
  what = (f"whole step (embeddings, {args.layers} layer(s), fwd+bwd, loss, Adam{tokens})"
          if args.whole else f"step ({args.layers} layer(s), fwd+bwd{tokens})")
  print(f"{args.model} {what} on {args.topology} as a {args.mesh} mesh; each variant "
        "compiled in its own process with its libtpu flags:", flush=True)
  for v in variants:
    print(f"  {v}: {' '.join(flags_of[v]) or '(libtpu defaults)'}", flush=True)
  rows = {}
  passthrough = [f"--model={args.model}", f"--topology={args.topology}",
                 f"--mesh={args.mesh}", f"--layers={args.layers}", f"--flags={args.flags}",
                 f"--ksplit={args.ksplit}"]
  passthrough += [f"--batch={args.batch}"] if args.batch else []
  passthrough += [f"--seq={args.seq}"] if args.seq else []
  passthrough += [f"--profile={args.profile}"] if args.profile else []
  passthrough += ["--whole"] if args.whole else []
  for v in variants:
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "row.json")
      # the worker writes its row to --json (it prints no records); its report is printed
      # here when it is the rewrite's, or when it failed
      printed: list = []
      try:
        run_in_fresh_process(["-m", "meshslice", "aot", *passthrough, f"--variant={v}",
                              f"--json={out}"], prefix="RECORD ", echo=printed.append,
                             check=lambda _, out=out: os.path.exists(out),
                             drop_env=("XLA_FLAGS", "LIBTPU_INIT_ARGS"))
      except FreshProcessError as e:
        if VARIANTS[v][0] or e.returncode:
          print(e.stdout, end="", flush=True)
        print(f"error: variant {v} failed (exit {e.returncode}):\n{e.stderr[-2000:]}",
              file=sys.stderr)
        return 2
      if VARIANTS[v][0]:
        print("".join(printed), end="", flush=True)
      with open(out) as f:
        rows[v] = json.load(f)
  print(format_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0
