"""Handles users have on their matmuls (issue 11, items 1-3): the user's own source line
(library frames skipped) and the module path in the report; overrides by module-path
pattern; plans that apply from another folder or virtualenv; a headline that says what
was sliced, re-emitted as the plain collective, or left alone and why."""
import importlib.util
import inspect
import json
import re
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import provenance

from helpers import assert_trees_close, mesh

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

HERE = provenance.portable_path(__file__)     # relative to the working directory


def _lines(cls, needle):
  """Line numbers of this file where `cls`'s source contains `needle`."""
  source, first = inspect.getsourcelines(cls)
  return {first + k for k, text in enumerate(source) if needle in text}


# -- Flax Linen ----------------------------------------------------------------------------

class MlpBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64, use_bias=False)(x))
    return nn.Dense(32, use_bias=False)(h)


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, use_bias=False)(x)
    return MlpBlock()(x)


def _linen_step():
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  model = Model()
  x = jax.device_put(jax.random.normal(jax.random.key(0), (16, 32)), s)
  params = model.init(jax.random.key(1), x)
  params = jax.tree.map(lambda a: jax.device_put(a, s), params)
  shardings = jax.tree.map(lambda _: s, params)

  def step(params, x):
    return jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(params)

  return jax.jit(step, in_shardings=(shardings, s), out_shardings=shardings), (params, x)


def test_linen_report_names_user_lines_and_module_paths():
  step, args = _linen_step()
  report = meshslice.explain(step)(*args)
  # 3 Dense layers: forward, backward-data (not for the first: x is not differentiated),
  # backward-weight
  assert len(report.sites) == 8
  dense = _lines(MlpBlock, "nn.Dense(") | _lines(Model, "nn.Dense(")
  for site in report.sites:
    file, line = site.source.rsplit(":", 1)
    assert file == HERE and int(line) in dense, site.source
  modules = [s.module for s in report.sites]
  assert set(modules) == {"Model/Dense_0", "Model/MlpBlock_0/Dense_0",
                          "Model/MlpBlock_0/Dense_1"}
  assert [modules.count(m) for m in ("Model/Dense_0", "Model/MlpBlock_0/Dense_0",
                                      "Model/MlpBlock_0/Dense_1")] == [2, 3, 3]
  text = str(report)
  assert "module" in text.splitlines()[1] and "Model/MlpBlock_0/Dense_1" in text
  assert f"{HERE}:" in text and "flax/" not in text


def test_linen_override_by_module_pattern_changes_exactly_those_sites():
  step, args = _linen_step()
  base = meshslice.explain(step)(*args)
  pattern = "*/MlpBlock_*/Dense_1"
  fast = meshslice.transform(step, overrides={pattern: {"ksplit": 2}})
  report = fast.explain(*args)
  hit = [s.index for s in report.sites if s.module.endswith("MlpBlock_0/Dense_1")]
  assert len(hit) == 3
  for old, new in zip(base.sites, report.sites):
    if new.index in hit:
      assert (new.algorithm, new.ksplit) == ("meshslice", 2)
    else:
      assert (new.algorithm, new.ksplit, new.dataflow) == (old.algorithm, old.ksplit,
                                                          old.dataflow)
  assert_trees_close(fast(*args), step(*args))
  # an index pin beats the pattern on its site
  one = meshslice.explain(step, overrides={pattern: {"ksplit": 2}, hit[0]: {"ksplit": 1}})(*args)
  assert [one.sites[i].ksplit for i in hit] == [1, 2, 2]


def test_module_pattern_errors():
  step, args = _linen_step()
  with pytest.raises(ValueError, match=re.escape(
      "overrides['*/NoSuchBlock/*']: module pattern '*/NoSuchBlock/*' matches no matmul of "
      "this program (it has 8 sites, indexes 0..7); the module paths are Model/Dense_0, "
      "Model/MlpBlock_0/Dense_0, Model/MlpBlock_0/Dense_1")):
    meshslice.explain(step, overrides={"*/NoSuchBlock/*": {"ksplit": 2}})(*args)
  # whole-path match: a bare layer name is not a suffix match
  with pytest.raises(ValueError, match=re.escape("module pattern 'Dense_1' matches no matmul")):
    meshslice.explain(step, overrides={"Dense_1": {"ksplit": 2}})(*args)
  with pytest.raises(ValueError, match=re.escape(
      "overrides['*/MlpBlock_0/*'] and overrides['*/Dense_1'] both match site #") +
      r"\d+ \(module Model/MlpBlock_0/Dense_1\) and pin ksplit differently \(2 vs 1\)"):
    meshslice.explain(step, overrides={"*/MlpBlock_0/*": {"ksplit": 2},
                                       "*/Dense_1": {"ksplit": 1}})(*args)
  # patterns that agree (or pin different settings) merge
  both = meshslice.explain(step, overrides={"*/MlpBlock_0/*": {"ksplit": 2},
                                            "Model/*": {"ksplit": 2}})(*args)
  assert {s.ksplit for s in both.sites} == {2}


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return MlpBlock(name="MlpBlock_0")(x), None


class _Layered(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.remat(MlpBlock)(name="remat_mlp")(x)
    layers = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=2)
    return layers(name="layers")(x, None)[0]


def test_module_paths_through_scan_and_remat():
  # names of the enclosing scan/remat equations prefix those of their bodies; JAX's own
  # scopes ('rematted_computation') and jvp/transpose wrappers are dropped
  msh = mesh((2, 4))
  model = _Layered()
  x = jnp.ones((16, 32))
  params = model.init(jax.random.key(0), x)
  last2 = lambda a: P(*(None,) * (a.ndim - 2), "x", "y") if a.ndim >= 2 else P()
  specs = jax.tree.map(lambda a: NamedSharding(msh, last2(a)), params)
  step = jax.jit(lambda p, x: jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p),
                 in_shardings=(specs, NamedSharding(msh, P("x", "y"))))
  report = meshslice.explain(step)(params, x)
  by_module = {}
  for site in report.sites:
    by_module.setdefault(site.module, set()).add(site.context)
  assert by_module == {
      "_Layered/remat_mlp/Dense_0": {"top", "remat2"},
      "_Layered/remat_mlp/Dense_1": {"top", "remat2"},
      "_Layered/layers/MlpBlock_0/Dense_0": {"scan"},
      "_Layered/layers/MlpBlock_0/Dense_1": {"scan"}}
  dense = _lines(MlpBlock, "nn.Dense(")
  assert {int(s.source.rsplit(":", 1)[1]) for s in report.sites} == dense


# -- Flax NNX, Explicit mesh axes ------------------------------------------------------------

_OUT = P("x", "y")


def _kernel():
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), ("x", "y"))


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(32, 64, use_bias=False, kernel_init=_kernel(), rngs=rngs)
    self.down = nnx.Linear(64, 32, use_bias=False, kernel_init=_kernel(), rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.up(x, out_sharding=_OUT))
    return self.down(h, out_sharding=_OUT)


class NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(32, 32, use_bias=False, kernel_init=_kernel(), rngs=rngs)
    self.mlp = NnxMlp(rngs)

  def __call__(self, x):
    return self.mlp(self.embed(x, out_sharding=_OUT))


def test_nnx_explicit_report_and_module_override():
  msh = mesh((2, 4), explicit=True)
  with jax.set_mesh(msh):
    graphdef, state = nnx.split(NnxModel(nnx.Rngs(0)))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), _OUT)

    @jax.jit
    def step(state, x):
      loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)
      return jax.grad(loss)(state)

    report = meshslice.explain(step)(state, x)
    assert len(report.sites) == 8
    calls = (_lines(NnxMlp.__call__, "self.up(") | _lines(NnxMlp.__call__, "self.down(")
             | _lines(NnxModel.__call__, "self.embed("))
    for site in report.sites:
      file, line = site.source.rsplit(":", 1)
      assert file == HERE and int(line) in calls, site.source
    # NNX puts no module names in JAX's name stack: a site is named by the parameter it
    # reads or whose gradient it makes, from the step's own pytrees (attribute names)
    assert {s.module for s in report.sites} == {"embed", "mlp/up", "mlp/down"}
    assert [s.module for s in report.sites].count("mlp/down") == 3    # fwd, dgrad, wgrad
    assert "flax/" not in str(report) and "mlp/down" in str(report)
    # one projection can be pinned alone
    fast = meshslice.transform(step, overrides={"mlp/down": {"ksplit": 2}})
    pinned = fast.explain(state, x)
    for old, new in zip(report.sites, pinned.sites):
      if new.module == "mlp/down":
        assert (new.algorithm, new.ksplit) == ("meshslice", 2)
      else:
        assert (new.algorithm, new.ksplit) == (old.algorithm, old.ksplit)
    assert sum(s.ksplit == 2 for s in pinned.sites) == 3
    assert_trees_close(fast(state, x), step(state, x))


def test_library_frames_are_never_user_code():
  import flax.linen.linear
  assert provenance.is_library_file(flax.linen.linear.__file__)
  # in a virtualenv (site-packages outside the stdlib folder), wherever it lives
  for root in ("/home/me/venv/lib/python3.12/site-packages", "/opt/conda/lib/python3.11/"
               "dist-packages"):
    assert provenance.is_library_file(f"{root}/flax/linen/linear.py")
    assert provenance.is_library_file(f"{root}/optax/_src/alias.py")
    # any installed package is a framework by default; the user may name their own
    assert provenance.is_library_file(f"{root}/mymodels/layers.py")
    assert not provenance.is_library_file(f"{root}/mymodels/layers.py",
                                          source_packages=("mymodels",))
    assert provenance.portable_path(f"{root}/flax/linen/linear.py") == "flax/linen/linear.py"
  assert provenance.portable_path(flax.linen.linear.__file__) == "flax/linen/linear.py"
  assert HERE in ("tests/test_user_handles.py", "test_user_handles.py")


# -- portable plans ---------------------------------------------------------------------------

_PROGRAM = '''
import jax
import jax.numpy as jnp


def loss(x, w1, w2):
  with jax.named_scope("mlp"):
    h = jnp.tanh(x @ w1)
  with jax.named_scope("head"):
    return jnp.sum(h @ w2)
'''


def _import_copy(folder, name, monkeypatch):
  """Write the program into `folder` (a checkout or an installed package) and import it
  from there, as a script whose folder is on sys.path."""
  folder.mkdir(parents=True)
  (folder / "handles_program.py").write_text(textwrap.dedent(_PROGRAM))
  monkeypatch.syspath_prepend(str(folder))
  spec = importlib.util.spec_from_file_location(name, folder / "handles_program.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _step_of(module):
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  args = tuple(jax.device_put(jax.random.normal(jax.random.key(i), sh) / 8, s)
               for i, sh in enumerate([(16, 64), (64, 128), (128, 64)]))
  return jax.jit(jax.grad(module.loss, argnums=(1, 2)), in_shardings=(s, s, s)), args


@pytest.mark.parametrize("layout", ["checkout", "virtualenv"])
def test_plan_saved_in_one_place_applies_in_another(tmp_path, monkeypatch, layout):
  where = {"checkout": ("laptop/proj", "pod-host/work/proj"),
           "virtualenv": ("venv1/lib/python3.11/site-packages/handles",
                          "other/venv2/lib/python3.12/site-packages/handles")}[layout]
  first = _import_copy(tmp_path / where[0], f"handles_a_{layout}", monkeypatch)
  step, args = _step_of(first)
  report = meshslice.explain(step)(*args)
  plan_file = tmp_path / "plan.json"
  report.plan.edit(0, ksplit=2).save(str(plan_file))
  text = plan_file.read_text()
  assert str(tmp_path) not in text
  expected = "handles_program.py" if layout == "checkout" else "handles/handles_program.py"
  sources = {e["source"].rsplit(":", 1)[0] for e in json.loads(text)["sites"]}
  assert sources == {expected}
  assert {e["module"] for e in json.loads(text)["sites"]} == {"mlp", "head"}
  # the same project from another folder / virtualenv: the plan applies
  second = _import_copy(tmp_path / where[1], f"handles_b_{layout}", monkeypatch)
  step2, args2 = _step_of(second)
  applied = meshslice.explain(step2, plan=str(plan_file))(*args2)
  assert applied.sites[0].ksplit == 2
  assert [s.source for s in applied.sites] == [s.source for s in report.sites]
  assert_trees_close(meshslice.transform(step2, plan=str(plan_file))(*args2), step2(*args2))
  # a plan of another program is still refused (module and file checked)
  data = json.loads(text)
  data["sites"][0]["module"] = "attention"
  with pytest.raises(ValueError, match=re.escape(
      f"plan does not match this program: site #0 was a matmul at "
      f"'{data['sites'][0]['source']}' (module attention), this program has")):
    meshslice.explain(step2, plan=meshslice.Plan.from_json(json.dumps(data)))(*args2)


def test_plans_with_absolute_paths_still_apply():
  step, args = _linen_step()
  plan = meshslice.explain(step)(*args).plan
  data = json.loads(plan.to_json())
  for entry in data["sites"]:        # as saved before sources were portable
    entry["source"] = "/home/someone/checkout/" + entry["source"]
    del entry["module"]
  meshslice.explain(step, plan=meshslice.Plan.from_json(json.dumps(data)))(*args)


def test_absolute_file_line_override_keys_match():
  step, args = _linen_step()
  report = meshslice.explain(step)(*args)
  line = report.sites[0].source.rsplit(":", 1)[1]
  key = f"{__file__}:{line}"
  pinned = meshslice.explain(step, overrides={key: {"rewrite": False}})(*args)
  assert [not s.rewritten for s in pinned.sites] == [s.source == report.sites[0].source
                                                    for s in report.sites]


# -- the headline --------------------------------------------------------------------------

def test_headline_counts_sliced_collective_and_left_alone_with_reasons():
  msh = mesh((2, 4))
  s, r = NamedSharding(msh, P("x", "y")), NamedSharding(msh, P())

  def f(x, w, v, u):
    h = jnp.tanh(x @ w)           # site 0: OS
    g = jnp.tanh(x @ u)           # site 1: OS
    return jnp.sum(h @ v) + jnp.sum(g @ v)   # sites 2, 3: K split on one operand only

  args = (jax.device_put(jnp.ones((16, 64)), s), jax.device_put(jnp.ones((64, 64)), s),
          jax.device_put(jnp.ones((64, 8)), r), jax.device_put(jnp.ones((64, 64)), s))
  step = jax.jit(f, in_shardings=(s, s, r, s))
  report = meshslice.explain(step, overrides={0: {"ksplit": 2}})(*args)
  assert [x.index for x in report.sliced] == [0]
  assert [x.index for x in report.collective] == [1]
  assert report.reasons() == (("not an OS/LS/RS pattern", (2, 3)),)
  lines = str(report).splitlines()
  assert lines[0] == ("meshslice report: mesh x=2 x y=4, profile tpu-v4; 4 matmuls: "
                      "1 sliced/overlapped, 1 plain collective, 2 left alone "
                      "(2 not an OS/LS/RS pattern)")
  assert lines[-2] == "left alone, by reason:"
  assert lines[-1].startswith("  2 x not an OS/LS/RS pattern: sites 2-3 (e.g. axis 'y' "
                              "appears at lhs K-dim 1")


@pytest.mark.parametrize("reason,label", [
    ("operand sharding unknown (no in_shardings, constraint or explicit-mode type reaches "
     "this matmul)", "operand sharding unknown"),
    ("contraction split over 'x' and no free dim can take the scattered result: a plain "
     "all-reduce", "a plain all-reduce"),
    ("contraction split over 'y' and the result is wanted unsplit over it: a plain "
     "all-reduce, left to GSPMD", "a plain all-reduce"),
    ("not provably exact: lhs dim 0 is split over ('x',) (the axes and their order must "
     "match)", "not provably exact"),
    ("int32 matmul: only floating-point matmuls are rewritten",
     "only floating-point matmuls are rewritten"),
    ("axis 'y' appears at lhs K-dim 1: not an OS/LS/RS pattern (needs resharding GSPMD "
     "would insert)", "not an OS/LS/RS pattern"),
    ("no communication needed: axis x splits only one operand's free dims (runs locally)",
     "no communication needed"),
    ("axis 'x' splits different contracting dims of lhs and rhs",
     "axis '…' splits different contracting dims of lhs and rhs"),
])
def test_reason_classes(reason, label):
  from meshslice.report import reason_class
  assert reason_class(reason) == label


def test_installed_frameworks_are_skipped_unless_named_as_the_users_own(tmp_path, monkeypatch):
  root = tmp_path / "site-packages" / "mymodel_pkg"
  root.mkdir(parents=True)
  (root / "__init__.py").write_text("")
  (root / "layers.py").write_text(
      "import jax.numpy as jnp\n\n\ndef dense(x, w):\n  return jnp.tanh(x @ w)\n")
  monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
  import importlib
  layers = importlib.import_module("mymodel_pkg.layers")
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=s)
  w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=s)

  def step(x, w):
    return layers.dense(x, w)                   # the user's line

  line = step.__code__.co_firstlineno + 1
  framework = meshslice.explain(step)(x, w).sites[0].source
  assert framework == f"{HERE}:{line}"
  own = meshslice.explain(step, source_packages=("mymodel_pkg",))(x, w).sites[0].source
  assert own == "mymodel_pkg/layers.py:5"
  with pytest.raises(ValueError, match=re.escape(
      "source_packages must be a tuple of top-level package names, e.g. ('maxtext',), got "
      "['my-pkg']")):
    meshslice.explain(step, source_packages=["my-pkg"])
