"""The report says when the backend lacks the flags that let sliced collectives overlap
the matmuls (libtpu's async collective flags; XLA's latency-hiding scheduler on GPU)."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import aot
from meshslice.backend_flags import (GPU_OVERLAP_FLAGS, TPU_OVERLAP_FLAGS,
                                     missing_overlap_flags)

from helpers import mesh


def test_missing_flags_per_platform():
  assert missing_overlap_flags("tpu", {}) == TPU_OVERLAP_FLAGS
  assert missing_overlap_flags("tpu", {"LIBTPU_INIT_ARGS": " ".join(TPU_OVERLAP_FLAGS)}) == ()
  assert missing_overlap_flags("cuda", {"XLA_FLAGS": "--foo"}) == GPU_OVERLAP_FLAGS
  assert missing_overlap_flags("gpu", {"XLA_FLAGS": GPU_OVERLAP_FLAGS[0]}) == ()
  assert missing_overlap_flags("cpu", {}) == ()


def _explain_sliced(msh, **options):
  s = NamedSharding(msh, P("x", "y"))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=s)
  w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=s)
  return meshslice.explain(jax.jit(lambda a, b: a @ b), **options)(x, w)


def test_tpu_report_names_the_missing_libtpu_flags(monkeypatch):
  pytest.importorskip("libtpu")
  tpu = aot.make_mesh("v4:2x2x1", (2, 2))
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
  note, = _explain_sliced(tpu, ksplit=2).notes
  # the mesh's generation is named, and its flags (v4: no all-gather continuation fusion)
  assert note.startswith("sliced collectives overlap the matmuls on TPU v4 only with "
                         "--xla_tpu_enable_async_collective_fusion=true "
                         "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false")
  assert "in LIBTPU_INIT_ARGS (set before jax starts; docs/tpu.md)" in note
  assert _explain_sliced(tpu, ksplit=1).notes == ()            # nothing sliced
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(TPU_OVERLAP_FLAGS))
  assert _explain_sliced(tpu, ksplit=2).notes == ()


def test_cpu_meshes_get_no_flag_note():
  assert _explain_sliced(mesh((2, 4)), ksplit=2).notes == ()


def test_abstract_meshes_get_no_flag_note():
  am = jax.sharding.AbstractMesh((2, 4), ("x", "y"),
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
  assert _explain_sliced(am, ksplit=2).notes == ()


def test_tpu7x_report_names_only_flags_set_against_libtpus_default(monkeypatch):
  """On TPU7x libtpu offloads collectives to the SparseCore by default, so a sliced plan
  gets no missing-flags note without LIBTPU_INIT_ARGS; turning offload off gets one
  naming the chip as jax does ("TPU7x") and the flag to set back."""
  pytest.importorskip("libtpu")
  tpu = aot.make_mesh("tpu7x:2x2x1", (2, 4))
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
  assert _explain_sliced(tpu, ksplit=2, profile="tpu-v7x").notes == ()
  monkeypatch.setenv("LIBTPU_INIT_ARGS",
                     "--xla_tpu_enable_sparse_core_collective_offload_all_gather=false")
  note, = _explain_sliced(tpu, ksplit=2, profile="tpu-v7x").notes
  assert note.startswith("sliced collectives overlap the matmuls on TPU7x only with "
                         "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true "
                         "in LIBTPU_INIT_ARGS")
