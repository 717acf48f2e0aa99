"""How long one distributed GEMM site takes: collective and GEMM time formulas, the
schedule of each algorithm, and the perfect-overlap lower bound.

A site is `Y[M,N] = X[M,K] . W[K,N]` on an R x C mesh (docs/design.md), described
without JAX by a `GemmProblem`. Every algorithm is modelled as a *schedule*: a sequence
of stages, each stage a set of operations on three streams — the compute unit and the
two mesh-axis links ("row": the axis of size R, "col": the axis of size C). Operations
on different streams of a stage run concurrently, operations on one stream run back to
back, and a stage ends when its slowest stream does (the emitted code joins each
pipeline step with an optimization barrier). So

    stage time  = max(compute, row-link time, col-link time)
    total       = sum of stage times

Formulas (per device; b = per-device shard in bytes, n = size of the mesh axis):

    collective (all-gather / reduce-scatter, bidirectional ring)
                = base_overhead + (n - 1) * b / bandwidth + (n - 1) * hop_latency
    permute     = base_overhead + b / bandwidth + hops * hop_latency       (send/recv)
    all-reduce  = reduce-scatter + all-gather of b / n each    (SUMMA's masked psum)
    GEMM        = max(2 * batch * m * n * k / (peak_flops * efficiency(m, n, k)),
                      HBM bytes / hbm_bandwidth) + op_overhead
                  (HBM bytes: inputs read once, output written once, or a float32
                   partial sum read and written when the matmul accumulates)
    copy        = 2 * bytes / hbm_bandwidth + op_overhead      (a copy in HBM)

A collective over an axis of size 1 is not issued and costs nothing. Bandwidth,
latency and overhead are those of the profile dim (0 or 1) the mesh axis is mapped to
(with a topology, `topology.profile_for_mesh` derives those dims for one mesh). The
whole model, with its sources, is written up in docs/costmodel.md.

The two movements of each dataflow (which matrix goes over which link; `movements`):

    dataflow  row link (size R)                  col link (size C)
    os        all-gather W  (k/R x n/C)          all-gather X  (m/R x k/C)
    ls        all-gather W  (k/C x n/R)          reduce-scatter Y (m/R x n/C)
    rs        reduce-scatter Y (m/R x n/C)       all-gather X  (m/C x k/R)

with the local matmul (m/R, n/C, k) for os, (m/R, n, k/C) for ls and (m, n/C, k/R) for
rs, sliced along the communicated dim (k, n, m respectively).

Algorithms (each time model follows the schedule its builder in meshslice.rewrites
emits; `algorithm_doc(name)` gives the details and assumptions):

    collective  GSPMD's all-gather, matmul, reduce-scatter; nothing overlaps; ksplit 1
    meshslice   ksplit block-cyclic slices, collectives pipelined beside the matmuls,
                the slices cut in one pass before, the output finished in one after
    cannon      square meshes; skew, then neighbour shifts; ksplit chunks per block
    wang        one axis as a ring of permutes (options ring=, bidirectional=), the
                other a plain collective; ksplit chunks per ring block
    summa       ksplit * lcm(R, C) panel steps, broadcasts / reduces as masked psums

1D-sharded matmuls (only one mesh axis involved) are the same problem with R = 1 or
C = 1: see `GemmProblem.one_d` (collective, meshslice and wang apply; cannon and summa
need two axes). An all-reduce site, whose partial sums are psummed rather than
scattered, is `one_d(collective="all_reduce")`: its Y movement costs `all_reduce_time`,
and only collective and meshslice apply.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from .profiles import HardwareProfile, load_profile

# The names of meshslice.rewrites.ALGORITHMS and rewrites.geometry.DATAFLOWS (this package
# cannot import them). The order is this package's own: the autotuner tries candidates in
# it and keeps the earlier on a tie, so the simplest algorithm comes first.
ALGORITHMS = ("collective", "meshslice", "cannon", "wang", "summa")
DATAFLOWS = ("os", "ls", "rs")
REDUCTIONS = ("reduce_scatter", "all_reduce")
STREAMS = ("compute", "row", "col")


def _positive_int(value, name):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GemmProblem:
  """One 2D-sharded GEMM site, independent of JAX.

  Attributes:
    m, n, k: global sizes of the M, N and K dim groups (products of their dims).
    rows, cols: mesh sizes R (row axis r) and C (column axis c).
    batch: product of the dot_general batch dims (they ride along unsharded).
    in_bytes: bytes per element of both inputs.
    out_bytes: bytes per element of the output (and of reduce-scattered partials).
    row_profile_dim, col_profile_dim: which profile dim (0 or 1: the pair index of the
      profile's bandwidths) the row and column axes communicate over.
    reduction: how the partial sums of Y leave the matmul when the dataflow moves Y:
      "reduce_scatter" (Y ends split over that axis) or "all_reduce" (Y ends whole on
      every device of the axis: a 1D all-reduce site, `one_d(collective="all_reduce")`).

  Example:
    >>> p = GemmProblem(m=4096, n=4096, k=4096, rows=2, cols=4)
    >>> p.lcm, p.extent("os"), p.local_shape("ls")
    (4, 4096, (2048.0, 4096.0, 1024.0))
  """

  m: int
  n: int
  k: int
  rows: int
  cols: int
  batch: int = 1
  in_bytes: int = 2
  out_bytes: int = 2
  row_profile_dim: int = 0
  col_profile_dim: int = 1
  reduction: str = "reduce_scatter"

  def __post_init__(self):
    for name in ("m", "n", "k", "rows", "cols", "batch", "in_bytes", "out_bytes"):
      _positive_int(getattr(self, name), name)
    for name in ("row_profile_dim", "col_profile_dim"):
      if getattr(self, name) not in (0, 1) or isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be 0 or 1 (a profile dim), got "
                         f"{getattr(self, name)!r}")
    if self.reduction not in REDUCTIONS:
      raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")

  @classmethod
  def one_d(cls, *, m: int, n: int, k: int, size: int, collective: str,
            profile_dim: int = 1, batch: int = 1, in_bytes: int = 2,
            out_bytes: int = 2) -> "GemmProblem":
    """A 1D-sharded matmul over one mesh axis of `size` devices; predict it with
    dataflow "rs" (the 2D formulas with the other axis of size 1).

    collective="all_gather": X[M:size, K] is gathered along M, then multiplied by
      W[K, N:size] (sequence-parallel column-parallel linear) -> rows=1, cols=size.
    collective="reduce_scatter": X[M, K:size] . W[K:size, N] gives partial sums that
      are reduce-scattered along M (row-parallel linear) -> rows=size, cols=1.
    collective="all_reduce": the same partial sums psummed, Y[M, N] whole on every
      device (a row-parallel linear feeding replicated activations) -> rows=size,
      cols=1, reduction="all_reduce"; M is the dim cut into slices.

    Example:
      >>> p = GemmProblem.one_d(m=8192, n=4096, k=4096, size=8, collective="all_gather")
      >>> (p.rows, p.cols), p.local_shape("rs")
      ((1, 8), (8192.0, 512.0, 4096.0))
      >>> GemmProblem.one_d(m=8192, n=4096, k=4096, size=8, collective="all_reduce").reduction
      'all_reduce'
    """
    if collective not in ("all_gather", "reduce_scatter", "all_reduce"):
      raise ValueError(f"collective must be 'all_gather', 'reduce_scatter' or 'all_reduce', "
                       f"got {collective!r}")
    if profile_dim not in (0, 1):
      raise ValueError(f"profile_dim must be 0 or 1, got {profile_dim!r}")
    rows, cols = (1, size) if collective == "all_gather" else (size, 1)
    return cls(m=m, n=n, k=k, rows=rows, cols=cols, batch=batch, in_bytes=in_bytes,
               out_bytes=out_bytes, row_profile_dim=profile_dim,
               col_profile_dim=profile_dim,
               reduction="all_reduce" if collective == "all_reduce" else "reduce_scatter")

  @property
  def lcm(self) -> int:
    return math.lcm(self.rows, self.cols)

  @property
  def flops(self) -> int:
    """Global FLOPs of the GEMM (2 per multiply-add)."""
    return 2 * self.batch * self.m * self.n * self.k

  def extent(self, dataflow: str) -> int:
    """Global size of the communicated dim: k (os), n (ls) or m (rs)."""
    return {"os": self.k, "ls": self.n, "rs": self.m}[_dataflow(dataflow)]

  def local_shape(self, dataflow: str) -> tuple[float, float, float]:
    """(m, n, k) of the unsliced local matmul of `dataflow`."""
    m, n, k, r, c = self.m, self.n, self.k, self.rows, self.cols
    return {"os": (m / r, n / c, float(k)), "ls": (m / r, float(n), k / c),
            "rs": (float(m), n / c, k / r)}[_dataflow(dataflow)]


def _dataflow(dataflow):
  if dataflow not in DATAFLOWS:
    raise ValueError(f"dataflow must be one of {DATAFLOWS}, got {dataflow!r}")
  return dataflow


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
  """Predicted seconds of one site (or, summed with `+`, of many).

  Attributes:
    compute_s: time the compute unit is busy.
    comm_s: time the communication would take on its own (the two links run in
      parallel, so each stage counts its slowest link).
    exposed_comm_s: total_s - compute_s, the communication not hidden under compute.
    total_s: predicted wall time.

  Example:
    >>> a = Cost(compute_s=2.0, comm_s=1.0, exposed_comm_s=0.5, total_s=2.5)
    >>> (a + a).total_s, (3 * a).compute_s, sum([a, a]).comm_s
    (5.0, 6.0, 2.0)
  """

  compute_s: float = 0.0
  comm_s: float = 0.0
  exposed_comm_s: float = 0.0
  total_s: float = 0.0

  def __add__(self, other):
    if not isinstance(other, Cost):
      return NotImplemented
    return Cost(compute_s=self.compute_s + other.compute_s,
                comm_s=self.comm_s + other.comm_s,
                exposed_comm_s=self.exposed_comm_s + other.exposed_comm_s,
                total_s=self.total_s + other.total_s)

  def __radd__(self, other):
    # Lets the builtin sum() start from 0.
    if isinstance(other, (int, float)) and other == 0:
      return self
    return NotImplemented

  def __mul__(self, factor):
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
      return NotImplemented
    return Cost(compute_s=self.compute_s * factor, comm_s=self.comm_s * factor,
                exposed_comm_s=self.exposed_comm_s * factor,
                total_s=self.total_s * factor)

  __rmul__ = __mul__


# ----------------------------------------------------------------------------- formulas

def collective_time(profile: HardwareProfile, kind: str, dim: int, n: int,
                    shard_bytes: float) -> float:
  """All-gather / reduce-scatter on a ring of n devices, shard_bytes per device.

  base_overhead + (n - 1) * shard_bytes / bandwidth + (n - 1) * hop_latency; 0 for n = 1.

  Example:
    >>> p = load_profile("tpu-v4")
    >>> round(collective_time(p, "all_gather", 1, 4, 79.751e6) * 1e6, 3)   # 13 + 3000 + 15 us
    3028.0
  """
  if n <= 1:
    return 0.0
  c = profile.collective(kind)
  return (c.base_overhead[dim] + (n - 1) * shard_bytes / c.bandwidth[dim]
          + (n - 1) * c.hop_latency[dim])


def permute_time(profile: HardwareProfile, dim: int, nbytes: float, hops: int = 1) -> float:
  """One send/recv of nbytes over `hops` ring hops: base + nbytes / bw + hops * hop.

  Example:
    >>> p = load_profile("tpu-v4")           # dim 0: 13 us + 38.801e6 B at 38.801e9 + 50 us
    >>> round(permute_time(p, 0, 38.801e6) * 1e6, 6)
    1063.0
  """
  c = profile.permute
  return c.base_overhead[dim] + nbytes / c.bandwidth[dim] + hops * c.hop_latency[dim]


def all_reduce_time(profile: HardwareProfile, dim: int, n: int, nbytes: float) -> float:
  """psum of nbytes over a ring of n devices: a reduce-scatter then an all-gather of the
  nbytes / n shard (each with its own base overhead and hops); 0 for n = 1.

  It is how the emitted SUMMA broadcasts a panel (the owner contributes it, everyone else
  zeros) and reduces partial sums onto their owner.

  Example:
    >>> p = load_profile("tpu-v4")   # RS: 26 + 1000 + 5 us, AG: 13 + 792.05 + 5 us
    >>> round(all_reduce_time(p, 1, 2, 2 * 63.167e6) * 1e6, 2)
    1841.05
  """
  if n <= 1:
    return 0.0
  return (collective_time(profile, "reduce_scatter", dim, n, nbytes / n)
          + collective_time(profile, "all_gather", dim, n, nbytes / n))


def gemm_time(profile: HardwareProfile, m: float, n: float, k: float, batch: int = 1, *,
              in_bytes: int = 2, out_bytes: int = 2, accumulate: bool = False) -> float:
  """Seconds of one local matmul: a roofline plus a fixed cost per op,

      max(2 * batch * m * n * k / (peak * efficiency(m, n, k)),  hbm_bytes / hbm_bandwidth)
        + op_overhead

  hbm_bytes = batch * ((m * k + k * n) * in_bytes + m * n * y_bytes): each input read
  once, the output written once (y_bytes = out_bytes). When the matmul adds into a
  float32 partial sum that lives in HBM (`accumulate`: a slice of a sliced contraction,
  or a partial sum received from a neighbour), y_bytes = profile.accumulate_bytes (8:
  read and write it) if the profile's accumulation is fused into the matmul; if it is
  not (accumulate_fused false, XLA on GPU), the matmul's output is not counted in the
  max and batch * m * n * accumulate_bytes / hbm_bandwidth is *added* after it (the
  separate add pass). The memory terms are left out when the profile has no
  hbm_bandwidth (0).

  Batch dims multiply the work but do not improve efficiency (conservative).

  Example:
    >>> p = load_profile("cpu")          # no HBM term, no op overhead: FLOPs / (peak * eff)
    >>> round(gemm_time(p, 1000, 1000, 1000) * 1e3, 9)    # 2e9 FLOP at 0.5 * 5e10 FLOP/s
    80.0
    >>> v4 = load_profile("tpu-v4")     # 2.75e14 * 0.92 FLOP/s, 1.2e12 B/s, 3.5 us per op
    >>> round(gemm_time(v4, 8192, 8192, 8192) * 1e3, 3)                  # compute bound
    4.349
    >>> round(gemm_time(v4, 8192, 8192, 256, accumulate=True) * 1e6, 1)  # HBM bound
    457.9
  """
  if m <= 0 or n <= 0 or k <= 0:
    return 0.0
  compute = 2.0 * batch * m * n * k / (profile.peak_flops * profile.gemm(m, n, k))
  if profile.hbm_bandwidth > 0:
    fused = accumulate and profile.accumulate_fused
    y_bytes = profile.accumulate_bytes if fused else 0 if accumulate else out_bytes
    moved = batch * ((m * k + k * n) * in_bytes + m * n * y_bytes)
    compute = max(compute, moved / profile.hbm_bandwidth)
    if accumulate and not fused:      # a separate pass: product out, partial sum in / out
      compute += batch * m * n * profile.accumulate_bytes / profile.hbm_bandwidth
  return compute + profile.op_overhead


def copy_time(profile: HardwareProfile, nbytes: float) -> float:
  """A relayout copy of nbytes in HBM (read + write): 2 * nbytes / hbm_bandwidth +
  op_overhead (just op_overhead without an HBM bandwidth).

  Example:
    >>> round(copy_time(load_profile("tpu-v4"), 12e6) * 1e6, 1)     # 24 MB at 1.2e12 + 3.5
    23.5
  """
  moved = 2.0 * nbytes / profile.hbm_bandwidth if profile.hbm_bandwidth > 0 else 0.0
  return moved + profile.op_overhead


# ----------------------------------------------------------------------------- schedules

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Op:
  """One operation of a schedule: `seconds` on `stream` ("compute", "row" or "col")."""

  stream: str
  name: str
  seconds: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
  """Operations that start together; the stage lasts as long as its busiest stream.

  `repeat` consecutive identical stages are stored once (a ring of 512 steps is a few
  Stage records, not 512), so predicting stays cheap on large meshes.
  """

  ops: tuple[Op, ...]
  repeat: int = 1

  def stream_time(self, stream: str) -> float:
    return sum(op.seconds for op in self.ops if op.stream == stream)

  @property
  def duration(self) -> float:
    """Seconds of one repetition."""
    return max(self.stream_time(s) for s in STREAMS)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
  """The predicted schedule of one site under one algorithm / dataflow / ksplit / options.

  Example:
    >>> p = GemmProblem(m=8192, n=8192, k=8192, rows=4, cols=4)
    >>> s = schedule(p, "meshslice", "os", 2, load_profile("tpu-v4"))
    >>> [(sorted({op.stream for op in st.ops}), st.repeat)
    ...  for st in s.stages]                     # doctest: +NORMALIZE_WHITESPACE
    [(['compute'], 1), (['col'], 1), (['row'], 1), (['col', 'compute', 'row'], 1),
     (['compute'], 1), (['compute'], 1)]
  """

  problem: GemmProblem
  algorithm: str
  dataflow: str
  ksplit: int
  stages: tuple[Stage, ...]
  options: tuple[tuple[str, object], ...] = ()
  note: str = ""
  overlap: bool = True

  def cost(self) -> Cost:
    compute = sum(st.repeat * st.stream_time("compute") for st in self.stages)
    comm = sum(st.repeat * max(st.stream_time("row"), st.stream_time("col"))
               for st in self.stages)
    if self.overlap:
      total = sum(st.repeat * st.duration for st in self.stages)
    else:   # the streams of a stage run one after another (profile.overlap is False)
      total = sum(st.repeat * sum(st.stream_time(s) for s in STREAMS) for st in self.stages)
    return Cost(compute_s=compute, comm_s=comm, exposed_comm_s=max(0.0, total - compute),
                total_s=total)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Movement:
  """One matrix crossing one link: what the dataflow communicates (unsliced)."""

  kind: str           # "all_gather" (an input arrives), "reduce_scatter" or "all_reduce"
                      # (the output's partial sums leave: GemmProblem.reduction)
  link: str           # "row" or "col"
  size: int           # devices on that mesh axis
  dim: int            # profile dim of that axis
  shard_bytes: float  # per-device shard, whole (unsliced); for an all-reduce the piece
                      # each of its two halves moves per device (the buffer / size)
  matrix: str         # "X", "W" or "Y", for labels


def movements(p: GemmProblem, dataflow: str) -> tuple[Movement, Movement]:
  """The two movements of `dataflow` (the module docstring's table): for os X then W,
  for ls and rs the gathered input, then the output Y, whose kind is `p.reduction`.

  Example:
    >>> p = GemmProblem.one_d(m=8192, n=4096, k=4096, size=8, collective="all_reduce")
    >>> [(v.matrix, v.kind, v.link, v.size) for v in movements(p, "rs")]
    [('X', 'all_gather', 'col', 1), ('Y', 'all_reduce', 'row', 8)]
  """
  dataflow = _dataflow(dataflow)
  m, n, k, r, c, b = p.m, p.n, p.k, p.rows, p.cols, p.batch
  row: dict[str, Any] = dict(link="row", size=r, dim=p.row_profile_dim)
  col: dict[str, Any] = dict(link="col", size=c, dim=p.col_profile_dim)
  y_bytes = b * m / r * n / c * p.out_bytes
  if dataflow == "os":
    return (Movement(kind="all_gather", matrix="X", shard_bytes=b * m / r * k / c * p.in_bytes,
                     **col),
            Movement(kind="all_gather", matrix="W", shard_bytes=b * k / r * n / c * p.in_bytes,
                     **row))
  if dataflow == "ls":
    return (Movement(kind="all_gather", matrix="W", shard_bytes=b * k / c * n / r * p.in_bytes,
                     **row),
            Movement(kind=p.reduction, matrix="Y", shard_bytes=y_bytes, **col))
  return (Movement(kind="all_gather", matrix="X", shard_bytes=b * m / c * k / r * p.in_bytes,
                   **col),
          Movement(kind=p.reduction, matrix="Y", shard_bytes=y_bytes, **row))


# the names before movements() became public (compiler_fit, memory and xla_baseline
# imported them)
_Movement = Movement
_movements = movements


def _out_elements(p: GemmProblem, dataflow: str) -> float:
  """Elements of the output one device ends with: the Y shard, or, after an all-reduce,
  the Y shard times the size of the axis Y was summed over (it stays whole there)."""
  y = p.batch * p.m / p.rows * p.n / p.cols
  whole = [v.size for v in movements(p, dataflow) if v.kind == "all_reduce"]
  return y * (whole[0] if whole else 1)


def _sliced_shape(p: GemmProblem, dataflow: str, parts: float) -> tuple[float, float, float]:
  """The local matmul with its communicated dim cut into `parts`."""
  lm, ln, lk = p.local_shape(dataflow)
  return {"os": (lm, ln, lk / parts), "ls": (lm, ln / parts, lk),
          "rs": (lm / parts, ln, lk)}[dataflow]


def _matmul(p, profile, dataflow, parts, count=1, accumulate=False) -> Op:
  """`count` back-to-back local matmuls with the communicated dim cut into `parts`;
  `accumulate`: each adds into a float32 partial sum held in HBM."""
  seconds = count * gemm_time(profile, *_sliced_shape(p, dataflow, parts), batch=p.batch,
                              in_bytes=p.in_bytes, out_bytes=p.out_bytes,
                              accumulate=accumulate)
  return Op(stream="compute", name="matmul" if count == 1 else f"{count} matmuls",
            seconds=seconds)


def _stages(*runs) -> list[Stage]:
  """Stages from (repeat, ops) runs, dropping empty ones."""
  return [Stage(ops=tuple(ops), repeat=int(repeat)) for repeat, ops in runs
          if repeat > 0 and ops]


def _pipeline(steps, compute, ahead=(), behind=(), *, prologue=True, epilogue=True,
              serial_prologue=False):
  """A software pipeline of `steps` equal matmuls (`compute`: one Op, or a list of the
  compute-stream ops of one step).

  ahead: the ops that bring in one step's operands (those of step s+1 run beside step s;
  step 0's in a prologue). behind: the ops that ship one step's result (step s's run
  beside step s+1; the last step's in an epilogue). serial_prologue: the prologue's ops
  run one after the other (synchronous collectives), not side by side.
  """
  ahead, behind = list(ahead), list(behind)
  compute = list(compute) if isinstance(compute, (list, tuple)) else [compute]
  first = ([(prologue, [op]) for op in ahead] if serial_prologue else [(prologue, ahead)])
  if steps == 1:
    return _stages(*first, (1, compute), (epilogue, behind))
  return _stages(*first,
                 (1, compute + ahead),
                 (steps - 2, compute + ahead + behind),
                 (1, compute + behind),
                 (epilogue, behind))


_SCHEDULES = {}


def _algorithm(name, options=()):
  """Register the time model of `name`, taking the keyword `options` (as the builder in
  meshslice.rewrites does)."""
  def register(fn):
    _SCHEDULES[name] = (fn, options)
    return fn
  return register


def _collective_ops(profile, mv: Movement, parts: int, label: str) -> list[Op]:
  if mv.size <= 1:
    return []   # not issued
  if mv.kind == "all_reduce":   # psum of the slice: its reduce-scatter and all-gather halves
    t = all_reduce_time(profile, mv.dim, mv.size, mv.shard_bytes * mv.size / parts)
  else:
    t = collective_time(profile, mv.kind, mv.dim, mv.size, mv.shard_bytes / parts)
  return [Op(stream=mv.link, name=label, seconds=t)]


# scatter (the form of the reduce-scatter: one collective, or an all-to-all and a local
# sum) moves the same bytes over the same link; which form the compiler overlaps is the
# compiler's business (docs/tpu.md), so this model prices both alike.
@_algorithm("meshslice", options=("scatter",))
def _meshslice(p: GemmProblem, dataflow, ksplit, profile, scatter="reduce_scatter"):
  """MeshSlice with S = ksplit block-cyclic slices, software-pipelined (as emitted):

      prologue: all-gather(s=0)                 # os: both, one after the other (sync)
      step s:   matmul(s) || all-gather(s+1) || reduce-scatter(s-1)
      epilogue: reduce-scatter(S-1)                       # ls / rs only

  On an all-reduce site (`GemmProblem.reduction`) each reduce-scatter is the psum of the
  slice instead (`all_reduce_time`: a reduce-scatter and an all-gather of it), and the
  output concatenated at the end is the whole Y.

  Each sliced collective moves 1/S of the shard but pays the full base overhead and
  hop latencies. For os: total = prologue + (S-1) * max(comm_slice, compute_slice) +
  compute_slice, comm_slice being the slower of the two links and the prologue the sum
  of the two first-slice gathers. For ls / rs the
  all-gather (one link) and the reduce-scatter (the other link) of a step overlap.

  With S > 1 the compute stream also carries what the emitted body adds to the dense
  program (checked with the TPU compiler: no relayout copies, docs/tpu.md):

      cut:      before the prologue, the local shards of the gathered inputs are cut
                into their S slices in one pass (`copy_time` of those shards)
      matmuls:  for os every slice's matmul adds into the float32 accumulator in HBM
                (`gemm_time` with accumulate)
      finish:   after the epilogue, os converts the accumulator to the output dtype
                (read 4 + write out_bytes per element); ls / rs concatenate the S
                reduce-scattered pieces into the output shard (`copy_time` of it)

  These terms track the TPU compiler's own estimate of a sliced site's compute (the
  figures: docs/benchmarks-log.md, "Cost-model checks"). S = 1 is the collective algorithm
  exactly.
  """
  mv = movements(p, dataflow)
  ahead = [op for v in mv if v.kind == "all_gather"
           for op in _collective_ops(profile, v, ksplit, f"all_gather {v.matrix} slice")]
  behind = [op for v in mv if v.kind != "all_gather"
            for op in _collective_ops(profile, v, ksplit, f"{v.kind} {v.matrix} slice")]
  compute = _matmul(p, profile, dataflow, ksplit, accumulate=dataflow == "os" and ksplit > 1)
  # The first slice's gathers are synchronous and run one after the other, also os's two
  # on different axes (the TPU compiler's schedule: docs/costmodel.md section 3 and
  # docs/tpu.md); with S = 1 that is the whole collective algorithm.
  stages = _pipeline(ksplit, compute, ahead, behind,
                     serial_prologue=profile.serial_collectives)
  if ksplit > 1:
    cut = sum(v.shard_bytes for v in mv if v.kind == "all_gather" and v.size > 1)
    y = _out_elements(p, dataflow)
    if dataflow == "os":
      moved = y * (4 + p.out_bytes)
      finish = (moved / profile.hbm_bandwidth if profile.hbm_bandwidth > 0 else 0.0) + \
          profile.op_overhead
      name = "convert accumulator"
    else:
      finish, name = copy_time(profile, y * p.out_bytes), "concatenate output"
    first = [Op(stream="compute", name="cut slices", seconds=copy_time(profile, cut))]
    last = [Op(stream="compute", name=name, seconds=finish)]
    stages = _stages(*[(1, [op for op in ops if op.seconds > 0]) for ops in (first,)]) + \
        stages + _stages(*[(1, [op for op in ops if op.seconds > 0]) for ops in (last,)])
  return stages, f"{ksplit} slices"


@_algorithm("collective", options=("scatter",))
def _collective(p, dataflow, ksplit, profile, scatter="reduce_scatter"):
  """The GSPMD algorithm as XLA emits it with windowed einsum off (and as
  `rewrites.build_body("collective")` does): synchronous all-gather(s), one after the
  other, the matmul, then the reduce-scatter; nothing overlaps (total = the sum of all
  collectives + compute). Equal to meshslice with S = 1."""
  stages, _ = _meshslice(p, dataflow, 1, profile)
  return stages, "no overlap"


@_algorithm("summa")
def _summa(p, dataflow, ksplit, profile):
  """SUMMA: P = ksplit * lcm(R, C) steps, each on a panel of extent / P of the
  communicated dim, which lives whole on one owner device per axis:

      prologue: broadcast panel 0 over each gathered axis
      step q:   matmul(q) || broadcast(q+1) || reduce(q-1) onto its owner (ls / rs)
      epilogue: reduce(P-1)

  As meshslice.rewrites emits it, a broadcast and a reduce are each a masked psum (an
  all-reduce: `all_reduce_time`) of the panel, panel = shard * n / P bytes on an axis of
  n devices: about twice the bytes of the collective algorithm, in small steps.
  """
  panels = ksplit * p.lcm

  def panel_ops(kind, label):
    return [Op(stream=v.link, name=f"{label} {v.matrix} panel",
               seconds=all_reduce_time(profile, v.dim, v.size, v.shard_bytes * v.size / panels))
            for v in movements(p, dataflow) if v.kind == kind and v.size > 1]

  mm = _matmul(p, profile, dataflow, panels, accumulate=dataflow == "os" and panels > 1)
  return (_pipeline(panels, mm,
                    panel_ops("all_gather", "broadcast"), panel_ops("reduce_scatter", "reduce")),
          f"{panels} panels")


@_algorithm("cannon")
def _cannon(p, dataflow, ksplit, profile):
  """Cannon's algorithm on a square q x q mesh (R = C = q): q steps on blocks
  (m/q, n/q, k/q), each block cut into S = ksplit chunks, so q * S stages:

      skew:        permute each moving input block over floor(q/2) hops (the farthest
                   initial shift on a ring with wrap-around)
      stage (t,c): matmul(chunk) || shift the moving input chunks one hop (t < q-1)
                                 || pass the previous stage's partial-sum chunk on one
                                    hop (ls / rs), or home (unskew, floor(q/2) hops)
                                    once it is complete (t = q-1)
      epilogue:    unskew the last partial-sum chunk (ls / rs)

  os moves X (over c) and W (over r); ls moves W (over r) and the partial Y (over c);
  rs moves X (over c) and the partial Y (over r). Every transfer is a send/recv
  (`permute_time`); the bytes are those of the collective plus a skew (and, for ls / rs,
  q output-sized partial sums instead of a reduce-scatter's q-1 shards).
  """
  q, s = p.rows, ksplit
  mv = movements(p, dataflow)
  moving = [v for v in mv if v.kind == "all_gather"]
  partial = [v for v in mv if v.kind == "reduce_scatter"]
  far = q // 2
  skew = [Op(stream=v.link, name=f"skew {v.matrix}",
             seconds=permute_time(profile, v.dim, v.shard_bytes, hops=far)) for v in moving]
  shift = [Op(stream=v.link, name=f"shift {v.matrix} chunk",
              seconds=permute_time(profile, v.dim, v.shard_bytes / s)) for v in moving]
  pass_on = [Op(stream=v.link, name=f"shift {v.matrix} partial",
                seconds=permute_time(profile, v.dim, v.shard_bytes / s)) for v in partial]
  home = [Op(stream=v.link, name=f"unskew {v.matrix} partial",
             seconds=permute_time(profile, v.dim, v.shard_bytes / s, hops=far))
          for v in partial]
  # os adds each chunk's product into the f32 accumulator; ls / rs add into the partial
  # sum that arrived from the neighbour.
  mm = _matmul(p, profile, dataflow, q * s, accumulate=q * s > 1)
  steady = (q - 1) * s          # stages that still shift the moving chunks
  if not partial:
    stages = _stages((1, skew), (steady, [mm] + shift), (s, [mm]))
  else:
    stages = _stages((1, skew), (1, [mm] + shift), (steady - 1, [mm] + shift + pass_on),
                     (1, [mm] + pass_on), (s - 1, [mm] + home), (1, home))
  return stages, f"{q} steps x {s} chunks"


def wang_ring_axis(problem: GemmProblem, ring: str | None = None) -> str:
  """The axis ("row" or "col") wang rings over: `ring`, or by default (as in
  meshslice.rewrites) the larger axis, col on a tie.

  Example:
    >>> wang_ring_axis(GemmProblem(m=8, n=8, k=8, rows=4, cols=2))
    'row'
  """
  return ring or ("row" if problem.rows > problem.cols else "col")


@_algorithm("wang", options=("ring", "bidirectional"))
def _wang(p, dataflow, ksplit, profile, ring=None, bidirectional=False):
  """Wang et al.'s collective matmul: the collective of the `ring` axis ("row", "col";
  None: the larger axis, col on a tie) becomes a ring of one-hop permutes overlapped
  with matmuls; the other axis keeps its plain, exposed collective (before the ring if
  it is an all-gather, after it if it is a reduce-scatter).

  With n devices on the ring axis, each ring block (one device's shard) is cut into
  S = ksplit chunks, so n * S stages:

      all-gather ring:      stage (t,c): matmul(chunk) || send the chunk on (t < n-1)
      reduce-scatter ring:  stage (t,c): matmul(partial chunk) || send the previous
                            stage's accumulated chunk on (all but the first stage and
                            the last S-1)

  bidirectional: each chunk is cut in halves travelling opposite ways at once (the two
  directions of a link are independent), so a stage sends half the bytes and runs two
  half-size matmuls. Every send is `permute_time` of the chunk.
  """
  which = wang_ring_axis(p, ring)
  mv = movements(p, dataflow)
  ring_mv = next(v for v in mv if v.link == which)
  other = next(v for v in mv if v.link != which)
  n, s = ring_mv.size, ksplit
  ways = 2 if bidirectional else 1
  # a ring of the contracted dim (os) or of partial sums (a reduce-scatter ring) adds
  # each chunk's product into a float32 partial sum
  accumulate = n * s * ways > 1 and (dataflow == "os" or ring_mv.kind == "reduce_scatter")
  mm = _matmul(p, profile, dataflow, n * s * ways, count=ways, accumulate=accumulate)
  send = ([Op(stream=which, name=f"pass {ring_mv.matrix} chunk" if ring_mv.kind == "all_gather"
              else f"pass {ring_mv.matrix} partial",
              seconds=permute_time(profile, ring_mv.dim, ring_mv.shard_bytes / (s * ways)))]
          if n > 1 else [])
  sends = (n - 1) * s
  if ring_mv.kind == "all_gather":
    ring_stages = _stages((sends, [mm] + send), (n * s - sends, [mm]))
  else:
    ring_stages = _stages((1, [mm]), (sends, [mm] + send), (n * s - 1 - sends, [mm]))
  plain = _stages((1, _collective_ops(profile, other, 1, f"{other.kind} {other.matrix}")))
  stages = plain + ring_stages if other.kind == "all_gather" else ring_stages + plain
  way = "bidirectional" if bidirectional else "unidirectional"
  chunks = f"{s} chunk{'s' if s > 1 else ''} per block"
  return stages, f"{way} ring over {which} ({ring_mv.matrix}), {chunks}"


def _check_options(algorithm, options):
  allowed = _SCHEDULES[algorithm][1]
  for key, value in options.items():
    if key not in allowed:
      takes = f"takes only {', '.join(allowed)}" if allowed else "takes no options"
      return f"{algorithm} {takes}; got option {key!r}"
    if key == "ring" and value not in (None, "row", "col"):
      return f"wang: ring must be 'row', 'col' or None, got {value!r}"
    if key == "bidirectional" and not isinstance(value, bool):
      return f"wang: bidirectional must be True or False, got {value!r}"
  return ""


def why_invalid(problem: GemmProblem, algorithm: str, dataflow: str, ksplit: int,
                **options) -> str:
  """Why (algorithm, dataflow, ksplit, options) cannot run `problem`; "" when it can.

  The rules are those of the builders in meshslice.rewrites: every sharded dim splits
  evenly; meshslice, summa and cannon need ksplit * lcm(R, C) to divide the
  communicated extent; wang needs ksplit (x2 if bidirectional) to divide the ring
  block extent / n_ring; cannon needs a square mesh; cannon and summa need a 2D site
  (both axes > 1); collective takes ksplit = 1.

  Example:
    >>> p = GemmProblem(m=64, n=64, k=40, rows=2, cols=4)
    >>> why_invalid(p, "meshslice", "os", 4)
    'ksplit=4 needs ksplit * lcm(R, C) = 16 to divide the communicated extent k=40'
    >>> why_invalid(p, "cannon", "os", 1)
    'cannon needs a square mesh (R == C), got R=2, C=4'
    >>> why_invalid(p, "wang", "os", 3, bidirectional=True, ring="col")
    'wang: 2 * ksplit = 6 must divide the ring block k / C = 10'
  """
  if algorithm not in ALGORITHMS:
    return f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
  if dataflow not in DATAFLOWS:
    return f"dataflow must be one of {DATAFLOWS}, got {dataflow!r}"
  if isinstance(ksplit, bool) or not isinstance(ksplit, int) or ksplit < 1:
    return f"ksplit must be a positive int, got {ksplit!r}"
  reason = _check_options(algorithm, options)
  if reason:
    return reason
  if algorithm == "collective" and ksplit != 1:
    return f"collective does not slice; ksplit must be 1, got {ksplit}"
  r, c, lcm = problem.rows, problem.cols, problem.lcm
  # The layouts of docs/design.md: each sharded dim must split evenly.
  need = {"os": (("m", r), ("n", c), ("k", lcm)), "ls": (("m", r), ("k", c), ("n", lcm)),
          "rs": (("n", c), ("k", r), ("m", lcm))}[dataflow]
  for dim, parts in need:
    if getattr(problem, dim) % parts:
      return (f"dataflow {dataflow!r} on a {r}x{c} mesh shards {dim}={getattr(problem, dim)} "
              f"into {parts} parts, which does not divide it")
  if problem.reduction == "all_reduce" and algorithm not in ("collective", "meshslice"):
    return (f"{algorithm} is not modelled for an all-reduce site (reduction='all_reduce'): "
            f"only collective and meshslice are")
  if algorithm in ("cannon", "summa") and min(r, c) == 1:
    return f"{algorithm} needs a 2D site (both mesh axes > 1), got a {r}x{c} mesh"
  if algorithm == "cannon" and r != c:
    return f"cannon needs a square mesh (R == C), got R={r}, C={c}"
  extent = problem.extent(dataflow)
  name = {"os": "k", "ls": "n", "rs": "m"}[dataflow]
  if algorithm in ("meshslice", "summa", "cannon") and extent % (ksplit * lcm):
    return (f"ksplit={ksplit} needs ksplit * lcm(R, C) = {ksplit * lcm} to divide the "
            f"communicated extent {name}={extent}")
  if algorithm == "wang":
    which = wang_ring_axis(problem, options.get("ring"))
    n = r if which == "row" else c
    parts = ksplit * (2 if options.get("bidirectional") else 1)
    if (extent // n) % parts:
      what = f"2 * ksplit = {parts}" if options.get("bidirectional") else f"ksplit={ksplit}"
      return (f"wang: {what} must divide the ring block {name} / {'R' if which == 'row' else 'C'}"
              f" = {extent // n}")
  return ""


def schedule(problem: GemmProblem, algorithm: str, dataflow: str, ksplit: int,
             profile: HardwareProfile | str, **options) -> Schedule:
  """The predicted stage-by-stage schedule of `problem` (see each algorithm's docstring:
  `algorithm_doc(name)`). `profile` is a HardwareProfile or a name / path for
  `load_profile` (so are the other entry points'). `options` are the algorithm's
  keyword options (wang: ring, bidirectional), as for meshslice.rewrites.build_body.

  Example:
    >>> p = GemmProblem(m=8192, n=8192, k=8192, rows=4, cols=4)
    >>> s = schedule(p, "meshslice", "ls", 4, "tpu-v4")
    >>> [([op.name for op in st.ops], st.repeat)
    ...  for st in s.stages]                     # doctest: +NORMALIZE_WHITESPACE
    [(['cut slices'], 1), (['all_gather W slice'], 1),
     (['matmul', 'all_gather W slice'], 1),
     (['matmul', 'all_gather W slice', 'reduce_scatter Y slice'], 2),
     (['matmul', 'reduce_scatter Y slice'], 1), (['reduce_scatter Y slice'], 1),
     (['concatenate output'], 1)]

  Raises:
    ValueError: the combination cannot run the problem (see `why_invalid`).
  """
  reason = why_invalid(problem, algorithm, dataflow, ksplit, **options)
  if reason:
    raise ValueError(reason)
  profile = load_profile(profile)
  stages, note = _SCHEDULES[algorithm][0](problem, dataflow, ksplit, profile, **options)
  return Schedule(problem=problem, algorithm=algorithm, dataflow=dataflow, ksplit=ksplit,
                  stages=tuple(stages), options=tuple(sorted(options.items())), note=note,
                  overlap=profile.overlap)


def algorithm_doc(algorithm: str) -> str:
  """The docstring of the time model of `algorithm` (its formula and assumptions).

  Example:
    >>> algorithm_doc("summa").splitlines()[0]
    'SUMMA: P = ksplit * lcm(R, C) steps, each on a panel of extent / P of the'
  """
  if algorithm not in _SCHEDULES:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  return _SCHEDULES[algorithm][0].__doc__


def algorithm_options(algorithm: str) -> tuple[str, ...]:
  """The keyword options the time model of `algorithm` takes.

  Example:
    >>> algorithm_options("wang"), algorithm_options("summa")
    (('ring', 'bidirectional'), ())
  """
  if algorithm not in _SCHEDULES:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  return _SCHEDULES[algorithm][1]


def predict(problem: GemmProblem, algorithm: str, dataflow: str, ksplit: int,
            profile: HardwareProfile | str, **options) -> Cost:
  """Predicted cost of running `problem` with `algorithm` / `dataflow` / `ksplit`.

  algorithm: "collective" (no overlap; ksplit 1), "meshslice" (ksplit pipelined slices),
  "cannon" (square meshes; ksplit chunks per block), "wang" (one axis as a ring of
  permutes; ksplit chunks per ring block; options ring=, bidirectional=) or "summa"
  (ksplit * lcm(R, C) broadcast steps). The formulas are in the module docstring and
  in `algorithm_doc(algorithm)`.

  Example:
    >>> prof = load_profile("tpu-v4")
    >>> p = GemmProblem(m=16384, n=12288, k=12288, rows=4, cols=4)
    >>> base = predict(p, "collective", "os", 1, prof)
    >>> sliced = predict(p, "meshslice", "os", 4, prof)
    >>> sliced.total_s < base.total_s == base.compute_s + base.comm_s
    True
    >>> predict(p, "wang", "os", 2, prof, ring="row", bidirectional=True).total_s > 0
    True
  """
  return schedule(problem, algorithm, dataflow, ksplit, profile, **options).cost()


def _bound_bandwidth(profile: HardwareProfile, v: Movement, algorithms) -> float:
  """The best bandwidth any of `algorithms` reaches for movement `v` (see lower_bound)."""
  own = profile.collective(v.kind).bandwidth[v.dim]
  candidates = []
  if {"collective", "meshslice"} & set(algorithms):
    candidates.append(own)
  if "summa" in algorithms:        # masked psums: a reduce-scatter and an all-gather
    candidates.append(max(profile.all_gather.bandwidth[v.dim],
                          profile.reduce_scatter.bandwidth[v.dim]))
  if "cannon" in algorithms:       # one-hop sends, one direction
    candidates.append(profile.permute.bandwidth[v.dim])
  if "wang" in algorithms:         # either axis: its collective, or a ring of sends that
    candidates += [own, 2 * profile.permute.bandwidth[v.dim]]   # may use both directions
  return max(candidates)


def lower_bound(problem: GemmProblem, profile: HardwareProfile | str,
                dataflow: str | None = None, algorithms=ALGORITHMS) -> Cost:
  """Perfect-overlap bound: max(compute, communication), for `dataflow` or (None) the
  best of the three, valid for every schedule of `algorithms` (default: all modelled).

  compute: the unsliced local matmul (`gemm_time`: roofline and one op overhead); every
  schedule runs at least that work, those bytes and one op. communication: per link,
  the bytes the dataflow must receive there, (n - 1) * shard, at the best bandwidth any
  of `algorithms` reaches on that link, with no latency or overhead:

      collective, meshslice   the movement's own collective (all-gather or reduce-scatter)
      summa                   the better of all-gather and reduce-scatter (its psums)
      cannon                  send/recv (one direction)
      wang                    the movement's collective, or 2 x send/recv (a
                              bidirectional ring on that axis)

  The two links overlap, so the slower one counts. So the bound for the algorithms the
  pass emits (collective, meshslice) uses collective bandwidths only, and a bound over
  all algorithms credits the bidirectional send/recv ring only because wang can use it.

  Example:
    >>> prof = load_profile("tpu-v4")
    >>> p = GemmProblem(m=16384, n=12288, k=12288, rows=4, cols=4)
    >>> bound = lower_bound(p, prof, "os")
    >>> bound.total_s == max(bound.compute_s, bound.comm_s)
    True
    >>> bound.total_s <= predict(p, "meshslice", "os", 8, prof).total_s
    True
    >>> emitted = lower_bound(p, prof, "os", algorithms=("collective", "meshslice"))
    >>> emitted.comm_s >= bound.comm_s
    True
  """
  profile = load_profile(profile)
  algorithms = tuple(algorithms)
  for a in algorithms:
    if a not in ALGORITHMS:
      raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {a!r}")
  if not algorithms:
    raise ValueError(f"algorithms must not be empty; choose from {ALGORITHMS}")
  if dataflow is None:
    bounds = [lower_bound(problem, profile, d, algorithms) for d in DATAFLOWS]
    return min(bounds, key=lambda c: c.total_s)
  compute = gemm_time(profile, *problem.local_shape(_dataflow(dataflow)), batch=problem.batch,
                      in_bytes=problem.in_bytes, out_bytes=problem.out_bytes)
  links = {"row": 0.0, "col": 0.0}
  for v in movements(problem, dataflow):
    if v.kind == "all_reduce":   # its two halves, each at its own collective's bandwidth
      links[v.link] += sum((v.size - 1) * v.shard_bytes / profile.collective(kind).bandwidth[v.dim]
                           for kind in ("reduce_scatter", "all_gather"))
      continue
    links[v.link] += (v.size - 1) * v.shard_bytes / _bound_bandwidth(profile, v, algorithms)
  comm = max(links.values())
  total = max(compute, comm)
  return Cost(compute_s=compute, comm_s=comm, exposed_comm_s=total - compute, total_s=total)
