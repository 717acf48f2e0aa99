"""Matching: is a dot_general a 2D-sharded site, and which dataflows can serve it?

Write the site as Y[M, N] = X[M, K] . W[K, N] where M, K, N are the groups of lhs free,
contracting and rhs free dims (batch dims ride along). Classification reads like
docs/design.md, one small step each:

  describe    each operand's per-dim axis tuples, grouped into M, K, N and batch
  roles       each mesh axis by where it appears:
                lhs M and rhs K   -> the row axis r of OS
                lhs K and rhs N   -> the column axis c of OS
                lhs M and rhs N   -> the "cross" axis of LS/RS (must move: it cannot
                                     split Y twice)
                lhs K and rhs K   -> LS/RS's scatter axis, or an extra reduction
                only lhs M, only rhs N -> passes through (no communication)
  candidates  OS needs one r and one c on the same contracting pair; LS and RS need one
              cross axis a and a contracting axis b (LS outputs (M:a, N:b), RS outputs
              (M:b, N:a), so the output layout the program wants decides); 1D sites
              have one axis only; a contraction split with no cross axis is an
              all-reduce (the result kept whole) or a reduce-scatter onto a free dim
  validate    `validation.site_reason` proves each candidate's shard_map computes the
              dot_general (axis tuples equal *in order* on every contracting and batch
              pair, divisibility, the output layout); candidates it cannot prove are
              dropped, and if none is left the site is left alone with its reason
  choose      the candidate whose output layout the program wants
"""
from __future__ import annotations

import dataclasses
import math

from meshslice.rewrites import GemmGeometry, OneDGeometry

from . import specs as S
from . import validation


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


class _LeftAlone(Exception):
  """Raised inside the classification steps: the site cannot be served, and why."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Operands:
  """Step 1: the dot_general's dim groups and each operand's per-dim axis tuples."""
  dimension_numbers: tuple
  lhs_shape: tuple
  rhs_shape: tuple
  lhs_spec: tuple
  rhs_spec: tuple
  axis_sizes: dict
  lc: tuple
  rc: tuple
  lb: tuple
  rb: tuple
  lf: tuple
  rf: tuple

  def out_position(self, operand, d):
    nb = len(self.lb)
    return nb + (self.lf.index(d) if operand == "lhs" else len(self.lf) + self.rf.index(d))

  def out_spec(self, m_override=None, n_override=None):
    """The output layout with lhs-free dim (or rhs-free dim) d replaced: (d, axes)."""
    out = [self.lhs_spec[d] for d in self.lb]
    for d in self.lf:
      out.append(m_override[1] if m_override and m_override[0] == d else self.lhs_spec[d])
    for d in self.rf:
      out.append(n_override[1] if n_override and n_override[0] == d else self.rhs_spec[d])
    return tuple(out)

  def extent(self, operand, d):
    """Extent of dim d within one shard of its extra (major) axes: what the minor axis
    communicates."""
    shape, spec = ((self.lhs_shape, self.lhs_spec) if operand == "lhs"
                   else (self.rhs_shape, self.rhs_spec))
    return shape[d] // math.prod(self.axis_sizes[a] for a in spec[d][:-1])

  def extras(self, operand, d):
    """The axes that split dim d besides its last (minor) one."""
    return tuple((self.lhs_spec if operand == "lhs" else self.rhs_spec)[d][:-1])

  def minor_reason(self, operand, d, ax):
    spec = self.lhs_spec if operand == "lhs" else self.rhs_spec
    if spec[d][-1] != ax:
      return (f"{operand} dim {d} is split over {spec[d]} with {ax!r} not last: the "
              "communicated axis must be the minor one")
    return ""

  def mesh_order(self, axis):
    return list(self.axis_sizes).index(axis)


def _groups(dimension_numbers, lhs_ndim, rhs_ndim):
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
  return list(lc), list(rc), list(lb), list(rb), lf, rf


def natural_output_spec(dimension_numbers, lhs_spec, rhs_spec):
  """Output spec of a dot_general that needs no communication, or None if it does.

  A contraction split over an axis needs a sum over it, and its result can be left
  split (reduce-scatter) or whole (all-reduce): the consumers decide, so None."""
  lc, rc, lb, rb, lf, rf = _groups(dimension_numbers, len(lhs_spec), len(rhs_spec))
  if any(lhs_spec[a] != rhs_spec[b] or lhs_spec[a] for a, b in zip(lc, rc)):
    return None
  if any(lhs_spec[a] != rhs_spec[b] for a, b in zip(lb, rb)):
    return None
  out = [lhs_spec[d] for d in lb] + [lhs_spec[d] for d in lf] + [rhs_spec[d] for d in rf]
  flat = [a for e in out for a in e]
  if len(flat) != len(set(flat)):
    return None
  return tuple(out)


def describe(dimension_numbers, lhs_shape, rhs_shape, lhs_spec, rhs_spec,
             axis_sizes) -> Operands:
  """Step 1: group the dims; refuse unknown, empty and batch-mismatched operands."""
  if lhs_spec is None or rhs_spec is None:
    raise _LeftAlone("operand sharding unknown (no in_shardings, constraint or "
                     "explicit-mode type reaches this matmul)")
  why = S.typed_reason("lhs", lhs_spec) or S.typed_reason("rhs", rhs_spec)
  if why:
    raise _LeftAlone(why)
  if 0 in tuple(lhs_shape) + tuple(rhs_shape):
    raise _LeftAlone("an operand has a zero-size dim: nothing to compute or communicate")
  lc, rc, lb, rb, lf, rf = _groups(dimension_numbers, len(lhs_shape), len(rhs_shape))
  for a, b in zip(lb, rb):
    if lhs_spec[a] != rhs_spec[b]:
      raise _LeftAlone(f"batch dims sharded differently: lhs {S.describe(lhs_spec)}, "
                       f"rhs {S.describe(rhs_spec)}")
  return Operands(dimension_numbers=dimension_numbers, lhs_shape=tuple(lhs_shape),
                  rhs_shape=tuple(rhs_shape), lhs_spec=tuple(lhs_spec),
                  rhs_spec=tuple(rhs_spec), axis_sizes=dict(axis_sizes),
                  lc=tuple(lc), rc=tuple(rc), lb=tuple(lb), rb=tuple(rb), lf=tuple(lf),
                  rf=tuple(rf))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Roles:
  """Step 2: what each mesh axis does in this matmul (see the module docstring)."""
  os_row: tuple = ()       # (axis, rhs K dim)
  os_col: tuple = ()       # (axis, lhs K dim)
  cross: tuple = ()        # (axis, lhs M dim, rhs N dim)
  shared_k: tuple = ()     # (axis, lhs K dim, rhs K dim)
  passthrough: tuple = ()  # axis


def roles(ops: Operands) -> Roles:
  where = {}   # axis -> list of (operand, group, dim)
  for operand, spec, groups in (("lhs", ops.lhs_spec, (("M", ops.lf), ("K", ops.lc))),
                                ("rhs", ops.rhs_spec, (("N", ops.rf), ("K", ops.rc)))):
    for group, dims in groups:
      for d in dims:
        for ax in spec[d]:
          where.setdefault(ax, []).append((operand, group, d))
  if not where:
    batch_axes = {ax for d in ops.lb for ax in ops.lhs_spec[d]}
    raise _LeftAlone("no mesh axis shards a non-batch dim (nothing to communicate)"
                     if batch_axes else "unsharded: no mesh axis splits either operand")
  found = {"os_row": [], "os_col": [], "cross": [], "shared_k": [], "passthrough": []}
  for ax in sorted(where, key=ops.mesh_order):
    sig = sorted((o, g) for o, g, _ in where[ax])
    dims = {(o, g): d for o, g, d in where[ax]}
    if sig == [("lhs", "M"), ("rhs", "K")]:
      found["os_row"].append((ax, dims[("rhs", "K")]))
    elif sig == [("lhs", "K"), ("rhs", "N")]:
      found["os_col"].append((ax, dims[("lhs", "K")]))
    elif sig == [("lhs", "M"), ("rhs", "N")]:
      found["cross"].append((ax, dims[("lhs", "M")], dims[("rhs", "N")]))
    elif sig == [("lhs", "K"), ("rhs", "K")]:
      lk, rk = dims[("lhs", "K")], dims[("rhs", "K")]
      if ops.lc.index(lk) != ops.rc.index(rk):
        raise _LeftAlone(f"axis {ax!r} splits different contracting dims of lhs and rhs")
      found["shared_k"].append((ax, lk, rk))
    elif sig in ([("lhs", "M")], [("rhs", "N")]):
      found["passthrough"].append(ax)
    else:
      places = ", ".join(f"{o} {g}-dim {d}" for o, g, d in where[ax])
      raise _LeftAlone(f"axis {ax!r} appears at {places}: not an OS/LS/RS pattern (needs "
                       "resharding GSPMD would insert)")
  found = Roles(**{k: tuple(v) for k, v in found.items()})
  if not (found.os_row or found.os_col or found.cross or found.shared_k):
    involved = ", ".join(sorted(set(found.passthrough)))
    raise _LeftAlone(f"no communication needed: axis {involved} splits only one operand's "
                     "free dims (runs locally)")
  return found


def candidates(ops: Operands, r: Roles) -> list:
  """Step 3: every dataflow the roles allow (not yet validated)."""
  if r.os_row or r.os_col:
    if not r.cross and len(r.os_row) + len(r.os_col) == 1:
      return _os_one_axis(ops, r)
    if r.cross or len(r.os_row) != 1 or len(r.os_col) != 1:
      raise _LeftAlone("mixed sharding: parts of the OS pattern without the rest (each of r "
                       "and c must split one dim of each operand)")
    return _os(ops, r)
  if len(r.cross) > 1:
    raise _LeftAlone(f"axes {[a for a, *_ in r.cross]} split both M and N; at most one can "
                     "move")
  if r.cross and not r.shared_k:
    return _gather_1d(ops, r)
  if r.cross:
    return _ls_rs(ops, r)
  return _scatter_1d(ops, r)


def _os(ops, r):
  (row, rk), (col, lk) = r.os_row[0], r.os_col[0]
  if ops.lc.index(lk) != ops.rc.index(rk):
    raise _LeftAlone("OS pattern splits different contracting dims on lhs and rhs")
  why = ops.minor_reason("lhs", lk, col) or ops.minor_reason("rhs", rk, row)
  if why:
    raise _LeftAlone(why)
  return [Match(dataflow="os", row_axis=row, col_axis=col, lhs_dim=lk, rhs_dim=rk,
                out_dim=None, global_extent=ops.extent("lhs", lk),
                reduce_axes=tuple(a for a, *_ in r.shared_k), out_spec=ops.out_spec())]


def _os_one_axis(ops, r):
  """One operand's contracting dim is split (a sequence-parallel weight gradient): OS with
  the other axis of size 1 -- only that operand is gathered, slice by slice."""
  if r.os_row:
    (row, rk), col = r.os_row[0], None
    lk = ops.lc[ops.rc.index(rk)]
    why = ops.minor_reason("rhs", rk, row)
    extent = ops.extent("rhs", rk)
  else:
    (col, lk), row = r.os_col[0], None
    rk = ops.rc[ops.lc.index(lk)]
    why = ops.minor_reason("lhs", lk, col)
    extent = ops.extent("lhs", lk)
  if why:
    raise _LeftAlone(why)
  return [Match(dataflow="os", row_axis=row, col_axis=col, lhs_dim=lk, rhs_dim=rk,
                out_dim=None, global_extent=extent,
                reduce_axes=tuple(a for a, *_ in r.shared_k), out_spec=ops.out_spec())]


def _gather_1d(ops, r):
  """1D all-gather (sequence-parallel input of a Megatron block): one operand's free dim
  is gathered; which one depends on the output layout the program wants."""
  a, m_dim, n_dim = r.cross[0]
  found = []
  if not ops.minor_reason("lhs", m_dim, a):
    found.append(Match(dataflow="1d-gather", row_axis=a, col_axis=a, lhs_dim=m_dim,
                       rhs_dim=None, out_dim=ops.out_position("lhs", m_dim),
                       global_extent=ops.extent("lhs", m_dim), reduce_axes=(),
                       out_spec=ops.out_spec(m_override=(m_dim, ops.extras("lhs", m_dim)))))
  if not ops.minor_reason("rhs", n_dim, a):
    found.append(Match(dataflow="1d-gather", row_axis=a, col_axis=a, lhs_dim=None,
                       rhs_dim=n_dim, out_dim=ops.out_position("rhs", n_dim),
                       global_extent=ops.extent("rhs", n_dim), reduce_axes=(),
                       out_spec=ops.out_spec(n_override=(n_dim, ops.extras("rhs", n_dim)))))
  if not found:
    raise _LeftAlone(ops.minor_reason("lhs", m_dim, a))
  return found


def _ls_rs(ops, r):
  """Any contracting axis b can carry the reduce-scatter (the others are summed with a
  psum): one LS and one RS candidate per b, the largest b first (ties: mesh order), and
  the output layout the program wants picks among them."""
  a, m_dim, n_dim = r.cross[0]
  found = []
  for b, _, _ in sorted(r.shared_k, key=lambda t: (-ops.axis_sizes[t[0]],
                                                   ops.mesh_order(t[0]))):
    reduce = tuple(x for x, *_ in r.shared_k if x != b)
    if not ops.minor_reason("rhs", n_dim, a):
      found.append(Match(
          dataflow="ls", row_axis=a, col_axis=b, lhs_dim=None, rhs_dim=n_dim,
          out_dim=ops.out_position("rhs", n_dim), global_extent=ops.extent("rhs", n_dim),
          reduce_axes=reduce,
          out_spec=ops.out_spec(n_override=(n_dim, ops.extras("rhs", n_dim) + (b,)))))
    if not ops.minor_reason("lhs", m_dim, a):
      found.append(Match(
          dataflow="rs", row_axis=b, col_axis=a, lhs_dim=m_dim, rhs_dim=None,
          out_dim=ops.out_position("lhs", m_dim), global_extent=ops.extent("lhs", m_dim),
          reduce_axes=reduce,
          out_spec=ops.out_spec(m_override=(m_dim, ops.extras("lhs", m_dim) + (b,)))))
  if not found:
    raise _LeftAlone(ops.minor_reason("rhs", n_dim, a))
  return found


def _scatter_1d(ops, r):
  """1D reduce-scatter (row-parallel linear, FSDP weight gradient): partial sums over a
  contracting axis b are scattered along a free dim, appended to that dim's axes as the
  minor one; the other contracting axes are summed with a psum. One candidate per b (the
  largest first, ties: mesh order) and free dim (unsplit dims first), so the output layout
  the program wants picks among them. First comes the all-reduce form (`_all_reduce_1d`):
  the result unsplit over every contracting axis, what GSPMD gives when nobody asks."""
  # the all-reduce first: with no consumer asking, the result stays whole, as in GSPMD
  found = _all_reduce_1d(ops, r)
  for b, lk, rk in sorted(r.shared_k, key=lambda t: (-ops.axis_sizes[t[0]],
                                                     ops.mesh_order(t[0]))):
    reduce = tuple(x for x, *_ in r.shared_k if x != b)
    free = [("lhs", d, ops.lhs_shape, ops.lhs_spec) for d in ops.lf]
    free += [("rhs", d, ops.rhs_shape, ops.rhs_spec) for d in ops.rf]
    for operand, d, shape, spec in sorted(free, key=lambda t: bool(t[3][t[1]])):
      extent = shape[d] // math.prod(ops.axis_sizes[a] for a in spec[d])
      if extent % ops.axis_sizes[b]:
        continue
      override = {"m_override" if operand == "lhs" else "n_override": (d, spec[d] + (b,))}
      found.append(Match(dataflow="1d-scatter", row_axis=b, col_axis=b, lhs_dim=lk,
                         rhs_dim=rk, out_dim=ops.out_position(operand, d),
                         global_extent=extent, reduce_axes=reduce,
                         out_spec=ops.out_spec(**override)))
  if not found:
    b = max(r.shared_k, key=lambda t: (ops.axis_sizes[t[0]], -ops.mesh_order(t[0])))[0]
    raise _LeftAlone(f"contraction split over {b!r} and no free dim can take the scattered "
                     "result or be cut into slices: a plain all-reduce")
  return found


def _all_reduce_1d(ops, r):
  """The all-reduce form: psum the partial sums over every contracting axis, slice by
  slice along a free dim whose local extent the largest contracting axis divides: not the
  output's last dim if another fits (cutting the minor dim costs copies on TPU), then the
  largest, then the more major. The output layout stays as it is."""
  axis, lk, rk = max(r.shared_k, key=lambda t: (ops.axis_sizes[t[0]], -ops.mesh_order(t[0])))
  last = len(ops.lb) + len(ops.lf) + len(ops.rf) - 1
  fits = []
  for operand, dims, shape, spec in (("lhs", ops.lf, ops.lhs_shape, ops.lhs_spec),
                                     ("rhs", ops.rf, ops.rhs_shape, ops.rhs_spec)):
    for d in dims:
      extent = shape[d] // math.prod(ops.axis_sizes[a] for a in spec[d])
      position = ops.out_position(operand, d)
      if extent % ops.axis_sizes[axis] == 0:
        fits.append((position == last, -extent, position))
  if not fits:
    return []
  _, extent, out_dim = min(fits)
  extent = -extent
  return [Match(dataflow="1d-allreduce", row_axis=axis, col_axis=axis, lhs_dim=lk,
                rhs_dim=rk, out_dim=out_dim, global_extent=extent,
                reduce_axes=tuple(x for x, *_ in r.shared_k if x != axis),
                out_spec=ops.out_spec())]


def geometry_of(match: Match, dimension_numbers, axis_sizes, **dot_params):
  """The rewrite geometry that emits `match` (dot_params: precision,
  preferred_element_type, out_dtype)."""
  common = dict(dimension_numbers=dimension_numbers, lhs_dim=match.lhs_dim,
                rhs_dim=match.rhs_dim, out_dim=match.out_dim,
                global_extent=match.global_extent, reduce_axes=match.reduce_axes,
                **dot_params)
  if match.dataflow.startswith("1d"):
    return OneDGeometry(
        kind="all_gather" if match.dataflow == "1d-gather" else "reduce_scatter",
        all_reduce=match.dataflow == "1d-allreduce",
        axis=match.row_axis, axis_size=axis_sizes[match.row_axis], **common)
  return GemmGeometry(dataflow=match.dataflow, row_axis=match.row_axis,
                      col_axis=match.col_axis, row_size=axis_sizes.get(match.row_axis, 1),
                      col_size=axis_sizes.get(match.col_axis, 1), **common)


# Where the two axes go in each 2D dataflow, for a site whose output is (M:r, N:c):
# operand -> group -> "r" or "c" (the table in docs/design.md).
_LAYOUTS = {"os": {"lhs": {"M": "r", "K": "c"}, "rhs": {"K": "r", "N": "c"}},
            "ls": {"lhs": {"M": "r", "K": "c"}, "rhs": {"K": "c", "N": "r"}},
            "rs": {"lhs": {"M": "c", "K": "r"}, "rhs": {"K": "r", "N": "c"}}}


def relayouts(dimension_numbers, lhs_shape, rhs_shape, lhs_spec, rhs_spec, match: Match,
              axis_sizes) -> list:
  """The other 2D dataflows that give `match`'s output layout if the operands are
  resharded first: [(match', lhs_spec', rhs_spec')], each proved by `classify`.

  E.g. an OS site X[M:r, K:c] . W[K:r, N:c] can run as LS once W is resharded to
  (K:c, N:r): W moves instead of X, which pays when X is the bigger operand."""
  if match.dataflow not in _LAYOUTS or None in (match.row_axis, match.col_axis):
    return []
  lc, rc, lb, rb, lf, rf = _groups(dimension_numbers, len(lhs_shape), len(rhs_shape))
  out = match.out_spec
  m_part, n_part = out[len(lb):len(lb) + len(lf)], out[len(lb) + len(lf):]
  pair = {match.row_axis, match.col_axis}
  r = next((a for e in m_part for a in e if a in pair), None)
  c = next((a for e in n_part for a in e if a in pair), None)
  if r is None or c is None or r == c:
    return []
  m_dim = lf[next(i for i, e in enumerate(m_part) if r in e)]
  n_dim = rf[next(i for i, e in enumerate(n_part) if c in e)]
  k_pairs = [(a, b) for a, b in zip(lc, rc)
             if pair & set(lhs_spec[a] + rhs_spec[b])]
  if len(k_pairs) != 1:
    return []
  (lk, rk), = k_pairs
  dims = {"lhs": {"M": m_dim, "K": lk}, "rhs": {"K": rk, "N": n_dim}}
  found = []
  for dataflow, layout in _LAYOUTS.items():
    if dataflow == match.dataflow:
      continue
    specs = {}
    for operand, spec in (("lhs", lhs_spec), ("rhs", rhs_spec)):
      entries = [tuple(a for a in e if a not in pair) for e in spec]
      for group, role in layout[operand].items():
        entries[dims[operand][group]] += ({"r": r, "c": c}[role],)
      specs[operand] = tuple(entries)
    classified = classify(dimension_numbers, lhs_shape, rhs_shape, specs["lhs"],
                          specs["rhs"], axis_sizes)
    for m in classified.matches:
      if m.dataflow == dataflow and m.out_spec == out:
        found.append((m, specs["lhs"], specs["rhs"]))
        break
  return found


def classify(dimension_numbers, lhs_shape, rhs_shape, lhs_spec, rhs_spec,
             axis_sizes: dict) -> Classification:
  """Every dataflow (os/ls/rs/1d) that provably serves this dot_general, or why none does."""
  try:
    ops = describe(dimension_numbers, lhs_shape, rhs_shape, lhs_spec, rhs_spec, axis_sizes)
    proposed = candidates(ops, roles(ops))
  except _LeftAlone as e:
    return Classification(reason=str(e))
  matches, reasons = [], []
  for m in proposed:
    why = validation.site_reason(geometry_of(m, dimension_numbers, axis_sizes),
                                 lhs_shape, rhs_shape, (lhs_spec, rhs_spec, m.out_spec),
                                 axis_sizes)
    if why:
      reasons.append(why)
    else:
      matches.append(m)
  if not matches:
    return Classification(reason=f"not provably exact: {reasons[0]}")
  return Classification(matches=tuple(matches))


def choose(classification: Classification, demanded_out_spec):
  """The match whose output layout the program wants; the first one when unconstrained.

  A site whose contraction is split and whose result is wanted unsplit over every
  contracting axis gets the all-reduce form ("1d-allreduce") when it was proved, else it
  is left alone (GSPMD's all-reduce). Returns (match or None, reason)."""
  if not classification.matches:
    return None, classification.reason
  why = S.typed_reason("result", demanded_out_spec)
  if why:
    return None, why
  if demanded_out_spec is None:
    return classification.matches[0], ""
  for m in classification.matches:
    if m.out_spec == demanded_out_spec:
      return m, ""
  scatters = [m for m in classification.matches if m.dataflow == "1d-scatter"]
  if scatters or classification.matches[0].dataflow == "1d-allreduce":
    wanted = S.axes_of(demanded_out_spec)
    usable = [m for m in scatters if m.row_axis in wanted]
    if not usable:
      reduce = [m for m in classification.matches if m.dataflow == "1d-allreduce"]
      if reduce:
        # the consumer reshards the replicated result as it would GSPMD's
        return reduce[0], ""
      b = scatters[0].row_axis
      return None, (f"contraction split over {b!r} and the result is wanted unsplit over "
                    "it: a plain all-reduce, left to GSPMD")
    return _closest(usable, demanded_out_spec), ""
  if len(classification.matches) == 1:
    # Auto mode: our output layout is valid; GSPMD reshards it if needed downstream.
    return classification.matches[0], ""
  return _closest(classification.matches, demanded_out_spec), ""


def _closest(matches, demanded_out_spec):
  """Neither LS nor RS (nor any scatter dim) produces the demanded layout: prefer the one
  closer to it."""
  def agreement(m):
    return sum(a == b for a, b in zip(m.out_spec, demanded_out_spec))
  return max(matches, key=agreement)
