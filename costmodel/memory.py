"""Per-chip memory: what one site's plan needs, what a training step keeps resident,
and what the chip holds.

The pass and the autotuner ask the same questions, so both use this module:

  site_memory      bytes a plan needs beyond its input shards (output or float32
                   accumulator, gathered operands, slices in flight, partial sums)
  site_peak_bytes  the same plus the input shards: the most the site holds at once
  chip_capacity    HBM per chip from the profile (0: unknown)
  why_too_big      "" when a plan fits the chip (after `reserved` bytes), else why not
  training_memory  weights, optimizer state and activations of a training step
                   (`autotune.transformer_memory` fills it in for a named model)

Example:
  >>> from meshslice.costmodel import GemmProblem, load_profile
  >>> p = GemmProblem(m=524288, n=81920, k=20480, rows=2, cols=128)   # Megatron bwd-data
  >>> round(site_peak_bytes(p, "collective", "ls", 1) / 2**30, 1)    # partial Y whole
  40.4
  >>> why_too_big(p, "collective", "ls", 1, load_profile("tpu-v4"))
  'needs 40.4 GiB per chip (input shards 92.5 MiB, output and buffers 40.3 GiB),
  32.0 GiB free of 32.0 GiB HBM'
  >>> why_too_big(p, "meshslice", "ls", 16, load_profile("tpu-v4"))
  ''
"""
from __future__ import annotations

import dataclasses
import math

from .timing import GemmProblem, movements, wang_ring_axis, why_invalid

# Bytes per parameter of mixed-precision Adam: bf16 weight and gradient (2 + 2), float32
# master weight, first and second moments (4 + 4 + 4).
ADAM_BYTES_PER_PARAM = 16


def gib(nbytes: float) -> str:
  return f"{nbytes / 2**30:.1f} GiB"


def _size(nbytes: float) -> str:
  """GiB, or MiB below one GiB (a small site would read as 0.0 GiB)."""
  return gib(nbytes) if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- one site

def site_memory(problem: GemmProblem, algorithm: str, dataflow: str, ksplit: int,
                **options) -> float:
  """Bytes per device a site needs beyond its input shards: its output (or float32
  accumulator) and the communication buffers of `algorithm`:

      collective  each gathered operand whole (shard * n), or the whole partial output
                  before its reduce-scatter (Y shard * n)
      meshslice   S = 1: as collective; S > 1: per moved matrix its shard once more (the
                  cut slices, or the reduce-scattered pieces before their concatenation)
                  and 2 slices of shard * n / S (the one in use, the one arriving)
      summa       per moved matrix 2 panels of shard * n / (S * lcm(R, C))
      cannon      per moved matrix 2 chunks of shard / S (in use, arriving)
      wang        ring axis: 2 chunks of shard / S; other axis: as collective

  The output is the Y shard (batch * m/R * n/C; the whole Y on an all-reduce site) at
  out_bytes, or at 4 bytes when the schedule accumulates in float32 (os sliced, cannon, a
  reduce-scatter ring).

  Raises:
    ValueError: the plan cannot run the problem (`why_invalid`).

  Example:
    >>> p = GemmProblem(m=524288, n=81920, k=20480, rows=2, cols=128)   # Megatron bwd-data
    >>> round(site_memory(p, "collective", "ls", 1) / 2**30, 1)         # partial Y whole
    40.3
    >>> round(site_memory(p, "meshslice", "ls", 16) / 2**30, 1)
    5.6
  """
  reason = why_invalid(problem, algorithm, dataflow, ksplit, **options)
  if reason:
    raise ValueError(reason)
  mv = movements(problem, dataflow)
  y_shard = problem.batch * problem.m / problem.rows * problem.n / problem.cols
  if problem.reduction == "all_reduce":     # the psum leaves Y whole on every device
    y_shard *= problem.rows
  accumulate = ((algorithm in ("meshslice", "summa") and dataflow == "os" and ksplit > 1)
                or algorithm == "cannon")
  buffers = 0.0
  for v in mv:
    if v.size <= 1:
      continue
    whole = v.shard_bytes * v.size
    if algorithm == "collective" or (algorithm == "meshslice" and ksplit == 1):
      buffers += whole
    elif algorithm == "meshslice":
      buffers += v.shard_bytes + 2 * whole / ksplit
    elif algorithm == "summa":
      buffers += 2 * whole / (ksplit * problem.lcm)
    elif algorithm == "cannon":
      buffers += 2 * v.shard_bytes / ksplit
    else:   # wang
      if v.link == wang_ring_axis(problem, options.get("ring")):
        buffers += 2 * v.shard_bytes / ksplit
        accumulate = accumulate or dataflow == "os" or v.kind == "reduce_scatter"
      else:
        buffers += whole
  return y_shard * (4 if accumulate else problem.out_bytes) + buffers


def input_bytes(problem: GemmProblem) -> float:
  """Bytes per device of the two input shards (X and W, each split over all R * C
  devices in every dataflow's layout)."""
  devices = problem.rows * problem.cols
  return problem.batch * (problem.m * problem.k + problem.k * problem.n) \
      * problem.in_bytes / devices


def site_peak_bytes(problem: GemmProblem, algorithm: str, dataflow: str, ksplit: int,
                    **options) -> int:
  """The most bytes one device holds while the site runs: its input shards plus
  `site_memory` (output or float32 accumulator, communication buffers). Nothing else of
  the program is counted; subtract what else is live from the capacity (`why_too_big`'s
  `reserved`).

  Example:
    >>> p = GemmProblem(m=4096, n=4096, k=4096, rows=2, cols=4)       # bf16, os
    >>> site_peak_bytes(p, "collective", "os", 1) / 2**20   # shards 4+4, gathered 16+8, Y 4
    36.0
    >>> site_peak_bytes(p, "meshslice", "os", 8) / 2**20    # +4+4 slices, +8+4 cut, Y f32 8
    30.0
  """
  return int(math.ceil(input_bytes(problem)
                       + site_memory(problem, algorithm, dataflow, ksplit, **options)))


def chip_capacity(profile) -> int:
  """HBM bytes per chip of a profile (0 when the profile does not say: nothing is
  checked)."""
  return int(getattr(profile, "hbm_capacity", 0) or 0)


def why_too_big(problem: GemmProblem, algorithm: str, dataflow: str, ksplit: int, profile,
                *, reserved: float = 0.0, **options) -> str:
  """"" when the plan's `site_peak_bytes` fits the profile's HBM per chip after
  `reserved` bytes (what else the program keeps live), or when the capacity is unknown;
  otherwise one line saying how much it needs and what is free.

  Example:
    >>> from meshslice.costmodel import load_profile
    >>> p = GemmProblem(m=4096, n=4096, k=4096, rows=2, cols=4)
    >>> why_too_big(p, "collective", "os", 1, load_profile("tpu-v4"))
    ''
    >>> why_too_big(p, "collective", "os", 1, load_profile("tpu-v4"), reserved=32 * 2**30 - 2**25)
    'needs 36.0 MiB per chip (input shards 8.0 MiB, output and buffers 28.0 MiB),
    32.0 MiB free of 32.0 GiB HBM'
  """
  capacity = chip_capacity(profile)
  if not capacity:
    return ""
  need = site_peak_bytes(problem, algorithm, dataflow, ksplit, **options)
  free = capacity - reserved
  if need <= free:
    return ""
  inputs = input_bytes(problem)
  return (f"needs {_size(need)} per chip (input shards {_size(inputs)}, output and buffers "
          f"{_size(need - inputs)}), {_size(max(free, 0.0))} free of {gib(capacity)} HBM")


# ----------------------------------------------------------------------------- a training step

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
  """Bytes per chip of a transformer training step on one mesh (see `training_memory`).

  Attributes:
    states: weights, gradients and optimizer state of the resident layers.
    saved: activations kept for the backward pass (full rematerialisation: each
      resident layer's input).
    working: one layer's activations while it is recomputed and differentiated.
    gemm: the largest output + communication buffers of one GEMM plan (filled in by
      autotune.evaluate_mesh; `site_memory`).
    capacity: HBM per chip (0: unknown, nothing checked).

  Example:
    >>> m = training_memory(hidden=12288, heads=96, seq=2048, layers=96, batch=256,
    ...                     chips=256, capacity=32 * 2**30)
    >>> round(m.states / 2**30, 1), round(m.free_for_gemm / 2**30, 1)
    (10.1, 16.0)
  """

  states: float
  saved: float
  working: float
  capacity: float
  gemm: float = 0.0
  layers: int = 1

  @property
  def total(self) -> float:
    return self.states + self.saved + self.working + self.gemm

  @property
  def free_for_gemm(self) -> float:
    """Capacity left for one GEMM's buffers (inf when the capacity is unknown)."""
    if not self.capacity:
      return float("inf")
    return self.capacity - self.states - self.saved - self.working

  @property
  def fits(self) -> bool:
    return not self.capacity or self.total <= self.capacity

  def describe(self) -> str:
    return (f"{gib(self.total)} per chip of {gib(self.capacity)} (states "
            f"{gib(self.states)} and saved activations {gib(self.saved)} for "
            f"{self.layers} layers, working set {gib(self.working)}, GEMM buffers "
            f"{gib(self.gemm)})")


def training_memory(*, hidden: int, heads: int, seq: int, layers: int, batch: int,
                    chips: int, capacity: float, dtype_bytes: int = 2,
                    bytes_per_param: int = ADAM_BYTES_PER_PARAM) -> MemoryEstimate:
  """Per-chip memory of training `layers` transformer layers with everything sharded over
  all `chips` (T = batch * seq tokens, H = hidden):

    states   = 12 H^2 params per layer * bytes_per_param * layers / chips
    saved    = T * H * dtype_bytes * layers / chips           (remat: layer inputs only)
    working  = (14 T * H + batch * heads * seq^2) * dtype_bytes / chips
               (one layer's activations: qkv 3H, attention output H, residual and norms
                2H, MLP 4H + 4H; attention probabilities unfused)

  The GEMM buffers come on top (`site_memory`).

  Example:
    >>> m = training_memory(hidden=20480, heads=128, seq=2048, layers=105, batch=256,
    ...                     chips=256, capacity=32 * 2**30)          # Megatron-NLG
    >>> m.fits, round((m.states + m.saved) / 2**30, 1)
    (False, 39.0)
  """
  tokens = batch * seq
  states = 12 * hidden * hidden * bytes_per_param * layers / chips
  saved = tokens * hidden * dtype_bytes * layers / chips
  working = (14 * tokens * hidden + batch * heads * seq ** 2) * dtype_bytes / chips
  return MemoryEstimate(states=states, saved=saved, working=working, capacity=capacity,
                        layers=layers)
