"""Property: whatever the pass does to a sharded dot_general, values and gradients equal
`jax.lax.dot_general` on the same inputs (random meshes, dimension numbers, dim orders,
shardings, sizes that divide and some that do not, dtypes, algorithms).

Tolerance as in docs/guide.md, "Numerics" (float32 1e-4 relative to the largest entry).
In bfloat16 both programs round differently, so each is compared with the float32 result
on the same inputs: the transformed one may be off by at most max(4x the original's error, 2e-2).
"""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import assert_trees_close, mesh

MESHES = [((2, 2), ("x", "y")), ((2, 4), ("x", "y")), ((4, 2), ("x", "y")),
          ((1, 8), ("x", "y")), ((2, 2, 2), ("data", "x", "y"))]
LAYOUTS = {"os": (("r", "c"), ("r", "c")), "ls": (("r", "c"), ("c", "r")),
           "rs": (("c", "r"), ("r", "c"))}


@st.composite
def cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  layout = draw(st.sampled_from(sorted(LAYOUTS)))
  r, c = draw(st.sampled_from([("x", "y"), ("y", "x")]))
  axis = {"r": r, "c": c}
  n_batch = draw(st.integers(0, 1))
  n_m, n_k, n_n = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
  size = lambda: draw(st.sampled_from([8, 16, 16, 32, 12]))   # 12: some do not divide
  batch = [size() for _ in range(n_batch)]
  ms, ks, ns = ([size() for _ in range(n)] for n in (n_m, n_k, n_n))
  # logical dims: ("b", i), ("m", i), ("k", i), ("n", i); each operand in a random order
  lhs_dims = [("b", i) for i in range(n_batch)] + [("m", i) for i in range(n_m)] + \
             [("k", i) for i in range(n_k)]
  rhs_dims = [("b", i) for i in range(n_batch)] + [("k", i) for i in range(n_k)] + \
             [("n", i) for i in range(n_n)]
  lhs_dims = draw(st.permutations(lhs_dims))
  rhs_dims = draw(st.permutations(rhs_dims))
  extent = {"b": batch, "m": ms, "k": ks, "n": ns}
  (lm, lk), (rk, rn) = LAYOUTS[layout]
  lhs_axes = {("m", 0): axis[lm], ("k", 0): axis[lk]}
  rhs_axes = {("k", 0): axis[rk], ("n", 0): axis[rn]}
  if "data" in names and n_batch:
    lhs_axes[("b", 0)] = rhs_axes[("b", 0)] = "data"
  lhs_spec = P(*[lhs_axes.get(d) for d in lhs_dims])
  rhs_spec = P(*[rhs_axes.get(d) for d in rhs_dims])
  dn = (([lhs_dims.index(("k", i)) for i in range(n_k)],
         [rhs_dims.index(("k", i)) for i in range(n_k)]),
        ([lhs_dims.index(("b", i)) for i in range(n_batch)],
         [rhs_dims.index(("b", i)) for i in range(n_batch)]))
  lhs_shape = tuple(extent[k][i] for k, i in lhs_dims)
  rhs_shape = tuple(extent[k][i] for k, i in rhs_dims)
  dtype = draw(st.sampled_from([jnp.float32, jnp.float32, jnp.bfloat16]))
  algorithm = draw(st.sampled_from([None, "meshslice", "collective", "wang", "cannon",
                                    "summa"]))
  ksplit = draw(st.sampled_from([None, 1, 2, 4]))
  return dict(mesh=(shape, names), lhs_spec=lhs_spec, rhs_spec=rhs_spec, dn=dn,
              lhs_shape=lhs_shape, rhs_shape=rhs_shape, dtype=dtype, algorithm=algorithm,
              ksplit=ksplit)


def _divisible(shape, spec, sizes):
  return all(entry is None or n % sizes[entry] == 0 for n, entry in zip(shape, spec))


BF16_ON_CPU = dict(mesh=((2, 2), ("x", "y")), lhs_spec=P("y", "x"), rhs_spec=P("y", "x", None),
                   dn=(([0], [0]), ([], [])), lhs_shape=(8, 8), rhs_shape=(8, 8, 8),
                   dtype=jnp.bfloat16, algorithm=None, ksplit=None)


# derandomize: CI sees the same examples on every run (a property test must not flake).
# The broader differential fuzzer (tests/test_fuzz.py; bench/fuzz.py for long campaigns)
# covers random axis tuples and orders; these examples keep the layouts of the three
# dataflows in focus.
@settings(max_examples=8, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(BF16_ON_CPU)   # once crashed XLA's CPU runtime (bf16 x bf16 -> f32 dot)
def test_transformed_dot_general_matches(case):
  shape, names = case["mesh"]
  m = mesh(shape, names)
  sizes = dict(m.shape)
  if not (_divisible(case["lhs_shape"], case["lhs_spec"], sizes)
          and _divisible(case["rhs_shape"], case["rhs_spec"], sizes)):
    return   # jax itself refuses to place such arrays
  ls, rs = NamedSharding(m, case["lhs_spec"]), NamedSharding(m, case["rhs_spec"])
  # Inputs drawn on the host and compared on the host: jax.random.normal and eager jnp
  # ops would compile a program per shape and sharding, most of this test's time.
  a = jax.device_put(_normal(0, case["lhs_shape"], case["dtype"]), ls)
  b = jax.device_put(_normal(1, case["rhs_shape"], case["dtype"]), rs)
  dn = case["dn"]
  dot = lambda x, y: jax.lax.dot_general(x, y, dn)
  loss = lambda x, y: jnp.sum(jnp.sin(dot(x, y)))
  options = {k: case[k] for k in ("algorithm", "ksplit") if case[k] is not None}
  f = jax.jit(dot, in_shardings=(ls, rs))
  report = meshslice.explain(f, **options)(a, b)
  assert len(report.sites) == 1
  # the values and the gradients from one program (the dot once, as value_and_grad's aux,
  # and its gradient dots): one compile each of plain jit and the transformed program per
  # example, not two
  def value_and_grads(x, y):
    (_, value), grads = jax.value_and_grad(lambda x, y: (loss(x, y), dot(x, y)),
                                           argnums=(0, 1), has_aux=True)(x, y)
    return value, grads

  g = jax.jit(value_and_grads, in_shardings=(ls, rs))
  (new_f, new_g), (old_f, old_g) = meshslice.transform(g, **options)(a, b), g(a, b)
  if case["dtype"] == jnp.float32:
    assert_trees_close(new_f, old_f)
    assert_trees_close(new_g, old_g, scale=2.0)
    return
  # bfloat16: both programs round differently (slices, ring order); each must be as close
  # to the float32 result on the same inputs as bfloat16 allows
  a32, b32 = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
  exact_f, exact_g = jax.jit(lambda x, y: (dot(x, y), jax.grad(loss, argnums=(0, 1))(x, y)))(
      a32, b32)
  for new, old, exact in ((new_f, old_f, exact_f), (new_g, old_g, exact_g)):
    for n, o, e in zip(jax.tree.leaves(new), jax.tree.leaves(old), jax.tree.leaves(exact)):
      e = np.asarray(e)
      scale = float(np.max(np.abs(e))) or 1.0
      err = lambda v: float(np.max(np.abs(np.asarray(v).astype(np.float32) - e))) / scale
      assert err(n) <= max(4 * err(o), 2e-2), (err(n), err(o))


def _normal(seed, shape, dtype):
  """Standard normal values on the host, rounded to `dtype`."""
  return np.random.RandomState(seed).standard_normal(shape).astype(np.float32).astype(dtype)
