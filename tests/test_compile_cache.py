"""The compiled-program cache (`meshslice.compile_cache`) on CPU devices: what a hit
returns, what its key depends on, and what a damaged entry does. tune's use of it (TPU
compiles read back with the same figures) is tests/test_never_slower.py's."""
import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshslice import compile_cache
from meshslice.errors import MeshsliceError

from helpers import mesh


def _matmul(msh, n=64):
  s = NamedSharding(msh, P("x", "y"))
  x = jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=s)
  return jax.jit(lambda a, b: jnp.tanh(a @ b)), x, x


def test_a_hit_returns_the_compiled_text_and_memory_figures(tmp_path):
  msh = mesh((2, 4))
  f, x, w = _matmul(msh)
  cache = compile_cache.CompileCache(tmp_path / "new")        # created when missing
  compiled, seconds, hit = cache.compile(f, x, w, mesh=msh)
  assert not hit and seconds > 0 and (cache.hits, cache.misses) == (0, 1)
  program, again, hit = cache.compile(f, x, w, mesh=msh)
  assert hit and again == seconds and (cache.hits, cache.misses) == (1, 1)
  assert isinstance(program, compile_cache.CachedProgram)
  assert program.as_text() == compiled.as_text()
  mem = compiled.memory_analysis()
  for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
    assert getattr(program.memory_analysis(), name) == getattr(mem, name)
  entry, = (tmp_path / "new").glob("*.json.gz")
  with gzip.open(entry, "rt") as fh:
    assert json.load(fh)["format"] == compile_cache.FORMAT


def test_the_key_follows_the_program_the_mesh_and_the_flags(tmp_path, monkeypatch):
  msh = mesh((2, 4))
  f, x, w = _matmul(msh)
  text = f.lower(x, w).as_text()
  key = compile_cache.key_of(text, msh)
  assert compile_cache.key_of(text, msh) == key                  # deterministic
  other = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                        devices=np.array(jax.devices()[:8])[::-1])
  assert compile_cache.key_of(text, other) != key                # another device order
  g, _, _ = _matmul(msh, n=128)
  assert compile_cache.key_of(g.lower(*_matmul(msh, n=128)[1:]).as_text(), msh) != key
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_all_to_all=true")
  assert compile_cache.key_of(text, msh) != key                  # other compiler flags


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path):
  msh = mesh((2, 4))
  f, x, w = _matmul(msh)
  cache = compile_cache.CompileCache(tmp_path)
  cache.compile(f, x, w, mesh=msh)
  entry, = tmp_path.glob("*.json.gz")
  entry.write_bytes(gzip.compress(b'{"format": 0}'))             # another format
  _, _, hit = cache.compile(f, x, w, mesh=msh)
  assert not hit
  _, _, hit = cache.compile(f, x, w, mesh=msh)
  assert hit and not list(tmp_path.glob("*.tmp"))


def test_a_bad_directory_is_named(tmp_path):
  with pytest.raises(MeshsliceError, match=r"^cache_dir must be a directory path \(str "
                     r"or os.PathLike\), got None$"):
    compile_cache.CompileCache(None)
  afile = tmp_path / "f"
  afile.write_text("")
  with pytest.raises(MeshsliceError, match=r"^cache_dir '.*/f' cannot be created: .*; "
                     r"pass a writable directory$"):
    compile_cache.CompileCache(afile)
