"""Predicted scaling of the FF layers of GPT-3 and Megatron-NLG training (cost model only).

For each chip count, each algorithm runs at its own best mesh shape (and, for meshslice,
its best ksplit per GEMM); the table shows the predicted time of one training step's FF
GEMMs (forward + backward, times the model's layer count) and the gap to the
perfect-overlap bound (the best bound over all mesh shapes). Nothing is executed, so
this runs anywhere in a second or two.

  python bench/scaling.py                                  # tpu-v4, 16 ... 1024 chips
  python bench/scaling.py --profile=tpu-v5p --models=gpt3 --plot=/tmp/scaling.png
"""
from __future__ import annotations

from absl import app, flags

from meshslice.costmodel.autotune import recommend_mesh
from meshslice.costmodel.profiles import load_profile

ALGORITHMS = ("collective", "cannon", "wang", "summa", "meshslice")

_PROFILE = flags.DEFINE_string("profile", "tpu-v4", "hardware profile name or JSON path")
_MODELS = flags.DEFINE_list("models", ["gpt3", "megatron"], "models: gpt3, megatron")
_CHIPS = flags.DEFINE_list("chips", ["16", "32", "64", "128", "256", "512", "1024"],
                           "chip counts")
_MAX_KSPLIT = flags.DEFINE_integer("max_ksplit", 16, "largest ksplit meshslice may use")
_PLOT = flags.DEFINE_string("plot", None, "write a plot here (needs matplotlib)")


def scaling(model: str, chips_list, profile, max_ksplit: int) -> list[dict]:
  """One row per chip count: per algorithm (step seconds, mesh shape) or None, and the
  bound (step seconds)."""
  rows = []
  for chips in chips_list:
    row = {"chips": chips, "algorithms": {}}
    bound = None
    for algorithm in ALGORITHMS:
      try:
        # Time only: whether the whole model fits the chips' HBM is not this table's
        # question (recommend_mesh would exclude every shape of a model too big for them).
        rec = recommend_mesh(chips, model=model, profile=profile, algorithms=(algorithm,),
                             max_ksplit=max_ksplit, check_memory=False)
      except ValueError:
        row["algorithms"][algorithm] = None   # e.g. cannon without a square mesh
        continue
      layers = rec.model.layers
      row["algorithms"][algorithm] = (rec.best.cost.total_s * layers, rec.best_shape)
      shape_bounds = [r.bound.total_s * layers for r in rec.results if r.feasible]
      bound = min([bound] * (bound is not None) + shape_bounds)
    row["bound"] = bound
    rows.append(row)
  return rows


def render(model: str, rows) -> str:
  header = ["chips", "bound (s)"] + [f"{a} (s, shape, gap)" for a in ALGORITHMS]
  table = []
  for row in rows:
    cells = [str(row["chips"]), f"{row['bound']:.3f}"]
    for a in ALGORITHMS:
      v = row["algorithms"][a]
      cells.append("n/a" if v is None else
                   f"{v[0]:.3f} {v[1][0]}x{v[1][1]} +{(v[0] / row['bound'] - 1) * 100:.0f}%")
    table.append(cells)
  widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
  lines = [f"{model}: predicted FF-GEMM time per training step (forward + backward, all layers)"]
  lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header] + table]
  return "\n".join(lines)


def _plot(results, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"matplotlib is not installed; no plot written to {path}")
    return
  fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
  for ax, (model, rows) in zip(axes[0], results.items()):
    chips = [r["chips"] for r in rows]
    for a in ALGORITHMS:
      pts = [(c, r["algorithms"][a][0]) for c, r in zip(chips, rows) if r["algorithms"][a]]
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=a)
    ax.plot(chips, [r["bound"] for r in rows], "k--", label="perfect overlap")
    ax.set(xscale="log", yscale="log", xlabel="chips", ylabel="seconds per step (FF GEMMs)",
           title=model)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  print(f"plot written to {path}")


def main(argv):
  del argv
  profile = load_profile(_PROFILE.value)
  chips_list = [int(c) for c in _CHIPS.value]
  print(f"profile {profile.name}; batch = one 2048-token sequence per chip; "
        f"each algorithm at its own best mesh shape\n")
  results = {}
  for model in _MODELS.value:
    results[model] = scaling(model, chips_list, profile, _MAX_KSPLIT.value)
    print(render(model, results[model]) + "\n")
  if _PLOT.value:
    _plot(results, _PLOT.value)


if __name__ == "__main__":
  app.run(main)
