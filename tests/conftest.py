"""Every test runs on 8 emulated CPU devices."""
import importlib
import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture
def bench_script():
  """Imports a bench/ script by name, e.g. `bench_script("tpu_tune")`.

  The scripts define absl flags when imported; those flags (and the module) are dropped
  after the test, so a later test can import another script that defines flags of the
  same names (both tpu_aot and tpu_tune have --mesh)."""
  from absl import flags
  before = set(flags.FLAGS)
  imported = []

  def load(name):
    sys.path.insert(0, _BENCH)
    try:
      module = importlib.import_module(name)
    finally:
      sys.path.remove(_BENCH)
    imported.append(name)
    return module

  yield load
  for flag in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, flag)
  for name in imported:
    sys.modules.pop(name, None)
