"""`python -m meshslice autotune`, run in-process through meshslice.costmodel.cli.main."""
import json
import time

import pytest

from meshslice.costmodel.autotune import recommend_mesh
from meshslice.costmodel.cli import main

SMALL = ["--model", "custom", "--chips", "16", "--heads", "8", "--head-dim", "64",
         "--seq", "256"]


def test_autotune_small_config(capsys):
  assert main(["autotune"] + SMALL) == 0
  out = capsys.readouterr().out
  rec = recommend_mesh(16, model="custom", heads=8, head_dim=64, seq=256)
  lines = out.splitlines()
  assert lines[0] == ("autotune: custom (hidden 512 = 8 heads x 64, seq 256, 1 layers), "
                      "16 chips, batch 16, 2-byte elements, profile tpu-v4")
  assert lines[1].startswith("candidates: collective, meshslice (ksplit <= 16)")
  assert lines[2] == "assumptions: ours; layouts chosen by: model"
  # summary table: one row per mesh shape, the best one starred
  header = lines[4].split()
  assert header[:3] == ["mesh", "shape", "best"] and "collective" in header
  assert header[-1] == "memory"
  rows = {line.split(")")[0] + ")": line for line in lines[5:8]}
  assert list(rows) == ["(2, 8)", "(4, 4)", "(8, 2)"]
  assert rows[str(rec.best_shape)].split(")")[1].split()[0] == "*"
  # one per-GEMM table per mesh shape, 12 GEMMs each, with dataflow/algorithm/ksplit
  assert out.count("mesh shape (") == 3 and f"mesh shape {rec.best_shape} (best):" in out
  for lc in rec.best.layers:
    c = lc.choice
    assert any(line.split()[:4] == [lc.label, c.dataflow, c.algorithm, str(c.ksplit)]
               for line in lines), lc.label
  assert lines[-1].startswith(f"best mesh shape: {rec.best_shape}: "
                              f"{rec.best.cost.total_s * 1e3:.3f} ms per layer")


def test_autotune_without_the_command_word_and_best_only(capsys):
  assert main(SMALL + ["--best-only", "--algorithms", "all"]) == 0
  out = capsys.readouterr().out
  assert out.count("mesh shape (") == 1
  assert "candidates: collective, meshslice, cannon, wang, summa" in out


def test_autotune_writes_trace_and_json(tmp_path, capsys):
  trace, result = tmp_path / "plan.json", tmp_path / "result.json"
  assert main(["autotune"] + SMALL + ["--trace", str(trace), "--json", str(result)]) == 0
  out = capsys.readouterr().out
  assert f"trace written to {trace}" in out and f"result written to {result}" in out
  events = json.loads(trace.read_text())["traceEvents"]
  sites = [e["name"] for e in events if e["ph"] == "X" and e["tid"] == 3]
  assert sites[:3] == ["qkv/forward", "qkv/backward_data", "qkv/backward_weight"]
  assert len(sites) == 12
  data = json.loads(result.read_text())
  assert data["best_shape"] == list(recommend_mesh(16, model="custom", heads=8, head_dim=64,
                                                   seq=256).best_shape)


def test_autotune_errors(capsys):
  assert main(["autotune", "--chips", "7"]) == 2
  assert "error: chips=7 has no 2D mesh shape" in capsys.readouterr().err
  assert main(["autotune", "--chips", "16", "--profile", "tpu-v9"]) == 2
  assert "error: unknown hardware profile 'tpu-v9'; known profiles: cpu" in (
      capsys.readouterr().err)
  assert main(["autotune", "--chips", "16", "--model", "custom"]) == 2
  assert "error: model 'custom' needs heads, head_dim, seq" in capsys.readouterr().err
  assert main(["autotune", "--chips", "16", "--algorithms", "fox"]) == 2
  assert "algorithms must be drawn from" in capsys.readouterr().err
  assert main(["autotune", "--model", "gpt4", "--chips", "16"]) == 2   # argparse usage error
  assert "invalid choice: 'gpt4'" in capsys.readouterr().err
  assert main(["autotune", "--help"]) == 0
  assert "--chips" in capsys.readouterr().out


def test_autotune_1024_chips_is_fast(capsys):
  start = time.perf_counter()
  assert main(["autotune", "--model", "megatron", "--chips", "1024", "--algorithms", "all"]) == 0
  assert time.perf_counter() - start < 10
  out = capsys.readouterr().out
  assert out.count("mesh shape (") == 9   # (2, 512) ... (512, 2)
  assert "best mesh shape: (" in out


def test_autotune_shows_runner_up_memory_and_assumptions(capsys):
  assert main(["autotune", "--model", "gpt3", "--chips", "256", "--memory-layers", "1",
               "--best-only"]) == 0
  out = capsys.readouterr().out
  rec = recommend_mesh(256, model="gpt3", memory_layers=1)
  runner = rec.runner_up
  assert (f"runner-up: {runner.shape}: {runner.cost.total_s * 1e3:.3f} ms per layer, "
          f"+{rec.margin * 100:.2f}% over the best") in out
  assert "GiB" in out.split("mesh shape (")[0]           # memory column of the summary
  # the per-GEMM table names each GEMM's layout; mlp_down runs lhs-stationary forward
  assert any(line.split()[:5] == ["mlp_down/forward", "ls", "meshslice", "16", "ls"]
             for line in out.splitlines())
  assert main(["autotune", "--model", "gpt3", "--chips", "256", "--assume", "paper",
               "--best-only"]) == 0
  out = capsys.readouterr().out
  assert "assumptions: paper; layouts chosen by: paper" in out
  assert "profile tpu-v4-paper" in out.splitlines()[0]
  assert out.splitlines()[-1].startswith("best mesh shape: (32, 8)")


def test_autotune_marks_near_ties_and_reports_memory_errors(capsys):
  # GPT-3 on 32 chips with the paper's assumptions: (8, 4) and (4, 8) within 0.2%
  assert main(["autotune", "--model", "gpt3", "--chips", "32", "--assume", "paper",
               "--best-only"]) == 0
  out = capsys.readouterr().out
  assert "(near tie: within 2%" in out
  assert main(["autotune", "--model", "megatron", "--chips", "256"]) == 2
  err = capsys.readouterr().err
  assert "memory: " in err and "for 105 layers" in err
  assert main(["autotune", "--model", "megatron", "--chips", "256", "--dataflow-policy", "os",
               "--memory-layers", "1", "--best-only"]) == 0
  out = capsys.readouterr().out
  assert "! the collective algorithm does not fit in memory on this shape:" in out
  assert "(2, 128): mlp_down/forward: the collective algorithm needs" in out


def test_autotune_compare(capsys):
  from meshslice.costmodel.autotune import compare_algorithms
  assert main(["autotune", "--model", "gpt3", "--chips", "64", "--compare", "--assume",
               "paper"]) == 0
  out = capsys.readouterr().out
  rows = {r.algorithm: r for r in compare_algorithms(64, model="gpt3", assume="paper")}
  ms = rows["meshslice"]
  lines = {line.split()[0]: line for line in out.splitlines()[3:8]}
  assert list(lines) == ["collective", "wang", "summa", "cannon", "meshslice"]
  for name in ("collective", "wang", "summa", "cannon"):
    r = rows[name]
    assert str(r.shape) in lines[name]
    assert f"{(r.ff_s / ms.ff_s - 1) * 100:+.1f}%" in lines[name]
    assert f"{(r.layer_s / ms.layer_s - 1) * 100:+.1f}%" in lines[name]
  assert ms.other_s > 0 and ms.layer_s == ms.ff_s + ms.other_s
  assert "other work per layer (attention core, elementwise)" in out


def test_trace_uses_the_profile_the_shape_was_predicted_with(tmp_path, capsys):
  trace = tmp_path / "t.json"
  assert main(["autotune", "--model", "gpt3", "--chips", "256", "--no-memory-check",
               "--best-only", "--trace", str(trace)]) == 0
  capsys.readouterr()
  rec = recommend_mesh(256, model="gpt3", check_memory=False)
  assert rec.best.profile.name == f"tpu-v4@{rec.best_shape[0]}x{rec.best_shape[1]}"
  events = json.loads(trace.read_text())["traceEvents"]
  sites = [e for e in events if e["ph"] == "X" and e["tid"] == 3]
  total_us = sum(e["dur"] for e in sites)
  assert total_us == pytest.approx(rec.best.cost.total_s * 1e6, rel=1e-6)
