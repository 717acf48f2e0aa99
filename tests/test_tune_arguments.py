"""meshslice.tune checks every argument and every candidate before it loads libtpu or
compiles, with errors naming the argument and the fix; on a mesh shape + topology it takes
the arguments a concrete mesh takes (static values, unsharded arrays); and a tune that
fails before libtpu loads leaves LIBTPU_INIT_ARGS as it was."""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import aot
from meshslice.costmodel import known_profiles
from meshslice.errors import MeshsliceError, PinError

from helpers import mesh

tune_module = importlib.import_module("meshslice.tune")   # the function shadows it
SlicedSites, HeldGathers = meshslice.SlicedSites, meshslice.HeldGathers


def _problem(names=("x", "y")):
  """A jitted matmul and its abstract arguments, sharded over a 2x4 CPU mesh."""
  s = NamedSharding(mesh((2, 4), names), P(*names))
  x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=s)
  w = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=s)
  return jax.jit(lambda a, b: jnp.tanh(a @ b)), x, w


def _not_there(*args, **kwargs):
  raise AssertionError("tune loaded libtpu or compiled before checking its arguments")


@pytest.fixture
def no_compile(monkeypatch):
  """tune may not make a TPU mesh (load libtpu) or compile; LIBTPU_INIT_ARGS set, so that
  nothing sets it in this process."""
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
  for name in ("topology", "make_mesh", "compile"):
    monkeypatch.setattr(aot, name, _not_there)


def _message(error, call) -> str:
  """The message of the `error` (exactly that class) `call` raises."""
  with pytest.raises(error) as info:
    call()
  assert type(info.value) is error, repr(info.value)
  return str(info.value)


def _tune(*args, **kwargs):
  """meshslice.tune of `_problem` on mesh=(2, 4), topology='v4:2x2x2', with `kwargs`."""
  f, x, w = _problem()
  kwargs = {"mesh": (2, 4), "topology": "v4:2x2x2", **kwargs}
  return lambda: meshslice.tune(*(args or (f, x, w)), **kwargs)


_OPTIONS = ", ".join(meshslice.Options.names())
_COLLECTIVE = {"algorithm": "collective"}

CANDIDATE_ERRORS = {
    "a list": ([{"ksplit": 2}], MeshsliceError,
               "tune: candidates must be a mapping of name -> options, got list; pass "
               "{'mine': {...}}"),
    "a misspelled option": ({"mine": {"ksplt": 2}}, MeshsliceError,
                            "tune: candidate 'mine': meshslice.transform got an unknown "
                            f"option 'ksplt'; allowed options: {_OPTIONS}"),
    "an invalid option": ({"mine": {"ksplit": 0}}, PinError,
                          "tune: candidate 'mine': ksplit must be a positive int (1 = no "
                          "slicing) or None for automatic, got 0"),
    "a wrong-case dataflow": ({"c": _COLLECTIVE, "s": SlicedSites("c", "LS", 2)}, PinError,
                              "tune: candidate 's': SlicedSites dataflow must be one of "
                              "'os', 'ls', 'rs', got 'LS'; did you mean 'ls'?"),
    "ksplit 0": ({"c": _COLLECTIVE, "s": SlicedSites("c", "ls", 0)}, PinError,
                 "tune: candidate 's': SlicedSites ksplit must be a positive int "
                 "(1 = no slicing), got 0"),
    "sliced xla": ({"s": SlicedSites("xla", "ls", 2)}, MeshsliceError,
                   "tune: candidate 's' slices the plan of 'xla', XLA's own program, which "
                   "rewrites no site; base it on an earlier candidate of transform options, "
                   "e.g. 'collective': {'algorithm': 'collective'}"),
    "held xla": ({"h": HeldGathers("xla")}, MeshsliceError,
                 "tune: candidate 'h' holds the gathers of the plan of 'xla', XLA's own "
                 "program, which rewrites no site; base it on an earlier candidate of "
                 "transform options, e.g. 'collective': {'algorithm': 'collective'}"),
    "a candidate named xla": ({"xla": {"ksplit": 2}}, MeshsliceError,
                              "tune: the candidate name 'xla' is reserved for XLA's own "
                              "program (every site left alone), which tune always compiles "
                              "first and which wins ties; name yours otherwise"),
    "a refine name": ({"refine 1: mine": {}}, MeshsliceError,
                      "tune: the candidate name 'refine 1: mine' is reserved: 'refine "
                      "<sweep>: <move>' names the plans refine= compiles; name yours "
                      "otherwise"),
    "a later base": ({"s": SlicedSites("c", "ls", 2), "c": _COLLECTIVE}, MeshsliceError,
                     "tune: candidate 's' slices the plan of 'c', which must be an earlier "
                     "candidate; put 'c' before 's'"),
    "a misspelled base": ({"collective": _COLLECTIVE,
                           "s": SlicedSites("Collective", "ls", 2)}, MeshsliceError,
                          "tune: candidate 's' slices the plan of 'Collective', which must "
                          "be an earlier candidate; did you mean 'collective'?"),
    "a base not a str": ({"h": HeldGathers(0)}, MeshsliceError,
                         "tune: candidate 'h': HeldGathers base must be the name (str) of an "
                         "earlier candidate, got 0"),
    "modules as a str": ({"c": _COLLECTIVE, "h": HeldGathers("c", "*w_up")}, MeshsliceError,
                         "tune: candidate 'h': HeldGathers modules must be a tuple of "
                         "module-path patterns (fnmatch), e.g. ('*w_up',), or () for every "
                         "site, got '*w_up'"),
    "None": ({"plain": None}, MeshsliceError,
             "tune: candidate 'plain' must be a dict of meshslice.transform options, a "
             "SlicedSites or a HeldGathers, got None; XLA's own program is the 'xla' "
             "candidate, always compiled"),
    "a name not a str": ({2: {}}, MeshsliceError,
                         "tune: a candidate's name must be a non-empty str, got 2; e.g. "
                         "{'ksplit=2': {'ksplit': 2}}"),
}


@pytest.mark.parametrize("case", CANDIDATE_ERRORS)
def test_every_candidate_is_checked_before_anything_compiles(no_compile, case):
  candidates, error, message = CANDIDATE_ERRORS[case]
  assert _message(error, _tune(candidates=candidates)) == message


def test_the_default_candidates_pass_the_checks():
  checked = tune_module._check_candidates(tune_module.CANDIDATES, "tpu-v4")
  assert checked == tune_module.CANDIDATES


_PROFILES = ", ".join(known_profiles())

KEYWORD_ERRORS = {
    "results a list": ({"results": []},
                       "tune: results must be a dict (it receives {name: Candidate}) or "
                       "None, got list; pass results={}"),
    "echo a str": ({"echo": "yes"},
                   "tune: echo must be a print-like callable (e.g. echo=print) or None for "
                   "no output, got str 'yes'"),
    "echo a bool": ({"echo": True},
                    "tune: echo must be a print-like callable (e.g. echo=print) or None for "
                    "no output, got bool True"),
    "refine a bool": ({"refine": True},
                      "tune: refine must be a non-negative int (sweeps of local search after "
                      "the candidates; 0 for none), got True"),
    "max_peak 0": ({"max_peak": 0},
                   "tune: max_peak must be a positive number (a multiple of XLA's program's "
                   "peak memory, e.g. 1.10) or None, got 0"),
    "profile an int": ({"profile": 3},
                       f"tune: profile must be a shipped hardware profile name ({_PROFILES}), "
                       "the path of a profile JSON file, a meshslice.costmodel."
                       "HardwareProfile, or None for the topology's generation's, got int 3"),
    "profile unknown": ({"profile": "tpu-v9"},
                        "tune: profile: unknown hardware profile 'tpu-v9'; known profiles: "
                        f"{_PROFILES} (or pass the path of a profile JSON file)"),
    "mesh a str": ({"mesh": "2x4"},
                   "tune: mesh shape must be a tuple of positive ints, one size per mesh "
                   "axis (e.g. (2, 4)), got '2x4'"),
    "mesh without topology": ({"topology": None},
                              "tune: mesh must be a concrete jax.sharding.Mesh of TPU devices "
                              "(aot.make_mesh), or a shape tuple together with topology=, "
                              "e.g. mesh=(2, 4), topology='v4:2x2x2'; got tuple (2, 4)"),
    "mesh of another size": ({"mesh": (2, 2)},
                             "tune: mesh shape (2, 2) has 4 devices but topology 'v4:2x2x2' "
                             "has 8; pick a shape whose product is 8"),
    "mesh of chips on tpu7x": ({"mesh": (2, 2), "topology": "tpu7x:2x2x1"},
                               "tune: mesh shape (2, 2) has 4 devices but topology "
                               "'tpu7x:2x2x1' has 8 (2 per chip); pick a shape whose "
                               "product is 8"),
    "topology malformed": ({"topology": "v4:2x2"},
                           "tune: topology 'v4:2x2': v4 is a 3D torus, so give 3 positive "
                           "chip counts, e.g. 'v4:2x2x2'"),
    "topology an int": ({"topology": 8},
                        "tune: topology must be a TPU topology name such as 'v4:2x2x2', got "
                        "int 8"),
}


@pytest.mark.parametrize("case", KEYWORD_ERRORS)
def test_every_keyword_is_checked_before_anything_compiles(no_compile, case):
  kwargs, message = KEYWORD_ERRORS[case]
  assert _message(MeshsliceError, _tune(**kwargs)) == message


def test_the_mesh_and_the_arguments_are_checked_before_anything_compiles(no_compile):
  f, x, w = _problem()
  cpu = x.sharding.mesh
  assert _message(MeshsliceError, _tune(mesh=cpu)) == (
      "tune: topology='v4:2x2x2' goes with a mesh shape (mesh=(2, 4), "
      "topology='v4:2x2x2'), but mesh is a concrete Mesh, whose devices are its topology; "
      "drop topology=, or pass the mesh's shape")
  assert _message(MeshsliceError, _tune(mesh=cpu, topology=None)) == (
      "tune: the mesh's devices are not TPUs; tune compiles for a TPU topology "
      "(meshslice.aot.make_mesh)")
  assert _message(MeshsliceError, _tune("step", x, w)) == (
      "tune: step must be a callable (the jitted training step), got str")
  # on a mesh shape, the NamedShardings give the axis names: one mesh's, one per size
  bare = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
  assert _message(MeshsliceError, _tune(f, *bare)) == (
      "tune: mesh=(2, 4) with topology= moves the arguments' NamedShardings onto "
      "'v4:2x2x2', but no argument has one; shard the arguments over a mesh with 2 axes, "
      "or pass a concrete mesh, mesh=aot.make_mesh('v4:2x2x2', (2, 4), axis_names)")
  _, _, other = _problem(("a", "b"))
  assert _message(MeshsliceError, _tune(f, x, other)) == (
      "tune: the arguments' NamedShardings are over meshes with different axis names, "
      "('x', 'y') and ('a', 'b'); tune moves them onto one mesh of 'v4:2x2x2': shard "
      "every argument over one mesh's axes")
  row = jax.ShapeDtypeStruct((256, 512), jnp.float32,
                             sharding=NamedSharding(mesh((8,), ("x",)), P("x")))
  assert _message(MeshsliceError, _tune(f, row, w.update(sharding=None))) == (
      "tune: mesh=(2, 4) has 2 axes but the arguments' NamedShardings are over 1, "
      "('x',); give one size per axis")


def test_onto_a_topology_moves_named_shardings_and_passes_every_other_argument_on():
  # the shape + topology path: what a concrete mesh is given, with NamedShardings moved
  f, x, w = _problem()
  target = mesh((4, 2))
  committed = jax.device_put(jnp.ones((4,)), jax.devices()[1])        # one device's
  weak = jax.device_put(jnp.asarray(2.0), x.sharding.update(spec=P()))
  scale = jax.ShapeDtypeStruct((), jnp.float32)                          # no sharding
  numpy = np.float32(3.0)
  moved = tune_module._onto(target, (x, {"w": committed, "scale": scale}, weak, 2.0, numpy,
                                     "relu", None))
  mx, tree, mweak, lr, mnumpy, activation, none = moved
  assert mx == jax.ShapeDtypeStruct((256, 512), jnp.float32,
                                    sharding=NamedSharding(target, P("x", "y")))
  assert tree == {"w": jax.ShapeDtypeStruct((4,), jnp.float32), "scale": scale}
  assert tree["w"].sharding is None and tree["scale"].sharding is None
  assert mweak == jax.ShapeDtypeStruct((), jnp.float32, weak_type=True,
                                       sharding=NamedSharding(target, P()))
  assert (lr, mnumpy, activation, none) == (2.0, numpy, "relu", None)
  assert mnumpy is numpy


def _raise(*args, **kwargs):
  raise RuntimeError("failed after libtpu loaded")


def test_a_tune_that_fails_before_libtpu_loads_leaves_libtpu_init_args_as_it_was(monkeypatch):
  # as in a fresh process: libtpu not loaded, LIBTPU_INIT_ARGS unset; tune sets the
  # generation's async flags, then fails making the mesh, before libtpu loads
  monkeypatch.setattr(aot, "_FLAGS_AT_LOAD", [])
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  monkeypatch.setattr(aot, "have_libtpu", lambda: False)
  with pytest.raises(RuntimeError, match="^compiling for TPU needs libtpu"):
    _tune(candidates={})()
  assert "LIBTPU_INIT_ARGS" not in os.environ and aot._FLAGS_AT_LOAD == []
  # the user's own flags are theirs: not touched
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_mine=true")
  with pytest.raises(RuntimeError, match="^compiling for TPU needs libtpu"):
    _tune(candidates={})()
  assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_mine=true"
  # libtpu loaded with tune's flags, then the error: they stay, as the flags it runs with
  monkeypatch.delenv("LIBTPU_INIT_ARGS")
  monkeypatch.setattr(aot, "have_libtpu", lambda: True)
  monkeypatch.setattr(aot, "_prepare_env", lambda: None)
  monkeypatch.setattr("jax.experimental.topologies.get_topology_desc", _raise)
  with pytest.raises(RuntimeError, match="^failed after libtpu loaded$"):
    _tune(candidates={})()
  flags = " ".join(aot.preset_flags("async", "v4"))
  assert os.environ["LIBTPU_INIT_ARGS"] == aot._FLAGS_AT_LOAD[0] == flags


_FRESH_PROCESS = textwrap.dedent("""
    import json, os
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import meshslice
    from meshslice import aot
    jax.config.update("jax_platforms", "cpu")
    auto = (jax.sharding.AxisType.Auto,) * 2
    cpu = jax.make_mesh((2, 4), ("x", "y"), axis_types=auto)
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(cpu, P("x", "y")))
    w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(cpu, P("x", "y")))

    def train(a, b, scale, lr):
      h = jnp.tanh(a @ b) * scale
      return h * lr if lr > 1 else h          # lr must be static: a Python value
    step = jax.jit(train, static_argnums=3)
    scale = jax.ShapeDtypeStruct((), jnp.float32)     # no sharding
    out = {}
    try:                                       # fails tracing, after libtpu loaded
      meshslice.tune(jax.jit(lambda a, b: a @ a), x, w, mesh=(2, 4), topology="v4:2x2x2",
                     candidates={})
    except TypeError as e:
      out["error"] = type(e).__name__
    out["flags"] = [os.environ.get("LIBTPU_INIT_ARGS"), aot._FLAGS_AT_LOAD[0]]
    shaped, concrete = {}, {}
    plan = meshslice.tune(step, x, w, scale, 2.0, mesh=(2, 4), topology="v4:2x2x2",
                          candidates={}, results=shaped)
    tpu = aot.make_mesh("v4:2x2x2", (2, 4))
    xt, wt = (a.update(sharding=NamedSharding(tpu, P("x", "y"))) for a in (x, w))
    same = meshslice.tune(step, xt, wt, scale, 2.0, mesh=tpu, candidates={}, results=concrete)
    out["plans equal"] = plan == same
    out["sites"] = len(plan.sites)
    out["step_s"] = [shaped["xla"].step_s, concrete["xla"].step_s]
    out["compiled with"] = shaped["xla"].result.flags
    print("RESULT " + json.dumps(out))
""")


def test_shape_and_topology_take_static_and_unsharded_arguments_as_a_concrete_mesh_does():
  # a fresh process (libtpu not loaded, no LIBTPU_INIT_ARGS: tune sets the async flags);
  # a static float and an unsharded abstract scalar, on both paths; 2 compiles
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], env=env, capture_output=True,
                        text=True, timeout=600)
  lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  assert done.returncode == 0 and lines, done.stderr[-3000:]
  out = json.loads(lines[-1][len("RESULT "):])
  flags = " ".join(aot.preset_flags("async", "v4"))
  # the failed tune: libtpu loaded with tune's flags, and LIBTPU_INIT_ARGS says so
  assert out["error"] == "TypeError" and out["flags"] == [flags, flags]
  assert out["compiled with"] == flags
  assert out["plans equal"] and out["sites"] == 1
  assert out["step_s"][0] == out["step_s"][1] > 0
