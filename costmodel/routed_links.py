"""A second link model for compiled TPU programs: every collective routed over the torus.

`tpu_schedule.simulate` times each collective with the project's alpha-beta model
(`timing.collective_time`: per mesh axis, a bandwidth, a hop latency and an overhead).
This module is an independent model of the same collectives, built on the devices'
physical torus coordinates instead of mesh axes: each collective's bytes are routed over
the directed chip-to-chip links they use, and the busiest link sets its time. It plugs
into the same walk of the schedule:

  RoutedLinks(devices, profile).seconds(op)      -> seconds of one collective
  RoutedLinks(...).route(op)                     -> RoutedCollective: the per-link loads
  simulate(schedule, profile, collective_time=RoutedLinks(devices, profile).seconds)
  simulate_routed(text_or_schedule, devices, profile) -> the same, Simulation.model
                                                     "routed-links"

Devices. Partition i of a program is the i-th device of its device assignment; for a
program jitted over a `jax.sharding.Mesh` that is `mesh.devices.flat[i]` (checked on
libtpu 0.0.42.1, v4:2x2x2: the compiled executable's device list is the mesh's devices
in mesh order). `devices` is that sequence (or the Mesh itself): jax TPU devices (their
`.coords` and `.core_on_chip`), or plain chip coordinates `(x, y, z)`, or `((x, y, z),
core)`. On v4 / v5p "megacore" one device is one chip; where a chip holds two devices
(TPU7x: equal coords, `core_on_chip` 0 and 1) a transfer between them is on-chip: no
link, no hop.

Torus. `Torus(shape, wrap)`: the extent of each torus dim (default: the largest
coordinate + 1 over the given devices) and whether it has wraparound links (default:
the profile's rule, `Topology.wrap_min_length` / `wrap_min_chips`, as
`costmodel.topology` applies it: on v4 / v5p a dim of 4 or more in a slice of at least
64 chips, i.e. of whole 4x4x4 cubes; on v5e / v6e the 16 side of a full 16x16). Each
directed link is named `(chip coords, dim, +1 or -1)`: the link leaving that chip along
that dim.

Routing (dimension-ordered, shortest way round). A transfer from chip a to chip b moves
along dim 0 until its coordinate matches, then dim 1, then dim 2. On a dim with
wraparound it goes the shorter way round (`d = (b - a) mod n` hops forward or `n - d`
back); a tie (`d = n / 2`) sends half the bytes each way. Without wraparound it goes
straight, `|b - a|` hops. Every link of the route carries the transfer's bytes.

Collectives (n devices in a group; every group of the collective at once, their loads
added link by link; `bytes` is the result's size, `CompiledOp.bytes`):

  all-gather, reduce-scatter, all-reduce: rings.
    one ring (default): the group's devices in the order the replica group lists them,
      closed back to the first. Each of the n - 1 steps (2 (n - 1) for an all-reduce:
      a reduce-scatter then an all-gather) every member sends a chunk to the next member;
      bidirectional (default): half of it to the next, half to the previous member.
      Chunk: bytes / n (all-gather, all-reduce), bytes (reduce-scatter: its result is
      one shard). A member pair several hops apart loads every link of its route.
    N-D rings: when libtpu's emitter drives several torus dims (`CompiledOp.ring_dims`
      >= 2: "2DAllGather...", "UniDirectionNDRingStrategy{... cores:{4 4}}",
      "StrategyND"; tpu_schedule reads them) and the group is a full box over that many
      dims: the data is split into k equal parts (k = the dims the group spans), part j
      gathers along the dims in the rotated order j, j+1, ... (one phase per dim, its
      rings the members that differ only along that dim, in coordinate order, each
      phase moving the data gathered so far, so later phases move more); two cores of a
      chip exchange last, free. A reduce-scatter is the same traffic run backwards, an
      all-reduce both.
    core pairs: a group that holds both cores of each of its chips (a box over chips x
      cores, e.g. a TPU7x mesh axis over core pairs; libtpu's emitter reads
      "SparseCoreOffload{... +core pair}") runs as N-D rings over its chip dims (1D
      emitters: one), the cores exchanging on-chip, last, free.
    (`use_emitter=False`: always one ring in group order.)
  all-to-all: each member sends bytes / n to every other member, routed as above.
  collective-permute: each (source, target) pair sends `bytes`, routed as above.

Time of one collective:

    seconds = fixed_s + hop_s * hop_steps + max over directed links (bytes on it) / L

  L: one-way bandwidth of one link, the profile's `topology.link_bandwidth` (tpu-v4 45e9
    B/s, Jouppi et al., ISCA 2023; v5e 5e10, v5p 1e11, v6e 1e11, v7x 1e11:
    costmodel/profiles; `link_bandwidth=` for a profile without one); no efficiency
    factor (the alpha-beta model's calibration is what this one is meant to be checked
    against).
  fixed_s: per-collective cost, default 10 us; hop_s: per link hop, default 1 us
    (DESIGN.md section 5: about 1 us per ICI hop; the independent model of DESIGN.md
    "Facts added December 2026" used 10 us + 1 us per ring step).
  hop_steps: for rings, the sum over the ring steps (of every phase) of the longest route
    of that step in hops (n - 1 for a ring of neighbours, 2 (n - 1) when they are two
    hops apart); for an all-to-all and a permute, one step: its longest route.

Caveats: all the devices of a collective's groups run it at once, and different
collectives never share a link in this model (the simulator's walk queues them on its
two mesh-axis link streams, as for the alpha-beta model); libtpu's ring orders on a
multi-dim axis with a 1D emitter are not printed, the group order is used; every ring
is taken as bidirectional (`bidirectional=False`: one way), including libtpu's
"StrategyRing{colors:1}", which may be one way; one slice only (no DCN).

Example (four chips around one torus dim of 4 with wraparound; an all-gather of a 1 MiB
result, 256 KiB a member: 3 steps, each link carrying half a shard per step):

  >>> torus = Torus(shape=(4,), wrap=(True,))
  >>> model = RoutedLinks([(0,), (1,), (2,), (3,)], "tpu-v4", torus=torus)
  >>> from meshslice.costmodel.tpu_schedule import CompiledOp
  >>> op = CompiledOp(name="ag", opcode="all-gather", kind="collective", bytes=2**20,
  ...                 collective="all-gather", group=(0, 1, 2, 3))
  >>> r = model.route(op)
  >>> r.busiest_bytes == 3 * 2**18 / 2, r.hop_steps
  (True, 3)
  >>> round(r.seconds * 1e6, 3)           # 10 + 3 x 1 + 393216 B / 45e9 B/s (8.738 us)
  21.738
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Sequence

from .profiles import HardwareProfile, load_profile

MODEL = "routed-links"
DEFAULT_FIXED_S = 10e-6       # per collective
DEFAULT_HOP_S = 1e-6          # per link hop of a step's longest route

Link = tuple  # (chip coords, dim, +1 | -1): the directed link leaving that chip


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Torus:
  """The physical network: `shape[d]` chips along torus dim d, `wrap[d]` when that dim
  has wraparound links.

  Example:
    >>> t = Torus(shape=(4, 2), wrap=(True, False))
    >>> t.route((0, 0), (3, 1))              # back round the wrap, then along dim 1
    ((1.0, (((0, 0), 0, -1), ((3, 0), 1, 1))),)
    >>> [w for w, _ in t.route((0, 0), (2, 0))]     # a tie: half the bytes each way
    [0.5, 0.5]
  """

  shape: tuple[int, ...]
  wrap: tuple[bool, ...]

  def __post_init__(self):
    shape = tuple(int(v) for v in self.shape)
    wrap = tuple(bool(v) for v in self.wrap)
    if len(wrap) != len(shape) or any(v < 1 for v in shape):
      raise ValueError(f"Torus: shape {shape} needs one positive extent per dim and wrap "
                       f"{wrap} one flag per dim")
    object.__setattr__(self, "shape", shape)
    object.__setattr__(self, "wrap", wrap)

  def moves(self, dim: int, delta: int) -> tuple[tuple[float, int, int], ...]:
    """(weight, direction, hops) ways to cover `delta` along `dim`: the shorter way round
    with wraparound (both, half each, on a tie), else straight."""
    if delta == 0:
      return ()
    n = self.shape[dim]
    if not self.wrap[dim]:
      return ((1.0, 1 if delta > 0 else -1, abs(delta)),)
    ahead = delta % n
    back = n - ahead
    if ahead < back:
      return ((1.0, 1, ahead),)
    if back < ahead:
      return ((1.0, -1, back),)
    return ((0.5, 1, ahead), (0.5, -1, back))

  def route(self, a: Sequence[int], b: Sequence[int]) -> tuple[tuple[float, tuple], ...]:
    """The weighted paths from chip a to chip b (dimension order, module docstring):
    ((weight, (link, ...)), ...), weights summing to 1; () when a == b."""
    a, b = tuple(a), tuple(b)
    if a == b:
      return ()
    paths: list[tuple[float, tuple, tuple]] = [(1.0, (), a)]
    for d in range(len(self.shape)):
      options = self.moves(d, b[d] - a[d])
      if not options:
        continue
      grown = []
      for weight, links, at in paths:
        for share, step, hops in options:
          here, walked = list(at), list(links)
          for _ in range(hops):
            walked.append((tuple(here), d, step))
            here[d] = (here[d] + step) % self.shape[d]
          grown.append((weight * share, tuple(walked), tuple(here)))
      paths = grown
    return tuple((w, links) for w, links, _ in paths)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
  """Where each partition runs: `coords[i]` the torus coordinates of partition i's chip,
  `cores[i]` its core on that chip; `torus` the network."""

  coords: tuple[tuple[int, ...], ...]
  cores: tuple[int, ...]
  torus: Torus


def _device_list(devices) -> list:
  if hasattr(devices, "devices") and hasattr(getattr(devices, "devices"), "flat"):
    return list(devices.devices.flat)          # a jax Mesh: mesh order
  return list(devices)


def _one(device) -> tuple[tuple[int, ...], int]:
  if hasattr(device, "coords"):
    if getattr(device, "slice_index", 0) not in (0, None):
      raise ValueError(f"routed_links covers one slice; device {device} is in slice "
                       f"{device.slice_index} (DCN links are not modelled)")
    return tuple(int(v) for v in device.coords), int(getattr(device, "core_on_chip", 0) or 0)
  item = tuple(device)
  if len(item) == 2 and not isinstance(item[0], (int,)) and hasattr(item[0], "__len__"):
    return tuple(int(v) for v in item[0]), int(item[1])
  return tuple(int(v) for v in item), 0


def placement(devices, profile: HardwareProfile | str | None = None, *,
              shape: Sequence[int] | None = None,
              wrap: Sequence[bool] | None = None) -> Placement:
  """The Placement of a program's partitions from its device assignment (module
  docstring: a jax Mesh, jax TPU devices, or coordinates), in partition order.

  shape: torus extents (default: the largest coordinate + 1 over `devices`).
  wrap: wraparound per dim (default: the profile topology's rule; no wraparound without
    a profile or topology).

  Example:
    >>> p = placement([(0, 0, 0), (1, 0, 0), (((0, 0, 0)), 1)], shape=(4, 4, 4),
    ...               wrap=(True, True, True))
    >>> p.coords[2], p.cores, p.torus.shape
    ((0, 0, 0), (0, 0, 1), (4, 4, 4))
  """
  items = [_one(d) for d in _device_list(devices)]
  if not items:
    raise ValueError("placement: no devices given; pass the program's device assignment "
                     "(for a Mesh, mesh.devices.flat)")
  dims = {len(c) for c, _ in items}
  if len(dims) != 1:
    raise ValueError(f"placement: devices have coordinates of different lengths {dims}")
  if shape is None:
    shape = tuple(max(c[d] for c, _ in items) + 1 for d in range(dims.pop()))
  shape = tuple(int(v) for v in shape)
  if wrap is None:
    if isinstance(profile, str):
      profile = load_profile(profile)
    topo = getattr(profile, "topology", None) if profile is not None else None
    if topo is not None and topo.kind == "torus":
      chips = math.prod(shape)
      wrap = tuple(chips >= topo.wrap_min_chips and n >= topo.wrap_min_length
                   for n in shape)
    else:
      wrap = (False,) * len(shape)
  for c, _ in items:
    if len(c) != len(shape) or any(not 0 <= v < n for v, n in zip(c, shape)):
      raise ValueError(f"placement: coordinates {c} lie outside the torus {shape}")
  return Placement(coords=tuple(c for c, _ in items), cores=tuple(k for _, k in items),
                   torus=Torus(shape=shape, wrap=tuple(wrap)))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoutedCollective:
  """One collective under the routed model.

  Attributes:
    seconds: latency_s + link_s.
    latency_s: fixed_s + hop_s * hop_steps.
    link_s: busiest_bytes / the link bandwidth.
    busiest_bytes: bytes over the busiest directed link; busiest_link its name
      ((chip coords, dim, +1 | -1); None when nothing crosses a link).
    hop_steps: sum over the steps of each step's longest route in hops.
    algorithm: "ring" (one ring, group order), "nd-ring" (one phase per torus dim),
      "all-to-all", "permute", or "" (nothing to move).
    loads: bytes per directed link.
  """

  seconds: float
  latency_s: float
  link_s: float
  busiest_bytes: float
  busiest_link: Any
  hop_steps: float
  algorithm: str
  loads: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass(frozen=True, slots=True)
class _Pattern:
  """What a collective's structure routes to, per byte of its unit (a shard, a pair's
  chunk, a permute's buffer; cached per structure), and its busiest link."""
  loads: dict                 # link -> load per unit byte
  hop_steps: float
  algorithm: str
  peak: float = 0.0
  peak_link: Any = None


def _pattern_of(loads: dict, hop_steps: float, algorithm: str) -> _Pattern:
  peak_link, peak = max(loads.items(), key=lambda kv: (kv[1], kv[0])) if loads else (None, 0.0)
  return _Pattern(loads=loads, hop_steps=hop_steps, algorithm=algorithm, peak=peak,
                  peak_link=peak_link)


class RoutedLinks:
  """The routed link model (module docstring) over one program's device assignment.

  Args:
    devices: the program's devices in partition order (a Mesh, jax devices, or
      coordinates; `placement`).
    profile: a HardwareProfile or its name: the link bandwidth (`topology.link_bandwidth`)
      and the wraparound rule.
    link_bandwidth: bytes/s one way over one link (default: the profile's).
    fixed_s, hop_s: per-collective and per-hop latency (defaults 10 us, 1 us).
    bidirectional: rings send half of each chunk each way round (default True).
    use_emitter: follow libtpu's multi-dim emitters (`CompiledOp.ring_dims` >= 2) with
      N-D rings (default True); False: every ring collective is one ring in group order.
    torus: a Torus overriding shape / wraparound derived from devices and profile.

  `name` ("routed-links") is the model's name in results (`Simulation.model`).
  """

  name = MODEL

  def __init__(self, devices, profile: HardwareProfile | str = "tpu-v4", *,
               link_bandwidth: float | None = None, fixed_s: float = DEFAULT_FIXED_S,
               hop_s: float = DEFAULT_HOP_S, bidirectional: bool = True,
               use_emitter: bool = True, torus: Torus | None = None):
    if isinstance(profile, str):
      profile = load_profile(profile)
    self.profile = profile
    kw = {} if torus is None else {"shape": torus.shape, "wrap": torus.wrap}
    self.placement = placement(devices, profile, **kw)
    if link_bandwidth is None:
      topo = getattr(profile, "topology", None)
      link_bandwidth = 0.0
      if topo is not None and topo.kind == "torus":
        link_bandwidth = topo.link_bandwidth
      if not link_bandwidth:
        raise ValueError(f"RoutedLinks: profile {profile.name!r} has no torus topology "
                         f"with a link_bandwidth; pass link_bandwidth= (bytes/s one way "
                         f"per link)")
    if link_bandwidth <= 0:
      raise ValueError(f"RoutedLinks: link_bandwidth must be > 0, got {link_bandwidth!r}")
    self.link_bandwidth = float(link_bandwidth)
    self.fixed_s, self.hop_s = float(fixed_s), float(hop_s)
    self.bidirectional, self.use_emitter = bool(bidirectional), bool(use_emitter)
    self._routes: dict = {}
    self._patterns: dict = {}

  # ----------------------------------------------------------------------- public

  def seconds(self, op) -> float:
    """Duration of one collective (a `tpu_schedule.CompiledOp`): the simulator's
    `collective_time` hook."""
    found = self._lookup(op)
    if found is None:
      return 0.0
    pattern, scale = found
    latency = self.fixed_s + self.hop_s * pattern.hop_steps if pattern.algorithm else 0.0
    return latency + pattern.peak * scale / self.link_bandwidth

  def route(self, op) -> RoutedCollective:
    """The collective routed over the links (RoutedCollective)."""
    found = self._lookup(op)
    if found is None:
      return RoutedCollective(seconds=0.0, latency_s=0.0, link_s=0.0, busiest_bytes=0.0,
                              busiest_link=None, hop_steps=0, algorithm="")
    pattern, scale = found
    loads = {link: load * scale for link, load in pattern.loads.items()}
    busiest = pattern.peak * scale
    latency = self.fixed_s + self.hop_s * pattern.hop_steps if pattern.algorithm else 0.0
    link_s = busiest / self.link_bandwidth
    return RoutedCollective(seconds=latency + link_s, latency_s=latency, link_s=link_s,
                            busiest_bytes=busiest, busiest_link=pattern.peak_link,
                            hop_steps=pattern.hop_steps, algorithm=pattern.algorithm,
                            loads=loads)

  def _lookup(self, op):
    """(the cached _Pattern of op's structure, bytes per unit), None for a group of one."""
    kind = op.collective
    if kind == "collective-permute":
      pairs = tuple(op.pairs) or ((tuple(op.group[:2]),) if len(op.group) >= 2 else ())
      key = (kind, pairs)
      scale = float(op.bytes)
    else:
      groups = tuple(op.groups) or ((tuple(op.group),) if op.group else ())
      n = len(op.group) or (len(groups[0]) if groups else 0)
      if n <= 1 or not groups:
        return None
      # -1: one ring in group order whatever libtpu chose (use_emitter=False)
      key = (kind, groups, op.ring_dims if self.use_emitter else -1)
      # per byte of: a shard (gather / scatter traffic), a pair's chunk (all-to-all)
      scale = float(op.bytes) if kind == "reduce-scatter" else op.bytes / n
    pattern = self._patterns.get(key)
    if pattern is None:
      pattern = self._patterns[key] = self._pattern(key)
    return pattern, scale

  # ----------------------------------------------------------------------- routing

  def _chip(self, partition: int):
    coords = self.placement.coords
    if not 0 <= partition < len(coords):
      raise ValueError(f"routed_links: partition {partition} has no device: "
                       f"{len(coords)} devices were given; pass the compiled program's "
                       f"device assignment in partition order (for a Mesh, "
                       f"mesh.devices.flat)")
    return coords[partition]

  def _paths(self, a: int, b: int):
    key = (a, b)
    found = self._routes.get(key)
    if found is None:
      found = self._routes[key] = self.placement.torus.route(self._chip(a), self._chip(b))
    return found

  def _send(self, loads: dict, a: int, b: int, weight: float) -> int:
    """Add `weight` over the route a -> b; its hops."""
    hops = 0
    for share, links in self._paths(a, b):
      hops = len(links)
      for link in links:
        loads[link] = loads.get(link, 0.0) + weight * share
    return hops

  def _ring(self, loads: dict, members: Sequence[int], weight: float) -> int:
    """One ring step, repeated `weight` times over: each member sends `weight` to the
    next member (half to the next, half to the previous when bidirectional); the step's
    longest route in hops."""
    n, longest = len(members), 0
    if n <= 1:
      return 0
    for i in range(n):
      a, b = members[i], members[(i + 1) % n]
      if self.bidirectional:
        longest = max(longest, self._send(loads, a, b, weight / 2),
                      self._send(loads, b, a, weight / 2))
      else:
        longest = max(longest, self._send(loads, a, b, weight))
    return longest

  def _pattern(self, key) -> _Pattern:
    kind = key[0]
    loads: dict = {}
    if kind == "collective-permute":
      hops = [self._send(loads, a, b, 1.0) for a, b in key[1] if a != b]
      return _pattern_of(loads, max(hops, default=0), "permute" if hops else "")
    groups, ring_dims = key[1], key[2]
    if kind == "all-to-all":
      longest = 0
      for group in groups:
        for a, b in itertools.permutations(group, 2):
          longest = max(longest, self._send(loads, a, b, 1.0))
      return _pattern_of(loads, longest, "all-to-all")
    # gather traffic per shard byte (a reduce-scatter runs it backwards: same loads)
    hop_steps, algorithm = 0.0, "ring"
    for group in groups:
      cores = len({self._key(p)[-1] for p in group}) > 1
      axes = self._box(group) if ring_dims >= 2 or (cores and ring_dims >= 0) else None
      chip_axes = [a for a in axes if a[0] != "core"] if axes else []
      if axes and (2 <= len(chip_axes) <= ring_dims or
                   (cores and len(chip_axes) <= max(1, ring_dims))):
        steps = self._nd_gather(loads, group, axes)
        algorithm = "nd-ring"
      else:
        n = len(group)
        steps = (n - 1) * self._ring(loads, group, float(n - 1))
      hop_steps = max(hop_steps, steps)
    if kind == "all-reduce":             # a reduce-scatter, then an all-gather
      loads = {link: 2 * load for link, load in loads.items()}
      hop_steps *= 2
    elif kind not in ("all-gather", "reduce-scatter"):
      raise ValueError(f"routed_links: unknown collective {kind!r}")
    return _pattern_of(loads, hop_steps, algorithm)

  def _key(self, partition: int) -> tuple[int, ...]:
    return self._chip(partition) + (self.placement.cores[partition],)

  def _box(self, group):
    """The axes a group spans, [(axis, sorted values), ...] (axis a torus dim, or "core"
    for the core on a chip), when the group is every combination of them (a box);
    else None."""
    keys = [self._key(p) for p in group]
    width = len(keys[0])
    axes = []
    for d in range(width):
      values = sorted({k[d] for k in keys})
      if len(values) > 1:
        axes.append(("core" if d == width - 1 else d, values))
    if math.prod(len(v) for _, v in axes) != len(set(keys)) or len(set(keys)) != len(keys):
      return None
    return axes

  def _nd_gather(self, loads: dict, group, axes) -> float:
    """N-D rings: the data in k parts, part j gathering along the chip axes from the
    j-th on, round, then across the cores of a chip; loads per shard byte added to
    `loads`; the hop steps of the slowest part."""
    width = len(self._key(group[0]))
    index = {a: (width - 1 if a == "core" else a) for a, _ in axes}
    chip = [a for a in axes if a[0] != "core"]
    core = [a for a in axes if a[0] == "core"]
    k = max(1, len(chip))
    worst = 0.0
    for j in range(k):
      order = chip[j:] + chip[:j] + core
      gathered, steps = 1, 0.0
      for axis, values in order:
        size = len(values)
        d = index[axis]
        rings: dict = {}
        for p in group:
          key = self._key(p)
          rings.setdefault(key[:d] + key[d + 1:], []).append((key[d], p))
        longest = 0
        for members in rings.values():
          ordered = [p for _, p in sorted(members)]
          longest = max(longest, self._ring(loads, ordered, gathered * (size - 1) / k))
        steps += (size - 1) * longest
        gathered *= size
      worst = max(worst, steps)
    return worst


def simulate_routed(schedule, devices, profile: HardwareProfile | str = "tpu-v4", *,
                    clock_hz: float | None = None, **options):
  """`tpu_schedule.simulate` with every collective timed by the routed model
  (`RoutedLinks(devices, profile, **options).seconds`); `Simulation.model` is
  "routed-links".

  Args:
    schedule: compiled HLO text or a `tpu_schedule.CompiledSchedule`.
    devices: the program's device assignment in partition order (for a program jitted
      over a Mesh: the mesh, or `mesh.devices.flat`).

  Example:
    >>> mesh = aot.make_mesh("v4:2x2x2", (2, 4))                      # doctest: +SKIP
    >>> simulate_routed(compiled.as_text(), mesh, "tpu-v4").step_s    # doctest: +SKIP
  """
  from . import tpu_schedule
  if isinstance(profile, str):
    profile = load_profile(profile)
  model = RoutedLinks(devices, profile, **options)
  if isinstance(schedule, str):
    schedule = tpu_schedule.read_schedule(schedule, chip=profile.name)
  if schedule.num_partitions > len(model.placement.coords):
    raise ValueError(f"simulate_routed: the program has {schedule.num_partitions} "
                     f"partitions but {len(model.placement.coords)} devices were given")
  return tpu_schedule.simulate(schedule, profile, clock_hz=clock_hz,
                               collective_time=model.seconds, model=MODEL)
