"""meshslice.hlo on small real compiled programs: counts and per-device bytes, exactly,
including collectives inside while loops (fori_loop, scan, nested, unknown trip count).

All programs run on the (2, 4) mesh ("x" = 2, "y" = 4) with x: f32[16, 32] sharded
P("x", "y"), so every device holds an f32[8, 8] block (256 bytes); every collective is
over "y", a group of n = 4 devices. Byte rules (meshslice/hlo.py): all-gather result *
(n-1)/n, reduce-scatter result * (n-1).
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from meshslice.hlo import KINDS, collective_stats, while_trip_counts

from helpers import mesh

X = jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32)


def _compiled(body, out_specs=P("x", "y")):
  f = jax.jit(jax.shard_map(body, mesh=mesh((2, 4)), in_specs=P("x", "y"),
                            out_specs=out_specs, check_vma=False))
  return f.lower(X).compile().as_text(), f


def _only(stats, kind):
  """The stats dict must mention nothing but `kind`; returns (count, bytes) of it."""
  assert set(stats) == {"count", "bytes", "total_bytes"}
  assert set(stats["count"]) == set(stats["bytes"]) == set(KINDS)
  assert all(stats["count"][k] == 0 and stats["bytes"][k] == 0 for k in KINDS if k != kind)
  assert stats["total_bytes"] == stats["bytes"][kind]
  return stats["count"][kind], stats["bytes"][kind]


def _gather_in_loop(a):
  # 5 trips, one all-gather of the [8, 8] block along dim 1 -> f32[8, 32] each.
  def body(i, acc):
    return acc + lax.all_gather(a * i, "y", axis=1, tiled=True).sum()
  return lax.fori_loop(0, 5, body, jnp.zeros((), a.dtype))[None, None]


def test_plain_all_gather():
  text, _ = _compiled(lambda a: lax.all_gather(a, "y", axis=0, tiled=True), P("x", None))
  # result f32[32, 8] = 1024 B; a ring over 4 devices receives 3/4 of it: 768 B.
  assert _only(collective_stats(text), "all-gather") == (1, 768.0)
  assert while_trip_counts(text) == {}


def test_all_gather_in_fori_loop_counts_every_trip():
  text, f = _compiled(_gather_in_loop)
  # per trip: result f32[8, 32] = 1024 B, * 3/4 = 768 B; 5 trips: 5 collectives, 3840 B.
  assert list(while_trip_counts(text).values()) == [5]
  assert _only(collective_stats(text), "all-gather") == (5, 3840.0)
  # loops=False: the figures of the text as written (one all-gather in the loop body).
  assert _only(collective_stats(text, loops=False), "all-gather") == (1, 768.0)
  # Without XLA's known_trip_count the induction variable is recognised: in compiled text
  # (compare / add inside wrapped fusions) and in lowered, unoptimized HLO.
  bare = re.sub(r", backend_config=\{.*\}", "", text)
  assert "known_trip_count" in text and "known_trip_count" not in bare
  assert _only(collective_stats(bare), "all-gather") == (5, 3840.0)
  lowered = f.lower(X).as_text(dialect="hlo")
  assert list(while_trip_counts(lowered).values()) == [5]
  assert _only(collective_stats(lowered), "all-gather") == (5, 3840.0)


def test_scan_over_layers_and_nested_loops():
  def layers(a):
    # scan over 2 "layers" of the [8, 8] block viewed as [2, 4, 8]: each layer gathers
    # its f32[4, 8] along dim 1 -> f32[4, 32] = 512 B, * 3/4 = 384 B; 2 layers: 768 B.
    def layer(c, w):
      return c + lax.all_gather(w, "y", axis=1, tiled=True).sum(), None
    return lax.scan(layer, jnp.zeros((), a.dtype), a.reshape(2, 4, 8))[0][None, None]

  text, _ = _compiled(layers)
  assert list(while_trip_counts(text).values()) == [2]
  assert _only(collective_stats(text), "all-gather") == (2, 768.0)

  def nested(a):
    # 4 outer x 3 inner trips of the 768 B all-gather of _gather_in_loop: 12, 9216 B.
    def inner(j, c):
      return c + lax.all_gather(a * j, "y", axis=1, tiled=True).sum()
    return lax.fori_loop(0, 4, lambda i, c: lax.fori_loop(0, 3, inner, c * i),
                         jnp.zeros((), a.dtype))[None, None]

  text, _ = _compiled(nested)
  assert sorted(while_trip_counts(text).values()) == [3, 4]
  assert _only(collective_stats(text), "all-gather") == (12, 9216.0)


def test_loop_of_unknown_trip_count_counts_once():
  def until(a):
    def body(c):
      return (c[0] + lax.all_gather(a, "y", axis=1, tiled=True).sum(),)
    return lax.while_loop(lambda c: c[0] < a[0, 0], body, (jnp.zeros((), a.dtype),)
                          )[0][None, None]

  text, _ = _compiled(until)
  assert list(while_trip_counts(text).values()) == [None]
  assert _only(collective_stats(text), "all-gather") == (1, 768.0)     # a lower bound


def test_reduce_scatter():
  text, _ = _compiled(lambda a: lax.psum_scatter(jnp.tile(a, (1, 4)), "y",
                                                 scatter_dimension=1, tiled=True))
  # operand f32[8, 32], result f32[8, 8] = 256 B; a ring sends (n - 1) results: 768 B.
  assert _only(collective_stats(text), "reduce-scatter") == (1, 768.0)


def test_text_formats_the_cpu_backend_does_not_print():
  # Async collectives (GPU/TPU): bytes of the outputs, not of the trailing u32 contexts;
  # empty replica_groups mean every device of the module; loose lines count once.
  text = "\n".join([
      "HloModule m, num_partitions=8",
      "ENTRY %main (p: f32[8,8]) -> f32[8,8] {",
      "  %p = f32[8,8]{1,0} parameter(0)",
      "  %ag = (f32[8,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%p), channel_id=1, "
      "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
      "  %cp = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(%p), "
      "channel_id=2, source_target_pairs={{0,1},{1,0}}",
      "  %ar = f32[8,8]{1,0} all-reduce-start(%p), channel_id=3, replica_groups={}, "
      "to_apply=%add",
      "  ROOT %d = f32[8,8]{1,0} all-reduce-done(%ar)",
      "}"])
  stats = collective_stats(text)
  assert stats["count"] == dict.fromkeys(KINDS, 0) | {
      "all-gather": 1, "collective-permute": 1, "all-reduce": 1}
  # 1024 * 3/4; 256 (the permuted block); 2 * 256 * 7/8 over all 8 devices.
  assert stats["bytes"]["all-gather"] == 768.0
  assert stats["bytes"]["collective-permute"] == 256.0
  assert stats["bytes"]["all-reduce"] == 448.0
  # Generic async wrapping (all-to-all, reduce-scatter on GPU): the wrapped collective
  # runs once, though async-done may print the same calls= as async-start.
  wrapped = "\n".join([
      "%rs_body (p: f32[8,32]) -> f32[8,8] {",
      "  %p = f32[8,32]{1,0} parameter(0)",
      "  ROOT %rs = f32[8,8]{1,0} reduce-scatter(%p), replica_groups={{0,1,2,3}}, "
      "dimensions={1}, to_apply=%add",
      "}",
      "ENTRY %main (p: f32[8,32]) -> f32[8,8] {",
      "  %p = f32[8,32]{1,0} parameter(0)",
      "  %s = ((f32[8,32]{1,0}), f32[8,8]{1,0}, u32[]) async-start(%p), calls=%rs_body",
      "  ROOT %d = f32[8,8]{1,0} async-done(%s), calls=%rs_body",
      "}"])
  assert _only(collective_stats(wrapped), "reduce-scatter") == (1, 768.0)
  loose = "%ag = f32[32,8]{1,0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}"
  assert _only(collective_stats(loose), "all-gather") == (1, 768.0)


@pytest.mark.parametrize("text", ["", "HloModule empty\n"])
def test_no_collectives(text):
  stats = collective_stats(text)
  assert stats["total_bytes"] == 0.0 and not any(stats["count"].values())
