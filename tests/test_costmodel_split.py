"""The split costmodel modules: the chip table agrees with the profiles, and every moved
name still answers at its old home (tpu_schedule, autotune, meshslice.costing) as the
very object of its new one."""
import pytest

from meshslice import costing
from meshslice.costmodel import (autotune, libtpu_log, mesh_study, profiles, site_choice,
                                 tpu_read, tpu_schedule, tpu_simulate)


def test_clock_times_flops_per_cycle_is_the_profiles_peak():
  # Two tables state each TPU's peak: the simulator's (clock x MXU FLOPs per cycle, which
  # turns compiler cycles into seconds) and the profile's peak_flops (which the cost model
  # divides FLOPs by). Checked here so that they cannot drift apart.
  both = sorted(set(tpu_simulate.CLOCK_HZ) & set(profiles.known_profiles()))
  assert set(both) >= {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"}
  for name in both:
    peak = tpu_simulate.CLOCK_HZ[name] * tpu_simulate.FLOPS_PER_CYCLE[name]
    assert peak == pytest.approx(profiles.load_profile(name).peak_flops, rel=0.005), name


def _same(old, new, names):
  for name in names:
    assert getattr(old, name) is getattr(new, name), (old.__name__, name)


def test_tpu_schedule_re_exports_the_reader_the_simulator_and_the_log():
  _same(tpu_schedule, tpu_read, ["CLOCK_HZ", "FLOPS_PER_CYCLE", "KINDS", "CompiledOp",
                                 "CompiledSchedule", "Entry", "Loop",
                                 "Summary", "parse_module", "read_schedule", "summarize",
                                 "_Reader", "_permute_link", "_strategy", "_strategy_cores"])
  _same(tpu_schedule, tpu_simulate, ["Simulation", "Wait", "axis_torus_dims",
                                     "collective_seconds", "simulate", "CLOCK_HZ"])
  _same(tpu_schedule, libtpu_log, ["SCHEDULER_LOG_ENV", "SchedulerTotals", "capture_stderr",
                                   "read_scheduler_log", "scheduler_cycles",
                                   "scheduler_entry", "scheduler_loop_cycles"])
  assert all(hasattr(tpu_schedule, n) for n in tpu_schedule.__all__)


def test_the_old_schedule_names_still_resolve_with_a_deprecation_warning():
  # timing has its own Op and Schedule; the compiled-schedule ones are CompiledOp and
  # CompiledSchedule, and the old names warn, naming the new one
  for old, new in (("Op", "CompiledOp"), ("Schedule", "CompiledSchedule")):
    with pytest.warns(DeprecationWarning, match=rf"tpu_schedule\.{old} is deprecated.*{new}"):
      assert getattr(tpu_schedule, old) is getattr(tpu_read, new)
    assert old not in tpu_schedule.__all__
  with pytest.warns(DeprecationWarning):
    from meshslice.costmodel.tpu_schedule import Schedule  # noqa: F401
  with pytest.raises(AttributeError, match="no attribute 'Nope'"):
    _ = tpu_schedule.Nope


def test_autotune_re_exports_the_site_rule_and_the_mesh_study():
  _same(autotune, site_choice, ["EMITTABLE", "NEAR_TIE", "Choice", "best_plan",
                                "valid_ksplits", "variants"])
  _same(autotune, mesh_study, ["ASSUMPTIONS", "DATAFLOW_POLICIES", "FF_LAYERS", "LAYOUTS",
                               "MODELS", "Comparison", "LayerChoice", "LayerProblem",
                               "MeshRecommendation", "MeshResult", "ModelSpec",
                               "compare_algorithms", "evaluate_mesh", "mesh_shapes",
                               "model_spec", "other_layer_time", "paper_assumptions",
                               "paper_layout", "paper_mesh_shapes", "recommend_mesh",
                               "transformer_memory", "transformer_problems"])
  assert all(hasattr(autotune, n) for n in autotune.__all__)


def test_costing_re_exports_the_pass_rule():
  _same(costing, site_choice, ["NEAR_TIE", "NO_PLAN_FITS", "XLA_MARGIN", "PlanChoice",
                               "choose", "leave_to_xla", "predict", "xla_program"])
  assert costing.Choice is site_choice.PlanChoice
  # the pass's candidates are the autotuner's default ones
  assert costing.AUTO_ALGORITHMS is site_choice.EMITTABLE
