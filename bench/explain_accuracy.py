"""How near `explain`'s prediction comes to the compiled program (issue "the report tells
the truth about the step"): what the per-site model predicts for the sites it priced
against XLA's own program, beside the ratio the compiled programs' simulations give.
Used by bench/tpu_models.py and bench/tpu_whole_step.py (run as scripts, so this module
is importable from their folder); no flags of its own.

`overlap` prints the split a step-level prediction has to get right: how much of a
program's collective time is synchronous (all exposed) and how much of the asynchronous
part the compute scheduled under it left exposed."""


def predicted_by_explain(report) -> dict:
  """What `explain` predicts: XLA's own program and the plan for the sites it priced
  against XLA (`Report.xla_sites_seconds` / `plan_sites_seconds`), per step."""
  return {"sites_compared": len(report.compared), "xla_sites_s": report.xla_sites_seconds,
          "plan_sites_s": report.plan_sites_seconds}


def versus_compiled(xla: dict, plan: dict, models) -> str:
  """explain's predicted ratio beside the compiled programs' simulated ones: the sites'
  own ratio, and the step's when the predicted saving is taken off XLA's simulated step
  (what a step-level prediction from the per-site model would say), per model."""
  e = plan["explain"]
  saving = e["xla_sites_s"] - e["plan_sites_s"]
  sites = e["xla_sites_s"] / e["plan_sites_s"] if e["plan_sites_s"] else 1.0
  lines = [f"explain: {e['sites_compared']} sites priced against XLA, predicted "
           f"{e['plan_sites_s'] * 1e3:.2f} vs {e['xla_sites_s'] * 1e3:.2f} ms "
           f"({sites:.3f}x for those sites; saving {saving * 1e3:.2f} ms a step)"]
  for model in models:
    x, p = xla[model]["step_s"], plan[model]["step_s"]
    step = x / (x - saving) if x > saving else float("inf")
    lines.append(f"  {model}: compiled {x / p:.3f}x, predicted {step:.3f}x (XLA's step less "
                 f"the saving): error {(step / (x / p) - 1) * 100:+.1f}%")
  return "\n".join(lines)


def overlap(figures: dict) -> str:
  """One simulation record (`Simulation.figures()`) as its sync / async split: sync
  collective time and what the chip waited in them (their link's queue included), async
  collective time and the share of it exposed.

  >>> print(overlap({"sync_collective_s": 0.04, "sync_exposed_s": 0.045,
  ...                "async_collective_s": 0.2, "async_exposed_s": 0.03}))
  sync 40.00 ms (waited 45.00), async 200.00 ms of which 30.00 exposed (15.0 %)
  """
  sync, a = figures["sync_collective_s"], figures["async_collective_s"]
  a_exposed = figures["async_exposed_s"]
  share = f"{a_exposed / a * 100:.1f} %" if a else "-"
  return (f"sync {sync * 1e3:.2f} ms (waited {figures['sync_exposed_s'] * 1e3:.2f}), "
          f"async {a * 1e3:.2f} ms of which {a_exposed * 1e3:.2f} exposed ({share})")
