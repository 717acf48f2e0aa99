"""bench/tpu_models.py on a tiny layer (v4:2x2x2 as 2x4): three programs compiled in one
process, each read under the three cost models, the least favourable ratio claimed."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tpu_models_reads_every_program_under_three_models(tmp_path):
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "bench", "tpu_models.py"), "--model=custom:4x128",
       "--seq=128", "--topology=v4:2x2x2", "--mesh=2x4", f"--out_dir={tmp_path}",
       "--nosave_hlo"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  claim = [l for l in proc.stdout.splitlines() if l.startswith("least favourable: ")]
  assert len(claim) == 1 and "default " in claim[0] and "tuned " in claim[0], proc.stdout
  with open(tmp_path / "custom-4x128_v4-2x2x2_2x4.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["program"] for r in records] == ["xla", "default", "tuned", "summary"]
  for r in records:
    assert r["jax"] and r["libtpu"] and r["topology"] == "v4:2x2x2" and r["mesh"] == "2x4"
    assert "--xla_tpu_enable_async_all_to_all=true" in r["libtpu_flags"]
    assert "tpu_models.py" in r["command"]
  for r in records[:3]:
    _assert_simulated_figures(r)
    assert r["libtpu-lhs"]["cycles"] > 0          # the scheduler log was captured
    assert r["libtpu_peak_bytes"] > 0
  # the tuned plan slices the ls sites of collective+all_to_all in two
  assert any("meshslice ls S=2 rs=all_to_all" in d for d in records[2]["plan"])
  # and the printed split per program and model
  assert proc.stdout.count("of which") >= 6 and " exposed (" in proc.stdout
  summary = records[3]
  for name in ("default", "tuned"):
    by_model = summary["ratios_xla_over_program"][name]
    assert set(by_model) == {"alpha-beta", "routed-links", "libtpu-lhs"}
    worst = summary["least_favourable"][name]
    assert worst["ratio"] == min(by_model.values())
    assert f"{name} {worst['ratio']:.3f}x" in claim[0]


def test_tpu_plans_compiles_pinned_plans_and_reads_them_under_both_models(tmp_path):
  """bench/tpu_plans.py: plans pinned by site index compile in one process; each row is
  read under alpha-beta and routed links, against the "xla" row."""
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = tmp_path / "plans.jsonl"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "bench", "tpu_plans.py"), "--model=custom:4x128",
       "--seq=128", "--topology=v4:2x2x2", "--mesh=2x4", "--list", "--plan=xla=",
       '--plan=pinned={"algorithm": "collective", "overrides": {"0": {"rewrite": false}}}',
       f"--out={out}"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("#0   forward  wq ") and lines[0].endswith("left alone")
  pinned = next(line for line in lines if line.startswith("pinned: "))
  assert "XLA / plan " in pinned and "'collective os S=1': 10" in pinned
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["plan"] for r in records] == ["xla", "pinned"]
  assert records[1]["options"]["overrides"] == {"0": {"rewrite": False}}
  for r in records:
    assert r["topology"] == "v4:2x2x2" and "tpu_plans.py" in r["command"]
    _assert_simulated_figures(r)


def _assert_simulated_figures(record):
  """A bench record's figures under each time model: a step no shorter than its compute,
  and the exposed time split into the sync collectives' waits and the async dones'."""
  for model in ("alpha-beta", "routed-links"):
    s = record[model]
    assert s["step_s"] >= s["compute_s"] > 0
    assert s["sync_exposed_s"] + s["async_exposed_s"] == pytest.approx(s["exposed_s"])
    assert s["sync_collective_s"] + s["async_collective_s"] == pytest.approx(
        s["collective_s"])
    assert 0 <= s["async_exposed_s"] <= s["async_collective_s"] + 1e-12


def test_never_slower_sweep_compiles_both_programs_and_flags_a_slower_plan(tmp_path):
  """bench/tpu_never_slower_sweep.py: per row XLA's program and the default plan under one
  flag set, each read under both time models; the least favourable ratio decides whether
  the row is marked broken (here a tolerance no plan can meet, so the mark must show)."""
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = tmp_path / "sweep.jsonl"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "bench", "tpu_never_slower_sweep.py"),
       "--topology=v4:2x2x2", "--meshes=2x4,4x2", "--models=custom:4x128", "--seqs=128",
       "--tolerance=100", f"--out={out}"],
      capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["mesh"] for r in rows] == ["2x4", "4x2"]
  for r in rows:
    assert r["topology"] == "v4:2x2x2" and r["seq"] == 128 and r["batch"] == 8
    assert "--xla_tpu_enable_async_all_to_all=true" in r["libtpu_flags"]
    assert "tpu_never_slower_sweep.py" in r["command"]
    ratios = {m: r["xla"][m]["step_s"] / r["default"][m]["step_s"]
              for m in ("alpha-beta", "routed-links")}
    assert r["least_favourable"]["ratio"] == min(ratios.values())
    assert r["least_favourable"]["model"] == min(ratios, key=ratios.get)
    assert r["broken"] is True
    for program in ("xla", "default"):
      for model in ("alpha-beta", "routed-links"):
        s = r[program][model]
        assert s["step_s"] >= s["compute_s"] > 0
  assert "2 of 2 rows broken (least favourable below 100.0)" in proc.stdout
  assert proc.stdout.count("BROKEN") == 2
