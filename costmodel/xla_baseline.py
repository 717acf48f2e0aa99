"""What the TPU compiler makes of a site: XLA's own program ("leave it to XLA"), and the
per-site terms that compiled rewrites add to the analytic model.

The analytic model (timing.py) prices a schedule of collectives and matmuls. Compiled
TPU programs differ from it in ways a profile's peak and bandwidths cannot express; they
are fitted from ahead-of-time compiles (`python -m meshslice calibrate --aot v4:2x2x2`,
meshslice.compiler_fit) into a `CompilerTerms`, stored in a profile JSON file as the
versioned section "compiler_terms":

  dot_efficiency     fraction of peak_flops a compiled dot reaches, and
  dot_fixed_s        seconds every dot op costs beyond its FLOPs (why small GEMMs and
                     thin slices lose efficiency): a dot takes
                     dot_fixed_s + flops / (peak_flops * dot_efficiency)
  extra_scale        per dataflow: the compiled non-dot compute of a sliced site (slice
                     fusions, the float32 accumulator's conversion, concatenations)
                     over what the analytic model's "cut slices" / "convert" /
                     "concatenate" ops predict
  async_fraction     per dataflow and collective kind: the share of the pipelined
                     sliced collectives the compiler makes asynchronous (overlapped with
                     the partial matmuls); the rest run synchronously and add
  windowed_min_ring  XLA's windowed einsum (collective matmul) fires when the ring axis
  windowed_min_bytes has at least this many devices and the windowed operand's
                     per-device shard at least this many bytes
  windowed_compute_factor  compute of XLA's windowed-einsum loop over the same site's
                     dense program (its chunk dots are estimated well above the fused dot)

With terms, a candidate's time is its analytic schedule re-priced stage by stage
(`compiled_seconds`): matmuls by the dot terms, other compute ops scaled by extra_scale,
and each collective beside compute split into an overlapped part (on its link) and an
exposed part (added):

    stage = max(compute, overlapped row link, overlapped col link) + exposed collectives

XLA's own program for the site (`xla_seconds`), under the recommended async flags:

    dense     (windowed einsum off, or not firing) the collective algorithm's schedule,
              nothing overlapped: XLA's partitioner emits the same all-gathers, dot and
              reduce-scatter (checked: for os / ls / rs 8192^3 on v4 the plain jit and
              the collective rewrite compile to the same cycles and collectives)
    windowed  a ring of collective-permutes on the axis moving the most bytes,
              bidirectional, beside the chunk dots; the other axis's collective exposed:
              other collective + max(dense compute * windowed_compute_factor, ring)

Example:
  >>> from meshslice.costmodel import GemmProblem, load_profile
  >>> terms = builtin_terms("tpu-v4")
  >>> p = GemmProblem(m=8192, n=8192, k=8192, rows=2, cols=4)
  >>> xla = xla_seconds(p, "os", load_profile("tpu-v4"), terms, "windowed")
  >>> xla.windowed, round(xla.seconds * 1e3, 2) > 0
  (False, True)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

from .profiles import HardwareProfile, load_profile
from .timing import (DATAFLOWS, GemmProblem, collective_time, permute_time, schedule)

SECTION = "compiler_terms"
VERSION = 1
BASELINES = ("windowed", "dense", "none")
_KINDS = ("all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompilerTerms:
  """Per-site terms fitted from compiled TPU programs (module docstring).

  Example:
    >>> t = builtin_terms("tpu-v4")
    >>> CompilerTerms.from_json_dict(t.to_json_dict()) == t
    True
  """

  dot_efficiency: float
  dot_fixed_s: float
  extra_scale: dict
  async_fraction: dict
  windowed_min_ring: int
  windowed_min_bytes: float
  windowed_compute_factor: float
  source: str = ""

  def __post_init__(self):
    if not 0 < self.dot_efficiency <= 1:
      raise ValueError(f"dot_efficiency must be in (0, 1], got {self.dot_efficiency!r}")
    for name in ("dot_fixed_s", "windowed_min_bytes"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
    if self.windowed_compute_factor <= 0 or self.windowed_min_ring < 2:
      raise ValueError("windowed_compute_factor must be > 0 and windowed_min_ring >= 2")
    for flow in DATAFLOWS:
      if self.extra_scale.get(flow, -1) < 0:
        raise ValueError(f"extra_scale needs a value >= 0 for each of {DATAFLOWS}, got "
                         f"{self.extra_scale!r}")
      fractions = self.async_fraction.get(flow, {})
      if any(not 0 <= fractions.get(k, -1) <= 1 for k in _KINDS):
        raise ValueError(f"async_fraction[{flow!r}] needs {_KINDS} in [0, 1], got "
                         f"{fractions!r}")

  def to_json_dict(self) -> dict:
    return {"version": VERSION, **dataclasses.asdict(self)}

  @classmethod
  def from_json_dict(cls, data: dict) -> "CompilerTerms":
    if not isinstance(data, dict) or data.get("version") != VERSION:
      raise ValueError(f"section {SECTION!r}: version {data.get('version') if isinstance(data, dict) else None!r} "
                       f"is not {VERSION}; re-run python -m meshslice calibrate --aot")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields - {"version"}
    if unknown:
      raise ValueError(f"section {SECTION!r}: unknown keys {sorted(unknown)}")
    try:
      return cls(**{k: v for k, v in data.items() if k != "version"})
    except TypeError as e:
      raise ValueError(f"section {SECTION!r}: {e}") from None


# Fitted by `python -m meshslice calibrate --aot v4:2x2x2` (jax 0.10.2, libtpu 0.0.42.1;
# see docs/tpu.md, "The planner learns from the compiler"), windowed einsum from the
# 256-chip GPT-3 / Megatron-NLG sites of bench/tpu_rank.py. Used for every TPU profile
# without a calibrated section: the terms are fractions and seconds, not v4 cycles.
_TPU_V4 = CompilerTerms(
    dot_efficiency=0.915, dot_fixed_s=2.0e-6,
    extra_scale={"os": 1.0, "ls": 4.0, "rs": 3.5},
    async_fraction={"os": {"all_gather": 0.5, "reduce_scatter": 0.0},
                    "ls": {"all_gather": 1.0, "reduce_scatter": 0.0},
                    "rs": {"all_gather": 1.0, "reduce_scatter": 0.0}},
    windowed_min_ring=8, windowed_min_bytes=0.0, windowed_compute_factor=2.3,
    source="built-in: placeholder until calibrated")


def builtin_terms(profile_name: str) -> CompilerTerms | None:
  """The shipped terms for a profile name: TPU profiles ("tpu-*") get the v4 fit, others
  (cpu, h100: no TPU compiler) none.

  Example:
    >>> builtin_terms("cpu") is None, builtin_terms("tpu-v5e") is not None
    (True, True)
  """
  return _TPU_V4 if profile_name.startswith("tpu-") else None


def read_terms(source) -> CompilerTerms | None:
  """The terms for a profile source (as `load_profile` takes it): a profile JSON file's
  "compiler_terms" section if it has one, else the built-in terms of its name; a
  HardwareProfile gets the built-in terms of its name.

  Raises:
    ValueError: the file's section is malformed or of another version.
  """
  if isinstance(source, HardwareProfile):
    return builtin_terms(source.name)
  text = os.fspath(source)
  if os.path.isfile(text):
    with open(text, encoding="utf-8") as f:
      data = json.load(f)
    if SECTION in data:
      try:
        return CompilerTerms.from_json_dict(data[SECTION])
      except ValueError as e:
        raise ValueError(f"hardware profile {text!r}: {e}") from None
    return builtin_terms(str(data.get("name", "")))
  return builtin_terms(load_profile(text).name)


def write_terms(path, profile: HardwareProfile, terms: CompilerTerms) -> None:
  """Write `profile` as a profile JSON file with `terms` as its "compiler_terms"
  section (`load_profile(path)` reads the profile, `read_terms(path)` the terms)."""
  from .profiles import save_profile
  save_profile(profile, path)
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  data[SECTION] = terms.to_json_dict()
  with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2)
    f.write("\n")


# ----------------------------------------------------------------------------- pricing

def dot_seconds(terms: CompilerTerms, profile: HardwareProfile, flops: float) -> float:
  """A compiled dot of `flops` FLOPs: dot_fixed_s + flops / (peak * dot_efficiency)."""
  return terms.dot_fixed_s + flops / (profile.peak_flops * terms.dot_efficiency)


def _kind(op_name: str) -> str | None:
  return next((k for k in _KINDS if op_name.startswith(k)), None)


def compiled_seconds(problem: GemmProblem, algorithm: str, dataflow: str, ksplit: int,
                     profile: HardwareProfile, terms: CompilerTerms) -> float:
  """`algorithm`'s analytic schedule re-priced with the compiler terms (module
  docstring). Only the algorithms the pass emits on TPU are fitted: collective and
  meshslice; others keep the analytic time."""
  sched = schedule(problem, algorithm, dataflow, ksplit, profile)
  if algorithm not in ("collective", "meshslice"):
    return sched.cost().total_s
  slices = 1 if algorithm == "collective" else ksplit
  flops = problem.flops / (problem.rows * problem.cols) / slices
  overlap = terms.async_fraction[dataflow]
  total = 0.0
  for stage in sched.stages:
    compute = links_row = links_col = exposed = 0.0
    for op in stage.ops:
      if op.stream == "compute":
        compute += (dot_seconds(terms, profile, flops) if op.name == "matmul"
                    else op.seconds * terms.extra_scale[dataflow])
    has_compute = compute > 0 and profile.overlap
    for op in stage.ops:
      if op.stream == "compute":
        continue
      hidden = overlap.get(_kind(op.name), 0.0) if has_compute else 1.0
      exposed += op.seconds * (1 - hidden)
      if op.stream == "row":
        links_row += op.seconds * hidden
      else:
        links_col += op.seconds * hidden
    if has_compute:
      total += stage.repeat * (max(compute, links_row, links_col) + exposed)
    elif profile.overlap:
      total += stage.repeat * (max(compute, links_row, links_col))
    else:
      total += stage.repeat * (compute + links_row + links_col + exposed)
  return total


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class XlaProgram:
  """XLA's own program for a site: predicted seconds, whether windowed einsum fires,
  and in words what it is."""

  seconds: float
  windowed: bool
  description: str


def _movements(p: GemmProblem, dataflow: str):
  """(kind, mesh-axis size, profile dim, per-device shard bytes) of the two matrices a
  dataflow moves (docs/costmodel.md section 1)."""
  m, n, k, r, c, b = p.m, p.n, p.k, p.rows, p.cols, p.batch
  y = b * m / r * n / c * p.out_bytes
  row, col = (r, p.row_profile_dim), (c, p.col_profile_dim)
  return {"os": (("all_gather", *col, b * m / r * k / c * p.in_bytes),
                 ("all_gather", *row, b * k / r * n / c * p.in_bytes)),
          "ls": (("all_gather", *row, b * k / c * n / r * p.in_bytes),
                 ("reduce_scatter", *col, y)),
          "rs": (("all_gather", *col, b * m / c * k / r * p.in_bytes),
                 ("reduce_scatter", *row, y))}[dataflow]


def windowed_fires(problem: GemmProblem, dataflow: str, terms: CompilerTerms) -> bool:
  """Whether XLA's windowed einsum is predicted to fire on this site: the movement with
  the most bytes ((n - 1) * shard) rings over at least windowed_min_ring devices with a
  shard of at least windowed_min_bytes."""
  kind, size, dim, shard = max(_movements(problem, dataflow),
                               key=lambda v: (v[1] - 1) * v[3])
  return size >= terms.windowed_min_ring and shard >= terms.windowed_min_bytes


def xla_seconds(problem: GemmProblem, dataflow: str, profile: HardwareProfile,
                terms: CompilerTerms | None, baseline: str = "windowed") -> XlaProgram:
  """XLA's own program for the site (module docstring). baseline: "windowed" (windowed
  einsum on, libtpu's default: used where `windowed_fires`) or "dense" (off).

  Without terms (a profile of no TPU compiler) XLA's program is the collective algorithm
  as the analytic model prices it."""
  if baseline not in ("windowed", "dense"):
    raise ValueError(f"baseline must be 'windowed' or 'dense', got {baseline!r}")
  if terms is None:
    dense = schedule(problem, "collective", dataflow, 1, profile).cost().total_s
    return XlaProgram(seconds=dense, windowed=False, description="dense program")
  dense = compiled_seconds(problem, "collective", dataflow, 1, profile, terms)
  if baseline == "dense" or not windowed_fires(problem, dataflow, terms):
    return XlaProgram(seconds=dense, windowed=False, description="dense program")
  ring, other = sorted(_movements(problem, dataflow), key=lambda v: (v[1] - 1) * v[3],
                       reverse=True)
  kind, size, dim, shard = ring
  ring_s = math.ceil((size - 1) / 2) * permute_time(profile, dim, shard)
  okind, osize, odim, oshard = other
  other_s = collective_time(profile, okind, odim, osize, oshard)
  compute = dot_seconds(terms, profile, problem.flops / (problem.rows * problem.cols))
  seconds = other_s + max(compute * terms.windowed_compute_factor, ring_s)
  return XlaProgram(seconds=seconds, windowed=True,
                    description=f"windowed einsum (a ring over {size} devices)")
