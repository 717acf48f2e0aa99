"""cannon, wang, summa and the 1D collective matmuls of meshslice.rewrites, by hand in
shard_map: values and gradients vs the plain matmul, compiled-HLO structure, errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
from jax.sharding import PartitionSpec as P

from meshslice.rewrites import (ALGORITHMS, GemmGeometry, OneDGeometry, build_body,
                                build_cannon, build_oned_ring, build_summa, build_wang,
                                supports)

from helpers import assert_trees_close, collective_counts, mesh

NEW = ("cannon", "wang", "summa")

# Two problems, each with the layouts of every dataflow (geometry.py's table):
#   plain:   x[M, K] . w[K, N]
#   batched: x[K, B, M, J] . w[B, J, N, K] contracting (K, J), batch B -> y[B, M, N]
DIMS = dict(M=16, K=32, N=48, B=2, J=3)
PROBLEMS = {
    "plain": dict(
        dn=(((1,), (0,)), ((), ())), lhs="MK", rhs="KN", out=P("x", "y"),
        os=(P("x", "y"), P("x", "y"), dict(lhs_dim=1, rhs_dim=0, out_dim=None, extent="K")),
        ls=(P("x", "y"), P("y", "x"), dict(lhs_dim=None, rhs_dim=1, out_dim=1, extent="N")),
        rs=(P("y", "x"), P("x", "y"), dict(lhs_dim=0, rhs_dim=None, out_dim=0, extent="M"))),
    "batched": dict(
        dn=(((0, 3), (3, 1)), ((1,), (0,))), lhs="KBMJ", rhs="BJNK", out=P(None, "x", "y"),
        os=(P("y", None, "x", None), P(None, None, "y", "x"),
            dict(lhs_dim=0, rhs_dim=3, out_dim=None, extent="K")),
        ls=(P("y", None, "x", None), P(None, None, "x", "y"),
            dict(lhs_dim=None, rhs_dim=2, out_dim=2, extent="N")),
        rs=(P("x", None, "y", None), P(None, None, "y", "x"),
            dict(lhs_dim=2, rhs_dim=None, out_dim=1, extent="M"))),
}


def _geometry(problem, dataflow, shape, dims, dtype=jnp.float32):
  spec = PROBLEMS[problem]
  kw = dict(spec[dataflow][2])
  extent = dims[kw.pop("extent")]
  return GemmGeometry(dimension_numbers=spec["dn"], dataflow=dataflow, row_axis="x",
                      col_axis="y", row_size=shape[0], col_size=shape[1],
                      global_extent=extent, out_dtype=jnp.dtype(dtype), **kw)


def _operands(problem, dims, dtype=jnp.float32, seed=0):
  """Standard normal numpy operands: jax.random.normal would compile a program per shape,
  and a jitted shard_map given a single-device jax array compiles one more to slice it
  (numpy arrays are sent to the devices in slices); together most of the property
  test's time."""
  spec = PROBLEMS[problem]
  rng = np.random.RandomState(seed)
  x, w = (rng.standard_normal(tuple(dims[d] for d in spec[side])).astype(np.float32)
          .astype(dtype) for side in ("lhs", "rhs"))
  return x, w


@functools.lru_cache(maxsize=None)
def _fn(algorithm, problem, dataflow, shape, ksplit, dims=tuple(DIMS.items()),
        dtype=jnp.float32, **options):
  """The jitted shard_map of one algorithm (cached: compiling dominates test time)."""
  spec = PROBLEMS[problem]
  g = _geometry(problem, dataflow, shape, dict(dims), dtype)
  lhs_spec, rhs_spec, _ = spec[dataflow]
  body = build_body(algorithm, g, ksplit, **options)
  return jax.jit(jax.shard_map(body, mesh=mesh(shape), in_specs=(lhs_spec, rhs_spec),
                               out_specs=spec["out"]))


def _reference(problem):
  dn = PROBLEMS[problem]["dn"]
  return lambda x, w: jax.lax.dot_general(x, w, dn, precision=jax.lax.Precision.HIGHEST)


def _loss(fn):
  return lambda a, b: jnp.sum(jnp.sin(fn(a, b)))


# (algorithm, mesh, options): every algorithm on (2, 2) and a non-square mesh if it can.
CASES = [
    ("cannon", (2, 2), {}),
    ("wang", (2, 2), {}),
    ("wang", (2, 4), {}),                           # ring over the larger axis, y
    ("wang", (4, 2), dict(bidirectional=True)),     # ring over x, halves both ways
    ("summa", (2, 2), {}),
    ("summa", (2, 4), {}),
]


@pytest.mark.parametrize("dataflow", ["os", "ls", "rs"])
@pytest.mark.parametrize("algorithm,shape,options", CASES,
                         ids=[f"{a}-{s[0]}x{s[1]}{'-bidi' if o else ''}" for a, s, o in CASES])
def test_values_and_grads_match_matmul(algorithm, shape, options, dataflow):
  f = _fn(algorithm, "plain", dataflow, shape, 2, **options)
  x, w = _operands("plain", DIMS)
  # values and gradients from one compiled program (one compile instead of two)
  value, grads = jax.jit(lambda a, b: (f(a, b), jax.grad(_loss(f), (0, 1))(a, b)))(x, w)
  assert_trees_close(value, x @ w)
  assert_trees_close(grads, jax.grad(_loss(lambda a, b: a @ b), (0, 1))(x, w))


@pytest.mark.parametrize("dataflow", ["os", "ls", "rs"])
@pytest.mark.parametrize("algorithm", NEW)
def test_batch_and_multi_contracting_dims(algorithm, dataflow):
  f = _fn(algorithm, "batched", dataflow, (2, 2), 2)
  x, w = _operands("batched", DIMS, seed=1)
  assert_trees_close(f(x, w), _reference("batched")(x, w))


def _sends(f, *args):
  """The element types of the collective_permutes in `f`'s lowered program."""
  return [l.rstrip().rsplit("x", 1)[-1] for l in f.lower(*args).as_text().splitlines()
          if "collective_permute" in l]


@pytest.mark.parametrize("algorithm,dataflow", [("cannon", "ls"), ("wang", "rs")])
def test_bf16_partial_sums_travel_in_the_dtype_the_target_sums_in(algorithm, dataflow):
  """On CPU, partial sums travel in float32: XLA's CPU compiler sums bf16 partials in
  float32 too (plain jit's all-reduces are promoted), so the values match plain jit's.
  For TPU they travel in bf16, as XLA's TPU program sums them."""
  options = dict(ring="row") if algorithm == "wang" else {}     # a reduce-scatter ring
  f = _fn(algorithm, "plain", dataflow, (2, 2), 1, dtype=jnp.bfloat16, **options)
  x, w = _operands("plain", DIMS, jnp.bfloat16)
  out = f(x, w)
  assert out.dtype == jnp.bfloat16
  sends = _sends(f, x, w)           # the moving operand's blocks stay bf16
  assert "f32>" in sends and set(sends) <= {"f32>", "bf16>"}
  assert_trees_close(out, jnp.dot(x, w, preferred_element_type=jnp.float32), jnp.bfloat16)
  pytest.importorskip("libtpu")
  from meshslice import aot
  tpu_mesh = aot.make_mesh("v4:2x2x1", (2, 2))
  spec = PROBLEMS["plain"]
  lhs_spec, rhs_spec, _ = spec[dataflow]
  g = _geometry("plain", dataflow, (2, 2), DIMS, jnp.bfloat16)
  on_tpu = jax.jit(jax.shard_map(build_body(algorithm, g, 1, **options), mesh=tpu_mesh,
                                 in_specs=(lhs_spec, rhs_spec), out_specs=spec["out"]))
  abstract = [jax.ShapeDtypeStruct(v.shape, v.dtype,
                                   sharding=jax.sharding.NamedSharding(tpu_mesh, s))
              for v, s in ((x, lhs_spec), (w, rhs_spec))]
  with jax.set_mesh(tpu_mesh):
    tpu_sends = _sends(on_tpu, *abstract)
  assert tpu_sends and set(tpu_sends) == {"bf16>"}


def _counts(f, problem="plain"):
  x, w = _operands(problem, DIMS)
  return collective_counts(f.lower(x, w).compile().as_text())


NONE = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}


@pytest.mark.parametrize("dataflow,ksplit,permutes", [
    ("os", 1, 2 + 2),          # skew X, skew W; then R - 1 = 1 shift of each
    ("os", 2, 2 + 2 * 2),      # ... per chunk
    ("ls", 2, 1 + 2 * 3),      # skew W; per chunk: 1 W shift, 1 partial-sum shift, 1 unskew
])
def test_cannon_is_only_neighbour_permutes(dataflow, ksplit, permutes):
  counts = _counts(_fn("cannon", "plain", dataflow, (2, 2), ksplit))
  assert counts == dict(NONE, **{"collective-permute": permutes})


@pytest.mark.parametrize("dataflow,options,expect", [
    # (2, 4): ring over y (4 devices): 3 steps per chunk; x keeps its plain collective.
    ("os", {}, {"all-gather": 1, "collective-permute": 3 * 2}),
    ("ls", {}, {"all-gather": 1, "reduce-scatter": 0, "collective-permute": 3 * 2}),
    ("rs", {}, {"all-gather": 0, "reduce-scatter": 1, "collective-permute": 3 * 2}),
    ("ls", dict(ring="row", bidirectional=True),
     {"all-gather": 0, "reduce-scatter": 1, "collective-permute": 1 * 2 * 2}),
])
def test_wang_rings_one_axis(dataflow, options, expect):
  counts = _counts(_fn("wang", "plain", dataflow, (2, 4), 2, **options))
  assert {k: counts[k] for k in expect} == expect
  assert counts["all-reduce"] == 0


@pytest.mark.parametrize("dataflow", ["os", "ls"])
def test_summa_broadcasts_one_panel_per_loop_step(dataflow):
  f = _fn("summa", "plain", dataflow, (2, 4), 2)      # P = 2 * lcm(2, 4) = 8 panels
  x, w = _operands("plain", DIMS)
  hlo = f.lower(x, w).compile().as_text()
  counts = collective_counts(hlo)
  assert counts["all-gather"] == counts["reduce-scatter"] == 0
  assert counts["collective-permute"] == 0
  # Prologue + loop body + epilogue: a handful of all-reduces, not one per panel unrolled
  # (which XLA would merge) and not one merged all-reduce of everything.
  assert 3 <= counts["all-reduce"] <= 6
  assert " while(" in hlo


def _plain_geometry(shape=(2, 4), dataflow="os", extent=32):
  return _geometry("plain", dataflow, shape, dict(DIMS, K=extent, N=extent, M=extent))


def test_supports_says_why_not():
  square, wide = _plain_geometry((2, 2)), _plain_geometry((2, 4))
  assert all(supports(a, square) == "" for a in ALGORITHMS)
  assert [a for a in ALGORITHMS if supports(a, wide)] == ["cannon"]
  assert supports("cannon", wide) == (
      "cannon needs a square mesh (R == C), got 2x4 over ('x', 'y'); use meshslice, "
      "wang or summa on this mesh")
  assert supports("nope", wide) == (
      "unknown algorithm 'nope': expected one of meshslice, collective, cannon, wang, summa")
  odd = _plain_geometry((2, 4), extent=30)
  assert supports("summa", odd) == (
      "summa: communicated extent 30 is not divisible by lcm(R, C) = 4")
  assert supports("meshslice", odd) == (
      "meshslice: communicated extent 30 is not divisible by lcm(R, C) = 4")


def test_builders_raise_the_reason():
  wide = _plain_geometry((2, 4))
  with pytest.raises(ValueError, match=r"^cannon needs a square mesh \(R == C\), got 2x4"):
    build_body("cannon", wide)
  with pytest.raises(ValueError, match=r"^cannon needs a square mesh"):
    build_cannon(wide)
  with pytest.raises(ValueError, match=r"^summa: ksplit=3 does not divide the communicated "
                                       r"extent 32 into ksplit \* lcm = 3 \* 4 equal blocks; "
                                       r"valid ksplit: 1, 2, 4, 8$"):
    build_summa(wide, 3)
  g = _plain_geometry((4, 2), "ls", extent=24)      # ring over x: 24 / 4 = 6 per device
  with pytest.raises(ValueError, match=r"^wang: 2 \* ksplit = 4 must divide the ring block: "
                                       r"the communicated extent 24 / 4 devices on ring "
                                       r"axis 'x' = 6$"):
    build_wang(g, 2, bidirectional=True)
  with pytest.raises(ValueError, match=r"^wang: ring must be one of \('row', 'col'\)"):
    build_wang(g, ring="x")
  with pytest.raises(ValueError, match="algorithm must be one of"):
    build_body("nope", g)


# 1D sites on the (4, 2) mesh, axis x (4 devices):
#   Megatron all_gather:  x[M:x, K] . w[K, N:x] -> y[M, N:x]
#   replicated gather:    x[M:x, K] . w[K, N:y] -> y[M, N:y]   (replicated over x)
#   reduce_scatter:       x[M:y, K:x] . w[K:x, N] -> y[M:y, N:x]
DN = (((1,), (0,)), ((), ()))
ONED = {
    "megatron": (dict(kind="all_gather", lhs_dim=0, rhs_dim=None, out_dim=0, extent="M"),
                 (P("x", None), P(None, "x")), P(None, "x")),
    "replicated": (dict(kind="all_gather", lhs_dim=0, rhs_dim=None, out_dim=0, extent="M"),
                   (P("x", None), P(None, "y")), P(None, "y")),
    "scatter": (dict(kind="reduce_scatter", lhs_dim=1, rhs_dim=0, out_dim=1, extent="N"),
                (P("y", "x"), P("x", None)), P("y", "x")),
}


def _oned_geometry(site, **overrides):
  kw = dict(ONED[site][0])
  extent = DIMS[kw.pop("extent")]
  return OneDGeometry(dimension_numbers=DN, axis="x", axis_size=4, global_extent=extent,
                      out_dtype=jnp.dtype(jnp.float32), **dict(kw, **overrides))


@functools.lru_cache(maxsize=None)
def _oned_fn(site, algorithm, ksplit, **options):
  _, in_specs, out_spec = ONED[site]
  body = build_body(algorithm, _oned_geometry(site), ksplit, **options)
  # A replicated output cannot be proven replicated through ppermutes / barriers.
  check = site != "replicated" or algorithm == "collective"
  return jax.jit(jax.shard_map(body, mesh=mesh((4, 2)), in_specs=in_specs,
                               out_specs=out_spec, check_vma=check))


ONED_CASES = [("collective", 1, {}), ("meshslice", 2, {}), ("wang", 1, {}),
              ("wang", 2, dict(bidirectional=True))]


@pytest.mark.parametrize("site", list(ONED))
@pytest.mark.parametrize("algorithm,ksplit,options", ONED_CASES,
                         ids=[f"{a}-{k}{'-bidi' if o else ''}" for a, k, o in ONED_CASES])
def test_oned_values(site, algorithm, ksplit, options):
  f = _oned_fn(site, algorithm, ksplit, **options)
  x, w = _operands("plain", DIMS)
  assert_trees_close(f(x, w), x @ w)


@pytest.mark.parametrize("site", ["megatron", "scatter"])
def test_oned_ring_grads(site):
  f = _oned_fn(site, "wang", 1)
  x, w = _operands("plain", DIMS)
  assert_trees_close(jax.grad(_loss(f), (0, 1))(x, w),
                     jax.grad(_loss(lambda a, b: a @ b), (0, 1))(x, w))


@pytest.mark.parametrize("site,algorithm,ksplit,expect", [
    ("megatron", "meshslice", 2, {"all-gather": 2, "collective-permute": 0}),
    ("megatron", "wang", 1, {"all-gather": 0, "collective-permute": 3}),
    ("scatter", "meshslice", 2, {"reduce-scatter": 2, "collective-permute": 0}),
    ("scatter", "wang", 1, {"reduce-scatter": 0, "all-reduce": 0, "collective-permute": 3}),
])
def test_oned_hlo(site, algorithm, ksplit, expect):
  counts = _counts(_oned_fn(site, algorithm, ksplit))
  assert {k: counts[k] for k in expect} == expect


def test_oned_errors():
  g = _oned_geometry("megatron")
  assert supports("cannon", g) == (
      "cannon needs a 2D site (a matmul sharded over two mesh axes); this is a 1D "
      "all_gather site over 'x': use one of meshslice, collective, wang")
  assert supports("wang", g) == ""
  with pytest.raises(ValueError, match="^summa needs a 2D site"):
    build_body("summa", g)
  with pytest.raises(ValueError, match=r"^1D all_gather: 2 \* ksplit = 6 must divide the "
                                       r"per-device block 16 / 4 = 4 of mesh axis 'x'$"):
    build_oned_ring(g, 3, bidirectional=True)
  with pytest.raises(ValueError, match="set exactly one of lhs_dim, rhs_dim"):
    _oned_geometry("megatron", rhs_dim=1)
  with pytest.raises(ValueError, match="reduce_scatter OneDGeometry needs both"):
    _oned_geometry("scatter", rhs_dim=None)
  bad = _oned_geometry("megatron", out_dim=1)
  x, w = _operands("plain", DIMS)
  with pytest.raises(ValueError, match=r"^out_dim=1 is rhs dim 1, but the gathered dim is "
                                       r"lhs dim 0"):
    jax.eval_shape(build_body("collective", bad), x, w)


# Property: any valid (mesh, dataflow, algorithm, ksplit, problem) equals dot_general.
@st.composite
def _configs(draw):
  shape = draw(st.sampled_from([(2, 2), (2, 4), (4, 2)]))
  algorithm = draw(st.sampled_from(("meshslice",) + NEW if shape == (2, 2)
                                   else ("meshslice", "wang", "summa")))
  dataflow = draw(st.sampled_from(["os", "ls", "rs"]))
  problem = draw(st.sampled_from(["plain", "batched"]))
  dims = dict(DIMS, **{d: 8 * draw(st.integers(1, 3)) for d in "MKN"})
  options = {}
  if algorithm == "wang":
    options = dict(bidirectional=draw(st.booleans()),
                   ring=draw(st.sampled_from([None, "row", "col"])))
  valid = []
  for s in (1, 2, 4):
    try:
      build_body(algorithm, _geometry(problem, dataflow, shape, dims), s, **options)
      valid.append(s)
    except ValueError:
      pass
  ksplit = draw(st.sampled_from(valid)) if valid else None
  return shape, algorithm, dataflow, problem, tuple(dims.items()), ksplit, options


@settings(max_examples=20, deadline=None, database=None, derandomize=True)
@given(_configs(), st.integers(0, 2**16))
def test_property_matches_dot_general(config, seed):
  shape, algorithm, dataflow, problem, dims, ksplit, options = config
  assume(ksplit is not None)    # e.g. wang bidirectional on an odd ring block
  f = _fn(algorithm, problem, dataflow, shape, ksplit, dims, **options)
  x, w = _operands(problem, dict(dims), seed=seed)
  np.testing.assert_allclose(f(x, w), _reference(problem)(x, w), rtol=1e-4, atol=1e-4)


def test_cannon_on_a_3x3_mesh_in_a_subprocess():
  # On 2 x 2 a shift by +1 equals a shift by -1; an odd mesh catches direction mistakes.
  import os
  import subprocess
  import sys
  code = (
      "import jax, jax.numpy as jnp, numpy as np\n"
      "jax.config.update('jax_num_cpu_devices', 9)\n"
      "import test_algorithms as t\n"
      "dims = dict(t.DIMS, M=18, K=36, N=12)\n"
      "for df in ('os', 'ls', 'rs'):\n"
      "  f = t._fn('cannon', 'plain', df, (3, 3), 2, tuple(dims.items()))\n"
      "  x, w = t._operands('plain', dims)\n"
      "  np.testing.assert_allclose(f(x, w), x @ w, rtol=1e-4, atol=1e-3)\n"
      "print('ok')\n")
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=9",
             JAX_PLATFORMS="cpu", PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
