"""The AOT tooling's module layout (issue 21, R3): the GPT-style model in meshslice.gpt,
the `aot` and `calibrate --aot` CLIs in their own modules, the calibration records built
on `aot.analyze`; every old name still importable from its old module."""
import ast
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from meshslice import aot, aot_cli, aot_sites, calibrate_aot, demo, gpt
from meshslice.costmodel import load_profile, profile_for_mesh
from meshslice.costmodel import tpu_schedule as ts

# `from meshslice import aot` before the split (docs: the public AOT API and its CLI)
AOT_NAMES = ("Generation", "GENERATIONS", "have_libtpu", "parse_topology", "topology_name",
             "set_flags", "topology", "make_mesh", "abstract_args", "compile", "AotResult",
             "analyze", "compare_candidates", "model_step", "compare", "format_table", "main",
             "ASYNC_FLAGS", "DENSE_FLAGS", "FLAG_PRESETS", "preset_flags", "VARIANTS",
             "XLA_VARIANTS", "variant_flags", "versus_best_xla")
GPT_NAMES = ("ModelConfig", "GPT3_LAYER", "WEIGHTS", "init_params", "init_batch", "layernorm",
             "block", "loss_fn", "train_step", "param_specs", "batch_specs", "make_mesh",
             "make_step", "make_grad_step", "place", "abstract_inputs")


def test_aot_keeps_every_name():
  missing = [name for name in AOT_NAMES if not hasattr(aot, name)]
  assert not missing, missing


def test_the_cli_names_of_aot_are_the_cli_modules():
  assert aot.format_table is aot_cli.format_table
  assert aot.main is aot_cli.main
  assert aot_sites.calibrate_main is calibrate_aot.calibrate_main
  assert aot_sites.DEFAULT_SHAPES == calibrate_aot.DEFAULT_SHAPES
  with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
    aot.nonesuch  # noqa: B018
  with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
    aot_sites.nonesuch  # noqa: B018


def test_importing_the_api_modules_loads_neither_cli():
  script = ("import sys, meshslice.aot, meshslice.aot_sites, meshslice.demo; "
            "print(sorted(m for m in ('meshslice.aot_cli', 'meshslice.calibrate_aot') "
            "if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items()
                                         if k != "XLA_FLAGS"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]"


def test_demo_reexports_the_model_from_gpt():
  for name in GPT_NAMES:
    if name != "block":
      assert getattr(demo, name) is getattr(gpt, name), name
  assert demo._block is gpt.block          # the old private name (bench imported it)
  assert demo._layernorm is gpt.layernorm


def test_aot_sites_ends_with_its_subprocess_worker_guard():
  tree = ast.parse(open(aot_sites.__file__).read())
  last = tree.body[-1]
  assert isinstance(last, ast.If) and ast.unparse(last.test) == "__name__ == '__main__'"
  assert "_worker" in ast.unparse(last)


def test_compare_takes_topology_and_its_old_keyword():
  # the topology is parsed first: a bad name proves which argument it came from
  with pytest.raises(ValueError, match="topology 'v9:2x2'"):
    aot.compare("gpt3", "v9:2x2", (2, 2))
  with pytest.raises(ValueError, match="topology 'v9:2x2'"):
    aot.compare("gpt3", topology_name_="v9:2x2", mesh_shape=(2, 2))
  with pytest.raises(TypeError, match="both topology and topology_name_"):
    aot.compare("gpt3", "v4:2x2x1", (2, 2), topology_name_="v4:2x2x1")
  with pytest.raises(TypeError, match="needs a topology"):
    aot.compare("gpt3", mesh_shape=(2, 2))


# one all-gather over the 4 devices of a 2x2 mesh, then a dot and a relayout copy
_HLO = textwrap.dedent("""
    HloModule m, is_scheduled=true, num_partitions=4

    %dot (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {
      %a = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
      %b = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
      ROOT %conv = bf16[1024,1024]{1,0:T(8,128)(2,1)} convolution(%a, %b), dim_labels=bf_io->bf
    }

    ENTRY %main (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[4096,1024] {
      %p0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
      %p1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
      %ag = bf16[4096,1024]{1,0:T(8,128)(2,1)} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
      %f = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%p1, %p1), kind=kOutput, calls=%dot, backend_config={"flag_configs":[],"window_config":{"estimated_cycles":"105000"}}
      %t = bf16[1024,1024]{0,1:T(8,128)(2,1)} copy(%f), backend_config={"estimated_cycles":"21000"}
      ROOT %r = bf16[4096,1024]{1,0:T(8,128)(2,1)} add(%ag, %ag), backend_config={"estimated_cycles":"0"}
    }""").strip()  # noqa: E501 (HLO lines as the compiler prints them)


@dataclasses.dataclass
class _Compiled:
  """What aot.analyze reads of a compiled program: its text and (no) memory analysis."""
  text: str

  def as_text(self):
    return self.text

  def memory_analysis(self):
    return None


def test_calibration_record_is_the_aot_result_plus_expanded_counts():
  result = aot.analyze(_Compiled(_HLO), "tpu-v4", compile_s=1.5, mesh_shape=(2, 2),
                       ring_shares=False)
  record = aot_sites._record(result)
  # the derivation aot_sites had before it was built on aot.analyze
  schedule = ts.read_schedule(_HLO, chip="tpu-v4")
  summary = ts.summarize(schedule)
  sim = ts.simulate(schedule, profile_for_mesh(load_profile("tpu-v4"), (2, 2)),
                    clock_hz=ts.CLOCK_HZ["tpu-v4"])
  assert record == {
      "compute_cycles": summary.compute_cycles, "dot_cycles": summary.dot_cycles,
      "copy_cycles": summary.copy_cycles, "other_cycles": summary.other_cycles,
      "relayout_copies": summary.relayout_copies, "dots": [(105000, 2 * 1024 ** 3, 1)],
      "sync": {"all-gather": 1}, "async": {},
      "collective_bytes": summary.total_collective_bytes,
      "windowed_einsum_loops": summary.windowed_einsum_loops, "step_s": sim.step_s,
      "compute_s": sim.compute_s, "exposed_s": sim.exposed_s,
      "sync_collective_s": sim.sync_collective_s}
  assert record["dot_cycles"] == 105000 and record["copy_cycles"] == 21000
  # ring_shares only drops the per-algorithm link share; with none in this program, the
  # default simulation is the same
  assert aot.analyze(_Compiled(_HLO), "tpu-v4", mesh_shape=(2, 2)).simulation == sim
