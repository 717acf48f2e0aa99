"""The scripts in examples/ run, at tiny sizes, and say what they should (issue 11 item 7).

Each runs in its own process on 8 emulated CPU devices. The TPU ahead-of-time part is
skipped (--no-aot) except in one script, where it runs when libtpu is installed.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from cpu_flags import CPU_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

pytest.importorskip("flax")
pytest.importorskip("optax")


def _run(script, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu", MESHSLICE_EXAMPLE_TINY="1",
             XLA_FLAGS=CPU_XLA_FLAGS)
  proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--tiny", *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (f"{script} exited {proc.returncode}:\n"
                                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
  return proc.stdout


def _assert_common(out, sites, module):
  lines = out.splitlines()
  assert lines[-1] == "OK"
  head = next(l for l in lines if l.startswith("meshslice report: mesh"))
  assert f"; {sites} matmuls: " in head and "left alone" in head
  assert module in out                                 # module paths in the report
  assert any(l.startswith("meshslice.check: OK:") for l in lines)
  forced = next(l for l in lines if l.startswith("forced ksplit=2: "))
  assert int(re.search(r"(\d+) sliced/overlapped", forced).group(1)) > 0
  assert any(l.startswith("plan saved to plan.json") for l in lines)
  assert "DIFFER" not in out
  assert any(l.startswith("pod plan (") and " matmuls: " in l for l in lines)
  assert any(l.startswith("pod plan: predicted matmul time") for l in lines)


def test_flax_linen_logical_axes():
  out = _run("flax_linen_logical_axes.py", "--no-aot")
  _assert_common(out, 24, "Model/block_0/Mlp_0/wo")
  assert "aot: skipped (--no-aot)" in out


def test_flax_nnx_explicit():
  out = _run("flax_nnx_explicit.py", "--no-aot")
  _assert_common(out, 24, "blocks/0/mlp/wi")           # a list of blocks: one name each
  assert "blocks/0/attn/value" in out                 # named by attribute, per projection
  assert "(cpu, Explicit axes)" in out


def test_maxtext_style_step():
  out = _run("maxtext_style_step.py")
  _assert_common(out, 34, "scan > remat")
  assert "'data': 1, 'x': 2, 'y': 4" in out
  aot_line = next(l for l in out.splitlines() if l.startswith("aot: "))
  assert aot_line.startswith("aot: compiled for v4:2x2x2") or "libtpu not installed" in aot_line


def test_flax_linen_fsdp_tensor():
  out = _run("flax_linen_fsdp_tensor.py")
  lines = out.splitlines()
  assert lines[0] == ("51 matmuls: 0 sliced/overlapped, 39 plain collective, 12 left alone "
                      "(12 no mesh axis shards a non-batch dim)")
  # the weight gradients reduce-scattered onto the optimizer's (fsdp, tensor) layout
  assert "   13  collective: 1d-scatter" in lines
  assert lines[-3].startswith("forced ksplit=2: 51 matmuls: 39 sliced/overlapped")
  assert lines[-2].startswith("meshslice.check: OK: 53 of 53 outputs agree")
  assert lines[-1] == "OK"


def test_maxtext_train():
  """Without MaxText (Python >= 3.12, ~250 packages: never in the normal suite) the script
  names the install steps and exits 0; with it (docs/maxtext.md), the real trainer's step
  is explained, pinned by module path and checked."""
  import importlib.util
  if importlib.util.find_spec("maxtext") is None:
    out = _run("maxtext_train.py")
    assert out.startswith("skipped: this example needs MaxText")
    assert '"maxtext[tpu]==0.2.5" "jax[tpu]==0.12.0.1"' in out
    return
  out = _run("maxtext_train.py", "--no-aot")
  lines = out.splitlines()
  assert lines[-1] == "OK"
  assert any(l.startswith("meshslice report: mesh fsdp=2 x tensor=4") for l in lines)
  pinned = next(l for l in lines if l.startswith("overrides={'*/mlp/wo'"))
  assert "decoder/layers/mlp/wo (forward)" in pinned and "wi_" not in pinned
  assert any(l.startswith("meshslice.check: OK:") for l in lines)
