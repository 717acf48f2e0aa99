"""All-reduce sites (issue 11 item 4): a matmul contracting a dim split over an axis whose
result is wanted unsplit over that axis (a row-parallel layer feeding replicated
activations, a data-parallel weight gradient) becomes psums of output slices, each beside
the next slice's matmul ("1d-allreduce")."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import matching, validation
from meshslice.rewrites import OneDGeometry, build_body, supports

from helpers import assert_trees_close, mesh

DN = (((1,), (0,)), ((), ()))


def _row_parallel(m, out=P()):
  """Y[M, N] = X[M, K:y] . W[K:y, N], the result wanted replicated (`out`)."""
  sh = lambda *s: NamedSharding(m, P(*s))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (32, 64)), sh(None, "y"))
  w = jax.device_put(jax.random.normal(jax.random.key(1), (64, 48)) / 8, sh("y", None))

  def layer(x, w):
    return jax.lax.with_sharding_constraint(jnp.tanh(x) @ w, NamedSharding(m, out))

  return jax.jit(layer, in_shardings=(sh(None, "y"), sh("y", None))), (x, w)


def _unsharded(f, args):
  return f(*[np.asarray(a) for a in args])


def test_row_parallel_layer_values_and_gradients():
  m = mesh((2, 4))
  f, args = _row_parallel(m)
  report = meshslice.explain(f, ksplit=2)(*args)
  (site,) = report.sites
  assert (site.dataflow, site.algorithm, site.ksplit, site.mesh_axes, site.out_spec) == (
      "1d-allreduce", "meshslice", 2, ("y",), "P(None, None)")
  fast = meshslice.transform(f, ksplit=2)
  plain = jax.jit(lambda x, w: jnp.tanh(x) @ w)
  assert_trees_close(fast(*args), f(*args))
  assert_trees_close(fast(*args), _unsharded(plain, args))

  loss = lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  fast_grad = meshslice.transform(grad, ksplit=2)
  flows = [s.dataflow for s in meshslice.explain(grad, ksplit=2)(*args).rewritten]
  assert "1d-allreduce" in flows
  assert_trees_close(fast_grad(*args), grad(*args))
  ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(jnp.tanh(x) @ w)), argnums=(0, 1))
  assert_trees_close(fast_grad(*args), ref(*[np.asarray(a) for a in args]))


def test_jaxpr_interleaves_one_psum_per_slice_with_the_dots():
  m = mesh((2, 4))
  f, args = _row_parallel(m)
  jaxpr = jax.make_jaxpr(meshslice.transform(f, ksplit=4))(*args)
  (body,) = [e.params["jaxpr"] for e in _walk(jaxpr.jaxpr) if e.primitive.name == "shard_map"]
  # jax 0.10 binds a psum whose result is invariant over the axis as "psum_invariant"
  name = lambda e: "psum" if e.primitive.name.startswith("psum") else e.primitive.name
  order = [name(e) for e in body.eqns if name(e) in ("dot_general", "psum", "pipeline_barrier")]
  # dot 0 | psum 0 beside dot 1 | psum 1 beside dot 2 | psum 2 beside dot 3 | psum 3
  # (the last matmul needs no barrier: nothing follows it)
  assert order == (["dot_general", "pipeline_barrier"]
                   + ["psum", "dot_general", "pipeline_barrier"] * 2
                   + ["psum", "dot_general", "psum"])
  psums = [e for e in body.eqns if name(e) == "psum"]
  assert all(tuple(e.params["axes"]) == ("y",) for e in psums)
  # each psum carries one quarter of the local output (32 rows cut into 4)
  assert all(e.invars[0].aval.shape == (8, 48) for e in psums)


def _walk(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for p in ("jaxpr", "call_jaxpr"):
      sub = e.params.get(p)
      if sub is not None and e.primitive.name != "shard_map":
        yield from _walk(getattr(sub, "jaxpr", sub))


def test_data_parallel_weight_gradient_psums_over_every_contracting_axis():
  """dW[K, N:y] = X[B:(d, x), K]^T . dY[B:(d, x), N:y] wanted unsplit over d and x: the
  sliced psum sums over both axes at once."""
  m = mesh((2, 2, 2), ("d", "x", "y"))
  sh = lambda *s: NamedSharding(m, P(*s))
  x = jax.device_put(jax.random.normal(jax.random.key(2), (16, 32)), sh(("d", "x"), None))
  dy = jax.device_put(jax.random.normal(jax.random.key(3), (16, 24)), sh(("d", "x"), "y"))

  def wgrad(x, dy):
    dw = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))
    return jax.lax.with_sharding_constraint(dw, sh(None, "y"))

  f = jax.jit(wgrad)
  (site,) = meshslice.explain(f, ksplit=2)(x, dy).sites
  assert (site.dataflow, site.ksplit, site.out_spec) == ("1d-allreduce", 2, "P(None, 'y')")
  assert site.geometry.reduce_axes == ("x",) and site.geometry.axis == "d"
  fast = meshslice.transform(f, ksplit=2)
  assert_trees_close(fast(x, dy), f(x, dy))
  assert_trees_close(fast(x, dy), np.asarray(x).T @ np.asarray(dy))


def test_consumer_wanting_the_result_split_gets_the_reduce_scatter_form():
  """Same layer, the consumer wants rows split over y: a reduce-scatter, not an all-reduce;
  and one whose rows are already split over x gets y appended as the minor axis."""
  m = mesh((2, 4))
  f, args = _row_parallel(m, out=P("y", None))
  (site,) = meshslice.explain(f, ksplit=2)(*args).sites
  assert (site.dataflow, site.out_spec) == ("1d-scatter", "P('y', None)")
  assert_trees_close(meshslice.transform(f, ksplit=2)(*args), f(*args))

  sh = lambda *s: NamedSharding(m, P(*s))
  x = jax.device_put(jax.random.normal(jax.random.key(4), (32, 64)), sh("x", "y"))
  w = jax.device_put(jax.random.normal(jax.random.key(5), (64, 48)) / 8, sh("y", None))
  g = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, sh(("x", "y"), None)))
  (site,) = meshslice.explain(g, ksplit=2)(x, w).sites
  assert (site.dataflow, site.out_spec) == ("1d-scatter", "P(('x', 'y'), None)")
  assert_trees_close(meshslice.transform(g, ksplit=2)(x, w), np.asarray(x) @ np.asarray(w))


def test_site_it_cannot_slice_is_left_alone_with_the_reason():
  """No free dim divisible by the axis size: neither scatter nor sliced psum is exact."""
  found = matching.classify(DN, (3, 8), (8, 5), ((), ("y",)), (("y",), ()), {"y": 4})
  assert found.matches == ()
  assert found.reason == ("contraction split over 'y' and no free dim can take the scattered "
                          "result or be cut into slices: a plain all-reduce")
  m = mesh((1, 4))
  sh = lambda *s: NamedSharding(m, P(*s))
  x = jax.device_put(jnp.ones((3, 8)), sh(None, "y"))
  w = jax.device_put(jnp.ones((8, 5)), sh("y", None))
  f = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, sh()))
  (site,) = meshslice.explain(f)(x, w).sites
  assert not site.rewritten and site.reason == found.reason


def test_validator_proves_the_all_reduce_and_rejects_a_wrong_declaration():
  g = OneDGeometry(dimension_numbers=DN, kind="reduce_scatter", all_reduce=True, axis="y",
                   axis_size=4, lhs_dim=1, rhs_dim=0, out_dim=0, global_extent=32)
  y = ("y",)
  specs = (((), y), (y, ()), ((), ()))
  assert validation.site_reason(g, (32, 64), (64, 48), specs, {"y": 4}) == ""
  # declaring the output split over y (what a reduce-scatter would give) is refused
  bad = (((), y), (y, ()), (y, ()))
  assert validation.site_reason(g, (32, 64), (64, 48), bad, {"y": 4}) == (
      "the rewrite would produce output layout ((), ()), not the declared (('y',), ())")
  # a psum over y alone when the contraction is also split over x is refused
  xy = ("x", "y")
  two = (((), xy), (xy, ()), ((), ()))
  assert validation.site_reason(g, (32, 64), (64, 48), two, {"x": 2, "y": 4}) == (
      "the local products are partial over ['x', 'y'] but the rewrite sums over ['y']")
  # the sliced extent must be the local size of out_dim
  wrong = OneDGeometry(dimension_numbers=DN, kind="reduce_scatter", all_reduce=True,
                       axis="y", axis_size=4, lhs_dim=1, rhs_dim=0, out_dim=0,
                       global_extent=16)
  assert validation.site_reason(wrong, (32, 64), (64, 48), specs, {"y": 4}) == (
      "sliced extent 16 is not the size 32 of output dim 0 within one shard of its axes")


def test_ring_algorithm_refuses_all_reduce_sites():
  g = OneDGeometry(dimension_numbers=DN, kind="reduce_scatter", all_reduce=True, axis="y",
                   axis_size=4, lhs_dim=1, rhs_dim=0, out_dim=0, global_extent=32)
  assert supports("wang", g).startswith("wang: an all-reduce site keeps its result whole")
  assert supports("meshslice", g) == supports("collective", g) == ""
  with pytest.raises(ValueError, match="needs kind='reduce_scatter'"):
    OneDGeometry(dimension_numbers=DN, kind="all_gather", all_reduce=True, axis="y",
                 axis_size=4, lhs_dim=0, rhs_dim=None, out_dim=0, global_extent=32)
  assert callable(build_body("meshslice", g, 4))


def test_a_saved_all_reduce_plan_loads_and_applies(tmp_path):
  m = mesh((2, 4))
  f, args = _row_parallel(m)
  path = tmp_path / "plan.json"
  meshslice.explain(f, ksplit=2)(*args).plan.save(str(path))
  (site,) = meshslice.explain(f, plan=str(path))(*args).sites
  assert (site.dataflow, site.ksplit) == ("1d-allreduce", 2)
  assert_trees_close(meshslice.transform(f, plan=str(path))(*args), f(*args))


def test_bf16_partial_sums_are_summed_as_plain_jit_sums_them_on_cpu():
  """K split over two axes, the result wanted whole: the partial products are psummed.
  XLA's CPU program sums bf16 partials in float32 (found by bench/fuzz.py: rounding them
  to bf16 first put a cancelling bf16 loss 22 % off where plain jit matched the float32
  reference); the transformed site now returns plain jit's values bit for bit. jax >= 0.11's
  CPU program rounds each device's partial product to bf16 before that float32 sum; there
  the site keeps the float32 sum rounded once, never further from it than plain jit."""
  msh = mesh((2, 2, 2), ("d", "x", "y"), explicit=True)
  rng = np.random.default_rng(0)
  a_host, c_host = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(2))

  def fn(a, c):
    lhs = jax.sharding.reshard(c, P("d", ("y", "x")))
    rhs = jax.sharding.reshard(a, P(("y", "x"), None))
    return jnp.matmul(lhs, rhs, out_sharding=P("d", None))

  with jax.set_mesh(msh):
    a = jax.device_put(jnp.asarray(a_host, jnp.bfloat16), NamedSharding(msh, P("d", "y")))
    c = jax.device_put(jnp.asarray(c_host, jnp.bfloat16), NamedSharding(msh, P("x", "y")))
    plain = jax.jit(fn)
    fast = meshslice.transform(plain, algorithm="collective")
    site, = fast.explain(a, c).rewritten
    assert site.dataflow == "1d-allreduce"
    got, want = fast(a, c), plain(a, c)
  assert got.dtype == jnp.bfloat16
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  once = (np.asarray(c, np.float32) @ np.asarray(a, np.float32)).astype(jnp.bfloat16)
  once = once.astype(np.float32)              # the float32 sum, rounded to bf16 once
  if np.array_equal(want, once):              # jax 0.10.2's CPU program
    np.testing.assert_array_equal(got, want)
  else:                                       # jax >= 0.11 rounds the partials first
    np.testing.assert_array_equal(got, once)
