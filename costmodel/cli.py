"""`python -m meshslice autotune`: best mesh shape, dataflow, algorithm and ksplit for the
feed-forward layers of a transformer, from the cost model alone (nothing is run).

Example:
  python -m meshslice autotune --model gpt3 --chips 256
  python -m meshslice autotune --model custom --chips 64 --heads 32 --head-dim 128 \\
      --seq 2048 --profile tpu-v5p --algorithms all --trace plan.json
"""
from __future__ import annotations

import argparse
import sys

from . import autotune as A
from .profiles import known_profiles, load_profile
from .timeline import trace_events, write_trace
from .timing import ALGORITHMS, schedule


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m meshslice autotune",
      description="Predict the FF-layer GEMMs of one transformer layer (forward + backward) "
                  "on every 2D mesh shape of --chips and pick the best shape, and per GEMM "
                  "the algorithm and ksplit. Costs come from the cost model only.")
  p.add_argument("--model", default="gpt3", choices=[*A.MODELS, "custom"],
                 help="gpt3 (96 heads x 128), megatron (160 x 128), or custom "
                      "(needs --heads, --head-dim, --seq)")
  p.add_argument("--chips", type=int, required=True, help="number of chips P")
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per step (default: one per chip)")
  p.add_argument("--seq", type=int, default=None, help="sequence length (preset: 2048)")
  p.add_argument("--heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=None)
  p.add_argument("--layers", type=int, default=None,
                 help="transformer layers per step (presets: gpt3 96, megatron 105)")
  p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element (bf16: 2)")
  p.add_argument("--profile", default="tpu-v4",
                 help=f"hardware profile name ({', '.join(known_profiles())}) or JSON path")
  p.add_argument("--algorithms", default=",".join(A.EMITTABLE),
                 help=f"comma-separated candidates from {', '.join(ALGORITHMS)}, or 'all' "
                      f"(default: what the pass emits)")
  p.add_argument("--assume", default="ours", choices=A.ASSUMPTIONS,
                 help="ours: the profile as shipped (roofline, op overheads, memory), "
                      "layouts chosen by predicted time; paper: the original MeshSlice "
                      "autotuner's assumptions (tpu-v4 only: 2.66e14 FLOP/s at full "
                      "efficiency, no roofline or memory limit, its dataflow rule)")
  p.add_argument("--dataflow-policy", default=None, choices=A.DATAFLOW_POLICIES,
                 help="how each FF layer's weight layout (forward dataflow) is chosen: "
                      "model (by predicted time; default), paper (os if d_out >= d_in, "
                      "else ls; default with --assume paper), os (always os)")
  p.add_argument("--no-topology", action="store_true",
                 help="use the profile's two fixed dims (row axis = dim 0, column axis = "
                      "dim 1) instead of bandwidths derived from where create_device_mesh "
                      "puts each mesh axis on the torus / nodes")
  p.add_argument("--no-memory-check", action="store_true",
                 help="do not exclude plans and shapes that exceed the chip's HBM")
  p.add_argument("--memory-layers", type=int, default=None,
                 help="layers whose weights, optimizer state and saved activations live "
                      "on these chips (default: all of the model's)")
  p.add_argument("--max-ksplit", type=int, default=16)
  p.add_argument("--min-block", type=int, default=1)
  p.add_argument("--compare", action="store_true",
                 help="instead of one search over --algorithms: run each of collective, "
                      "wang, summa, cannon and meshslice alone at its own best mesh shape "
                      "and print meshslice's predicted gain over each, FF GEMMs and end to "
                      "end (FF GEMMs + attention + elementwise)")
  p.add_argument("--best-only", action="store_true",
                 help="print the per-GEMM table of the best mesh shape only")
  p.add_argument("--trace", default=None,
                 help="write the predicted schedule of the best shape as Perfetto JSON")
  p.add_argument("--json", default=None, help="write the full result as JSON")
  return p


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3f} ms"


def _ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}x" if b else "-"


def _table(rows, header) -> list[str]:
  widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
  fmt = lambda r: "  ".join(str(v).rjust(w) if i >= 2 else str(v).ljust(w)
                            for i, (v, w) in enumerate(zip(r, widths))).rstrip()
  return [fmt(header)] + [fmt(r) for r in rows]


def _layer_table(result) -> list[str]:
  rows = []
  for lc in result.layers:
    c, p = lc.choice, lc.problem
    rows.append([lc.label, c.dataflow, c.label, c.ksplit, lc.layout, f"{p.m}x{p.n}x{p.k}",
                 _ms(c.cost.total_s), _ms(c.baseline.total_s), _ratio(c.baseline.total_s,
                                                                       c.cost.total_s),
                 _ms(c.cost.exposed_comm_s), _ms(lc.bound.total_s)])
  return _table(rows, ["gemm", "dataflow", "algorithm", "ksplit", "layout", "m x n x k",
                       "predicted",
                       "collective", "speedup", "exposed comm", "bound"])


def render(rec: A.MeshRecommendation, *, best_only: bool = False) -> str:
  """The text report of a MeshRecommendation (what `autotune` prints)."""
  m = rec.model
  lines = [f"autotune: {m.name} (hidden {m.hidden} = {m.heads} heads x {m.head_dim}, "
           f"seq {m.seq}, {m.layers} layers), {rec.chips} chips, batch {rec.batch}, "
           f"{rec.dtype_bytes}-byte elements, profile {rec.profile}",
           f"candidates: {', '.join(rec.algorithms)} (ksplit <= {rec.max_ksplit}); "
           f"times per transformer layer (12 FF GEMMs, forward + backward)",
           f"assumptions: {rec.assume}; layouts chosen by: {rec.dataflow_policy}", ""]
  rows = []
  for r in rec.results:
    mem = "-" if r.memory is None else f"{r.memory.total / 2**30:.1f} GiB"
    if r.feasible:
      rows.append([str(r.shape), "*" if r is rec.best else "", _ms(r.cost.total_s),
                   _ms(r.baseline.total_s) + ("!" if r.baseline_reason else ""),
                   _ratio(r.baseline.total_s, r.cost.total_s),
                   _ms(r.bound.total_s), f"+{(r.cost.total_s / r.bound.total_s - 1) * 100:.1f}%",
                   mem, ""])
    else:
      rows.append([str(r.shape), "", "infeasible", "", "", "", "", mem, r.reason])
  lines += _table(rows, ["mesh shape", "best", "predicted", "collective", "speedup", "bound",
                         "gap to bound", "memory", ""])
  if any(r.baseline_reason for r in rec.results if r.feasible):
    lines += ["", "! the collective algorithm does not fit in memory on this shape:"]
    lines += [f"  {r.shape}: {r.baseline_reason}" for r in rec.results
              if r.feasible and r.baseline_reason]
  for r in rec.results:
    if r.feasible and (r is rec.best or not best_only):
      lines += ["", f"mesh shape {r.shape}{' (best)' if r is rec.best else ''}:"]
      if r.axes:
        lines += [f"  row axis on {r.axes[0]}, column axis on {r.axes[1]}"]
      lines += ["  " + line for line in _layer_table(r)]
  b = rec.best
  runner = rec.runner_up
  if runner is not None:
    tie = " (near tie: within 2%, inside the model's error)" if rec.near_tie else ""
    lines += ["", f"runner-up: {runner.shape}: {_ms(runner.cost.total_s)} per layer, "
                  f"+{rec.margin * 100:.2f}% over the best{tie}"]
  else:
    lines += [""]
  lines += [f"best mesh shape: {b.shape}: {_ms(b.cost.total_s)} per layer, "
                f"{b.cost.total_s * m.layers:.4f} s per step of {m.layers} layers "
                f"(collective on the same shape: {b.baseline.total_s * m.layers:.4f} s, "
                f"{_ratio(b.baseline.total_s, b.cost.total_s)})"]
  return "\n".join(lines)


def render_comparison(rows, *, model, chips: int, profile: str, assume: str) -> str:
  """The text table of `--compare` (autotune.compare_algorithms rows)."""
  ms = next((r for r in rows if r.algorithm == "meshslice" and r.shape), None)
  lines = [f"compare: {model}, {chips} chips, profile {profile}, assumptions {assume}; "
           f"times per transformer layer (forward + backward); each algorithm at its own "
           f"best mesh shape", ""]
  table = []
  for r in rows:
    if r.shape is None:
      table.append([r.algorithm, "n/a", "", "", "", "", r.reason.split(": ", 1)[-1][:60]])
      continue
    ff_gain = e2e_gain = "-"
    if ms is not None and r is not ms:
      ff_gain = f"{(r.ff_s / ms.ff_s - 1) * 100:+.1f}%"
      e2e_gain = f"{(r.layer_s / ms.layer_s - 1) * 100:+.1f}%"
    table.append([r.algorithm, str(r.shape), _ms(r.ff_s), _ms(r.layer_s), ff_gain, e2e_gain,
                  ""])
  lines += _table(table, ["algorithm", "best shape", "FF GEMMs", "end to end",
                          "meshslice gain (FF)", "(end to end)", ""])
  if ms is not None:
    lines += ["", f"other work per layer (attention core, elementwise): "
                  f"{_ms(ms.other_s)}, the same for every algorithm"]
  return "\n".join(lines)


def main(argv=None) -> int:
  """Run `autotune`; `argv` may start with the word "autotune". Returns the exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] == "autotune":
    argv = argv[1:]
  parser = _parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:   # --help or a usage error: argparse already printed why
    return int(e.code or 0)
  algorithms = (ALGORITHMS if args.algorithms.strip() == "all"
                else tuple(a.strip() for a in args.algorithms.split(",") if a.strip()))
  options = dict(batch=args.batch, seq=args.seq, heads=args.heads, head_dim=args.head_dim,
                 layers=args.layers, dtype_bytes=args.dtype_bytes, max_ksplit=args.max_ksplit,
                 min_block=args.min_block, assume=args.assume,
                 dataflow_policy=args.dataflow_policy, check_memory=not args.no_memory_check,
                 memory_layers=args.memory_layers, topology=not args.no_topology)
  if args.compare:
    try:
      profile = load_profile(args.profile)
      spec = A.model_spec(args.model, heads=args.heads, head_dim=args.head_dim, seq=args.seq,
                          layers=args.layers)
      A.mesh_shapes(args.chips)
      rows = A.compare_algorithms(args.chips, model=spec, profile=profile, **{
          k: v for k, v in options.items() if k not in ("seq", "heads", "head_dim",
                                                        "layers")})
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(render_comparison(rows, model=spec.name, chips=args.chips, profile=profile.name,
                            assume=args.assume))
    return 0
  try:
    profile = load_profile(args.profile)
    rec = A.recommend_mesh(args.chips, model=args.model, profile=profile, batch=args.batch,
                           seq=args.seq, heads=args.heads, head_dim=args.head_dim,
                           layers=args.layers, dtype_bytes=args.dtype_bytes,
                           algorithms=algorithms, max_ksplit=args.max_ksplit,
                           min_block=args.min_block, assume=args.assume,
                           dataflow_policy=args.dataflow_policy,
                           check_memory=not args.no_memory_check,
                           memory_layers=args.memory_layers,
                           topology=not args.no_topology)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(render(rec, best_only=args.best_only))
  if args.trace:
    scheds = [(lc.label, schedule(lc.problem, lc.choice.algorithm, lc.choice.dataflow,
                                  lc.choice.ksplit, rec.best.profile,
                                  **dict(lc.choice.options)))
              for lc in rec.best.layers]
    write_trace(args.trace, trace_events(
        scheds, process_name=f"{rec.model.name} on {rec.best_shape} ({rec.profile}), predicted"))
    print(f"trace written to {args.trace}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      f.write(rec.to_json() + "\n")
    print(f"result written to {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
