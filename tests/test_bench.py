"""The benchmark entry points on tiny configurations, the calibration, and the fits.

The bench apps (absl) run as subprocesses, as a user runs them; their JSON lines are
validated here. Calibration runs in-process on this process's 8 CPU devices.
"""
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import gpt
from meshslice.costmodel import calibrate
from meshslice.costmodel import (GemmEfficiency, GemmProblem, load_profile, predict,
                                 save_profile)
from meshslice.hlo import collective_stats

from cpu_flags import CPU_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(layers=2, batch=4, seq=8, hidden=32, heads=2, ffn=64)


def _bench(name, *flags, timeout=300):
  """Run bench/<name>.py with `flags`; returns its stdout. The timeout guards against a
  hang, not speed: the transformer bench took 60 s beside the suite's other worker."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = CPU_XLA_FLAGS     # the scripts' own 8 devices, fast codegen
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), *flags],
                        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
  assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
  return proc.stdout


def _records(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- transformer

def test_transformer_bench(tmp_path):
  out = tmp_path / "t.jsonl"
  flags = [f"--{k}={v}" for k, v in TINY.items()]
  _bench("transformer", *flags, "--mesh=2x4", "--steps=2", "--warmup=1",
         "--algorithms=collective,meshslice:2", f"--out={out}")
  records = _records(out)
  assert [r["variant"] for r in records] == ["jit", "collective", "meshslice:2", "default"]
  for r in records:
    for key in ("config", "mesh", "algorithm", "step_s", "predicted_step_s",
                "predicted_sites_s", "collective_bytes", "temp_bytes", "plans", "loss"):
      assert key in r, (r["variant"], key)
    assert r["config"] == {**TINY, "dtype": "float32", "learning_rate": 1e-2}
    assert r["mesh"] == {"x": 2, "y": 4} and r["devices"] == 8
    assert r["step_s"] > 0 and r["step_s_min"] <= r["step_s"]
    assert r["predicted_step_s"] > 0 and r["collective_bytes"] > 0 and r["temp_bytes"] > 0
    # every rewritten site sits in the 2-layer scan: it runs twice per step
    assert math.isclose(r["predicted_step_s"], 2 * r["predicted_sites_s"], rel_tol=1e-9)
    np.testing.assert_allclose(r["loss"], records[0]["loss"], rtol=1e-4)
  jit, coll, sliced, default = records
  assert jit["rewritten"] == 0 and coll["rewritten"] > 0
  assert set(sliced["plans"]) and all(p.split()[0] == "meshslice" and p.endswith("S=2")
                                      for p in sliced["plans"])
  # plain jit is predicted as the collective algorithm, a reduce-scatter a site; the
  # collective plan shares one among the attention input gradients' sum (two fewer)
  assert any("one reduce-scatter with sites" in n for n in coll["notes"])
  assert coll["predicted_step_s"] < jit["predicted_step_s"]
  # S=2 issues more, smaller collectives than S=1
  assert (sum(sliced["collective_counts"].values())
          > sum(coll["collective_counts"].values()))

  # the jit figures are those of the real compiled HLO of the same step
  cfg = gpt.ModelConfig(**TINY)
  mesh = gpt.make_mesh((2, 4))
  params, batch = gpt.place(cfg, mesh)
  compiled = gpt.make_step(cfg, mesh).lower(params, batch).compile()
  assert jit["collective_bytes"] == collective_stats(compiled.as_text())["total_bytes"]
  assert jit["temp_bytes"] == compiled.memory_analysis().temp_size_in_bytes


def test_transformer_bench_with_data_axis(tmp_path):
  out = tmp_path / "t.jsonl"
  flags = [f"--{k}={v}" for k, v in TINY.items() if k != "batch"]
  _bench("transformer", *flags, "--batch=8", "--mesh=2x2", "--data=2", "--steps=1",
         "--warmup=0", "--algorithms=meshslice:2", "--skip_default", f"--out={out}")
  jit, sliced = _records(out)
  assert jit["mesh"] == sliced["mesh"] == {"data": 2, "x": 2, "y": 2}
  assert sliced["rewritten"] > 0 and sliced["predicted_step_s"] > 0
  np.testing.assert_allclose(sliced["loss"], jit["loss"], rtol=1e-4)


# ----------------------------------------------------------------------------- collectives

def test_collectives_bench(tmp_path):
  out = tmp_path / "c.jsonl"
  _bench("collectives", "--sizes_kib=4,32", "--loops=2", "--repeats=2",
         "--kinds=all_gather,permute", f"--out={out}")
  records = _records(out)
  timings = [r for r in records if r["record"] == "timing"]
  fits = [r for r in records if r["record"] == "fit"]
  # all-gather: 2 sizes x 2 axes; permute: 2 sizes x (1 shift on the 2-axis, 2 on the 4-axis)
  assert len(timings) == 4 + 6
  assert {(f["kind"], f["dim"]) for f in fits} == {(k, d) for k in ("all_gather", "permute")
                                                   for d in (0, 1)}
  for t in timings:
    assert t["seconds"] > 0 and t["bandwidth_Bps"] > 0 and t["predicted_seconds"] > 0
    assert t["group"] == (2 if t["dim"] == 0 else 4)
  for f in fits:
    assert f["bandwidth"] > 0 and f["hop_latency"] >= 0 and f["base_overhead"] >= 0
    assert f["r2"] <= 1 and f["max_rel_error"] >= 0
  # permute on the 4-device axis ran 1- and 2-hop shifts: base and hop identified
  assert next(f for f in fits if (f["kind"], f["dim"]) == ("permute", 1))["identified"]


# ----------------------------------------------------------------------------- compare

def test_compare_bench(tmp_path):
  out = tmp_path / "m.jsonl"
  _bench("compare", "--shapes=64x64x64", "--dataflows=os,rs", "--ksplits=2",
         "--algorithms=wang", "--repeats=3", f"--out={out}")
  records = _records(out)
  plans = [r for r in records if r["record"] == "plan"]
  summary = next(r for r in records if r["record"] == "summary")
  assert [(r["dataflow"], r["plan"]) for r in plans] == [
      (d, p) for d in ("os", "rs") for p in ("collective", "meshslice S=2", "wang")]
  for r in plans:
    assert r["measured_s"] > 0 and r["predicted_s"] > 0
    assert r["max_rel_error"] < 1e-4                    # each plan computed x @ w
  assert summary["plans"] == 6 and summary["sites"] == 2
  assert -1 <= summary["spearman_all"] <= 1
  assert set(summary["spearman_per_site"]) == {"64x64x64 os", "64x64x64 rs"}


# ----------------------------------------------------------------------------- calibration

def test_calibration_on_cpu_writes_a_profile_that_loads_and_round_trips(tmp_path, capsys):
  path, report = tmp_path / "cpu.json", tmp_path / "report.json"
  assert calibrate.main(["--mesh", "2x4", "--out", str(path), "--report", str(report),
                         "--sizes-kib", "4,32", "--kinds", "all_gather,reduce_scatter,permute",
                         "--gemm-base", "64", "--gemm-min", "32", "--loops", "2",
                         "--repeats", "2", "--quiet", "--name", "test-cpu"]) == 0
  printed = capsys.readouterr().out
  assert "R^2" in printed and f"written to {path}" in printed
  profile = load_profile(str(path))
  assert profile.name == "test-cpu" and profile.peak_flops > 0
  assert all(bw > 0 for kind in ("all_gather", "reduce_scatter", "permute")
             for bw in profile.collective(kind).bandwidth)
  again = tmp_path / "again.json"
  save_profile(profile, again)
  assert load_profile(str(again)) == profile
  assert again.read_text() == path.read_text()
  data = json.loads(report.read_text())
  assert len(data["gemms"]) == 4 and len(data["collectives"]) == 2 * 2 + 2 * 2 + 2 * 3
  assert {row["what"] for row in data["fits"]} >= {"gemm", "permute dim 1"}
  # the pass plans with it
  mesh = gpt.make_mesh((2, 4))
  f = jax.jit(lambda x, w: x @ w, in_shardings=(NamedSharding(mesh, P("x", "y")),) * 2,
              out_shardings=NamedSharding(mesh, P("x", "y")))
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("x", "y")))
  report = meshslice.explain(f, profile=str(path))(x, x)
  assert report.profile == "test-cpu" and report.rewritten[0].predicted_seconds > 0


# ----------------------------------------------------------------------------- fits

def test_collective_fit_recovers_known_parameters():
  rng = np.random.default_rng(0)
  sizes = np.array([4e3, 3e4, 2.5e5, 2e6, 1.6e7])
  bw, hop, base = 4.5e10, 1e-6, 1.3e-5
  for kind in ("all_gather", "reduce_scatter"):
    n = np.repeat([2, 4, 8], len(sizes))
    b = np.tile(sizes, 3)
    t = base + (n - 1) * b / bw + (n - 1) * hop
    fit = calibrate.fit_collective(kind, n, b, t)
    assert fit.identified and fit.r2 > 0.999999 and fit.max_rel_error < 1e-9
    assert math.isclose(fit.bandwidth, bw, rel_tol=1e-6)
    assert math.isclose(fit.hop_latency, hop, rel_tol=1e-6)
    assert math.isclose(fit.base_overhead, base, rel_tol=1e-6)
    # 1% multiplicative noise: still close
    noisy = calibrate.fit_collective(kind, n, b, t * rng.normal(1, 0.01, t.shape))
    assert math.isclose(noisy.bandwidth, bw, rel_tol=0.05)
    assert math.isclose(noisy.base_overhead + 7 * noisy.hop_latency, base + 7 * hop,
                        rel_tol=0.05)
  # permute: hops 1 and 2 identify base and hop
  hops = np.repeat([1, 2], len(sizes))
  b = np.tile(sizes, 2)
  t = base + b / bw + hops * 5e-5
  fit = calibrate.fit_collective("permute", 4, b, t, hops=hops)
  assert fit.identified and math.isclose(fit.hop_latency, 5e-5, rel_tol=1e-6)
  assert math.isclose(fit.bandwidth, bw, rel_tol=1e-6)


def test_collective_fit_with_one_ring_size_splits_the_intercept_by_the_rule():
  sizes = np.array([1e4, 1e5, 1e6])
  n, bw, hop, base = 4, 2e10, 2e-6, 1e-5
  t = base + (n - 1) * sizes / bw + (n - 1) * hop
  fit = calibrate.fit_collective("all_gather", n, sizes, t, hop_ratio=0.5)
  assert not fit.identified and "split with hop = 0.5 * base" in fit.note
  assert math.isclose(fit.bandwidth, bw, rel_tol=1e-6)
  # the intercept (all a prediction on this axis size uses) is exact ...
  assert math.isclose(fit.base_overhead + 3 * fit.hop_latency, base + 3 * hop, rel_tol=1e-6)
  # ... and split so that hop = 0.5 * base
  assert math.isclose(fit.hop_latency, 0.5 * fit.base_overhead, rel_tol=1e-9)
  # default ratio: the reference profile's (tpu-v4 all-gather: 5 us hop, 13 us base)
  default = calibrate.fit_collective("all_gather", n, sizes, t)
  assert math.isclose(default.hop_latency / default.base_overhead, 5 / 13, rel_tol=1e-9)
  # a flat line: no bandwidth measurable -> the documented stand-in, still positive
  flat = calibrate.fit_collective("all_gather", n, sizes, np.full(3, 1e-4))
  assert flat.bandwidth == calibrate.UNMEASURABLE_BANDWIDTH
  assert "no size dependence" in flat.note
  with pytest.raises(ValueError, match="distinct shard sizes"):
    calibrate.fit_collective("all_gather", n, [1e4, 1e4], [1e-5, 2e-5])


def test_gemm_fit_recovers_known_parameters_and_predicts_like_the_cost_model():
  true = GemmEfficiency(max_efficiency=0.6, m_sat=128, n_sat=64, k_sat=256)
  shapes = calibrate.gemm_shapes(1024, 16)
  peak = 2e12
  t = [2 * m * n * k / (peak * true(m, n, k)) for m, n, k in shapes]
  fit = calibrate.fit_gemm_efficiency(shapes, t, peak_flops=peak)
  assert fit.efficiency == true and fit.r2 > 0.999999
  # without a peak: the best measured throughput becomes the peak (efficiency 1 there)
  free = calibrate.fit_gemm_efficiency(shapes, t)
  assert math.isclose(free.peak_flops, 0.6 * peak) and free.efficiency.max_efficiency == 1.0
  # a profile built from the fits predicts GEMMs as measured
  coll = calibrate.fit_collective("all_gather", 2, [1e4, 1e6], [2e-5, 3e-4])
  profile = calibrate.build_profile(name="synthetic", gemm_fit=fit,
                                    collective_fits={("all_gather", 0): coll},
                                    base=load_profile("tpu-v4"))
  assert profile.all_gather.bandwidth == (coll.bandwidth, coll.bandwidth)
  assert profile.permute == load_profile("tpu-v4").permute
  problem = GemmProblem(m=256, n=64, k=512, rows=1, cols=1)
  cost = predict(problem, "collective", "os", 1, profile)
  assert math.isclose(cost.total_s, 2 * 256 * 64 * 512 / (peak * true(256, 64, 512)))


def test_spearman():
  assert calibrate.spearman([1, 2, 3], [2, 4, 9]) == 1.0
  assert calibrate.spearman([1, 2, 3], [9, 4, 2]) == -1.0
  assert math.isnan(calibrate.spearman([1, 1, 1], [1, 2, 3]))
  # ties take their average rank: ranks (1.5, 1.5, 3) vs (1, 2, 3)
  assert math.isclose(calibrate.spearman([5, 5, 7], [1, 2, 3]), np.sqrt(3) / 2)
  rng = np.random.default_rng(1)
  x, y = rng.normal(size=50), rng.normal(size=50)
  # against the textbook formula (no ties): 1 - 6 sum d^2 / (n (n^2 - 1))
  d = calibrate.rank(x) - calibrate.rank(y)
  assert math.isclose(calibrate.spearman(x, y), 1 - 6 * np.sum(d * d) / (50 * (50**2 - 1)))
