"""Which compiler a traced program is for: the platform of its mesh's devices.

With ahead-of-time compiles (`meshslice.aot`) a program is traced on a CPU host for TPU
devices, so `jax.default_backend()` ("cpu") says nothing about the target; the mesh
does: a concrete mesh's devices, or (inside a shard_map body, or for an AbstractMesh
built from devices) the abstract mesh's device.
"""
from __future__ import annotations

import jax

from ._jax_compat import abstract_device


def target_platform(mesh=None) -> str:
  """"cpu", "tpu", "gpu", ...: the platform `mesh` (default: the mesh of the
  shard_map or `jax.set_mesh` being traced) compiles for; JAX's default backend when
  the mesh names no devices.

  >>> import jax
  >>> target_platform(jax.make_mesh((1,), ("x",))) == jax.devices()[0].platform
  True
  """
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  try:
    return mesh.devices.flat[0].platform
  except (ValueError, AttributeError):      # an AbstractMesh has no devices
    device = abstract_device(mesh)
    return getattr(device, "platform", None) or jax.default_backend()
