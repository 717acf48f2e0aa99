"""Read what the TPU compiler made of a program: its scheduled HLO as records.

`compiled.as_text()` of a program compiled for TPU (ahead of time on a CPU machine, see
`meshslice.aot`, or on a TPU) is *scheduled* HLO: the instructions of each computation
appear in the order they run, and most carry the compiler's own cost estimate in their
backend config (`"estimated_cycles":"151690"`, chip cycles). This module turns that text
into data:

  read_schedule(text)  -> CompiledSchedule: a CompiledOp per instruction of the entry
                          computation, in order, with `while` loops as Loop entries
                          (body + trip count); `.expanded()` repeats each body
                          trip-count times
  summarize(schedule)  -> Summary: compute cycles (dot / relayout copy / other),
                          collectives by kind (count, bytes), sync vs async, loops,
                          windowed-einsum loops

Why a module of its own: reading is what the rest stands on. `tpu_simulate` walks these
records to predict a step, `libtpu_log` sets libtpu's scheduler totals beside their
loops, and `tpu_schedule` (the import path the docs and benches use) re-exports all
three. This module imports none of them, so the imports run one way.

What an instruction is (`CompiledOp.kind`):

  dot          a convolution / dot, or a fusion whose computation contains one
  copy         a relayout: a `copy` (or a fusion that is only a copy / transpose) whose
               result layout differs from its operand's (`{1,0:T(8,128)}` ->
               `{0,1:T(8,128)}`); a copy that only changes memory space is "other"
  collective   a synchronous all-gather / reduce-scatter / all-reduce / all-to-all /
               collective-permute: the chip waits for it
  start, done  the two halves of an asynchronous collective: XLA's `all-gather-start` /
               `-done` (and the other kinds), `async-start` / `async-done` around a
               collective, and libtpu's async collective fusions (`fusion` instructions
               named `async-collective-start` / `-done` whose computations end in the
               `AsyncCollectiveStart` / `AsyncCollectiveDone` custom calls), and
               collectives offloaded to the SparseCore (v5p, v6e under
               `--xla_tpu_enable_sparse_core_collective_offload_*`; tpu7x by default,
               which kinds and sizes: docs/tpu.md): `call-start` / `call-done` to a
               computation on the "sparsecore" execution thread whose root is the
               collective (newer libtpus issue it with a `call-update` after an
               operand-less `call-start`; the update is the start). What is
               scheduled between a start and its done runs while the collective moves.
  dma          async memory moves with no compute estimate (copy-start/-done,
               slice-start/-done): not modelled
  loop         a `while` (CompiledSchedule entries of type Loop)
  other        everything else: elementwise fusions, slices, reductions (their
               estimated cycles count as compute), and free ops (parameter, bitcast,
               get-tuple-element, tuple, constant)

Parsing. The text is read by `costmodel.hlo_text` (the one HLO text parser, shared with
`meshslice.hlo`): types and bytes, replica groups, bytes moved, trip counts.

Trip counts. A `while` runs its body `known_trip_count` times when the compiler states it
in the backend config; otherwise the loop's induction variable is followed
(`hlo_text.trip_count`: the counter starts at a constant of the initial tuple, the body
adds or subtracts a constant, the condition compares it with a constant: `i < 4` from 0
by 1 is 4 trips, `i <= 9` by 3 is 4, `i >= 0` from 5 by -1 is 6). A loop whose trip
count cannot be read counts once (`Loop.trip_count_known` is False).

Windowed einsum. XLA's collective matmul ("windowed einsum") compiles a sharded matmul
into a `while` whose body passes chunks around a ring with collective-permutes and
multiplies each chunk; a Loop whose body holds both collective-permutes and dots is
flagged `windowed_einsum`.

Compute inside async collective fusions. With libtpu's async collective fusion
(`--xla_tpu_enable_async_collective_fusion=true`), the compute that overlaps a collective
is fused with the collective's continuation (`async_collective_fusion.N`, a kOutput
fusion whose computation repeats the collective and whose operands are the start's
outputs). Such a fusion is compute (`CompiledOp.continuation`; kind "dot" when it holds a
dot, else "other", e.g. an attention softmax), never another collective: the collective is
timed by its start / done pair. The compiler estimates such fusions itself; the start and
done fusions carry no estimate (they issue and wait; measured: docs/tpu.md). Any
dot-bearing fusion without an estimate gets one from its FLOPs at the chip's peak
(`CompiledOp.cycles_source == "flops"`), so nothing is silently free; compiling the same
program a second time without the async flags gives the compiler's own estimate for the
same work (`meshslice.aot` does both).

Bytes. `CompiledOp.bytes` is the size of the result (for an async start: of the
collective's output). `CompiledOp.moved_bytes` is what one device sends for a collective,
assuming rings over a group of n devices (`hlo_text.moved_bytes`, as `meshslice.hlo`
counts them): all-gather and all-to-all result * (n-1)/n, reduce-scatter result * (n-1),
all-reduce 2 * result * (n-1)/n, collective-permute result.

Links per collective. A mesh axis may span several torus dims, and `profile_for_mesh`
sums their links; libtpu need not use them all. Each collective's backend config names
the algorithm it chose (`CompiledOp.emitter`: "1DAllGatherNonMajorDim",
"2DAllGatherOnMajorDim", "StrategyRing{colors:1 ...}", "UniDirectionNDRingStrategy{...
cores:{4 4}}", ...), read as the torus dims it drives (`CompiledOp.ring_dims`); given
`axis_dims` (the torus dims each profile dim's bandwidth sums:
`tpu_simulate.axis_torus_dims(profile, mesh_shape)`), `tpu_simulate.simulate` gives the
collective that share of the axis's bandwidth: pricing each collective on all the axis's
links would time it faster than the algorithm libtpu chose runs. What libtpu chose on
measured meshes: docs/tpu.md, "Our simulator against libtpu's".
Async collective fusions name no algorithm: they take the one libtpu chose for a
collective of the same kind over the same group shape elsewhere in the program
(`CompiledOp.ring_dims_source == "same-axis"`), else (none) keep the whole axis.

Example (a hand-written schedule; see tests/test_tpu_aot.py for compiled ones):
  >>> text = '''
  ... HloModule m, is_scheduled=true, num_partitions=4
  ... ENTRY %main (p: bf16[1024,1024]) -> bf16[1024,1024] {
  ...   %p = bf16[1024,1024]{1,0} parameter(0)
  ...   %ag = bf16[4096,1024]{1,0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  ...   ROOT %f = bf16[1024,1024]{1,0} fusion(%ag), kind=kOutput, calls=%c,'''
  >>> text += ''' backend_config={"estimated_cycles":"1050000"}
  ... }'''
  >>> s = read_schedule(text)
  >>> [(op.name, op.kind, op.cycles) for op in s.expanded()]
  [('p', 'other', 0), ('ag', 'collective', 0), ('f', 'other', 1050000)]
  >>> summarize(s).compute_cycles, summarize(s).collective_count
  (1050000, {'all-gather': 1})
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterator, Union

from . import hlo_text
from .hlo_text import COLLECTIVES, Computation, Instr, arrays, nbytes

KINDS = ("dot", "copy", "collective", "start", "done", "dma", "loop", "other")

# The chip table sits with the reader, not with tpu_simulate (which reads the clock): the
# reader's FLOP-derived cycles need FLOPS_PER_CYCLE, and the reader imports nothing above it.
#
# Clock of each TPU generation's TensorCore (Hz): estimated_cycles / clock = seconds.
# v4: 1.05 GHz, v5e: 1.5 GHz, v5p: 1.75 GHz, v6e: 1.75 GHz: public bf16 peaks (2.75e14,
# 1.97e14, 4.59e14, 9.18e14 FLOP/s) divided by the MXU FLOPs per cycle (v4 2 cores x 4 x
# 128x128 MXUs, v5e 4 x 128x128, v5p 2 cores x 4 x 128x128, v6e 4 x 256x256; 2 FLOPs per
# MAC); docs/tpu.md compares them with the compiler's own estimates.
# tpu7x (Ironwood, profile "tpu-v7x"): 2.2 GHz *derived*, not published. A device is one
# TensorCore (two per chip), so its peak is 2,307 / 2 = 1,153.5 TFLOP/s bf16; with four
# 256x256 MXUs per TensorCore (v6e's layout, assumed: 524,288 FLOP/cycle) that is 2.2e9
# cycles/s. The compiler agrees with the assumption: libtpu 0.0.42.1 estimates a dense
# 8192^3 bf16 dot on one TPU7x device at 2,604,600 cycles, 422k FLOP/cycle = 80.5 % of
# 524,288 (v6e: 70 %, v5p: 90 %); half as many MXUs would put it above peak.
CLOCK_HZ = {"tpu-v4": 1.05e9, "tpu-v5e": 1.5e9, "tpu-v5p": 1.75e9, "tpu-v6e": 1.75e9,
            "tpu-v7x": 2.2e9}
# Dense bf16 MXU FLOPs per cycle per device (the peak the FLOP-based fallback divides by).
FLOPS_PER_CYCLE = {"tpu-v4": 262144, "tpu-v5e": 131072, "tpu-v5p": 262144,
                   "tpu-v6e": 524288, "tpu-v7x": 524288}

_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"?(\d+)')
_FREE = frozenset(("parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                   "after-all", "partition-id", "replica-id", "opt-barrier",
                   "optimization-barrier", "add-dependency"))
_DMA = frozenset(("copy-start", "copy-done", "slice-start", "slice-done", "send", "recv",
                  "send-done", "recv-done"))


# ----------------------------------------------------------------------------- parsing
# The text itself is read by costmodel.hlo_text; what follows is what a schedule needs.

def _parsed(text: str) -> hlo_text.Module:
  module = hlo_text.parse(text)
  if module.entry is None and module.computations:
    raise ValueError("the HLO text has no ENTRY computation; pass the whole module "
                     "(compiled.as_text()), not a fragment")
  return module


def parse_module(text: str) -> tuple[dict, str | None, dict]:
  """({computation name: hlo_text.Computation}, entry name, module attributes) of HLO
  text; a ValueError for text without an ENTRY computation.

  Module attributes: `num_partitions`, `replica_count` (ints) and `is_scheduled` (bool)
  from the HloModule line.
  """
  module = _parsed(text)
  return module.computations, module.entry, {
      "num_partitions": module.num_partitions, "replica_count": module.replica_count,
      "is_scheduled": module.is_scheduled}


def _layout_key(type_text: str) -> tuple:
  """The layouts of a type, memory space (S(n)) removed: what a relayout changes."""
  return tuple(re.sub(r"S\(\d+\)", "", layout) for _, _, layout in arrays(type_text))


def _permute_link(pairs) -> int:
  """Profile dim of a collective-permute from its whole source/target set: 1 (the minor
  mesh axis) when every group of partitions the pairs connect is a run of consecutive
  ids (a shift along the minor axis, either direction: {0,1},{1,2},... or
  {0,3},{1,0},{2,1},{3,2}), else 0 (partitions a row apart: the major axis)."""
  parent = {}
  def find(a):
    while parent.setdefault(a, a) != a:
      parent[a] = parent[parent[a]]
      a = parent[a]
    return a
  for a, b in pairs:
    if a != b:
      parent[find(a)] = find(b)
  groups = {}
  for a in parent:
    groups.setdefault(find(a), []).append(a)
  if not groups:
    return 0
  consecutive = all(max(g) - min(g) == len(g) - 1 for g in groups.values())
  return 1 if consecutive else 0


_ALGO = re.compile(r'"collective_algorithm_config"\s*:\s*\{(.{0,4000})')


def _strategy(attrs: str) -> tuple[str, int]:
  """(emitter name, torus dims it drives) of a collective from libtpu's backend config.

  Read from `"collective_algorithm_config":{"emitter":..., "strategy":..., "debug":...}`
  (measured on libtpu 0.0.42, v4:4x4x4 and v4:2x2x2):

    "1DAllGatherNonMajorDim[Imbalanced]"            1 (one bidirectional ring)
    "2DAllGatherOnMajorDim"                         2
    StrategyRing{colors:1 ... cores:{16}}           1 (a single ring, however many
                                                      torus dims its chips span)
    UniDirection1DRingStrategy{colors:2 cores:{4},{4}}   1 (two one-way rings = one
                                                      bidirectional ring on one dim)
    UniDirectionNDRingStrategy{colors:4 cores:{4 4},...} 2 (a ring per direction on each
                                                      of the dims listed in one core set)
    StrategyND{colors:3 cores:{8 8 4},...}          3 (likewise; a 256-chip all-reduce)
    "SinglePhaseRingSumEmitter"                     1 (one ring; small all-reduces)
    anything else (AllToAllEmitter, no config)      0 (unknown)

  On TPU7x (two devices per chip) libtpu counts a chip's core pair as a dim of its own:
  over a mesh axis of 2 chips x 2 cores (tpu7x:2x2x1 as 2x4, offload off) it chose
  "2DAllGatherOnMajorDim" and "SingleInputAllReduceScatterFusion/StrategySubgroupND
  {colors:2 phases:2 cores:{2 2}}" (2 dims), over 2 chips "1DAllGatherNonMajorDim".
  Such a collective is priced on its axis's whole bandwidth (`collective_seconds`: a
  share only when it drives fewer dims than the axis spans).
  """
  config = _ALGO.search(attrs)
  if not config:
    return _offload_strategy(attrs)
  body = config.group(1)
  emitter = re.search(r'"emitter"\s*:\s*"([^"]*)"', body)
  strategy = re.search(r'"strategy"\s*:\s*"([^"]*)"', body)
  name = (emitter.group(1) if emitter else "") + (
      "/" + strategy.group(1) if strategy else "")
  debug = re.search(r'"debug"\s*:\s*"([^"]*)"', body)
  debug = debug.group(1) if debug else ""
  kind = strategy.group(1) if strategy else ""
  lead = re.match(r"(\d)D", emitter.group(1)) if emitter else None
  cores = re.search(r"cores:\{([0-9 ]+)\}", debug) if kind else None
  if kind == "StrategyRing" or "1DRing" in kind:
    return name, 1
  if cores:                          # one core set: the sizes of the dims it spans
    return name, len(cores.group(1).split())
  if lead:
    return name, int(lead.group(1))
  if emitter and not kind and "Ring" in emitter.group(1):
    return name, 1                   # e.g. SinglePhaseRingSumEmitter
  return name, 0


_OFFLOAD = re.compile(r'"ici_strategy_config"\s*:\s*\{"color_strategies"\s*:\s*\[(.{0,4000})')


def _offload_strategy(attrs: str) -> tuple[str, int]:
  """(name, torus dims driven) of a SparseCore-offloaded collective, from its
  `"collective_offload_config":{..."ici_strategy_config":{"color_strategies":[{
  "phase_rings":[{"ring_type":"ICI_RING_TYPE_UNIDIR_CW","core_count":"4",...}]},...]}`
  (measured on libtpu 0.0.42.1 and 0.0.50.1, v5p): one color per ring direction, one
  phase ring per torus dim it crosses. A ring names its size (`"core_count"`, explicit
  rings) or its torus dim (`"ring_dim":"ICI_RING_DIM_X_MESH"`, implicit rings). Two
  one-phase colors (CW and CCW) are one bidirectional ring: 1 dim, named
  "SparseCoreOffload{colors:2 phases:1 cores:4}" (or "... dims:X_MESH"). On TPU7x a
  ring over a mesh axis that holds both TensorCores of each chip is marked so
  ("... cores:2 +core pair": libtpu 0.0.42.1 writes `"across_cores_on_chip":true` or
  `"partner_transfers_outside_the_ring":true` on its rings; its `core_count` counts
  chips). ("", 0) without such a config."""
  config = _OFFLOAD.search(attrs)
  if not config:
    return "", 0
  colors = re.findall(r'\{"phase_rings"\s*:\s*\[(.*?)\]\}', config.group(1))
  rings = [re.findall(r'\{"ring_type"[^{}]*\}', c) for c in colors]
  rings = [r for r in rings if r]
  if not rings:
    return "", 0
  dims = max(len(r) for r in rings)
  cores = [re.search(r'"core_count"\s*:\s*"(\d+)"', ring) for ring in rings[0]]
  if all(cores):
    where = "cores:" + " ".join(c.group(1) for c in cores)
  else:
    named = [re.search(r'"ring_dim"\s*:\s*"ICI_RING_DIM_([A-Z_]+)"', ring) for ring in rings[0]]
    where = "dims:" + " ".join(m.group(1) if m else "?" for m in named)
  # TPU7x (two devices per chip): a ring that runs through both TensorCores of each chip
  # says "across_cores_on_chip" (implicit rings) or has each chip's other core take
  # its data off the ring ("partner_transfers_outside_the_ring", explicit rings)
  on_chip = re.search(r'"(across_cores_on_chip|partner_transfers_outside_the_ring)"'
                      r'\s*:\s*true', config.group(1))
  where += " +core pair" if on_chip else ""
  return f"SparseCoreOffload{{colors:{len(rings)} phases:{dims} {where}}}", dims


def _strategy_cores(attrs: str) -> tuple[int, ...]:
  """The ring sizes, one per torus dim, of an N-D strategy's first core set
  (`StrategyND{colors:3 phases:3 cores:{8 8 4},...}` -> (8, 8, 4)); () for a 1D emitter,
  a single ring, or no config. An N-D all-reduce runs one phase per dim, so its hop
  latency is that of rings of these sizes, not of one ring over the whole group."""
  config = _ALGO.search(attrs)
  if not config or '"strategy"' not in config.group(1):
    return ()
  cores = re.search(r"cores:\{([0-9 ]+)\}", config.group(1))
  sizes = tuple(int(v) for v in cores.group(1).split()) if cores else ()
  return sizes if len(sizes) > 1 else ()


# ----------------------------------------------------------------------------- data

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompiledOp:
  """One scheduled instruction of a compiled program (`Op`, its old name, still works;
  `costmodel.timing.Op` is a modelled one).

  Attributes:
    name, opcode: as in the HLO text.
    kind: one of KINDS (see the module docstring).
    cycles: the compiler's estimated cycles (0 where it gives none), or FLOP-derived for
      a dot fusion without an estimate (`cycles_source` says which: "compiler", "flops"
      or "" for none).
    bytes: bytes of the result (for an async start: of the collective's output).
    collective: for collectives, starts and dones: the collective kind (COLLECTIVES);
      else "".
    group: the first replica group (partition ids) of a collective; size n = len(group).
    moved_bytes: bytes one device sends in the collective (module docstring), 0 else.
    link: profile dim (0 or 1) the collective travels over: 1 when its group is
      consecutive partitions (the minor mesh axis), else 0; for a collective-permute,
      1 when every set of partitions its pairs connect is consecutive (`_permute_link`).
    partner: for a start, the name of its done; for a done, the name of its start.
    between: for a start, the names of the ops scheduled between it and its done.
    between_cycles: for a start, the compute cycles scheduled between it and its done.
    relayout: for copies: operand and result layouts differ (not just memory space).
    flops: FLOPs of the dots inside (2 per multiply-add), 0 for non-dots.
    emitter: for collectives, the algorithm libtpu chose (its backend config's
      `collective_algorithm_config`: the emitter, and the strategy where it names one),
      e.g. "1DAllGatherNonMajorDim", "RotatedPincerEmitter/UniDirection1DRingStrategy";
      "" when the config names none.
    continuation: a fusion holding the continuation of an async collective in flight
      (with the async collective fusion flags): its cycles are compute (kind "dot" when
      it has a dot, else "other"); the collective is timed by its start / done.
    ring_dims: how many torus dims that algorithm drives at once (`_strategy`): 1 for
      the 1D emitters and single rings, 2 for "2D..." emitters and N-D rings over two
      dims; 0 when unknown (the collective is then priced on all the dims of its axis).
    ring_dims_source: "config" (its own backend config), "same-axis" (it names none, as
      async collective fusions do: taken from a collective of the same kind over the same
      group shape in the program that names one), or "" (unknown).
    ring_cores: for an N-D strategy, its ring size per torus dim (`_strategy_cores`,
      e.g. (8, 8, 4) for a 256-chip all-reduce); () otherwise.
    groups: every replica group of a collective (`hlo_text.replica_groups`; `group` is
      the first); () for collective-permutes and where unread.
    pairs: a collective-permute's (source, target) pairs; () otherwise.
  """

  name: str
  opcode: str
  kind: str
  cycles: int = 0
  cycles_source: str = ""
  bytes: int = 0
  collective: str = ""
  group: tuple[int, ...] = ()
  moved_bytes: float = 0.0
  link: int = 0
  partner: str = ""
  between: tuple[str, ...] = ()
  between_cycles: int = 0
  relayout: bool = False
  flops: float = 0.0
  emitter: str = ""
  ring_dims: int = 0
  ring_dims_source: str = ""
  ring_cores: tuple[int, ...] = ()
  continuation: bool = False
  groups: tuple[tuple[int, ...], ...] = ()
  pairs: tuple[tuple[int, ...], ...] = ()

  @property
  def group_size(self) -> int:
    return len(self.group)

  @property
  def is_async(self) -> bool:
    return self.kind in ("start", "done")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Loop:
  """A `while` of the schedule: its body runs `trip_count` times.

  `windowed_einsum`: the body (including nested calls) has collective-permutes and dots
  (XLA's collective matmul).
  """

  name: str
  trip_count: int
  trip_count_known: bool
  body: tuple["Entry", ...]
  condition: str = ""
  body_computation: str = ""
  windowed_einsum: bool = False
  kind: str = "loop"


Entry = Union[CompiledOp, Loop]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompiledSchedule:
  """The entry computation's scheduled instructions (loops nested as Loop entries).
  `Schedule`, its old name, still works; `costmodel.timing.Schedule` is a modelled one.

  Attributes:
    entries: CompiledOp / Loop records in schedule order.
    num_partitions: devices the program is partitioned over (from the HloModule line).
    scheduled: the module says `is_scheduled=true` (text order is the run order).
  """

  entries: tuple[Entry, ...]
  num_partitions: int = 1
  scheduled: bool = True

  def expanded(self) -> Iterator[CompiledOp]:
    """Every CompiledOp in run order, each loop body repeated trip_count times."""
    yield from _expand(self.entries)

  def loops(self) -> list[Loop]:
    """All Loop entries, outer before inner."""
    out = []
    def visit(entries):
      for e in entries:
        if isinstance(e, Loop):
          out.append(e)
          visit(e.body)
    visit(self.entries)
    return out


# The old names (timing.Schedule / timing.Op are the cost model's own: two of each in one
# package was confusing).
Op = CompiledOp
Schedule = CompiledSchedule


def _expand(entries) -> Iterator[CompiledOp]:
  for e in entries:
    if isinstance(e, Loop):
      for _ in range(e.trip_count):
        yield from _expand(e.body)
    else:
      yield e


def _weighted(entries, times: int = 1) -> Iterator[tuple[CompiledOp, int]]:
  """(op, how often it runs) without repeating bodies: for totals on big loops."""
  for e in entries:
    if isinstance(e, Loop):
      yield from _weighted(e.body, times * e.trip_count)
    else:
      yield e, times


# ----------------------------------------------------------------------------- reading

class _Reader:
  """Builds CompiledOp / Loop records from parsed computations."""

  def __init__(self, module: hlo_text.Module, chip: str):
    self.module = module
    self.comps = module.computations
    self.devices = module.devices
    self.flops_per_cycle = FLOPS_PER_CYCLE.get(chip, FLOPS_PER_CYCLE["tpu-v4"])
    self._contents = {}

  # What a computation contains, recursively (through calls=, to_apply=, ...).
  def contents(self, comp_name: str) -> dict:
    if comp_name in self._contents:
      return self._contents[comp_name]
    self._contents[comp_name] = {}     # cycle guard
    out = {"opcodes": set(), "targets": set(), "flops": 0.0, "collectives": []}
    comp = self.comps.get(comp_name)
    if comp is not None:
      for instr in comp.instrs.values():
        out["opcodes"].add(instr.opcode)
        target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
        if target:
          out["targets"].add(target.group(1))
        if instr.opcode in ("convolution", "dot"):
          out["flops"] += self.dot_flops(comp, instr)
        if hlo_text.collective_kind(instr.opcode):
          out["collectives"].append(instr)
        for names in instr.called().values():
          for name in names:
            inner = self.contents(name)
            out["opcodes"] |= inner.get("opcodes", set())
            out["targets"] |= inner.get("targets", set())
            out["flops"] += inner.get("flops", 0.0)
            out["collectives"] += inner.get("collectives", [])
    self._contents[comp_name] = out
    return out

  def dot_flops(self, comp: Computation, instr: Instr) -> float:
    """2 * output elements * contracted size of a dot / convolution."""
    out = arrays(instr.type_text)
    if not out or not instr.operands:
      return 0.0
    lhs = comp.instrs.get(instr.operands[0])
    lhs_arrays = arrays(lhs.type_text) if lhs is not None else []
    if not lhs_arrays:
      return 0.0
    lhs_dims = lhs_arrays[0][1]
    if instr.opcode == "dot":
      contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
      k = math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d) \
          if contracting else 1
    else:   # convolution used as a matmul: dim_labels=bf_io->bf, contracted dim "f"
      labels = re.search(r"dim_labels=([0-9a-z]+)_", instr.attrs)
      k = lhs_dims[labels.group(1).index("f")] if labels and "f" in labels.group(1) \
          and labels.group(1).index("f") < len(lhs_dims) else 1
      window = re.search(r"window=\{size=([0-9x]+)", instr.attrs)
      if window:
        k *= math.prod(int(v) for v in window.group(1).split("x"))
    return 2.0 * math.prod(out[0][1]) * k

  def collective_op(self, instr: Instr, kind_name: str, collective: str, *,
                    result_type: str, partner: str = "") -> CompiledOp:
    group = hlo_text.replica_group(instr.attrs, self.devices)
    size = nbytes(result_type)
    groups, pairs = (), ()
    if collective == "collective-permute":
      group = group if group else (0, 1)      # (source, target) of its first pair
      pairs = hlo_text.source_target_pairs(instr.attrs) or (tuple(group[:2]),)
      link = _permute_link(pairs)
    else:
      ids = sorted(group)         # a mesh group with device_ids may list them permuted
      link = 1 if len(ids) > 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])) else 0
      groups = hlo_text.replica_groups(instr.attrs, self.devices)
    moved = hlo_text.moved_bytes(collective, size, len(group))
    emitter, ring_dims = _strategy(instr.attrs)
    return CompiledOp(name=instr.name, opcode=instr.opcode, kind=kind_name, bytes=size,
                      collective=collective, group=tuple(group), moved_bytes=moved,
                      link=link, partner=partner, emitter=emitter, ring_dims=ring_dims,
                      ring_cores=_strategy_cores(instr.attrs), groups=groups,
                      pairs=tuple(pairs))

  def op(self, comp: Computation, instr: Instr) -> CompiledOp:
    opcode = instr.opcode
    cycles = _CYCLES.search(instr.attrs)
    cycles = int(cycles.group(1)) if cycles else 0
    base: dict[str, Any] = dict(name=instr.name, opcode=opcode, cycles=cycles,
                                cycles_source="compiler" if cycles else "",
                                bytes=nbytes(instr.type_text))
    if opcode in COLLECTIVES:
      return self.collective_op(instr, "collective", opcode, result_type=instr.type_text)
    stem = opcode.removesuffix("-start").removesuffix("-done")
    if stem in COLLECTIVES and opcode != stem:
      result = hlo_text.collective_output_type(opcode, instr.type_text)
      return self.collective_op(instr, "start" if opcode.endswith("-start") else "done",
                                stem, result_type=result)
    if opcode in ("async-start", "async-done", "async-update"):
      called = instr.called().get("calls", [])
      inner = self.contents(called[0])["collectives"] if called else []
      if inner and opcode != "async-update":
        c = inner[0]
        return _renamed(self.collective_op(c, "start" if opcode == "async-start" else "done",
                                  c.opcode, result_type=c.type_text), instr)
      return CompiledOp(kind="other", **base)
    if opcode in ("call-start", "call-update", "call-done"):
      offloaded = self._offloaded_collective(comp, instr)
      if offloaded is not None:
        return offloaded
    if opcode in _DMA:
      return CompiledOp(kind="dma", **base)
    if opcode in _FREE:
      return CompiledOp(kind="other", **base)
    if opcode == "copy":
      operand = comp.instrs.get(instr.operands[0]) if instr.operands else None
      relayout = operand is not None and _layout_key(operand.type_text) != _layout_key(
          instr.type_text)
      return CompiledOp(kind="copy" if relayout else "other", relayout=relayout, **base)
    if opcode in ("convolution", "dot"):
      return self._dot(CompiledOp(kind="dot", flops=self.dot_flops(comp, instr), **base))
    if opcode == "fusion":
      called = instr.called().get("calls", [])
      inner = self.contents(called[0]) if called else {"opcodes": set(), "targets": set(),
                                                       "flops": 0.0, "collectives": []}
      if "AsyncCollectiveStart" in inner["targets"] or "AsyncCollectiveDone" in inner["targets"]:
        start = "AsyncCollectiveStart" in inner["targets"]
        if inner["collectives"]:
          c = inner["collectives"][0]
          return _renamed(self.collective_op(c, "start" if start else "done", c.opcode,
                                    result_type=c.type_text), instr)
      if inner["collectives"] and self._is_continuation(comp, instr):
        # compute fused with the continuation of a collective in flight: the collective is
        # timed by its start / done pair, this fusion's cycles are compute
        op = CompiledOp(kind="dot" if inner["opcodes"] & {"convolution", "dot"} else "other",
                        flops=inner["flops"], continuation=True, **base)
        return self._dot(op)
      if inner["collectives"] and not inner["opcodes"] & {"convolution", "dot"}:
        return self._collective_fusion(instr, inner["collectives"][0])
      if inner["opcodes"] & {"convolution", "dot"}:
        return self._dot(CompiledOp(kind="dot", flops=inner["flops"], **base))
      if called and self._is_relayout_fusion(comp, instr, called[0]):
        return CompiledOp(kind="copy", relayout=True, **base)
    return CompiledOp(kind="other", **base)

  def _offloaded_collective(self, comp: Computation, instr: Instr) -> CompiledOp | None:
    """A collective libtpu runs on another execution thread (SparseCore offload,
    `--xla_tpu_enable_sparse_core_collective_offload_*`), `to_apply=` a computation whose
    root is the collective. libtpu 0.0.42.1 writes `call-start(input, token)` then
    `call-done(start)`; 0.0.50.1 writes `call-start()` (no operands), then
    `call-update(start, input)`, which hands over the data, then `call-done(update)`.
    The instruction that hands over the data (a call-start with operands, or the update)
    is the collective's start, the done its done; a call-start without operands issues
    nothing. None when the called computation holds no collective (the call is read as
    any other op)."""
    start = instr
    while start is not None and start.opcode != "call-start" and start.operands:
      start = comp.instrs.get(start.operands[0])
    if start is None or start.opcode != "call-start":
      return None
    called = start.called().get("to_apply", []) + start.called().get("calls", [])
    inner = self.contents(called[0])["collectives"] if called else []
    if not inner:
      return None
    if instr.opcode == "call-start" and not instr.operands:
      return CompiledOp(name=instr.name, opcode=instr.opcode, kind="other",
                        bytes=nbytes(instr.type_text))
    c = inner[0]
    kind = "done" if instr.opcode == "call-done" else "start"
    return _renamed(self.collective_op(c, kind, c.opcode, result_type=c.type_text), instr)

  def _is_continuation(self, comp: Computation, instr: Instr) -> bool:
    """A fusion that continues an async collective fusion (libtpu's
    `async_collective_fusion.N`): its computation is named so, or one of its operands
    (through get-tuple-elements and bitcasts) is an `AsyncCollectiveStart` fusion whose
    collective is the same kind as the one this fusion holds. (A synchronous collective
    fusion fed by a continuation's result, such as the dense reduce-scatter, is not.)"""
    called = instr.called().get("calls", [])
    if called and called[0].startswith("async_collective_fusion"):
      return True
    mine = {c.opcode for c in self.contents(called[0])["collectives"]} if called else set()
    for name in instr.operands:
      source = comp.instrs.get(name)
      while source is not None and source.opcode in ("get-tuple-element", "bitcast") \
          and source.operands:
        source = comp.instrs.get(source.operands[0])
      if source is None or source.opcode != "fusion":
        continue
      inner = source.called().get("calls", [])
      content = self.contents(inner[0]) if inner else None
      if content and "AsyncCollectiveStart" in content["targets"] and \
          mine & {c.opcode for c in content["collectives"]}:
        return True
    return False

  def _collective_fusion(self, instr: Instr, inner: Instr) -> CompiledOp:
    """A synchronous collective the TPU compiler wrapped in a fusion. The dense program's
    reduce-scatters look like this: a kCustom fusion calling `%all-reduce-scatter`, an
    all-reduce whose result is dynamic-sliced to this device's piece (run as one
    reduce-scatter). Counted as that reduce-scatter, of the fusion's (sliced) result."""
    if inner.opcode == "all-reduce" and nbytes(instr.type_text) < nbytes(inner.type_text):
      return _renamed(self.collective_op(inner, "collective", "reduce-scatter",
                                         result_type=instr.type_text), instr)
    return _renamed(self.collective_op(inner, "collective", inner.opcode,
                                       result_type=inner.type_text), instr)

  def _dot(self, op: CompiledOp) -> CompiledOp:
    if op.cycles or not op.flops:
      return op
    return dataclasses.replace(op, cycles=int(round(op.flops / self.flops_per_cycle)),
                               cycles_source="flops")

  def _is_relayout_fusion(self, comp, instr, called) -> bool:
    inner = self.comps.get(called)
    if inner is None:
      return False
    ops = {i.opcode for i in inner.instrs.values()} - {"parameter", "bitcast"}
    if not ops or not ops <= {"copy", "transpose"}:
      return False
    operand = comp.instrs.get(instr.operands[0]) if len(instr.operands) == 1 else None
    return operand is not None and _layout_key(operand.type_text) != _layout_key(
        instr.type_text)

  def entries(self, comp_name: str, depth: int = 0) -> tuple[Entry, ...]:
    comp = self.comps[comp_name]
    out = []
    for instr in comp.instrs.values():
      if instr.opcode == "while" and depth < 16:
        out.append(self.loop(comp, instr, depth))
      elif instr.opcode in ("call", "conditional") and depth < 16:
        called = instr.called()
        names = called.get("to_apply", []) + called.get("calls", []) + \
            called.get("branch_computations", []) + called.get("true_computation", []) + \
            called.get("false_computation", [])
        if instr.opcode == "call" and names:
          out.extend(self.entries(names[0], depth + 1))
        elif names:     # a conditional: its longest branch, by compute cycles (upper bound)
          branches = [self.entries(n, depth + 1) for n in names if n in self.comps]
          best = max(branches, key=lambda b: sum(o.cycles * t for o, t in _weighted(b)),
                     default=())
          out.extend(best)
      else:
        out.append(self.op(comp, instr))
    return _pair_async(tuple(out), comp)

  def loop(self, comp: Computation, instr: Instr, depth: int) -> Loop:
    called = instr.called()
    body = called.get("body", [""])[0]
    cond = called.get("condition", [""])[0]
    count = hlo_text.trip_count(self.module, comp, instr)
    known = count is not None
    count = count if known else 1
    body_entries = self.entries(body, depth + 1) if body in self.comps else ()
    content = self.contents(body) if body in self.comps else {"opcodes": set()}
    ops = content.get("opcodes", set())
    windowed = bool(ops & {"collective-permute", "collective-permute-start"}) and bool(
        ops & {"convolution", "dot"})
    return Loop(name=instr.name, trip_count=int(count), trip_count_known=known,
                body=body_entries, condition=cond, body_computation=body,
                windowed_einsum=windowed)


def _renamed(op: CompiledOp, instr: Instr) -> CompiledOp:
  """The collective found inside an async wrapper, named after the wrapper instruction
  (and priced by the wrapper's algorithm where the inner collective names none)."""
  if op.emitter:
    emitter, ring_dims, cores = op.emitter, op.ring_dims, op.ring_cores
  else:
    (emitter, ring_dims), cores = _strategy(instr.attrs), _strategy_cores(instr.attrs)
  return dataclasses.replace(op, name=instr.name, opcode=instr.opcode, emitter=emitter,
                             ring_dims=ring_dims, ring_cores=cores)


def _operand_names(comp: Computation, name: str) -> tuple[str, ...]:
  instr = comp.instrs.get(name)
  return instr.operands if instr is not None else ()


def _pair_async(entries: tuple, comp: Computation) -> tuple:
  """Link each async done to its start (following operands back through
  get-tuple-elements and continuation fusions), and record what runs in between."""
  position = {e.name: i for i, e in enumerate(entries)}
  starts = {e.name for e in entries if isinstance(e, CompiledOp) and e.kind == "start"}
  pairs = {}
  for i, e in enumerate(entries):
    if not (isinstance(e, CompiledOp) and e.kind == "done"):
      continue
    frontier, seen, found = list(_operand_names(comp, e.name)), set(), None
    while frontier and found is None:
      name = frontier.pop(0)
      if name in seen:
        continue
      seen.add(name)
      if name in starts and name not in pairs.values():
        found = name
      elif position.get(name, -1) < i:
        frontier.extend(_operand_names(comp, name))
    if found is not None:
      pairs[e.name] = found
  out = list(entries)
  for d, s in pairs.items():
    i, j = position[s], position[d]
    between = [x for x in entries[i + 1:j]]
    cycles = sum(o.cycles * t for o, t in _weighted(between))
    out[i] = dataclasses.replace(entries[i], partner=d,
                                 between=tuple(x.name for x in between), between_cycles=cycles)
    out[j] = dataclasses.replace(entries[j], partner=s)
  return tuple(out)


def read_schedule(text: str, *, chip: str = "tpu-v4") -> CompiledSchedule:
  """The entry computation of compiled (scheduled) HLO text, as CompiledOp / Loop records.

  chip: the profile name of the TPU generation (sets the FLOPs per cycle of the fallback
  estimate for dot fusions the compiler gave no cycles; see the module docstring).

  Example:
    >>> s = read_schedule(compiled.as_text())                        # doctest: +SKIP
    >>> [op.name for op in s.expanded() if op.kind == "copy"]         # doctest: +SKIP
  """
  module = _parsed(text)
  if module.entry is None:
    raise ValueError("read_schedule needs HLO text with an ENTRY computation")
  reader = _Reader(module, chip)
  return CompiledSchedule(entries=_infer_ring_dims(reader.entries(module.entry)),
                  num_partitions=module.devices, scheduled=module.is_scheduled)


def _infer_ring_dims(entries: tuple) -> tuple:
  """Collectives whose config names no algorithm (libtpu's async collective fusions)
  take the torus dims libtpu chose for the same kind of collective over the same group
  shape elsewhere in the program (`CompiledOp.ring_dims_source` "same-axis"), the fewest where
  it chose several: priced like their synchronous siblings, not on every link."""
  known = {}
  def key(op):
    return (op.collective, op.link, op.group_size)
  def visit(items):
    for e in items:
      if isinstance(e, Loop):
        visit(e.body)
      elif e.kind in ("collective", "start") and e.ring_dims:
        known[key(e)] = min(known.get(key(e), e.ring_dims), e.ring_dims)
  visit(entries)
  def fill(items):
    out = []
    for e in items:
      if isinstance(e, Loop):
        out.append(dataclasses.replace(e, body=fill(e.body)))
      elif e.kind in ("collective", "start", "done") and e.collective and e.ring_dims:
        out.append(dataclasses.replace(e, ring_dims_source="config"))
      elif e.kind in ("collective", "start") and e.collective and key(e) in known:
        out.append(dataclasses.replace(e, ring_dims=known[key(e)],
                                       ring_dims_source="same-axis"))
      else:
        out.append(e)
    return tuple(out)
  return fill(entries) if known else entries


# ----------------------------------------------------------------------------- summary

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
  """Totals of one execution of the program (loop bodies times their trip counts).

  Attributes:
    compute_cycles: sum of every op's cycles (dot + copy + other).
    dot_cycles, copy_cycles, other_cycles: that sum split by kind.
    relayout_copies: number of relayout copies run.
    flop_estimated_cycles: the part of dot_cycles derived from FLOPs (no compiler
      estimate), see the module docstring.
    collective_count, collective_bytes: per collective kind (COLLECTIVES), the number
      run and bytes one device sends (only kinds that occur).
    sync_collectives, async_collectives: how many run synchronously / asynchronously.
    overlap_cycles: compute cycles scheduled between async starts and their dones.
    loops, windowed_einsum_loops: Loop entries (each counted once per time it runs).
  """

  compute_cycles: int
  dot_cycles: int
  copy_cycles: int
  other_cycles: int
  relayout_copies: int
  flop_estimated_cycles: int
  collective_count: dict
  collective_bytes: dict
  sync_collectives: int
  async_collectives: int
  overlap_cycles: int
  loops: int
  windowed_einsum_loops: int

  @property
  def total_collective_bytes(self) -> float:
    return float(sum(self.collective_bytes.values()))


def summarize(schedule: CompiledSchedule | str) -> Summary:
  """Totals of a CompiledSchedule (or of HLO text, read with default options)."""
  if isinstance(schedule, str):
    schedule = read_schedule(schedule)
  by_kind = {"dot": 0, "copy": 0}
  other = relayouts = flop_cycles = sync = asyn = overlap = 0
  count, moved = {}, {}
  for op, times in _weighted(schedule.entries):
    if op.kind in by_kind:
      by_kind[op.kind] += op.cycles * times
    else:
      other += op.cycles * times
    if op.kind == "copy":
      relayouts += times
    if op.cycles_source == "flops":
      flop_cycles += op.cycles * times
    if op.kind in ("collective", "start"):
      count[op.collective] = count.get(op.collective, 0) + times
      moved[op.collective] = moved.get(op.collective, 0.0) + op.moved_bytes * times
      if op.kind == "collective":
        sync += times
      else:
        asyn += times
        overlap += op.between_cycles * times
  loops, windowed = 0, 0
  def visit(entries, times):
    nonlocal loops, windowed
    for e in entries:
      if isinstance(e, Loop):
        loops += times
        windowed += times * e.windowed_einsum
        visit(e.body, times * e.trip_count)
  visit(schedule.entries, 1)
  return Summary(compute_cycles=by_kind["dot"] + by_kind["copy"] + other,
                 dot_cycles=by_kind["dot"], copy_cycles=by_kind["copy"], other_cycles=other,
                 relayout_copies=relayouts, flop_estimated_cycles=flop_cycles,
                 collective_count=count, collective_bytes=moved, sync_collectives=sync,
                 async_collectives=asyn, overlap_cycles=overlap, loops=loops,
                 windowed_einsum_loops=windowed)
