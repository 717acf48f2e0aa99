"""Per-chip memory of a plan (costmodel.memory), by hand. No JAX needed."""
import pytest

from meshslice.costmodel import autotune, memory
from meshslice.costmodel.profiles import load_profile
from meshslice.costmodel.timing import GemmProblem


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


def test_all_reduce_site_keeps_the_whole_output():
  from meshslice.costmodel.memory import site_memory
  kw = dict(m=8192, n=4096, k=4096, size=8)
  whole_y = 8192 * 4096 * 2
  scatter = GemmProblem.one_d(collective="reduce_scatter", **kw)
  reduce = GemmProblem.one_d(collective="all_reduce", **kw)
  # collective: the partial Y whole before the reduction, plus the result kept
  assert site_memory(scatter, "collective", "rs", 1) == whole_y + whole_y / 8
  assert site_memory(reduce, "collective", "rs", 1) == whole_y + whole_y
