"""Every test runs on 8 emulated CPU devices."""
import importlib
import os
import sys

import pytest

# eight emulated CPU devices and fast codegen (cpu_flags.py); subprocesses that drop
# XLA_FLAGS compile at the default level
from cpu_flags import CPU_XLA_FLAGS  # noqa: E402

os.environ.setdefault("XLA_FLAGS", CPU_XLA_FLAGS)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")

# Parallel by default. With pytest-xdist installed (the dev extra) and no -n given,
# `python -m pytest` runs as `-n auto --maxprocesses=4 --dist worksteal`:
# - one worker per core (2 on CI's machine), at most 4: each worker is a process that holds
#   jax, 8 emulated devices and its compiled programs (up to 1.5 GiB measured, and the
#   suite's subprocesses on top), so a many-core machine does not spend its memory on
#   workers;
# - worksteal: each worker takes a contiguous half of the tests (a module's tests, and its
#   module-scoped fixtures, mostly stay on one worker) and an idle worker takes over part
#   of the other's queue, so a few long tests at the end do not leave a core idle.
# Set here rather than as addopts so that an environment without xdist, or `-p no:xdist`,
# still runs the suite (serially); `-n 0` runs it serially, `-n N` on N workers.
_PARALLEL = dict(numprocesses="auto", maxprocesses=4, dist="worksteal")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """The `_PARALLEL` defaults, before xdist's own pytest_cmdline_main reads its options
  (this hook runs first: conftests register after installed plugins)."""
  if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
      or config.getoption("numprocesses") is not None):
    return
  config.option.numprocesses = _PARALLEL["numprocesses"]
  config.option.maxprocesses = config.option.maxprocesses or _PARALLEL["maxprocesses"]
  if config.option.dist == "no":
    config.option.dist = _PARALLEL["dist"]


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
