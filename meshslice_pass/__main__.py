"""Command line: `python -m meshslice demo | autotune | calibrate | aot` (each takes
--help; `calibrate --aot TOPOLOGY` fits the planner's compiler terms to TPU compiles)."""
from __future__ import annotations

import argparse
import os
import sys


def _demo(argv) -> int:
  parser = argparse.ArgumentParser(prog="python -m meshslice demo",
                                   description="Plan a GPT-3 layer for a TPU pod, then "
                                               "transform a small GPT-style training step on "
                                               "an emulated 8-device CPU mesh and check it.")
  parser.add_argument("--mesh", default="2x4", help="mesh shape RxC, e.g. 2x4, 4x2, 2x2")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--explicit", action="store_true", help="use Explicit mesh axes")
  parser.add_argument("--ksplit", default="4",
                      help="slices per site (default 4, so the demo exercises the sliced "
                           "pipeline), or 'auto' to let the cost model choose: for these "
                           "CPU-sized matmuls it predicts that slicing does not pay")
  parser.add_argument("--profile", default="tpu-v4", help="hardware profile for the cost model")
  parser.add_argument("--target", default="64x4",
                      help="mesh RxC of the pod to plan one GPT-3 layer for first (abstract "
                           "inputs, nothing allocated; default: the 256-chip mesh that "
                           "`autotune --model gpt3 --chips 256` recommends), or 'none' to "
                           "skip that part")
  args = parser.parse_args(argv)
  target = None
  if args.target.lower() != "none":
    try:
      target = tuple(int(v) for v in args.target.lower().split("x"))
      assert len(target) == 2 and all(v >= 1 for v in target)
    except (ValueError, AssertionError):
      parser.error(f"--target must be RxC (e.g. 32x8) or 'none', got {args.target!r}")
  try:
    shape = tuple(int(v) for v in args.mesh.lower().split("x"))
    assert len(shape) == 2 and all(v >= 1 for v in shape) and shape[0] * shape[1] <= 8
  except (ValueError, AssertionError):
    parser.error(f"--mesh must be RxC with R*C <= 8 (the emulated devices), got {args.mesh!r}")
  options = {"profile": args.profile}
  if args.ksplit != "auto":
    try:
      ksplit = int(args.ksplit)
    except ValueError:
      ksplit = 0
    if ksplit < 1:
      parser.error(f"--ksplit must be a positive int (1 = no slicing) or 'auto', got "
                   f"{args.ksplit!r}")
    options.update(ksplit=ksplit, algorithm="meshslice")
  from meshslice.costmodel import load_profile
  try:
    load_profile(args.profile)
  except ValueError as e:
    parser.error(f"--profile: {e}")
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  from .demo import run_demo
  err = run_demo(shape, args.dtype, args.explicit, target=target, **options)
  tolerance = 1e-3 if args.dtype == "float32" else 5e-2
  if err > tolerance:
    print(f"FAILED: transformed step differs by {err:.2e} > {tolerance}")
    return 1
  print(f"OK: transformed step matches the original within {tolerance}")
  return 0


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  def autotune(args):
    from meshslice.costmodel import cli
    return cli.main(["autotune"] + args)

  def calibrate(args):
    if any(a == "--aot" or a.startswith("--aot=") for a in args):
      from .calibrate_aot import calibrate_main   # fit the planner's terms to TPU compiles
      return calibrate_main(args)
    from meshslice.costmodel import calibrate as calibration
    return calibration.main(args)

  def aot(args):
    from . import aot_cli
    return aot_cli.main(args)

  commands = {"demo": _demo, "autotune": autotune, "calibrate": calibrate, "aot": aot}
  if not argv or argv[0] not in commands:
    print(f"usage: python -m meshslice {{{','.join(commands)}}} [options]", file=sys.stderr)
    return 2
  return commands[argv[0]](argv[1:])


if __name__ == "__main__":
  sys.exit(main())
