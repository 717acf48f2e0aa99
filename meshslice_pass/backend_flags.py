"""Whether the backend a program will run on is set up to overlap sliced collectives.

Slicing only pays when the compiler runs each slice's collective asynchronously beside
the previous slice's matmul. On TPU that takes libtpu's async collective flags, on GPU
XLA's latency-hiding scheduler (docs/tpu.md); both are read once, when the backend
starts. The report says when they are missing.

Example:
  >>> missing_overlap_flags("tpu", {"LIBTPU_INIT_ARGS": ""})[:2]
  ('--xla_tpu_enable_async_collective_fusion=true', '--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true')
  >>> missing_overlap_flags("cpu", {})
  ()
"""
from __future__ import annotations

import os

from jax.sharding import Mesh

from .aot import ASYNC_FLAGS as TPU_OVERLAP_FLAGS

GPU_OVERLAP_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
_VARIABLE = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}


def missing_overlap_flags(platform: str, environ=None) -> tuple:
  """The overlap flags `platform` ("tpu", "gpu", "cuda", "rocm") lacks in `environ`."""
  platform = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
  if platform not in _VARIABLE:
    return ()
  environ = os.environ if environ is None else environ
  given = set(environ.get(_VARIABLE[platform], "").split())
  wanted = TPU_OVERLAP_FLAGS if platform == "tpu" else GPU_OVERLAP_FLAGS
  return tuple(flag for flag in wanted if flag not in given)


def overlap_note(sites, mesh, environ=None) -> tuple:
  """A report note when sliced sites will run on a backend without its overlap flags."""
  if not isinstance(mesh, Mesh) or not any(s.rewritten and (s.ksplit or 1) > 1
                                           for s in sites):
    return ()        # an AbstractMesh has no devices: the backend is not known here
  platform = getattr(mesh.devices.flat[0], "platform", "")
  missing = missing_overlap_flags(platform, environ)
  if not missing:
    return ()
  variable = _VARIABLE["gpu" if platform in ("gpu", "cuda", "rocm") else platform]
  return (f"sliced collectives overlap the matmuls on {platform.upper()} only with "
          f"{' '.join(missing)} in {variable} (set before jax starts; docs/tpu.md); "
          "without them the slices run one after another",)
