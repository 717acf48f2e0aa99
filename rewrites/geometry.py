"""The shape of one distributed GEMM, as the algorithms see it from inside a shard_map.

A `GemmGeometry` says which local dims of the operands are sliced and communicated, over
which mesh axes, and how the local matmul is computed. It knows nothing about
PartitionSpecs: the caller (the pass, or a person writing shard_map code by hand) wraps
the body an algorithm builds in a `jax.shard_map` whose specs realise the layouts of
DESIGN.md section 4:

    dataflow  lhs (X)          rhs (W)          output (Y)
    os        M:row, K:col     K:row, N:col     M:row, N:col
    ls        M:row, K:col     K:col, N:row     M:row, N:col
    rs        M:col, K:row     K:row, N:col     M:row, N:col
"""
from __future__ import annotations

import dataclasses
import math

DATAFLOWS = ("os", "ls", "rs")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GemmGeometry:
  """Where a 2D-sharded dot_general communicates, in local (per-device) terms.

  Attributes:
    dimension_numbers: the dot_general's ((lhs_contract, rhs_contract),
      (lhs_batch, rhs_batch)), unchanged from the original program.
    dataflow: "os", "ls" or "rs" (which matrix stays put).
    row_axis, col_axis: the two mesh axis names (r and c in DESIGN.md section 4).
    row_size, col_size: their sizes R and C.
    lhs_dim: the lhs dim that is communicated (os: the sharded contracting dim;
      rs: the sharded free dim M), or None (ls).
    rhs_dim: the rhs dim that is communicated (os: the sharded contracting dim;
      ls: the sharded free dim N), or None (rs).
    out_dim: the output dim that is reduce-scattered (ls: N's position, rs: M's
      position), or None (os).
    global_extent: the global size of the communicated dim (K, N or M).
    reduce_axes: extra mesh axes the contraction is also sharded over; the partial
      result is summed over them (the reduction GSPMD would add anyway).
    precision, preferred_element_type: passed through to every local dot_general.
    out_dtype: dtype of the original dot_general's result.

  Example:
    >>> g = GemmGeometry(dimension_numbers=(((1,), (0,)), ((), ())), dataflow="os",
    ...                  row_axis="x", col_axis="y", row_size=2, col_size=4,
    ...                  lhs_dim=1, rhs_dim=0, out_dim=None, global_extent=64)
    >>> g.lcm
    4
  """

  dimension_numbers: tuple
  dataflow: str
  row_axis: str
  col_axis: str
  row_size: int
  col_size: int
  lhs_dim: int | None
  rhs_dim: int | None
  out_dim: int | None
  global_extent: int
  reduce_axes: tuple[str, ...] = ()
  precision: object = None
  preferred_element_type: object = None
  out_dtype: object = None

  def __post_init__(self):
    if self.dataflow not in DATAFLOWS:
      raise ValueError(f"dataflow must be one of {DATAFLOWS}, got {self.dataflow!r}")

  @property
  def lcm(self) -> int:
    return math.lcm(self.row_size, self.col_size)

  def block_size(self, ksplit: int) -> int:
    """The block-cyclic block size B = extent / (S * lcm(R, C)) for S = ksplit."""
    if not self.valid_ksplit(ksplit):
      raise ValueError(
          f"ksplit={ksplit} does not divide the communicated extent "
          f"{self.global_extent} into S * lcm(R, C) = {ksplit * self.lcm} equal blocks")
    return self.global_extent // (ksplit * self.lcm)

  def valid_ksplit(self, ksplit: int) -> bool:
    return ksplit >= 1 and self.global_extent % (ksplit * self.lcm) == 0

  def valid_ksplits(self) -> tuple[int, ...]:
    """Every S for which block-cyclic slicing is exact, ascending."""
    n = self.global_extent // self.lcm if self.global_extent % self.lcm == 0 else 0
    return tuple(s for s in range(1, n + 1) if n % s == 0)
