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


def test_published_v4_rows_are_maxtexts_april_2023_runs(bench_script):
  """The v4 rows: TFLOP/s over v4's 275 is the MFU, the names say the parameter count of
  the scripts' dims, sequence 1024, and the FLOPs are 6 x params x tokens (that commit's
  train.py counted no attention), so the implied step is 13.8 s for 22B on 64 chips."""
  m = bench_script("maxtext_mfu")
  rows = {r.name: r for r in m.PUBLISHED_V4}
  assert sorted(rows) == ["22b-v4", "52b-v4"]
  for row in rows.values():
    assert row.tflops / 275 * 100 == pytest.approx(row.mfu, abs=0.1), row.name
    assert row.maxtext_flags == m.FLAGS_V4_2023 and row.tensor == 1
    assert row.attention == "dot_product" and row.seq == 1024
    d = m.model_dims(row)
    assert d["head_dim"] == 256
    assert m.params(d) / 1e9 == pytest.approx(int(row.name[:2]), rel=0.01), row.name
    assert m.flops_per_device(row) == 6 * m.params(d) * 1024 * row.per_device_batch
    assert m.BY_NAME[row.name] is row
  assert [rows[n].chips for n in ("22b-v4", "52b-v4")] == [64, 192]
  r22 = rows["22b-v4"]
  assert m.flops_per_device(r22) / (r22.mfu / 100 * 275e12) == pytest.approx(13.84, abs=0.01)
  assert m.overrides(r22, 3)["attention"] == "dot_product"
  assert m.overrides(r22, 3)["base_emb_dim"] == 6144


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


def test_a_named_maxtext_model_on_v4(bench_script):
  """CONFIGS' Llama2-70B: MaxText's llama2-70b by model_name, its parameter count
  (GQA 64 / 8 heads, SwiGLU 28672, untied 32000-token embedding: 69.0B), its FLOPs at
  sequence 4096, v4's peak, and no published MFU (no residual)."""
  m = bench_script("maxtext_mfu")
  row = m.BY_NAME["llama2-70b-v4"]
  assert (row.chips, row.profile, row.mfu) == (256, "tpu-v4", None)
  assert m.params(m.model_dims(row)) / 1e9 == pytest.approx(68.98, abs=0.01)
  d = m.model_dims(row)
  tokens = 4096 * 4
  assert m.flops_per_device(row) == pytest.approx(
      6 * m.params(d) * tokens + 6 * 64 * 80 * 128 * 4096**2 * 4)
  o = m.overrides(row, 3)
  assert (o["model_name"], o["base_num_decoder_layers"], o["max_target_length"],
          o["ici_tensor_parallelism"], o["compile_topology"]) == (
              "llama2-70b", 3, 4096, 4, "v4-512")
  assert "base_emb_dim" not in o and m.PEAK_FLOPS[row.profile] == 275e12
  # the 2023 rows' parameters are unchanged by the named-model fields
  assert m.params(m.model_dims(m.BY_NAME["32b"])) == m.params(m.dims(32))
  # Llama3.1-70B: the same body, a 128256-token vocabulary (70.55B), context 8192
  row = m.BY_NAME["llama3.1-70b-v4"]
  assert m.params(m.model_dims(row)) / 1e9 == pytest.approx(70.55, abs=0.01)
  assert (row.seq, row.per_device_batch, m.overrides(row, 3)["model_name"]) == (
      8192, 2, "llama3.1-70b")


def test_a_config_without_maxtext_flags_needs_a_preset(bench_script):
  from absl import app
  m = bench_script("maxtext_mfu")
  m.flags.FLAGS(["maxtext_mfu", "--rows=llama2-70b-v4"])
  try:
    with pytest.raises(app.UsageError, match="llama2-70b-v4 need --preset"):
      m.main(["maxtext_mfu"])
  finally:
    m.flags.FLAGS.unparse_flags()


def test_options_variants_are_named_and_compared_by_label(bench_script):
  """--options / --label: a plan variant is saved as <program>_meshslice-<label> and the
  comparison has a row per plan against the same XLA program; the flags go together."""
  from absl import app
  m = bench_script("maxtext_mfu")
  assert m.program_name("r", False, True, "dense,async", "coll") == "r_dense-async_meshslice-coll"
  assert m.program_name("r", False, False, "", "coll") == "r"

  def result(program, ab, routed):
    return {"row": "r", "program": program, "windowed_einsum": False,
            "models": {"alpha-beta": {"step_s": ab}, "routed-links": {"step_s": routed}}}
  table = m.comparison([result("r_p", 10.0, 10.0), result("r_p_meshslice", 8.0, 12.5),
                        result("r_p_meshslice-coll", 12.5, 8.0)])
  rows = table.splitlines()[2:]
  assert len(rows) == 2
  assert rows[0].startswith("| r (default) |") and "1.250x / 0.800x | **0.800x**" in rows[0]
  assert rows[1].startswith("| r (coll) |") and "0.800x / 1.250x | **0.800x**" in rows[1]
  for argv in (["--options={}"], ["--label=x", "--meshslice"],
               ["--options={}", "--label=x"]):
    m.flags.FLAGS(["maxtext_mfu", "--rows=32b", *argv])
    try:
      with pytest.raises(app.UsageError, match="--options and --label go together"):
        m.main(["maxtext_mfu"])
    finally:
      m.flags.FLAGS.unparse_flags()
