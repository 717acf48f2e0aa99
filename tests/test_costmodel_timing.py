"""The time model (costmodel.timing): formulas and schedules against hand-derived
numbers, the lower bound, the compute model against measurements. No JAX needed."""
import dataclasses

import pytest

from meshslice.costmodel import timing
from meshslice.costmodel.autotune import evaluate_mesh, variants
from meshslice.costmodel.profiles import GemmEfficiency, load_profile
from meshslice.costmodel.timing import (ALGORITHMS, DATAFLOWS, Cost, GemmProblem, all_reduce_time,
                                        collective_time, gemm_time, lower_bound, permute_time,
                                        predict, schedule, why_invalid)

from test_costmodel import HBM, OS, PROBLEMS, PROF, WIDE, approx


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
      "meshslice takes only scatter; got option 'ring'")
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
  # rewritten body's compute is 1.20x the dense program's (docs/costmodel.md, docs/tpu.md)
  p = GemmProblem(m=8192, n=8192, k=8192, rows=2, cols=4)
  ratio = (predict(p, "meshslice", "os", 4, "tpu-v4").compute_s
           / predict(p, "collective", "os", 1, "tpu-v4").compute_s)
  assert 1.15 < ratio < 1.25


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
