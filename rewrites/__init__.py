"""Distributed-GEMM algorithms as shard_map body builders.

`meshslice.rewrites` is usable by the pass and by people writing shard_map code by hand:
describe the GEMM with a `GemmGeometry` (or a `OneDGeometry` for a site sharded over one
mesh axis), build a body, wrap it in `jax.shard_map`. Every algorithm of a geometry
takes the same input layouts and returns the same output layout, so they are drop-in
alternatives for one site; `supports` says which ones can serve it.

A body depends on its geometry and on one ambient input: it reads the target platform
(`platform.target_platform`, the platform of the mesh being traced) at trace time, to
pick the dtypes and local dots that platform's compiler sums and runs correctly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from . import cannon, oned, summa, wang
from .cannon import build_cannon
from .geometry import (DATAFLOWS, ONED_KINDS, GemmGeometry, OneDGeometry, extent_reason,
                       plain_gemm)
from .meshslice import build_collective, build_meshslice, build_meshslice_sum
from .oned import build_oned_collective, build_oned_ring, build_oned_sliced
from .slicing import assemble_slices, take_slice
from .summa import build_summa
from .wang import build_wang


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Algorithm:
  """One row of the algorithm table: how to build an algorithm's body, and when it
  cannot serve a site.

  Attributes:
    build_2d: `(geometry, ksplit, **options) -> body` for a `GemmGeometry`.
    unsupported: `(geometry) -> str`, the algorithm's own reason it cannot serve a
      `GemmGeometry` (with ksplit=1 and default options), "" if it can.
    options: the keyword options of `build_2d` (the cost model's time model of the same
      name takes the same ones: `costmodel.algorithm_options`).
    needs_two_axes: it cannot serve an os site that communicates over one mesh axis
      (row_axis or col_axis None, with size 1).
    build_1d: `(geometry, ksplit, **options) -> body` for a `OneDGeometry`, or None when
      the algorithm has no 1D form.
    unsupported_1d: `(geometry) -> str`, as `unsupported` for a `OneDGeometry`.
  """

  build_2d: Callable
  unsupported: Callable[..., str]
  options: tuple[str, ...] = ()
  needs_two_axes: bool = False
  build_1d: Callable | None = None
  unsupported_1d: Callable[..., str] | None = None


def _extent_only(algorithm: str):
  """The rule of an algorithm that slices any extent lcm(R, C) divides."""
  def unsupported(geometry) -> str:
    reason = extent_reason(geometry)
    return f"{algorithm}: {reason}" if reason else ""
  return unsupported


def _collective_2d(geometry, ksplit=1, **options):
  return build_collective(geometry, **options)     # one collective: nothing to slice


def _collective_1d(geometry, ksplit=1, **options):
  return build_oned_collective(geometry, **options)


def _oned_rule(ring: bool):
  return lambda geometry: oned.unsupported(geometry, ring=ring)


# Adding an algorithm: a row here, its time model (`@_algorithm`) in costmodel/timing.py,
# and tests/test_rewrites_registry.py checks that the two agree on what is valid.
_TABLE = {
    # scatter: the form of an ls / rs site's reduce-scatter (scatter.SCATTER_FORMS)
    "meshslice": Algorithm(build_2d=build_meshslice, unsupported=_extent_only("meshslice"),
                           options=("scatter",), build_1d=build_oned_sliced,
                           unsupported_1d=_oned_rule(False)),
    "collective": Algorithm(build_2d=_collective_2d, unsupported=_extent_only("collective"),
                            options=("scatter",), build_1d=_collective_1d,
                            unsupported_1d=_oned_rule(False)),
    "cannon": Algorithm(build_2d=build_cannon, unsupported=cannon.unsupported,
                        needs_two_axes=True),
    # on a 1D site: a ppermute ring (not for all-reduce sites), which takes bidirectional
    "wang": Algorithm(build_2d=build_wang, unsupported=wang.unsupported,
                      options=("ring", "bidirectional"), needs_two_axes=True,
                      build_1d=build_oned_ring, unsupported_1d=_oned_rule(True)),
    "summa": Algorithm(build_2d=build_summa, unsupported=summa.unsupported,
                       needs_two_axes=True),
}

ALGORITHMS = tuple(_TABLE)
# The algorithms with a form for a 1D site.
_ONED = tuple(name for name, entry in _TABLE.items() if entry.build_1d is not None)


def supports(algorithm: str, geometry) -> str:
  """Why `algorithm` cannot serve `geometry` (with ksplit=1 and default options), as a
  human-readable reason (e.g. "cannon needs a square mesh (R == C), got 2x4 ..."), or
  the empty string if it can.

  The pass uses it to fall back to another algorithm or to report why it did not.
  """
  if algorithm not in ALGORITHMS:
    return f"unknown algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}"
  entry = _TABLE[algorithm]
  if isinstance(geometry, OneDGeometry):
    if entry.build_1d is None:
      return (f"{algorithm} needs a 2D site (a matmul sharded over two mesh axes); this is "
              f"a 1D {geometry.kind} site over {geometry.axis!r}: use one of "
              f"{', '.join(_ONED)}")
    return entry.unsupported_1d(geometry)
  if not isinstance(geometry, GemmGeometry):
    return f"geometry must be a GemmGeometry or OneDGeometry, got {type(geometry).__name__}"
  if entry.needs_two_axes and None in (geometry.row_axis, geometry.col_axis):
    return (f"{algorithm} needs two mesh axes; this site communicates over one "
            "(an OS site with a size-1 axis): use meshslice or collective")
  return entry.unsupported(geometry)


def build_body(algorithm: str, geometry, ksplit: int = 1, **options):
  """The shard_map body of `algorithm` (one of `ALGORITHMS`) for `geometry`.

  `options` go to the builder (e.g. `bidirectional=True` for "wang"). On a
  `OneDGeometry`: "meshslice" -> `build_oned_sliced`, "collective" ->
  `build_oned_collective`, "wang" -> `build_oned_ring`. Raises ValueError with the
  reason from `supports` when the algorithm cannot serve the geometry.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  entry = _TABLE[algorithm]
  if isinstance(geometry, OneDGeometry):
    reason = supports(algorithm, geometry)
    if reason:
      raise ValueError(reason)
    return entry.build_1d(geometry, ksplit, **options)
  # meshslice and collective check their geometry as they build it (block_size, with the
  # ksplit in its message); the two-axes rule is the table's, so `supports` goes first
  if entry.needs_two_axes:
    reason = supports(algorithm, geometry)
    if reason:
      raise ValueError(reason)
  return entry.build_2d(geometry, ksplit, **options)


# The algorithms with a body for a sum of several GEMMs of one geometry reduced once
# (`build_summed_body`).
SUMMABLE = ("collective", "meshslice")


def summable(algorithm: str, geometry) -> bool:
  """Whether `build_summed_body` can serve a sum of `algorithm` GEMMs of `geometry`: the
  collective and MeshSlice algorithms on a 2D ls or rs geometry, whose partial products
  are reduce-scattered (a reduce-scatter is linear, so the terms can share one)."""
  return (algorithm in SUMMABLE and isinstance(geometry, GemmGeometry)
          and geometry.dataflow in ("ls", "rs") and not supports(algorithm, geometry))


def build_summed_body(algorithm: str, geometry, ksplit: int, terms: int, **options):
  """The shard_map body of the sum of `terms` GEMMs of one geometry:
  body(lhs_1, rhs_1, ..., lhs_n, rhs_n) = sum_t lhs_t . rhs_t, with one reduce-scatter a
  slice for all terms (`meshslice.build_meshslice_sum`). Raises ValueError where
  `summable` is False.

  >>> from meshslice.rewrites import GemmGeometry
  >>> g = GemmGeometry(dimension_numbers=(((1,), (0,)), ((), ())), dataflow="ls",
  ...                  row_axis="x", col_axis="y", row_size=2, col_size=4,
  ...                  lhs_dim=None, rhs_dim=1, out_dim=1, global_extent=64)
  >>> body = build_summed_body("meshslice", g, 2, 3)   # body(x1, w1, x2, w2, x3, w3)
  """
  if not summable(algorithm, geometry):
    raise ValueError(f"build_summed_body: {algorithm!r} on this geometry has no summed "
                     f"form (algorithms {SUMMABLE}, 2D ls or rs sites only)")
  return build_meshslice_sum(geometry, 1 if algorithm == "collective" else ksplit, terms,
                             **options)


__all__ = ["ALGORITHMS", "DATAFLOWS", "GemmGeometry", "ONED_KINDS", "OneDGeometry",
           "SUMMABLE", "assemble_slices", "build_body", "build_cannon", "build_collective",
           "build_meshslice", "build_meshslice_sum", "build_oned_collective",
           "build_oned_ring", "build_oned_sliced", "build_summa", "build_summed_body",
           "build_wang", "plain_gemm", "summable", "supports", "take_slice"]
