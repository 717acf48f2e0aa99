"""Behaviour-neutrality snapshot: plan JSON, report text and lowered StableHLO of a fixed
corpus, written one file per case so two snapshots can be diffed.

    python tests/snapshot_corpus.py /tmp/before      # on the old commit
    python tests/snapshot_corpus.py /tmp/after       # on the new one
    diff -r /tmp/before /tmp/after                   # must print nothing

The corpus: the demo's GPT step (default plan and every algorithm pinned, on the 2x4 CPU
mesh, abstract inputs), the GPT-3 layer planned at pod size for CPU and TPU profiles,
the MaxText-style example step, and the first fuzz seeds (derandomized hypothesis, the
same strategies as tests/test_fuzz.py) for single dot_generals and small programs.
Nothing is compiled; each case is traced, planned and lowered.

A refactor that moves meshslice's own model code (the demo GPT) changes the `source`
column of that model's sites; sources inside meshslice_pass/ are therefore written as
`<meshslice>` so only user-code lines are compared, and report tables are compared cell by
cell (runs of spaces and dashes collapsed: column widths follow the longest source).
"""
from __future__ import annotations

import os
import re
import sys
import traceback

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")     # as tests/conftest.py: CPU even with libtpu

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import meshslice  # noqa: E402
from meshslice import demo, gpt  # noqa: E402

_OWN_SOURCE = re.compile(r"meshslice_pass/[A-Za-z_]+\.py:\d+")
N_DOT_SEEDS = 40
N_PROGRAM_SEEDS = 12


def _normalize(text: str, table: bool = False) -> str:
  text = _OWN_SOURCE.sub("<meshslice>", text)
  if table:    # a report's column widths follow the longest source: compare cells only
    text = re.sub(r" {2,}", "  ", re.sub(r"-{2,}", "--", text))
  return text


class Writer:
  def __init__(self, out: str):
    self.out = out
    os.makedirs(out, exist_ok=True)
    self.failures = 0

  def case(self, name: str, transformed, *args, mesh=None, lower=True):
    """Explain (plan JSON + report) and lower (StableHLO) one transformed step."""
    def run():
      report = transformed.explain(*args)
      self._write(f"{name}.plan.json", report.plan.to_json())
      self._write(f"{name}.report.txt", str(report), table=True)
      if lower:
        self._write(f"{name}.stablehlo.mlir", transformed.lower(*args).as_text())
    try:
      if mesh is not None:
        with jax.set_mesh(mesh):
          run()
      else:
        run()
    except Exception as e:  # noqa: BLE001 - a case that fails is itself a snapshot fact
      self.failures += 1
      self._write(f"{name}.error.txt", f"{type(e).__name__}: {e}\n")
      traceback.print_exc()

  def _write(self, fname: str, text: str, table: bool = False):
    with open(os.path.join(self.out, fname), "w") as f:
      f.write(_normalize(text, table))


def demo_cases(w: Writer):
  cfg = gpt.ModelConfig()
  mesh = gpt.make_mesh((2, 4))
  params, batch = gpt.abstract_inputs(cfg, mesh)
  step = gpt.make_step(cfg, mesh)
  w.case("demo_default", meshslice.transform(step), params, batch)
  for algorithm, ksplit in (("meshslice", 2), ("collective", None), ("cannon", None),
                            ("wang", None), ("summa", 2)):
    opts = {"algorithm": algorithm}
    if ksplit:
      opts["ksplit"] = ksplit
    w.case(f"demo_{algorithm}", meshslice.transform(step, **opts), params, batch)
  grad_step = gpt.make_grad_step(cfg, mesh)
  w.case("demo_grad_step", meshslice.transform(grad_step), params, batch)


def pod_cases(w: Writer):
  for profile in ("tpu-v4", None):
    lines = []
    demo.plan_at_scale(echo=lines.append, **({"profile": profile} if profile else {}))
    w._write(f"pod_gpt3_{profile or 'default'}.txt", "\n".join(lines) + "\n")


def maxtext_cases(w: Writer):
  import maxtext_style_step as mts
  from jax.sharding import AxisType
  for name, cfg, shape in (("maxtext_tiny", mts.TINY, (1, 2, 4)),
                           ("maxtext_tiny_data2", mts.TINY, (2, 2, 2))):
    mesh = jax.make_mesh(shape, ("data", "x", "y"), axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:8])
    step, args, _, _ = mts.make_step(cfg, mesh)
    w.case(name, meshslice.transform(step), *args)
  mesh = jax.sharding.AbstractMesh((2, 16, 8), ("data", "x", "y"),
                                   axis_types=(AxisType.Auto,) * 3)
  step, args, _, _ = mts.make_step(mts.POD, mesh)
  w.case("maxtext_pod", meshslice.transform(step), *args, lower=False)


def fuzz_cases(w: Writer):
  import fuzzing
  from hypothesis import given, settings
  from test_fuzz import SETTINGS

  dots, programs = [], []

  @settings(max_examples=N_DOT_SEEDS, **SETTINGS)
  @given(fuzzing.dot_cases())
  def collect_dots(case):
    dots.append(case)

  @settings(max_examples=N_PROGRAM_SEEDS, **SETTINGS)
  @given(fuzzing.program_cases())
  def collect_programs(case):
    programs.append(case)

  collect_dots()
  collect_programs()
  for i, case in enumerate(dots):
    mesh = fuzzing.make_mesh(case.mesh_shape, case.mesh_names, case.explicit)
    _, step = fuzzing._dot_step(case, mesh)
    ls = NamedSharding(mesh, fuzzing.spec_of(case.lhs_axes))
    rs = NamedSharding(mesh, fuzzing.spec_of(case.rhs_axes))
    lhs, rhs, ct = case.shapes()
    dt = jnp.dtype(case.dtype)
    a = jax.ShapeDtypeStruct(lhs, dt, sharding=ls)
    b = jax.ShapeDtypeStruct(rhs, dt, sharding=rs)
    if case.explicit:
      try:
        with jax.set_mesh(mesh):
          out_type = jax.eval_shape(_, a, b)
      except Exception:  # noqa: BLE001 - jax rejects the case; nothing to snapshot
        continue
      c = jax.ShapeDtypeStruct(ct, dt, sharding=NamedSharding(mesh, out_type.sharding.spec))
      plain = jax.jit(step)
    else:
      c = jax.ShapeDtypeStruct(ct, dt, sharding=NamedSharding(mesh, P()))
      outs = (NamedSharding(mesh, fuzzing.spec_of(case.out_axes))
              if case.out_via == "jit" and case.out_axes is not None else None)
      plain = jax.jit(step, in_shardings=(ls, rs, c.sharding), out_shardings=(outs, (ls, rs)))
    try:
      fuzzing._call(plain.trace, case, mesh, a, b, c)
    except Exception:  # noqa: BLE001
      continue
    try:
      transformed = meshslice.transform(plain, **case.options)
    except Exception as e:  # noqa: BLE001
      w._write(f"dot{i:02d}.error.txt", f"{type(e).__name__}: {e}\n")
      continue
    w._write(f"dot{i:02d}.case.txt", repr(case) + "\n")
    w.case(f"dot{i:02d}", transformed, a, b, c, mesh=mesh if case.explicit else None)
  for i, case in enumerate(programs):
    mesh = fuzzing.make_mesh(case.mesh_shape, case.mesh_names, case.explicit)
    ws, x = case.data()
    lead = (None,) if case.wrapper == "vmap" else ()
    step = fuzzing._program_fn(case, mesh)
    w_sh = [NamedSharding(mesh, fuzzing.spec_of(e)) for _, e in case.weights]
    x_sh = NamedSharding(mesh, fuzzing.spec_of(case.x_axes))
    wss = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s) for v, s in zip(ws, w_sh)]
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype,
                              sharding=NamedSharding(mesh, P(*lead, *fuzzing.spec_of(case.x_axes))))
    if case.explicit:
      plain = jax.jit(step)
    else:
      out_sh = ((NamedSharding(mesh, P()), (w_sh, x_sh)) if case.out_shardings else None)
      plain = jax.jit(step, in_shardings=(w_sh, x_sh), out_shardings=out_sh)
    try:
      transformed = meshslice.transform(plain, **case.options)
      wrapped = fuzzing._wrap(case, transformed, len(ws))
    except Exception as e:  # noqa: BLE001
      w._write(f"prog{i:02d}.error.txt", f"{type(e).__name__}: {e}\n")
      continue
    w._write(f"prog{i:02d}.case.txt", repr(case) + "\n")
    if wrapped is transformed or case.wrapper is None:
      w.case(f"prog{i:02d}", transformed, wss, xs, mesh=mesh if case.explicit else None)
    else:   # vmap-style wrappers: the report only (the wrapper is not a Transformed)
      try:
        ctx = jax.set_mesh(mesh) if case.explicit else fuzzing._nullctx()
        with ctx:
          jaxpr = jax.make_jaxpr(wrapped)(wss, xs)
        w._write(f"prog{i:02d}.jaxpr.txt", str(jaxpr))
      except Exception as e:  # noqa: BLE001
        w._write(f"prog{i:02d}.error.txt", f"{type(e).__name__}: {e}\n")


def cli_cases(w: Writer):
  """The CLI's help texts and one planning-only autotune table."""
  import subprocess
  runs = {"cli_help": ["--help"], "cli_demo_help": ["demo", "--help"],
          "cli_aot_help": ["aot", "--help"], "cli_calibrate_help": ["calibrate", "--help"],
          "cli_autotune_help": ["autotune", "--help"],
          "cli_autotune_gpt3": ["autotune", "--model", "gpt3", "--chips", "256"]}
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for name, args in runs.items():
    r = subprocess.run([sys.executable, "-m", "meshslice", *args], capture_output=True,
                       text=True, env=env, timeout=600)
    w._write(f"{name}.txt", f"rc={r.returncode}\n{r.stdout}")


def main(argv):
  if len(argv) != 2:
    print(__doc__)
    return 2
  w = Writer(argv[1])
  for part in (demo_cases, pod_cases, maxtext_cases, fuzz_cases, cli_cases):
    try:
      part(w)
    except Exception as e:  # noqa: BLE001
      w.failures += 1
      w._write(f"{part.__name__}.error.txt", f"{type(e).__name__}: {e}\n")
      traceback.print_exc()
    print(f"{part.__name__}: done", flush=True)
  print(f"{len(os.listdir(w.out))} files in {w.out}; {w.failures} failing parts")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
