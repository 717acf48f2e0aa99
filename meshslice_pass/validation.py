"""The last gate before emission: prove that a planned shard_map computes the dot_general.

Matching proposes a dataflow from patterns; this module checks the proposal from first
principles, knowing only what the emitted code does (docs/design.md):

  1. Every operand dim is split over its axis tuple, major axis first, and divides.
  2. The rewrite's collectives change the local layout: an all-gather over axis a of dim
     d removes a from d's tuple (a must be the minor axis, or the gathered pieces would
     not be contiguous); a reduce-scatter over b appends b to the output dim's tuple.
  3. After the gathers, each device multiplies its local blocks with the original
     dimension numbers. That is a correct partial product only if every contracting
     pair and every batch pair is split over the *same axes in the same order* on lhs
     and rhs (then both hold the same global indices).
  4. The partial products are summed over exactly the axes that still split a
     contracting pair: the reduce-scatter axis plus `reduce_axes` (psum); an all-reduce
     site (a 1D geometry with all_reduce=True) psums over its axis plus `reduce_axes`
     and leaves the output layout as it is, cutting a free dim into slices only.
  5. What remains is the output layout: batch dims, then lhs free, then rhs free, each
     with its tuple; it must equal the out_spec the shard_map declares, use each axis
     once, and divide the output dims.
  6. The geometry's communicated extent is that dim's size within one shard of the
     remaining axes.

`site_reason` returns "" when all of this holds, else why not; a site with a reason is
left alone (never emitted), so a pattern-matching mistake costs speed, not correctness.

Example:
  >>> g = GemmGeometry(dimension_numbers=(((1,), (0,)), ((), ())), dataflow="os",
  ...                  row_axis="x", col_axis="y", row_size=2, col_size=4,
  ...                  lhs_dim=1, rhs_dim=0, out_dim=None, global_extent=64)
  >>> x, y = ("x",), ("y",)
  >>> site_reason(g, (16, 64), (64, 32), ((x, y), (x, y), (x, y)), {"x": 2, "y": 4})
  ''
  >>> site_reason(g, (16, 64), (64, 32), ((x, y), (y, x), (x, y)), {"x": 2, "y": 4})
  "rhs dim 0 is split over ('y',) with 'x' not the minor axis: gathering it would not give
  contiguous blocks"
"""
from __future__ import annotations

import math

from meshslice.rewrites import GemmGeometry, OneDGeometry


def site_reason(geometry, lhs_shape, rhs_shape, specs, axis_sizes: dict) -> str:
  """Why the shard_map built from `geometry` with `specs` = (lhs, rhs, out) per-dim axis
  tuples would not compute this dot_general exactly; "" when it provably does."""
  lhs_spec, rhs_spec, out_spec = specs
  (lc, rc), (lb, rb) = geometry.dimension_numbers
  for name, shape, spec in (("lhs", lhs_shape, lhs_spec), ("rhs", rhs_shape, rhs_spec)):
    why = layout_reason(name, shape, spec, axis_sizes)
    if why:
      return why
  if 0 in tuple(lhs_shape) + tuple(rhs_shape):
    return "an operand has a zero-size dim: nothing to compute or communicate"

  gathers, scatter = _communication(geometry)
  psummed = geometry.axis if getattr(geometry, "all_reduce", False) else None
  local = {"lhs": list(lhs_spec), "rhs": list(rhs_spec)}
  shapes = {"lhs": lhs_shape, "rhs": rhs_shape}
  for operand, dim, axis in gathers:
    if dim is None or not 0 <= dim < len(local[operand]):
      return f"the rewrite gathers {operand} dim {dim}, which does not exist"
    tup = local[operand][dim]
    if not tup or tup[-1] != axis:
      return (f"{operand} dim {dim} is split over {tup} with {axis!r} not the minor axis: "
              "gathering it would not give contiguous blocks")
    local[operand][dim] = tup[:-1]
    within = shapes[operand][dim] // _size(tup[:-1], axis_sizes)
    if within != geometry.global_extent:
      return (f"communicated extent {geometry.global_extent} is not the size {within} of "
              f"{operand} dim {dim} within one shard of its other axes")

  for kind, pairs in (("contracting", zip(lc, rc)), ("batch", zip(lb, rb))):
    for a, b in pairs:
      if local["lhs"][a] != local["rhs"][b]:
        return (f"{kind} dims lhs {a} and rhs {b} are split over {local['lhs'][a]} and "
                f"{local['rhs'][b]}: the local blocks would not hold the same indices "
                "(the axes and their order must match)")
  summed = {ax for a in lc for ax in local["lhs"][a]}
  wanted_sum = (set(geometry.reduce_axes) | ({scatter} if scatter else set())
                | ({psummed} if psummed else set()))
  if summed != wanted_sum:
    return (f"the local products are partial over {sorted(summed)} but the rewrite sums "
            f"over {sorted(wanted_sum)}")

  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  out = ([local["lhs"][d] for d in lb] + [local["lhs"][d] for d in lf]
         + [local["rhs"][d] for d in rf])
  out_shape = ([lhs_shape[d] for d in lb] + [lhs_shape[d] for d in lf]
               + [rhs_shape[d] for d in rf])
  if scatter:
    reason = _free_dim_reason(geometry, len(lb), out, out_shape, axis_sizes, "scatters",
                              "communicated extent", "its other axes")
    if reason:
      return reason
    out[geometry.out_dim] = out[geometry.out_dim] + (scatter,)
  if psummed:
    # the psum keeps the layout; out_dim is only cut into slices, locally
    reason = _free_dim_reason(geometry, len(lb), out, out_shape, axis_sizes, "slices",
                              "sliced extent", "its axes")
    if reason:
      return reason
  if tuple(out) != tuple(out_spec):
    return (f"the rewrite would produce output layout {tuple(out)}, not the declared "
            f"{tuple(out_spec)}")
  return layout_reason("output", out_shape, out, axis_sizes)


def _communication(geometry):
  """([(operand, dim, axis) gathered], scattered axis or None) of the emitted code."""
  if isinstance(geometry, OneDGeometry):
    if geometry.kind == "all_gather":
      operand = "lhs" if geometry.lhs_dim is not None else "rhs"
      dim = geometry.lhs_dim if operand == "lhs" else geometry.rhs_dim
      return [(operand, dim, geometry.axis)], None
    return [], (None if geometry.all_reduce else geometry.axis)
  assert isinstance(geometry, GemmGeometry)
  g = geometry
  if g.dataflow == "os":
    gathers = [("lhs", g.lhs_dim, g.col_axis), ("rhs", g.rhs_dim, g.row_axis)]
    return [t for t in gathers if t[2] is not None], None
  if g.dataflow == "ls":
    return [("rhs", g.rhs_dim, g.row_axis)], g.col_axis
  return [("lhs", g.lhs_dim, g.col_axis)], g.row_axis


def _free_dim_reason(geometry, n_batch, out, out_shape, axis_sizes, verb, extent,
                     shard_of) -> str:
  """Why output dim `geometry.out_dim` cannot be the one the rewrite scatters / slices:
  it must be a free (non-batch) dim whose extent within one shard of its other axes is
  the geometry's global extent. "" when it can."""
  d = geometry.out_dim
  if d is None or not n_batch <= d < len(out):
    return f"the rewrite {verb} output dim {d}, which is not a free dim"
  within = out_shape[d] // _size(out[d], axis_sizes)
  if within != geometry.global_extent:
    return (f"{extent} {geometry.global_extent} is not the size {within} of output dim "
            f"{d} within one shard of {shard_of}")
  return ""


def _size(axes, axis_sizes) -> int:
  return math.prod(axis_sizes[a] for a in axes)


def layout_reason(name, shape, spec, axis_sizes) -> str:
  """Why `spec` is not a layout `shape` can have ("" when it is): one entry per dim,
  each a tuple of known mesh axes, every axis used once, every dim divisible."""
  if spec is None:
    return f"{name} layout unknown"
  if len(spec) != len(shape):
    return f"{name} layout has {len(spec)} entries for {len(shape)} dims"
  seen = []
  for d, tup in enumerate(spec):
    for ax in tup:
      if ax not in axis_sizes:
        return f"{name} dim {d} is split over {ax!r}, which is not a mesh axis"
      if ax in seen:
        return f"mesh axis {ax!r} splits two dims of the {name}"
      seen.append(ax)
    if shape[d] % _size(tup, axis_sizes):
      return (f"{name} dim {d} of size {shape[d]} is not divisible by the "
              f"{_size(tup, axis_sizes)} devices of {tup}")
  return ""
