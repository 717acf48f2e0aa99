"""Which hardware profile a plan is made for when the user names none: the mesh's TPU
generation's shipped profile (a v5p mesh plans as "tpu-v5p", Ironwood as "tpu-v7x"),
"tpu-v4" on any other mesh; a profile given is always the one used. Planning only, on
compile-only TPU topologies (`meshslice.aot`): nothing compiles."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import aot, backend_flags
from meshslice.options import Options


def _site(mesh):
  """One 2D matmul, big enough to be worth planning, on `mesh` (axes x, y)."""
  x = jax.ShapeDtypeStruct((16384, 8192), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("x", "y")))
  w = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("x", "y")))
  return jax.jit(lambda a, b: a @ b), x, w


def _cpu_mesh():
  """The emulated CPU devices as a 2x4 mesh."""
  return jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _decisions(report):
  return [(s.index, s.algorithm, s.dataflow, s.ksplit, s.reason) for s in report.sites]


@pytest.mark.parametrize("topology, shape, profile", [
    ("v5p:2x2x1", (2, 2), "tpu-v5p"), ("tpu7x:2x2x1", (2, 4), "tpu-v7x"),
    ("v4:2x2x1", (2, 2), "tpu-v4")])
def test_a_tpu_mesh_plans_with_its_generations_profile(topology, shape, profile):
  pytest.importorskip("libtpu")
  mesh = aot.make_mesh(topology, shape)
  f, x, w = _site(mesh)
  flags = aot.preset_flags("dense,async", topology.split(":")[0])
  default = meshslice.explain(f, compiler_flags=flags)(x, w)
  named = meshslice.explain(f, compiler_flags=flags, profile=profile)(x, w)
  assert default.profile == profile
  assert str(default).startswith(f"meshslice report: mesh x={shape[0]} x y={shape[1]}, "
                                 f"profile {profile};")
  assert _decisions(default) == _decisions(named)
  assert default.sites[0].profile.name.startswith(profile + "@")


def test_v5e_keeps_tpu_v4_until_its_plans_are_checked():
  """With tpu-v5e the default plan sliced every GPT-3 step on v5e:8x8 and four of six
  compiled slower than XLA (0.920-0.941x, docs/tpu.md): v5e meshes plan as before."""
  pytest.importorskip("libtpu")
  mesh = aot.make_mesh("v5e:2x2", (2, 2))
  f, x, w = _site(mesh)
  assert backend_flags.mesh_generation(mesh) == "v5e"
  assert meshslice.explain(f, compiler_flags=())(x, w).profile == "tpu-v4"


def test_a_profile_given_is_the_one_used_on_any_mesh():
  pytest.importorskip("libtpu")
  mesh = aot.make_mesh("v5p:2x2x1", (2, 2))
  f, x, w = _site(mesh)
  report = meshslice.explain(f, profile="tpu-v4", compiler_flags=())(x, w)
  assert report.profile == "tpu-v4"
  assert report.sites[0].profile.name.startswith("tpu-v4@")


def test_a_mesh_of_other_devices_plans_as_tpu_v4():
  mesh = _cpu_mesh()
  assert backend_flags.mesh_generation(mesh) is None
  f, x, w = _site(mesh)
  assert meshslice.explain(f)(x, w).profile == "tpu-v4"


def test_the_mesh_profile_keeps_the_flags_read_when_the_options_were_made(monkeypatch):
  """The options are built again for the mesh's profile, but the environment is read once:
  flags set after `transform` do not reach its plans (tests/test_compiler_flags.py)."""
  pytest.importorskip("libtpu")
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(backend_flags.DENSE_FLAGS))
  options = Options.from_kwargs("meshslice.transform", {"ksplit": 2})
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
  on_v5p = options.for_mesh(aot.make_mesh("v5p:2x2x1", (2, 2)))
  assert on_v5p.profile.name == "tpu-v5p"
  assert on_v5p.compiler_flags == tuple(backend_flags.DENSE_FLAGS)
  assert on_v5p.ksplit == 2 and on_v5p.compiler_terms is not None
  assert options.for_mesh(_cpu_mesh()) is options
