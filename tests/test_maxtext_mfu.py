"""bench/maxtext_mfu.py: the published rows, MaxText's 2023 model and FLOP rule, and the
restored layer count of a program compiled with fewer layers."""
import pytest

from meshslice.costmodel import tpu_schedule as ts


def test_published_rows_agree_with_their_own_tflops(bench_script):
  """Each row's TFLOP/s per chip is its MFU of v5p's 459 TFLOP/s (as MaxText divides)."""
  m = bench_script("maxtext_mfu")
  assert len(m.PUBLISHED) == 7
  for row in m.PUBLISHED:
    assert row.tflops / 459 * 100 == pytest.approx(row.mfu, abs=0.15), row.name
  assert [r.chips for r in m.PUBLISHED] == [64, 64, 128, 512, 512, 1024, 2048]


def test_model_dims_follow_maxtext_2023_scaling_rule(bench_script):
  """Heads and MLP double first, then the embedding, then layers (get_individual_scales),
  from 2560 emb / 8 heads / 8192 MLP / 16 layers; the names say the parameter count."""
  m = bench_script("maxtext_mfu")
  assert m.dims(32) == {"emb": 10240, "heads": 32, "head_dim": 256, "mlp": 32768,
                        "layers": 32}
  assert m.dims(1024) == {"emb": 20480, "heads": 128, "head_dim": 256, "mlp": 131072,
                          "layers": 128}
  for scale in (32, 64, 128, 256, 512, 1024):
    assert m.params(m.dims(scale)) / 1e9 == pytest.approx(scale, rel=0.08), scale


def test_flops_per_device_is_maxtexts_2023_formula(bench_script):
  """6 x params x tokens + causal attention (half of 12 h L d s^2 b), per device."""
  m = bench_script("maxtext_mfu")
  row = m.BY_NAME["32b"]
  d = m.dims(32)
  tokens = 2048 * 8
  expected = (6 * m.params(d) * tokens
              + 6 * d["heads"] * d["layers"] * d["head_dim"] * 2048**2 * 8)
  assert m.flops_per_device(row) == pytest.approx(expected)
  # the implied step of the published MFU: ~9.9 s for 32B on v5p-128
  assert m.flops_per_device(row) / (row.mfu / 100 * 459e12) == pytest.approx(9.91, abs=0.02)


def test_restored_trip_count_runs_the_full_models_layers(bench_script):
  """Loops compiled with 3 trips run 32 in the simulation; others keep theirs."""
  m = bench_script("maxtext_mfu")
  dot = ts.CompiledOp(name="d", opcode="fusion", kind="dot", cycles=1000)
  layers = ts.Loop(name="scan", trip_count=3, trip_count_known=True, body=(dot,))
  other = ts.Loop(name="inner", trip_count=4, trip_count_known=True, body=(dot,))
  schedule = ts.CompiledSchedule(entries=(dot, layers, other))
  restored, found = m.with_trip_count(schedule, 3, 32)
  assert found == 1
  assert [e.trip_count for e in restored.entries[1:]] == [32, 4]
  clock = 1e9
  assert ts.simulate(restored, "tpu-v5p", clock_hz=clock).step_s == pytest.approx(
      (1 + 32 + 4) * 1000 / clock)
