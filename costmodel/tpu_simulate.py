"""Predict the step time of a compiled TPU program from its schedule.

  simulate(schedule, profile) -> Simulation: the predicted step time, and every wait of
                                 the compute stream on communication (`Wait`)
  collective_seconds(op, profile, axis_dims)  one collective under the project's model
  axis_torus_dims(profile, mesh_shape)        the `axis_dims` of a mesh
  link_mesh_shape(mesh_shape)                 the (dim 0, dim 1) shape the links are for

Why a module of its own: the prediction is a model laid over what `tpu_read` reads, and
it changes for other reasons than the reader does (link models, clocks, how waits are
counted; `routed_links` hands in a second link model). It imports the reader;
`tpu_schedule` re-exports both under the old names.

Simulation (`simulate`). One compute stream, and per profile dim (0, 1) two link
streams, one per direction round the axis's rings (ICI links are full duplex):

  compute op      t += cycles / clock_hz
  sync collective starts when the chip reaches it and its links are free; t = its end
  async start     starts when the chip reaches it and its links are free (t unchanged)
  async done      t = max(t, end of its collective)

A ring collective (bidirectional rings, as libtpu runs them) holds both directions of its
dim; a collective-permute that shifts every partition the same way round its ring (+1 or
-1: what XLA's bidirectional windowed einsum issues in pairs) holds one
(`link_streams`), so the two halves of such a pair move at once, as they do on the
torus, instead of one after the other.

Collective durations come from the project's ICI model (`timing.collective_time`,
`permute_time`, `all_reduce_time` with the profile's bandwidths, hop latencies and
overheads); a collective's link is profile dim 1 when its replica group is made of
consecutive partitions (the minor mesh axis), else dim 0; a collective-permute's, when
every set of partitions its source/target pairs connect is consecutive (shifts along
the minor axis in either direction), else dim 0. Loops run their body trip-count
times. Compute cycles are the compiler's (or FLOP-derived: `tpu_read`).

Links per collective. A collective gets the share of its mesh axis's bandwidth that the
algorithm libtpu chose for it drives (`CompiledOp.ring_dims`, read by `tpu_read`; the
measurements are in docs/tpu.md), given `axis_dims` (`axis_torus_dims`); see
`collective_seconds`.
"""
from __future__ import annotations

import dataclasses
import math

from .profiles import HardwareProfile, load_profile
from .timing import all_reduce_time, collective_time, permute_time
from .tpu_read import CLOCK_HZ, CompiledOp, CompiledSchedule, Loop, read_schedule
# The chip table is the reader's (its FLOP fallback needs the FLOPs per cycle); the
# clock's twin is importable here too, beside the clock this module reads.
from .tpu_read import FLOPS_PER_CYCLE  # noqa: F401  (re-exported beside CLOCK_HZ)


def link_mesh_shape(mesh_shape) -> tuple[int, ...]:
  """The mesh shape to derive a profile's two dims for (`profile_for_mesh`,
  `axis_torus_dims`) when simulating a program compiled on `mesh_shape`. The reader puts
  a collective whose group is consecutive device ids on dim 1 (`CompiledOp.link`): the
  minor axis' groups, unless the minor axis has size 1, when they are the major axis',
  so such a mesh is read as (1, rows). Without this a one-axis (pure fsdp) mesh's
  collectives were priced on the size-1 axis' links: on MaxText's 22B on 64 v4 chips,
  2.53 s of all-reduces a step instead of 0.47 s (docs/benchmarks.md, "Anchored on v4
  too").

  Example:
    >>> link_mesh_shape((64, 4)), link_mesh_shape((64, 1)), link_mesh_shape((1, 64))
    ((64, 4), (1, 64), (1, 64))
  """
  shape = tuple(int(v) for v in mesh_shape)
  if len(shape) == 2 and shape[1] == 1:
    return (1, shape[0])
  return shape


def axis_torus_dims(profile: HardwareProfile, mesh_shape) -> tuple[int, int] | None:
  """How many torus dims mesh axes 0 and 1 span on the profile's topology (placed as
  `profile_for_mesh` places them): the `axis_dims` of `simulate`. None for profiles
  without a torus topology, or meshes of one axis.

  Example:
    >>> v4 = load_profile("tpu-v4")
    >>> axis_torus_dims(v4, (64, 4)), axis_torus_dims(v4, (2, 4))
    ((2, 1), (1, 2))
  """
  topology = getattr(profile, "topology", None)
  mesh_shape = tuple(int(v) for v in mesh_shape)
  if topology is None or topology.kind != "torus" or len(mesh_shape) < 2:
    return None
  from .topology import assign_axes, chip_mesh_shape
  # two devices per chip (tpu-v7x): the torus places chips; an axis that is only the
  # pair of cores of a chip spans no torus dim and counts as one
  try:
    chip_shape = chip_mesh_shape(profile, mesh_shape)
  except ValueError:          # no axis holds a chip's devices: placed as chips
    chip_shape = mesh_shape
  dims = assign_axes(topology, chip_shape)
  return tuple(max(1, len(d)) for d in dims[:2])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
  """The predicted step of a scheduled program (seconds, per device).

  Attributes:
    step_s: predicted wall time of one execution.
    compute_s: compute cycles / clock (the compute stream's busy time).
    collective_s: sum of all collective durations (as if nothing overlapped).
    sync_collective_s: the part of collective_s spent in synchronous collectives.
    exposed_s: step_s - compute_s: communication (and link contention) not hidden.
    clock_hz: the clock used.
    profile: name of the hardware profile of the collective model.
    waits: every moment the compute stream waited on communication, in program order
      (`Wait`): their `waited_s` sum to exposed_s. `exposed_by()` groups them.
    model: the link model that timed the collectives: "alpha-beta" (the project's
      per-mesh-axis model, `collective_seconds`) or the name `simulate` was given with
      its `collective_time` (`routed_links.MODEL`: "routed-links").
  """

  step_s: float
  compute_s: float
  collective_s: float
  sync_collective_s: float
  exposed_s: float
  clock_hz: float
  profile: str
  waits: tuple = ()
  model: str = "alpha-beta"

  @property
  def async_collective_s(self) -> float:
    """The part of collective_s spent in asynchronous collectives (start / done pairs)."""
    return self.collective_s - self.sync_collective_s

  @property
  def sync_exposed_s(self) -> float:
    """The part of exposed_s the chip stood still in synchronous collectives (their own
    time, and any wait for their link to free)."""
    return sum(w.waited_s for w in self.waits if w.sync)

  @property
  def async_exposed_s(self) -> float:
    """The part of exposed_s spent at async dones whose collective had not finished: the
    share of the async collectives that the compute scheduled under them did not hide.
    With `sync_exposed_s` it sums to exposed_s.

    Example (one sync gather of 2 ms, one async gather of 4 ms that 3 ms of compute
    half hides):
      >>> waits = (Wait(name="a", collective="all-gather", sync=True, group_size=4, link=1,
      ...               bytes=1, seconds=2e-3, waited_s=2e-3),
      ...          Wait(name="b", collective="all-gather", sync=False, group_size=4,
      ...               link=1, bytes=1, seconds=4e-3, waited_s=1e-3, between_s=3e-3))
      >>> sim = Simulation(step_s=6e-3, compute_s=3e-3, collective_s=6e-3,
      ...                  sync_collective_s=2e-3, exposed_s=3e-3, clock_hz=1e9,
      ...                  profile="p", waits=waits)
      >>> round(sim.async_collective_s * 1e3, 6), round(sim.async_exposed_s * 1e3, 6)
      (4.0, 1.0)
    """
    return sum(w.waited_s for w in self.waits if not w.sync)

  def figures(self) -> dict:
    """The simulation as one JSON-able record (seconds), as the benchmarks write it: step,
    compute, exposed and its sync / async split, collective time and its sync / async
    split, and `exposed_by()`."""
    return {"model": self.model, "step_s": self.step_s, "compute_s": self.compute_s,
            "exposed_s": self.exposed_s, "sync_exposed_s": self.sync_exposed_s,
            "async_exposed_s": self.async_exposed_s, "collective_s": self.collective_s,
            "sync_collective_s": self.sync_collective_s,
            "async_collective_s": self.async_collective_s,
            "exposed_by": [list(g) for g in self.exposed_by()]}

  def exposed_by(self, top: int | None = None) -> list[tuple[str, float, int]]:
    """Where the exposed time goes: (`Wait.label`, seconds waited, how many waits) per
    label, largest first; the first `top` of them when given.

    Example (an all-gather waited on right after it is issued):
      >>> w = Wait(name="ag", collective="all-gather", sync=False, group_size=4, link=1,
      ...          bytes=2**20, seconds=2e-3, waited_s=2e-3, between_s=0.0)
      >>> Simulation(step_s=3e-3, compute_s=1e-3, collective_s=2e-3, sync_collective_s=0,
      ...            exposed_s=2e-3, clock_hz=1e9, profile="p", waits=(w,)).exposed_by()
      [('async all-gather n=4 link 1', 0.002, 1)]
    """
    groups: dict[str, list] = {}
    for w in self.waits:
      g = groups.setdefault(w.label, [0.0, 0])
      g[0] += w.waited_s
      g[1] += 1
    ranked = sorted(((k, v[0], v[1]) for k, v in groups.items()), key=lambda r: (-r[1], r[0]))
    return ranked if top is None else ranked[:top]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
  """One stall of the compute stream on communication (`Simulation.waits`).

  Attributes:
    name: the collective (for an async pair, its start; for a collective-permute, the op).
    collective: its kind ("all-gather", ...).
    sync: True for a synchronous collective (the chip waits from issue, including for
      its link to be free); False for an async done that found its collective unfinished.
    group_size, link, bytes: as on `CompiledOp` (link: the profile dim it travels on).
    seconds: the collective's modelled duration.
    waited_s: how long the compute stream stood still for it.
    between_s: for an async pair, the compute time the schedule put between its start and
      done (what it was meant to hide under); 0 for a sync collective.
  """

  name: str
  collective: str
  sync: bool
  group_size: int
  link: int
  bytes: int
  seconds: float
  waited_s: float
  between_s: float = 0.0

  @property
  def label(self) -> str:
    return (f"{'sync' if self.sync else 'async'} {self.collective} n={self.group_size} "
            f"link {self.link}")


def collective_seconds(op: CompiledOp, profile: HardwareProfile, axis_dims=None) -> float:
  """Duration of one collective op under the project's ICI model (timing.py).

  axis_dims: per profile dim, how many torus dims the profile's bandwidth for that dim
    sums (`profile_for_mesh` adds the links of every torus dim a mesh axis spans;
    `aot.analyze` passes the counts for its mesh). Given, a collective whose algorithm
    drives fewer dims (`op.ring_dims`, from libtpu's emitter / strategy) gets that share
    of the bandwidth: a 1D ring on an axis over two torus dims moves at half the axis's
    summed rate. Latencies and overheads are unchanged; permutes are not scaled.

  Example (a 1D all-gather on an axis that spans two torus dims):
    >>> p = load_profile("tpu-v4")
    >>> op = CompiledOp(name="ag", opcode="all-gather", kind="collective", bytes=4 * 2**21,
    ...                 collective="all-gather", group=(0, 1, 2, 3), link=1, ring_dims=1)
    >>> full, one = collective_seconds(op, p), collective_seconds(op, p, (1, 2))
    >>> round((one - 13e-6 - 15e-6) / (full - 13e-6 - 15e-6), 6)
    2.0
  """
  n = op.group_size
  if op.collective == "collective-permute":
    return permute_time(profile, op.link, op.bytes)
  if n <= 1:
    return 0.0
  share = 1.0
  if axis_dims and op.ring_dims:
    spanned = axis_dims[min(op.link, len(axis_dims) - 1)] or 0
    if spanned > op.ring_dims:
      share = op.ring_dims / spanned
  nbytes = op.bytes / share          # bytes / (bandwidth * share)
  if op.collective == "all-gather" or op.collective == "all-to-all":
    return collective_time(profile, "all_gather", op.link, n, nbytes / n)
  if op.collective == "reduce-scatter":
    return collective_time(profile, "reduce_scatter", op.link, n, nbytes)
  if op.collective == "all-reduce":
    if len(op.ring_cores) > 1 and math.prod(op.ring_cores) == n:
      # an N-D strategy: one all-reduce phase per torus dim, each over that dim's ring
      # on what the phases before it left (the same bytes on the wire as one ring, far
      # fewer hops: a 256-chip scalar psum crosses 8 + 8 + 4 rings, not one of 256)
      total, left = 0.0, nbytes
      for size in op.ring_cores:
        total += all_reduce_time(profile, op.link, size, left)
        left /= size
      return total
    return all_reduce_time(profile, op.link, n, nbytes)
  return 0.0


def link_streams(op: CompiledOp) -> tuple[tuple[int, int], ...]:
  """The link streams a collective holds while it moves: (profile dim, direction) pairs,
  direction +1 or -1 round the dim's rings. A collective-permute whose pairs all shift
  the same way round their rings (the sets of partitions they connect, in id order) holds
  that one direction; every other collective (rings run both ways) holds both.

  Example (4 partitions in a ring, minor axis):
    >>> fwd = CompiledOp(name="p", opcode="collective-permute-start", kind="start",
    ...                  collective="collective-permute", link=1,
    ...                  pairs=((0, 1), (1, 2), (2, 3), (3, 0)))
    >>> bwd = dataclasses.replace(fwd, pairs=((0, 3), (1, 0), (2, 1), (3, 2)))
    >>> link_streams(fwd), link_streams(bwd)
    (((1, 1),), ((1, -1),))
    >>> link_streams(dataclasses.replace(fwd, collective="all-gather", pairs=()))
    ((1, 1), (1, -1))
  """
  both = ((op.link, 1), (op.link, -1))
  if op.collective != "collective-permute" or not op.pairs:
    return both
  parent: dict = {}

  def find(a):
    while parent.setdefault(a, a) != a:
      a = parent[a]
    return a
  for a, b in op.pairs:
    parent[find(a)] = find(b)
  rings: dict = {}
  for a in parent:
    rings.setdefault(find(a), []).append(a)
  position = {a: (i, len(ring)) for ring in rings.values()
              for i, a in enumerate(sorted(ring))}
  shifts = set()
  for a, b in op.pairs:
    (i, n), (j, _) = position[a], position[b]
    step = (j - i) % n
    shifts.add(1 if step == 1 else -1 if step == n - 1 else 0)
  if len(shifts) == 1 and 0 not in shifts:
    return ((op.link, shifts.pop()),)
  return both


def simulate(schedule: CompiledSchedule | str, profile: HardwareProfile | str = "tpu-v4", *,
             clock_hz: float | None = None, axis_dims=None, collective_time=None,
             model: str | None = None) -> Simulation:
  """Walk the schedule: compiler cycles on one compute stream, collectives on link streams
  per profile dim and direction (`link_streams`); async collectives overlap what runs
  between start and done, sync ones add (module docstring).

  profile: a HardwareProfile or a profile name (`load_profile`); its collective numbers
  time the collectives, its name picks the clock (CLOCK_HZ) unless clock_hz is given.
  axis_dims: torus dims summed in each profile dim's bandwidth (`collective_seconds`):
  collectives are priced by the algorithm libtpu chose for them; None: every collective
  gets its axis's full bandwidth.
  collective_time: a callable(CompiledOp) -> seconds timing each collective instead of
  the project's model (`collective_seconds`; profile and axis_dims then only pick the
  clock), e.g. `routed_links.RoutedLinks(devices, profile).seconds`; the walk, the link
  streams and the waits are the same. model: the name it is reported under
  (`Simulation.model`; default "alpha-beta" without collective_time, else "custom").

  Example:
    >>> sim = simulate(compiled.as_text(), "tpu-v4")               # doctest: +SKIP
    >>> sim.step_s, sim.exposed_s                                   # doctest: +SKIP
  """
  if isinstance(profile, str):
    profile = load_profile(profile)
  if isinstance(schedule, str):
    schedule = read_schedule(schedule, chip=profile.name)
  if clock_hz is None:
    if profile.name not in CLOCK_HZ:
      raise ValueError(f"simulate: no TPU clock known for profile {profile.name!r} "
                       f"(known: {sorted(CLOCK_HZ)}); pass clock_hz=")
    clock_hz = CLOCK_HZ[profile.name]
  state = {"t": 0.0, "links": {}, "pending": {}, "compute": 0.0,
           "comm": 0.0, "sync": 0.0, "waits": [], "timer": collective_time}
  if model is None:
    model = "alpha-beta" if collective_time is None else "custom"
  _run(schedule.entries, state, profile, clock_hz, axis_dims)
  # collectives still in flight when the program ends (no done read): the step waits
  for end, wait in sorted(state["pending"].values(), key=lambda v: v[0]):
    if end > state["t"]:
      state["waits"].append(dataclasses.replace(wait, waited_s=end - state["t"]))
      state["t"] = end
  t = state["t"]
  return Simulation(step_s=t, compute_s=state["compute"], collective_s=state["comm"],
                    sync_collective_s=state["sync"], exposed_s=max(0.0, t - state["compute"]),
                    clock_hz=clock_hz, profile=profile.name, waits=tuple(state["waits"]),
                    model=model)


def _run(entries, state, profile, clock_hz, axis_dims=None):
  for e in entries:
    if isinstance(e, Loop):
      for _ in range(e.trip_count):
        _run(e.body, state, profile, clock_hz, axis_dims)
      continue
    if e.kind in ("collective", "start"):
      timer = state.get("timer")
      seconds = timer(e) if timer else collective_seconds(e, profile, axis_dims)
      streams = link_streams(e)
      begin = max([state["t"]] + [state["links"].get(k, 0.0) for k in streams])
      end = begin + seconds
      for k in streams:
        state["links"][k] = end
      state["comm"] += seconds
      wait = Wait(name=e.name, collective=e.collective, sync=e.kind == "collective",
                  group_size=e.group_size, link=e.link, bytes=e.bytes, seconds=seconds,
                  # an async pair's wait is known only at its done
                  waited_s=end - state["t"] if e.kind == "collective" else 0.0,
                  between_s=0.0 if e.kind == "collective" else e.between_cycles / clock_hz)
      if e.kind == "collective":
        state["sync"] += seconds
        if end > state["t"]:
          state["waits"].append(wait)
        state["t"] = end
      else:
        state["pending"][e.partner or e.name] = (end, wait)
    elif e.kind == "done":
      end, wait = state["pending"].pop(e.name, (state["t"], None))
      if end > state["t"]:
        state["waits"].append(dataclasses.replace(wait, waited_s=end - state["t"]))
        state["t"] = end
    elif e.cycles:
      seconds = e.cycles / clock_hz
      state["t"] += seconds
      state["compute"] += seconds
