"""What bounds the planner besides speed: the chip's memory (plans that do not fit HBM are
excluded, a site none of whose plans fits is left alone), the data-centre network between
TPU slices (a mesh axis crossing slices is priced at DCN bandwidth), and the all-gather
half of an all-reduce site's psums."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import aot, backend_flags, costing, planning
from meshslice import analysis as A
from meshslice import specs as S
from meshslice.costmodel import load_profile, profile_for_mesh, site_peak_bytes, topology
from meshslice.costmodel.timing import gemm_time
from meshslice.options import Options

from helpers import mesh

V4 = load_profile("tpu-v4")
GIB = 2**30


def _square(n, shape=(2, 4), **options):
  """The one site of Y = X @ W, both n x n bf16 split P('x', 'y') over an abstract mesh."""
  am = jax.sharding.AbstractMesh(shape, ("x", "y"),
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
  arg = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(am, P("x", "y")))
  site, = meshslice.explain(jax.jit(lambda a, b: a @ b), **options)(arg, arg).sites
  return site


# ----------------------------------------------------------------------------- memory

def test_plans_that_do_not_fit_hbm_are_excluded_and_named():
  # os on 2x4, 131072^2 bf16: shards 4 + 4 GiB; collective gathers X (16 GiB) and W
  # (8 GiB) whole and writes Y (4 GiB): 36 GiB > 32 GiB of a v4 chip
  site = _square(131072, max_ksplit=8, relayout=False)
  assert site.rewritten and (site.dataflow, site.algorithm, site.ksplit) == ("os", "meshslice", 8)
  need = {k: site_peak_bytes(site.problem, "meshslice", "os", k) / GIB for k in (1, 2, 4, 8)}
  assert need == {1: 36.0, 2: 48.0, 4: 36.0, 8: 30.0}
  assert site.note.startswith(
      "excluded for memory: collective S=1 needs 36.0 GiB per chip (input shards 8.0 GiB, "
      "output and buffers 28.0 GiB), 32.0 GiB free of 32.0 GiB HBM (+2 more)")
  # XLA's dense program holds what the collective plan holds, so it is no way out either
  assert "XLA's own program (dense program) does not fit HBM either" in site.note
  # the same site planned for a profile without a capacity: nothing is excluded
  cpu = _square(131072, max_ksplit=8, relayout=False, profile="cpu")
  assert cpu.rewritten and "memory" not in cpu.note


def test_a_site_no_plan_fits_is_left_alone_with_the_nearest_miss():
  site = _square(262144)       # every dataflow, every S <= 4: at least 144 GiB per chip
  assert not site.rewritten and site.algorithm is None and site.predicted_seconds is None
  assert site.reason == (
      "no plan fits HBM: collective S=1 needs 144.0 GiB per chip (input shards 32.0 GiB, "
      "output and buffers 112.0 GiB), 32.0 GiB free of 32.0 GiB HBM")


def test_a_pinned_plan_that_does_not_fit_is_kept_and_flagged():
  site = _square(131072, relayout=False, overrides={0: {"ksplit": 2}})
  assert site.rewritten and (site.algorithm, site.ksplit) == ("meshslice", 2)
  assert "the requested plan does not fit HBM: needs 48.0 GiB per chip" in site.note


def test_choose_excludes_by_the_profiles_capacity_only():
  from meshslice.costmodel import GemmProblem
  p = GemmProblem(m=131072, n=131072, k=131072, rows=2, cols=4)
  fits = costing.choose(p, V4, "os", algorithms=costing.AUTO_ALGORITHMS, ksplits=(1, 2, 4))
  assert fits.algorithm is None and fits.note.startswith("no plan fits HBM: collective S=1")
  roomy = dataclasses.replace(V4, hbm_capacity=40 * GIB)      # collective needs 36 GiB
  assert costing.choose(p, roomy, "os", algorithms=costing.AUTO_ALGORITHMS,
                        ksplits=(1, 2, 4)).algorithm is not None


# ----------------------------------------------------------------------------- multi-slice

def _plan_on(device_mesh, n=8192, **options):
  """Plan Y = X @ W on abstract inputs laid out P('x', 'y') over `device_mesh` (a concrete
  Mesh or an AbstractMesh), the way `meshslice.transform` plans a traced program."""
  arg = jax.ShapeDtypeStruct((n, n), jnp.bfloat16,
                             sharding=NamedSharding(device_mesh, P("x", "y")))
  closed = jax.jit(lambda a, b: a @ b).trace(arg, arg).jaxpr
  axis_sizes = dict(device_mesh.shape)
  in_specs = [S.from_sharding(arg.sharding, 2, axis_sizes)] * 2
  analysis = A.analyze(closed, in_specs, [None], A.Context(axis_sizes=axis_sizes))
  ctx = planning.Context(axis_sizes=axis_sizes, mesh=device_mesh,
                         options=Options.from_kwargs("test", dict(options)))
  return planning.plan_program(closed, analysis, ctx)


@pytest.mark.skipif(not aot.have_libtpu(), reason="needs libtpu")
@pytest.mark.parametrize("dcn_shape, crossing", [((2, 1), 0), ((1, 2), 1)])
def test_an_axis_crossing_slices_is_priced_at_dcn_bandwidth(dcn_shape, crossing):
  from jax.experimental import mesh_utils
  devices = aot.topology("v4:2x2x2", num_slices=2).devices
  per_slice = tuple(4 // d for d in dcn_shape)
  grid = mesh_utils.create_hybrid_device_mesh(per_slice, dcn_shape, devices)
  two_slices = jax.sharding.Mesh(grid, ("x", "y"))
  # the flags that let a TPU rewrite overlap (without them every site is left to XLA)
  flags = backend_flags.tpu_overlap_flags("v4")
  site, = _plan_on(two_slices, relayout=False, compiler_terms=False, compiler_flags=flags)
  dcn = V4.topology.dcn_bandwidth
  bandwidths = site.profile.all_gather.bandwidth
  assert bandwidths[crossing] == dcn and bandwidths[1 - crossing] > 10 * dcn
  assert site.profile.name == "tpu-v4@4x4/2slices"
  expected = costing.predict(site.problem, topology.profile_for_devices(V4, grid),
                             site.algorithm, site.dataflow, site.ksplit)
  assert site.predicted_seconds == pytest.approx(expected, rel=1e-12)
  # the same mesh shape without devices (an AbstractMesh) plans as one slice of ICI
  one, = _plan_on(two_slices.abstract_mesh, relayout=False, compiler_terms=False,
                  compiler_flags=flags)
  assert one.profile.name == "tpu-v4@4x4" and dcn not in one.profile.all_gather.bandwidth
  assert one.baseline_seconds < site.baseline_seconds
  # deterministic: planned again, the same sites
  assert _plan_on(two_slices, relayout=False, compiler_terms=False,
                  compiler_flags=flags) == (site,)


@pytest.mark.skipif(not aot.have_libtpu(), reason="needs libtpu")
def test_explain_prices_a_multislice_mesh_with_its_devices():
  """meshslice.explain hands planning the concrete mesh: the axis crossing two slices is
  priced over DCN there, as by planning directly."""
  from jax.experimental import mesh_utils
  devices = aot.topology("v4:2x2x2", num_slices=2).devices
  grid = mesh_utils.create_hybrid_device_mesh((2, 4), (2, 1), devices)
  two_slices = jax.sharding.Mesh(grid, ("x", "y"))
  arg = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16,
                             sharding=NamedSharding(two_slices, P("x", "y")))
  options = dict(relayout=False, compiler_terms=False)
  site, = meshslice.explain(jax.jit(lambda a, b: a @ b), **options)(arg, arg).sites
  direct, = _plan_on(two_slices, **options)
  assert site.profile.name == "tpu-v4@4x4/2slices"
  assert site.profile.all_gather.bandwidth[0] == V4.topology.dcn_bandwidth
  assert (site.algorithm, site.ksplit, site.predicted_seconds) == (
      direct.algorithm, direct.ksplit, direct.predicted_seconds)


# ----------------------------------------------------------------------------- all-reduce

def _row_parallel():
  """Y[32, 48] = X[32, 64:y] . W[64:y, 48] (float32) on the 2x4 CPU mesh, Y replicated:
  an all-reduce site over y (4 devices)."""
  m = mesh((2, 4))
  sh = lambda *s: NamedSharding(m, P(*s))
  x = jax.device_put(jnp.ones((32, 64)), sh(None, "y"))
  w = jax.device_put(jnp.ones((64, 48)), sh("y", None))
  return jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, sh())), (x, w)


def _ring(c, n, shard):
  """An all-gather / reduce-scatter on profile dim 1 of n devices, shard bytes each."""
  return c.base_overhead[1] + (n - 1) * shard / c.bandwidth[1] + (n - 1) * c.hop_latency[1]


def test_all_reduce_sites_pay_both_halves_of_each_psum():
  f, args = _row_parallel()
  site, = meshslice.explain(f, compiler_terms=False)(*args).sites
  assert site.dataflow == "1d-allreduce" and site.problem.reduction == "all_reduce"
  # the profile the site is priced with: tpu-v4's bandwidths for the 2x4 mesh's axis y
  prof = profile_for_mesh(V4, (2, 4), axes=(1, 1))
  assert site.profile == prof
  # collective: the local matmul (32 x 48 x 64/4), then psum of the 32 x 48 float32 result,
  # a reduce-scatter and an all-gather of its quarter (32 * 48 * 4 / 4 bytes)
  quarter = 32 * 48 * 4 / 4
  psum = _ring(prof.reduce_scatter, 4, quarter) + _ring(prof.all_gather, 4, quarter)
  matmul = gemm_time(prof, 32, 48, 16, in_bytes=4, out_bytes=4)
  assert site.baseline_seconds == pytest.approx(matmul + psum, rel=1e-12)
  # a reduce-scatter alone would leave the all-gather half out
  assert site.baseline_seconds - _ring(prof.all_gather, 4, quarter) == pytest.approx(
      matmul + _ring(prof.reduce_scatter, 4, quarter), rel=1e-12)

  # meshslice S=2: cut (nothing to cut: an op overhead) | matmul 0 | matmul 1 beside psum
  # 0 | psum 1 | concatenate the whole 32 x 48 output
  pinned, = meshslice.explain(f, compiler_terms=False, algorithm="meshslice",
                              ksplit=2)(*args).sites
  half = quarter / 2
  psum = _ring(prof.reduce_scatter, 4, half) + _ring(prof.all_gather, 4, half)
  matmul = gemm_time(prof, 16, 48, 16, in_bytes=4, out_bytes=4)
  concat = 2 * 32 * 48 * 4 / prof.hbm_bandwidth + prof.op_overhead
  assert prof.overlap
  expected = prof.op_overhead + matmul + max(matmul, psum) + psum + concat
  assert pinned.predicted_seconds == pytest.approx(expected, rel=1e-12)


def test_all_reduce_problems_refuse_the_algorithms_not_modelled_for_them():
  from meshslice.costmodel import GemmProblem, why_invalid
  p = GemmProblem.one_d(m=64, n=64, k=64, size=4, collective="all_reduce")
  assert why_invalid(p, "wang", "rs", 1) == (
      "wang is not modelled for an all-reduce site (reduction='all_reduce'): only "
      "collective and meshslice are")
  assert why_invalid(p, "meshslice", "rs", 2) == ""
  with pytest.raises(ValueError, match="reduction must be one of"):
    GemmProblem(m=8, n=8, k=8, rows=2, cols=1, reduction="psum")
