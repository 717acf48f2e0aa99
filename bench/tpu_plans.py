"""Plans of one model layer pinned site by site, compiled for a TPU topology and read
under the alpha-beta and routed-links models: which per-site choice a gain comes from.

Each --plan is "name=JSON": the name of a row and the `meshslice.transform` options of
that plan as a JSON object, whose "overrides" may pin sites by index (JSON keys are
strings: "7" pins site 7, as `explain` numbers them). "name=" alone is XLA's own program
(plain jit). All plans compile in one process under one libtpu flag set (default
`dense,async,all_to_all`), so their ratios are fair; `--list` prints the sites first, by
index, as the default plan decides them.

  python bench/tpu_plans.py --model=gpt3 --topology=v4:8x8x4 --mesh=64x4 \\
      --plan="xla=" --plan="default={}" \\
      --plan='coll={"algorithm": "collective", "reduce_scatter": "all_to_all"}' \\
      --plan='ls2={"algorithm": "collective", "reduce_scatter": "all_to_all",
               "overrides": {"7": {"algorithm": "meshslice", "ksplit": 2, "dataflow": "ls"}}}'

(~1.5-2.5 min a plan for GPT-3's layer at 256 chips on 2 cores.) It prints one line a
plan (alpha-beta and routed step, exposed time, compute, libtpu peak, the plan's
decisions counted, and XLA / plan under each model when an "xla" row is among them) and
writes one JSON line a plan to --out (with jax / libtpu versions, flags and the command).
docs/benchmarks.md, "Where the tuned plan's gain comes from", was measured this way.
"""
import json
import os
import sys
import time
from importlib.metadata import version

from absl import app, flags

import tpu_models

# --model, --topology, --mesh, --seq and --flags are tpu_models' (defined when it is
# imported): one layer step, read by its `read`, as there
_MODEL, _TOPOLOGY, _MESH, _SEQ, _FLAGS = (tpu_models._MODEL, tpu_models._TOPOLOGY,
                                          tpu_models._MESH, tpu_models._SEQ,
                                          tpu_models._FLAGS)
_PLANS = flags.DEFINE_multi_string("plan", [], "name=JSON transform options (name= alone: "
                                   "XLA's program); repeat")
_LIST = flags.DEFINE_bool("list", False, "print the default plan's sites by index first")
_OUT = flags.DEFINE_string("out", "", "write one JSON line a plan here")


def parse_plan(text: str) -> tuple:
  """(name, options or None for XLA's program) of one --plan; overrides' digit keys
  become site indices.

  Example:
    >>> parse_plan('s7={"overrides": {"7": {"ksplit": 2}}}')
    ('s7', {'overrides': {7: {'ksplit': 2}}})
    >>> parse_plan("xla=")
    ('xla', None)
  """
  name, sep, body = text.partition("=")
  if not sep or not name.strip():
    raise app.UsageError(f"--plan {text!r} is not name=JSON (name= alone: XLA's program)")
  if not body.strip():
    return name.strip(), None
  from meshslice.options import options_from_json
  try:
    return name.strip(), options_from_json(body, f"--plan {name.strip()!r}")
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  plans = [parse_plan(p) for p in _PLANS.value]
  if not plans:
    raise app.UsageError("give at least one --plan")
  from meshslice import aot
  generation, _ = aot.parse_topology(_TOPOLOGY.value)
  shape = tuple(int(v) for v in _MESH.value.split("x"))
  aot.set_flags(*aot.preset_flags(_FLAGS.value, generation.name))
  from meshslice.costmodel import tpu_schedule
  os.environ.update(tpu_schedule.SCHEDULER_LOG_ENV)
  import jax
  jax.config.update("jax_platforms", "cpu")
  import meshslice
  mesh = aot.make_mesh(_TOPOLOGY.value, shape)
  model, seq = tpu_models.model_of(_MODEL.value, _SEQ.value)
  step, params, data = aot.model_step(model, mesh, seq=seq)
  profile = generation.profile
  if _LIST.value:
    with jax.set_mesh(mesh):
      report = meshslice.transform(step, profile=profile).explain(params, data)
    for s in report.sites:
      plan = (f"{s.algorithm} {s.dataflow} S={s.ksplit}" if s.rewritten else "left alone")
      print(f"#{s.index:<3} {s.direction:<8} {s.module or s.source:<24} "
            f"{s.lhs_shape}x{s.rhs_shape}  {plan}")
  common = {"model": _MODEL.value, "topology": _TOPOLOGY.value, "mesh": _MESH.value,
            "flag_presets": _FLAGS.value, "libtpu_flags": os.environ["LIBTPU_INIT_ARGS"],
            "jax": jax.__version__, "libtpu": version("libtpu"),
            "command": " ".join([sys.executable] + sys.argv)}
  rows = {}
  out = open(_OUT.value, "w") if _OUT.value else None
  try:
    for name, options in plans:
      fn = step if options is None else meshslice.transform(step, profile=profile,
                                                            **options)
      counts = "plain jit"
      if options is not None:
        with jax.set_mesh(mesh):
          counts = dict(fn.explain(params, data).plan_counts(reduce_scatter=True)) or (
              "every site left to XLA")
      began = time.perf_counter()
      with tpu_schedule.capture_stderr() as log:
        compiled, seconds = aot.compile(fn, params, data, mesh=mesh)
      figures = tpu_models.read(compiled, seconds, log.text, mesh, shape, profile)
      del compiled
      rows[name] = figures
      ab, rt = figures["alpha-beta"], figures["routed-links"]
      xla = rows.get("xla")
      ratio = "" if xla is None or name == "xla" else (
          f"  XLA / plan {xla['alpha-beta']['step_s'] / ab['step_s']:.3f}x / "
          f"{xla['routed-links']['step_s'] / rt['step_s']:.3f}x")
      print(f"{name}: alpha-beta {ab['step_s'] * 1e3:.2f} ms (exposed "
            f"{ab['exposed_s'] * 1e3:.2f}), routed {rt['step_s'] * 1e3:.2f} ms (exposed "
            f"{rt['exposed_s'] * 1e3:.2f}), compute {ab['compute_s'] * 1e3:.2f} ms, peak "
            f"{figures['libtpu_peak_bytes'] / 2**30:.2f} GiB [{time.perf_counter() - began:.0f}"
            f" s]{ratio}; {counts}", flush=True)
      if out is not None:
        out.write(json.dumps({**common, "plan": name, "options": options, "counts": counts,
                              **figures}, default=str) + "\n")
        out.flush()
  finally:
    if out is not None:
      out.close()


if __name__ == "__main__":
  app.run(main)
