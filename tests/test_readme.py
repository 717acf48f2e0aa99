"""The quick starts run verbatim (each in a fresh interpreter, as a user would paste it):
the README's (Auto axes) and the guide's (Explicit axes), and what they promise shows up:
a report, and shard_maps in `jax.make_jaxpr` of the transformed step."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"


def _snippets():
  blocks = []
  for page in (README, GUIDE):
    blocks += re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
  return [b for b in blocks if "import meshslice" in b]


def test_readme_is_a_front_door():
  """The README stays short: the guide and the docs hold the rest."""
  assert len(README.read_text().splitlines()) <= 200


def test_readme_has_the_auto_and_explicit_quick_starts():
  snippets = _snippets()
  assert len(snippets) == 2
  assert "AxisType.Auto" in snippets[0] and "jax.set_mesh" in snippets[1]
  assert all("jax.make_jaxpr(fast_step)" in s for s in snippets)


@pytest.mark.parametrize("index", [0, 1], ids=["auto", "explicit"])
def test_readme_snippet_runs_verbatim(index, tmp_path):
  code = _snippets()[index]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert "meshslice report:" in out
  assert out.count("shard_map[") == 5      # every site, forward and backward, is rewritten
  assert "UserWarning" not in done.stderr
