"""bench/plot_results.py: the bars it reads from the TPU benchmarks' JSON lines (the
drawing only where matplotlib is installed: it is not a dependency)."""
import json
import sys

import pytest


def _sim(step_s):
  return {"model": "x", "step_s": step_s, "compute_s": step_s / 2, "exposed_s": 0.0}


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def results(tmp_path):
  """A tpu_models file (one layer: xla, default, tuned, a summary, a failed compile) and a
  tpu_whole_step folder (whole step: xla at two meshes, meshslice)."""
  layer = {"model": "gpt3", "topology": "v4:8x8x4", "mesh": "64x4", "layers": 1}
  models = tmp_path / "gpt3_v4-8x8x4_64x4.jsonl"
  _write(models, [
      {**layer, "program": "xla", "alpha-beta": _sim(0.190), "routed-links": _sim(0.178),
       "libtpu-lhs": {"cycles": 4.3e8, "nominal_step_s": 0.41}},
      {**layer, "program": "default", "alpha-beta": _sim(0.175),
       "routed-links": _sim(0.167), "libtpu-lhs": None},
      {**layer, "program": "tuned", "alpha-beta": _sim(0.157), "routed-links": _sim(0.162),
       "libtpu-lhs": {"cycles": 3.8e8, "nominal_step_s": 0.36}},
      {**layer, "program": "summary", "ratios_xla_over_program": {}},
      {**dict(layer, topology="v5p:4x4x4"), "program": "tuned", "error": "OOM"}])
  whole = {"model": "gpt3", "topology": "v4:8x8x4", "layers": 4, "vocab": 50304,
           "options": {}}
  folder = tmp_path / "whole"
  folder.mkdir()
  _write(folder / "a.jsonl", [
      {**whole, "mesh": "64x4", "program": "xla", "alpha-beta": _sim(0.94),
       "routed-links": _sim(0.98)},
      {**whole, "mesh": "64x4", "program": "meshslice", "alpha-beta": _sim(0.78),
       "routed-links": _sim(0.74)}])
  _write(folder / "b.jsonl", [
      {**whole, "mesh": "32x8", "program": "xla", "alpha-beta": _sim(0.90),
       "routed-links": _sim(1.10)}])
  (folder / "notes.txt").write_text("not read")
  return [str(models), str(folder)]


def test_load_gives_one_bar_per_setup_program_and_model(bench_script, results):
  plot = bench_script("plot_results")
  bars = plot.load(results)
  layer, whole = "v4 256 chips: gpt3, 1 layer", "v4 256 chips: gpt3, whole step, 4 layers"
  assert [(b.setup, b.program, b.simulator, b.step_s) for b in bars] == [
      (layer, "XLA (best)", "alpha-beta", 0.190),
      (layer, "XLA (best)", "routed-links", 0.178),
      (layer, "XLA (best)", "libtpu-lhs", 0.41),
      (layer, "meshslice default", "alpha-beta", 0.175),
      (layer, "meshslice default", "routed-links", 0.167),
      (layer, "meshslice tuned", "alpha-beta", 0.157),
      (layer, "meshslice tuned", "routed-links", 0.162),
      (layer, "meshslice tuned", "libtpu-lhs", 0.36),
      # XLA's best of its two meshes, per model
      (whole, "XLA (best)", "alpha-beta", 0.90),
      (whole, "XLA (best)", "routed-links", 0.98),
      (whole, "meshslice default", "alpha-beta", 0.78),
      (whole, "meshslice default", "routed-links", 0.74)]
  assert [b.mesh for b in bars if b.setup == whole and b.program == "XLA (best)"] == [
      "32x8", "64x4"]
  panels = plot.panels(bars)
  assert list(panels) == [layer, whole]
  assert panels[layer]["libtpu-lhs"] == {"XLA (best)": 0.41, "meshslice tuned": 0.36}


def test_a_whole_step_run_with_options_is_not_called_the_default(bench_script, tmp_path):
  plot = bench_script("plot_results")
  path = tmp_path / "w.jsonl"
  _write(path, [{"model": "tiny", "topology": "v4:2x2x2", "mesh": [2, 4], "layers": 4,
                 "vocab": 256, "options": {"ksplit": 2}, "program": "meshslice",
                 "alpha-beta": _sim(1e-3), "routed-links": _sim(2e-3)}])
  bars = plot.load([str(path)])
  assert {(b.setup, b.program) for b in bars} == {
      ("v4 8 chips: tiny, whole step, 4 layers", 'meshslice {"ksplit": 2}')}


def test_a_setup_counts_the_topologys_chips_not_the_meshs_devices(bench_script, tmp_path):
  # tpu7x: two TensorCores a chip, each a device of the mesh
  plot = bench_script("plot_results")
  path = tmp_path / "w.jsonl"
  _write(path, [{"model": "gpt3", "topology": "tpu7x:16x16x4", "mesh": "128x16",
                 "layers": 4, "vocab": 50304, "program": "xla",
                 "alpha-beta": _sim(1e-3), "routed-links": _sim(2e-3)},
                {"model": "gpt3", "topology": "?", "mesh": "64x4", "layers": 1,
                 "program": "xla", "alpha-beta": _sim(1e-3), "routed-links": _sim(2e-3)}])
  assert {b.setup for b in plot.load([str(path)])} == {
      "tpu7x 1024 chips: gpt3, whole step, 4 layers", "? 256 chips: gpt3, 1 layer"}


def test_without_matplotlib_the_error_says_how_to_get_it(bench_script, results,
                                                         monkeypatch, tmp_path):
  plot = bench_script("plot_results")
  monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib fails
  with pytest.raises(ImportError, match="pip install matplotlib"):
    plot.plot(plot.load(results), str(tmp_path / "out.png"))


def test_the_plot_is_written(bench_script, results, tmp_path):
  pytest.importorskip("matplotlib")
  plot = bench_script("plot_results")
  png = tmp_path / "out.png"
  plot.plot(plot.load(results), str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
