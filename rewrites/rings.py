"""Ring engines: a collective over one mesh axis as n - 1 neighbour `ppermute` steps, each
beside the matmul of the block that just arrived (`ring_all_gather`) or of the partial sum
passed on next (`ring_reduce_scatter`).

Shared by the collective matmul (`wang.py`), Cannon's neighbour shifts (`cannon.py`) and
the 1D ring collective matmuls (`oned.py`). Bidirectional rings cut each block in halves
that travel opposite ways, so each step uses both links of a ring.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .slicing import pipeline_barrier


def shift(x, axis: str, n: int, step: int):
  """Send `x` to the device `step` places further along mesh axis `axis` (size n)."""
  return lax.ppermute(x, axis, [(k, (k + step) % n) for k in range(n)])


def _groups(ksplit: int, bidirectional: bool):
  """Chunks of one ring block as pipeline stages of (chunk index, direction of travel).

  A bidirectional stage sends one chunk each way at once (both links busy)."""
  if bidirectional:
    return [((c, +1), (ksplit + c, -1)) for c in range(ksplit)]
  return [((c, +1),) for c in range(ksplit)]


def ring_all_gather(moving, dim: int, axis: str, n: int, ksplit: int, bidirectional: bool,
                    consume, carry=None):
  """Feed each block of all_gather(moving, axis, dim) to `consume` as it arrives.

    chunks = split(moving, ksplit (x2 if bidirectional), dim)
    for t in 0..n-1:  for each chunk c (travelling d = +-1):
      send c on to the device d further (t < n-1)  |  carry = consume(carry, c, start)
  where `start` (traced) is where the chunk sits in the gathered dim (block me - d*t).
  """
  groups = _groups(ksplit, bidirectional)
  parts = sum(len(g) for g in groups)
  extent = moving.shape[dim]
  size = extent // parts
  chunks = ([moving] if parts == 1 else
            [lax.slice_in_dim(moving, c * size, (c + 1) * size, axis=dim) for c in range(parts)])
  me = lax.axis_index(axis)
  for t in range(n):
    last = t + 1 == n
    for group in groups:
      sent = {} if last else {c: shift(chunks[c], axis, n, d) for c, d in group}
      for c, d in group:
        start = ((me - d * t) % n) * extent + c * size
        carry = consume(carry, chunks[c], start)
      if not last:
        chunks = [sent.get(c, x) for c, x in enumerate(chunks)]
        # Later stages' sends start from the barrier's output: no collective combining.
        chunks, carry = pipeline_barrier((chunks, carry))
  return carry


def ring_reduce_scatter(produce, axis: str, n: int, extent: int, out_dim: int, ksplit: int,
                        bidirectional: bool, wire_dtype):
  """psum_scatter over `axis` along `out_dim` of a partial result made block by block.

    for t in 0..n-1:  for each chunk c (travelling d = +-1) of output block b = me - d*(1+t):
      acc_c = received_c + produce(start of (b, c), chunk size)
      send acc_c on to the device d further (t < n-1), beside the next stage's produce
  so after n steps each device holds the full sum of its own block (b = me).
  `extent` is the local (scattered) extent of out_dim; partial sums travel as wire_dtype.
  """
  groups = _groups(ksplit, bidirectional)
  parts = sum(len(g) for g in groups)
  size = extent // parts
  me = lax.axis_index(axis)
  accs = [None] * parts
  pending = []       # (chunk, direction, partial sum) to send during the next stage
  for t in range(n):
    for group in groups:
      sent = [(c, shift(v, axis, n, d)) for c, d, v in pending]
      made = [produce(((me - d * (1 + t)) % n) * extent + c * size, size) for c, d in group]
      received, made = pipeline_barrier(([v for _, v in sent], made))
      for (c, _), v in zip(sent, received):
        accs[c] = v
      pending = []
      for (c, d), part in zip(group, made):
        total = part if t == 0 else accs[c].astype(part.dtype) + part
        if t + 1 < n:
          pending.append((c, d, total.astype(wire_dtype)))
        else:
          accs[c] = total
  return accs[0] if parts == 1 else jnp.concatenate(accs, axis=out_dim)
