"""Hardware profiles, time models and the autotuner (see docs/costmodel.md).

The cost model knows the algorithms of `meshslice.rewrites` by name and shape only; it
never imports the pass or the rewrites.

  profiles      HardwareProfile, load_profile / save_profile, the shipped JSON profiles
  interconnect  Topology: the network a profile describes (data only)
  topology      per-mesh-axis bandwidth from the torus / node geometry (profile_for_mesh)
  timing        GemmProblem, Cost, the collective / GEMM formulas, movements, schedules,
                predict, lower_bound
  memory        per-site peak bytes of a plan, chip capacity, training-step memory
  timeline      predicted schedules as Chrome / Perfetto trace JSON
  site_choice   one site's plan: the autotuner's best_plan and the pass's choose, one room
                so the two rules sit side by side where pass and mesh study reach them
  mesh_study    whole models: recommend_mesh, evaluate_mesh, transformer_memory; apart,
                since it grows with models and layouts, not with how a site is chosen
  autotune      the old import path: re-exports site_choice and mesh_study
  cli           `python -m meshslice autotune`
  fitting       fits of the collective and GEMM models to timings, rank / spearman
  calibrate     the measurement harness and `python -m meshslice calibrate`
  xla_baseline  CompilerTerms, candidates re-priced as compiled, XLA's own program
  compiler_fit  CompilerTerms fitted to compiled single-GEMM programs
  hlo_text      the one HLO text parser: types and bytes, replica groups, trip counts
  tpu_read      compiled TPU programs read as CompiledOp / CompiledSchedule records, and
                the chip table (CLOCK_HZ); apart: tpu_simulate and libtpu_log stand on it
  tpu_simulate  the predicted step time of a read schedule (simulate, Wait); apart, since
                link models and clocks change for other reasons than the reading
  libtpu_log    libtpu's scheduler totals from its compile log: a second opinion beside
                the simulation, not an input to it
  tpu_schedule  the old import path: re-exports tpu_read, tpu_simulate and libtpu_log
  routed_links  a second link model for the simulation: collectives routed over torus links

Example:
  >>> from meshslice.costmodel import GemmProblem, best_plan
  >>> best_plan(GemmProblem(m=65536, n=12288, k=12288, rows=8, cols=8), "tpu-v4",
  ...           dataflows=("os",)).ksplit
  8
"""
from . import memory, xla_baseline  # noqa: F401  (xla_baseline registers its profile section check)
from .autotune import (Choice, LayerChoice, LayerProblem, MeshRecommendation,
                       MeshResult, ModelSpec, best_plan, evaluate_mesh, mesh_shapes,
                       model_spec, paper_assumptions, recommend_mesh, transformer_memory,
                       transformer_problems, valid_ksplits, variants)
from .memory import (MemoryEstimate, chip_capacity, site_memory, site_peak_bytes,
                     why_too_big)
from .profiles import (CollectiveParams, GemmEfficiency, HardwareProfile, known_profiles,
                       load_profile, save_profile)
from .timeline import trace_events, write_trace
from .timing import (ALGORITHMS, DATAFLOWS, Cost, GemmProblem, Schedule, algorithm_doc,
                     algorithm_options, lower_bound, predict, schedule, wang_ring_axis,
                     why_invalid)
from .topology import Topology, describe_axes, profile_for_mesh

__all__ = ["ALGORITHMS", "DATAFLOWS", "Choice", "CollectiveParams", "Cost", "GemmEfficiency",
           "GemmProblem", "HardwareProfile", "LayerChoice", "LayerProblem", "MemoryEstimate",
           "MeshRecommendation", "MeshResult", "ModelSpec", "Schedule", "Topology",
           "algorithm_doc", "algorithm_options", "chip_capacity",
           "best_plan", "describe_axes", "evaluate_mesh", "known_profiles", "lower_bound",
           "load_profile", "mesh_shapes", "model_spec", "paper_assumptions", "predict",
           "profile_for_mesh", "recommend_mesh", "save_profile", "schedule", "site_memory",
           "site_peak_bytes",
           "trace_events", "transformer_memory", "transformer_problems", "valid_ksplits",
           "variants", "wang_ring_axis", "why_invalid", "why_too_big", "write_trace"]
