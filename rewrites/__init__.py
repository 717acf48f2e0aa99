"""Distributed-GEMM algorithms as shard_map body builders (pure functions).

`meshslice.rewrites` is usable by the pass and by people writing shard_map code by hand:
describe the GEMM with a `GemmGeometry`, build a body, wrap it in `jax.shard_map`.
"""
from .geometry import DATAFLOWS, GemmGeometry
from .meshslice import build_collective, build_meshslice
from .slicing import assemble_slices, take_slice

ALGORITHMS = ("meshslice", "collective")


def build_body(algorithm: str, geometry: GemmGeometry, ksplit: int = 1):
  """The shard_map body of `algorithm` ("meshslice" or "collective") for `geometry`."""
  if algorithm == "meshslice":
    return build_meshslice(geometry, ksplit)
  if algorithm == "collective":
    return build_collective(geometry)
  raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


__all__ = ["ALGORITHMS", "DATAFLOWS", "GemmGeometry", "assemble_slices", "build_body",
           "build_collective", "build_meshslice", "take_slice"]
