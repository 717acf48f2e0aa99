"""The algorithms of meshslice.rewrites, used by hand inside shard_map."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshslice.rewrites import (GemmGeometry, assemble_slices, build_body, plain_gemm,
                                take_slice)

from helpers import assert_trees_close, collective_counts, mesh

M, K, N = 32, 64, 48
DN = (((1,), (0,)), ((), ()))
LAYOUTS = {
    "os": ((P("x", "y"), P("x", "y")), dict(lhs_dim=1, rhs_dim=0, out_dim=None, global_extent=K)),
    "ls": ((P("x", "y"), P("y", "x")), dict(lhs_dim=None, rhs_dim=1, out_dim=1, global_extent=N)),
    "rs": ((P("y", "x"), P("x", "y")), dict(lhs_dim=0, rhs_dim=None, out_dim=0, global_extent=M)),
}


def _run(shape, dataflow, ksplit, algorithm="meshslice", dtype=jnp.float32):
  m = mesh(shape)
  specs, kw = LAYOUTS[dataflow]
  g = GemmGeometry(dimension_numbers=DN, dataflow=dataflow, row_axis="x", col_axis="y",
                   row_size=shape[0], col_size=shape[1], out_dtype=jnp.dtype(dtype), **kw)
  f = jax.jit(jax.shard_map(build_body(algorithm, g, ksplit), mesh=m, in_specs=specs,
                            out_specs=P("x", "y")))
  x = jax.random.normal(jax.random.key(0), (M, K), dtype)
  w = jax.random.normal(jax.random.key(1), (K, N), dtype)
  return f, x, w


@pytest.mark.parametrize("dataflow", ["os", "ls", "rs"])
def test_plain_gemm_lays_out_each_dataflow_as_the_table(dataflow):
  specs, kw = LAYOUTS[dataflow]
  dtype = jnp.dtype(jnp.float32)
  geometry, lhs_axes, rhs_axes = plain_gemm(dataflow, M, K, N, 2, 4, dtype)
  assert (P(*lhs_axes), P(*rhs_axes)) == specs
  assert geometry == GemmGeometry(dimension_numbers=DN, dataflow=dataflow, row_axis="x",
                                  col_axis="y", row_size=2, col_size=4, out_dtype=dtype, **kw)
  # other axis names: the same layout over them
  renamed, lhs2, rhs2 = plain_gemm(dataflow, M, K, N, 2, 4, dtype, axes=("r", "c"))
  names = {"x": "r", "y": "c"}
  assert (lhs2, rhs2) == (tuple(names[a] for a in lhs_axes), tuple(names[a] for a in rhs_axes))
  assert (renamed.row_axis, renamed.col_axis) == ("r", "c")
  # the body it describes computes x @ w with those specs
  m = mesh((2, 4))
  f = jax.jit(jax.shard_map(build_body("meshslice", geometry, 2), mesh=m,
                            in_specs=(P(*lhs_axes), P(*rhs_axes)), out_specs=P("x", "y")))
  x = jax.random.normal(jax.random.key(0), (M, K), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (K, N), jnp.float32)
  np.testing.assert_allclose(f(x, w), x @ w, rtol=1e-5, atol=1e-4)


def test_plain_gemm_refuses_an_unknown_dataflow():
  with pytest.raises(ValueError, match="dataflow must be one of"):
    plain_gemm("xs", M, K, N, 2, 4, jnp.float32)


def test_take_and_assemble_are_inverse():
  x = np.arange(48).reshape(4, 12)
  pieces = [take_slice(x, 1, 3, 2, s) for s in range(3)]
  assert np.asarray(pieces[1]).tolist()[0] == [2, 3, 8, 9]
  np.testing.assert_array_equal(assemble_slices(pieces, 1, 2), x)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (2, 2)])
@pytest.mark.parametrize("dataflow", ["os", "ls", "rs"])
def test_meshslice_matches_dot_values_and_grads(shape, dataflow):
  f, x, w = _run(shape, dataflow, 2)
  assert_trees_close(f(x, w), x @ w)
  loss = lambda fn: (lambda a, b: jnp.sum(jnp.sin(fn(a, b))))
  assert_trees_close(jax.grad(loss(f), (0, 1))(x, w),
                     jax.grad(loss(lambda a, b: a @ b), (0, 1))(x, w))


@pytest.mark.parametrize("dataflow,ksplit,expect", [
    ("os", 4, {"all-gather": 8, "reduce-scatter": 0}),
    ("ls", 4, {"all-gather": 4, "reduce-scatter": 4}),
    ("rs", 2, {"all-gather": 2, "reduce-scatter": 2}),
])
def test_compiled_hlo_keeps_one_collective_per_slice(dataflow, ksplit, expect):
  f, x, w = _run((2, 4), dataflow, ksplit)
  counts = collective_counts(f.lower(x, w).compile().as_text())
  assert {k: counts[k] for k in expect} == expect


def test_bf16_accumulates_in_f32():
  f, x, w = _run((2, 4), "os", 4, dtype=jnp.bfloat16)
  out = f(x, w)
  assert out.dtype == jnp.bfloat16
  ref = jnp.dot(x, w, preferred_element_type=jnp.float32)
  assert_trees_close(out, ref, jnp.bfloat16)


def test_invalid_ksplit_is_rejected():
  g = GemmGeometry(dimension_numbers=DN, dataflow="os", row_axis="x", col_axis="y",
                   row_size=2, col_size=4, lhs_dim=1, rhs_dim=0, out_dim=None, global_extent=K)
  assert g.valid_ksplits() == (1, 2, 4, 8, 16)
  with pytest.raises(ValueError, match=r"ksplit=3 does not divide the communicated extent 64"):
    build_body("meshslice", g, 3)
  with pytest.raises(ValueError, match="algorithm must be one of"):
    build_body("nope", g, 1)


@pytest.mark.parametrize("algorithm", ["meshslice", "cannon", "wang", "summa"])
def test_row_axis_second_in_mesh_order(algorithm):
  # r = "y", c = "x": algorithms must not assume the row axis comes first in the mesh
  # (multi-axis ppermutes number devices in mesh order, not in the order names are given)
  m = mesh((2, 2))
  x = jax.random.normal(jax.random.key(0), (8, 8))
  w = jax.random.normal(jax.random.key(1), (8, 8))
  layouts = {"os": ((P("y", "x"), P("y", "x")), dict(lhs_dim=1, rhs_dim=0, out_dim=None)),
             "ls": ((P("y", "x"), P("x", "y")), dict(lhs_dim=None, rhs_dim=1, out_dim=1)),
             "rs": ((P("x", "y"), P("y", "x")), dict(lhs_dim=0, rhs_dim=None, out_dim=0))}
  for dataflow, (specs, kw) in layouts.items():
    g = GemmGeometry(dimension_numbers=DN, dataflow=dataflow, row_axis="y", col_axis="x",
                     row_size=2, col_size=2, global_extent=8, **kw)
    f = jax.jit(jax.shard_map(build_body(algorithm, g, 1), mesh=m, in_specs=specs,
                              out_specs=P("y", "x")))
    assert_trees_close(f(x, w), x @ w)


def test_vmap_spmd_axis_over_a_sliced_transformed_step():
  # issue 8 item 10: under vmap(spmd_axis_name=...) the batched activations vary over the
  # spmd axis and the unbatched weight does not; the pipelining barrier joins both
  import meshslice
  from jax.sharding import NamedSharding

  m = mesh((2, 2, 2), ("b", "x", "y"))
  s = lambda *spec: NamedSharding(m, P(*spec))
  step = jax.jit(lambda x, w: x @ w, in_shardings=(s("x", "y"), s("x", "y")),
                 out_shardings=s("x", "y"))
  x = jax.random.normal(jax.random.key(0), (2, M, K))
  w = jax.random.normal(jax.random.key(1), (K, N))
  xs, ws = jax.device_put(x, s("b", "x", "y")), jax.device_put(w, s("x", "y"))

  def loss(fn):
    batched = jax.vmap(fn, in_axes=(0, None), spmd_axis_name="b")
    return lambda a, b: jnp.sum(jnp.sin(batched(a, b)))

  fast = meshslice.transform(step, algorithm="meshslice", ksplit=2)
  assert "meshslice os S=2" in str(meshslice.explain(step, algorithm="meshslice",
                                                     ksplit=2)(x[0], w))
  got = jax.value_and_grad(loss(fast), (0, 1))(xs, ws)
  plain = jax.value_and_grad(loss(step), (0, 1))(xs, ws)
  cpu0 = jax.devices()[0]
  reference = jax.value_and_grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), (0, 1))(
      jax.device_put(x, cpu0), jax.device_put(w, cpu0))
  assert_trees_close(got, plain)
  assert_trees_close(got, reference)
