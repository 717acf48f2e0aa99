"""Where a matmul comes from, in the user's terms: its source line and its module path.

`source_location` is the innermost frame of the user's own code: frames of JAX, the
libraries and frameworks models are written with (any installed package: flax, optax,
keras, keras_hub, penzai, maxtext, praxis, ...), numpy, the Python stdlib and meshslice
are skipped, as JAX's own traceback filtering skips its internals. A package the user
writes their model in can be named as their own (option `source_packages`), and its
frames then count. Where no frame is the user's (MaxText's model is MaxText's own code),
the source is the line in the enclosing layer that calls the matmul's layer
(`enclosing_layer_call`). Files are made portable (`portable_path`), so plans saved on one
host apply on another. `module_path` reads module names from JAX's name stack.

Example:
  >>> is_library_file("/venv/lib/python3.12/site-packages/keras/src/layers/core/dense.py")
  True
  >>> is_library_file("/venv/lib/python3.12/site-packages/keras_hub/src/models/x.py",
  ...                 source_packages=("keras_hub",))
  False
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig

from ._jax_internals import (eqn_name_stack, eqn_traceback, frame_of, jax_user_frame,
                             raw_frames, scope_names)

def source_location(eqn, source_packages=()) -> str:
  """'file:line' of the innermost frame of the user's code that produced `eqn`, with the
  file made portable by `portable_path` ('' when unknown).

  Library frames (`is_library_file`) are skipped; when only such frames exist, JAX's own
  guess is used. `source_packages` names installed packages that are the user's code.
  """
  frame = user_frame(eqn_traceback(eqn), tuple(source_packages))
  if frame is None:
    return ""
  return f"{portable_path(frame.file_name)}:{frame.start_line}"


def user_frame(traceback, source_packages=()):
  """The innermost frame of `traceback` outside library files (`is_library_file`); when
  there is none (a framework's own model, e.g. MaxText's), the line of the enclosing layer
  that calls the layer holding the matmul (`enclosing_layer_call`); else JAX's own guess;
  None without a traceback."""
  if traceback is None:
    return None
  code, lasti = raw_frames(traceback)
  for c, i in zip(code, lasti):
    if not is_library_file(c.co_filename, source_packages):
      return frame_of(c, i)
  k = enclosing_layer_call(code)
  if k is None:
    k = enclosing_call_method(code)
  if k is not None:
    return frame_of(code[k], lasti[k])
  return jax_user_frame(traceback)


def enclosing_layer_call(code) -> int | None:
  """Index (into `code`, innermost first) of the frame whose line calls the layer a matmul
  is in, inside the layer that encloses it: a framework layer's `__call__` (MaxText's
  `DenseGeneral.__call__`), then only methods of one class up to that class's `__call__`
  (`Attention.query_projection` in `Attention.__call__`: the line `query =
  self.query_projection(...)`). That line tells query from key, wi_0 from wo, where the
  matmul's own line (one `dot_general` in DenseGeneral) does not. None when no layer is
  called that way (Keras and penzai dispatch through their own wrappers and containers:
  their lines would be the same for every layer)."""
  for k, c in enumerate(code):
    if _method(c)[1] != "__call__" or _core_library_file(c.co_filename):
      continue
    between = set()
    for j in range(k + 1, len(code)):
      owner, method = _method(code[j])
      if owner is None or _core_library_file(code[j].co_filename):
        break
      if method == "__call__":
        if between <= {owner}:
          return j
        break
      between.add(owner)
  return None


def enclosing_call_method(code) -> int | None:
  """As `enclosing_layer_call` for frameworks whose layers implement `call` and are
  invoked through their base classes' `__call__` (Keras): index of the frame of the
  enclosing layer's `call` whose line calls the layer holding the matmul (keras-hub's
  `CachedGemmaAttention.call`, `query = self.query_dense(x)`), skipping the dispatch
  between them (`Layer.__call__`, `Operation.__call__` and their traceback wrappers,
  which are the same for every layer). None when the matmul is in no `call` method, or
  the next one out is the same class's."""
  for k, c in enumerate(code):
    owner, method = _method(c)
    if method != "call" or owner is None:
      continue
    for j in range(k + 1, len(code)):
      outer, name = _method(code[j])
      if outer is None or name == "__call__":
        continue        # dispatch: closures (traceback filters) and base __call__s
      return j if name == "call" and outer != owner else None
    return None
  return None


def _method(code) -> tuple:
  """(class, method) of a code object defined in a class body; (None, name) otherwise."""
  owner, _, name = code.co_qualname.rpartition(".")
  return (owner if owner and "<" not in owner else None), name


@functools.lru_cache(maxsize=4096)
def _core_library_file(filename: str) -> bool:
  """JAX, the libraries of `LIBRARIES`, the stdlib (not its site-packages: a virtualenv's
  stdlib folder holds them), frozen and generated code."""
  if filename.startswith("<"):
    return True
  filename = os.path.abspath(filename)
  if any(filename.startswith(d) for d, _ in _library_dirs()):
    return True
  return _after_package_dir(filename) is None and any(filename.startswith(d)
                                                      for d in _stdlib_dirs())


# Top-level packages whose frames are never "the user's code", wherever they are installed
# (also from a source checkout). meshslice's own package dirs are added from the installed
# package (its import name maps to several folders). Any other installed package counts
# as a library too, unless named in `source_packages`.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "equinox", "haiku", "orbax", "chex", "numpy",
             "scipy", "ml_dtypes", "opt_einsum", "meshslice")
_PACKAGE_DIRS = ("site-packages", "dist-packages")


@functools.cache
def _library_dirs() -> tuple:
  """(library folder, the folder its portable paths are relative to), longest first."""
  found = {}
  for name in LIBRARIES + ("meshslice.rewrites", "meshslice.costmodel"):
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    if spec is None:
      continue
    for folder in list(spec.submodule_search_locations or ()):
      folder = os.path.abspath(folder)
      found[folder + os.sep] = os.path.dirname(folder)
  return tuple(sorted(found.items(), key=lambda kv: -len(kv[0])))


@functools.cache
def _stdlib_dirs() -> tuple:
  paths = sysconfig.get_paths()
  dirs = {paths.get("stdlib"), paths.get("platstdlib"), os.path.dirname(os.__file__)}
  return tuple(os.path.abspath(d) + os.sep for d in dirs if d)


def _after_package_dir(filename: str):
  """The part of `filename` after its last site-packages/dist-packages folder, or None."""
  parts = filename.replace(os.sep, "/").split("/")
  for k in range(len(parts) - 2, -1, -1):
    if parts[k] in _PACKAGE_DIRS:
      return "/".join(parts[k + 1:])
  return None


@functools.lru_cache(maxsize=4096)
def is_library_file(filename: str, source_packages: tuple = ()) -> bool:
  """Whether frames of `filename` are a library's, not the user's: JAX and the libraries
  of `LIBRARIES` wherever they live, any installed (site-/dist-packages) package not in
  `source_packages`, the stdlib, frozen modules."""
  if filename.startswith("<"):             # <frozen runpy>, <string>, <stdin>, ...
    return filename.startswith("<frozen ")
  filename = os.path.abspath(filename)
  installed = _after_package_dir(filename)
  top = installed.split("/", 1)[0].removesuffix(".py") if installed is not None else None
  if top is not None and top in source_packages:
    return False
  if any(filename.startswith(d) for d, _ in _library_dirs()):
    return True
  if installed is not None:
    return True
  return any(filename.startswith(d) for d in _stdlib_dirs())


def portable_path(filename: str) -> str:
  """`filename` as the same text on every host that runs the same project:

  - a file of a library of `LIBRARIES`, or any installed package (site-packages or
    dist-packages): `package/relative/path.py` (the same in every virtualenv);
  - a file under the current working directory (the project, when run from its root):
    relative to it;
  - else a file under an entry of `sys.path` (a script's folder, a PYTHONPATH root):
    relative to the longest such entry;
  - anything else: unchanged. Separators are always '/'.
  """
  if not filename or filename.startswith("<"):
    return filename
  return _portable(os.path.abspath(filename), os.getcwd(), tuple(sys.path))


@functools.lru_cache(maxsize=4096)
def _portable(filename: str, cwd: str, path: tuple) -> str:
  for folder, root in _library_dirs():
    if filename.startswith(folder):
      return os.path.relpath(filename, root).replace(os.sep, "/")
  installed = _after_package_dir(filename)
  if installed is not None:
    return installed
  inside = lambda root: filename.startswith(root.rstrip(os.sep) + os.sep)
  if inside(cwd):
    return os.path.relpath(filename, cwd).replace(os.sep, "/")
  roots = [r for r in (os.path.abspath(p or cwd) for p in path if isinstance(p, str))
           if inside(r)]
  if roots:
    return os.path.relpath(filename, max(roots, key=len)).replace(os.sep, "/")
  return filename.replace(os.sep, "/")


def name_stack(eqn) -> str:
  return str(eqn_name_stack(eqn))


# Scopes JAX itself pushes while tracing (not the user's modules).
_JAX_SCOPES = frozenset({"rematted_computation", "checkpoint", "remat"})
# Library folders whose `Class.__call__` frames are model layers (nnx.Linear, eqx.nn.Linear).
_LAYER_DIRS = ("flax/nnx/nn/", "flax/linen/", "equinox/nn/", "haiku/_src/")


def module_path(eqn, enclosing=(), call_chain=True) -> str:
  """The module path of `eqn`, e.g. 'TransformerLM/Decoder/MlpBlock_0/Dense_0'.

  It is the JAX name stack of the equation, prefixed by those of the equations whose
  sub-jaxprs hold it (`enclosing`: NameStacks, outermost first), without transformation
  wrappers (jvp(...), transpose(...), vmap(...)) and JAX's own scopes (remat). Flax Linen
  modules, `jax.named_scope` and `jax.named_call` put names there. When the name stack
  holds no names (Flax NNX and Equinox record none), it is the chain of classes whose
  `__call__` the matmul was called from, outermost first, e.g. 'Model/MlpBlock/Linear'
  ('' with `call_chain=False`).
  """
  scopes = []
  for stack in enclosing:
    names = _scope_names(stack)
    half = len(names) // 2
    if half and names[:half] == names[half:]:
      # the transpose of a remat repeats its enclosing stack: 'transpose(jvp(M))/jvp(M)'
      names = names[:half]
    scopes += names
  scopes += _scope_names(eqn_name_stack(eqn))
  if scopes:
    return "/".join(scopes)
  return _call_chain(eqn_traceback(eqn)) if call_chain else ""


def _scope_names(stack) -> list:
  return [name for name in scope_names(stack) if name not in _JAX_SCOPES]


def _call_chain(traceback) -> str:
  if traceback is None:
    return ""
  code, _ = raw_frames(traceback)
  names = []
  for c in reversed(code):
    owner, _, method = c.co_qualname.rpartition(".")
    if method == "__call__" and owner and "<" not in owner and _is_layer_file(c.co_filename):
      names.append(owner)
  return "/".join(names)


@functools.lru_cache(maxsize=4096)
def _is_layer_file(filename: str) -> bool:
  if not is_library_file(filename):
    return True
  portable = portable_path(filename)
  return portable.startswith(_LAYER_DIRS)
