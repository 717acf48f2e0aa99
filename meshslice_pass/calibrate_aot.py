"""`python -m meshslice calibrate --aot TOPOLOGY`: fit the planner's per-site compiler
terms to single-GEMM programs compiled ahead of time for a TPU topology
(meshslice.aot_sites compiles them, costmodel.compiler_fit fits them) and write them into
a profile JSON as its "compiler_terms" section.
"""
from __future__ import annotations

import argparse
import json

from . import aot
from .aot_sites import Case, compile_in_subprocess, flags_of

DEFAULT_SHAPES = ("4096x4096x4096", "8192x8192x8192", "16384x4096x8192")


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
  parser.add_argument("--mesh", default=None, help="mesh RxC (default: 2 x chips/2)")
  parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                      help="GEMM sizes MxKxN, comma-separated")
  parser.add_argument("--ksplits", default="1,2,4", help="meshslice slice counts")
  parser.add_argument("--dataflows", default="os,ls,rs", help="dataflows to compile")
  parser.add_argument("--profile", default=None,
                      help="base profile (default: the topology's generation's)")
  parser.add_argument("--out", required=True, help="profile JSON to write")
  parser.add_argument("--records", default=None,
                      help="also write the compiled programs' figures here (JSON lines)")
  args = parser.parse_args(argv)
  try:
    gen, dims = aot.parse_topology(args.aot)
    chips = 1
    for d in dims:
      chips *= d
    mesh = (tuple(int(v) for v in args.mesh.lower().split("x")) if args.mesh
            else (2, chips // 2))
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    ksplits = tuple(int(v) for v in args.ksplits.split(","))
    flows = tuple(args.dataflows.split(","))
    assert set(flows) <= {"os", "ls", "rs"}
    assert len(mesh) == 2 and mesh[0] * mesh[1] == chips and all(len(s) == 3 for s in shapes)
  except (ValueError, AssertionError) as e:
    parser.error(f"--aot / --mesh / --shapes / --ksplits: {e or 'malformed'}")
  if not aot.have_libtpu():
    parser.error("needs libtpu: pip install -e '.[tpu]'")
  import jax
  from meshslice.costmodel import compiler_fit, load_profile, xla_baseline
  from meshslice.costmodel.tpu_schedule import CLOCK_HZ
  base = load_profile(args.profile or gen.profile)
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
