"""Safe libtpu flags per TPU generation and honest rivals (issue 18, deliverables 1-2):
no all-gather continuation fusion on v4 / v5p / v6e (libtpu 0.0.50.1 refuses it there as
unsafe), the MaxText group on v5e; every table states its flags; the rewrite is
compared with the best of XLA's four programs (plain / dense, defaults / async)."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import aot, aot_sites, backend_flags

FUSE = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"


def test_flags_per_generation():
  for gen in ("v4", "v5p", "v6e"):
    flags = backend_flags.tpu_overlap_flags(gen)
    assert FUSE not in flags and "--xla_enable_async_all_gather=true" in flags
    assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false" in flags
    assert backend_flags.unsafe_flags(gen, aot.ASYNC_FLAGS) == (FUSE,)
    assert backend_flags.unsafe_flags(gen, flags) == ()
  assert backend_flags.tpu_overlap_flags("v5e") == backend_flags.CONTINUATION_FUSION_FLAGS
  assert backend_flags.unsafe_flags("v5e", aot.ASYNC_FLAGS) == ()
  # an unknown TPU gets the flags safe wherever they were tried
  assert backend_flags.tpu_overlap_flags(None) == backend_flags.SAFE_ASYNC_FLAGS
  assert backend_flags.tpu_generation("TPU v4") == "v4"
  assert backend_flags.tpu_generation("TPU v5 lite") == "v5e"
  assert backend_flags.tpu_generation("TPU v6 lite") == "v6e"
  assert backend_flags.tpu_generation("TPU v5") == "v5p"


def test_old_names_still_work_and_backend_flags_does_not_import_aot():
  assert aot.ASYNC_FLAGS == backend_flags.CONTINUATION_FUSION_FLAGS    # MaxText's group
  assert aot.DENSE_FLAGS == backend_flags.DENSE_FLAGS
  assert aot.FLAG_PRESETS["async"] == aot.ASYNC_FLAGS
  code = ("import sys; import meshslice.backend_flags as b; "
          "print('meshslice.aot' in sys.modules, b.TPU_OVERLAP_FLAGS[0])")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
  # meshslice's package import may pull aot in for other reasons; backend_flags itself
  # must not import it
  with open(backend_flags.__file__, encoding="utf-8") as f:
    assert "from .aot" not in f.read() and "import aot" not in f.read()
  assert out.returncode == 0, out.stderr[-2000:]


def test_presets_per_generation():
  assert aot.preset_flags("async", "v4") == backend_flags.SAFE_ASYNC_FLAGS
  assert aot.preset_flags("async", "v5e") == aot.ASYNC_FLAGS
  assert aot.preset_flags("dense,async", "v6e") == (
      aot.DENSE_FLAGS + backend_flags.SAFE_ASYNC_FLAGS + backend_flags.SPARSE_CORE_OFFLOAD_FLAGS)
  assert aot.preset_flags("fusion", "v4") == aot.ASYNC_FLAGS           # asked for by name
  assert aot.preset_flags("", "v4") == ()
  with pytest.raises(ValueError, match="unknown libtpu flag preset 'fast'; known: default"):
    aot.preset_flags("fast", "v4")
  assert aot.variant_flags("plain", "v4") == ()
  assert aot.variant_flags("dense", "v4") == aot.DENSE_FLAGS
  assert aot.variant_flags("dense_async", "v4") == aot.DENSE_FLAGS + backend_flags.SAFE_ASYNC_FLAGS
  assert aot.variant_flags("meshslice", "v4") == backend_flags.SAFE_ASYNC_FLAGS
  assert aot_sites.flags_of("async", "v5p") == (backend_flags.SAFE_ASYNC_FLAGS
                                                + backend_flags.SPARSE_CORE_OFFLOAD_FLAGS)
  assert aot_sites.flags_of("async_dense", "v4") == (backend_flags.SAFE_ASYNC_FLAGS
                                                     + aot.DENSE_FLAGS)
  assert aot_sites.flags_of("default", "v4") == ()


def _explain_sliced(msh):
  s = NamedSharding(msh, P("x", "y"))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=s)
  w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=s)
  with jax.set_mesh(msh):
    return meshslice.explain(jax.jit(lambda a, b: a @ b), ksplit=2)(x, w)


def test_report_note_reads_the_generation_and_warns_of_unsafe_flags(monkeypatch):
  pytest.importorskip("libtpu")
  v4 = aot.make_mesh("v4:2x2x1", (2, 2))
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(aot.ASYNC_FLAGS))
  note, = _explain_sliced(v4).notes
  assert note.startswith(f"{FUSE} (all-gather continuation fusion) is set, which the newest "
                         "libtpu refuses on TPU v4 as unsafe")
  assert note.endswith(" ".join(backend_flags.SAFE_ASYNC_FLAGS) + " (docs/tpu.md)")
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(backend_flags.SAFE_ASYNC_FLAGS))
  assert _explain_sliced(v4).notes == ()
  v5e = aot.make_mesh("v5e:2x2", (2, 2))
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
  note, = _explain_sliced(v5e).notes
  assert note.startswith("sliced collectives overlap the matmuls on TPU v5e only with "
                         + " ".join(aot.ASYNC_FLAGS))   # v5e: continuation fusion wanted
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(aot.ASYNC_FLAGS))
  assert _explain_sliced(v5e).notes == ()


def test_report_notes_on_sparse_core_offload(monkeypatch):
  # v5p wants the offload flags beside the safe set; on v4 they make the async
  # all-gathers synchronous (bench/tpu_flags_probe.py), which the note says
  pytest.importorskip("libtpu")
  v5p = aot.make_mesh("v5p:2x2x1", (2, 2))
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(backend_flags.SAFE_ASYNC_FLAGS))
  note, = _explain_sliced(v5p).notes
  assert note.startswith("sliced collectives overlap the matmuls on TPU v5p only with "
                         + " ".join(backend_flags.SPARSE_CORE_OFFLOAD_FLAGS) + " in "
                         "LIBTPU_INIT_ARGS")
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(backend_flags.tpu_overlap_flags("v5p")))
  assert _explain_sliced(v5p).notes == ()
  v4 = aot.make_mesh("v4:2x2x1", (2, 2))
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(backend_flags.tpu_overlap_flags("v5p")))
  note, = _explain_sliced(v4).notes
  assert note == ("SparseCore collective offload "
                  "(--xla_tpu_enable_sparse_core_collective_offload_*) is set, which makes "
                  "the async all-gathers synchronous again on TPU v4 (it has no SparseCore "
                  "for them); drop it there (docs/tpu.md)")


def _row(step_ms, flags=""):
  return {"compute_cycles": 1e6, "dot_cycles": 1e6, "copy_cycles": 0, "relayout_copies": 0,
          "collectives": 2, "sync_collectives": 1, "async_collectives": 1,
          "collective_bytes": 1e6, "windowed_einsum_loops": 0, "step_s": step_ms / 1e3,
          "compute_s": 1e-3, "exposed_s": 0.0, "peak_bytes": 2**30, "compile_s": 1.0,
          "flags": flags}


def test_cli_table_states_flags_and_compares_with_the_best_of_four():
  rows = {"plain": _row(3.0), "dense": _row(2.5, "D"), "plain_async": _row(2.2, "A"),
          "dense_async": _row(2.0, "D A"), "meshslice": _row(1.6, "A")}
  assert aot.versus_best_xla(rows) == ("dense_async", 2e-3, pytest.approx(1.25))
  text = aot.format_table(rows)
  assert "  plain: (libtpu defaults)" in text and "  dense_async: D A" in text
  assert text.splitlines()[-1] == ("meshslice vs the best XLA variant (dense_async, 2.000 ms): "
                                   "1.250x (faster)")
  waiting = [line for line in text.splitlines() if line.startswith("  most of it waiting on")]
  assert waiting and waiting[0].split()[-1] == "-"          # no waits recorded in the rows
  rows["meshslice"]["exposed_by"] = [["async all-gather n=4 link 1", 4e-4, 3]]
  assert aot.format_table(rows).count("async all-gather n=4 link 1 (0.40)") == 1
  slower = dict(rows, meshslice=_row(2.1, "A"))
  assert aot.format_table(slower).endswith("0.952x (not faster)")
  assert aot.versus_best_xla({"meshslice": _row(1.0)}) is None
  # the CLI compiles all by default, each with its own flags; the rewrite also with
  # dense_async's flags
  assert list(aot.VARIANTS) == ["plain", "dense", "plain_async", "dense_async", "meshslice",
                                "meshslice_dense"]
  assert aot.variant_flags("meshslice_dense", "v4") == aot.variant_flags("dense_async", "v4")
  both = aot.format_table(dict(rows, meshslice_dense=_row(1.9, "D A")))
  assert both.splitlines()[-1] == ("meshslice_dense vs the best XLA variant (dense_async, "
                                   "2.000 ms): 1.053x (faster)")


def test_bench_tpu_aot_flags_and_headline(bench_script):
  tpu_aot = bench_script("tpu_aot")
  assert tpu_aot.variant_flags("meshslice", "v4") == backend_flags.SAFE_ASYNC_FLAGS
  assert tpu_aot.variant_flags("plain_async", "v5e") == aot.ASYNC_FLAGS
  assert tpu_aot.variant_flags("dense_async", "v4", "fusion") == aot.DENSE_FLAGS + aot.ASYNC_FLAGS
  base = dict(model="gpt3", generation="v4", chips=8, topology="v4:2x2x2", mesh=[2, 4],
              libtpu="0.0.42.1")
  records = [dict(base, variant=v, **_row(ms, f"flags-of-{v}")) for v, ms in
             (("plain", 3.0), ("dense", 2.5), ("plain_async", 2.2), ("dense_async", 2.0),
              ("meshslice", 2.1))]
  text = tpu_aot.markdown(records)
  assert "| 0.952x (dense_async) |" in text
  assert "- v4 dense_async (libtpu 0.0.42.1): `flags-of-dense_async`" in text
  # each side at its own best mesh: XLA's best is on the other mesh here
  other = dict(base, mesh=[4, 2])
  records += [dict(other, variant=v, **_row(ms, f"flags-of-{v}")) for v, ms in
              (("dense_async", 1.8), ("meshslice", 2.4))]
  assert tpu_aot.best_meshes(records) == [
      "- gpt3 v4 8 chips, each at its best of 2 mesh(es): meshslice 2x4 2.10 ms against "
      "dense_async 4x2 1.80 ms: 0.857x"]
  assert tpu_aot.best_meshes(records)[0] in tpu_aot.markdown(records)
  # where each program's exposed time goes (`AotResult.row()["exposed_by"]`, seconds)
  records[3]["exposed_by"] = [["async all-gather n=4 link 1", 4e-4, 3],
                              ["sync all-reduce n=8 link 0", 1e-4, 1]]
  assert ("- gpt3 v4 8 chips 2x4 dense_async: async all-gather n=4 link 1: 0.40 ms (3x), sync "
          "all-reduce n=8 link 0: 0.10 ms (1x)") in tpu_aot.markdown(records).splitlines()
  records += [dict(other, variant="dense", **_row(2.5))]
  row, = tpu_aot.summary(records)
  assert row[4:10] == ["dense_async (4x2)", "1.8", "meshslice (2x4)", "2.1", "0.857x", ""]
