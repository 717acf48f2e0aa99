"""The gate between matching and emission (`meshslice.validation`), and the sites it and
the analysis must leave alone: each test here reproduces a failure an adversarial run
found (a silent wrong result or a crash) and checks values against an unsharded numpy
reference as well as plain jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import analysis as A
from meshslice import matching
from meshslice.rewrites import GemmGeometry, OneDGeometry
from meshslice.validation import site_reason

from helpers import assert_trees_close, mesh

SIZES = {"x": 2, "y": 4}
MATMUL = (((1,), (0,)), ((), ()))
X, Y = ("x",), ("y",)


def _os(**kw):
  return GemmGeometry(**dict(dict(dimension_numbers=MATMUL, dataflow="os", row_axis="x",
                                  col_axis="y", row_size=2, col_size=4, lhs_dim=1,
                                  rhs_dim=0, out_dim=None, global_extent=64), **kw))


# ------------------------------------------------------------------ the validator alone

def test_validator_accepts_the_three_dataflows():
  assert site_reason(_os(), (16, 64), (64, 32), ((X, Y), (X, Y), (X, Y)), SIZES) == ""
  ls = _os(dataflow="ls", row_axis="x", col_axis="y", lhs_dim=None, rhs_dim=1, out_dim=1,
           global_extent=32)
  assert site_reason(ls, (16, 64), (64, 32), ((X, Y), (Y, X), (X, Y)), SIZES) == ""
  rs = _os(dataflow="rs", row_axis="y", col_axis="x", lhs_dim=0, rhs_dim=None, out_dim=0,
           global_extent=16)
  assert site_reason(rs, (16, 64), (64, 32), ((X, Y), (Y, X), (Y, X)), SIZES) == ""


def test_validator_rejects_contracting_axes_in_another_order():
  scatter = OneDGeometry(dimension_numbers=MATMUL, kind="reduce_scatter", axis="y",
                         axis_size=4, lhs_dim=1, rhs_dim=0, out_dim=1, global_extent=32,
                         reduce_axes=("x",))
  specs = (((), ("x", "y")), (("y", "x"), ()), ((), Y))
  assert site_reason(scatter, (16, 64), (64, 32), specs, SIZES) == (
      "contracting dims lhs 1 and rhs 0 are split over ('x', 'y') and ('y', 'x'): the "
      "local blocks would not hold the same indices (the axes and their order must match)")
  same_order = (((), ("x", "y")), (("x", "y"), ()), ((), Y))
  assert site_reason(scatter, (16, 64), (64, 32), same_order, SIZES) == ""


@pytest.mark.parametrize("specs, geometry, expected", [
    (((X, Y), (X, Y), (Y, Y)), _os(), "the rewrite would produce output layout "
     "(('x',), ('y',)), not the declared (('y',), ('y',))"),
    (((X, Y), (X, Y), (X, ())), _os(), "the rewrite would produce output layout "
     "(('x',), ('y',)), not the declared (('x',), ())"),
    (((X, ("y", "x")), (X, Y), (X, Y)), _os(), "mesh axis 'x' splits two dims of the lhs"),
    ((((), Y), (X, Y), (X, Y)), _os(), "the rewrite would produce output layout "
     "((), ('y',)), not the declared (('x',), ('y',))"),
    (((X, Y), (X, Y), (X, Y)), _os(reduce_axes=("z",)),
     "the local products are partial over [] but the rewrite sums over ['z']"),
    (((X, Y), (X, Y), (X, Y)), _os(global_extent=32),
     "communicated extent 32 is not the size 64 of lhs dim 1 within one shard of its "
     "other axes"),
    (((X, Y), (X, ("z",)), (X, Y)), _os(), "rhs dim 1 is split over 'z', which is not a "
     "mesh axis"),
])
def test_validator_reasons(specs, geometry, expected):
  assert site_reason(geometry, (16, 64), (64, 32), specs, SIZES) == expected


def test_validator_divisibility_and_empty_operands():
  assert site_reason(_os(), (5, 64), (64, 32), ((X, Y), (X, Y), (X, Y)), SIZES) == (
      "lhs dim 0 of size 5 is not divisible by the 2 devices of ('x',)")
  assert site_reason(_os(), (0, 64), (64, 32), ((X, Y), (X, Y), (X, Y)), SIZES) == (
      "an operand has a zero-size dim: nothing to compute or communicate")


def test_classify_drops_candidates_the_validator_cannot_prove():
  sizes = {"x": 2, "y": 2, "z": 2}
  # LS form: cross axis x, contraction over (y, z) on lhs but (z, y) on rhs
  found = matching.classify(MATMUL, (16, 64), (64, 32), (X, ("y", "z")), (("z", "y"), X),
                            sizes)
  assert not found.matches
  assert found.reason.startswith("not provably exact: contracting dims lhs 1 and rhs 0")
  same = matching.classify(MATMUL, (16, 64), (64, 32), (X, ("y", "z")), (("y", "z"), X),
                           sizes)
  assert {m.dataflow for m in same.matches} == {"ls", "rs"}


# ------------------------------------------------------------ whole programs, end to end

def _inputs(*shapes):
  return [np.random.RandomState(i).randn(*s).astype(np.float32) for i, s in enumerate(shapes)]


def _check(f, args, ref):
  """Transformed == plain jit == unsharded numpy, for every algorithm; returns reports."""
  reports = []
  for algorithm in (None, "meshslice", "collective", "wang"):
    out = meshslice.transform(f, algorithm=algorithm)(*args)
    assert_trees_close(out, ref)
    reports.append(meshslice.explain(f, algorithm=algorithm)(*args))
  assert_trees_close(f(*args), ref)
  return reports


@pytest.mark.parametrize("mesh_shape, names, lhs, rhs, out", [
    # 1d-scatter form: K over (x, y) on lhs, (y, x) on rhs
    ((2, 4), ("x", "y"), P(None, ("x", "y")), P(("y", "x"), None), None),
    # LS form: cross axis x, K over (y, z) vs (z, y)
    ((2, 2, 2), ("x", "y", "z"), P("x", ("y", "z")), P(("z", "y"), "x"), None),
    # OS form with a second contracting dim split over (y, z) vs (z, y)
    ((2, 2, 2), ("x", "y", "z"), P("x", None, ("y", "z")), P(None, ("z", "y"), "x"), None),
])
def test_contracting_axes_in_different_orders_are_left_alone(mesh_shape, names, lhs, rhs,
                                                             out):
  m = mesh(mesh_shape, names)
  sh = lambda s: NamedSharding(m, s)
  if len(lhs) == 3:       # two contracting dims
    a, b = _inputs((16, 8, 16), (8, 16, 32))
    fn = lambda a, b: jnp.einsum("mkl,kln->mn", a, b)
    ref = np.einsum("mkl,kln->mn", a, b)
  else:
    a, b = _inputs((16, 64), (64, 32))
    fn = lambda a, b: a @ b
    ref = a @ b
  f = jax.jit(fn, in_shardings=(sh(lhs), sh(rhs)))
  for report in _check(f, (a, b), ref):
    assert not report.rewritten
    assert "the axes and their order must match" in report.sites[0].reason


def test_zero_size_batch_is_left_alone():
  m = mesh((2, 4))
  s = NamedSharding(m, P("x", "y"))
  a, b = np.zeros((0, 64), np.float32), _inputs((64, 32))[0]
  f = jax.jit(lambda a, b: a @ b, in_shardings=(s, s))
  out = meshslice.transform(f)(a, b)
  assert out.shape == (0, 32)
  site, = meshslice.explain(f)(a, b).sites
  assert site.reason == "an operand has a zero-size dim: nothing to compute or communicate"


@pytest.mark.parametrize("lhs, rhs, out, shapes, ksplit, dataflow", [
    # row-parallel matmul with 6 tokens, scattered along N (the model used to split M=6)
    (P(None, "y"), P("y", None), P(None, "y"), ((6, 64), (64, 32)), None, "1d-scatter"),
    (P(None, "y"), P("y", None), P(None, "y"), ((6, 64), (64, 32)), 2, "1d-scatter"),
    # a 1D gather of the rhs with ksplit=4 (the model used to slice M=8 into 16 parts)
    (P("y", None), P(None, "y"), P("y", None), ((8, 32), (32, 64)), 4, "1d-gather"),
])
def test_one_d_sites_are_costed_as_emitted(lhs, rhs, out, shapes, ksplit, dataflow):
  m = mesh((2, 4))
  sh = lambda s: NamedSharding(m, s)
  a, b = _inputs(*shapes)
  f = jax.jit(lambda a, b: a @ b, in_shardings=(sh(lhs), sh(rhs)), out_shardings=sh(out))
  report = meshslice.explain(f, ksplit=ksplit)(a, b)
  site, = report.sites
  assert (site.dataflow, site.rewritten) == (dataflow, True)
  assert site.predicted_seconds > 0
  assert_trees_close(meshslice.transform(f, ksplit=ksplit)(a, b), a @ b)


def test_inferred_layouts_that_do_not_divide_stay_unknown():
  # a consumer "wants" 8 devices on a dim of size 2: the analysis must not believe it
  closed = jax.make_jaxpr(lambda v: v * 2)(jnp.zeros((2, 8)))
  result = A.analyze(closed, [None], [(("x", "y"), ())], A.Context(axis_sizes=SIZES))
  assert result.specs.get(closed.jaxpr.outvars[0]) is None
  assert result.specs.get(closed.jaxpr.invars[0]) is None
  fine = A.analyze(closed, [None], [(X, ())], A.Context(axis_sizes=SIZES))
  assert fine.specs.get(closed.jaxpr.invars[0]) == (X, ())


def test_explicit_types_win_over_out_shardings():
  m = mesh((2, 4), explicit=True)
  sh = lambda *s: NamedSharding(m, P(*s))
  x, w1, w2 = (jax.device_put(v, sh("x", "y")) for v in _inputs((16, 32), (32, 64), (64, 32)))

  def f(x, w1, w2):
    h = jnp.matmul(x, w1, out_sharding=P("x", "y"))
    return h, jnp.matmul(h, w2, out_sharding=P("x", "y"))

  # h is returned with another layout than its type, and also feeds the second matmul
  g = jax.jit(f, out_shardings=(sh("y", "x"), sh("x", "y")))
  with jax.set_mesh(m):
    out = meshslice.transform(g)(x, w1, w2)
    report = meshslice.explain(g)(x, w1, w2)
  xn, w1n, w2n = map(np.asarray, (x, w1, w2))
  assert_trees_close(out, (xn @ w1n, xn @ w1n @ w2n))
  assert out[0].sharding.spec == P("y", "x")
  assert [s.lhs_spec for s in report.sites] == ["P('x', 'y')", "P('x', 'y')"]


def test_explicit_specs_naming_size_one_axes():
  # fuzzer finding: the type keeps a size-1 axis the analysis drops; the shard_map's
  # in_specs must still match the type
  m = jax.make_mesh((4, 1), ("z", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                    devices=jax.devices()[:4])
  a, b = _inputs((8, 16), (16,))
  x = jax.device_put(a, NamedSharding(m, P("z", None)))
  w = jax.device_put(b, NamedSharding(m, P(("z", "y"))))
  f = jax.jit(lambda a, b: a @ b)
  with jax.set_mesh(m):
    out = meshslice.transform(f)(x, w)
    assert meshslice.explain(f)(x, w).sites[0].rewritten
  assert_trees_close(out, a @ b)
