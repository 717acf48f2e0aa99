"""`python -m meshslice aot`: compile a transformer training step for a TPU topology
ahead of time as XLA's four programs (plain and dense, each with libtpu defaults and with
the async collective flags) and the meshslice rewrite, each variant in its own process
under its own libtpu flags, and print what the compiler made of each side by side.

The compiling and reading is meshslice.aot's (`compare`, `VARIANTS`, `variant_flags`,
`versus_best_xla`); this module is the command line and its table. `aot.format_table` and
`aot.main` still resolve here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from .aot import (VARIANTS, compare, have_libtpu, parse_topology, preset_flags, set_flags,
                  variant_flags, versus_best_xla)

# the table's rows: (label, figure of a row dict (`AotResult.row()`), format)
_ROWS = (("compute cycles (M)", lambda r: r["compute_cycles"] / 1e6, "{:.1f}"),
         ("  dot cycles (M)", lambda r: r["dot_cycles"] / 1e6, "{:.1f}"),
         ("  relayout copy cycles (M)", lambda r: r["copy_cycles"] / 1e6, "{:.2f}"),
         ("relayout copies", lambda r: r["relayout_copies"], "{:d}"),
         ("collectives (sync / async)",
          lambda r: f"{r['collectives']} ({r['sync_collectives']} / {r['async_collectives']})",
          "{}"),
         ("collective bytes / device (MB)", lambda r: r["collective_bytes"] / 1e6, "{:.1f}"),
         ("windowed-einsum loops", lambda r: r["windowed_einsum_loops"], "{:d}"),
         ("simulated step (ms)", lambda r: r["step_s"] * 1e3, "{:.3f}"),
         ("  compute (ms)", lambda r: r["compute_s"] * 1e3, "{:.3f}"),
         ("  exposed communication (ms)", lambda r: r["exposed_s"] * 1e3, "{:.3f}"),
         ("  most of it waiting on", lambda r: _largest_wait(r), "{}"),
         ("peak memory / device (GiB)", lambda r: r["peak_bytes"] / 2**30, "{:.2f}"),
         ("compile time (s)", lambda r: r["compile_s"], "{:.0f}"))


def _largest_wait(row: dict) -> str:
  """The label and ms of the largest group of waits (`Simulation.exposed_by`), or "-"."""
  groups = row.get("exposed_by") or []
  if not groups:
    return "-"
  label, seconds, _ = groups[0]
  return f"{label} ({seconds * 1e3:.2f})"


def format_table(results: dict) -> str:
  """Side-by-side table of {variant: AotResult or row dict} (ratio column for two
  variants), each column's libtpu flags under it, and meshslice against the best XLA
  variant when both are there."""
  names = list(results)
  rows = {n: (results[n] if isinstance(results[n], dict) else results[n].row())
          for n in names}
  lines = [["", *names] + (["ratio"] if len(names) == 2 else [])]
  for label, get, fmt in _ROWS:
    values = [get(rows[n]) for n in names]
    line = [label] + [fmt.format(v) for v in values]
    if len(names) == 2:
      a, b = values
      line.append(f"{b / a:.2f}x" if isinstance(a, (int, float)) and a else "")
    lines.append(line)
  widths = [max(len(l[i]) for l in lines) for i in range(len(lines[0]))]
  text = [ "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(l, widths))) for l in lines]
  text.append("libtpu flags (LIBTPU_INIT_ARGS):")
  text += [f"  {n}: {rows[n].get('flags') or '(libtpu defaults)'}" for n in names]
  for variant in (n for n in names if VARIANTS.get(n, (False,))[0]):
    best = versus_best_xla(rows, variant=variant)
    if best is not None:
      name, seconds, ratio = best
      text.append(f"{variant} vs the best XLA variant ({name}, {seconds * 1e3:.3f} ms): "
                  f"{ratio:.3f}x ({'faster' if ratio > 1 else 'not faster'})")
  return "\n".join(text)


def _variant_worker(args, gen, shape, options) -> int:
  """Compile one variant in this process under its flags, print its report (meshslice)
  and write its row as JSON to args.json."""
  use_pass, _ = VARIANTS[args.variant]
  set_flags(*variant_flags(args.variant, gen.name, args.flags if use_pass else "async"))
  import jax
  jax.config.update("jax_platforms", "cpu")      # the host runs nothing but the compiler
  results = compare(args.model, args.topology, shape, layers=args.layers, batch=args.batch,
                    seq=args.seq, variants=("meshslice" if use_pass else "plain",),
                    echo=print, **options)
  row = next(iter(results.values())).row()
  with open(args.json, "w") as f:
    json.dump(row, f)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m meshslice aot",
      description="Compile a transformer training step for a TPU topology ahead of time "
                  "(libtpu, no TPU needed): XLA's plain and dense programs, each with "
                  "libtpu defaults and with the async collective flags, and the "
                  "meshslice-transformed step, each in its own process; print what the "
                  "compiler made of each side by side, and the rewrite against the best "
                  "XLA variant.")
  parser.add_argument("--model", default="gpt3", choices=["gpt3", "megatron"])
  parser.add_argument("--topology", required=True,
                      help="TPU topology, e.g. v4:2x2x2, v4:8x8x4 (256 chips), v5e:16x16, "
                           "tpu7x:2x2x1 (Ironwood: 4 chips, 8 devices, one per TensorCore)")
  parser.add_argument("--mesh", required=True,
                      help="mesh shape RxC (axes x, y) in devices, e.g. 32x8 (on tpu7x the "
                           "two TensorCores of a chip are next to each other along y)")
  parser.add_argument("--layers", type=int, default=1, help="layers in the step")
  parser.add_argument("--batch", type=int, default=None,
                      help="sequences per step (default: one per device)")
  parser.add_argument("--seq", type=int, default=None,
                      help="tokens per sequence (default: the model's, 2048); smaller "
                           "compiles faster")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="programs to compile, comma-separated, from: "
                           + ", ".join(VARIANTS) + " (default: all)")
  parser.add_argument("--flags", default="async",
                      help="libtpu flag presets for the meshslice variant, comma-separated: "
                           "default (none), async (the generation's async collective flags: "
                           "no all-gather continuation fusion on v4/v5p/v6e, docs/tpu.md), "
                           "fusion (MaxText's continuation-fusion group), safe_async, dense "
                           "(windowed einsum off); default: async. The XLA variants use "
                           "defaults / dense, each also with async")
  parser.add_argument("--profile", default=None,
                      help="hardware profile for planning and the simulator (default: the "
                           "topology's generation)")
  parser.add_argument("--ksplit", default="auto", help="slices per site, or auto")
  parser.add_argument("--json", default=None, help="also write the figures as JSON here")
  parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)   # internal
  args = parser.parse_args(argv)
  try:
    gen, _ = parse_topology(args.topology)
    shape = tuple(int(v) for v in args.mesh.lower().split("x"))
    if len(shape) != 2:
      raise ValueError
  except ValueError as e:
    parser.error(str(e) if str(e) else f"--mesh must be RxC, got {args.mesh!r}")
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
  print(f"{args.model} step ({args.layers} layer(s), fwd+bwd"
        f"{f', {args.seq} tokens per sequence' if args.seq else ''}) on {args.topology} as a "
        f"{args.mesh} mesh; each variant compiled in its own process with its libtpu "
        "flags:", flush=True)
  for v in variants:
    print(f"  {v}: {' '.join(flags_of[v]) or '(libtpu defaults)'}", flush=True)
  rows = {}
  passthrough = [f"--model={args.model}", f"--topology={args.topology}",
                 f"--mesh={args.mesh}", f"--layers={args.layers}", f"--flags={args.flags}",
                 f"--ksplit={args.ksplit}"]
  passthrough += [f"--batch={args.batch}"] if args.batch else []
  passthrough += [f"--seq={args.seq}"] if args.seq else []
  passthrough += [f"--profile={args.profile}"] if args.profile else []
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.pop("LIBTPU_INIT_ARGS", None)
  for v in variants:
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "row.json")
      proc = subprocess.run([sys.executable, "-m", "meshslice", "aot", *passthrough,
                             f"--variant={v}", f"--json={out}"], env=env, text=True,
                            capture_output=True)
      if VARIANTS[v][0] or proc.returncode:
        print(proc.stdout, end="", flush=True)
      if proc.returncode or not os.path.exists(out):
        print(f"error: variant {v} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}",
              file=sys.stderr)
        return 2
      with open(out) as f:
        rows[v] = json.load(f)
  print(format_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0
