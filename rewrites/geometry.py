"""The shape of one distributed GEMM, as the algorithms see it from inside a shard_map.

A `GemmGeometry` says which local dims of the operands are sliced and communicated, over
which mesh axes, and how the local matmul is computed. It knows nothing about
PartitionSpecs: the caller (the pass, or a person writing shard_map code by hand) wraps
the body an algorithm builds in a `jax.shard_map` whose specs realise the layouts of
docs/design.md ("The three dataflows"):

    dataflow  lhs (X)          rhs (W)          output (Y)
    os        M:row, K:col     K:row, N:col     M:row, N:col
    ls        M:row, K:col     K:col, N:row     M:row, N:col
    rs        M:col, K:row     K:row, N:col     M:row, N:col
"""
from __future__ import annotations

import dataclasses
import math

DATAFLOWS = ("os", "ls", "rs")


class _Slicing:
  """Slice-count arithmetic shared by both geometries: the communicated extent is cut
  into S * lcm equal blocks (lcm = lcm(R, C) for 2D sites, n for 1D sites)."""

  __slots__ = ()
  _LCM_NAME = "lcm(R, C)"
  # what the method below read, set by each geometry (annotations only: no slots)
  global_extent: int
  lcm: int

  def block_size(self, ksplit: int) -> int:
    """The block-cyclic block size B = extent / (S * lcm) for S = ksplit."""
    if not self.valid_ksplit(ksplit):
      raise ValueError(
          f"ksplit={ksplit} does not divide the communicated extent {self.global_extent} "
          f"into S * {self._LCM_NAME} = {ksplit * self.lcm} equal blocks")
    return self.global_extent // (ksplit * self.lcm)

  def valid_ksplit(self, ksplit: int) -> bool:
    return ksplit >= 1 and self.global_extent % (ksplit * self.lcm) == 0

  def valid_ksplits(self) -> tuple[int, ...]:
    """Every S for which slicing is exact, ascending."""
    n = self.global_extent // self.lcm if self.global_extent % self.lcm == 0 else 0
    return tuple(s for s in range(1, n + 1) if n % s == 0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GemmGeometry(_Slicing):
  """Where a 2D-sharded dot_general communicates, in local (per-device) terms.

  Attributes:
    dimension_numbers: the dot_general's ((lhs_contract, rhs_contract),
      (lhs_batch, rhs_batch)), unchanged from the original program.
    dataflow: "os", "ls" or "rs" (which matrix stays put).
    row_axis, col_axis: the two mesh axis names (r and c in docs/design.md). For
      "os" one of them may be None with size 1: that operand holds K whole, and only the
      other is gathered (e.g. Y[M:a, N] = X[M:a, K] . all_gather(W[K:a, N])).
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

  def stationary_roles(self, moving_is_lhs: bool) -> Roles:
    """Which operand moves over which axis in an operand-stationary dataflow: ls (the rhs
    moves over row, partial sums scatter over col; `moving_is_lhs=False`) and rs (the
    lhs moves over col, partial sums scatter over row; `moving_is_lhs=True`) are the
    same loop with these roles swapped.

    >>> g = GemmGeometry(dimension_numbers=(((1,), (0,)), ((), ())), dataflow="rs",
    ...                  row_axis="x", col_axis="y", row_size=2, col_size=4,
    ...                  lhs_dim=0, rhs_dim=None, out_dim=0, global_extent=64)
    >>> r = g.stationary_roles(moving_is_lhs=True)
    >>> r.dim, r.gather_link, r.gather_axis, r.scatter_axis, r.scatter_size
    (0, 'col', 'y', 'x', 2)
    """
    if self.dataflow == "os":
      raise ValueError("an os GEMM has no stationary operand: both operands move")
    if moving_is_lhs:
      return Roles(moving_is_lhs=True, dim=self.lhs_dim, gather_link="col",
                   gather_axis=self.col_axis, gather_size=self.col_size,
                   scatter_axis=self.row_axis, scatter_size=self.row_size)
    return Roles(moving_is_lhs=False, dim=self.rhs_dim, gather_link="row",
                 gather_axis=self.row_axis, gather_size=self.row_size,
                 scatter_axis=self.col_axis, scatter_size=self.col_size)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Roles:
  """The roles of an ls or rs GEMM (`GemmGeometry.stationary_roles`): one operand moves
  (is gathered) along `dim` over the gather axis, the other stays put, and the partial
  sums are reduced over the scatter axis.

  Attributes:
    moving_is_lhs: the lhs moves (rs) or the rhs does (ls).
    dim: the moving operand's communicated dim.
    gather_link: "row" or "col", which of the geometry's two axes the moving operand
      travels over; gather_axis, gather_size: that mesh axis and its size.
    scatter_axis, scatter_size: the other mesh axis (and its size), the one the partial
      sums are reduced over.
  """

  moving_is_lhs: bool
  dim: int
  gather_link: str
  gather_axis: str
  gather_size: int
  scatter_axis: str
  scatter_size: int

  def moving(self, lhs, rhs):
    """The operand that moves, of the local pair (lhs, rhs)."""
    return lhs if self.moving_is_lhs else rhs

  def operands(self, piece, lhs, rhs):
    """The local (lhs, rhs) pair with `piece` in the moving operand's place."""
    return (piece, rhs) if self.moving_is_lhs else (lhs, piece)


ONED_KINDS = ("all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OneDGeometry(_Slicing):
  """A dot_general sharded over one mesh axis `axis` (size n), in local terms.

  The one-axis special case of the 2D layouts; the layouts are (a, b stand for any
  other dims, which may be split further over other mesh axes without communication):

    kind            lhs / rhs                               output
    all_gather      the free dim named by lhs_dim (or        out_dim: unsharded (gathered)
                    rhs_dim) is sharded over `axis`; the
                    contracting dims of both are not
    reduce_scatter  the contracting dims lhs_dim, rhs_dim    out_dim: sharded over `axis`
                    are sharded over `axis`; the operand
                    that supplies out_dim holds it whole

  e.g. all_gather: Y[M, N:a] = all_gather(X[M:a, K], a) . W[K, N:a] (sequence-parallel
  activations entering a Megatron MLP), reduce_scatter: Y[M:a, N] =
  reduce_scatter(X[M, K:a] . W[K:a, N], a) (leaving it).

  With `all_reduce=True` a reduce_scatter geometry sums the partial products with a psum
  instead: Y[M, N] = psum(X[M, K:a] . W[K:a, N], a), the output keeps out_dim's layout
  (replicated over `axis`), and out_dim is only the dim cut into slices so that the psum
  of one slice runs beside the matmul of the next (a row-parallel layer, or a
  data-parallel weight gradient, whose consumer wants the result whole).

  Attributes:
    dimension_numbers: the dot_general's ((lhs_contract, rhs_contract),
      (lhs_batch, rhs_batch)).
    kind: "all_gather" or "reduce_scatter".
    axis, axis_size: the mesh axis and its size n.
    lhs_dim, rhs_dim: all_gather: exactly one is set, the gathered free dim of that
      operand; reduce_scatter: both are set, the sharded contracting dims.
    out_dim: the output position of the communicated dim (a free dim, not batch).
    global_extent: global size of the communicated dim (the gathered dim, or out_dim);
      with all_reduce, the size of out_dim within one shard of the axes that split it.
    all_reduce: reduce_scatter only: psum the partial sums over `axis` (and reduce_axes)
      slice by slice instead of scattering them; the output is not split over `axis`.
    reduce_axes, precision, preferred_element_type, out_dtype: as in `GemmGeometry`.

  Example:
    >>> g = OneDGeometry(dimension_numbers=(((1,), (0,)), ((), ())), kind="all_gather",
    ...                  axis="x", axis_size=4, lhs_dim=0, rhs_dim=None, out_dim=0,
    ...                  global_extent=64)
    >>> g.valid_ksplits()
    (1, 2, 4, 8, 16)
  """

  dimension_numbers: tuple
  kind: str
  axis: str
  axis_size: int
  lhs_dim: int | None
  rhs_dim: int | None
  out_dim: int
  global_extent: int
  reduce_axes: tuple[str, ...] = ()
  precision: object = None
  preferred_element_type: object = None
  out_dtype: object = None
  all_reduce: bool = False

  def __post_init__(self):
    if self.all_reduce and self.kind != "reduce_scatter":
      raise ValueError("all_reduce=True sums partial products: it needs kind='reduce_scatter' "
                       f"(sharded contracting dims), got kind={self.kind!r}")
    if self.kind not in ONED_KINDS:
      raise ValueError(f"kind must be one of {ONED_KINDS}, got {self.kind!r}")
    if self.kind == "all_gather" and (self.lhs_dim is None) == (self.rhs_dim is None):
      raise ValueError("an all_gather OneDGeometry gathers one operand: set exactly one of "
                       f"lhs_dim, rhs_dim (got lhs_dim={self.lhs_dim}, rhs_dim={self.rhs_dim})")
    if self.kind == "reduce_scatter" and (self.lhs_dim is None or self.rhs_dim is None):
      raise ValueError("a reduce_scatter OneDGeometry needs both sharded contracting dims: "
                       f"got lhs_dim={self.lhs_dim}, rhs_dim={self.rhs_dim}")

  _LCM_NAME = "n"

  @property
  def lcm(self) -> int:
    # One axis: the block-cyclic arithmetic of GemmGeometry with lcm(R, C) -> n.
    return self.axis_size


def plain_gemm(dataflow: str, m: int, k: int, n: int, rows: int, cols: int, dtype,
               axes: tuple[str, str] = ("x", "y")) -> tuple[GemmGeometry, tuple, tuple]:
  """The plain GEMM Y[M, N] = X[M, K] . W[K, N] on an R x C mesh, laid out for `dataflow`
  (the module docstring's table): its `GemmGeometry` and the mesh axes of each operand's
  two dims, (lhs_axes, rhs_axes), for the shard_map's in_specs (`PartitionSpec(*axes)`).
  The output is laid out as `axes` (M over the row axis, N over the column axis) in all
  three dataflows.

  Args:
    dataflow: "os", "ls" or "rs".
    m, k, n: the global sizes.
    rows, cols: the sizes R and C of the row and column mesh axes.
    dtype: the result's dtype (`GemmGeometry.out_dtype`).
    axes: the names of the row and column mesh axes.

  Example:
    >>> g, lhs_axes, rhs_axes = plain_gemm("ls", 64, 32, 128, 2, 4, "float32")
    >>> lhs_axes, rhs_axes, g.rhs_dim, g.out_dim, g.global_extent
    (('x', 'y'), ('y', 'x'), 1, 1, 128)
  """
  row, col = axes
  lhs_dim: int | None
  rhs_dim: int | None
  out_dim: int | None
  if dataflow == "os":
    lhs_dim, rhs_dim, out_dim, extent = 1, 0, None, k
    lhs_axes, rhs_axes = (row, col), (row, col)
  elif dataflow == "ls":
    lhs_dim, rhs_dim, out_dim, extent = None, 1, 1, n
    lhs_axes, rhs_axes = (row, col), (col, row)
  elif dataflow == "rs":
    lhs_dim, rhs_dim, out_dim, extent = 0, None, 0, m
    lhs_axes, rhs_axes = (col, row), (row, col)
  else:
    raise ValueError(f"dataflow must be one of {DATAFLOWS}, got {dataflow!r}")
  geometry = GemmGeometry(dimension_numbers=(((1,), (0,)), ((), ())), dataflow=dataflow,
                          row_axis=row, col_axis=col, row_size=rows, col_size=cols,
                          lhs_dim=lhs_dim, rhs_dim=rhs_dim, out_dim=out_dim,
                          global_extent=extent, out_dtype=dtype)
  return geometry, lhs_axes, rhs_axes


def extent_reason(geometry) -> str:
  """Why the communicated extent cannot be laid out on the mesh, or "" if it can.

  Every algorithm needs it: the extent is split over both axes (or over the one axis
  of a `OneDGeometry`), so lcm(R, C) (or n) must divide it.
  """
  if geometry.global_extent % geometry.lcm == 0:
    return ""
  if isinstance(geometry, OneDGeometry):
    return (f"communicated extent {geometry.global_extent} is not divisible by the size "
            f"{geometry.axis_size} of mesh axis {geometry.axis!r}")
  return (f"communicated extent {geometry.global_extent} is not divisible by "
          f"lcm(R, C) = {geometry.lcm}")


def ksplit_reason(geometry, ksplit: int, algorithm: str) -> str:
  """Why `ksplit` does not slice `geometry` exactly (S * lcm must divide the extent)."""
  if isinstance(ksplit, int) and geometry.valid_ksplit(ksplit):
    return ""
  return (f"{algorithm}: ksplit={ksplit} does not divide the communicated extent "
          f"{geometry.global_extent} into ksplit * lcm = {ksplit} * {geometry.lcm} equal "
          f"blocks; valid ksplit: {', '.join(map(str, geometry.valid_ksplits())) or 'none'}")
