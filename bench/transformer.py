"""A GPT-style training step as plain `jax.jit` and transformed by meshslice with each
algorithm: measured step time, predicted time, collective bytes and temp memory.

The step is `meshslice.gpt`'s (layernorm, attention, MLP, `lax.scan` over
`jax.checkpoint`-ed layers, MSE loss, SGD), 2D-sharded over mesh axes ("x", "y"):
activations [batch:x, seq, hidden:y], weights [in:x, out:y]. With --data > 1 a
data-parallel axis "data" goes in front and activations become
[batch:data, seq:x, hidden:y] (tokens still split over x, but one mesh axis per dim: the
pass leaves a dim split over ("data", "x") alone). Variants:

  jit          the user's step, partitioned by XLA (GSPMD / Shardy)
  <algorithm>  meshslice.transform(step, algorithm=...) for each --algorithms entry
               ("meshslice:4" also pins ksplit=4); a site an algorithm cannot serve falls
               back (the record lists the notes)
  default      meshslice.transform(step): the autotuned plan (cost model picks per site)

One JSON record per variant (--out, JSON lines):

  step_s                 median wall time of one step after --warmup steps (each step
                         blocked on with block_until_ready), plus mean and min
  predicted_step_s       the cost model's time of the rewritten matmuls in one step
                         (report.predicted_step_seconds): the sum over report.rewritten of
                         site.predicted_seconds, each site multiplied by how often it runs
                         (site.runs: a site inside the layer scan is listed once in the
                         report but runs once per layer). Only the
                         rewritten matmuls: attention score matmuls, elementwise work and
                         the optimizer are not modelled. For "jit" it is the same sum with
                         the collective algorithm (what GSPMD emits).
  predicted_sites_s      the plain sum, each listed site once (report.predicted_seconds)
  collective_bytes       bytes one device sends in collectives, read off the compiled HLO
                         (meshslice.hlo.collective_stats); like the report, it counts an
                         op inside the scan's while loop once, not once per layer
  temp_bytes             compiled.memory_analysis().temp_size_in_bytes (per device)
  loss                   loss of the first step (all variants start from the same params)

--trace_dir writes one profile per variant under <trace_dir>/<variant> ("meshslice:4" ->
"meshslice-S4").

  python bench/transformer.py                                   # 8 emulated CPU devices
  python bench/transformer.py --mesh 2x2 --data 2 --steps 20 --out /tmp/t.jsonl
  python bench/transformer.py --distributed --mesh 8x8 --hidden 12288 --heads 96 \\
      --seq 2048 --batch 64 --dtype bfloat16 --profile my-v4.json  # a TPU v4-128 slice
See docs/benchmarks-log.md for TPU pods and GPU clusters.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import cluster  # noqa: E402  (bench/cluster.py: shared flags)

_LAYERS = flags.DEFINE_integer("layers", 2, "transformer layers")
_HIDDEN = flags.DEFINE_integer("hidden", 128, "hidden size")
_HEADS = flags.DEFINE_integer("heads", 8, "attention heads")
_FFN = flags.DEFINE_integer("ffn", 0, "MLP inner size (0: 4 * hidden)")
_SEQ = flags.DEFINE_integer("seq", 32, "sequence length")
_BATCH = flags.DEFINE_integer("batch", 8, "global batch (sequences per step)")
_DTYPE = flags.DEFINE_string("dtype", "float32", "float32 or bfloat16")
_MESH = flags.DEFINE_string("mesh", "2x4", "tensor-parallel mesh shape RxC (axes x, y)")
_DATA = flags.DEFINE_integer("data", 1, "size of an extra data-parallel axis in front")
_PROFILE = flags.DEFINE_string(
    "profile", None, "hardware profile (name or JSON path) for planning and predictions; "
    "default: cpu on CPU, h100 on GPU, tpu-v4 otherwise")
_MAX_KSPLIT = flags.DEFINE_integer("max_ksplit", 4, "largest ksplit the cost model may pick")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps per variant")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed steps per variant (after compiling)")
_ALGORITHMS = flags.DEFINE_list(
    "algorithms", ["collective", "meshslice", "meshslice:2", "meshslice:4", "cannon", "wang",
                   "summa"],
    "variants to run: an algorithm from meshslice.rewrites.ALGORITHMS, optionally with a "
    "ksplit as name:S (otherwise the cost model picks S)")
_NO_DEFAULT = flags.DEFINE_bool("skip_default", False, "skip the autotuned-plan variant")
_OUT = flags.DEFINE_string("out", None, "write one JSON line per variant here")
_TRACE_DIR = flags.DEFINE_string(
    "trace_dir", None, "write a jax.profiler trace of two extra steps per variant here "
    "(TensorBoard / Perfetto); traced steps are not timed")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
  """The mesh, the user's jitted step and its sharded inputs."""

  cfg: object
  mesh: object
  step: object
  params: object
  batch: object


def build(cfg, shape, data=1) -> Setup:
  """The demo step on a (data, R, C) mesh ("data" only when data > 1).

  Example:
    >>> from meshslice.gpt import ModelConfig
    >>> s = build(ModelConfig(layers=1, hidden=32, heads=2, ffn=64, seq=8, batch=4),
    ...           (2, 2), data=2)                                    # doctest: +SKIP
    >>> dict(s.mesh.shape)                                           # doctest: +SKIP
    {'data': 2, 'x': 2, 'y': 2}
  """
  from meshslice import gpt
  if data == 1:
    mesh = gpt.make_mesh(shape)
    params, batch = gpt.place(cfg, mesh)
    return Setup(cfg=cfg, mesh=mesh, step=gpt.make_step(cfg, mesh), params=params,
                 batch=batch)
  n = data * shape[0] * shape[1]
  mesh = jax.make_mesh((data,) + tuple(shape), ("data", "x", "y"),
                       axis_types=(AxisType.Auto,) * 3, devices=jax.devices()[:n])
  # weights as in the demo; tokens split over data (batch) and x (sequence), since the
  # pass handles one mesh axis per matmul dim
  ps = jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.param_specs("x", "y"))
  bs = jax.tree.map(lambda s: NamedSharding(mesh, s),
                    {"x": P("data", "x", "y"), "y": P("data", "x", "y")})
  step = jax.jit(lambda p, b: gpt.train_step(cfg, p, b), in_shardings=(ps, bs),
                 out_shardings=(ps, NamedSharding(mesh, P())), donate_argnums=(0,))
  kp, kb = jax.random.split(jax.random.key(0))
  params = jax.tree.map(jax.device_put, gpt.init_params(cfg, kp), ps)
  batch = jax.tree.map(jax.device_put, gpt.init_batch(cfg, kb), bs)
  return Setup(cfg=cfg, mesh=mesh, step=step, params=params, batch=batch)


def measure(setup: Setup, fn, *, steps, warmup, trace_dir=None, label="") -> dict:
  """Compile figures and step times of `fn` (jitted or transformed) on fresh params."""
  from meshslice.hlo import collective_stats
  params = jax.tree.map(jnp.copy, setup.params)       # the step donates its params
  start = time.perf_counter()
  compiled = fn.lower(params, setup.batch).compile()
  compile_s = time.perf_counter() - start
  stats = collective_stats(compiled.as_text())
  memory = compiled.memory_analysis()
  params, loss = fn(params, setup.batch)
  first_loss = float(loss)
  for _ in range(warmup):
    params, loss = fn(params, setup.batch)
  jax.block_until_ready(params)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    params, loss = fn(params, setup.batch)
    jax.block_until_ready((params, loss))
    times.append(time.perf_counter() - start)
  if trace_dir:
    with jax.profiler.trace(os.path.join(trace_dir, label.replace(":", "-S"))):
      for _ in range(2):
        params, loss = fn(params, setup.batch)
      jax.block_until_ready((params, loss))
  return {"step_s": statistics.median(times), "step_s_mean": statistics.fmean(times),
          "step_s_min": min(times), "compile_s": compile_s,
          "collective_bytes": stats["total_bytes"],
          "collective_counts": {k: v for k, v in stats["count"].items() if v},
          "temp_bytes": int(memory.temp_size_in_bytes),
          "argument_bytes": int(memory.argument_size_in_bytes),
          "output_bytes": int(memory.output_size_in_bytes), "loss": first_loss}


def default_profile() -> str:
  platform = jax.devices()[0].platform
  return {"cpu": "cpu", "gpu": "h100", "cuda": "h100", "rocm": "h100"}.get(platform, "tpu-v4")


def parse_variant(text: str) -> dict:
  """"meshslice:4" -> {"algorithm": "meshslice", "ksplit": 4}; "wang" -> {"algorithm": "wang"}.

  Example:
    >>> parse_variant("meshslice:4"), parse_variant("summa")
    ({'algorithm': 'meshslice', 'ksplit': 4}, {'algorithm': 'summa'})
  """
  from meshslice.rewrites import ALGORITHMS
  name, _, ksplit = text.partition(":")
  if name not in ALGORITHMS or (ksplit and not ksplit.isdigit()):
    raise ValueError(f"variant {text!r}: expected one of {', '.join(ALGORITHMS)}, "
                     "optionally followed by :ksplit (e.g. meshslice:4)")
  return {"algorithm": name, **({"ksplit": int(ksplit)} if ksplit else {})}


def run(setup: Setup, *, algorithms, profile, max_ksplit=4, steps=10, warmup=2,
        include_default=True, trace_dir=None, echo=print) -> list[dict]:
  """One record per variant: "jit", each algorithm, then "default" (autotuned)."""
  import meshslice
  from meshslice.costmodel import load_profile
  profile_name = load_profile(profile).name
  device = jax.devices()[0]
  common = {"bench": "transformer", "config": dataclasses.asdict(setup.cfg),
            "mesh": {k: int(v) for k, v in setup.mesh.shape.items()},
            "devices": int(setup.mesh.size), "processes": jax.process_count(),
            "platform": device.platform,
            "device_kind": getattr(device, "device_kind", device.platform),
            "profile": profile_name, "steps": steps, "warmup": warmup,
            "jax": jax.__version__}
  variants = [("jit", None)] + [(a, parse_variant(a)) for a in algorithms]
  if include_default:
    variants.append(("default", {}))
  base_report = meshslice.explain(setup.step, profile=profile, max_ksplit=max_ksplit)(
      setup.params, setup.batch)
  records = []
  for label, options in variants:
    if options is None:
      fn, report = setup.step, base_report
      pred = float(report.baseline_step_seconds)
      extra = {"algorithm": None, "ksplit": None, "sites": len(report.sites), "rewritten": 0,
               "plans": {}, "predicted_sites_s": float(report.baseline_seconds), "notes": []}
    else:
      opts = dict(options, profile=profile, max_ksplit=max_ksplit)
      fn = meshslice.transform(setup.step, **opts)
      report = fn.explain(setup.params, setup.batch)
      pred = float(report.predicted_step_seconds)
      extra = {"algorithm": options.get("algorithm"), "ksplit": options.get("ksplit"),
               "sites": len(report.sites),
               "rewritten": len(report.rewritten), "plans": report.plan_counts(),
               "predicted_sites_s": float(report.predicted_seconds),
               "notes": sorted({s.note for s in report.rewritten if s.note})}
    figures = measure(setup, fn, steps=steps, warmup=warmup, trace_dir=trace_dir, label=label)
    record = {**common, "variant": label, **extra, "predicted_step_s": pred,
              "predicted_collective_step_s": float(report.baseline_step_seconds),
              **figures}
    records.append(record)
    if echo:
      echo(f"  {label:<11} step {record['step_s'] * 1e3:8.2f} ms  predicted "
           f"{pred * 1e3:8.3f} ms  bytes {record['collective_bytes'] / 1e6:8.3f} MB  "
           f"temp {record['temp_bytes'] / 1e6:8.3f} MB  {extra['plans'] or ''}")
  return records


def render(records) -> str:
  """Ratios of each variant to plain jax.jit."""
  base = records[0]
  lines = [f"{'variant':<12}{'step ms':>9}{'x jit':>7}{'pred ms':>9}{'bytes x':>9}"
           f"{'temp x':>8}  plans"]
  for r in records:
    ratio = lambda key: r[key] / base[key] if base[key] else float("nan")
    lines.append(f"{r['variant']:<12}{r['step_s'] * 1e3:>9.2f}{ratio('step_s'):>7.2f}"
                 f"{r['predicted_step_s'] * 1e3:>9.3f}{ratio('collective_bytes'):>9.2f}"
                 f"{ratio('temp_bytes'):>8.2f}  "
                 + ", ".join(f"{k} x{v}" for k, v in r["plans"].items()))
  from meshslice.costmodel.calibrate import spearman
  rho = spearman([r["step_s"] for r in records], [r["predicted_step_s"] for r in records])
  lines.append(f"spearman(measured, predicted) over the {len(records)} variants: {rho:.2f}")
  return "\n".join(lines)


def main(argv):
  del argv
  cluster.start()
  from meshslice.gpt import ModelConfig
  shape = tuple(int(v) for v in _MESH.value.lower().split("x"))
  cfg = ModelConfig(layers=_LAYERS.value, batch=_BATCH.value, seq=_SEQ.value,
                    hidden=_HIDDEN.value, heads=_HEADS.value,
                    ffn=_FFN.value or 4 * _HIDDEN.value, dtype=_DTYPE.value)
  setup = build(cfg, shape, _DATA.value)
  lead = jax.process_index() == 0
  profile = _PROFILE.value or default_profile()
  if lead:
    print(f"transformer step: {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}, "
          f"ffn {cfg.ffn}, batch {cfg.batch}x{cfg.seq}, {cfg.dtype}, mesh "
          f"{dict(setup.mesh.shape)}, profile {profile}")
  records = run(setup, algorithms=_ALGORITHMS.value, profile=profile,
                max_ksplit=_MAX_KSPLIT.value, steps=_STEPS.value, warmup=_WARMUP.value,
                include_default=not _NO_DEFAULT.value, trace_dir=_TRACE_DIR.value,
                echo=print if lead else None)
  if not lead:
    return
  print(render(records))
  if _OUT.value:
    cluster.write_jsonl(_OUT.value, records)


if __name__ == "__main__":
  app.run(main)
