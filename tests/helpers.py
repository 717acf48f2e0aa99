"""Shared helpers for the tests: meshes, tolerances, tree comparison."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from meshslice.hlo import collective_stats

TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2}


def mesh(shape, names=("x", "y"), explicit=False):
  n = int(np.prod(shape))
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape),
                       devices=jax.devices()[:n])


def assert_trees_close(a, b, dtype=jnp.float32, scale=1.0):
  tol = TOL[jnp.dtype(dtype)] * scale
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    # on the host: jnp.asarray(x, jnp.float32) would compile a convert per shape and sharding
    x = np.asarray(x).astype(np.float32)
    y = np.asarray(y).astype(np.float32)
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol * max(1.0, float(np.abs(y).max())))


# The kinds collective_counts reports: tests compare whole dicts of these.
COUNTED = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def collective_counts(hlo_text):
  """{kind: how many appear in the HLO text} for the COUNTED kinds: each instruction once,
  loop bodies included once (`meshslice.hlo.collective_stats(..., loops=False)`)."""
  count = collective_stats(hlo_text, loops=False)["count"]
  return {kind: count[kind] for kind in COUNTED}


def shard_map_bodies(fn, *args):
  """The jaxprs of the shard_map bodies in `fn`'s traced program, in program order,
  sub-jaxprs (pjit, checkpoint, scan, ...) included."""
  from meshslice import analysis
  bodies = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "shard_map":
        bodies.append(eqn.params["jaxpr"])
      for _, sub in analysis.sub_jaxprs(eqn):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return bodies


def windowed_asked(monkeypatch) -> list:
  """Spies on `costing.xla_program`: the returned list gets, per site priced, whether
  XLA's program for it was the windowed einsum one."""
  from meshslice import costing
  asked = []
  real = costing.xla_program

  def spy(*args, **kwargs):
    program = real(*args, **kwargs)
    asked.append(program.windowed)
    return program
  monkeypatch.setattr(costing, "xla_program", spy)
  return asked
