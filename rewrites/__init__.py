"""Distributed-GEMM algorithms as shard_map body builders (pure functions).

`meshslice.rewrites` is usable by the pass and by people writing shard_map code by hand:
describe the GEMM with a `GemmGeometry` (or a `OneDGeometry` for a site sharded over one
mesh axis), build a body, wrap it in `jax.shard_map`. Every algorithm of a geometry
takes the same input layouts and returns the same output layout, so they are drop-in
alternatives for one site; `supports` says which ones can serve it.
"""
from . import cannon, oned, summa, wang
from .cannon import build_cannon
from .geometry import DATAFLOWS, ONED_KINDS, GemmGeometry, OneDGeometry, extent_reason
from .meshslice import build_collective, build_meshslice
from .oned import build_oned_collective, build_oned_ring, build_oned_sliced
from .slicing import assemble_slices, take_slice
from .summa import build_summa
from .wang import build_wang

ALGORITHMS = ("meshslice", "collective", "cannon", "wang", "summa")

# The algorithms of a 1D site and what they mean there.
_ONED = {"meshslice": "sliced collectives", "collective": "one collective",
         "wang": "ppermute ring (not for all-reduce sites)"}


def supports(algorithm: str, geometry) -> str:
  """Why `algorithm` cannot serve `geometry` (with ksplit=1 and default options), as a
  human-readable reason (e.g. "cannon needs a square mesh (R == C), got 2x4 ..."), or
  the empty string if it can.

  The pass uses it to fall back to another algorithm or to report why it did not.
  """
  if algorithm not in ALGORITHMS:
    return f"unknown algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}"
  if isinstance(geometry, OneDGeometry):
    if algorithm not in _ONED:
      return (f"{algorithm} needs a 2D site (a matmul sharded over two mesh axes); this is "
              f"a 1D {geometry.kind} site over {geometry.axis!r}: use one of "
              f"{', '.join(_ONED)}")
    return oned.unsupported(geometry, ring=algorithm == "wang")
  if not isinstance(geometry, GemmGeometry):
    return f"geometry must be a GemmGeometry or OneDGeometry, got {type(geometry).__name__}"
  if None in (geometry.row_axis, geometry.col_axis) and algorithm not in ("meshslice",
                                                                          "collective"):
    return (f"{algorithm} needs two mesh axes; this site communicates over one "
            "(an OS site with a size-1 axis): use meshslice or collective")
  if algorithm == "cannon":
    return cannon.unsupported(geometry)
  if algorithm == "wang":
    return wang.unsupported(geometry)
  if algorithm == "summa":
    return summa.unsupported(geometry)
  reason = extent_reason(geometry)      # meshslice / collective
  return f"{algorithm}: {reason}" if reason else ""


def build_body(algorithm: str, geometry, ksplit: int = 1, **options):
  """The shard_map body of `algorithm` (one of `ALGORITHMS`) for `geometry`.

  `options` go to the builder (e.g. `bidirectional=True` for "wang"). On a
  `OneDGeometry`: "meshslice" -> `build_oned_sliced`, "collective" ->
  `build_oned_collective`, "wang" -> `build_oned_ring`. Raises ValueError with the
  reason from `supports` when the algorithm cannot serve the geometry.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  if isinstance(geometry, OneDGeometry):
    reason = supports(algorithm, geometry)
    if reason:
      raise ValueError(reason)
    if algorithm == "meshslice":
      return build_oned_sliced(geometry, ksplit, **options)
    if algorithm == "collective":
      return build_oned_collective(geometry, **options)
    return build_oned_ring(geometry, ksplit, **options)
  if algorithm == "meshslice":
    return build_meshslice(geometry, ksplit, **options)
  if algorithm == "collective":
    return build_collective(geometry, **options)
  reason = supports(algorithm, geometry)
  if reason:
    raise ValueError(reason)
  builder = {"cannon": build_cannon, "wang": build_wang, "summa": build_summa}[algorithm]
  return builder(geometry, ksplit, **options)


__all__ = ["ALGORITHMS", "DATAFLOWS", "GemmGeometry", "ONED_KINDS", "OneDGeometry",
           "assemble_slices", "build_body", "build_cannon", "build_collective",
           "build_meshslice", "build_oned_collective", "build_oned_ring",
           "build_oned_sliced", "build_summa", "build_wang", "supports", "take_slice"]
