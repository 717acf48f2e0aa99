"""Run a shard_map body as its own computation in the compiled program.

XLA's CPU runtime builds one dependency graph over all the operations (thunks) of a
computation, and building it costs more than linear time in their number (its transitive
reduction; measured with `perf` on the unrolled demo step with every site sliced at 16
layers: 22 % of a 65 s compile against 3 % of plain jit's 14 s). A sliced site adds S
steps of slices, gathers, dots and scatters to that one graph. Inside a branch of a
`conditional` a site's operations form a graph of their own, one per site, and XLA also
stops fusing the rest of the program into the per-slice ops (which duplicates producers
once per slice).

`in_own_computation` makes the body the taken branch of a conditional whose predicate
is true on every device but which XLA cannot fold: it is computed from the device's
position on a mesh axis. (A loop of one trip does not work: XLA hoists the
loop-invariant body out of it.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._jax_compat import varying_axes

# No mesh axis is this long: `axis_index < _NEVER_REACHED` holds on every device.
_NEVER_REACHED = 2 ** 30


def in_own_computation(body):
  """`body(*operands)` (inside a shard_map; `body(lhs, rhs)` for one GEMM) as the branch
  of a conditional XLA keeps.

  The predicate is `axis_index(a) < 2**30` for a mesh axis `a` the result varies over,
  true on every device; the other branch, never taken, returns zeros. A body whose
  result varies over no mesh axis is returned as it is (the predicate would make it
  vary).

  >>> import jax, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = in_own_computation(lambda a, b: a @ b)
  >>> g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
  >>> np.asarray(g(np.eye(2, dtype=np.float32), np.ones((2, 2), np.float32))).tolist()
  [[1.0, 1.0], [1.0, 1.0]]
  """
  def run(*operands):
    out = jax.eval_shape(body, *operands)
    varying = varying_axes(out)
    if not varying:
      return body(*operands)

    def never_taken(*operands):
      # the conditional's branches must agree on the result's type, varying axes included
      return lax.pcast(jnp.zeros(out.shape, out.dtype), varying, to="varying")

    taken = lax.axis_index(varying[0]) < _NEVER_REACHED
    return lax.cond(taken, body, never_taken, *operands)

  return run
