"""`python -m meshslice calibrate --aot TOPOLOGY`: fit the planner's per-site compiler
terms to single-GEMM programs compiled ahead of time for a TPU topology
(meshslice.aot_sites compiles them, costmodel.compiler_fit fits them) and write them into
a profile JSON as its "compiler_terms" section.
"""
from __future__ import annotations

import argparse
import json
import math
import os

from . import aot
from .aot_sites import Case, compile_in_subprocess, flags_of

DEFAULT_SHAPES = ("4096x4096x4096", "8192x8192x8192", "16384x4096x8192")
DATAFLOWS = ("os", "ls", "rs")

# the mesh axes each dim of an (M, K, N) GEMM is sharded over, per dataflow: the operand
# layouts of rewrites.plain_gemm and the output's P("x", "y"), with mesh axes x = R, y = C
_SHARDED_OVER = {"os": ("R", "RC", "C"), "ls": ("R", "C", "RC"), "rs": ("RC", "R", "C")}


def _ints(text: str, sep: str) -> tuple[int, ...]:
  """Positive integers separated by `sep`, or ValueError."""
  values = tuple(int(v) for v in text.lower().split(sep))
  if not values or min(values) < 1:
    raise ValueError(text)
  return values


def _check_args(args):
  """Every option of `calibrate --aot`, checked before anything is compiled: (generation,
  mesh, shapes, ksplits, dataflows, base profile), or a ValueError naming the first bad
  option."""
  from meshslice.costmodel.calibrate import check_output_path, check_profile_option
  try:
    gen, dims = aot.parse_topology(args.aot)
  except ValueError as e:
    raise ValueError(f"--aot: {e}") from None
  chips = math.prod(dims) * gen.devices_per_chip       # devices: two per chip on tpu7x
  try:
    mesh = _ints(args.mesh, "x") if args.mesh else (2, chips // 2)
  except ValueError:
    mesh = ()
  if len(mesh) != 2 or mesh[0] * mesh[1] != chips:
    raise ValueError(f"--mesh must be RxC with R * C = {chips} (the devices of {args.aot}), "
                     f"got {args.mesh!r}")
  try:
    shapes = tuple(_ints(s, "x") for s in args.shapes.split(","))
  except ValueError:
    shapes = ()
  if not shapes or any(len(s) != 3 for s in shapes):
    raise ValueError("--shapes must be GEMM sizes MxKxN of positive integers, comma-separated "
                     f"(e.g. 4096x4096x4096), got {args.shapes!r}")
  try:
    ksplits = tuple(dict.fromkeys(_ints(args.ksplits, ",")))
  except ValueError:
    raise ValueError("--ksplits must be positive integers, comma-separated (e.g. 1,2,4), got "
                     f"{args.ksplits!r}") from None
  flows = tuple(dict.fromkeys(f.strip() for f in args.dataflows.split(",") if f.strip()))
  if not flows or not set(flows) <= set(DATAFLOWS):
    raise ValueError(f"--dataflows must be drawn from {', '.join(DATAFLOWS)} "
                     f"(comma-separated), got {args.dataflows!r}")
  sizes = {"R": mesh[0], "C": mesh[1]}
  for shape in shapes:
    for name, extent, i in zip("MKN", shape, range(3)):
      multiple = math.lcm(*(sizes[a] for f in flows for a in _SHARDED_OVER[f][i]))
      if extent % multiple:
        raise ValueError(f"--shapes: {'x'.join(map(str, shape))} does not shard over the "
                         f"{mesh[0]}x{mesh[1]} mesh: {name} must be a multiple of {multiple} "
                         f"(dataflows {','.join(flows)})")
  base = check_profile_option("--profile", args.profile or gen.profile)
  check_output_path("--out", args.out, suffix=".json")
  if args.records is not None:
    check_output_path("--records", args.records)
    if os.path.abspath(args.records) == os.path.abspath(args.out):
      raise ValueError(f"--records must differ from --out (both {args.out!r})")
  return gen, mesh, shapes, ksplits, flows, base


def calibrate_main(argv) -> int:
  """`python -m meshslice calibrate --aot TOPOLOGY`: compile single-GEMM programs for
  the topology (os / ls / rs, each shape, meshslice S in --ksplits, XLA's program with
  windowed einsum on and off), fit the compiler terms (costmodel.compiler_fit) and write
  a profile JSON with them as its "compiler_terms" section.

  Example:
    python -m meshslice calibrate --aot v4:2x2x2 --out v4-compiled.json
    python -c "import meshslice; meshslice.transform(step, profile='v4-compiled.json')"
  """
  parser = argparse.ArgumentParser(
      prog="python -m meshslice calibrate --aot",
      description="Fit the planner's per-site compiler terms to ahead-of-time TPU compiles "
                  "and write them into a profile JSON (section 'compiler_terms').")
  parser.add_argument("--aot", required=True, metavar="TOPOLOGY", help="e.g. v4:2x2x2")
  parser.add_argument("--mesh", default=None,
                      help="mesh RxC with R * C = the topology's chips (default: 2 x chips/2)")
  parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                      help="GEMM sizes MxKxN, comma-separated; each dim a multiple of the "
                           "mesh axes it is sharded over")
  parser.add_argument("--ksplits", default="1,2,4",
                      help="meshslice slice counts, positive, comma-separated")
  parser.add_argument("--dataflows", default=",".join(DATAFLOWS),
                      help="dataflows to compile, comma-separated, from: "
                           + ", ".join(DATAFLOWS))
  parser.add_argument("--profile", default=None,
                      help="base profile (default: the topology's generation's)")
  parser.add_argument("--out", required=True,
                      help="profile JSON to write (a .json name in an existing directory)")
  parser.add_argument("--records", default=None,
                      help="also write the compiled programs' figures here (JSON lines)")
  args = parser.parse_args(argv)
  try:
    gen, mesh, shapes, ksplits, flows, base = _check_args(args)
  except ValueError as e:
    parser.error(str(e))
  if not aot.have_libtpu():
    parser.error("needs libtpu: pip install -e '.[tpu]'")
  import jax
  from meshslice.costmodel import compiler_fit, xla_baseline
  from meshslice.costmodel.tpu_schedule import CLOCK_HZ
  cases = [Case(dataflow=flow, m=m, k=k, n=n, label=f"{flow} {m}x{k}x{n}")
           for m, k, n in shapes for flow in flows]
  print(f"compiling {len(cases)} GEMM sites for {args.aot} as {mesh[0]}x{mesh[1]} "
        f"(S = {args.ksplits}; XLA with windowed einsum on and off), one at a time")
  records = []
  for flag_set, ks in (("async_dense", ()), ("async", ksplits)):
    records += compile_in_subprocess(args.aot, mesh, cases, flag_set, ksplits=ks,
                                     echo=lambda s: print(s, flush=True)
                                     if "Mcycles" in s else None)
  from importlib.metadata import version
  source = (f"python -m meshslice calibrate --aot {args.aot} --mesh {mesh[0]}x{mesh[1]} "
            f"--shapes {args.shapes} --ksplits {args.ksplits}; jax {jax.__version__}, "
            f"libtpu {version('libtpu')}, flags: {' '.join(flags_of('async', gen.name))} "
            "(+ DENSE_FLAGS for the dense program)")
  fallback = xla_baseline.builtin_terms(base.name) or xla_baseline.builtin_terms("tpu-v4")
  terms, notes = compiler_fit.fit_terms(records, base, CLOCK_HZ.get(base.name, 1.05e9),
                                        fallback=fallback, source=source)
  xla_baseline.write_terms(args.out, base, terms)
  for key, value in terms.to_json_dict().items():
    if key != "source":
      print(f"  {key:<24} {value}")
  for note in notes:
    print(f"  note: {note}")
  print(f"profile {base.name!r} with compiler terms written to {args.out}")
  if args.records:
    with open(args.records, "w", encoding="utf-8") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")
  return 0
