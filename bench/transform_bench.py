"""Pass overhead and cost of the rewritten demo step on the emulated 8-device CPU mesh.

Prints, against plain `jax.jit` measured in the same run:
  lowering time   trace + analysis + plan + re-emission + lowering     (target <= 2x)
  collective bytes per device, from compiled HLO                       (target <= 1.0x)
  temp memory per device, from compiled memory analysis                (target <= 1.0x)
  wall time of one step (CPU: no interconnect, so no overlap can win)  (target <= 1.25x)

  python bench/transform_bench.py [--mesh 2x4] [--dtype float32] [--repeats 20]
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import meshslice  # noqa: E402
from meshslice.demo import ModelConfig, make_mesh, make_step, place  # noqa: E402
from meshslice.hlo import collective_stats  # noqa: E402

FLAGS = flags.DEFINE_string("mesh", "2x4", "mesh shape RxC")
DTYPE = flags.DEFINE_string("dtype", "float32", "float32 or bfloat16")
REPEATS = flags.DEFINE_integer("repeats", 20, "timed steps per variant (median)")
LAYERS = flags.DEFINE_integer("layers", 2, "transformer layers")

VARIANTS = {"default plan": {}, "collective": {"algorithm": "collective"},
            "meshslice S=2": {"ksplit": 2}, "meshslice S=4": {"ksplit": 4}}


def _median_step_time(fn, params, batch, repeats):
  jax.block_until_ready(fn(params, batch))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(params, batch))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure(cfg, mesh, options, repeats):
  """Figures of one variant; options None means plain jax.jit."""
  params, batch = place(cfg, mesh)
  start = time.perf_counter()
  step = make_step(cfg, mesh, donate=False)        # a fresh function: no trace cache hit
  fn = step if options is None else meshslice.transform(step, **options)
  lowered = fn.lower(params, batch)
  lower_s = time.perf_counter() - start
  compiled = lowered.compile()
  stats = collective_stats(compiled.as_text())
  memory = compiled.memory_analysis()
  return {"lower_s": lower_s, "bytes": stats["total_bytes"],
          "temp": float(memory.temp_size_in_bytes),
          "step_s": _median_step_time(fn, params, batch, repeats)}


def main(argv):
  del argv
  shape = tuple(int(v) for v in FLAGS.value.split("x"))
  cfg = ModelConfig(dtype=DTYPE.value, layers=LAYERS.value)
  mesh = make_mesh(shape)
  measure(cfg, mesh, None, 2)                       # warm up JAX itself
  base = measure(cfg, mesh, None, REPEATS.value)
  print(f"demo step: {cfg.layers} layers, hidden {cfg.hidden}, ffn {cfg.ffn}, batch "
        f"{cfg.batch}x{cfg.seq}, {cfg.dtype}, mesh {dict(mesh.shape)}")
  print(f"plain jax.jit: lower {base['lower_s'] * 1e3:.0f} ms, collective bytes/device "
        f"{base['bytes'] / 1e6:.3f} MB, temp {base['temp'] / 1e6:.3f} MB, step "
        f"{base['step_s'] * 1e3:.2f} ms")
  header = f"{'variant':<16}{'lower':>9}{'bytes':>9}{'temp':>9}{'step':>9}   (ratios vs plain jax.jit)"
  print(header)
  for name, options in VARIANTS.items():
    m = measure(cfg, mesh, options, REPEATS.value)
    print(f"{name:<16}{m['lower_s'] / base['lower_s']:>8.2f}x{m['bytes'] / base['bytes']:>8.2f}x"
          f"{m['temp'] / max(base['temp'], 1):>8.2f}x{m['step_s'] / base['step_s']:>8.2f}x")
  print("targets: lower <= 2x, bytes <= 1.0x, temp <= 1.0x, step <= 1.25x (CPU)")


if __name__ == "__main__":
  app.run(main)
