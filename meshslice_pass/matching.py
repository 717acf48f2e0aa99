"""Matching: is a dot_general a 2D-sharded site, and which dataflows can serve it?

Write the site as Y[M, N] = X[M, K] . W[K, N] where M, K, N are the groups of lhs free,
contracting and rhs free dims (batch dims ride along). Each mesh axis that shards an
operand is classified by where it appears:

  lhs M and rhs K   -> the row axis r of OS      lhs K and rhs N  -> the column axis c of OS
  lhs M and rhs N   -> the "cross" axis of LS/RS (must move: it cannot split Y twice)
  lhs K and rhs K (same contracting pair)   -> LS/RS's scatter axis, or an extra reduction
  only lhs M, only rhs N, or a batch dim    -> passes through (no communication)

OS needs exactly one r and one c on the same contracting pair. LS and RS need one cross
axis a and a contracting axis b; LS outputs (M:a, N:b), RS outputs (M:b, N:a), so the
output layout the program wants decides between them.
"""
from __future__ import annotations

import dataclasses
import math

from . import specs as S


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Match:
  """One way to serve a site: a dataflow and where it communicates."""
  dataflow: str
  row_axis: str
  col_axis: str
  lhs_dim: int | None
  rhs_dim: int | None
  out_dim: int | None
  global_extent: int
  reduce_axes: tuple
  out_spec: tuple


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Classification:
  """All dataflows that can serve a dot_general (empty `matches` means: left alone)."""
  matches: tuple = ()
  reason: str = ""


def _groups(dimension_numbers, lhs_ndim, rhs_ndim):
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
  return list(lc), list(rc), list(lb), list(rb), lf, rf


def natural_output_spec(dimension_numbers, lhs_spec, rhs_spec):
  """Output spec of a dot_general that needs no communication, or None if it does."""
  lc, rc, lb, rb, lf, rf = _groups(dimension_numbers, len(lhs_spec), len(rhs_spec))
  if any(lhs_spec[a] != rhs_spec[b] for a, b in zip(lc, rc)):
    return None
  if any(lhs_spec[a] != rhs_spec[b] for a, b in zip(lb, rb)):
    return None
  out = [lhs_spec[d] for d in lb] + [lhs_spec[d] for d in lf] + [rhs_spec[d] for d in rf]
  flat = [a for e in out for a in e]
  if len(flat) != len(set(flat)):
    return None
  return tuple(out)


def classify(dimension_numbers, lhs_shape, rhs_shape, lhs_spec, rhs_spec,
             axis_sizes: dict) -> Classification:
  """Every dataflow (os/ls/rs) that serves this dot_general, or why none does."""
  if lhs_spec is None or rhs_spec is None:
    return Classification(reason="operand sharding unknown (no in_shardings, constraint or "
                                 "explicit-mode type reaches this matmul)")
  lc, rc, lb, rb, lf, rf = _groups(dimension_numbers, len(lhs_shape), len(rhs_shape))
  nbatch = len(lb)
  for a, b in zip(lb, rb):
    if lhs_spec[a] != rhs_spec[b]:
      return Classification(reason=f"batch dims sharded differently: lhs {S.describe(lhs_spec)}"
                                   f", rhs {S.describe(rhs_spec)}")
  batch_axes = {ax for d in lb for ax in lhs_spec[d]}
  where = {}   # axis -> list of (operand, group, dim)
  for operand, spec, groups in (("lhs", lhs_spec, (("M", lf), ("K", lc))),
                                ("rhs", rhs_spec, (("N", rf), ("K", rc)))):
    for group, dims in groups:
      for d in dims:
        for ax in spec[d]:
          where.setdefault(ax, []).append((operand, group, d))
  if not where:
    return Classification(reason="no mesh axis shards a non-batch dim (nothing to "
                                 "communicate)" if batch_axes else
                                 "unsharded: no mesh axis splits either operand")

  def kpos(operand, d):
    return (lc if operand == "lhs" else rc).index(d)

  os_row, os_col, cross, shared_k, passthrough = [], [], [], [], []
  for ax in sorted(where, key=lambda a: list(axis_sizes).index(a)):
    sig = sorted((o, g) for o, g, _ in where[ax])
    dims = {(o, g): d for o, g, d in where[ax]}
    if sig == [("lhs", "M"), ("rhs", "K")]:
      os_row.append((ax, dims[("rhs", "K")]))
    elif sig == [("lhs", "K"), ("rhs", "N")]:
      os_col.append((ax, dims[("lhs", "K")]))
    elif sig == [("lhs", "M"), ("rhs", "N")]:
      cross.append((ax, dims[("lhs", "M")], dims[("rhs", "N")]))
    elif sig == [("lhs", "K"), ("rhs", "K")]:
      if kpos("lhs", dims[("lhs", "K")]) != kpos("rhs", dims[("rhs", "K")]):
        return Classification(reason=f"axis {ax!r} splits different contracting dims of "
                                     "lhs and rhs")
      shared_k.append((ax, dims[("lhs", "K")], dims[("rhs", "K")]))
    elif sig in ([("lhs", "M")], [("rhs", "N")]):
      passthrough.append(ax)
    else:
      places = ", ".join(f"{o} {g}-dim {d}" for o, g, d in where[ax])
      return Classification(reason=f"axis {ax!r} appears at {places}: not an OS/LS/RS "
                                   "pattern (needs resharding GSPMD would insert)")

  tp_axes = [a for a, *_ in os_row + os_col + cross]
  if not tp_axes and not shared_k:
    involved = ", ".join(sorted(set(passthrough)))
    return Classification(reason=f"no communication needed: axis {involved} splits only one "
                                 "operand's free dims (runs locally)")
  def out_spec(m_override=None, n_override=None):
    out = [lhs_spec[d] for d in lb]
    for d in lf:
      out.append(m_override[1] if m_override and m_override[0] == d else lhs_spec[d])
    for d in rf:
      out.append(n_override[1] if n_override and n_override[0] == d else rhs_spec[d])
    return tuple(out)

  def out_position(operand, d):
    return nbatch + (lf.index(d) if operand == "lhs" else len(lf) + rf.index(d))

  def extras(spec, d):
    """The axes that split dim d besides its last (minor) one."""
    return tuple(spec[d][:-1])

  def extent(shape, spec, d):
    """Extent of dim d within one shard of its extra (major) axes: what the minor axis
    communicates. The communicated axis must be the minor one, so that gathering or
    scattering over it keeps every shard of the extra axes contiguous."""
    return shape[d] // math.prod(axis_sizes[a] for a in extras(spec, d))

  def minor_or_reason(operand, spec, d, ax):
    if spec[d][-1] != ax:
      return (f"{operand} dim {d} is split over {spec[d]} with {ax!r} not last: the "
              "communicated axis must be the minor one")
    return ""

  def largest(axes):
    return max(axes, key=lambda t: (axis_sizes[t[0]], -list(axis_sizes).index(t[0])))

  matches = []
  if os_row or os_col:
    if not cross and len(os_row) + len(os_col) == 1:
      # 1D: one operand's contracting dim is split (a sequence-parallel weight gradient):
      # OS with the other axis of size 1 -- only that operand is gathered, slice by slice.
      if os_row:
        (r, rk), c = os_row[0], None
        lk = lc[rc.index(rk)]
        why = minor_or_reason("rhs", rhs_spec, rk, r) or (
            "" if not lhs_spec[lk] else f"lhs contracting dim {lk} is split as well")
        extent_k = extent(rhs_shape, rhs_spec, rk) if not why else 0
      else:
        (c, lk), r = os_col[0], None
        rk = rc[lc.index(lk)]
        why = minor_or_reason("lhs", lhs_spec, lk, c) or (
            "" if not rhs_spec[rk] else f"rhs contracting dim {rk} is split as well")
        extent_k = extent(lhs_shape, lhs_spec, lk) if not why else 0
      if why:
        return Classification(reason=why)
      return Classification(matches=(Match(
          dataflow="os", row_axis=r, col_axis=c, lhs_dim=lk, rhs_dim=rk, out_dim=None,
          global_extent=extent_k, reduce_axes=tuple(a for a, *_ in shared_k),
          out_spec=out_spec()),))
    if cross or len(os_row) != 1 or len(os_col) != 1:
      return Classification(reason="mixed sharding: parts of the OS pattern without the "
                                   "rest (each of r and c must split one dim of each operand)")
    (r, rk), (c, lk) = os_row[0], os_col[0]
    if kpos("lhs", lk) != kpos("rhs", rk):
      return Classification(reason="OS pattern splits different contracting dims on lhs "
                                   "and rhs")
    why = (minor_or_reason("lhs", lhs_spec, lk, c) or minor_or_reason("rhs", rhs_spec, rk, r)
           or ("" if extras(lhs_spec, lk) == extras(rhs_spec, rk) else
               "the contracting dim is split over different extra axes on lhs and rhs"))
    if why:
      return Classification(reason=why)
    matches.append(Match(dataflow="os", row_axis=r, col_axis=c, lhs_dim=lk, rhs_dim=rk,
                         out_dim=None, global_extent=extent(lhs_shape, lhs_spec, lk),
                         reduce_axes=tuple(a for a, *_ in shared_k), out_spec=out_spec()))
  elif len(cross) > 1:
    return Classification(reason=f"axes {[a for a, *_ in cross]} split both M and N; "
                                 "at most one can move")
  elif cross and not shared_k:
    # 1D all-gather (sequence-parallel input of a Megatron block): one operand's free dim
    # is gathered; which one depends on the output layout the program wants.
    a, m_dim, n_dim = cross[0]
    if not minor_or_reason("lhs", lhs_spec, m_dim, a):
      matches.append(Match(dataflow="1d-gather", row_axis=a, col_axis=a, lhs_dim=m_dim,
                           rhs_dim=None, out_dim=out_position("lhs", m_dim),
                           global_extent=extent(lhs_shape, lhs_spec, m_dim), reduce_axes=(),
                           out_spec=out_spec(m_override=(m_dim, extras(lhs_spec, m_dim)))))
    if not minor_or_reason("rhs", rhs_spec, n_dim, a):
      matches.append(Match(dataflow="1d-gather", row_axis=a, col_axis=a, lhs_dim=None,
                           rhs_dim=n_dim, out_dim=out_position("rhs", n_dim),
                           global_extent=extent(rhs_shape, rhs_spec, n_dim), reduce_axes=(),
                           out_spec=out_spec(n_override=(n_dim, extras(rhs_spec, n_dim)))))
    if not matches:
      return Classification(reason=minor_or_reason("lhs", lhs_spec, m_dim, a))
  elif cross:
    a, m_dim, n_dim = cross[0]
    # Any contracting axis b can carry the reduce-scatter (the others are summed with a
    # psum): one LS and one RS candidate per b, the largest b first (ties: mesh order),
    # and the output layout the program wants picks among them.
    for b, _, _ in sorted(shared_k, key=lambda t: (-axis_sizes[t[0]],
                                                   list(axis_sizes).index(t[0]))):
      reduce = tuple(x for x, *_ in shared_k if x != b)
      if not minor_or_reason("rhs", rhs_spec, n_dim, a):
        matches.append(Match(
            dataflow="ls", row_axis=a, col_axis=b, lhs_dim=None, rhs_dim=n_dim,
            out_dim=out_position("rhs", n_dim),
            global_extent=extent(rhs_shape, rhs_spec, n_dim), reduce_axes=reduce,
            out_spec=out_spec(n_override=(n_dim, extras(rhs_spec, n_dim) + (b,)))))
      if not minor_or_reason("lhs", lhs_spec, m_dim, a):
        matches.append(Match(
            dataflow="rs", row_axis=b, col_axis=a, lhs_dim=m_dim, rhs_dim=None,
            out_dim=out_position("lhs", m_dim),
            global_extent=extent(lhs_shape, lhs_spec, m_dim), reduce_axes=reduce,
            out_spec=out_spec(m_override=(m_dim, extras(lhs_spec, m_dim) + (b,)))))
    if not matches:
      return Classification(reason=minor_or_reason("rhs", rhs_spec, n_dim, a))
  else:
    # 1D reduce-scatter (row-parallel linear): partial sums over axis b are scattered
    # along a free dim that is not split yet; which one depends on the wanted layout.
    b, lk, rk = largest(shared_k)
    reduce = tuple(x for x, *_ in shared_k if x != b)
    for operand, dims, shape, spec in (("lhs", lf, lhs_shape, lhs_spec),
                                       ("rhs", rf, rhs_shape, rhs_spec)):
      for d in dims:
        if spec[d] or shape[d] % axis_sizes[b]:
          continue
        override = {"m_override" if operand == "lhs" else "n_override": (d, (b,))}
        matches.append(Match(dataflow="1d-scatter", row_axis=b, col_axis=b, lhs_dim=lk,
                             rhs_dim=rk, out_dim=out_position(operand, d),
                             global_extent=shape[d], reduce_axes=reduce,
                             out_spec=out_spec(**override)))
    if not matches:
      return Classification(reason=f"contraction split over {b!r} and no free dim can take "
                                   "the scattered result: a plain all-reduce")
  matches = [m for m in matches if len(S.axes_of(m.out_spec)) == len(set(S.axes_of(m.out_spec)))]
  if not matches:
    return Classification(reason="the output would need one mesh axis on two dims")
  return Classification(matches=tuple(matches))


def choose(classification: Classification, demanded_out_spec):
  """The match whose output layout the program wants; the first one when unconstrained.

  Returns (match or None, reason)."""
  if not classification.matches:
    return None, classification.reason
  if demanded_out_spec is None:
    return classification.matches[0], ""
  first = classification.matches[0]
  if first.dataflow == "1d-scatter" and first.row_axis not in S.axes_of(demanded_out_spec):
    return None, (f"contraction split over {first.row_axis!r} and the result is wanted "
                  "unsplit over it: a plain all-reduce, left to GSPMD")
  for m in classification.matches:
    if m.out_spec == demanded_out_spec:
      return m, ""
  if len(classification.matches) == 1:
    # Auto mode: our output layout is valid; GSPMD reshards it if needed downstream.
    return classification.matches[0], ""
  # Neither LS nor RS produces the demanded layout: prefer the one closer to it.
  def agreement(m):
    return sum(a == b for a, b in zip(m.out_spec, demanded_out_spec))
  return max(classification.matches, key=agreement), ""
