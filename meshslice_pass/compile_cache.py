"""Compiled programs kept on disk, so a program compiled once is not compiled again.

`meshslice.tune` compiles every candidate plan ahead of time for a TPU topology (one to
several minutes each at pod scale). Run again on the same step, mesh and flags, it would
compile the same programs again: with a `CompileCache` it reads them back instead.

What is kept of a compile is what the project reads off it: the compiled program's text
(the scheduled HLO that `aot.analyze` reads and simulates), its memory figures
(`memory_analysis()`) and the seconds the compile took. A hit hands back a
`CachedProgram` with the two methods `aot.analyze` calls, so every figure read from it
is the original compile's.

An entry is keyed by everything the compiled program depends on:

  the lowered program   its StableHLO text: the rewritten step, its shardings, so the
                        plan, the shapes and the dtypes
  the mesh              its devices (ids, kind, torus coordinates, core on chip) in mesh
                        order, and its axis names
  the compiler          LIBTPU_INIT_ARGS (libtpu reads it once, at load: the flags in
                        force), and the versions of jax, jaxlib and libtpu

so a new libtpu, other flags or another plan miss and compile. Entries are one
gzip-compressed JSON file each, written to a temporary name and renamed into place, so
processes sharing a directory never read a partial entry; an entry that cannot be read
(truncated, another format) is compiled again and replaced.

Example:
  >>> cache = CompileCache("/tmp/meshslice-compiles")                # doctest: +SKIP
  >>> program, seconds, hit = cache.compile(step, *args, mesh=mesh)  # doctest: +SKIP
  >>> aot.analyze(program, "tpu-v4", compile_s=seconds)              # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import importlib.metadata
import json
import os
import tempfile
import time

from .errors import MeshsliceError

# The layout of an entry; an entry of another format is a miss.
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CachedMemory:
  """A compile's memory figures, as `memory_analysis()` gave them (bytes per device)."""

  argument_size_in_bytes: int = 0
  output_size_in_bytes: int = 0
  alias_size_in_bytes: int = 0
  temp_size_in_bytes: int = 0
  peak_memory_in_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class CachedProgram:
  """A compiled program read back from the cache: what `aot.analyze` reads of one."""

  text: str
  memory: CachedMemory | None

  def as_text(self) -> str:
    return self.text

  def memory_analysis(self) -> CachedMemory | None:
    return self.memory


# The memory figures kept: `memory_analysis()`'s attributes that aot.analyze reads.
MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(CachedMemory))


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "absent"


def _mesh_description(mesh) -> list:
  """The mesh's axis names and, in mesh order, each device's identity and place."""
  devices = [{"id": d.id, "kind": d.device_kind,
              "coords": list(getattr(d, "coords", ()) or ()),
              "core": getattr(d, "core_on_chip", None)} for d in mesh.devices.flat]
  return [list(mesh.axis_names), list(mesh.devices.shape), devices]


def key_of(lowered_text: str, mesh) -> str:
  """The entry's name: a SHA-256 of the lowered program, the mesh, the flags and the
  versions (module docstring)."""
  parts = {"format": FORMAT, "program": lowered_text, "mesh": _mesh_description(mesh),
           "flags": os.environ.get("LIBTPU_INIT_ARGS", ""),
           "versions": [_version(p) for p in ("jax", "jaxlib", "libtpu")]}
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class CompileCache:
  """Compiled programs on disk under `directory` (created if missing).

  `compile(fn, *args, mesh=mesh)` is `aot.compile` with the cache in front: it lowers
  `fn`, and compiles only when no entry has the same key. Counts of this object's hits
  and misses are in `hits` and `misses`.
  """

  def __init__(self, directory):
    if isinstance(directory, bool) or not isinstance(directory, (str, os.PathLike)):
      raise MeshsliceError(f"cache_dir must be a directory path (str or os.PathLike), "
                           f"got {directory!r}")
    self.directory = os.fspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      raise MeshsliceError(f"cache_dir {self.directory!r} cannot be created: {e}; pass a "
                           "writable directory") from None
    if not os.path.isdir(self.directory):
      raise MeshsliceError(f"cache_dir {self.directory!r} is not a directory")
    self.hits = 0
    self.misses = 0

  def path(self, key: str) -> str:
    return os.path.join(self.directory, f"{key}.json.gz")

  def load(self, key: str) -> tuple[CachedProgram, float] | None:
    """(program, compile seconds) of the entry `key`, or None when there is none or it
    cannot be read."""
    try:
      with gzip.open(self.path(key), "rt", encoding="utf-8") as f:
        entry = json.load(f)
      if entry.get("format") != FORMAT:
        return None
      memory = entry["memory"]
      program = CachedProgram(text=entry["text"], memory=None if memory is None else
                              CachedMemory(**{k: int(memory[k]) for k in MEMORY_FIELDS}))
      return program, float(entry["compile_s"])
    except (OSError, EOFError, ValueError, KeyError, TypeError):
      return None

  def store(self, key: str, compiled, seconds: float) -> None:
    """Write `compiled`'s text and memory figures as the entry `key` (atomically)."""
    mem = compiled.memory_analysis()
    memory = None if mem is None else {
        k: int(getattr(mem, k, 0) or 0) for k in MEMORY_FIELDS}
    entry = {"format": FORMAT, "text": compiled.as_text(), "memory": memory,
             "compile_s": seconds}
    handle, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
    try:
      with os.fdopen(handle, "wb") as raw, gzip.open(raw, "wt", encoding="utf-8") as f:
        json.dump(entry, f)
      os.replace(tmp, self.path(key))
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
      raise

  def compile(self, fn, *args, mesh):
    """(program, compile seconds, hit): `fn` lowered on `args` under `mesh` and compiled,
    or read back when an entry has its key (the seconds are then the original
    compile's)."""
    import jax
    start = time.perf_counter()
    with jax.set_mesh(mesh):
      lowered = fn.lower(*args)
      key = key_of(lowered.as_text(), mesh)
      found = self.load(key)
      if found is not None:
        self.hits += 1
        return found[0], found[1], True
      compiled = lowered.compile()
    seconds = time.perf_counter() - start
    self.store(key, compiled, seconds)
    self.misses += 1
    return compiled, seconds, False
