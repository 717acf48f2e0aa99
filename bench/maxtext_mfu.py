"""Anchor the TPU simulator in real hardware: MaxText's published v5p and v4 MFU, simulated.

MaxText publishes the MFU it measured on v5p for the dense configs it ships
(`configs/v5p/README.md`, added in MaxText commit 76bd53b0f, 2023-12-15; the same figures
are in today's `src/maxtext/configs/tpu/v5p/README.md`). Those are the only real-TPU
step times we have for 2D-sharded (fsdp x tensor) transformer training, so this script
compiles each of those configs ahead of time, as published, and puts the simulated MFU
beside the measured one. MaxText's v4 table (README of 2023-04-27, today in
`configs/v4/README.md`) gives two more rows (`PUBLISHED_V4`: 22B on v4-128, 52B on
v4-384, pure fsdp, as that commit ran them): one mesh axis, nothing for the pass, but
the only real-hardware check of the v4 simulation, where the project's headline
figures are.

- the model of that commit's `base.yml` scaled by `global_parameter_scale` (its
  `get_individual_scales` rule: head count and MLP width, then embedding, then layers,
  doubled in turn from 2560 emb / 8 heads of 256 / 8192 MLP / 16 layers, ReLU MLP,
  vocabulary 32768, logits through the embedding) as today's MaxText builds it
  (`decoder_block=default`);
- each script's per-device batch, remat policy, tensor parallelism (fsdp the rest),
  sequence 2048, flash attention, and its `LIBTPU_INIT_ARGS` (the six scripts of that
  commit set the same flags);
- compiled with MaxText's own train_compile pieces (`examples/maxtext_train.py`) for the
  named topology (v5p-N: N TensorCores, N/2 chips, one device per chip).

Besides those nine, `CONFIGS` holds configs MaxText publishes no MFU for, run the same
way to see what the pass does with them (no residual is computed): a MaxText model by
its `model_name` (e.g. llama2-70b) on another generation, with fsdp x tensor sharding.
Those need `--preset` (this script knows MaxText's flags for its published rows only).

The scanned decoder is compiled with `--layers` layers: every `while` of the program that
runs that many trips (the forward and backward scans) is given the config's layer count
in the simulation (`with_trip_count`), so the program simulated is the full model's.

Each program is read under every model the project has (`bench/tpu_models.py`):

  alpha-beta    `tpu_schedule.simulate` with the mesh's profile (`aot.analyze`)
  routed-links  `routed_links.simulate_routed` on the devices' torus coordinates
  libtpu-lhs    libtpu's latency-hiding scheduler total (entry + loop bodies x trips,
                loop trips restored as above); nominal seconds = cycles / clock

MFU as MaxText computed it when it published (train.py at 76bd53b0f): per device and step,
6 x parameters x tokens + 6 x heads x layers x head_dim x seq^2 x batch (causal
attention: half of 12), over step time x the chip's bf16 peak (`PEAK_FLOPS`: v5p 459,
v4 275 TFLOP/s); the v4 rows' commit counted the parameters' term alone.

Runs in MaxText's virtual environment (docs/maxtext.md), one process per row (libtpu reads
its flags once per process); the compiled HLO, the scheduler's log and the devices'
coordinates are kept in --out_dir, so `--analyze` re-simulates without compiling:

  .venv-maxtext/bin/python bench/maxtext_mfu.py --rows=32b --out_dir=/tmp/mfu
  python bench/maxtext_mfu.py --analyze --out_dir=/tmp/mfu        # any venv with meshslice
"""
import dataclasses
import glob
import gzip
import json
import math
import os
import subprocess
import sys
import time

from absl import app, flags

_ROWS = flags.DEFINE_list("rows", [], "rows to compile (default: the nine published "
                         "ones); PUBLISHED, PUBLISHED_V4 and CONFIGS below")
_LAYERS = flags.DEFINE_integer("layers", 3, "decoder layers compiled (trips restored)")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/maxtext_mfu", "where programs and JSON go")
_ANALYZE = flags.DEFINE_bool("analyze", False, "re-simulate saved programs; compile none")
_WORKER = flags.DEFINE_string("worker", "", "internal: compile this one row here")
_DENSE = flags.DEFINE_bool("dense", False, "also turn XLA's windowed einsum off (the "
                           "programs are saved as <row>_dense)")
_PRESET = flags.DEFINE_string("preset", "", "compile under these meshslice flag presets for "
                              "the row's generation instead of MaxText's 2023 flags, "
                              "e.g. 'dense,async' "
                              "(`aot.preset_flags`; programs saved as <row>_<preset>...)")
_MESHSLICE = flags.DEFINE_bool("meshslice", False, "compile meshslice.transform(step), the "
                               "default plan, instead of MaxText's step (<row>[_dense]"
                               "_meshslice)")
_OPTIONS = flags.DEFINE_string("options", "", "with --meshslice: JSON of meshslice.transform "
                               "options instead of the default plan's, e.g. "
                               "'{\"algorithm\": \"collective\"}'; needs --label")
_LABEL = flags.DEFINE_string("label", "", "with --options: the program is saved as "
                             "<row>..._meshslice-<label>")

# bf16 per chip, the figure MaxText's MFU divides by
PEAK_FLOPS = {"tpu-v5p": 459e12, "tpu-v4": 275e12}

# The LIBTPU_INIT_ARGS of MaxText's v5p scripts at 76bd53b0f (the same in all six).
FLAGS_2023 = ("--xla_tpu_megacore_fusion_allow_ags=false "
              "--xla_enable_async_collective_permute=true "
              "--xla_tpu_enable_ag_backward_pipelining=true "
              "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
              "--xla_tpu_data_parallel_opt_different_sized_ops=true "
              "--xla_tpu_enable_async_collective_fusion=true "
              "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
              "--xla_tpu_overlap_compute_collective_tc=true "
              "--xla_enable_async_all_gather=true")


@dataclasses.dataclass(frozen=True)
class Published:
  """One row of MaxText's v5p table and the settings of the script that produced it, or
  (mfu None) a config of `CONFIGS` that MaxText publishes no MFU for."""
  name: str
  topology: str              # MaxText's compile_topology (v4-N / v5p-N: N TensorCores)
  scale: int                 # global_parameter_scale (0: `model` names the model)
  per_device_batch: int
  tensor: int                # ici_tensor_parallelism (fsdp takes the rest)
  remat: str
  mfu: float | None          # published, percent
  tflops: float | None       # published TFLOP/s per chip
  generation: str = "v5p"
  model: str = ""            # MaxText's model_name, when scale is 0
  seq: int = 2048
  # the script's LIBTPU_INIT_ARGS; None: MaxText publishes none for this row (CONFIGS)
  maxtext_flags: str | None = None
  # the script's explicit base.yml dims (emb, heads, MLP, layers), when scale is 0 and no
  # model is named (2023 base.yml otherwise: head dim 256, ReLU, tied 32768 vocabulary)
  base_dims: tuple = ()
  attention: str = "flash"   # MaxText's attention kernel
  attention_flops: bool = True   # whether the published TFLOP/s counted attention

  @property
  def chips(self) -> int:
    return int(self.topology.split("-")[1]) // 2

  @property
  def profile(self) -> str:
    return f"tpu-{self.generation}"


PUBLISHED = tuple(Published(*fields, maxtext_flags=FLAGS_2023) for fields in (
    ("32b", "v5p-128", 32, 8, 4, "minimal", 71.47, 328),
    ("64b", "v5p-128", 64, 4, 4, "minimal", 70.31, 323),
    ("128b", "v5p-256", 128, 2, 8, "minimal", 68.68, 315),
    ("256b", "v5p-1024", 256, 2, 8, "minimal", 67.09, 308),
    ("512b", "v5p-1024", 512, 2, 16, "full", 63.99, 294),
    ("1024b-2048", "v5p-2048", 1024, 2, 16, "full", 55.35, 254),
    ("1024b-4096", "v5p-4096", 1024, 2, 16, "full", 64.80, 297),
))
# The single-slice v4 rows MaxText published on 2023-04-27 (README commit 281e04bf3, the
# table later moved to configs/v4/README.md unchanged), as that commit's 1xv4-128.sh and
# 1xv4-384.sh ran them: fsdp over every chip (tensor 1), full remat, per-device batch 16
# and 10, and that commit's base.yml (sequence 1024, head dim 256, ReLU, tied 32768
# vocabulary; `scale` times its 2048 emb / 8 heads / 8192 MLP / 16 layers, the 52B
# script with its own bases). MaxText had no flash attention then, and its train.py
# counted 6 x parameters x tokens only (no attention FLOPs) in the TFLOP/s it printed.
FLAGS_V4_2023 = "--xla_enable_async_all_gather=true TPU_MEGACORE=MEGACORE_DENSE"
PUBLISHED_V4 = tuple(
    Published(name, topology, 0, batch, 1, "full", mfu, tflops, generation="v4",
              seq=1024, maxtext_flags=FLAGS_V4_2023, base_dims=base_dims,
              attention="dot_product", attention_flops=False)
    for name, topology, batch, mfu, tflops, base_dims in (
        ("22b-v4", "v4-128", 16, 56.7, 156, (6144, 24, 24576, 48)),
        ("52b-v4", "v4-384", 10, 56.0, 154, (12288, 32, 49152, 32)),
    ))
# MaxText configs without a published MFU: what the pass does on them (docs/benchmarks.md,
# "MaxText configs on v4"). Llama2-70B as MaxText's llama2_70b_4096 recipe runs it
# (sequence 4096, batch 4 per device, full remat) but with tensor parallelism 4 beside
# fsdp: that recipe is pure fsdp, one mesh axis, where a 2D pass has nothing to do.
CONFIGS = (
    Published("llama2-70b-v4", "v4-512", 0, 4, 4, "full", None, None, generation="v4",
              model="llama2-70b", seq=4096),
    # the same at half the batch: the sequences per chip of the project's own Llama step
    Published("llama2-70b-v4-b2", "v4-512", 0, 2, 4, "full", None, None, generation="v4",
              model="llama2-70b", seq=4096),
    # and on 256 v5p chips, where the per-site model plans (no step template there)
    Published("llama2-70b-v5p", "v5p-512", 0, 4, 4, "full", None, None, generation="v5p",
              model="llama2-70b", seq=4096),
    # Llama3.1-70B (128256-token vocabulary) at its 8192 context, 2 sequences per device
    Published("llama3.1-70b-v4", "v4-512", 0, 2, 4, "full", None, None, generation="v4",
              model="llama3.1-70b", seq=8192),
)
BY_NAME = {r.name: r for r in PUBLISHED + PUBLISHED_V4 + CONFIGS}
SEQ = 2048
VOCAB = 32768

# The MaxText models CONFIGS names, as MaxText's configs/models/<name>.yml define them.
MODELS = {
    "llama2-70b": {"emb": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128, "mlp": 28672,
                   "layers": 80, "vocab": 32000, "gated": True, "tied": False},
    "llama3.1-70b": {"emb": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128, "mlp": 28672,
                     "layers": 80, "vocab": 128256, "gated": True, "tied": False},
}


def dims(scale: int) -> dict:
  """Model dims of MaxText's 2023 base.yml at a global_parameter_scale (its rule)."""
  log2 = int(math.log2(scale))
  base, rem = divmod(log2, 3)
  heads_scale = base + int(rem > 0)
  emb_scale = base + int(rem > 1)
  return {"emb": 2560 * 2**emb_scale, "heads": 8 * 2**heads_scale, "head_dim": 256,
          "mlp": 8192 * 2**heads_scale, "layers": 16 * 2**base}


def model_dims(row: Published) -> dict:
  """The row's model: `dims` of its scale or the script's explicit `base_dims` (the 2023
  model: key / value heads as many as query heads, ReLU MLP, tied embedding) or, for a
  named model, `MODELS`'."""
  if row.model:
    return MODELS[row.model]
  if row.base_dims:
    emb, heads, mlp, layers = row.base_dims
    return {"emb": emb, "heads": heads, "head_dim": 256, "mlp": mlp, "layers": layers}
  return dims(row.scale)


def params(d: dict) -> int:
  """Parameters as MaxText counts them (two norms per layer, final norm; the 2023 model's
  embedding is tied, a gated MLP has three matrices)."""
  heads, kv_heads = d["heads"], d.get("kv_heads", d["heads"])
  attention = 2 * d["emb"] * d["head_dim"] * (heads + kv_heads)
  mlp = (3 if d.get("gated") else 2) * d["emb"] * d["mlp"]
  embedding = d.get("vocab", VOCAB) * d["emb"] * (1 if d.get("tied", True) else 2)
  return embedding + d["layers"] * (attention + mlp + 2 * d["emb"]) + d["emb"]


def flops_per_device(row: Published) -> float:
  """MaxText's training FLOPs per device per step at 76bd53b0f (train.py); at the v4
  rows' commit, the weights' term alone."""
  d = model_dims(row)
  tokens = row.seq * row.per_device_batch
  weights = 6 * params(d) * tokens
  if not row.attention_flops:
    return weights
  attention = (12 * d["heads"] * d["layers"] * d["head_dim"] * row.seq**2
               * row.per_device_batch)
  return weights + attention / 2


def overrides(row: Published, layers: int) -> dict:
  if row.model:
    model = {"model_name": row.model, "override_model_config": "True",
             "base_num_decoder_layers": layers}
  else:
    d = model_dims(row)
    model = {
        "decoder_block": "default", "global_parameter_scale": "1",
        "base_emb_dim": d["emb"], "base_num_query_heads": d["heads"],
        "base_num_kv_heads": d["heads"], "head_dim": d["head_dim"], "base_mlp_dim": d["mlp"],
        "base_num_decoder_layers": layers, "mlp_activations": "['relu']",
        "vocab_size": VOCAB, "logits_via_embedding": "True"}
  return {
      **model,
      "per_device_batch_size": row.per_device_batch, "remat_policy": row.remat,
      "ici_fsdp_parallelism": "-1", "ici_tensor_parallelism": row.tensor,
      "max_target_length": row.seq, "use_iota_embed": "True", "attention": row.attention,
      "dataset_type": "synthetic", "steps": "1", "tokenizer_path": "",
      "enable_checkpointing": "False", "skip_jax_distributed_system": "True",
      "enable_goodput_recording": "False", "jax_cache_dir": "",
      "compile_topology": row.topology, "compile_topology_num_slices": "1",
      # tensor=16 on v5p-1024 (8x8x8) spans two physical axes; today's MaxText asks
      # for that in so many words (the 2023 one did not check)
      **({"allow_split_physical_axes": "True"} if row.name == "512b" else {}),
  }


def program_name(row: str, dense: bool, plan: bool, preset: str = "", label: str = "") -> str:
  return (row + (f"_{preset.replace(',', '-')}" if preset else "")
          + ("_dense" if dense else "") + ("_meshslice" if plan else "")
          + (f"-{label}" if plan and label else ""))


def compile_row(row: Published, layers: int, out_dir: str, dense: bool = False,
                plan: bool = False, preset: str = "", transform_options: dict | None = None,
                label: str = "") -> None:
  """Compile one row in this process (flags set before libtpu loads) and save it: MaxText's
  step, or (plan) `meshslice.transform` of it with the default plan, or with
  `transform_options`."""
  from meshslice.backend_flags import DENSE_FLAGS, preset_flags
  from meshslice.costmodel import tpu_schedule
  base = " ".join(preset_flags(preset, row.generation)) if preset else row.maxtext_flags
  os.environ["LIBTPU_INIT_ARGS"] = " ".join((base,) + (DENSE_FLAGS if dense else ()))
  os.environ.update(tpu_schedule.SCHEDULER_LOG_ENV)    # libtpu's scheduler totals
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path.insert(0, os.path.join(os.path.dirname(here), "examples"))
  import maxtext_train                   # sets MaxText's RNG flag, CPU host, unsafe_rbg
  import jax
  from flax.linen import partitioning as nn_partitioning
  config = maxtext_train.maxtext_config(
      None, [f"{k}={v}" for k, v in overrides(row, layers).items()], tiny=False)
  step, args, kwargs, mesh, options = maxtext_train.maxtext_aot_step(config)
  summary, counts = "", {}
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    if plan:
      import meshslice
      step = meshslice.transform(step, profile=row.profile, **(transform_options or {}))
      report = step.explain(*args, **kwargs)
      summary, counts = report.summary(), dict(report.plan_counts())
      print(f"{row.name}: {summary}", flush=True)
    start = time.perf_counter()
    with tpu_schedule.capture_stderr() as log:
      compiled = step.lower(*args, **kwargs).compile(compiler_options=options)
  seconds = time.perf_counter() - start
  stem = os.path.join(out_dir, program_name(row.name, dense, plan, preset, label))
  with gzip.open(stem + ".hlo.gz", "wt") as f:
    f.write(compiled.as_text())
  with open(stem + ".lhs.log", "w") as f:
    f.write("\n".join(l for l in log.text.splitlines() if "latency_hiding_scheduler" in l))
  mem = compiled.memory_analysis()
  from importlib.metadata import version
  meta = {"row": dataclasses.asdict(row), "compiled_layers": layers,
          "layers": model_dims(row)["layers"],
          "mesh": {k: int(v) for k, v in mesh.shape.items() if v > 1},
          "devices": [[list(map(int, d.coords)), int(getattr(d, "core_on_chip", 0) or 0)]
                      for d in mesh.devices.flat],
          "compile_s": seconds, "jax": jax.__version__, "libtpu": version("libtpu"),
          "maxtext": version("maxtext"), "libtpu_flags": os.environ["LIBTPU_INIT_ARGS"],
          "overrides": {k: str(v) for k, v in overrides(row, layers).items()},
          "libtpu_peak_bytes": int(getattr(mem, "peak_memory_in_bytes", 0) or 0),
          "plan": summary, "plan_counts": counts, "options": transform_options or {},
          "command": " ".join([sys.executable] + sys.argv)}
  with open(stem + ".meta.json", "w") as f:
    json.dump(meta, f)
  print(f"{row.name}: compiled in {seconds:.0f} s", flush=True)


def with_trip_count(schedule, compiled_layers: int, layers: int):
  """The schedule with every loop of `compiled_layers` trips run `layers` times."""
  from meshslice.costmodel import tpu_schedule

  def fix(entries):
    out = []
    for e in entries:
      if isinstance(e, tpu_schedule.Loop):
        body = tuple(fix(e.body))
        trips = layers if e.trip_count == compiled_layers else e.trip_count
        e = dataclasses.replace(e, body=body, trip_count=trips)
      out.append(e)
    return out
  restored = dataclasses.replace(schedule, entries=tuple(fix(schedule.entries)))
  found = sum(1 for e in schedule.entries if isinstance(e, tpu_schedule.Loop)
              and e.trip_count == compiled_layers)
  return restored, found


def analyze_row(name: str, out_dir: str) -> dict:
  """Every model's step and MFU for one saved program."""
  from meshslice.costmodel import profile_for_mesh, routed_links, tpu_schedule
  from meshslice.costmodel.profiles import load_profile
  stem = os.path.join(out_dir, name)
  with open(stem + ".meta.json") as f:
    meta = json.load(f)
  row = Published(**meta["row"])
  with gzip.open(stem + ".hlo.gz", "rt") as f:
    text = f.read()
  profile = row.profile
  base = load_profile(profile)
  # (fsdp, tensor); a one-axis mesh as (1, fsdp) (`link_mesh_shape`: the v4 rows)
  shape = tpu_schedule.link_mesh_shape((meta["mesh"].get("fsdp", 1),
                                        meta["mesh"].get("tensor", 1)))
  schedule, loops = with_trip_count(tpu_schedule.read_schedule(text, chip=profile),
                                    meta["compiled_layers"], meta["layers"])
  if loops == 0:
    raise RuntimeError(f"{name}: no loop of {meta['compiled_layers']} trips in the program")
  devices = [(tuple(c), core) for c, core in meta["devices"]]
  ab = tpu_schedule.simulate(schedule, profile_for_mesh(base, shape),
                             axis_dims=tpu_schedule.axis_torus_dims(base, shape),
                             clock_hz=tpu_schedule.CLOCK_HZ[profile])
  rt = routed_links.simulate_routed(schedule, devices, profile)
  flops = flops_per_device(row)
  peak = PEAK_FLOPS[profile]
  figures = {}
  for sim in (ab, rt):
    figures[sim.model] = {"step_s": sim.step_s, "compute_s": sim.compute_s,
                          "exposed_s": sim.exposed_s, "mfu": 100 * flops / sim.step_s / peak,
                          "exposed_by": [list(g) for g in sim.exposed_by(top=4)]}
  with open(stem + ".lhs.log") as f:
    log = f.read()
  lhs = _lhs_cycles(log, text, schedule)
  if lhs:
    step = lhs / tpu_schedule.CLOCK_HZ[profile]
    figures["libtpu-lhs"] = {"cycles": lhs, "step_s": step,
                             "mfu": 100 * flops / step / peak}
  measured_step = None if row.mfu is None else flops / (row.mfu / 100 * peak)
  return {"row": row.name, "program": name, "plan": meta.get("plan", ""),
          "plan_counts": meta.get("plan_counts", {}),
          "windowed_einsum": "windowed_einsum_for_all_gather=false" not in meta["libtpu_flags"],
          "topology": row.topology, "chips": row.chips,
          "mesh": meta["mesh"], "layers": meta["layers"],
          "compiled_layers": meta["compiled_layers"], "loops_restored": loops,
          "flops_per_device": flops, "published_mfu": row.mfu,
          "published_step_s": measured_step, "compute_mfu": 100 * flops / ab.compute_s / peak,
          "models": figures, "jax": meta["jax"], "libtpu": meta["libtpu"],
          "maxtext": meta["maxtext"], "compile_s": meta["compile_s"],
          "libtpu_peak_bytes": meta["libtpu_peak_bytes"]}


def _lhs_cycles(log: str, text: str, schedule) -> float | None:
  """libtpu's scheduler total for the entry plus loop bodies x (restored) trips."""
  import re
  from meshslice.costmodel import tpu_schedule
  totals = tpu_schedule.read_scheduler_log(log)
  entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
  record = tpu_schedule.scheduler_entry(totals, entry.group(1) if entry else None)
  if record is None:
    return None
  return record.cycles + tpu_schedule.scheduler_loop_cycles(totals, schedule)


def table(results: list) -> str:
  """Simulated MFU beside the published one. libtpu's scheduler total is shown as its
  nominal step (cycles / clock), not as an MFU: its units are not wall time."""
  lines = ["| program | chips | mesh fsdp x tensor | published MFU | alpha-beta | "
           "routed-links | compute only | residual alpha-beta / routed | libtpu LHS "
           "nominal step |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    m = r["models"]
    mesh = f"{r['mesh'].get('fsdp', 1)} x {r['mesh'].get('tensor', 1)}"
    lhs = m.get("libtpu-lhs")
    published = r["published_mfu"]
    residual = "—" if published is None else (
        f"{m['alpha-beta']['mfu'] - published:+.1f} / "
        f"{m['routed-links']['mfu'] - published:+.1f}")
    lines.append(
        f"| {r['program']} | {r['chips']} | {mesh} | "
        f"{'—' if published is None else format(published, '.2f') + ' %'} | "
        f"{m['alpha-beta']['mfu']:.1f} % | {m['routed-links']['mfu']:.1f} % | "
        f"{r['compute_mfu']:.1f} % | {residual} | "
        f"{'—' if lhs is None else format(lhs['step_s'], '.2f') + ' s'} |")
  return "\n".join(lines)


def comparison(results: list) -> str:
  """XLA's program against meshslice's default plan (and each --options variant of it,
  by its label), per row and flag set, each model."""
  lines = ["| config | windowed einsum | XLA step (alpha-beta / routed) | meshslice "
           "| XLA / meshslice (alpha-beta / routed) | least favourable |",
           "|---|---|---:|---:|---:|---:|"]
  for r in results:
    if "_meshslice" in r["program"]:
      continue
    for plan in (p for p in results if p["program"] == r["program"] + "_meshslice"
                 or p["program"].startswith(r["program"] + "_meshslice-")):
      label = plan["program"][len(r["program"]) + len("_meshslice-"):] or "default"
      lines.append(_comparison_row(r, plan, label))
  return "\n".join(lines)


def _comparison_row(r: dict, plan: dict, label: str) -> str:
  ratios = [r["models"][m]["step_s"] / plan["models"][m]["step_s"]
            for m in ("alpha-beta", "routed-links")]
  return (f"| {r['row']} ({label}) | {'on' if r['windowed_einsum'] else 'off'} | "
          f"{r['models']['alpha-beta']['step_s']:.3f} / "
          f"{r['models']['routed-links']['step_s']:.3f} s | "
          f"{plan['models']['alpha-beta']['step_s']:.3f} / "
          f"{plan['models']['routed-links']['step_s']:.3f} s | "
          f"{ratios[0]:.3f}x / {ratios[1]:.3f}x | **{min(ratios):.3f}x** |")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  rows = [_WORKER.value] if _WORKER.value else _ROWS.value
  unknown = [r for r in rows if r not in BY_NAME]
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; known: {', '.join(BY_NAME)}")
  # MaxText's flags are known for its published rows only; checked for a worker's row too
  unflagged = [r for r in rows if BY_NAME[r].maxtext_flags is None]
  if unflagged and not _PRESET.value and not _ANALYZE.value:
    raise app.UsageError(f"--rows: {', '.join(unflagged)} need --preset: MaxText "
                         "publishes no flags for their generation here (e.g. "
                         "--preset=dense,async,all_to_all)")
  if bool(_OPTIONS.value) != bool(_LABEL.value) or (_OPTIONS.value and not _MESHSLICE.value):
    raise app.UsageError("--options and --label go together, with --meshslice")
  from meshslice.options import options_from_json
  try:
    options = options_from_json(_OPTIONS.value, "--options") if _OPTIONS.value else None
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  if _WORKER.value:
    compile_row(BY_NAME[_WORKER.value], _LAYERS.value, _OUT_DIR.value, _DENSE.value,
                _MESHSLICE.value, _PRESET.value, options, _LABEL.value)
    return
  names = _ROWS.value or [r.name for r in PUBLISHED + PUBLISHED_V4]
  if not _ANALYZE.value:
    for name in names:
      began = time.perf_counter()
      done = subprocess.run([sys.executable, os.path.abspath(__file__), f"--worker={name}",
                             f"--layers={_LAYERS.value}", f"--out_dir={_OUT_DIR.value}"]
                            + (["--dense"] if _DENSE.value else [])
                            + (["--meshslice"] if _MESHSLICE.value else [])
                            + ([f"--preset={_PRESET.value}"] if _PRESET.value else [])
                            + ([f"--options={_OPTIONS.value}", f"--label={_LABEL.value}"]
                               if _OPTIONS.value else []))
      if done.returncode:
        print(f"{name}: compile failed (exit {done.returncode}) after "
              f"{time.perf_counter() - began:.0f} s", flush=True)
  results = []
  for name in names:
    if not glob.glob(os.path.join(glob.escape(_OUT_DIR.value), name + "*.meta.json")):
      print(f"{name}: no compiled program in {_OUT_DIR.value}")
    presets = ("", _PRESET.value) if _PRESET.value else ("",)
    for program in (program_name(name, d, p, f) for f in presets for d in (False, True)
                    for p in (False, True)):
      # the plan's program and every labelled variant of it (--options)
      variants = [program] + (sorted(
          os.path.basename(m)[:-len(".meta.json")] for m in glob.glob(
              os.path.join(glob.escape(_OUT_DIR.value), program + "-*.meta.json")))
          if program.endswith("_meshslice") else [])
      for name_ in variants:
        if os.path.exists(os.path.join(_OUT_DIR.value, name_ + ".meta.json")):
          results.append(analyze_row(name_, _OUT_DIR.value))
  with open(os.path.join(_OUT_DIR.value, "mfu.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(table(results))
  if any(r["program"].endswith("_meshslice") for r in results):
    print()
    print(comparison(results))
    for r in results:
      if r["plan"]:
        print(f"{r['program']}: {r['plan']}")


if __name__ == "__main__":
  app.run(main)
