"""bench/algorithms.py run tiny, as a user would run it: a row for every algorithm on
every (mesh, dataflow), every result equal to x @ w, and the byte ratios the algorithms
promise (sliced and ring collectives move exactly what the plain collectives move)."""
import os
import subprocess
import sys

from cpu_flags import CPU_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--hidden=32", "--tokens=64", "--meshes=2x2,2x4", "--sites=mlp_up",
        "--ksplits=2", "--repeats=1", "--warmup=0"]
ALL = {"gspmd", "collective", "meshslice-s2", "cannon", "wang", "wang-bidi", "summa"}


def test_tiny_run_has_every_algorithm_and_exact_byte_ratios():
  env = dict(os.environ, XLA_FLAGS=CPU_XLA_FLAGS, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "algorithms.py"), *TINY],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  lines = done.stdout.splitlines()
  start = next(i for i, l in enumerate(lines) if l.split()[:2] == ["mesh", "site"])
  rows = [l.split() for l in lines[start + 1:] if l and l[0].isdigit()]
  assert rows and all(len(r) == 10 for r in rows)
  table = {(r[0], r[2], r[3]): r for r in rows}
  assert len(table) == len(rows)                        # one row per (mesh, flow, algorithm)
  for mesh in ("2x2", "2x4"):
    for flow in ("os", "ls", "rs"):
      # cannon needs a square mesh; everything else serves both.
      expect = ALL if mesh == "2x2" else ALL - {"cannon"}
      assert {a for (m, f, a) in table if (m, f) == (mesh, flow)} == expect
      for algorithm in ("collective", "meshslice-s2", "wang", "wang-bidi"):
        assert table[mesh, flow, algorithm][6] == "1.00x", table[mesh, flow, algorithm]
      for algorithm in ("cannon", "summa"):              # more traffic than collective
        if (mesh, flow, algorithm) in table:
          assert float(table[mesh, flow, algorithm][6].rstrip("x")) > 1.5
      assert table[mesh, flow, "gspmd"][8] == "1.00x"     # the time baseline
  assert all(r[9] == "ok" for r in rows)
