"""The two rule sets of what can run agree: `meshslice.rewrites` (what the builders accept)
and `meshslice.costmodel.why_invalid` (what the time models price). They are written
twice on purpose (the cost model must not import the rewrites), so this grid checks them
against each other: every algorithm x options x dataflow x ksplit on small meshes and
extents, valid and invalid, for 2D and 1D sites.

A site is described once, as the geometry the pass builds for it and the `GemmProblem`
`meshslice.costing.problem_for` makes of it (only the communicated extent varies; the
other dims always split evenly, since the rewrites never see them). The rewrites' answer
is whether `build_body` builds (it validates without tracing); with ksplit = 1 and no
options, `supports` must give the same answer.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from meshslice import costmodel, rewrites
from meshslice.costmodel import GemmProblem, why_invalid
from meshslice.rewrites import GemmGeometry, OneDGeometry, build_body, supports

DN = (((1,), (0,)), ((), ()))
# dataflow -> (lhs_dim, rhs_dim, out_dim) of X[M, K] . W[K, N]
DIMS = {"os": (1, 0, None), "ls": (None, 1, 1), "rs": (0, None, 0)}
EXTENTS = (5, 6, 8, 12, 16, 24, 36, 48)
KSPLITS = (1, 2, 3, 4)
# (algorithm, options), including options an algorithm does not take and bad values
VARIANTS = (("meshslice", {}), ("collective", {}), ("cannon", {}), ("summa", {}),
            ("wang", {}), ("wang", {"bidirectional": True}), ("wang", {"ring": "row"}),
            ("wang", {"ring": "col", "bidirectional": True}), ("wang", {"ring": "diag"}),
            ("meshslice", {"ring": "row"}), ("collective", {"bidirectional": True}),
            ("summa", {"bidirectional": True}))
# (rows, cols, named): named=False is the pass's os site with one axis absent (None)
MESHES_2D = ((2, 2), (2, 4), (4, 2), (2, 3), (3, 3), (4, 4), (1, 4), (4, 1), (1, 1))
ABSENT_AXIS = ((1, 4), (4, 1))
ONED_SIZES = (2, 3, 4)
ONED_FORMS = ("all_gather_lhs", "all_gather_rhs", "reduce_scatter", "all_reduce")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Case:
  geometry: object
  problem: GemmProblem
  dataflow: str           # the cost model's dataflow ("rs" for a 1D site)
  algorithm: str
  ksplit: int
  options: dict

  @property
  def one_d(self) -> bool:
    return isinstance(self.geometry, OneDGeometry)

  @property
  def absent_axis(self) -> bool:
    return not self.one_d and None in (self.geometry.row_axis, self.geometry.col_axis)

  def rewrites_reason(self) -> str:
    try:
      build_body(self.algorithm, self.geometry, self.ksplit, **self.options)
    except (ValueError, TypeError) as e:      # TypeError: an option the builder lacks
      return str(e) or type(e).__name__
    return ""

  def costmodel_reason(self) -> str:
    return why_invalid(self.problem, self.algorithm, self.dataflow, self.ksplit,
                       **self.options)

  def __str__(self):
    g = self.geometry
    where = (f"1D {g.kind}{' all_reduce' if g.all_reduce else ''} n={g.axis_size}"
             if self.one_d else f"{g.dataflow} {g.row_axis}:{g.row_size} x "
             f"{g.col_axis}:{g.col_size}")
    return (f"{self.algorithm} {self.options} {where} extent={g.global_extent} "
            f"ksplit={self.ksplit}")


def _cases_2d():
  meshes = [(r, c, True) for r, c in MESHES_2D] + [(r, c, False) for r, c in ABSENT_AXIS]
  for (rows, cols, named), dataflow, extent in itertools.product(meshes, DIMS, EXTENTS):
    if not named and dataflow != "os":
      continue                  # only an os site communicates over one axis
    lhs_dim, rhs_dim, out_dim = DIMS[dataflow]
    g = GemmGeometry(dimension_numbers=DN, dataflow=dataflow,
                     row_axis="x" if named or rows > 1 else None,
                     col_axis="y" if named or cols > 1 else None, row_size=rows,
                     col_size=cols, lhs_dim=lhs_dim, rhs_dim=rhs_dim, out_dim=out_dim,
                     global_extent=extent)
    even = rows * cols * 8      # the dims that are not communicated always split
    dims = dict(m=even, n=even, k=even)
    dims[{"os": "k", "ls": "n", "rs": "m"}[dataflow]] = extent
    problem = GemmProblem(rows=rows, cols=cols, **dims)
    for (algorithm, options), ksplit in itertools.product(VARIANTS, KSPLITS):
      yield Case(geometry=g, problem=problem, dataflow=dataflow, algorithm=algorithm,
                 ksplit=ksplit, options=options)


def _cases_1d():
  for size, form, extent in itertools.product(ONED_SIZES, ONED_FORMS, EXTENTS):
    lhs_dim, rhs_dim, out_dim = {"all_gather_lhs": (0, None, 0),
                                 "all_gather_rhs": (None, 1, 1)}.get(form, (1, 0, 0))
    g = OneDGeometry(dimension_numbers=DN,
                     kind="all_gather" if form.startswith("all_gather") else "reduce_scatter",
                     all_reduce=form == "all_reduce", axis="x", axis_size=size,
                     lhs_dim=lhs_dim, rhs_dim=rhs_dim, out_dim=out_dim, global_extent=extent)
    # as costing.problem_for: the communicated dim is M (swapped with N when the rhs's
    # free dim moves), the contracting dim of a reduce-scatter splits over the axis
    problem = GemmProblem.one_d(m=extent, n=size * 8, k=size * 8, size=size,
                                collective="all_reduce" if g.all_reduce else g.kind)
    for (algorithm, options), ksplit in itertools.product(VARIANTS, KSPLITS):
      if options.get("ring") in ("row", "col"):
        continue                # a 1D ring has one axis: build_oned_ring takes no `ring`
      yield Case(geometry=g, problem=problem, dataflow="rs", algorithm=algorithm,
                 ksplit=ksplit, options=options)


CASES = list(_cases_2d()) + list(_cases_1d())


def _collective_ksplit(case) -> bool:
  return (case.algorithm == "collective" and case.ksplit > 1 and not case.options
          and case.geometry.global_extent % case.geometry.lcm == 0)


def _two_axes_rule_on_a_named_size_1_axis(case) -> bool:
  g = case.geometry
  return (case.algorithm in ("cannon", "summa") and not case.one_d and not case.absent_axis
          and min(g.row_size, g.col_size) == 1 and not case.rewrites_reason())


def _wang_with_an_absent_axis(case) -> bool:
  return case.algorithm == "wang" and case.absent_axis and not case.costmodel_reason()


# Where the two rule sets genuinely disagree today: {name: (selects the cases, why)}.
# Neither rule set is changed here; each is an xfail(strict=True) below, so fixing one
# side makes its test pass and fail as XPASS, until its entry is removed.
KNOWN = {
    "collective_ksplit": (
        _collective_ksplit,
        "build_body('collective', g, ksplit) ignores ksplit (build_collective takes "
        "none) while why_invalid rejects a collective with ksplit != 1"),
    "cannon_summa_on_a_named_size_1_axis": (
        _two_axes_rule_on_a_named_size_1_axis,
        "why_invalid requires both mesh axes > 1 for cannon and summa; the rewrites only "
        "refuse an absent (None) axis, so a GemmGeometry naming a size-1 axis builds "
        "(summa on 1xC / Rx1, cannon on 1x1)"),
    "wang_with_an_absent_axis": (
        _wang_with_an_absent_axis,
        "supports refuses wang on an os site with one axis absent (needs two mesh axes); "
        "why_invalid prices it (a ring over the one axis, nothing on the other)"),
}


def _known(case) -> bool:
  return any(select(case) for select, _ in KNOWN.values())


def _disagreements(cases) -> list[str]:
  out = []
  for case in cases:
    ours, theirs = case.rewrites_reason(), case.costmodel_reason()
    if bool(ours) != bool(theirs):
      out.append(f"{case}: rewrites {ours or 'builds it'!r}, costmodel "
                 f"{theirs or 'prices it'!r}")
  return out


def test_the_grid_covers_valid_and_invalid_cases_of_every_algorithm():
  for algorithm in rewrites.ALGORITHMS:
    for one_d in (False, True):
      mine = [c for c in CASES if c.algorithm == algorithm and c.one_d == one_d]
      valid = sum(not c.costmodel_reason() for c in mine)
      assert 0 < valid < len(mine) or (one_d and algorithm in ("cannon", "summa")), (
          algorithm, one_d, valid, len(mine))
  for select, _ in KNOWN.values():
    assert any(select(c) for c in CASES)


def test_rewrites_and_costmodel_agree_on_what_is_valid():
  problems = _disagreements([c for c in CASES if not _known(c)])
  assert not problems, f"{len(problems)} disagreements:\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=why))
    for name, (_, why) in KNOWN.items()])
def test_known_disagreement(name):
  select, _ = KNOWN[name]
  problems = _disagreements([c for c in CASES if select(c)])
  assert not problems, "\n".join(problems[:10])


def test_supports_is_build_body_at_ksplit_1_with_default_options():
  for case in CASES:
    if case.ksplit == 1 and not case.options:
      assert bool(supports(case.algorithm, case.geometry)) == bool(case.rewrites_reason()), (
          str(case))


def test_supports_and_why_invalid_agree_at_ksplit_1():
  problems = [f"{c}: supports {supports(c.algorithm, c.geometry)!r}, costmodel "
              f"{c.costmodel_reason()!r}" for c in CASES
              if c.ksplit == 1 and not c.options and not _known(c)
              and bool(supports(c.algorithm, c.geometry)) != bool(c.costmodel_reason())]
  assert not problems, "\n".join(problems[:40])


def test_the_table_and_the_time_models_know_the_same_algorithms_and_options():
  assert sorted(rewrites.ALGORITHMS) == sorted(costmodel.ALGORITHMS)
  for name in rewrites.ALGORITHMS:
    assert rewrites._TABLE[name].options == costmodel.algorithm_options(name), name


def test_unknown_algorithms_are_refused_alike():
  g = next(c.geometry for c in CASES if not c.one_d)
  assert supports("nope", g).startswith("unknown algorithm 'nope'")
  with pytest.raises(ValueError, match="algorithm must be one of"):
    build_body("nope", g)
  assert why_invalid(GemmProblem(m=8, n=8, k=8, rows=2, cols=2), "nope", "os", 1)
