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
windowed einsum on and off) in separate processes (see bench/tpu_aot.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time

# The libtpu flag constants live in backend_flags (one table per TPU generation,
# docs/tpu.md); the old names stay here. ASYNC_FLAGS: MaxText's CF_FOR_ALL_GATHER group
# (all-gather continuation fusion: safe on v5e only).
from .backend_flags import CONTINUATION_FUSION_FLAGS as ASYNC_FLAGS  # noqa: E402
from .backend_flags import (ASYNC_ALL_TO_ALL_FLAGS, DENSE_FLAGS,  # noqa: E402,F401
                            SAFE_ASYNC_FLAGS, tpu_overlap_flags, unsafe_flags)
# Generation-independent presets (legacy: "async" is the continuation-fusion group). For
# a topology use `preset_flags`, where "async" is the generation's own set.
FLAG_PRESETS = {"default": (), "async": ASYNC_FLAGS, "fusion": ASYNC_FLAGS,
                "safe_async": SAFE_ASYNC_FLAGS, "dense": DENSE_FLAGS,
                "all_to_all": ASYNC_ALL_TO_ALL_FLAGS}


def preset_flags(presets, generation: str | None) -> tuple:
  """The libtpu flags of preset names (a comma-separated string or a sequence) for a TPU
  generation: "default" (none), "async" (the generation's async collective flags,
  `backend_flags.tpu_overlap_flags`: no all-gather continuation fusion on v4 / v5p /
  v6e), "fusion" (the continuation-fusion group, `ASYNC_FLAGS`), "safe_async", "dense"
  (windowed einsum off), "all_to_all" (async all-to-all, for `reduce_scatter="all_to_all"`).

  Example:
    >>> preset_flags("dense,async", "v4")[-1]
    '--xla_enable_async_all_gather=true'
  """
  names = [p.strip() for p in presets.split(",")] if isinstance(presets, str) else presets
  out = []
  for name in (n for n in names if n):
    if name not in FLAG_PRESETS:
      raise ValueError(f"unknown libtpu flag preset {name!r}; known: {', '.join(FLAG_PRESETS)}")
    out += tpu_overlap_flags(generation) if name == "async" else FLAG_PRESETS[name]
  return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
  """A TPU generation as libtpu names it, and the project's profile for it."""

  name: str
  profile: str
  torus_dims: int           # 3: v4 / v5p / tpu7x, 2: v5e / v6e
  chip_config: str          # chip_config_name for get_topology_desc
  max_chips: int            # largest single slice
  device_kind: str
  devices_per_chip: int = 1  # 2 on tpu7x: each TensorCore is its own device


GENERATIONS = {
    "v4": Generation(name="v4", profile="tpu-v4", torus_dims=3, chip_config="megacore",
                     max_chips=4096, device_kind="TPU v4"),
    "v5p": Generation(name="v5p", profile="tpu-v5p", torus_dims=3, chip_config="megacore",
                      max_chips=8960, device_kind="TPU v5"),
    "v5e": Generation(name="v5e", profile="tpu-v5e", torus_dims=2, chip_config="default",
                      max_chips=256, device_kind="TPU v5 lite"),
    "v6e": Generation(name="v6e", profile="tpu-v6e", torus_dims=2, chip_config="default",
                      max_chips=256, device_kind="TPU v6 lite"),
    # Ironwood: 9,216 chips per pod (cloud.google.com/tpu/docs/tpu7x); libtpu 0.0.42.1
    # refuses the "megacore" chip config for it, so a chip is two devices
    "tpu7x": Generation(name="tpu7x", profile="tpu-v7x", torus_dims=3, chip_config="default",
                        max_chips=9216, device_kind="TPU7x", devices_per_chip=2),
}
# Spellings of Ironwood that libtpu refuses as topology names: named in the error
_TPU7X_SPELLINGS = ("v7x", "v7", "tpu7", "ironwood")

_FLAGS_AT_LOAD: list = []      # LIBTPU_INIT_ARGS when this process loaded libtpu


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
    schedule: the tpu_schedule.Schedule read (per-op detail, e.g. `schedule.expanded()`);
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
    kinds = {d.device_kind for d in mesh.devices.flat}
    profile = next((g.profile for g in GENERATIONS.values() if g.device_kind in kinds),
                   "tpu-v4")
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

def model_step(model: str, mesh, *, layers: int = 1, batch: int | None = None,
               seq: int | None = None, dtype: str = "bfloat16"):
  """The GPT-style training step (meshslice.gpt: attention + MLP layers, scan over
  checkpointed blocks, fwd + bwd + SGD) at the size of `model` ("gpt3", "megatron": see
  meshslice.costmodel.model_spec), on `mesh` (axes "x", "y"), with abstract inputs.

  batch: sequences per step (default: one per device; tpu7x: per TensorCore). seq:
  tokens per sequence (default: the model's). Returns (step, params, batch).
  """
  import jax
  from jax.sharding import NamedSharding
  from . import gpt
  from meshslice.costmodel import model_spec
  spec = model_spec(model, seq=seq)
  n = math.prod(dict(mesh.shape).values())     # a Mesh or an AbstractMesh
  cfg = gpt.ModelConfig(layers=layers, batch=batch or n, seq=spec.seq, hidden=spec.hidden,
                        heads=spec.heads, ffn=4 * spec.hidden, dtype=dtype)
  row, col = mesh.axis_names[-2:]
  ps = jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.param_specs(row, col))
  bs = jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.batch_specs(row, col))
  params = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
  data = jax.eval_shape(lambda: gpt.init_batch(cfg, jax.random.key(0)))
  return gpt.make_step(cfg, mesh), abstract_args(params, ps), abstract_args(data, bs)


def compare(model: str, topology: str | None = None, mesh_shape=None, *, layers: int = 1,
            batch: int | None = None, variants=("plain", "meshslice"), echo=None,
            topology_name_: str | None = None, seq: int | None = None, **options) -> dict:
  """Compile the model's step (`model_step`) on a TPU topology's `mesh_shape` mesh plain
  and meshslice-transformed (`options` go to meshslice.transform; profile defaults to
  the topology's) and analyze both.

  topology: a topology name such as "v4:2x2x2" (`topology_name_`: its old spelling,
    still accepted as a keyword).
  seq: tokens per sequence (default: the model's, 2048).
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
  step, params, data = model_step(model, mesh, layers=layers, batch=batch, seq=seq)
  out = {}
  for variant in variants:
    if variant == "plain":
      fn = step
    elif variant == "meshslice":
      fn = transform(step, **options)
      if echo is not None:
        import jax
        with jax.set_mesh(mesh):
          echo(str(fn.explain(params, data)))
    else:
      raise ValueError(f"variant must be 'plain' or 'meshslice', got {variant!r}")
    compiled, seconds = compile(fn, params, data, mesh=mesh)
    out[variant] = analyze(compiled, options["profile"], compile_s=seconds,
                           mesh_shape=mesh_shape)
    del compiled
  return out


# ----------------------------------------------------------------------------- variants

# The programs compared, each under its own libtpu flags (presets of `preset_flags`):
# XLA's plain and dense programs with libtpu defaults and with the async flags the
# rewrite gets, and the rewrite. The headline is the rewrite against the best of the four.
VARIANTS = {   # name: (meshslice.transform?, flag presets)
    "plain": (False, ("default",)), "dense": (False, ("dense",)),
    "plain_async": (False, ("async",)), "dense_async": (False, ("dense", "async")),
    "meshslice": (True, ("async",)),
    # the rewrite with windowed einsum off too: the sites it leaves to XLA run XLA's
    # dense program, and the planner prices them so (the rival with the same flags is
    # dense_async)
    "meshslice_dense": (True, ("dense", "async")),
}
XLA_VARIANTS = ("plain", "dense", "plain_async", "dense_async")


def variant_flags(variant: str, generation: str | None, async_presets: str = "async") -> tuple:
  """The libtpu flags `variant` (a `VARIANTS` name) compiles with on `generation`, its
  async part from `async_presets` (preset names, comma-separated)."""
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
  names = [n for p in VARIANTS[variant][1]
           for n in (async_presets.split(",") if p == "async" else [p])]
  return preset_flags(names, generation)


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


# ----------------------------------------------------------------------------- moved

# The `aot` CLI moved to aot_cli, which imports this module; its names resolve there on
# first use (PEP 562) so that `aot.main` / `aot.format_table` keep working while
# importing aot neither loads the CLI nor closes an import cycle.
_MOVED_TO_CLI = ("format_table", "main", "_ROWS", "_variant_worker")


def __getattr__(name: str):
  if name in _MOVED_TO_CLI:
    import importlib
    return getattr(importlib.import_module(".aot_cli", __package__), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
