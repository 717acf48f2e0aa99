"""All-gather, reduce-scatter and permute on each axis of a 2D mesh: timings and the
alpha-beta fit the cost model uses (docs/costmodel.md).

For each collective kind, mesh axis (profile dim 0 = the R axis, 1 = the C axis), ring
size and per-device shard size, prints the time of one collective (dispatch cancelled:
see meshslice/calibrate.py), the bytes each device moves ((n-1) * shard for a ring
all-gather / reduce-scatter, the shard for a permute) over that time, and the fitted
model's time; then per (kind, axis) the fitted bandwidth, hop latency, base overhead,
R^2 and max relative error. `python -m meshslice calibrate` runs the same measurements
plus GEMMs and writes a profile.

  python bench/collectives.py                                   # 8 emulated CPU devices
  python bench/collectives.py --mesh 4x4 --sizes_kib 64,1024,16384 --dtype bfloat16 \\
      --out /tmp/coll.jsonl                                     # e.g. a TPU v4-32 slice
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from absl import app, flags

import cluster  # noqa: E402  (bench/cluster.py: shared flags)

_MESH = flags.DEFINE_string("mesh", "2x4", "mesh shape RxC")
_SIZES = flags.DEFINE_list("sizes_kib", ["16", "64", "256", "1024"],
                           "per-device shard sizes, KiB")
_KINDS = flags.DEFINE_list("kinds", ["all_gather", "reduce_scatter", "permute"],
                           "collectives to time")
_GROUPS = flags.DEFINE_enum("group_sizes", "axis", ["axis", "all"],
                            "ring sizes: the whole axis, or every divisor >= 2 of it")
_DTYPE = flags.DEFINE_string("dtype", "float32", "element type")
_LOOPS = flags.DEFINE_integer("loops", 4, "collectives per timed call")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per measurement (median)")
_OUT = flags.DEFINE_string("out", None, "write JSON lines here (one per timing, one per fit)")


def run(shape, *, sizes_bytes, kinds, group_sizes, dtype, loops, repeats):
  """(samples, fits) on the first R * C devices."""
  from meshslice.costmodel import calibrate
  devices = calibrate.mesh_devices(shape)
  samples = calibrate.measure_collectives(devices, kinds=kinds, sizes_bytes=sizes_bytes,
                                          dtype=dtype, group_sizes=group_sizes, loops=loops,
                                          repeats=repeats)
  return samples, calibrate.fit_collectives(samples)


def records(samples, fits, shape, dtype) -> list[dict]:
  """JSON-able records: one per timing (with the fit's prediction), one per fit."""
  out = []
  device = jax.devices()[0]
  common = {"mesh": list(shape), "dtype": dtype, "platform": device.platform,
            "device_kind": getattr(device, "device_kind", device.platform)}
  for s in samples:
    fit = fits[(s.kind, s.dim)]
    moved = s.shard_bytes * (1 if s.kind == "permute" else s.group - 1)
    out.append({"record": "timing", **common, **dataclasses.asdict(s),
                "bytes_moved": moved, "bandwidth_Bps": moved / s.seconds,
                "predicted_seconds": float(fit.predict(s.group, s.shard_bytes, s.hops))})
  for (kind, dim), f in sorted(fits.items()):
    out.append({"record": "fit", **common, "kind": kind, "dim": dim,
                **{k: v for k, v in dataclasses.asdict(f).items() if k != "kind"}})
  return out


def main(argv):
  del argv
  cluster.start()
  shape = tuple(int(v) for v in _MESH.value.lower().split("x"))
  sizes = [int(float(v) * 1024) for v in _SIZES.value]
  samples, fits = run(shape, sizes_bytes=sizes, kinds=tuple(_KINDS.value),
                      group_sizes=_GROUPS.value, dtype=_DTYPE.value, loops=_LOOPS.value,
                      repeats=_REPEATS.value)
  rows = records(samples, fits, shape, _DTYPE.value)
  if jax.process_index() != 0:
    return
  print(f"collectives on mesh {shape[0]}x{shape[1]} ({rows[0]['device_kind']}), "
        f"{_DTYPE.value}")
  print(f"{'kind':<15}{'dim':>4}{'ring':>5}{'hops':>5}{'shard KiB':>11}{'measured us':>13}"
        f"{'GB/s':>8}{'model us':>10}")
  for r in rows:
    if r["record"] == "timing":
      print(f"{r['kind']:<15}{r['dim']:>4}{r['group']:>5}{r['hops']:>5}"
            f"{r['shard_bytes'] / 1024:>11.1f}{r['seconds'] * 1e6:>13.1f}"
            f"{r['bandwidth_Bps'] / 1e9:>8.2f}{r['predicted_seconds'] * 1e6:>10.1f}")
  from meshslice.costmodel.calibrate import render_fits
  print(render_fits(fits, None))
  if _OUT.value:
    cluster.write_jsonl(_OUT.value, rows)


if __name__ == "__main__":
  app.run(main)
