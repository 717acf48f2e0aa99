"""The cost model: formulas against hand-derived numbers, the autotuner's choices,
determinism, hardware profiles and traces. No JAX needed."""
import dataclasses
import doctest
import json

import pytest

from meshslice.costmodel import autotune, memory, profiles, timeline, timing, topology
from meshslice.costmodel.autotune import (Choice, best_plan, evaluate_mesh, mesh_shapes,
                                          model_spec, recommend_mesh, transformer_problems,
                                          valid_ksplits, variants)
from meshslice.costmodel.profiles import (CollectiveParams, GemmEfficiency, HardwareProfile,
                                          known_profiles, load_profile, save_profile)
from meshslice.costmodel.timeline import trace_events, write_trace
from meshslice.costmodel.timing import (ALGORITHMS, DATAFLOWS, Cost, GemmProblem,
                                        all_reduce_time, collective_time, gemm_time,
                                        lower_bound, permute_time, predict, schedule,
                                        why_invalid)

approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)


def _pair(a, b=None):
  return (a, a if b is None else b)


# Distinct numbers per dim and per kind, so a mixed-up axis or kind shows up.
PROF = HardwareProfile(
    name="test", peak_flops=1e12,
    all_gather=CollectiveParams(bandwidth=(1e9, 2e9), hop_latency=(1e-6, 2e-6),
                                base_overhead=(1e-5, 2e-5)),
    reduce_scatter=CollectiveParams(bandwidth=(0.5e9, 1e9), hop_latency=(1e-6, 2e-6),
                                    base_overhead=(3e-5, 4e-5)),
    permute=CollectiveParams(bandwidth=(2e9, 4e9), hop_latency=_pair(5e-6),
                             base_overhead=_pair(1e-5)),
    # Saturation at 1 element: every matmul runs at peak.
    gemm=GemmEfficiency(max_efficiency=1.0, m_sat=1, n_sat=1, k_sat=1))

# The OS / Wang / SUMMA example: X[2000, 4000] . W[4000, 4000] on a 2 x 4 mesh.
# X shard (m/R)(k/C) = 1000 * 1000 * 2 B = 2e6 B (col link, dim 1, n = 4);
# W shard (k/R)(n/C) = 2000 * 1000 * 2 B = 4e6 B (row link, dim 0, n = 2).
OS = GemmProblem(m=2000, n=4000, k=4000, rows=2, cols=4, in_bytes=2, out_bytes=4)


# ------------------------------------------------------------------------------ formulas

def test_collective_time_formula():
  # base + (n-1) b / bw + (n-1) hop on dim 1: 2e-5 + 3 * 2e6 / 2e9 + 3 * 2e-6 = 3.026e-3
  assert collective_time(PROF, "all_gather", 1, 4, 2e6) == approx(3.026e-3)
  # reduce-scatter on dim 0: 3e-5 + 1 * 1e6 / 0.5e9 + 1 * 1e-6 = 2.031e-3
  assert collective_time(PROF, "reduce_scatter", 0, 2, 1e6) == approx(2.031e-3)
  # a size-1 axis issues no collective
  assert collective_time(PROF, "all_gather", 0, 1, 1e9) == 0.0


def test_permute_and_all_reduce_formulas():
  # permute dim 1, 3 hops: 1e-5 + 2e6 / 4e9 + 3 * 5e-6 = 5.25e-4
  assert permute_time(PROF, 1, 2e6, hops=3) == approx(5.25e-4)
  # all-reduce of 4e6 B on dim 1, n = 4 = reduce-scatter + all-gather of 1e6 B:
  #   (4e-5 + 3 * 1e6 / 1e9 + 3 * 2e-6) + (2e-5 + 3 * 1e6 / 2e9 + 3 * 2e-6)
  #   = 3.046e-3 + 1.526e-3
  assert all_reduce_time(PROF, 1, 4, 4e6) == approx(4.572e-3)
  assert all_reduce_time(PROF, 1, 1, 4e6) == 0.0


def test_gemm_efficiency_and_time():
  eff = GemmEfficiency(max_efficiency=0.8, m_sat=256, n_sat=256, k_sat=256)
  # 0.8 * min(1, 128/256) * min(1, 512/256) * min(1, 64/256) = 0.8 * 0.5 * 1 * 0.25
  assert eff(128, 512, 64) == approx(0.1)
  prof = dataclasses.replace(PROF, gemm=eff)
  # 2 * 3 (batch) * 128 * 512 * 64 = 25165824 FLOP at 1e12 * 0.1 FLOP/s
  assert gemm_time(prof, 128, 512, 64, batch=3) == approx(25165824 / 1e11)
  # full efficiency once saturated: 2 * 1000^3 / (1e12 * 0.8) = 2.5e-3
  assert gemm_time(prof, 1000, 1000, 1000) == approx(2.5e-3)


def test_collective_os_by_hand():
  # all-gather X (dim 1): 2e-5 + 3 * 2e6 / 2e9 + 3 * 2e-6 = 3.026e-3
  # all-gather W (dim 0): 1e-5 + 4e6 / 1e9 + 1e-6      = 4.011e-3
  # matmul (1000, 1000, 4000): 8e9 FLOP / 1e12         = 8e-3
  # the two gathers are synchronous and run one after the other (as the TPU compiler
  # schedules them), then the matmul: total = 3.026e-3 + 4.011e-3 + 8e-3, nothing hidden
  c = predict(OS, "collective", "os", 1, PROF)
  assert c == Cost(compute_s=approx(8e-3), comm_s=approx(7.037e-3),
                   exposed_comm_s=approx(7.037e-3), total_s=approx(15.037e-3))


def test_meshslice_os_by_hand():
  # S = 2: X slice 2e-5 + 3 * 1e6 / 2e9 + 6e-6 = 1.526e-3; W slice 1e-5 + 2e6 / 1e9 + 1e-6
  # = 2.011e-3 -> comm_slice = 2.011e-3; compute_slice = 4e-3.
  # the first slice's two gathers are synchronous, one after the other (prologue
  # 1.526e-3 + 2.011e-3); then (S-1) max(comm, compute) + compute = 4e-3 + 4e-3
  c = predict(OS, "meshslice", "os", 2, PROF)
  assert c.total_s == approx(11.537e-3)
  assert c.compute_s == approx(8e-3)
  assert c.comm_s == approx(1.526e-3 + 2 * 2.011e-3)
  assert c.exposed_comm_s == approx(3.537e-3)
  # with the original model's assumption the two prologue gathers run side by side
  side = dataclasses.replace(PROF, serial_collectives=False)
  assert predict(OS, "meshslice", "os", 2, side).total_s == approx(10.011e-3)
  assert predict(OS, "collective", "os", 1, side).total_s == approx(12.011e-3)


def test_meshslice_ls_by_hand():
  p = GemmProblem(m=2000, n=4000, k=4000, rows=2, cols=4, in_bytes=2, out_bytes=4)
  # W shard (k/C)(n/R) * 2 = 1000 * 2000 * 2 = 4e6 B (row, dim 0, n = 2)
  # Y shard (m/R)(n/C) * 4 = 1000 * 1000 * 4 = 4e6 B (col, dim 1, n = 4, reduce-scatter)
  # collective: AG 1e-5 + 4e6/1e9 + 1e-6 = 4.011e-3; matmul (1000, 4000, 1000) = 8e-3;
  #             RS 4e-5 + 3 * 4e6 / 1e9 + 3 * 2e-6 = 12.046e-3     -> 24.057e-3
  assert predict(p, "collective", "ls", 1, PROF).total_s == approx(24.057e-3)
  # S = 2: AG slice 2.011e-3, RS slice 4e-5 + 3 * 2e6 / 1e9 + 6e-6 = 6.046e-3, matmul 4e-3
  # stages: [AG0] 2.011, [mm0 | AG1] 4, [mm1 | RS0] 6.046, [RS1] 6.046  -> 18.103e-3
  c = predict(p, "meshslice", "ls", 2, PROF)
  assert c.total_s == approx(18.103e-3)
  assert c.exposed_comm_s == approx(18.103e-3 - 8e-3)


def test_one_d_all_gather_matmul_by_hand():
  p = GemmProblem.one_d(m=4000, n=1000, k=1000, size=4, collective="all_gather")
  assert (p.rows, p.cols, p.row_profile_dim, p.col_profile_dim) == (1, 4, 1, 1)
  # rs dataflow with R = 1: X shard (m/C)(k) * 2 = 2e6 B gathered on dim 1;
  # AG 2e-5 + 3e-3 + 6e-6 = 3.026e-3; matmul (4000, 250, 1000) = 2e9 FLOP = 2e-3; no RS.
  assert predict(p, "collective", "rs", 1, PROF).total_s == approx(5.026e-3)
  # S = 2: AG slice 1.526e-3, matmul slice 1e-3: 1.526 + max(1, 1.526) + 1 = 4.052e-3
  assert predict(p, "meshslice", "rs", 2, PROF).total_s == approx(4.052e-3)
  q = GemmProblem.one_d(m=4000, n=1000, k=1000, size=4, collective="reduce_scatter",
                        profile_dim=0)
  # rs with C = 1: matmul (4000, 1000, 250) = 2e-3, then RS of Y shard
  # (m/R)(n) * 2 = 2e6 B on dim 0: 3e-5 + 3 * 2e6 / 0.5e9 + 3 * 1e-6 = 12.033e-3
  assert predict(q, "collective", "rs", 1, PROF).total_s == approx(14.033e-3)


def test_cannon_by_hand():
  p = GemmProblem(m=2000, n=2000, k=2000, rows=2, cols=2)
  # blocks of 1000 x 1000 * 2 B = 2e6 B; skew = permute over floor(2/2) = 1 hop:
  #   X (dim 1): 1e-5 + 2e6/4e9 + 5e-6 = 5.15e-4, W (dim 0): 1e-5 + 2e6/2e9 + 5e-6 = 1.015e-3
  # 2 steps of matmul (1000, 1000, 1000) = 2e-3, the shifts (<= 1.015e-3) hide under step 0
  # total = 1.015e-3 + 2e-3 + 2e-3
  assert predict(p, "cannon", "os", 1, PROF).total_s == approx(5.015e-3)
  with pytest.raises(ValueError, match=r"cannon needs a square mesh \(R == C\), got R=2, C=4"):
    predict(OS, "cannon", "os", 1, PROF)


def test_cannon_ls_by_hand():
  p = GemmProblem(m=2000, n=2000, k=2000, rows=2, cols=2, out_bytes=4)
  # W moves over row (block 1000 x 1000 * 2 B = 2e6 B, dim 0), partial Y over col
  # (1000 x 1000 * 4 B = 4e6 B, dim 1); q = 2, every transfer 1 hop.
  # S = 1: skew W 1e-5 + 2e6/2e9 + 5e-6 = 1.015e-3; [mm 2e-3 | shift W 1.015e-3];
  #        [mm 2e-3 | pass Y 1e-5 + 4e6/4e9 + 5e-6 = 1.015e-3]; unskew Y 1.015e-3
  assert predict(p, "cannon", "ls", 1, PROF).total_s == approx(1.015e-3 + 2e-3 + 2e-3 + 1.015e-3)
  # S = 2: chunks of half the bytes (5.15e-4 per transfer), matmuls of 1e-3:
  #   skew 1.015e-3, then 4 stages of 1e-3 (transfers hidden), then the last unskew 5.15e-4
  s = schedule(p, "cannon", "ls", 2, PROF)
  assert s.cost().total_s == approx(1.015e-3 + 4e-3 + 5.15e-4)
  assert [[op.name for op in st.ops] for st in s.stages] == [
      ["skew W"], ["matmul", "shift W chunk"], ["matmul", "shift W chunk", "shift Y partial"],
      ["matmul", "shift Y partial"], ["matmul", "unskew Y partial"], ["unskew Y partial"]]


def test_wang_by_hand():
  # Default ring: the larger axis, col (C = 4): plain AG W first (4.011e-3), then 4
  # stages of matmul (1000, 1000, 1000) = 2e-3, 3 of them beside a permute of X's 2e6 B
  # (1e-5 + 5e-4 + 5e-6 = 5.15e-4): 4.011e-3 + 4 * 2e-3
  s = schedule(OS, "wang", "os", 1, PROF)
  assert s.cost().total_s == approx(12.011e-3)
  assert s.note == "unidirectional ring over col (X), 1 chunk per block"
  # ring over row: plain AG X first (3.026e-3), then 2 matmuls (1000, 1000, 2000) = 4e-3,
  # the first beside a permute of W's 4e6 B (1e-5 + 2e-3 + 5e-6 = 2.015e-3)
  assert predict(OS, "wang", "os", 1, PROF, ring="row").total_s == approx(11.026e-3)
  # With 10x the FLOP/s the ring is bound by the permute; bidirectional halves it:
  fast = dataclasses.replace(PROF, peak_flops=1e13)
  # unidirectional: 3.026e-3 + max(0.4e-3, 2.015e-3) + 0.4e-3
  assert predict(OS, "wang", "os", 1, fast, ring="row").total_s == approx(5.441e-3)
  # bidirectional: halves of 2e6 B each way (1e-5 + 1e-3 + 5e-6 = 1.015e-3), two
  # half-size matmuls per stage (2 * 0.2e-3): 3.026e-3 + 1.015e-3 + 0.4e-3
  assert predict(OS, "wang", "os", 1, fast, ring="row",
                 bidirectional=True).total_s == approx(4.441e-3)


def test_wang_reduce_scatter_ring_by_hand():
  p = GemmProblem(m=2000, n=4000, k=4000, rows=2, cols=4, out_bytes=4)
  # ls, ring over col = the reduce-scatter of Y (4e6 B shard, dim 1): plain AG W first
  # (1e-5 + 4e6/1e9 + 1e-6 = 4.011e-3); 4 matmuls (1000, 1000, 1000) = 2e-3, the last 3
  # beside a permute of the accumulated 4e6 B (1e-5 + 4e6/4e9 + 5e-6 = 1.015e-3)
  assert predict(p, "wang", "ls", 1, PROF).total_s == approx(4.011e-3 + 4 * 2e-3)
  # a 512-device ring with 16 chunks per block is still a handful of stages
  big = GemmProblem(m=2048, n=8192, k=8192, rows=2, cols=512)
  assert len(schedule(big, "wang", "ls", 16, PROF).stages) <= 4


def test_summa_by_hand():
  # P = lcm(2, 4) = 4 panels of k/4 = 1000; each broadcast is a masked psum (all-reduce).
  # X panel (m/R)(k/P) * 2 = 2e6 B on dim 1 (n = 4): RS + AG of 0.5e6 B
  #   = (4e-5 + 3 * 0.5e6/1e9 + 6e-6) + (2e-5 + 3 * 0.5e6/2e9 + 6e-6) = 1.546e-3 + 0.776e-3
  # W panel (k/P)(n/C) * 2 = 2e6 B on dim 0 (n = 2): RS + AG of 1e6 B
  #   = (3e-5 + 1e6/0.5e9 + 1e-6) + (1e-5 + 1e6/1e9 + 1e-6) = 2.031e-3 + 1.011e-3
  # matmul per panel (1000, 1000, 1000) = 2e-3
  # total = 3.042e-3 + 3 * max(2e-3, 3.042e-3) + 2e-3
  assert predict(OS, "summa", "os", 1, PROF).total_s == approx(14.168e-3)
  # ksplit = 2: 8 panels of half the bytes and half the FLOPs (matmul 1e-3);
  # the W panel broadcast is the slowest stream:
  w = (3e-5 + 0.5e6 / 0.5e9 + 1e-6) + (1e-5 + 0.5e6 / 1e9 + 1e-6)   # 1.542e-3
  assert predict(OS, "summa", "os", 2, PROF).total_s == approx(w + 7 * w + 1e-3)


def test_lower_bound_by_hand():
  # compute: the unsliced matmul (1000, 1000, 4000) = 8e-3
  # best bandwidth per link: max(collective, 2 x permute (both directions))
  # col link: 3 * 2e6 B at max(2e9, 8e9) = 0.75e-3; row: 1 * 4e6 B at max(1e9, 4e9) = 1e-3
  b = lower_bound(OS, PROF, "os")
  assert b == Cost(compute_s=approx(8e-3), comm_s=approx(1e-3), exposed_comm_s=0.0,
                   total_s=approx(8e-3))
  assert lower_bound(OS, PROF).total_s <= b.total_s


PROBLEMS = [OS, GemmProblem(m=4096, n=1024, k=2048, rows=4, cols=4, out_bytes=4),
            GemmProblem(m=512, n=8192, k=1024, rows=8, cols=2, batch=3)]


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("profile", [PROF, "tpu-v4", "h100"])
def test_every_algorithm_respects_the_lower_bound(problem, profile):
  for dataflow in DATAFLOWS:
    bound = lower_bound(problem, profile, dataflow).total_s
    for algorithm in ALGORITHMS:
      for options in variants(problem, algorithm):
        for ksplit in (1, 2, 4):
          if why_invalid(problem, algorithm, dataflow, ksplit, **options):
            continue
          cost = predict(problem, algorithm, dataflow, ksplit, profile, **options)
          assert cost.total_s >= bound * (1 - 1e-12), (algorithm, dataflow, ksplit, options)


@pytest.mark.parametrize("dataflow", DATAFLOWS)
def test_meshslice_with_one_slice_is_the_collective_algorithm(dataflow):
  for p in PROBLEMS:
    assert predict(p, "meshslice", dataflow, 1, "tpu-v4") == predict(p, "collective", dataflow,
                                                                     1, "tpu-v4")
    c = predict(p, "collective", dataflow, 1, "tpu-v4")
    assert c.total_s == approx(c.compute_s + c.comm_s)


def test_invalid_combinations_are_errors_with_reasons():
  assert why_invalid(OS, "meshslice", "os", 3) == (
      "ksplit=3 needs ksplit * lcm(R, C) = 12 to divide the communicated extent k=4000")
  assert why_invalid(OS, "collective", "os", 2) == (
      "collective does not slice; ksplit must be 1, got 2")
  assert why_invalid(OS, "meshslice", "os", 1, ring="row") == (
      "meshslice takes no options; got option 'ring'")
  assert why_invalid(OS, "wang", "os", 1, ring="diag") == (
      "wang: ring must be 'row', 'col' or None, got 'diag'")
  # ring over row (R = 2): block k / R = 2000, 2 * 3 = 6 does not divide it
  assert why_invalid(OS, "wang", "os", 3, ring="row", bidirectional=True) == (
      "wang: 2 * ksplit = 6 must divide the ring block k / R = 2000")
  one_d = GemmProblem.one_d(m=64, n=64, k=64, size=4, collective="all_gather")
  assert why_invalid(one_d, "summa", "rs", 1) == (
      "summa needs a 2D site (both mesh axes > 1), got a 1x4 mesh")
  assert why_invalid(GemmProblem(m=3, n=8, k=8, rows=2, cols=4), "collective", "os", 1) == (
      "dataflow 'os' on a 2x4 mesh shards m=3 into 2 parts, which does not divide it")
  with pytest.raises(ValueError, match="algorithm must be one of"):
    predict(OS, "fox", "os", 1, PROF)
  with pytest.raises(ValueError, match="dataflow must be one of"):
    predict(OS, "collective", "xs", 1, PROF)
  with pytest.raises(ValueError, match="rows must be a positive int, got 0"):
    GemmProblem(m=1, n=1, k=1, rows=0, cols=1)


def test_cost_arithmetic():
  a = Cost(compute_s=1.0, comm_s=2.0, exposed_comm_s=0.5, total_s=1.5)
  assert a + a == Cost(compute_s=2.0, comm_s=4.0, exposed_comm_s=1.0, total_s=3.0)
  assert sum([a, a, a]) == 3 * a == a * 3
  assert Cost() + a == a


# ------------------------------------------------------------------------------ autotuner

def test_autotuner_slices_when_comm_matters_and_slicing_is_free():
  # No per-collective fixed cost and full efficiency: every extra slice hides more.
  free = dataclasses.replace(PROF, all_gather=dataclasses.replace(
      PROF.all_gather, hop_latency=(0.0, 0.0), base_overhead=(0.0, 0.0)))
  c = best_plan(OS, free, dataflows=("os",), max_ksplit=10)
  assert (c.algorithm, c.ksplit) == ("meshslice", 10)   # 10 * lcm = 40 divides k = 4000
  assert c.cost.total_s < c.baseline.total_s


def test_autotuner_keeps_one_slice_when_compute_is_tiny():
  tiny = GemmProblem(m=64, n=64, k=64, rows=2, cols=2)
  c = best_plan(tiny, "tpu-v4", dataflows=("os",))
  # meshslice with S = 1 ties with collective; the fixed order prefers collective.
  assert (c.algorithm, c.ksplit) == ("collective", 1)
  assert c.cost == c.baseline


def test_autotuner_slices_less_as_overheads_grow():
  p = GemmProblem(m=65536, n=12288, k=12288, rows=8, cols=8)
  chosen = []
  for base in (0.0, 1e-4, 1e-3, 1e-2):
    prof = dataclasses.replace(load_profile("tpu-v4"), all_gather=dataclasses.replace(
        load_profile("tpu-v4").all_gather, base_overhead=(base, base)))
    chosen.append(best_plan(p, prof, dataflows=("os",)).ksplit)
  assert chosen == sorted(chosen, reverse=True) and chosen[0] > 1 and chosen[-1] == 1


def test_autotuner_is_deterministic():
  p = GemmProblem(m=65536, n=12288, k=36864, rows=4, cols=16)
  a = best_plan(p, "tpu-v4", algorithms=ALGORITHMS)
  b = best_plan(p, load_profile("tpu-v4"), algorithms=tuple(reversed(ALGORITHMS)),
                dataflows=("rs", "ls", "os"))
  assert isinstance(a, Choice) and repr(a) == repr(b)
  r1 = recommend_mesh(64, model="custom", heads=16, head_dim=64, seq=512)
  r2 = recommend_mesh(64, model="custom", heads=16, head_dim=64, seq=512)
  assert r1.to_json() == r2.to_json() and repr(r1) == repr(r2)


def test_valid_ksplits_and_best_plan_errors():
  p = GemmProblem(m=64, n=64, k=96, rows=2, cols=4)
  assert valid_ksplits(p, "os", 16) == (1, 2, 3, 4, 6, 8, 12)
  assert valid_ksplits(p, "os", 16, min_block=4) == (1, 2, 3, 4, 6)   # B = 96 / (4 S) >= 4
  with pytest.raises(ValueError, match=r"no candidate can run .* cannon/os: cannon needs a "
                                       r"square mesh"):
    best_plan(p, PROF, dataflows=("os",), algorithms=("cannon",))
  with pytest.raises(ValueError, match="algorithms must be drawn from"):
    best_plan(p, PROF, algorithms=("meshslice", "fox"))


def test_transformer_problems_shapes():
  ps = transformer_problems("gpt3", 16, (4, 4))
  h, t = 12288, 16 * 2048
  got = {lp.label: (lp.dataflow, lp.problem.m, lp.problem.n, lp.problem.k) for lp in ps}
  assert got["qkv/forward"] == ("os", t, 3 * h, h)
  assert got["mlp_down/backward_data"] == ("ls", t, 4 * h, h)
  assert got["mlp_up/backward_weight"] == ("rs", h, 4 * h, t)
  assert got["attn_out/forward"] == ("os", t, h, h)
  assert len(ps) == 12
  assert model_spec("megatron").hidden == 20480
  with pytest.raises(ValueError, match="model 'custom' needs heads, head_dim"):
    transformer_problems("custom", 16, (4, 4), seq=128)
  with pytest.raises(ValueError, match=r"mesh_shape must be a pair \(R, C\) with R \* C = "
                                       r"chips = 16, got \(4, 2\)"):
    transformer_problems("gpt3", 16, (4, 2))


def test_recommend_mesh_result():
  rec = recommend_mesh(16, model="custom", heads=8, head_dim=64, seq=256, profile="tpu-v4")
  assert [r.shape for r in rec.results] == [(2, 8), (4, 4), (8, 2)] == list(mesh_shapes(16))
  assert rec.best in rec.results and rec.best_shape == rec.best.shape
  assert rec.best.cost.total_s == min(r.cost.total_s for r in rec.results)
  for r in rec.results:
    assert len(r.layers) == 12
    assert r.cost.total_s == approx(sum(lc.choice.cost.total_s for lc in r.layers))
    assert r.bound.total_s <= r.cost.total_s <= r.baseline.total_s
  json.loads(rec.to_json())


@pytest.mark.parametrize("chips,message", [
    (7, "chips=7 has no 2D mesh shape (R * C = 7 with R, C >= 2): 7 is prime; use a "
        "composite chip count such as 8"),
    (2, "chips=2 has no 2D mesh shape (R * C = 2 with R, C >= 2): 2 < 4; use a composite "
        "chip count such as 4"),
    (0, "chips must be a positive int, got 0"),
    (-8, "chips must be a positive int, got -8"),
    ("8", "chips must be a positive int, got '8'"),
])
def test_chips_without_a_2d_mesh(chips, message):
  with pytest.raises(ValueError) as e:
    recommend_mesh(chips)
  assert str(e.value) == message


def test_recommend_mesh_reports_infeasible_shapes():
  # hidden 48 (3H = 144): a 32-way split fails for the meshes 2 x 32 and 32 x 2.
  rec = recommend_mesh(64, model="custom", heads=3, head_dim=16, seq=128)
  bad = {r.shape: r.reason for r in rec.results if not r.feasible}
  assert set(bad) == {(2, 32), (32, 2)}
  assert bad[(2, 32)].startswith("qkv: qkv/forward (os layout): no candidate can run")
  assert rec.best.feasible


# ------------------------------------------------------------------------------ profiles

def test_shipped_profiles_load_and_round_trip(tmp_path):
  assert set(known_profiles()) == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "cpu"}
  for name in known_profiles():
    p = load_profile(name)
    assert p.name == name
    save_profile(p, tmp_path / f"{name}.json")
    assert load_profile(tmp_path / f"{name}.json") == p
    assert load_profile(str(tmp_path / f"{name}.json")) == p
    assert "units" in json.loads((tmp_path / f"{name}.json").read_text())


def test_tpu_v4_is_the_published_calibration():
  p = load_profile("tpu-v4")
  # public numbers: 275 TFLOP/s bf16, 1.2e12 B/s and 32 GiB of HBM
  assert (p.peak_flops, p.hbm_bandwidth, p.hbm_capacity) == (2.75e14, 1.2e12, 32 * 2**30)
  # the original's assumptions are available on top of it
  paper = autotune.paper_assumptions(p)
  assert (paper.peak_flops, paper.gemm.max_efficiency, paper.hbm_bandwidth) == (2.66e14, 1.0, 0)
  assert paper.all_gather == p.all_gather
  assert p.all_gather == CollectiveParams(bandwidth=(27.472e9, 79.751e9),
                                          hop_latency=_pair(5e-6), base_overhead=_pair(13e-6))
  assert p.reduce_scatter == CollectiveParams(bandwidth=(37.506e9, 63.167e9),
                                              hop_latency=_pair(5e-6),
                                              base_overhead=_pair(26e-6))
  assert p.permute == CollectiveParams(bandwidth=(38.801e9, 35.224e9),
                                       hop_latency=_pair(5e-5), base_overhead=_pair(13e-6))


def test_unknown_profile_name_lists_known_ones():
  with pytest.raises(ValueError) as e:
    load_profile("tpu-v9")
  assert str(e.value) == ("unknown hardware profile 'tpu-v9'; known profiles: cpu, h100, "
                          "tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e (or pass the path of a profile "
                          "JSON file)")


def _broken(tmp_path, edit):
  data = load_profile("tpu-v4").to_json_dict()
  edit(data)
  path = tmp_path / "broken.json"
  path.write_text(json.dumps(data))
  return path


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["collectives"].pop("permute"), "missing field 'collectives.permute'"),
    (lambda d: d["gemm_efficiency"].pop("k_sat"), "missing field 'gemm_efficiency.k_sat'"),
    (lambda d: d.update(peak_flops="fast"), "field 'peak_flops' must be a number, got 'fast'"),
    (lambda d: d["collectives"]["all_gather"].update(hop_latency=[5e-6, -1.0]),
     "field 'collectives.all_gather.hop_latency[1]' must be >= 0 (no negative values), "
     "got -1.0"),
    (lambda d: d["collectives"]["reduce_scatter"].update(bandwidth=[1e9]),
     "field 'collectives.reduce_scatter.bandwidth' must be a pair [mesh dim 0, mesh dim 1], "
     "got [1000000000.0]"),
    (lambda d: d["collectives"]["permute"].update(bandwidth=[0, 1e9]),
     "field 'collectives.permute.bandwidth[0]' must be > 0, got 0"),
    (lambda d: d["gemm_efficiency"].update(max_efficiency=1.5),
     "field 'gemm_efficiency.max_efficiency' must be <= 1.0, got 1.5"),
    (lambda d: d.update(name=True), "field 'name' must be a non-empty string, got True"),
])
def test_malformed_profile_names_file_and_field(tmp_path, edit, message):
  path = _broken(tmp_path, edit)
  with pytest.raises(ValueError) as e:
    load_profile(path)
  assert str(e.value) == f"hardware profile {str(path)!r}: {message}"


def test_profile_file_that_is_not_json_or_missing(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text("{ not json")
  with pytest.raises(ValueError, match=r"hardware profile '.*bad.json': not valid JSON"):
    load_profile(path)
  with pytest.raises(ValueError, match=r"hardware profile '.*nope.json': cannot read it"):
    load_profile(tmp_path / "nope.json")


# ------------------------------------------------------------------------------ timeline

def test_trace_events_follow_the_schedule(tmp_path):
  s = schedule(OS, "meshslice", "os", 2, PROF)
  events = trace_events([("site a", s), ("site b", s)])
  spans = [e for e in events if e["ph"] == "X"]
  site_spans = [e for e in spans if e["tid"] == 3]
  # two sites end to end, each 11.537 ms (see test_meshslice_os_by_hand): the prologue
  # gathers X (col, 1.526 ms) then W (row, 2.011 ms), one after the other
  assert [(e["name"], e["ts"], e["dur"]) for e in site_spans] == [
      ("site a", 0.0, 11537.0), ("site b", 11537.0, 11537.0)]
  matmuls = [(e["ts"], e["dur"]) for e in spans if e["tid"] == 0]
  assert matmuls[:2] == [(3537.0, 4000.0), (7537.0, 4000.0)]
  gathers_w = [(e["ts"], e["dur"]) for e in spans if e["tid"] == 1][:2]
  assert gathers_w == [(1526.0, 2011.0), (3537.0, 2011.0)]
  write_trace(tmp_path / "t.json", events)
  assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] == events


@pytest.mark.parametrize("module", [profiles, timing, autotune, timeline, topology, memory],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
  assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


# ------------------------------------------------------------------ issue 10: dataflow per layer

def _phase_total(model, chips, shape, profile, layout, layer):
  problems = [lp for lp in transformer_problems(model, chips, shape, layouts=layout)
              if lp.layer == layer]
  return sum(best_plan(lp.problem, profile, dataflows=(lp.dataflow,)).cost.total_s
             for lp in problems)


def test_layouts_fix_the_dataflow_of_each_phase():
  h, t = 12288, 16 * 2048
  ls = {lp.label: (lp.dataflow, lp.layout, lp.problem.m, lp.problem.n, lp.problem.k)
        for lp in transformer_problems("gpt3", 16, (4, 4), layouts={"mlp_down": "ls"})}
  assert ls["mlp_down/forward"] == ("ls", "ls", t, h, 4 * h)
  assert ls["mlp_down/backward_data"] == ("os", "ls", t, 4 * h, h)
  assert ls["mlp_down/backward_weight"] == ("rs", "ls", h, 4 * h, t)     # dW^T
  assert ls["mlp_up/forward"][:2] == ("os", "os")
  with pytest.raises(ValueError, match="layout of layer 'qkv' must be one of"):
    transformer_problems("gpt3", 16, (4, 4), layouts={"qkv": "rs"})
  with pytest.raises(ValueError, match=r"unknown layers \['mlp'\]"):
    transformer_problems("gpt3", 16, (4, 4), layouts={"mlp": "ls"})


def test_ls_beats_os_on_mlp_down_and_os_beats_ls_on_mlp_up():
  # GPT-3 at (32, 8): forcing OS on mlp_down gathers the 4H-wide activation.
  paper = autotune.paper_assumptions()
  assert _phase_total("gpt3", 256, (32, 8), paper, "os", "mlp_down") * 1e3 == (
      pytest.approx(62.8, abs=0.05))
  assert _phase_total("gpt3", 256, (32, 8), paper, "ls", "mlp_down") * 1e3 == (
      pytest.approx(30.1, abs=0.05))
  for profile in (paper, "tpu-v4"):
    assert (_phase_total("gpt3", 256, (32, 8), profile, "ls", "mlp_down")
            < _phase_total("gpt3", 256, (32, 8), profile, "os", "mlp_down"))
    assert (_phase_total("gpt3", 256, (32, 8), profile, "os", "mlp_up")
            < _phase_total("gpt3", 256, (32, 8), profile, "ls", "mlp_up"))
  chosen = evaluate_mesh("gpt3", 256, (32, 8), "tpu-v4", check_memory=False)
  assert chosen.layouts["mlp_down"] == "ls" and chosen.layouts["mlp_up"] == "os"
  assert {lc.label: lc.choice.dataflow for lc in chosen.layers}["mlp_down/forward"] == "ls"
  fixed = evaluate_mesh("gpt3", 256, (32, 8), "tpu-v4", check_memory=False,
                        dataflow_policy="os")
  assert set(fixed.layouts.values()) == {"os"}
  assert chosen.cost.total_s < 0.9 * fixed.cost.total_s
  # the paper's rule agrees with the model here, except on the square attention-out
  # layer, which the original makes ls (os only when d_out > d_in) and the model os
  rule = evaluate_mesh("gpt3", 256, (32, 8), "tpu-v4", check_memory=False,
                       dataflow_policy="paper")
  assert chosen.layouts == {"qkv": "os", "attn_out": "os", "mlp_up": "os", "mlp_down": "ls"}
  assert rule.layouts == {**chosen.layouts, "attn_out": "ls"}
  with pytest.raises(ValueError, match="dataflow_policy must be one of"):
    evaluate_mesh("gpt3", 256, (32, 8), "tpu-v4", dataflow_policy="best")


# The original autotuner (Autotuner.py at hwnam831/meshslice 9323a36, matmul time =
# FLOPs / 2.66e14 instead of a TPU measurement) run on GPT-3 / Megatron-NLG, 32 ... 2048
# chips: best shapes after its analytical search and emulated fine-tuning, and os/ls/os/ls
# for qkv / attn_out / mlp_up / mlp_down everywhere (docs/costmodel.md section 10).
ORIGINAL = {"gpt3": {32: (4, 8), 64: (8, 8), 128: (16, 8), 256: (32, 8), 512: (64, 8),
                     1024: (128, 8), 2048: (256, 8)},
            "megatron": {32: (4, 8), 64: (8, 8), 128: (16, 8), 256: (32, 8), 512: (64, 8),
                         1024: (128, 8), 2048: (128, 16)}}


def test_paper_assumptions_reproduce_the_original_choice():
  # The original autotuner's README: GPT-3 on 256 TPU v4 chips -> (32, 8), os/ls per layer.
  rec = recommend_mesh(256, model="gpt3", assume="paper")
  assert rec.best_shape == (32, 8) and rec.dataflow_policy == "paper"
  assert rec.best.memory is None and rec.profile == "tpu-v4-paper"
  assert rec.best.layouts == {"qkv": "os", "attn_out": "ls", "mlp_up": "os", "mlp_down": "ls"}
  assert [r.shape for r in rec.results] == [(4, 64), (8, 32), (16, 16), (32, 8), (64, 4)]
  # every chip count from 32 to 2048: the same shape as the original, or (two cases) a
  # near tie whose runner-up is the original's shape
  for model, shapes in ORIGINAL.items():
    for chips, shape in shapes.items():
      rec = recommend_mesh(chips, model=model, assume="paper")
      assert rec.best_shape == shape or (rec.runner_up.shape == shape
                                         and rec.margin < 0.03), (model, chips)
  with pytest.raises(ValueError, match="the paper's assumptions exist for tpu-v4 only"):
    recommend_mesh(256, model="gpt3", assume="paper", profile="tpu-v5p")
  with pytest.raises(ValueError, match="assume must be one of"):
    recommend_mesh(256, assume="mine")


def test_runner_up_and_margin():
  rec = recommend_mesh(256, model="gpt3", memory_layers=1)
  runner = rec.runner_up
  assert runner is not None and runner is not rec.best and runner.feasible
  assert runner.cost.total_s == min(r.cost.total_s for r in rec.results
                                    if r.feasible and r is not rec.best)
  assert rec.margin == pytest.approx(runner.cost.total_s / rec.best.cost.total_s - 1)
  assert rec.near_tie == (rec.margin < autotune.NEAR_TIE)
  data = rec.to_dict()
  assert data["runner_up"] == list(runner.shape) and data["margin"] == rec.margin


# ------------------------------------------------------------------ issue 10: compute model

HBM = dataclasses.replace(PROF, hbm_bandwidth=1e10, op_overhead=1e-5)


def test_gemm_roofline_accumulation_and_op_overhead_by_hand():
  # (1000, 1000, 4000): 8e9 FLOP at 1e12 = 8e-3 s; bytes (4e6 + 4e6) * 2 + 1e6 * 2 = 18e6
  # at 1e10 = 1.8e-3 s: compute bound, plus 1e-5 per op
  assert gemm_time(HBM, 1000, 1000, 4000) == approx(8e-3 + 1e-5)
  # a thin slice of k = 100 adding into an f32 accumulator: 2e8 FLOP = 2e-4 s, but
  # (1e5 + 1e5) * 2 + 1e6 * 8 = 8.4e6 B at 1e10 = 8.4e-4 s: memory bound
  assert gemm_time(HBM, 1000, 1000, 100, accumulate=True) == approx(8.4e-4 + 1e-5)
  assert timing.copy_time(HBM, 1e6) == approx(2e-4 + 1e-5)
  # without an HBM bandwidth the old formula holds
  assert gemm_time(PROF, 1000, 1000, 100, accumulate=True) == approx(2e-4)


def test_meshslice_os_with_cut_accumulation_and_conversion_by_hand():
  # OS example (X 2e6 B over col n=4, W 4e6 B over row n=2), S = 2, HBM 1e10 B/s, 1e-5 per op:
  # cut slices (one pass over both local shards): 2 * 6e6 / 1e10 + 1e-5 = 1.21e-3
  # matmul slice (1000, 1000, 2000) adding into f32: 4e-3 FLOP-bound (HBM: (2e6 + 2e6) * 2
  #   + 1e6 * 8 = 16e6 B = 1.6e-3) + 1e-5 = 4.01e-3
  # comm slice (W, row) 2.011e-3: prologue 1.526e-3 + 2.011e-3 (serial) + 2 * 4.01e-3
  # convert the f32 accumulator (1e6 elements, read 4 + write 4 B): 8e6 / 1e10 + 1e-5
  c = predict(OS, "meshslice", "os", 2, HBM)
  assert c.total_s == approx(1.21e-3 + 1.526e-3 + 2.011e-3 + 2 * 4.01e-3 + 0.81e-3)
  # ls / rs: the reduce-scattered pieces are concatenated once at the end
  names = [op.name for st in schedule(OS, "meshslice", "ls", 2, HBM).stages for op in st.ops]
  assert names[0] == "cut slices" and names[-1] == "concatenate output"
  # S = 1 (= collective): nothing added, one op overhead
  assert predict(OS, "meshslice", "os", 1, HBM) == predict(OS, "collective", "os", 1, HBM)
  assert predict(OS, "collective", "os", 1, HBM).compute_s == approx(8e-3 + 1e-5)
  # what the TPU compiler estimates for 8192^3 bf16 os, S = 4, on a (2, 4) v4 mesh: the
  # rewritten body's compute is 1.20x the dense program's (DESIGN.md 6b, docs/tpu.md)
  p = GemmProblem(m=8192, n=8192, k=8192, rows=2, cols=4)
  ratio = (predict(p, "meshslice", "os", 4, "tpu-v4").compute_s
           / predict(p, "collective", "os", 1, "tpu-v4").compute_s)
  assert 1.15 < ratio < 1.25


def test_ksplit_is_chosen_by_the_model_not_the_cap():
  # Megatron-NLG on 256 TPU v4 chips: with the original's assumptions (free slicing) the
  # slice count runs into any cap; with ours it stops where the f32 accumulation
  # traffic (os) and per-slice overheads outweigh the shorter prologue.
  def ksplits(profile, cap, policy="model"):
    r = evaluate_mesh("megatron", 256, (32, 8), profile, max_ksplit=cap, check_memory=False,
                      dataflow_policy=policy)
    return {lc.label: lc.choice.ksplit for lc in r.layers}, r.layouts

  ours64, layouts64 = ksplits("tpu-v4", 64)
  # larger valid slice counts exist (S * lcm(R, C) = S * 32 divides 20480 for S = 80,
  # 128, 160, ...) but the model never takes them
  assert ksplits("tpu-v4", 128) == ksplits("tpu-v4", 256) == (ours64, layouts64)
  assert ksplits("tpu-v4", 16)[1] == layouts64
  assert all(s <= 20 for label, s in ours64.items()
             if {lc.label: lc.dataflow for lc in transformer_problems(
                 "megatron", 256, (32, 8), layouts=layouts64)}[label] == "os")
  paper128, _ = ksplits(autotune.paper_assumptions(), 128, "paper")
  assert max(paper128.values()) > 64       # free slicing: runs past where ours stops
  recs = {cap: recommend_mesh(256, model="megatron", max_ksplit=cap, memory_layers=1)
          for cap in (16, 64, 128)}
  assert {(r.best_shape, tuple(r.best.layouts.items())) for r in recs.values()} == {
      (recs[16].best_shape, tuple(recs[16].best.layouts.items()))}
  assert ([lc.choice.ksplit for lc in recs[64].best.layers]
          == [lc.choice.ksplit for lc in recs[128].best.layers])


# ------------------------------------------------------------------ issue 10: profiles

def test_profiles_have_public_numbers_and_sources():
  gib = 2**30
  expect = {"tpu-v4": (2.75e14, 1.2e12, 32 * gib), "tpu-v5e": (1.97e14, 8.19e11, 16 * gib),
            "tpu-v5p": (4.59e14, 2.765e12, 95 * gib), "tpu-v6e": (9.18e14, 1.64e12, 32 * gib),
            "h100": (9.89e14, 3.35e12, 80e9)}
  for name, (peak, hbm, capacity) in expect.items():
    p = load_profile(name)
    assert (p.peak_flops, p.hbm_bandwidth, p.hbm_capacity) == (peak, hbm, capacity), name
    assert p.sources and all(isinstance(s, str) and s for s in p.sources), name
    assert p.op_overhead > 0
  # derived TPU profiles: link bandwidth (5e10 v5e, 1e11 v5p / v6e) times the efficiencies
  # the v4 calibration shows on its dim 1 (2 x 0.886 all-gather, 2 x 0.702 reduce-scatter,
  # 0.783 send/recv), and the v4 latencies / overheads
  v4 = load_profile("tpu-v4")
  for name, link in (("tpu-v5e", 5e10), ("tpu-v5p", 1e11), ("tpu-v6e", 1e11)):
    p = load_profile(name)
    assert p.all_gather.bandwidth == _pair(round(2 * link * 0.886, -6))
    assert p.reduce_scatter.bandwidth == _pair(round(2 * link * 0.702, -6))
    assert p.permute.bandwidth == _pair(round(link * 0.783, -6))
    for kind in ("all_gather", "reduce_scatter", "permute"):
      assert p.collective(kind).hop_latency == _pair(v4.collective(kind).hop_latency[1])
      assert p.collective(kind).base_overhead == v4.collective(kind).base_overhead
  assert v4.all_gather.bandwidth[1] == pytest.approx(2 * 4.5e10 * 0.886, rel=1e-3)


def test_profile_optional_fields_validate_and_default(tmp_path):
  data = load_profile("tpu-v4").to_json_dict()
  for key in ("hbm_bandwidth", "hbm_capacity", "op_overhead", "sources"):
    data.pop(key)
  path = tmp_path / "old.json"
  path.write_text(json.dumps(data))
  old = load_profile(path)
  assert (old.hbm_bandwidth, old.hbm_capacity, old.op_overhead, old.sources) == (0, 0, 0, ())
  data["sources"] = "a string"
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'sources' must be a list of strings"):
    load_profile(path)
  data["sources"], data["hbm_bandwidth"] = ["x, y,z"], -1
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'hbm_bandwidth' must be >= 0"):
    load_profile(path)
  # sources with commas survive a save / load round trip unchanged
  p = dataclasses.replace(load_profile("tpu-v4"), sources=("a,b", "c, d"))
  save_profile(p, tmp_path / "s.json")
  assert load_profile(tmp_path / "s.json").sources == ("a,b", "c, d")


# ------------------------------------------------------------------ issue 10: lower bound

WIDE = dataclasses.replace(HBM, gemm=GemmEfficiency(max_efficiency=0.8, m_sat=64, n_sat=64,
                                                    k_sat=64))


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("profile", [PROF, WIDE, "tpu-v4", "tpu-v5e", "h100"])
def test_lower_bound_holds_for_each_algorithm_alone(problem, profile):
  for algorithm in ALGORITHMS:
    for dataflow in DATAFLOWS:
      bound = lower_bound(problem, profile, dataflow, algorithms=(algorithm,)).total_s
      for options in variants(problem, algorithm):
        for ksplit in (1, 2, 4, 8):
          if why_invalid(problem, algorithm, dataflow, ksplit, **options):
            continue
          cost = predict(problem, algorithm, dataflow, ksplit, profile, **options)
          assert cost.total_s >= bound * (1 - 1e-12), (algorithm, dataflow, ksplit, options)


def test_lower_bound_of_the_emitted_algorithms_by_hand():
  # collective / meshslice only: collective bandwidths (no 2 x send/recv credit)
  # col link: 3 * 2e6 B at 2e9 = 3e-3; row link: 4e6 B at 1e9 = 4e-3; compute 8e-3
  b = lower_bound(OS, PROF, "os", algorithms=("collective", "meshslice"))
  assert (b.comm_s, b.compute_s) == (approx(4e-3), approx(8e-3))
  # with wang allowed, a bidirectional ring of sends reaches 2 x 2e9 on the row link
  assert lower_bound(OS, PROF, "os").comm_s == approx(1e-3)
  # GPT-3 on (32, 8): the bound of what the pass emits is tighter than the all-algorithm one
  r = evaluate_mesh("gpt3", 256, (32, 8), "tpu-v4", check_memory=False)
  loose = sum(lower_bound(lc.problem, "tpu-v4", lc.choice.dataflow).total_s
              for lc in r.layers)
  assert loose <= r.bound.total_s <= r.cost.total_s
  with pytest.raises(ValueError, match="algorithm must be one of"):
    lower_bound(OS, PROF, "os", algorithms=("fox",))


# ------------------------------------------------------------------ issue 10: memory

def test_site_memory_by_hand():
  p = GemmProblem(m=2000, n=4000, k=4000, rows=2, cols=4, in_bytes=2, out_bytes=4)
  # os: Y shard 1000 x 1000; collective: X 2e6 * 4 + W 4e6 * 2 gathered whole, Y at 4 B
  assert memory.site_memory(p, "collective", "os", 1) == 8e6 + 8e6 + 4e6
  # meshslice S = 4: each local shard once more (its cut slices) and 2 gathered slices
  # (8e6 / 4 each) per operand, f32 accumulator
  assert memory.site_memory(p, "meshslice", "os", 4) == (2e6 + 2 * 2e6) + (4e6 + 2 * 2e6) + 4e6
  # ls collective: W gathered (4e6 * 2) and the whole partial Y (4e6 * 4) before its RS
  assert memory.site_memory(p, "collective", "ls", 1) == 8e6 + 16e6 + 4e6


def test_site_peak_bytes_adds_the_input_shards():
  p = GemmProblem(m=2000, n=4000, k=4000, rows=2, cols=4, in_bytes=2, out_bytes=4)
  # X 2000 x 4000 and W 4000 x 4000 at 2 B over 8 devices: 2e6 + 4e6 bytes each device
  assert memory.input_bytes(p) == 6e6
  for algorithm, dataflow, ksplit in [("collective", "os", 1), ("meshslice", "os", 4),
                                      ("collective", "ls", 1), ("meshslice", "rs", 5)]:
    assert memory.site_peak_bytes(p, algorithm, dataflow, ksplit) == \
        6e6 + memory.site_memory(p, algorithm, dataflow, ksplit)
  # more slices, smaller buffers: the peak falls with S (os: 2 gathered slices of n/S)
  peaks = [memory.site_peak_bytes(p, "meshslice", "os", s) for s in (2, 4, 8)]
  assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
  with pytest.raises(ValueError, match="ksplit"):
    memory.site_peak_bytes(p, "meshslice", "os", 3)     # 4000 / (3 * lcm 4) not exact


def test_why_too_big_excludes_plans_over_the_chip_and_says_why():
  # Megatron-NLG backward-data on (2, 128) v4 chips: the collective's whole partial
  # output (T/2 x 4H in bf16, 40.3 GiB) does not fit 32 GiB; S = 16 slices do.
  p = GemmProblem(m=524288, n=81920, k=20480, rows=2, cols=128)
  v4 = load_profile("tpu-v4")
  assert memory.chip_capacity(v4) == 32 * 2**30
  reason = memory.why_too_big(p, "collective", "ls", 1, v4)
  assert reason.startswith("needs 40.4 GiB per chip") and "32.0 GiB free of 32.0 GiB" in reason
  assert memory.why_too_big(p, "meshslice", "ls", 16, v4) == ""
  # reserved bytes (weights, saved activations) shrink what is free
  need = memory.site_peak_bytes(p, "meshslice", "ls", 16)
  assert memory.why_too_big(p, "meshslice", "ls", 16, v4, reserved=v4.hbm_capacity - need) == ""
  assert memory.why_too_big(p, "meshslice", "ls", 16, v4,
                            reserved=v4.hbm_capacity - need + 1) != ""
  # 95 GiB v5p chips hold the collective; a profile without capacity checks nothing
  assert memory.why_too_big(p, "collective", "ls", 1, load_profile("tpu-v5p")) == ""
  assert memory.why_too_big(p, "collective", "ls", 1, autotune.paper_assumptions()) == ""


def test_memory_excludes_plans_and_shapes():
  # Megatron-NLG on (2, 128) v4 chips, one layer resident, forward os everywhere: the
  # collective algorithm's partial sums of mlp_down need ~40 GiB, more than is free.
  r = evaluate_mesh("megatron", 256, (2, 128), "tpu-v4", dataflow_policy="os",
                    memory_layers=1)
  assert r.feasible          # sliced plans fit ...
  assert "mlp_down/backward_data: the collective algorithm needs 40.3 GiB" in r.baseline_reason
  assert all(lc.memory <= r.memory.free_for_gemm for lc in r.layers)
  only = evaluate_mesh("megatron", 256, (2, 128), "tpu-v4", dataflow_policy="os",
                       memory_layers=1, algorithms=("collective",))
  assert not only.feasible   # ... the collective alone does not
  assert "collective/os: needs at least 40.1 GiB of buffers, 29.3 GiB free" in only.reason
  assert evaluate_mesh("megatron", 256, (16, 16), "tpu-v4", dataflow_policy="os",
                       memory_layers=1, algorithms=("collective",)).feasible
  # all 105 layers of Megatron-NLG do not fit on 256 v4 chips at any shape
  with pytest.raises(ValueError, match=r"states 30\.8 GiB and saved activations 8\.2 GiB "
                                       r"for 105 layers"):
    recommend_mesh(256, model="megatron")
  # but they do on 256 v5p chips (95 GiB)
  assert recommend_mesh(256, model="megatron", profile="tpu-v5p").best.memory.fits
  # no capacity known, or checking off: nothing excluded
  assert recommend_mesh(256, model="megatron", check_memory=False).best.memory is None


# ------------------------------------------------------------------ issue 10: topology

def test_axis_assignment_matches_create_device_mesh():
  np = pytest.importorskip("numpy")
  try:   # the routine behind jax.experimental.mesh_utils.create_device_mesh on TPU
    from jax._src.mesh_utils import _create_device_mesh_for_nd_torus as torus_mesh
  except ImportError:
    pytest.skip("this jax has no _create_device_mesh_for_nd_torus")
  t = load_profile("tpu-v4").topology
  for chips in (64, 256, 1024):
    shape = topology.physical_shape(t, chips)
    for mesh in mesh_shapes(chips):
      _, a = torus_mesh(np.arange(chips).reshape(shape), mesh, allow_split_physical_axes=True)
      theirs = tuple(tuple(p for p in range(len(shape)) if a[p, axis] > 1)
                     for axis in range(len(mesh)))
      assert topology.assign_axes(t, mesh) == theirs, (chips, mesh)


def test_per_axis_bandwidth_from_the_torus_by_hand():
  v4 = load_profile("tpu-v4")
  assert topology.physical_shape(v4.topology, 256) == (8, 8, 4)
  # (32, 8): row axis on the 8 x 4 plane (two wrap-around dims, 4 links), column axis on
  # one 8-long torus dim (2 links); link 4.5e10 B/s one way
  p = topology.profile_for_mesh(v4, (32, 8))
  assert p.all_gather.bandwidth == (approx(0.886 * 4 * 4.5e10), approx(0.886 * 2 * 4.5e10))
  assert p.reduce_scatter.bandwidth == (approx(0.702 * 4 * 4.5e10),
                                        approx(0.702 * 2 * 4.5e10))
  assert p.permute.bandwidth == (approx(0.783 * 4.5e10), approx(0.783 * 4.5e10))
  # swapping the mesh axes swaps the bandwidths
  q = topology.profile_for_mesh(v4, (8, 32))
  assert q.all_gather.bandwidth == (p.all_gather.bandwidth[1], p.all_gather.bandwidth[0])
  # latencies and overheads are kept
  assert p.all_gather.hop_latency == v4.all_gather.hop_latency
  # (16, 16) needs a physical dim split between the axes: the split dim is a line
  assert topology.describe_axes(v4, (16, 16)) == ("8 (split) line x 4 torus",
                                                  "8 torus x 8 (split) line")
  s = topology.profile_for_mesh(v4, (16, 16))
  assert s.all_gather.bandwidth == _pair(approx(0.886 * 3 * 4.5e10))
  assert s.permute.bandwidth == _pair(approx(0.783 * 4.5e10 / 2))
  # a slice smaller than a 4x4x4 cube has no wrap-around: every dim is a line
  # (the last mesh axis is placed first and prefers more physical dims)
  assert topology.describe_axes(v4, (4, 4)) == ("4 line", "2 line x 2 line")
  # the other way of asking for the axes: a 3-axis mesh, axes 1 and 2
  assert topology.profile_for_mesh(v4, (1, 32, 8), axes=(1, 2)).all_gather == p.all_gather
  # no topology, or a paper profile: unchanged
  assert topology.profile_for_mesh(PROF, (32, 8)) is PROF
  assert autotune.paper_assumptions().topology is None


def test_islands_and_network_limits():
  h = load_profile("h100")
  assert topology.describe_axes(h, (4, 8)) == ("across nodes", "inside a node")
  assert topology.describe_axes(h, (8, 4)) == ("across nodes", "inside a node")
  assert topology.describe_axes(h, (2, 16)) == ("across nodes", "across nodes")
  inside = topology.profile_for_mesh(h, (16, 8))
  assert inside.all_gather.bandwidth == h.all_gather.bandwidth     # (IB, NVLink)
  across = topology.profile_for_mesh(h, (8, 16))
  assert across.all_gather.bandwidth == _pair(h.all_gather.bandwidth[0])
  assert across.all_gather.hop_latency == _pair(h.all_gather.hop_latency[0])
  # one v5e pod holds 256 chips; more would need the data-centre network
  with pytest.raises(ValueError, match="tpu-v5e: 1024 chips exceed one network of 256"):
    topology.profile_for_mesh(load_profile("tpu-v5e"), (32, 32))
  r = evaluate_mesh("gpt3", 1024, (32, 32), "tpu-v5e", check_memory=False)
  assert r.reason.startswith("topology: tpu-v5e: 1024 chips exceed")
  assert evaluate_mesh("gpt3", 1024, (32, 32), "tpu-v5e", check_memory=False,
                       topology=False).feasible


def test_an_axis_across_slices_gets_the_dcn_figures():
  v4 = load_profile("tpu-v4")
  one = topology.profile_for_mesh(v4, (32, 8))                       # one 256-chip slice
  two = topology.profile_for_mesh(v4, (64, 8), dcn_shape=(2, 1))     # two of them
  assert two.name == "tpu-v4@64x8/2slices"
  for kind in ("all_gather", "reduce_scatter", "permute"):
    c = two.collective(kind)
    assert c.bandwidth[0] == v4.topology.dcn_bandwidth == 6.25e9
    assert c.hop_latency[0] == v4.topology.dcn_latency
    # the column axis stays inside each slice: the same as on one slice
    assert c.bandwidth[1] == one.collective(kind).bandwidth[1]
    assert c.hop_latency[1] == one.collective(kind).hop_latency[1]
  # slices along the column axis instead: the row axis keeps its ICI figure
  cols = topology.profile_for_mesh(v4, (32, 16), dcn_shape=(1, 2))
  assert cols.all_gather.bandwidth == (one.all_gather.bandwidth[0], 6.25e9)
  # the same site is slower when its row axis crosses the DCN
  p = GemmProblem(m=65536, n=12288, k=12288, rows=64, cols=8)
  assert timing.predict(p, "collective", "os", 1, two).comm_s > \
      5 * timing.predict(p, "collective", "os", 1, topology.profile_for_mesh(v4, (64, 8))).comm_s
  # v5e: 512 chips do not fit one pod, but do as two 256-chip slices
  v5e = load_profile("tpu-v5e")
  with pytest.raises(ValueError, match="need dcn_shape"):
    topology.profile_for_mesh(v5e, (32, 16))
  assert topology.profile_for_mesh(v5e, (32, 16), dcn_shape=(2, 1)).all_gather.bandwidth[0] \
      == 3.125e9
  with pytest.raises(ValueError, match="must give, per mesh axis"):
    topology.profile_for_mesh(v4, (6, 8), dcn_shape=(4, 1))
  no_dcn = dataclasses.replace(v4, topology=dataclasses.replace(v4.topology, dcn_bandwidth=0.0))
  with pytest.raises(ValueError, match="no DCN bandwidth"):
    topology.profile_for_mesh(no_dcn, (64, 8), dcn_shape=(2, 1))
  assert topology.profile_for_mesh(no_dcn, (32, 8), dcn_shape=(1, 1)).all_gather == \
      one.all_gather


def test_slices_per_axis_from_the_devices():
  import types

  import numpy as np
  dev = lambda s: types.SimpleNamespace(slice_index=s)
  # 2 slices stacked along axis 0 (how create_hybrid_device_mesh with (2, 1) lays them)
  grid = np.array([[dev(0)] * 8] * 32 + [[dev(1)] * 8] * 32, dtype=object)
  assert topology.dcn_shape_of(grid) == (2, 1)
  assert topology.dcn_shape_of(grid.T) == (1, 2)
  v4 = load_profile("tpu-v4")
  assert topology.profile_for_devices(v4, grid) == \
      topology.profile_for_mesh(v4, (64, 8), dcn_shape=(2, 1))
  # no slice_index (one slice, CPU or GPU devices): nothing crosses slices
  plain = np.array([[object()] * 8] * 32, dtype=object)
  assert topology.dcn_shape_of(plain) == (1, 1)
  assert topology.profile_for_devices(v4, plain) == topology.profile_for_mesh(v4, (32, 8))


def test_topology_moves_the_decision():
  # with the fixed profile dims the row axis always gets the measured dim-0 numbers
  fixed = recommend_mesh(256, model="gpt3", check_memory=False, topology=False)
  derived = recommend_mesh(256, model="gpt3", check_memory=False)
  assert fixed.best.axes == () and derived.best.axes
  assert derived.best_shape == (64, 4) and fixed.best_shape == (32, 8)
  assert derived.to_dict()["results"][0]["axes"] == list(derived.results[0].axes)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["topology"].update(kind="ring"), "field 'topology.kind' must be one of"),
    (lambda d: d["topology"].update(link_bandwidth=0), "field 'topology.link_bandwidth' must "
                                                       "be > 0"),
    (lambda d: d["topology"].update(efficiency=[1, 1]), "field 'topology.efficiency' must be "
                                                        "3 numbers"),
    (lambda d: d["topology"].update(hops=3), "field 'topology' has an unknown key 'hops'"),
    (lambda d: d["topology"].pop("kind"), "missing field 'topology.kind'"),
    (lambda d: d["topology"].update(dcn_bandwidth=-1), "field 'topology.dcn_bandwidth' must "
                                                       "be a number >= 0"),
])
def test_malformed_topology(tmp_path, edit, message):
  path = _broken(tmp_path, edit)
  with pytest.raises(ValueError) as e:
    load_profile(path)
  assert message in str(e.value)


# Measured on one H200 with JAX 0.11.2 (python bench/gemm_slicing.py
# --shapes=16384x4608x12288,8192x8192x8192 --ksplits=1,2,4,8,16,32,64,128): seconds of S
# K-slices of a bf16 matmul, each added into a float32 accumulator.
H200_OS = {(16384, 4608, 12288): (2.814e-3, 3.240e-3, 3.593e-3, 4.799e-3, 6.664e-3, 10.800e-3,
                                  19.840e-3, 39.149e-3),
           (8192, 8192, 8192): (1.768e-3, 2.372e-3, 2.449e-3, 3.430e-3, 5.280e-3, 9.162e-3,
                                17.619e-3, 33.474e-3)}


def test_sliced_accumulation_matches_gpu_measurements():
  # the h100 profile with the H200's measured copy bandwidth (4.3e12 B/s): same SMs
  h200 = dataclasses.replace(load_profile("h100"), hbm_bandwidth=4.3e12)
  for (m, n, k), measured in H200_OS.items():
    for s, seconds in zip((1, 2, 4, 8, 16, 32, 64, 128), measured):
      predicted = s * gemm_time(h200, m, n, k / s, accumulate=s > 1)
      assert 0.85 < predicted / seconds < 1.2, (m, n, k, s, predicted, seconds)
  # the TPU profile fuses the accumulation into the matmul: thin slices are HBM-bound
  # (max), not compute + a separate pass
  v4 = load_profile("tpu-v4")
  assert v4.accumulate_fused and not load_profile("h100").accumulate_fused
  fused = gemm_time(v4, 4096, 2048, 2048, accumulate=True)
  assert fused == approx(max(2 * 4096 * 2048 * 2048 / (2.75e14 * 0.92),
                             ((4096 + 2048) * 2048 * 2 + 4096 * 2048 * 8) / 1.2e12) + 3.5e-6)


def test_accumulate_fields_validate(tmp_path):
  data = load_profile("h100").to_json_dict()
  assert (data["accumulate_bytes"], data["accumulate_fused"]) == (16.0, False)
  data["accumulate_fused"] = "no"
  path = tmp_path / "p.json"
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'accumulate_fused' must be true or false"):
    load_profile(path)


def test_all_reduce_site_keeps_the_whole_output():
  from meshslice.costmodel.memory import site_memory
  kw = dict(m=8192, n=4096, k=4096, size=8)
  whole_y = 8192 * 4096 * 2
  scatter = GemmProblem.one_d(collective="reduce_scatter", **kw)
  reduce = GemmProblem.one_d(collective="all_reduce", **kw)
  # collective: the partial Y whole before the reduction, plus the result kept
  assert site_memory(scatter, "collective", "rs", 1) == whole_y + whole_y / 8
  assert site_memory(reduce, "collective", "rs", 1) == whole_y + whole_y
