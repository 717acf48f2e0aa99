"""meshslice.whole_step: a whole training step (one-hot embedding, scanned checkpointed
layers, logits + softmax cross-entropy, Adam) sharded the 2D way, small on the 8-device
CPU mesh and at pod size on an abstract mesh."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshslice
from meshslice import whole_step as ws

from helpers import assert_trees_close, mesh

PRESET_SIZES = {  # name: (hidden, heads, kv heads, ffn, seq, vocab)
    "gpt3": (12288, 96, 96, 49152, 2048, 50304),
    "megatron": (20480, 160, 160, 81920, 2048, 50304),
    "llama70b": (8192, 64, 8, 28672, 4096, 32000),
}


def test_presets_are_the_published_sizes_bf16_params_f32_moments():
  for name, sizes in PRESET_SIZES.items():
    c = ws.PRESETS[name]
    assert (c.hidden, c.heads, c.kv, c.ffn, c.seq, c.vocab) == sizes, name
    assert c.dtype == "bfloat16"
  step, params, opt, data = ws.whole_step("llama70b", jax.sharding.AbstractMesh(
      (64, 4), ("x", "y")), layers=4)
  assert {str(a.dtype) for a in jax.tree.leaves(params)} == {"bfloat16"}
  assert {str(a.dtype) for a in jax.tree.leaves((opt["mu"], opt["nu"]))} == {"float32"}
  assert params["layers"]["wk"].shape == (4, 8192, 1024)         # 8 KV heads x 128
  assert set(params["layers"]) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                                   "ln1", "ln2"}
  assert "pos_embed" not in params and data["tokens"].shape == (256, 4096)
  assert opt["mu"]["embed"].sharding.spec == params["embed"].sharding.spec


def test_adam_is_optaxs_adam():
  optax = pytest.importorskip("optax")
  cfg = ws.config("tiny")
  keys = jax.random.split(jax.random.key(1), 4)
  params = {"a": jax.random.normal(keys[0], (3, 5)), "b": jax.random.normal(keys[1], (7,))}
  tx = optax.adam(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
  ours, theirs = (params, ws.adam_init(params)), (params, tx.init(params))
  for k in keys[2:]:
    grads = jax.tree.map(lambda p: jax.random.normal(k, p.shape), params)
    ours = ws.adam_update(cfg, *ours[:1], grads, ours[1])
    updates, state = tx.update(grads, theirs[1], theirs[0])
    theirs = (optax.apply_updates(theirs[0], updates), state)
  assert_trees_close(ours[0], theirs[0], scale=0.1)
  assert_trees_close((ours[1]["mu"], ours[1]["nu"]), (theirs[1][0].mu, theirs[1][0].nu))


def test_sizes_that_do_not_divide_the_mesh_are_named():
  with pytest.raises(ValueError, match=r"model must be one of gpt3, megatron, llama70b, "
                                       r"tiny, tiny_llama or a WholeConfig, got 'gpt4'"):
    ws.config("gpt4")
  with pytest.raises(ValueError, match=r"sizes do not divide the mesh 64x4: batch 8 over 64"):
    ws.whole_step("tiny", jax.sharding.AbstractMesh((64, 4), ("x", "y")), batch=8)
  with pytest.raises(ValueError, match="layers must be a positive int, got 0"):
    ws.config("gpt3", layers=0)
  with pytest.raises(ValueError, match=r"dtype must be 'bfloat16', 'float32' or 'float16' "
                                       r"\(the params'; Adam's moments are float32\), got 'int8'"):
    ws.config("gpt3", dtype="int8")


# Sites of one whole step, derived by hand (the scan holds one copy of each matmul,
# whatever the number of layers):
#   embedding   forward 1 (one-hot @ embed), backward 1 (weight gradient; tokens have no
#               gradient)                                                             2
#   unembedding forward 1, backward 2 (data and weight gradients)                     3
#   a GPT layer, W = 6 weight matmuls + 2 attention einsums:
#               forward 8, remat'd forward 7 (all but w_down, whose output the
#               backward does not need), backward 2 per weight (12) + 2 per einsum (4)
#               = 31, of which the 2 + 2 + 4 attention einsums are left alone (batch
#               and head dims only: nothing to send)
#   a Llama layer, 7 weights (q, k, v, o, gate, up, down) + 2 einsums: 9 + 8 + 14 + 4 = 35
# gpt3: 2 + 3 + 31 = 36; llama70b: 2 + 3 + 35 = 40.
SITES = {"gpt": 36, "llama": 40}
AT_SCALE = {"gpt3": SITES["gpt"], "llama70b": SITES["llama"]}


@pytest.fixture(scope="module", params=["tiny", "tiny_llama"])
def tiny(request):
  """(name, the 8-device step, its inputs): 4 layers, float32, batch 8 on a 2x4 mesh."""
  cfg = ws.config(request.param, layers=4, batch=8)
  return request.param, ws.make_step(cfg, mesh((2, 4))), ws.place(cfg, mesh((2, 4)))


def _run(step, args):
  return step(*jax.tree.map(jnp.copy, args))     # the steps donate params and opt state


def test_the_tiny_step_matches_one_device_and_the_transformed_step_matches_both(tiny):
  """Loss, updated params and Adam moments: `transform(step, ksplit=2)` (slicing forced
  on every site it rewrites) against the same function jitted on one device, and (the
  GPT kind; each compile costs seconds) plain 2x4 jit against both, at the project's
  float32 tolerance (1e-4 of each tensor's largest entry)."""
  name, step, args = tiny
  cfg = ws.config(name, layers=4, batch=8)
  reference = _run(ws.make_step(cfg, mesh((1, 1))), ws.place(cfg, mesh((1, 1))))
  fast = meshslice.transform(step, ksplit=2)
  report = fast.explain(*args)
  assert len(report.sliced) >= 20, report.summary()
  got = _run(fast, args)
  assert np.isfinite(float(reference[2])) and float(reference[2]) > 1.0
  assert_trees_close(got, reference)
  if name == "tiny":
    plain = _run(step, args)
    assert_trees_close(plain, reference)
    assert_trees_close(got, plain)
  assert int(got[1]["count"]) == 1
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                       got[0], args[0])     # on the host: no compile per parameter shape
  assert min(jax.tree.leaves(moved)) > 0.5 * cfg.learning_rate         # Adam stepped


def test_explain_finds_the_layers_fwd_and_bwd_the_embedding_and_the_unembedding(tiny):
  name, step, args = tiny
  report = meshslice.explain(step)(*args)
  assert len(report.sites) == SITES[ws.config(name).kind], report.summary()
  by = {(s.module, s.direction, s.context, s.dataflow) for s in report.rewritten}
  # embedding: forward (one-hot @ embed) and its weight gradient; no data gradient
  assert ("embed", "forward", "top", "os") in by and ("embed", "backward", "top", "rs") in by
  assert [s.direction for s in report.sites if s.module == "embed"] == ["forward", "backward"]
  # unembedding (logits): forward, data and weight gradients
  assert {d for m, _, _, d in by if m == "unembed"} == {"os", "ls", "rs"}
  # the scanned layers: forward in the scan, rematerialized forward + backward in its
  # transpose (the checkpoint's remat)
  weights = ws.GPT_WEIGHTS if name == "tiny" else ws.LLAMA_WEIGHTS
  for w in weights:
    modes = {(d, c, f) for m, d, c, f in by if m == f"layers/{w}"}
    assert ("forward", "scan", "os") in modes, (w, modes)
    assert {"ls", "rs"} <= {f for d, c, f in modes if d == "backward" and "remat" in c}, w
  text = str(report)
  assert " embed " in text and " unembed " in text and "layers/w_down" in text


@pytest.mark.parametrize("name", sorted(AT_SCALE))
def test_explain_at_pod_size_on_abstract_inputs(name):
  before = {id(a) for a in jax.live_arrays()}
  am = jax.sharding.AbstractMesh((64, 4), ("x", "y"),          # Auto on every jax
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
  step, params, opt, data = ws.whole_step(name, am, layers=4)
  assert all(isinstance(a, jax.ShapeDtypeStruct)
             for a in jax.tree.leaves((params, opt, data)))
  report = meshslice.explain(step, profile="tpu-v4")(params, opt, data)
  assert len(report.sites) == AT_SCALE[name], report.summary()
  assert len([s for s in report.left_alone if "nothing to communicate" in s.reason]) == 8
  assert {"embed", "unembed"} <= {s.module for s in report.sites}
  assert report.summary().startswith(f"{AT_SCALE[name]} matmuls:")
  new = [a for a in jax.live_arrays() if id(a) not in before]
  assert sum(a.nbytes for a in new) < 2**20          # nothing the size of a weight


def test_the_step_traces_on_an_explicit_mesh_too():
  cfg = ws.config("tiny", batch=8)
  m = mesh((2, 4), explicit=True)
  step = ws.make_step(cfg, m)
  with jax.set_mesh(m):
    args = ws.place(cfg, m)
    out = jax.eval_shape(step, *args)
    assert out[0]["unembed"].sharding.spec == args[0]["unembed"].sharding.spec
    report = meshslice.explain(step)(*args)
  assert len(report.sites) == SITES["gpt"] and len(report.rewritten) == 28


def test_the_bench_tables_ratios_under_both_link_models(bench_script):
  """bench/tpu_whole_step.py's table from made-up figures (its compiles are minutes)."""
  bench = bench_script("tpu_whole_step")
  fig = lambda step, compute: {"step_s": step, "compute_s": compute,
                               "exposed_s": step - compute, "exposed_by": []}
  records = {"xla": {"alpha-beta": fig(0.9, 0.6), "routed-links": fig(1.0, 0.6),
                     "libtpu_peak_bytes": 6 * 2**30, "compile_s": 200.0},
             "meshslice": {"alpha-beta": fig(0.75, 0.62), "routed-links": fig(0.8, 0.62),
                           "libtpu_peak_bytes": 5 * 2**30, "compile_s": 150.0}}
  by = bench.ratios(records)
  assert by == {"meshslice": {"alpha-beta": pytest.approx(1.2),
                              "routed-links": pytest.approx(1.25)}}
  text = bench.table(records, by)
  assert "| meshslice | alpha-beta | 750.00 | 620.00 | 130.00 | 1.200x | 5.00 | 150 |" in text
  assert "| xla | routed-links | 1000.00 | 600.00 | 400.00 | 1 (base) | 6.00 | 200 |" in text
  # where the exposed time goes, with each model's sync / async split
  split = {"sync_collective_s": 0.1, "sync_exposed_s": 0.12, "async_collective_s": 0.4,
           "async_exposed_s": 0.05}
  for f in records.values():
    for model in bench.MODELS:
      f[model].update(split)
  assert bench.exposure(records, 3).count(
      "sync 100.00 ms (waited 120.00), async 400.00 ms of which 50.00 exposed (12.5 %)") == 4
  # explain's prediction beside the compiled ratio: its saving (80 ms) off XLA's step
  records["meshslice"]["explain"] = {"sites_compared": 3, "xla_sites_s": 0.5,
                                     "plan_sites_s": 0.42}
  told = bench.explain_accuracy.versus_compiled(records["xla"], records["meshslice"],
                                                bench.MODELS).splitlines()
  assert told == [
      "explain: 3 sites priced against XLA, predicted 420.00 vs 500.00 ms (1.190x for "
      "those sites; saving 80.00 ms a step)",
      "  alpha-beta: compiled 1.200x, predicted 1.098x (XLA's step less the saving): "
      "error -8.5%",
      "  routed-links: compiled 1.250x, predicted 1.087x (XLA's step less the saving): "
      "error -13.0%"]


def test_aot_model_step_plans_on_an_abstract_mesh():
  """aot.model_step (the one-layer benchmark model) takes an AbstractMesh as whole_step
  does: planning at pod size needs no TPU topology."""
  from meshslice import aot
  am = jax.sharding.AbstractMesh((64, 4), ("x", "y"),
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
  step, params, data = aot.model_step("gpt3", am)
  assert {leaf.shape[0] for leaf in jax.tree.leaves(data)} == {256}   # a sequence per device
  report = meshslice.explain(step, profile="tpu-v4")(params, data)
  assert len(report.sites) == 31


def test_aot_model_step_whole_is_the_whole_step_on_an_abstract_mesh():
  """aot.model_step(..., whole=True) returns whole_step's (step, params, opt_state, batch)
  with abstract inputs, 4 layers by default; the layer step stays (step, params, batch);
  either way `step, *args` takes it."""
  from meshslice import aot
  am = jax.sharding.AbstractMesh((64, 4), ("x", "y"),
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
  step, *args = aot.model_step("llama70b", am, whole=True)
  params, opt, data = args
  _, *expected = ws.whole_step("llama70b", am, layers=4)
  shapes = lambda tree: jax.tree.map(lambda a: (a.shape, str(a.dtype), a.sharding.spec), tree)
  assert shapes(args) == shapes(expected)
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(args))
  assert params["layers"]["wk"].shape == (4, 8192, 1024) and data["tokens"].shape == (256, 4096)
  assert str(opt["nu"]["embed"].dtype) == "float32"
  # sizes and dtype as whole_step's overrides; the tiny presets keep their float32
  small = jax.sharding.AbstractMesh((2, 4), ("x", "y"),
                                    axis_types=(jax.sharding.AxisType.Auto,) * 2)
  step, params, opt, data = aot.model_step("tiny", small, whole=True, layers=2, seq=8)
  assert params["layers"]["wq"].shape == (2, 64, 64) and data["tokens"].shape == (8, 8)
  assert str(params["embed"].dtype) == "float32"
  report = meshslice.explain(step, profile="tpu-v4")(params, opt, data)
  assert len(report.sites) == SITES["gpt"]
  assert len(aot.model_step("gpt3", small, seq=128)) == 3          # the layer step as before
  with pytest.raises(ValueError, match="'tiny' is a whole-step preset .*: pass whole=True"):
    aot.model_step("tiny", small)


def test_aot_cli_whole_compiles_the_whole_step(tmp_path, capsys):
  """`python -m meshslice aot --whole` compiles whole_step's step (the tiny preset on
  v4:2x2x2; 4 layers by default), plain and rewritten, each in its own process, and
  prints the usual table."""
  pytest.importorskip("libtpu")
  out = tmp_path / "rows.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
  proc = subprocess.run(
      [sys.executable, "-m", "meshslice", "aot", "--whole", "--model", "tiny", "--topology",
       "v4:2x2x2", "--mesh", "2x4", "--variants", "plain,meshslice", "--ksplit", "2",
       f"--json={out}"], capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("tiny whole step (embeddings, 4 layer(s), fwd+bwd, loss, Adam) on v4:2x2x2 as a "
          "2x4 mesh") in proc.stdout
  assert "meshslice report: mesh x=2 x y=4, profile tpu-v4; 36 matmuls: 28 sliced" in proc.stdout
  table = proc.stdout[proc.stdout.index("compute cycles (M)") - 200:]
  header = next(line for line in table.splitlines() if "ratio" in line)
  assert header.split() == ["plain", "meshslice", "ratio"]
  assert "simulated step (ms)" in table and "meshslice vs the best XLA variant (plain" in table
  rows = json.loads(out.read_text())
  assert set(rows) == {"plain", "meshslice"}
  assert all(r["step_s"] > r["compute_s"] > 0 for r in rows.values())
  # a preset outside the layer step's models needs --whole; sizes must divide the mesh.
  # Usage errors, raised before libtpu loads: the CLI's main in this process (no jax
  # start-up per case)
  from meshslice import aot_cli
  for argv, error in ((["--model", "tiny", "--mesh", "2x4"], "need --whole"),
                      (["--whole", "--model", "tiny", "--mesh", "1x8"],
                       "sizes do not divide the mesh 1x8")):
    capsys.readouterr()
    with pytest.raises(SystemExit) as wrong:
      aot_cli.main(argv + ["--topology", "v4:2x2x2"])
    assert wrong.value.code == 2 and error in capsys.readouterr().err
