"""Per-axis bandwidth from the interconnect's geometry and the mesh's device assignment.

A profile's collective numbers are given per *profile dim* (0, 1). When the profile
also describes its interconnect (`Topology`), `profile_for_mesh(profile, mesh_shape,
axes)` works out, for one mesh shape, how each mesh axis lies on the physical network
and returns a profile whose dim 0 / dim 1 are the two chosen mesh axes with bandwidths
derived from that placement (latencies and per-call overheads are kept).

Torus (TPU v4 / v5p: 3D, TPU v5e / v6e: 2D). The slice of P chips is a physical box
(`physical_shape`: the most cubic factorisation, sides descending, e.g. 256 v4 chips
-> 8x8x4, as the "v4:8x8x4" topology). Mesh axes are assigned to physical dims the way
`jax.experimental.mesh_utils.create_device_mesh` does: from the last (most network-
intensive) mesh axis to the first, each takes the subset of still-free physical dims
whose sizes multiply to its size, preferring subsets with more dims (itertools order
among equals). When no subset fits, the axis takes free dims until their product is a
multiple of its size and the dim it shares with another axis is split (both get it as a
line, no wrap-around). Per axis, with L the one-way bandwidth of one link:

    rate(dim)            = 2 L on a dim with wrap-around (a ring in both directions),
                           1 L on a line (the end chips have one neighbour)
    all-gather bandwidth = efficiency_all_gather    * sum of rate(dim) over the axis's dims
    reduce-scatter       = efficiency_reduce_scatter * the same sum
    send/recv            = efficiency_permute * L, halved when any of its dims is a line
                           (the ring's closing hop travels back along it)

A dim has wrap-around when it is at least `wrap_min_length` long and the slice has at
least `wrap_min_chips` chips (v4 / v5p: slices of whole 4x4x4 cubes; v5e / v6e: the 16
side of a full 16x16 pod). Several dims are summed because a multi-dimensional
collective sends over every dim's links at once (the original MeshSlice cost model
does the same for an axis over two torus dims).

Chips of two devices (TPU7x / Ironwood: `devices_per_chip` 2, one device per
TensorCore). Mesh axes count devices; the chips are placed as above for the mesh whose
*core axis* (the last axis whose size is a multiple of devices_per_chip, `core_axis`) is
divided by devices_per_chip, and the two devices of a chip sit next to each other along
the core axis (as `meshslice.aot.make_mesh` lays them out). Per axis:

    core axis, one chip long      the chip's two devices alone: efficiency * C, with C
                                  the profile's `core_link_bandwidth` (die-to-die, one way)
    core axis, several chips      a ring through both cores of each chip: efficiency *
                                  min(L * the axis's chip rate, C); each chip-to-chip link
                                  carries one flow per direction, as for one-device chips
    any other axis                the rings of the chip's two devices (same-numbered cores
                                  of different chips) share the chips' links: the
                                  one-device figure / devices_per_chip
    across slices                 dcn_bandwidth (per chip) / devices_per_chip

Several slices (TPU multi-slice: slices joined by the data-centre network, DCN). The
caller says how many slices lie along each mesh axis (`dcn_shape`, as
`mesh_utils.create_hybrid_device_mesh` takes it, or read from the devices' `slice_index`
by `profile_for_devices`). Each slice holds mesh_shape / dcn_shape of the mesh and is
placed on its own torus as above; a mesh axis that crosses slices gets the DCN figures
for every collective kind: `dcn_bandwidth` (bytes/s per chip, one way) and
`dcn_latency` per ring step. Every step of a ring waits for its slowest hop, so the
whole axis is charged at the DCN rate even when most of its hops are ICI.

Islands (H100: NVLink inside 8-GPU nodes, InfiniBand between). Devices are numbered
node by node and the mesh is laid out row-major (as create_device_mesh does on GPU), so
a mesh axis whose devices all sit inside one node uses the profile's dim 1 numbers
(NVLink) and any other axis those of dim 0 (the network).

Example:
  >>> from meshslice.costmodel import load_profile
  >>> v4 = load_profile("tpu-v4")
  >>> physical_shape(v4.topology, 256), assign_axes(v4.topology, (32, 8))
  ((8, 8, 4), ((1, 2), (0,)))
  >>> p = profile_for_mesh(v4, (32, 8))
  >>> [round(b / 1e9, 1) for b in p.all_gather.bandwidth]      # 4 links vs 2 links
  [159.5, 79.7]
  >>> two = profile_for_mesh(v4, (64, 8), dcn_shape=(2, 1))      # 2 slices of (32, 8)
  >>> [round(b / 1e9, 2) for b in two.all_gather.bandwidth]      # row axis over DCN
  [6.25, 79.74]
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from .interconnect import KINDS, Topology  # noqa: F401  (re-exported: the old home)
from .profiles import CollectiveParams


def physical_shape(topology: Topology, chips: int) -> tuple[int, ...]:
  """The physical box of a torus slice of `chips` chips: the factorisation into
  `physical_dims` sides that is most cubic (smallest largest side, then smallest
  second side), sides descending.

  Example:
    >>> t = Topology(kind="torus", physical_dims=3, link_bandwidth=1e9)
    >>> physical_shape(t, 64), physical_shape(t, 1024), physical_shape(t, 96)
    ((4, 4, 4), (16, 8, 8), (6, 4, 4))
  """
  best = None
  n = topology.physical_dims
  for sides in itertools.product(*[[d for d in range(1, chips + 1) if chips % d == 0]] * n):
    if math.prod(sides) != chips:
      continue
    key = tuple(sorted(sides, reverse=True))
    if best is None or key < best:
      best = key
  return best


def assign_axes(topology: Topology, mesh_shape) -> tuple[tuple[int, ...], ...]:
  """Physical dims (indices into `physical_shape`) each mesh axis is assigned, in the
  order of create_device_mesh (module docstring). A dim split between axes appears in
  both; dims of extent 1 in none.

  Example:
    >>> t = Topology(kind="torus", physical_dims=3, link_bandwidth=1e9)
    >>> assign_axes(t, (16, 16)), assign_axes(t, (2, 128))     # 256 chips: 8x8x4
    (((1, 2), (0, 1)), ((2,), (0, 1, 2)))
  """
  shape = physical_shape(topology, math.prod(mesh_shape))
  free = list(shape)                    # unassigned extent left on each physical dim
  out = [()] * len(mesh_shape)
  for axis in reversed(range(len(mesh_shape))):
    size = mesh_shape[axis]
    if size == 1:
      continue
    found = None
    for count in range(len(shape), 0, -1):
      for dims in itertools.combinations(range(len(shape)), count):
        if all(free[d] == shape[d] for d in dims) and \
            math.prod(shape[d] for d in dims) == size:
          found = dims
          break
      if found:
        break
    if found:
      for d in found:
        free[d] = 1
    else:   # split: take free extent, whole dims first, until the size is covered
      need, dims = size, []
      for d in sorted(range(len(shape)), key=lambda d: (free[d] != shape[d], d)):
        if need == 1:
          break
        take = math.gcd(need, free[d])
        if take > 1:
          dims.append(d)
          need //= take
          free[d] //= take
      found = tuple(sorted(dims))
    # a dim of extent 1 (slices under 8 chips) has no links: not part of any axis, as
    # in create_device_mesh's own assignment
    out[axis] = tuple(d for d in found if shape[d] > 1)
  return tuple(out)


def core_axis(mesh_shape, devices_per_chip: int) -> int | None:
  """The mesh axis that holds the devices of a chip (module docstring): the last axis
  whose size devices_per_chip divides; None for one device per chip.

  Raises:
    ValueError: no axis is a multiple of devices_per_chip.

  Example:
    >>> core_axis((2, 4), 2), core_axis((8, 1), 2), core_axis((8, 8), 1)
    (1, 0, None)
  """
  if devices_per_chip <= 1:
    return None
  found = next((a for a in reversed(range(len(mesh_shape)))
                if mesh_shape[a] % devices_per_chip == 0), None)
  if found is None:
    raise ValueError(f"mesh shape {tuple(mesh_shape)}: a chip is {devices_per_chip} devices, "
                     f"so one mesh axis must be a multiple of {devices_per_chip}")
  return found


def chip_mesh_shape(profile, mesh_shape) -> tuple[int, ...]:
  """The mesh shape in chips: `mesh_shape` (devices) with the core axis divided by the
  profile's devices_per_chip (unchanged for one device per chip). Physical placement
  (`assign_axes`) works on this shape.

  Example:
    >>> from meshslice.costmodel import load_profile
    >>> v7x, v4 = load_profile("tpu-v7x"), load_profile("tpu-v4")
    >>> chip_mesh_shape(v7x, (2, 4)), chip_mesh_shape(v4, (2, 4))
    ((2, 2), (2, 4))
  """
  mesh_shape = tuple(int(s) for s in mesh_shape)
  cores = getattr(profile, "devices_per_chip", 1)
  axis = core_axis(mesh_shape, cores)
  if axis is None:
    return mesh_shape
  return tuple(s // cores if a == axis else s for a, s in enumerate(mesh_shape))


def _axis_rates(topology: Topology, mesh_shape, chips):
  """Per mesh axis (`mesh_shape` in chips): (sum of link rates in units of L, has a
  line, description)."""
  shape = physical_shape(topology, chips)
  assignment = assign_axes(topology, mesh_shape)
  uses = [sum(d in dims for dims in assignment) for d in range(len(shape))]
  wrap_slice = chips >= topology.wrap_min_chips
  rates = []
  for axis, dims in enumerate(assignment):
    rate, line, parts = 0.0, False, []
    for d in dims:
      wraps = wrap_slice and shape[d] >= topology.wrap_min_length and uses[d] == 1
      rate += 2.0 if wraps else 1.0
      line = line or not wraps
      parts.append(f"{shape[d]}{'' if uses[d] == 1 else ' (split)'}"
                   f"{' torus' if wraps else ' line'}")
    rates.append((rate, line, " x ".join(parts) or "-"))
  return rates


def describe_axes(profile, mesh_shape) -> tuple[str, ...]:
  """One line per mesh axis: which physical dims it lies on (for reports).

  Example:
    >>> from meshslice.costmodel import load_profile
    >>> describe_axes(load_profile("tpu-v4"), (32, 8))
    ('8 torus x 4 torus', '8 torus')
    >>> describe_axes(load_profile("h100"), (4, 8))
    ('across nodes', 'inside a node')
    >>> describe_axes(load_profile("tpu-v7x"), (2, 4))      # 4 chips, 2 cores each
    ('2 line, shared by 2 cores', '2 cores x 2 line')
  """
  topology = profile.topology
  if topology is None:
    return tuple(f"profile dim {min(i, 1)}" for i in range(len(mesh_shape)))
  if topology.kind == "islands":
    return tuple("inside a node" if _inside_island(topology, mesh_shape, i)
                 else "across nodes" for i in range(len(mesh_shape)))
  cores = getattr(profile, "devices_per_chip", 1)
  try:
    chip_shape, axis = chip_mesh_shape(profile, mesh_shape), core_axis(tuple(mesh_shape), cores)
  except ValueError:           # no axis holds a chip's devices (as profile_for_mesh)
    chip_shape, axis = tuple(mesh_shape), None
  out = []
  for a, rate in enumerate(_axis_rates(topology, chip_shape, math.prod(chip_shape))):
    text = rate[2]
    if a == axis:
      text = f"{cores} cores" + ("" if text == "-" else f" x {text}")
    elif axis is not None and text != "-":
      text += f", shared by {cores} cores"
    out.append(text)
  return tuple(out)


def _inside_island(topology, mesh_shape, axis) -> bool:
  # Row-major layout over devices numbered node by node: the devices of one group along
  # `axis` are `stride` apart, `size` of them.
  stride = math.prod(mesh_shape[axis + 1:])
  span = stride * (mesh_shape[axis] - 1) + 1
  return span <= topology.island_size and topology.island_size % (stride * mesh_shape[axis]) == 0


def profile_for_mesh(profile, mesh_shape, axes=(0, 1), *, dcn_shape=None):
  """`profile` with dim 0 / dim 1 re-derived for mesh axes `axes` of `mesh_shape` (all
  of the mesh's axis sizes, in mesh order). A profile without a topology, or a mesh of
  one axis, comes back unchanged.

  dcn_shape: how many slices lie along each mesh axis (None: one slice), as
    `mesh_utils.create_hybrid_device_mesh` takes it: (2, 1) puts two slices along the
    first axis. Axes that cross slices get the topology's DCN figures.

  Raises:
    ValueError: more chips in one slice than one network holds (`Topology.max_chips`),
      a dcn_shape that does not divide the mesh, or slices without a DCN figure.

  Example:
    >>> from meshslice.costmodel import load_profile
    >>> h = profile_for_mesh(load_profile("h100"), (4, 8))    # col axis = one node
    >>> h.all_gather.bandwidth == load_profile("h100").all_gather.bandwidth
    True
    >>> profile_for_mesh(load_profile("h100"), (2, 16)).all_gather.bandwidth   # 2 nodes
    (40000000000.0, 40000000000.0)
  """
  topology = profile.topology
  mesh_shape = tuple(int(s) for s in mesh_shape)
  if topology is None or len(mesh_shape) < 2:
    return profile
  dcn = _check_dcn_shape(profile, mesh_shape, dcn_shape)
  slice_shape = tuple(s // d for s, d in zip(mesh_shape, dcn))
  cores = getattr(profile, "devices_per_chip", 1) if topology.kind == "torus" else 1
  try:
    core = core_axis(slice_shape, cores)
    chip_shape = chip_mesh_shape(profile, slice_shape) if core is not None else slice_shape
  except ValueError:   # no axis can hold a chip's devices (an abstract mesh of odd sizes):
    core, chip_shape = None, slice_shape     # each device placed as a chip, links shared
  chips = math.prod(chip_shape)
  if topology.max_chips and chips > topology.max_chips:
    raise ValueError(f"{profile.name}: {chips} chips exceed one network of "
                     f"{topology.max_chips}; several slices over the data-centre network "
                     f"need dcn_shape (slices per mesh axis)")
  params = {}
  crosses = [dcn[a] > 1 for a in axes]
  if topology.kind == "islands":
    inside = [_inside_island(topology, mesh_shape, a) and not x for a, x in zip(axes, crosses)]
    for kind in ("all_gather", "reduce_scatter", "permute"):
      c = profile.collective(kind)
      pick = lambda values: tuple(values[1] if i else values[0] for i in inside)
      params[kind] = CollectiveParams(bandwidth=pick(c.bandwidth),
                                      hop_latency=pick(c.hop_latency),
                                      base_overhead=pick(c.base_overhead))
  else:
    rates = _axis_rates(topology, chip_shape, chips)
    link = topology.link_bandwidth
    for kind, eff in zip(("all_gather", "reduce_scatter", "permute"), topology.efficiency):
      c = profile.collective(kind)
      bw, hop = [], []
      for i, a in enumerate(axes):
        rate, line, _ = rates[a]
        if crosses[i]:     # every ring step waits for the slowest hop: the DCN one
          bw.append(topology.dcn_bandwidth / cores)
          hop.append(topology.dcn_latency)
          continue
        if kind == "permute":
          chip_bw = link / (2.0 if line else 1.0)
        else:
          chip_bw = link * max(rate, 1.0)
        if a == core and chip_shape[a] == 1:     # the chip's own devices only
          bw.append(eff * profile.core_link_bandwidth)
        elif a == core:     # a ring through both cores of each chip (module docstring)
          bw.append(eff * min(chip_bw, profile.core_link_bandwidth))
        else:               # a chip's devices share its links
          bw.append(eff * chip_bw / cores)
        hop.append(c.hop_latency[min(i, 1)])
      params[kind] = CollectiveParams(bandwidth=tuple(bw), hop_latency=tuple(hop),
                                      base_overhead=c.base_overhead)
  shape = "x".join(map(str, mesh_shape))
  slices = "" if math.prod(dcn) == 1 else f"/{math.prod(dcn)}slices"
  return dataclasses.replace(profile, name=f"{profile.name}@{shape}{slices}", **params)


def _check_dcn_shape(profile, mesh_shape, dcn_shape) -> tuple[int, ...]:
  if dcn_shape is None:
    return (1,) * len(mesh_shape)
  dcn = tuple(int(d) for d in dcn_shape)
  if len(dcn) != len(mesh_shape) or any(d < 1 or s % d for s, d in zip(mesh_shape, dcn)):
    raise ValueError(f"dcn_shape {dcn_shape} must give, per mesh axis of {mesh_shape}, a "
                     f"slice count that divides the axis")
  if math.prod(dcn) > 1 and profile.topology.kind == "torus" and \
      not profile.topology.dcn_bandwidth:
    raise ValueError(f"{profile.name}: no DCN bandwidth in the profile's topology; a mesh "
                     f"over {math.prod(dcn)} slices cannot be modelled")
  return dcn


def dcn_shape_of(devices) -> tuple[int, ...]:
  """Slices along each axis of a device grid (a numpy array of devices, e.g.
  `mesh.devices`): the most distinct `slice_index` values on any line along that axis.
  Devices without a `slice_index` (one slice, CPU, GPU) count as slice 0.

  Example:
    >>> import numpy as np, types
    >>> d = lambda s: types.SimpleNamespace(slice_index=s)
    >>> dcn_shape_of(np.array([[d(0), d(0)], [d(1), d(1)]], dtype=object))
    (2, 1)
  """
  import numpy as np
  index = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0, otypes=[int])(
      np.asarray(devices, dtype=object))
  out = []
  for axis in range(index.ndim):
    lines = np.moveaxis(index, axis, -1).reshape(-1, index.shape[axis])
    out.append(max(len(set(line.tolist())) for line in lines))
  return tuple(out)


def profile_for_devices(profile, devices, axes=(0, 1)):
  """`profile_for_mesh` for a concrete device grid (`mesh.devices`): the mesh shape is
  the grid's, and the slices along each axis come from the devices' `slice_index`
  (`dcn_shape_of`). Within a slice the create_device_mesh placement is assumed.

  Example:
    >>> from meshslice import aot                                   # doctest: +SKIP
    >>> mesh = aot.make_mesh(aot.topology("v4:2x2x2", num_slices=2), (4, 4))  # doctest: +SKIP
    >>> profile_for_devices(load_profile("tpu-v4"), mesh.devices).name        # doctest: +SKIP
    'tpu-v4@4x4/2slices'
  """
  import numpy as np
  grid = np.asarray(devices, dtype=object)
  return profile_for_mesh(profile, grid.shape, axes, dcn_shape=dcn_shape_of(grid))
