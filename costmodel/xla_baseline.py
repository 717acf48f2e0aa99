"""What the TPU compiler makes of a site: XLA's own program ("leave it to XLA"), and the
per-site terms that compiled rewrites add to the analytic model.

The analytic model (timing.py) prices a schedule of collectives and matmuls. Compiled
TPU programs differ from it in ways a profile's peak and bandwidths cannot express; they
are fitted from ahead-of-time compiles (`python -m meshslice calibrate --aot v4:2x2x2`,
meshslice.costmodel.compiler_fit) into a `CompilerTerms`, stored in a profile JSON file
as the versioned section "compiler_terms":

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
  allreduce_max_block  per dataflow: sliced reduce-scatters whose block (communicated
                     extent / (S * lcm(R, C))) is at most this many elements compile as
                     synchronous all-reduces (twice the bytes; seen for ls, whose scatter
                     runs along the minor, 128-lane dim); 0: never seen
  last_allreduce_min_bytes  per dataflow, {reduce-scatter group size (a string, as JSON
                     keys are): bytes}: the *last* slice's reduce-scatter (the epilogue's,
                     with no matmul left to overlap) compiles as a synchronous all-reduce
                     when its group has that many devices and its partial sum (the
                     slice's unscattered piece of Y per device: Y shard * group / S) is
                     at least this many bytes (seen for rs over the 2-device axis of
                     v4:2x2x2 as 2x4); a group size not listed: never seen
  windowed_min_ring  XLA's windowed einsum (collective matmul) fires when its ring axis
  windowed_min_bytes has at least this many devices and (per dataflow) the windowed
                     matrix's per-device shard at least this many bytes. XLA windows the
                     reduce-scatter when the dataflow has one (ls, rs), else the larger
                     all-gather (os: X's)
  windowed_dot_factor  per dataflow: dot cycles of the windowed loop over the dense
                     program's (its chunk dots are estimated well above the fused dot)
  windowed_out_s     per dataflow: the loop's other compute, seconds per output element
                     per device (partial-sum updates of the reduce-scatter rings)
  windowed_ring_hidden  the share of the loop's compute that hides its ring of
                     collective-permutes (the rest of the ring is exposed)

With terms, a candidate's time is its analytic schedule re-priced stage by stage
(`compiled_seconds`): matmuls by the dot terms, other compute ops scaled by extra_scale,
and each collective beside compute split into an overlapped part (on its link) and an
exposed part (added):

    stage = max(compute, overlapped row link, overlapped col link) + exposed collectives

XLA's own program for the site (`xla_seconds`), under the recommended async flags:

    dense     (windowed einsum off, or not firing) the collective algorithm's schedule,
              nothing overlapped: XLA's partitioner emits the same all-gathers, dot and
              reduce-scatter (the check: docs/benchmarks-log.md, "Cost-model checks")
    windowed  a ring of collective-permutes over the windowed matrix's axis beside the
              chunk dots, the other axis's collective exposed:
              other collective + loop compute + max(0, ring - hidden * loop compute),
              loop compute = dense dot * windowed_dot_factor + output * windowed_out_s,
              ring = (n - 1) permutes of the windowed matrix's shard

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
import os

from .profiles import HardwareProfile, check_keys, load_profile, register_section_check
from .timing import (DATAFLOWS, GemmProblem, all_reduce_time, collective_time, movements,
                     permute_time, schedule)

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
  allreduce_max_block: dict
  windowed_min_ring: int
  windowed_min_bytes: dict
  windowed_dot_factor: dict
  windowed_out_s: dict
  windowed_ring_hidden: float
  source: str = ""
  last_allreduce_min_bytes: dict = dataclasses.field(
      default_factory=lambda: {flow: {} for flow in DATAFLOWS})

  def __post_init__(self):
    if not 0 < self.dot_efficiency <= 1:
      raise ValueError(f"dot_efficiency must be in (0, 1], got {self.dot_efficiency!r}")
    if self.dot_fixed_s < 0 or not 0 <= self.windowed_ring_hidden <= 1:
      raise ValueError("dot_fixed_s must be >= 0 and windowed_ring_hidden in [0, 1]")
    if self.windowed_min_ring < 2:
      raise ValueError(f"windowed_min_ring must be >= 2, got {self.windowed_min_ring!r}")
    for name in ("extra_scale", "allreduce_max_block", "windowed_min_bytes",
                 "windowed_dot_factor", "windowed_out_s"):
      values = getattr(self, name)
      if not isinstance(values, dict) or any(values.get(f, -1) < 0 for f in DATAFLOWS):
        raise ValueError(f"{name} needs a value >= 0 for each of {DATAFLOWS}, got "
                         f"{values!r}")
    limits = {}
    for flow in DATAFLOWS:
      groups = self.last_allreduce_min_bytes.get(flow) if isinstance(
          self.last_allreduce_min_bytes, dict) else None
      if not isinstance(groups, dict) or any(
          not str(g).isdigit() or int(g) < 2 or not isinstance(b, (int, float)) or b < 0
          for g, b in groups.items()):
        raise ValueError(f"last_allreduce_min_bytes[{flow!r}] needs {{group size >= 2: "
                         f"bytes >= 0}}, got {groups!r}")
      # JSON keys are strings: store them so, and a file round trip compares equal
      limits[flow] = {str(int(g)): float(b)
                      for g, b in sorted(groups.items(), key=lambda gb: int(gb[0]))}
      fractions = self.async_fraction.get(flow, {})
      if any(not 0 <= fractions.get(k, -1) <= 1 for k in _KINDS):
        raise ValueError(f"async_fraction[{flow!r}] needs {_KINDS} in [0, 1], got "
                         f"{fractions!r}")
    object.__setattr__(self, "last_allreduce_min_bytes", limits)   # frozen dataclass

  def to_json_dict(self) -> dict:
    return {"version": VERSION, **dataclasses.asdict(self)}

  @classmethod
  def from_json_dict(cls, data: dict) -> "CompilerTerms":
    version = data.get("version") if isinstance(data, dict) else None
    if version != VERSION:
      raise ValueError(f"section {SECTION!r}: version {version!r} is not {VERSION}; re-run "
                       "python -m meshslice calibrate --aot")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields - {"version"}
    if unknown:
      raise ValueError(f"section {SECTION!r}: unknown keys {sorted(unknown)}")
    try:
      return cls(**{k: v for k, v in data.items() if k != "version"})
    except TypeError as e:
      raise ValueError(f"section {SECTION!r}: {e}") from None


# Fitted by `python -m meshslice calibrate --aot v4:4x4x4 --mesh 8x8 --shapes
# 65536x8192x8192,32768x16384x4096,16384x4096x2048,8192x8192x8192` (jax 0.10.2, libtpu
# 0.0.42.1; the run: docs/benchmarks-log.md, "Cost-model checks"). v4:4x4x4, because windowed
# einsum needs a ring of >= 8 devices, which v4:2x2x2 lacks. Used for every TPU profile
# without a calibrated section: the terms are fractions and seconds, not cycles, though
# fitted on v4 only. Re-run after changing the emitted code.
_TPU_V4 = CompilerTerms(
    dot_efficiency=0.8909, dot_fixed_s=4.957e-06,
    extra_scale={"os": 0.885, "ls": 2.481, "rs": 2.157},
    async_fraction={"os": {"all_gather": 0.5, "reduce_scatter": 0.0},
                    "ls": {"all_gather": 1.0, "reduce_scatter": 0.0},
                    "rs": {"all_gather": 1.0, "reduce_scatter": 0.0}},
    allreduce_max_block={"os": 0.0, "ls": 128.0, "rs": 0.0},
    windowed_min_ring=8,
    windowed_min_bytes={"os": 2097152.0, "ls": 1048576.0, "rs": 2097152.0},
    windowed_dot_factor={"os": 2.957, "ls": 2.313, "rs": 2.128},
    windowed_out_s={"os": 4.092e-11, "ls": 2.4e-10, "rs": 2.397e-10},
    windowed_ring_hidden=0.0,
    # v4:4x4x4 as 8x8 has no 2-device axis: fitted to aot_sites.compile_cases on
    # v4:2x2x2 as 2x4 (ls, rs; n = 4096, 8192, 16384; S = 1, 2, 4; docs/tpu.md)
    last_allreduce_min_bytes={"os": {}, "ls": {}, "rs": {"2": 16777216.0}},
    source="built-in: calibrate --aot v4:4x4x4 --mesh 8x8, the last-slice all-reduce "
           "from v4:2x2x2 --mesh 2x4 (jax 0.10.2, libtpu 0.0.42.1)")


def builtin_terms(profile_name: str) -> CompilerTerms | None:
  """The shipped terms for a profile name: TPU profiles ("tpu-*") get the v4 fit, others
  (cpu, h100: no TPU compiler) none.

  Example:
    >>> builtin_terms("cpu") is None, builtin_terms("tpu-v5e") is not None
    (True, True)
  """
  return _TPU_V4 if profile_name.startswith("tpu-") else None


def _check_section(section) -> None:
  """A profile file's "compiler_terms" section: a JSON object with known keys, its tables
  JSON objects (`read_terms` checks the values and the version when the terms are used)."""
  if not isinstance(section, dict):
    raise ValueError(f"field {SECTION!r} must be a JSON object, got {section!r}")
  reference = builtin_terms("tpu-v4").to_json_dict()
  check_keys(section, tuple(reference), SECTION)
  for key, value in section.items():
    shape = reference[key]
    if isinstance(shape, dict):
      if not isinstance(value, dict):
        raise ValueError(f"field '{SECTION}.{key}' must be a JSON object, got {value!r}")
      for sub, inner in value.items():
        if isinstance(shape.get(sub), dict) and not isinstance(inner, dict):
          raise ValueError(f"field '{SECTION}.{key}.{sub}' must be a JSON object, got "
                           f"{inner!r}")


register_section_check(SECTION, _check_section)


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


def _compute_op_seconds(op, terms: CompilerTerms, profile: HardwareProfile, flops: float,
                        dataflow: str) -> float:
  """A compute op of an analytic schedule re-priced with the compiler terms: a matmul
  of `flops` by the dot terms, any other op scaled by extra_scale[dataflow]."""
  return (dot_seconds(terms, profile, flops) if op.name == "matmul"
          else op.seconds * terms.extra_scale[dataflow])


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
  # sliced reduce-scatters on blocks too small for the compiler: synchronous all-reduces
  as_all_reduce = last_as_all_reduce = None
  block = problem.extent(dataflow) / (slices * problem.lcm)
  scatter = next((v for v in movements(problem, dataflow) if v.kind == "reduce_scatter"), None)
  size, dim, shard = (scatter.size, scatter.dim, scatter.shard_bytes) if scatter else (1, 0, 0.0)
  partial = shard / slices * size          # one slice's unscattered piece, per device
  if slices > 1 and size > 1:
    if block <= terms.allreduce_max_block[dataflow]:
      as_all_reduce = all_reduce_time(profile, dim, size, partial)
    elif partial >= terms.last_allreduce_min_bytes[dataflow].get(str(size), float("inf")):
      last_as_all_reduce = all_reduce_time(profile, dim, size, partial)
  # the epilogue: the last stage that reduce-scatters
  last = max((i for i, st in enumerate(sched.stages)
              if any(_kind(op.name) == "reduce_scatter" for op in st.ops)), default=-1)
  total = 0.0
  for i, stage in enumerate(sched.stages):
    compute = links_row = links_col = exposed = 0.0
    for op in stage.ops:
      if op.stream == "compute":
        compute += _compute_op_seconds(op, terms, profile, flops, dataflow)
    has_compute = compute > 0 and profile.overlap
    for op in stage.ops:
      if op.stream == "compute":
        continue
      seconds, kind = op.seconds, _kind(op.name)
      if kind == "reduce_scatter" and as_all_reduce is not None:
        seconds, hidden = as_all_reduce, 0.0
      elif kind == "reduce_scatter" and i == last and last_as_all_reduce is not None:
        seconds, hidden = last_as_all_reduce, 0.0
      else:
        hidden = overlap.get(kind, 0.0) if has_compute else 1.0
      exposed += seconds * (1 - hidden)
      if op.stream == "row":
        links_row += seconds * hidden
      else:
        links_col += seconds * hidden
    if profile.overlap:
      total += stage.repeat * (max(compute, links_row, links_col) + exposed)
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


def windowed_movement(problem: GemmProblem, dataflow: str):
  """(windowed movement, other movement) of XLA's windowed einsum on this site, each as
  (kind, mesh-axis size, profile dim, per-device shard bytes) of `timing.movements`: the
  output's movement when the dataflow moves Y, else the all-gather moving more bytes."""
  moves = movements(problem, dataflow)
  # An all-reduce site's Y too, though XLA never windows an all-reduce: the planner
  # prices those sites dense before asking (meshslice.costing.xla_program).
  out = [v for v in moves if v.matrix == "Y"]
  ring = out[0] if out else max(moves, key=lambda v: (v.size - 1) * v.shard_bytes)
  other = next(v for v in moves if v is not ring)
  return tuple((v.kind, v.size, v.dim, v.shard_bytes) for v in (ring, other))


def windowed_fires(problem: GemmProblem, dataflow: str, terms: CompilerTerms) -> bool:
  """Whether XLA's windowed einsum is predicted to fire on this site: its ring has at
  least windowed_min_ring devices and the windowed matrix's shard at least
  windowed_min_bytes[dataflow]."""
  (_, size, _, shard), _ = windowed_movement(problem, dataflow)
  return size >= terms.windowed_min_ring and shard >= terms.windowed_min_bytes[dataflow]


def windowed_parts(problem: GemmProblem, dataflow: str, profile: HardwareProfile,
                   terms: CompilerTerms | None):
  """(exposed other collective, loop compute without the factors: dense dot seconds,
  output elements per device, ring seconds) of XLA's windowed einsum on this site."""
  (_, size, dim, shard), (okind, osize, odim, oshard) = windowed_movement(problem, dataflow)
  ring_s = (size - 1) * permute_time(profile, dim, shard)
  other_s = collective_time(profile, okind, odim, osize, oshard)
  devices = problem.rows * problem.cols
  dot = (dot_seconds(terms, profile, problem.flops / devices) if terms is not None
         else problem.flops / devices / profile.peak_flops)
  out = problem.batch * problem.m * problem.n / devices
  return other_s, dot, out, ring_s


def offloaded_seconds(problem: GemmProblem, dataflow: str, profile: HardwareProfile,
                      terms: CompilerTerms | None, offloaded, algorithm: str = "collective",
                      ksplit: int = 1, *, forward: bool = False) -> float:
  """A site's program (XLA's dense program: the collective algorithm; or a rewrite's,
  `algorithm` with `ksplit` slices) with the collectives of `offloaded` (kinds:
  "all_gather", "reduce_scatter", "all_reduce") run on the SparseCore (v5p / v6e under
  `--xla_tpu_enable_sparse_core_collective_offload_*`): those run beside the compute on
  their links, the others stay exposed:

      max(compute, offloaded on the row link, offloaded on the column link) + the rest

  Compute is priced as `compiled_seconds` prices it (dot terms, extra_scale); without
  terms, as the analytic model does. Whole-program, not per stage: XLA's scheduler
  overlaps a site's offloaded collectives with other sites' compute too (measured,
  GPT-3 on v5p 64x4 under the offload flags: 10.6 ms of 97.3 ms exposed,
  docs/benchmarks-log.md), so this is the site's limit. Slicing then only adds compute: the
  collective algorithm is the fastest program under offload.

  forward: a forward-pass site. There each matmul feeds the next, so nothing independent
  runs beside the collectives of its activations (X gathered before the dot, Y
  reduce-scattered after it): they are waited on, and only the weight's (W, there from
  the step's start) still hides under the compute:

      max(compute, W's offloaded collectives per link) + X's and Y's + the rest

  Measured in XLA's dense program for GPT-3 on 256 v6e chips (64x4): every forward
  activation gather is waited on as soon as it is issued; the weights' gathers hide.
  Sliced, they do not pipeline either (there libtpu issued each offloaded collective only
  after the previous one was done), so slicing still only adds compute; what pays is a
  dataflow whose activations move fewer bytes."""
  sched = schedule(problem, algorithm, dataflow, ksplit, profile)
  slices = ksplit if algorithm == "meshslice" else 1
  flops = problem.flops / (problem.rows * problem.cols) / slices
  compute = links_row = links_col = exposed = 0.0
  for stage in sched.stages:
    for op in stage.ops:
      seconds = op.seconds * stage.repeat
      if op.stream == "compute":
        if terms is not None:
          seconds = stage.repeat * _compute_op_seconds(op, terms, profile, flops, dataflow)
        compute += seconds
      elif not any(op.name.startswith(kind) for kind in offloaded) or (
          forward and _moved_matrix(op.name) in ("X", "Y")):
        exposed += seconds
      elif op.stream == "row":
        links_row += seconds
      else:
        links_col += seconds
  return max(compute, links_row, links_col) + exposed


def _moved_matrix(op_name: str) -> str:
  """The matrix a modelled collective moves ("all_gather X slice" -> "X"), "" if none."""
  words = op_name.split()
  return words[1] if len(words) > 1 and words[1] in ("X", "W", "Y") else ""


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
  other_s, dot, out, ring_s = windowed_parts(problem, dataflow, profile, terms)
  loop = dot * terms.windowed_dot_factor[dataflow] + out * terms.windowed_out_s[dataflow]
  seconds = other_s + loop + max(0.0, ring_s - terms.windowed_ring_hidden * loop)
  (_, size, _, _), _ = windowed_movement(problem, dataflow)
  return XlaProgram(seconds=seconds, windowed=True,
                    description=f"windowed einsum (a ring over {size} devices)")
