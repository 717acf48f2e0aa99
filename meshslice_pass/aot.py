"""Compile for TPU pods ahead of time, on any machine, and read what the compiler made.

libtpu (`pip install -e '.[tpu]'`, i.e. `jax[tpu]` at the installed jax version) compiles
for a named TPU topology without a TPU: the devices of the topology are compile-only.
This module builds meshes on such topologies, compiles plain and meshslice-transformed
programs for them, and reads the compiled (scheduled) HLO with
`meshslice.costmodel.tpu_schedule` (compute cycles, collectives, relayout copies,
simulated step time), next to the compiler's peak memory.

    from meshslice import aot
    mesh = aot.make_mesh("v4:8x8x4", (32, 8))           # 256 TPU v4 chips, axes ("x", "y")
    result = aot.analyze(aot.compile(step, *aot.abstract_args(args)), profile="tpu-v4")
    result.summary.compute_cycles, result.simulation.step_s, result.peak_bytes

Topology names are `<generation>:<chips along each torus dim>`:

    v4   3D torus, e.g. v4:2x2x1 (4 chips), v4:4x4x4 (64), v4:8x8x4 (256), v4:16x8x8 (1024)
    v5p  3D torus, e.g. v5p:2x2x2, v5p:8x8x16
    v5e  2D torus, up to v5e:16x16 (256 chips)
    v6e  2D torus, up to v6e:16x16 (256 chips)
    tpu7x  Ironwood, 3D torus, e.g. tpu7x:2x2x1 (4 chips, 8 devices), tpu7x:4x4x4 (64
         chips, 128 devices); libtpu's spelling ("v7x:" / "v7:" are refused)

(`topology_name(generation, chips)` picks the usual slice shape for a chip count.) v4 and
v5p compile for "megacore" chips: one device per chip, both TensorCores driven together.
tpu7x has no megacore mode: each of a chip's two TensorCores (one per chiplet) is its own
device (`Generation.devices_per_chip`), with the same `coords` and `core_on_chip` 0 / 1,
and `make_mesh` puts the two cores of a chip next to each other on the mesh's last axis
(`make_mesh`).

Process-wide libtpu settings, applied before libtpu loads (the first topology):

    TPU_SKIP_MDS_QUERY=1          do not ask a metadata server for the host's TPU
    ALLOW_MULTIPLE_LIBTPU_LOAD=1  do not take /tmp/libtpu_lockfile, so several processes
                                  can compile at once (nothing here touches a real TPU)
    LIBTPU_INIT_ARGS              compiler flags (`set_flags`), read once per process

libtpu prints warnings about TPU hostnames and accelerator type: harmless here. Flags
cannot change after libtpu has loaded; compile variants that need different flags (e.g.
windowed einsum on and off) in separate processes (`run_in_fresh_process`, the workers'
JSON-lines protocol; see bench/tpu_aot.py). `flags_at_load()` says which flags this
process loaded libtpu with.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import threading
import time

# The TPU target table (`Generation` rows), the libtpu flag constants and the named flag
# sets (presets, compared variants) live in backend_flags (docs/tpu.md); their old names
# stay here. ASYNC_FLAGS: MaxText's CF_FOR_ALL_GATHER group (all-gather continuation
# fusion: safe on v5e only).
from .backend_flags import CONTINUATION_FUSION_FLAGS as ASYNC_FLAGS  # noqa: F401
from .backend_flags import (ASYNC_ALL_TO_ALL_FLAGS, DENSE_FLAGS,  # noqa: F401
                            FLAG_PRESETS, GENERATIONS, SAFE_ASYNC_FLAGS, VARIANTS,
                            XLA_VARIANTS, Generation, mesh_profile, preset_flags,
                            tpu_overlap_flags, unsafe_flags, variant_flags)

# Spellings of Ironwood that libtpu refuses as topology names: named in the error
_TPU7X_SPELLINGS = ("v7x", "v7", "tpu7", "ironwood")

_FLAGS_AT_LOAD: list = []      # LIBTPU_INIT_ARGS when this process loaded libtpu


def flags_at_load() -> str | None:
  """LIBTPU_INIT_ARGS as they were when this process loaded libtpu (its first `topology`):
  the compiler flags of the process for good; None while libtpu is not loaded here."""
  return _FLAGS_AT_LOAD[0] if _FLAGS_AT_LOAD else None


def have_libtpu() -> bool:
  """Whether libtpu (the `tpu` extra) is installed."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


def parse_topology(name: str) -> tuple[Generation, tuple[int, ...]]:
  """("v4:8x8x4") -> (GENERATIONS["v4"], (8, 8, 4)), or a ValueError saying what is
  expected.

  Example:
    >>> g, dims = parse_topology("v4:8x8x4")
    >>> g.profile, dims, math.prod(dims)
    ('tpu-v4', (8, 8, 4), 256)
    >>> g, dims = parse_topology("tpu7x:4x4x4")          # Ironwood: 2 devices per chip
    >>> g.profile, math.prod(dims) * g.devices_per_chip
    ('tpu-v7x', 128)
  """
  match = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", str(name).strip().lower())
  if not match:
    raise ValueError(f"topology {name!r}: expected '<generation>:<dims>' such as "
                     f"'v4:2x2x2', 'v5e:4x4' (generations: {', '.join(GENERATIONS)})")
  gen_name, dims = match.group(1), tuple(int(d) for d in match.group(2).split("x"))
  if gen_name in _TPU7X_SPELLINGS:
    raise ValueError(f"topology {name!r}: libtpu names Ironwood 'tpu7x' (it refuses "
                     f"{gen_name!r}); use 'tpu7x:{match.group(2)}'")
  if gen_name not in GENERATIONS:
    raise ValueError(f"topology {name!r}: unknown TPU generation {gen_name!r}; known: "
                     f"{', '.join(GENERATIONS)}")
  gen = GENERATIONS[gen_name]
  if len(dims) != gen.torus_dims or min(dims) < 1:
    example = "x".join(["2"] * gen.torus_dims)
    raise ValueError(f"topology {name!r}: {gen_name} is a {gen.torus_dims}D torus, so give "
                     f"{gen.torus_dims} positive chip counts, e.g. '{gen_name}:{example}'")
  if math.prod(dims) > gen.max_chips:
    raise ValueError(f"topology {name!r}: {math.prod(dims)} chips exceeds the largest "
                     f"{gen_name} slice ({gen.max_chips} chips)")
  if dims[0] % 2 or dims[1] % 2:
    raise ValueError(f"topology {name!r}: the first two dims must be even (hosts hold "
                     f"2x2 chips), e.g. '{gen_name}:" + "x".join(
                         ["2", "2"] + ["1"] * (gen.torus_dims - 2)) + "'")
  return gen, dims


def device_count(name: str) -> int:
  """The jax devices of a topology name: its chips times the generation's devices per
  chip (2 on tpu7x, one per TensorCore); what a mesh over it must multiply to.

  Example:
    >>> device_count("v4:2x2x2"), device_count("tpu7x:2x2x1"), device_count("tpu7x:4x4x4")
    (8, 8, 128)
  """
  gen, dims = parse_topology(name)
  return math.prod(dims) * gen.devices_per_chip


def topology_name(generation: str, chips: int) -> str:
  """The usual slice shape of `chips` chips: 3D tori as near-cubes (v4:4x4x4 for 64,
  v4:8x8x4 for 256, v4:16x8x8 for 1024), 2D tori as near-squares (v6e:16x16 for 256).

  Example:
    >>> topology_name("v4", 64), topology_name("v4", 256), topology_name("v6e", 64)
    ('v4:4x4x4', 'v4:8x8x4', 'v6e:8x8')
  """
  if generation not in GENERATIONS:
    raise ValueError(f"generation must be one of {tuple(GENERATIONS)}, got {generation!r}")
  gen = GENERATIONS[generation]
  if not isinstance(chips, int) or chips < 4 or chips & (chips - 1):
    raise ValueError(f"chips must be a power of two >= 4, got {chips!r}")
  if chips > gen.max_chips:
    raise ValueError(f"{generation}: {chips} chips exceeds the largest slice "
                     f"({gen.max_chips} chips)")
  dims = [2, 2] + [1] * (gen.torus_dims - 2)
  order = [2, 0, 1] if gen.torus_dims == 3 else [0, 1]     # z to 2 first, then x, y, z, ...
  i = 0
  while math.prod(dims) < chips:
    dims[order[i % len(order)]] *= 2
    i += 1
  return f"{generation}:" + "x".join(str(d) for d in dims)


def set_flags(*flags: str) -> None:
  """Set LIBTPU_INIT_ARGS for this process (before libtpu loads: the first `topology`).

  Raises:
    RuntimeError: libtpu already loaded with other flags (they are read once per
      process; use a subprocess per flag set).
  """
  wanted = " ".join(flags)
  if _FLAGS_AT_LOAD and _FLAGS_AT_LOAD[0] != wanted:
    raise RuntimeError(f"libtpu already loaded in this process with LIBTPU_INIT_ARGS="
                       f"{_FLAGS_AT_LOAD[0]!r}; flags are read once per process, so "
                       f"compile with {wanted!r} in a new process")
  os.environ["LIBTPU_INIT_ARGS"] = wanted


def _prepare_env() -> None:
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology(name: str, *, num_slices: int = 1):
  """The compile-only devices of a named TPU topology (a jax TopologyDescription).

  Example:
    >>> len(topology("v4:2x2x2").devices)                    # doctest: +SKIP
    8
  """
  gen, dims = parse_topology(name)
  if not have_libtpu():
    raise RuntimeError("compiling for TPU needs libtpu: pip install -e '.[tpu]' "
                       "(jax[tpu] at the installed jax version)")
  _prepare_env()
  if not _FLAGS_AT_LOAD:
    _FLAGS_AT_LOAD.append(os.environ.get("LIBTPU_INIT_ARGS", ""))
  from jax.experimental import topologies
  bounds = (2, 2, 1) if math.prod(dims) >= 4 else (1, 1, 1)
  spelled = f"{gen.name}:" + "x".join(str(d) for d in dims)
  return topologies.get_topology_desc(platform="tpu", topology_name=spelled,
                                      chip_config_name=gen.chip_config,
                                      chips_per_host_bounds=bounds, num_slices=num_slices)


def make_mesh(topo, shape, axis_names=("x", "y")):
  """A jax.sharding.Mesh of `shape` over a topology (a name or a `topology(...)`), in the
  device order `mesh_utils.create_device_mesh` gives (each mesh axis along physical torus
  axes where the shape allows, else splitting them).

  Chips of two devices (tpu7x: one per TensorCore, `core_on_chip` 0 and 1): the two
  cores of a chip sit next to each other on the *core axis*, the last mesh axis whose
  size is even (normally the last, fastest-varying axis), core 0 first: along it the
  devices run chip a core 0, chip a core 1, chip b core 0, ... The chips themselves are
  placed as create_device_mesh places one-device-per-chip 3D tori (v4 / v5p megacore)
  for the mesh with the core axis halved (`costmodel.topology.core_axis`). So a
  collective over the core axis rings through both cores of each chip (the on-package
  die-to-die link between them, then one ICI hop to the next chip), and a collective
  over any other axis joins same-numbered cores of different chips over ICI, the two
  cores' rings sharing the chips' links (costmodel.topology prices both so).

  Raises:
    ValueError: the shape's size is not the topology's device count, or names mismatch.

  Example:
    >>> mesh = make_mesh("v4:8x8x4", (32, 8))                # doctest: +SKIP
    >>> dict(mesh.shape)                                      # doctest: +SKIP
    {'x': 32, 'y': 8}
    >>> m = make_mesh("tpu7x:2x2x1", (2, 4))                 # doctest: +SKIP
    >>> [(tuple(d.coords), d.core_on_chip) for d in m.devices[0]]  # doctest: +SKIP
    [((0, 0, 0), 0), ((0, 0, 0), 1), ((1, 0, 0), 0), ((1, 0, 0), 1)]
  """
  import jax
  name = topo if isinstance(topo, str) else None
  if name is not None:
    topo = topology(name)
  shape = tuple(int(v) for v in shape)
  devices = list(topo.devices)
  where = f"topology {name!r}" if name else "the topology"
  if len(axis_names) != len(shape):
    raise ValueError(f"mesh shape {shape} has {len(shape)} axes but axis_names "
                     f"{tuple(axis_names)} has {len(axis_names)}")
  if math.prod(shape) != len(devices) or min(shape) < 1:
    raise ValueError(f"mesh shape {'x'.join(map(str, shape))} has {math.prod(shape)} "
                     f"devices but {where} has {len(devices)}; pick a shape whose product "
                     f"is {len(devices)}")
  cores = 1 + max(getattr(d, "core_on_chip", 0) or 0 for d in devices)
  if cores > 1:
    grid = _core_pair_grid(devices, shape, cores)
  else:
    grid = _device_grid(devices, shape)
  return jax.sharding.Mesh(grid, tuple(axis_names))


def _device_grid(devices, shape):
  """create_device_mesh's order for `devices` (one per chip), splitting physical axes
  where it must, else the devices' own order."""
  import numpy as np
  from jax.experimental import mesh_utils
  try:
    return mesh_utils.create_device_mesh(shape, devices)
  except (ValueError, AssertionError, NotImplementedError):
    try:
      return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, AssertionError, NotImplementedError):
      return np.array(devices).reshape(shape)


@dataclasses.dataclass(frozen=True, slots=True)
class _Chip:
  """One chip of a multi-core topology as create_device_mesh sees a one-device-per-chip
  (megacore) 3D-torus chip: its coordinates, no core index. `device_kind` names a chip
  mesh_utils places by its generic torus rule (no kind-specific ring order)."""

  coords: tuple
  id: int
  slice_index: int = 0
  core_on_chip: int = 0
  device_kind: str = "TPU v4"
  platform: str = "tpu"


def _core_pair_grid(devices, shape, cores: int):
  """The device grid of `make_mesh` for chips of `cores` devices: chips placed for the
  mesh with the core axis divided by `cores`, then each chip's devices in core order
  along that axis."""
  import numpy as np
  from meshslice.costmodel.topology import core_axis
  axis = core_axis(shape, cores)       # a ValueError when no axis is a multiple of cores
  by_chip: dict = {}          # (slice, coords) -> {core: device}
  for d in devices:
    key = (getattr(d, "slice_index", 0) or 0, tuple(d.coords))
    by_chip.setdefault(key, {})[d.core_on_chip] = d
  if any(len(v) != cores for v in by_chip.values()):
    raise ValueError(f"the topology's chips do not all have {cores} devices")
  chips = [_Chip(coords=c, slice_index=k, id=min(d.id for d in v.values()))
           for (k, c), v in by_chip.items()]
  chip_shape = tuple(s // cores if a == axis else s for a, s in enumerate(shape))
  chip_grid = _device_grid(sorted(chips, key=lambda c: c.id), chip_shape)
  grid = np.empty(shape, dtype=object)
  for index in np.ndindex(*chip_shape):
    placed = chip_grid[index]
    chip = by_chip[(placed.slice_index, tuple(placed.coords))]
    for core in range(cores):
      spot = list(index)
      spot[axis] = index[axis] * cores + core
      grid[tuple(spot)] = chip[core]
  return grid


def abstract_args(tree, shardings=None):
  """ShapeDtypeStructs (with shardings) of a tree of arrays / ShapeDtypeStructs, for
  `jit(...).lower` on compile-only devices. `shardings`: a matching tree (default: each
  leaf's own `.sharding`)."""
  import jax
  if shardings is None:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=getattr(a, "sharding", None)),
                        tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      tree, shardings)


def compile(fn, *args, mesh=None):
  """`fn.lower(*args).compile()` (inside `jax.set_mesh(mesh)` when given), timed.

  Returns (compiled, seconds)."""
  import contextlib
  import jax
  ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  start = time.perf_counter()
  with ctx:
    compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - start


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AotResult:
  """What one compiled program costs, read off the compiler's output.

  Attributes:
    summary: tpu_schedule.Summary (cycles, collectives, copies, loops).
    simulation: tpu_schedule.Simulation (predicted step time) under `profile`.
    peak_bytes: argument + output + temp - aliased bytes per device
      (compiled.memory_analysis()): the project's formula, an upper bound.
    temp_bytes: the temp part of it.
    compile_s: compile seconds on this machine.
    flags: LIBTPU_INIT_ARGS in effect.
    libtpu_peak_bytes: libtpu's own peak per device
      (`memory_analysis().peak_memory_in_bytes`; 0 where it gives none). Not bounded
      by peak_bytes either way: lower on large programs whose buffers do not all live
      at once (docs/tpu.md, "Peak memory"), 1.7-3.8x higher on the v4:2x2x2 GEMM / attention
      programs of docs/tpu.md, whose gathered operands the temp figure leaves out.
    scheduler_cycles: libtpu's latency-hiding scheduler "Total cycles" for the entry
      computation, read from the compile's stderr (`scheduler_log`); None without a log.
      Its own cost model's units, not estimated cycles (tpu_schedule.SchedulerTotals).
    scheduler_s: scheduler_cycles / the chip clock: nominal, for putting it beside
      simulation.step_s; it ranks programs as libtpu's scheduler does, it is not a
      measured step time.
    scheduler_wasted_cycles: of scheduler_cycles, what the scheduler counts as waiting for
      collectives ("Total wasted cycles": its exposed communication); None without a log.
    scheduler_loop_cycles: the scheduler's totals for the bodies of `while` loops, times
      their trip counts (`tpu_schedule.scheduler_loop_cycles`); the entry total counts a
      loop as one node costing less (docs/tpu.md), so compare programs with loops on
      scheduler_cycles + this where the loop nodes are small. None without a log.
    schedule: the tpu_schedule.CompiledSchedule read (per-op detail, e.g. `schedule.expanded()`);
      not in `row()`.
  """

  summary: object
  simulation: object
  peak_bytes: int
  temp_bytes: int
  compile_s: float = 0.0
  flags: str = ""
  libtpu_peak_bytes: int = 0
  scheduler_cycles: float | None = None
  scheduler_s: float | None = None
  scheduler_loop_cycles: float | None = None
  scheduler_wasted_cycles: float | None = None
  schedule: object = dataclasses.field(default=None, repr=False, compare=False)

  def row(self) -> dict:
    """Plain figures, for JSON and tables."""
    s, sim = self.summary, self.simulation
    return {"compute_cycles": s.compute_cycles, "dot_cycles": s.dot_cycles,
            "copy_cycles": s.copy_cycles, "relayout_copies": s.relayout_copies,
            "collectives": sum(s.collective_count.values()),
            "collective_bytes": s.total_collective_bytes,
            "sync_collectives": s.sync_collectives, "async_collectives": s.async_collectives,
            "windowed_einsum_loops": s.windowed_einsum_loops,
            "step_s": sim.step_s, "compute_s": sim.compute_s, "exposed_s": sim.exposed_s,
            "exposed_by": [list(g) for g in sim.exposed_by(top=5)],
            "ici_profile": sim.profile,
            "peak_bytes": self.peak_bytes, "temp_bytes": self.temp_bytes,
            "libtpu_peak_bytes": self.libtpu_peak_bytes,
            "scheduler_cycles": self.scheduler_cycles, "scheduler_s": self.scheduler_s,
            "scheduler_loop_cycles": self.scheduler_loop_cycles,
            "scheduler_wasted_cycles": self.scheduler_wasted_cycles,
            "compile_s": self.compile_s, "flags": self.flags}


def analyze(compiled, profile: str = "tpu-v4", *, compile_s: float = 0.0,
            mesh_shape=None, scheduler_log: str | None = None,
            ring_shares: bool = True) -> AotResult:
  """Read a compiled TPU program: schedule summary, simulated step, peak memory, and
  libtpu's own figures beside them (its peak memory; its scheduler's total when the
  compile's stderr is given).

  mesh_shape: the mesh's axis sizes (row, col). Given, the simulator times collectives
    with the profile's links derived for that mesh from its topology
    (`costmodel.profile_for_mesh`): the ICI model the planner prices sites with, each
    collective at the share of its axis's torus dims that libtpu's chosen algorithm
    drives (`tpu_schedule.collective_seconds`, `axis_dims`). None: the profile's own two
    dims (for tpu-v4, the original's measured constants), unscaled.
  ring_shares: with mesh_shape, price each collective at the share of its axis's links
    that libtpu's algorithm drives (above). False: at the axis's full derived links, as
    the single-GEMM records the compiler terms are fitted to are simulated
    (`aot_sites.compile_cases`).
  scheduler_log: the stderr of the process that compiled it, with libtpu's scheduler
    logging on (`tpu_schedule.SCHEDULER_LOG_ENV` set before libtpu loaded; capture with
    `tpu_schedule.capture_stderr()` around the compile, or from a subprocess).

  Example:
    >>> aot.analyze(compiled, "tpu-v4", mesh_shape=(32, 8)).simulation.step_s  # doctest: +SKIP
  """
  from meshslice.costmodel import profile_for_mesh, tpu_schedule
  from meshslice.costmodel.profiles import load_profile
  base = load_profile(profile)
  if mesh_shape is not None:       # a (rows, 1) mesh's collectives are read as dim 1's
    mesh_shape = tpu_schedule.link_mesh_shape(mesh_shape)
  prof = base if mesh_shape is None else profile_for_mesh(base, tuple(mesh_shape))
  text = compiled.as_text()
  schedule = tpu_schedule.read_schedule(text, chip=base.name)
  mem = compiled.memory_analysis()
  peak = temp = libtpu_peak = 0
  if mem is not None:
    temp = int(mem.temp_size_in_bytes)
    peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
               - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    libtpu_peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
  clock = tpu_schedule.CLOCK_HZ.get(base.name)
  axis_dims = None if mesh_shape is None or not ring_shares else (
      tpu_schedule.axis_torus_dims(base, tuple(mesh_shape)))
  lhs = lhs_loops = wasted = None
  if scheduler_log:
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    totals = tpu_schedule.read_scheduler_log(scheduler_log)
    record = tpu_schedule.scheduler_entry(totals, entry.group(1) if entry else None)
    lhs, wasted = (None, None) if record is None else (record.cycles, record.wasted_cycles)
    lhs_loops = tpu_schedule.scheduler_loop_cycles(totals, schedule) if totals else None
  return AotResult(summary=tpu_schedule.summarize(schedule),
                   simulation=tpu_schedule.simulate(schedule, prof, clock_hz=clock,
                                                    axis_dims=axis_dims),
                   peak_bytes=peak,
                   temp_bytes=temp, compile_s=compile_s,
                   flags=os.environ.get("LIBTPU_INIT_ARGS", ""),
                   libtpu_peak_bytes=libtpu_peak, scheduler_cycles=lhs,
                   scheduler_loop_cycles=lhs_loops, scheduler_wasted_cycles=wasted,
                   scheduler_s=None if lhs is None or not clock else lhs / clock,
                   schedule=schedule)


def compare_candidates(fn, *args, mesh, candidates: dict, profile: str | None = None) -> dict:
  """Compile `fn` once per candidate plan under this process's libtpu flags and read each
  with the schedule simulator: the hook for a planner that wants the compiler's verdict
  on a site (or a whole step) rather than the analytic model's.

  candidates: {name: None (leave it to XLA: plain `fn`) or a dict of
  meshslice.transform options (e.g. {"algorithm": "meshslice", "ksplit": 2}, or
  {"overrides": {...}} to pin single sites)}. profile: for planning and simulation
  (default: the mesh's TPU generation).

  Returns {name: AotResult}; compare `result.simulation.step_s`. (Windowed einsum on and
  off need separate processes: run the "leave it to XLA" candidate under both flag sets.)

  Example:
    >>> results = compare_candidates(step, params, batch, mesh=mesh, candidates={
    ...     "xla": None, "S=2": {"algorithm": "meshslice", "ksplit": 2}})  # doctest: +SKIP
    >>> min(results, key=lambda k: results[k].simulation.step_s)        # doctest: +SKIP
  """
  from .transform import transform
  if profile is None:
    profile = mesh_profile(mesh)
  out = {}
  for name, options in candidates.items():
    if options is not None and not isinstance(options, dict):
      raise ValueError(f"candidate {name!r}: expected None (plain jit) or a dict of "
                       f"meshslice.transform options, got {options!r}")
    candidate = fn if options is None else transform(fn, **{"profile": profile, **options})
    compiled, seconds = compile(candidate, *args, mesh=mesh)
    out[name] = analyze(compiled, profile, compile_s=seconds,
                        mesh_shape=mesh.devices.shape if mesh.devices.ndim == 2 else None)
  return out


# ----------------------------------------------------------------------------- models

def layer_config(spec, devices: int, *, layers: int | None = None, batch: int | None = None,
                 dtype: str | None = None):
  """The `gpt.ModelConfig` of `model_step`'s layer step for a `costmodel.ModelSpec` on
  `devices` devices: 1 layer, one sequence per device and bf16 unless given, ffn 4x
  hidden."""
  from . import gpt
  return gpt.ModelConfig(layers=1 if layers is None else layers, batch=batch or devices,
                         seq=spec.seq, hidden=spec.hidden, heads=spec.heads,
                         ffn=4 * spec.hidden, dtype=dtype or "bfloat16")


def model_step(model: str, mesh, *, layers: int | None = None, batch: int | None = None,
               seq: int | None = None, dtype: str | None = None, whole: bool = False):
  """A training step of `model` on `mesh` (axes (..., row, col), e.g. ("x", "y"); a
  Mesh, e.g. `make_mesh`'s, or an AbstractMesh), with abstract inputs (sharded
  `jax.ShapeDtypeStruct`s: nothing allocated), as `(step, *args)`: `step(*args)` is the
  step, `compile(step, *args, mesh=mesh)` compiles it.

  whole=False (the default): the GPT-style layer step of the demo (meshslice.gpt:
    attention + MLP layers, scan over checkpointed blocks, fwd + bwd + SGD) at the size
    of `model` ("gpt3", "megatron", or a ModelSpec: meshslice.costmodel.model_spec);
    returns (step, params, batch). layers: default 1; dtype: default "bfloat16".
  whole=True: the whole training step of `meshslice.whole_step.whole_step` (one-hot
    token embedding, scanned checkpointed layers, logits, softmax cross-entropy, Adam)
    of a `whole_step.PRESETS` model ("gpt3", "megatron", "llama70b", "tiny",
    "tiny_llama") or a `whole_step.WholeConfig`; returns (step, params, opt_state,
    batch), the step donating params and opt_state. layers: default 4 (a schedule
    simulator sees the steady state); dtype: default the preset's (bfloat16 at scale,
    float32 for the tiny ones).

  batch: sequences per step (default: one per device; tpu7x: per TensorCore). seq:
  tokens per sequence (default: the model's).

  Either way, `step, *args = model_step(...)` takes both.

  Example:
    >>> am = jax.sharding.AbstractMesh((64, 4), ("x", "y"))          # doctest: +SKIP
    >>> step, params, opt_state, batch = model_step("gpt3", am, whole=True)  # doctest: +SKIP
    >>> params["layers"]["wq"].shape, batch["tokens"].shape           # doctest: +SKIP
    ((4, 12288, 12288), (256, 2048))
  """
  if whole:
    from .whole_step import whole_step
    step, params, opt_state, data = whole_step(model, mesh, layers=4 if layers is None
                                               else layers, batch=batch, seq=seq,
                                               dtype=dtype)
    return step, params, opt_state, data
  import jax
  from jax.sharding import NamedSharding
  from . import gpt
  from meshslice.costmodel import model_spec
  try:
    spec = model_spec(model, seq=seq)
  except ValueError as e:
    from .whole_step import PRESETS
    if isinstance(model, str) and model in PRESETS:   # llama70b, tiny, tiny_llama
      raise ValueError(f"{e}; {model!r} is a whole-step preset (meshslice.whole_step."
                       "PRESETS): pass whole=True") from None
    raise
  n = math.prod(dict(mesh.shape).values())     # a Mesh or an AbstractMesh
  cfg = layer_config(spec, n, layers=layers, batch=batch, dtype=dtype)
  row, col = mesh.axis_names[-2:]
  ps = jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.param_specs(row, col))
  bs = jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.batch_specs(row, col))
  params = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
  data = jax.eval_shape(lambda: gpt.init_batch(cfg, jax.random.key(0)))
  return gpt.make_step(cfg, mesh), abstract_args(params, ps), abstract_args(data, bs)


def compare(model: str, topology: str | None = None, mesh_shape=None, *,
            layers: int | None = None, batch: int | None = None,
            variants=("plain", "meshslice"), echo=None, topology_name_: str | None = None,
            seq: int | None = None, whole: bool = False, **options) -> dict:
  """Compile the model's step (`model_step`) on a TPU topology's `mesh_shape` mesh plain
  and meshslice-transformed (`options` go to meshslice.transform; profile defaults to
  the topology's) and analyze both.

  topology: a topology name such as "v4:2x2x2" (`topology_name_`: its old spelling,
    still accepted as a keyword).
  layers: layers in the step (default: `model_step`'s, 1, or 4 with `whole`).
  seq: tokens per sequence (default: the model's, 2048 for gpt3).
  whole: compile the whole training step (`model_step(..., whole=True)`: embeddings,
    layers, loss, Adam; `model` one of `whole_step.PRESETS`) instead of the layer step.
  echo: given, the meshslice variant's report is passed to it as text.

  Returns {variant: AotResult}.
  """
  from .transform import transform
  if topology_name_ is not None:
    if topology is not None:
      raise TypeError("compare() got both topology and topology_name_ (its old name)")
    topology = topology_name_
  if topology is None or mesh_shape is None:
    raise TypeError("compare() needs a topology (e.g. 'v4:2x2x2') and a mesh_shape")
  gen, _ = parse_topology(topology)
  options.setdefault("profile", gen.profile)
  mesh = make_mesh(topology, mesh_shape)
  step, *args = model_step(model, mesh, layers=layers, batch=batch, seq=seq, whole=whole)
  out = {}
  for variant in variants:
    if variant == "plain":
      fn = step
    elif variant == "meshslice":
      fn = transform(step, **options)
      if echo is not None:
        import jax
        with jax.set_mesh(mesh):
          echo(str(fn.explain(*args)))
    else:
      raise ValueError(f"variant must be 'plain' or 'meshslice', got {variant!r}")
    compiled, seconds = compile(fn, *args, mesh=mesh)
    out[variant] = analyze(compiled, options["profile"], compile_s=seconds,
                           mesh_shape=mesh_shape)
    del compiled
  return out


# ----------------------------------------------------------------------------- variants

def versus_best_xla(rows: dict, key: str = "step_s", variant: str = "meshslice"):
  """(best XLA variant name, its `key`, its `key` / `variant`'s: > 1 is the rewrite
  faster) among the XLA variants present in `rows` ({variant: row dict}); None when
  `variant` or every XLA variant is missing (or failed)."""
  ok = lambda r: isinstance(r, dict) and isinstance(r.get(key), (int, float)) and r[key] > 0
  xla = {n: r[key] for n, r in rows.items() if n in XLA_VARIANTS and ok(r)}
  if not xla or not ok(rows.get(variant)):
    return None
  best = min(xla, key=lambda n: (xla[n], n))
  return best, xla[best], xla[best] / rows[variant][key]


# ----------------------------------------------------------------------------- table

# the table's rows: (label, figure of a row dict (`AotResult.row()`), format)
_ROWS = (("compute cycles (M)", lambda r: r["compute_cycles"] / 1e6, "{:.1f}"),
         ("  dot cycles (M)", lambda r: r["dot_cycles"] / 1e6, "{:.1f}"),
         ("  relayout copy cycles (M)", lambda r: r["copy_cycles"] / 1e6, "{:.2f}"),
         ("relayout copies", lambda r: r["relayout_copies"], "{:d}"),
         ("collectives (sync / async)",
          lambda r: f"{r['collectives']} ({r['sync_collectives']} / {r['async_collectives']})",
          "{}"),
         ("collective bytes / device (MB)", lambda r: r["collective_bytes"] / 1e6, "{:.1f}"),
         ("windowed-einsum loops", lambda r: r["windowed_einsum_loops"], "{:d}"),
         ("simulated step (ms)", lambda r: r["step_s"] * 1e3, "{:.3f}"),
         ("  compute (ms)", lambda r: r["compute_s"] * 1e3, "{:.3f}"),
         ("  exposed communication (ms)", lambda r: r["exposed_s"] * 1e3, "{:.3f}"),
         ("  most of it waiting on", lambda r: _largest_wait(r), "{}"),
         ("peak memory / device (GiB)", lambda r: r["peak_bytes"] / 2**30, "{:.2f}"),
         ("compile time (s)", lambda r: r["compile_s"], "{:.0f}"))


def _largest_wait(row: dict) -> str:
  """The label and ms of the largest group of waits (`Simulation.exposed_by`), or "-"."""
  groups = row.get("exposed_by") or []
  if not groups:
    return "-"
  label, seconds, _ = groups[0]
  return f"{label} ({seconds * 1e3:.2f})"


def format_table(results: dict) -> str:
  """Side-by-side table of {variant: AotResult or row dict} (ratio column for two
  variants), each column's libtpu flags under it, and meshslice against the best XLA
  variant when both are there."""
  names = list(results)
  rows = {n: (results[n] if isinstance(results[n], dict) else results[n].row())
          for n in names}
  lines = [["", *names] + (["ratio"] if len(names) == 2 else [])]
  for label, get, fmt in _ROWS:
    values = [get(rows[n]) for n in names]
    line = [label] + [fmt.format(v) for v in values]
    if len(names) == 2:
      a, b = values
      line.append(f"{b / a:.2f}x" if isinstance(a, (int, float)) and a else "")
    lines.append(line)
  widths = [max(len(l[i]) for l in lines) for i in range(len(lines[0]))]
  text = [ "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(l, widths))) for l in lines]
  text.append("libtpu flags (LIBTPU_INIT_ARGS):")
  text += [f"  {n}: {rows[n].get('flags') or '(libtpu defaults)'}" for n in names]
  for variant in (n for n in names if VARIANTS.get(n, (False,))[0]):
    best = versus_best_xla(rows, variant=variant)
    if best is not None:
      name, seconds, ratio = best
      text.append(f"{variant} vs the best XLA variant ({name}, {seconds * 1e3:.3f} ms): "
                  f"{ratio:.3f}x ({'faster' if ratio > 1 else 'not faster'})")
  return "\n".join(text)


# ----------------------------------------------------------------------------- workers

class FreshProcessError(RuntimeError):
  """A `run_in_fresh_process` worker that failed: exited non-zero, timed out, or printed
  records its caller's `check` refused.

  Attributes:
    argv: the worker's arguments (after the Python executable).
    returncode: its exit status (None when it timed out).
    stdout: everything it printed on stdout; stderr: on stderr.
    timed_out: whether it was killed for running past the timeout.
  """

  def __init__(self, argv, returncode, stdout: str, stderr: str, *, timed_out=False):
    what = "timed out" if timed_out else f"exit {returncode}"
    super().__init__(f"python {' '.join(map(str, argv))} failed ({what}):\n{stderr[-3000:]}")
    self.argv, self.returncode, self.stdout, self.stderr = list(argv), returncode, stdout, stderr
    self.timed_out = timed_out


def run_in_fresh_process(argv, *, prefix: str = "", echo=None, check=None,
                         drop_env=("XLA_FLAGS",), timeout: float | None = None) -> list[dict]:
  """Run `python argv...` (this interpreter) in a fresh process and return the JSON
  objects it prints: the one worker protocol of the AOT tooling, since libtpu reads its
  flags once per process, so each flag set compiles in a process of its own.

  The worker prints one record per stdout line, `prefix` then a JSON object; every other
  stdout line is passed to `echo` as it comes (the line as printed, newline included).

  check: given, a test of the records (e.g. `bool`: at least one); False counts as a
    failure. drop_env: variables of this process's environment the worker does not get
    (XLA_FLAGS: the caller's emulated CPU devices would ask a TPU compile for them).
  timeout: seconds to wait for the worker's exit once its stdout has closed.

  Raises:
    FreshProcessError: the worker exited non-zero, timed out, or failed `check`; it
      carries the exit status and the worker's stdout and stderr.
  """
  env = {k: v for k, v in os.environ.items() if k not in drop_env}
  proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
  assert proc.stdout is not None and proc.stderr is not None      # both PIPE
  errors: list = []
  stderr_pipe = proc.stderr
  drain = threading.Thread(target=lambda: errors.append(stderr_pipe.read()), daemon=True)
  drain.start()                  # stderr read beside stdout: a full pipe cannot stall it
  printed, lines = [], []
  for line in proc.stdout:
    printed.append(line)
    if line.startswith(prefix + "{"):
      lines.append(line[len(prefix):])
    elif echo is not None:
      echo(line)
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    drain.join()
    raise FreshProcessError(argv, None, "".join(printed), "".join(errors),
                            timed_out=True) from None
  drain.join()
  stdout, stderr = "".join(printed), "".join(errors)
  if proc.returncode:
    raise FreshProcessError(argv, proc.returncode, stdout, stderr)
  records = [json.loads(line) for line in lines]
  if check is not None and not check(records):
    raise FreshProcessError(argv, proc.returncode, stdout, stderr)
  return records


# ----------------------------------------------------------------------------- moved

# The `aot` CLI moved to aot_cli, which imports this module; its names resolve there on
# first use (PEP 562) so that `aot.main` keeps working while importing aot does not load
# the CLI. (An import cycle all the same: tests/test_layering.KNOWN_CYCLES.)
_MOVED_TO_CLI = ("main", "_variant_worker")


def __getattr__(name: str):
  if name in _MOVED_TO_CLI:
    import importlib
    return getattr(importlib.import_module(".aot_cli", __package__), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
