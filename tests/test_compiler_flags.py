"""Compiler flags reach planning as data (`compiler_flags=`), never read from the
environment while planning: a plan is a function of the program, the mesh, the options
and the flags. None takes this process's LIBTPU_INIT_ARGS once, when the options are made."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import backend_flags

from helpers import windowed_asked


def _pod_site():
  """One big 2D matmul on an abstract 256-device mesh, planned for TPU v4."""
  abstract = jax.sharding.AbstractMesh((32, 8), ("x", "y"),     # Auto on every jax
                                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = jax.ShapeDtypeStruct((65536, 8192), jnp.bfloat16,
                           sharding=NamedSharding(abstract, P("x", "y")))
  w = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16,
                           sharding=NamedSharding(abstract, P("x", "y")))
  return jax.jit(lambda a, b: a @ b), x, w


def test_flags_given_as_data_decide_xla_program_whatever_the_environment(monkeypatch):
  asked = windowed_asked(monkeypatch)
  f, x, w = _pod_site()
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(backend_flags.DENSE_FLAGS))
  meshslice.explain(f, profile="tpu-v4", relayout=False, compiler_flags="")(x, w)
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
  meshslice.explain(f, profile="tpu-v4", relayout=False,
                    compiler_flags=backend_flags.DENSE_FLAGS)(x, w)
  assert asked == [True, False]      # windowed einsum priced per the given flags


def test_the_environment_is_read_when_the_options_are_made_not_while_planning(monkeypatch):
  asked = windowed_asked(monkeypatch)
  f, x, w = _pod_site()
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(backend_flags.DENSE_FLAGS))
  explained = meshslice.explain(f, profile="tpu-v4", relayout=False)
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")       # changed after: the plan does not see it
  first = explained(x, w)
  assert asked == [False]
  again = meshslice.explain(f, profile="tpu-v4", relayout=False,
                            compiler_flags=backend_flags.DENSE_FLAGS)(x, w)
  assert first.plan.to_json() == again.plan.to_json()


def test_bad_compiler_flags_are_named():
  f, x, w = _pod_site()
  with pytest.raises(ValueError, match="compiler_flags must be a LIBTPU_INIT_ARGS string or "
                                       "a sequence of '--flag=value' strings \\(and libtpu's "
                                       "NAME=VALUE settings"):
    meshslice.explain(f, compiler_flags=["xla_tpu_enable_async_all_to_all=true"])
  with pytest.raises(ValueError, match="compiler_flags must be"):
    meshslice.transform(f, compiler_flags=3)


def test_libtpu_settings_in_the_flags_are_accepted(monkeypatch):
  """MaxText's v4 scripts export LIBTPU_INIT_ARGS="--xla_enable_async_all_gather=true
  TPU_MEGACORE=MEGACORE_DENSE": libtpu takes the NAME=VALUE setting, so the pass must
  too (it raised before), whether read from the environment or passed; the flags around
  it still count."""
  f, x, w = _pod_site()
  args = "--xla_enable_async_all_gather=true TPU_MEGACORE=MEGACORE_DENSE"
  monkeypatch.setenv("LIBTPU_INIT_ARGS", args)
  from_env = meshslice.explain(f, profile="tpu-v4", relayout=False)(x, w)
  passed = meshslice.explain(f, profile="tpu-v4", relayout=False,
                             compiler_flags=args.split())(x, w)
  plain = meshslice.explain(f, profile="tpu-v4", relayout=False,
                            compiler_flags=("--xla_enable_async_all_gather=true",))(x, w)
  assert from_env.plan.to_json() == passed.plan.to_json() == plain.plan.to_json()
  with pytest.raises(ValueError, match="compiler_flags must be"):
    meshslice.explain(f, compiler_flags=["tpu_megacore=dense"])
