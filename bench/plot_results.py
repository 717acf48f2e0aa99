"""One picture of the TPU benchmarks' results: the step time of XLA's best program and
of meshslice's plans (default, tuned) per TPU generation and scale, under each simulator
model, as grouped bars.

It reads the JSON lines that bench/tpu_models.py (one layer: programs xla, default,
tuned) and bench/tpu_whole_step.py (a whole step: programs xla, meshslice) write to their
--out_dir, one line per compiled program; summary lines and failed compiles are skipped.
Each setup (generation, chips, model, layers) gets one panel; in it, one group of bars
per simulator model (alpha-beta, routed-links, and libtpu's scheduler total at its
nominal clock where it was logged) and one bar per program. Several records of one bar
(reruns, other meshes or flag sets) count once, the fastest: XLA's best program against
meshslice's best.

matplotlib draws it; it is not a dependency of meshslice (pip install matplotlib).

  python bench/plot_results.py --png=/tmp/results.png /tmp/models /tmp/whole_step
  python bench/plot_results.py --png=/tmp/gpt3.png /tmp/models/gpt3_v4-8x8x4_64x4.jsonl
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import sys

from absl import app, flags

_PNG = flags.DEFINE_string("png", None, "where the PNG goes (required)")

# the programs as they are shown, in this order, by the names the benches write
PROGRAMS = {"xla": "XLA (best)", "default": "meshslice default",
            "meshslice": "meshslice default", "tuned": "meshslice tuned"}
SIMULATORS = ("alpha-beta", "routed-links", "libtpu-lhs")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Bar:
  """One bar: a program's step time on one setup under one simulator model.

  Attributes:
    setup: the panel, e.g. "v4 256 chips: gpt3, 1 layer".
    program: "XLA (best)", "meshslice default", "meshslice tuned" (or "meshslice
      <options>" for a whole step run with --options).
    simulator: "alpha-beta", "routed-links" or "libtpu-lhs" (its cycles at the chip's
      nominal clock).
    step_s: the step time, seconds: the fastest of the records of this bar.
    mesh: the mesh of that record, e.g. "64x4".
  """

  setup: str
  program: str
  simulator: str
  step_s: float
  mesh: str


def _files(paths) -> list:
  """The JSON-lines files of `paths`: files as given, directories' *.jsonl sorted."""
  out = []
  for path in paths:
    if os.path.isdir(path):
      out += sorted(glob.glob(os.path.join(path, "*.jsonl")))
    else:
      out.append(path)
  return out


def _mesh(record) -> tuple:
  mesh = record.get("mesh", "")
  return tuple(int(v) for v in (mesh.split("x") if isinstance(mesh, str) else mesh))


def _chips(record) -> int:
  """Chips of the record's topology ("tpu7x:16x16x4": 1024, though its mesh counts the
  2048 TensorCores), else the mesh's devices."""
  dims = str(record.get("topology", "")).partition(":")[2]
  try:
    return math.prod(int(v) for v in dims.split("x"))
  except ValueError:
    return math.prod(_mesh(record))


def _setup(record) -> tuple:
  """(sort key, label) of the setup a record belongs to."""
  generation = str(record.get("topology", "?")).split(":")[0]
  chips = _chips(record)
  layers = record.get("layers", 1)
  what = (f"whole step, {layers} layers" if "vocab" in record
          else f"{layers} layer{'s' if layers != 1 else ''}")
  model = record.get("model", "?")
  return (generation, chips, model, what), f"{generation} {chips} chips: {model}, {what}"


def _program(record) -> str:
  name = record["program"]
  if name == "meshslice" and record.get("options"):
    return f"meshslice {json.dumps(record['options'], sort_keys=True)}"
  return PROGRAMS.get(name, name)


def _figures(record) -> dict:
  """{simulator: step seconds} of one program's record."""
  out = {}
  for simulator in SIMULATORS:
    figures = record.get(simulator)
    if not isinstance(figures, dict):
      continue
    seconds = figures.get("nominal_step_s" if simulator == "libtpu-lhs" else "step_s")
    if isinstance(seconds, (int, float)) and seconds > 0:
      out[simulator] = float(seconds)
  return out


def load(paths) -> list[Bar]:
  """The bars of the JSON lines in `paths` (files, or directories of *.jsonl): one per
  (setup, program, simulator), the fastest record's, in setup order (generation, chips,
  model, layers), then program order (XLA first), then simulator order."""
  best: dict = {}
  for path in _files(paths):
    with open(path, encoding="utf-8") as f:
      for line in f:
        if not line.strip():
          continue
        record = json.loads(line)
        if record.get("program") in (None, "summary") or "error" in record:
          continue
        key, label = _setup(record)
        program = _program(record)
        mesh = "x".join(map(str, _mesh(record)))
        for simulator, seconds in _figures(record).items():
          slot = (key, label, program, simulator)
          if slot not in best or seconds < best[slot].step_s:
            best[slot] = Bar(setup=label, program=program, simulator=simulator,
                             step_s=seconds, mesh=mesh)
  order = list(dict.fromkeys(PROGRAMS.values()))
  rank = lambda p: (order.index(p), p) if p in order else (len(order), p)
  slots = sorted(best, key=lambda s: (s[0], rank(s[2]), SIMULATORS.index(s[3])))
  return [best[s] for s in slots]


def panels(bars) -> dict:
  """{setup: {simulator: {program: step seconds}}}, in the bars' order."""
  out: dict = {}
  for bar in bars:
    out.setdefault(bar.setup, {}).setdefault(bar.simulator, {})[bar.program] = bar.step_s
  return out


def _pyplot():
  try:
    import matplotlib
  except ImportError:
    raise ImportError("bench/plot_results.py draws with matplotlib, which meshslice does "
                      "not depend on: pip install matplotlib") from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot(bars, png: str) -> None:
  """Draw `bars` (`load`) as one panel per setup, grouped bars per simulator model,
  and save the figure as a PNG at `png`."""
  plt = _pyplot()
  by_setup = panels(bars)
  if not by_setup:
    raise ValueError("no results to plot (no program records with a step time)")
  programs = list(dict.fromkeys(b.program for b in bars))
  colors = {p: plt.get_cmap("tab10")(k % 10) for k, p in enumerate(programs)}
  cols = min(len(by_setup), 3)
  rows = math.ceil(len(by_setup) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
  width = 0.8 / len(programs)
  for ax, (setup, by_simulator) in zip(axes.flat, by_setup.items()):
    for g, (simulator, steps) in enumerate(by_simulator.items()):
      xla = steps.get(PROGRAMS["xla"])
      for k, program in enumerate(programs):
        if program not in steps:
          continue
        ms = steps[program] * 1e3
        x = g + (k - (len(programs) - 1) / 2) * width
        ax.bar(x, ms, width, color=colors[program],
               label=program if g == 0 else None)
        # XLA / program over each meshslice bar (> 1: faster than XLA's best)
        text = f"{xla / steps[program]:.2f}x" if xla and program != PROGRAMS["xla"] else ""
        ax.annotate(f"{ms:.4g}" + (f"\n{text}" if text else ""), (x, ms),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(by_simulator)))
    ax.set_xticklabels([s if s != "libtpu-lhs" else "libtpu-lhs\n(nominal)"
                        for s in by_simulator])
    ax.set_title(setup, fontsize=10)
    ax.set_ylabel("step ms")
    ax.margins(y=0.15)
  for ax in list(axes.flat)[len(by_setup):]:
    ax.axis("off")
  handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in programs]
  fig.suptitle("Simulated step time: XLA's best program vs meshslice's plans "
               "(ratio: XLA / program)", fontsize=11)
  # the title above the top row's panel titles, not across them
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (4.2 * rows)))
  fig.legend(handles, programs, loc="upper center", bbox_to_anchor=(0.5, 0),
             ncol=len(programs), frameon=False)
  fig.savefig(png, dpi=120, bbox_inches="tight")
  plt.close(fig)


def main(argv):
  paths = argv[1:]
  if not _PNG.value or not paths:
    raise app.UsageError("usage: plot_results.py --png=OUT.png RESULTS [RESULTS ...] "
                         "(JSON-lines files or --out_dir folders of bench/tpu_models.py "
                         "and bench/tpu_whole_step.py)")
  bars = load(paths)
  try:
    plot(bars, _PNG.value)
  except (ImportError, ValueError) as e:
    print(f"plot_results: {e}", file=sys.stderr)
    return 1
  print(f"{_PNG.value}: {len(panels(bars))} setup(s), {len(bars)} bars")
  return 0


if __name__ == "__main__":
  app.run(main)
