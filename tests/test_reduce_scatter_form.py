"""reduce_scatter="all_to_all": an ls / rs site's reduce-scatter as an all-to-all and a
local sum (the form TPU v4 runs asynchronously). Same values and gradients as plain jit
and an unsharded run; the rewritten program has all-to-alls where it had reduce-scatters;
the choice is a global option, a per-site pin, a plan field and a tune candidate."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import gpt
from meshslice.rewrites import scatter

from helpers import assert_trees_close, mesh

tune = importlib.import_module("meshslice.tune")     # the function meshslice.tune shadows it


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axis", ["x", "y"])
def test_all_to_all_form_equals_psum_scatter(axis, dim):
  m = mesh((2, 4))
  x = np.random.RandomState(0).standard_normal((8, 16, 24)).astype(np.float32)

  def per_device(form):
    def body(a):
      a = a * (lax.axis_index(("x", "y")) + 1.0)    # each device holds other partials
      return scatter.reduce_scatter(a, axis, dim, form)[None]
    # every device's own piece, stacked on a leading device dim
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=P(), out_specs=P(("x", "y")),
                                 check_vma=False))(x)

  want = per_device("reduce_scatter")
  got = per_device("all_to_all")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)
  with pytest.raises(ValueError, match="reduce-scatter form must be one of"):
    scatter.reduce_scatter(x, axis, dim, "ring")


def _demo():
  cfg = gpt.ModelConfig()
  m = gpt.make_mesh((2, 4))
  return cfg, m, gpt.make_step(cfg, m, donate=False), gpt.place(cfg, m)


@pytest.fixture(scope="module")
def demo_run():
  """The demo step and its outputs under plain jit and on one device (no sharding at
  all): computed once for both options below (each is a compile of the whole step)."""
  cfg, m, step, (params, batch) = _demo()
  plain = step(params, batch)
  with jax.default_device(jax.devices()[0]):
    single = jax.jit(lambda p, b: gpt.train_step(cfg, p, b))(
        *jax.device_get((params, batch)))
  return step, params, batch, plain, single


@pytest.mark.parametrize("options", [{"algorithm": "collective"},
                                     {"algorithm": "meshslice", "ksplit": 2}])
def test_all_to_all_sites_match_plain_jit_and_the_unsharded_run(options, demo_run):
  step, params, batch, old, single = demo_run
  fast = meshslice.transform(step, reduce_scatter="all_to_all", **options)
  report = fast.explain(params, batch)
  forms = {(s.dataflow, s.reduce_scatter) for s in report.rewritten}
  assert ("rs", "all_to_all") in forms and ("ls", "all_to_all") in forms
  assert all(form is None for flow, form in forms if flow == "os")
  assert "rs=all_to_all" in str(report)
  jaxpr = str(jax.make_jaxpr(fast)(params, batch))
  assert "all_to_all" in jaxpr and "reduce_scatter" not in jaxpr
  # the demo's ls sites scatter the hidden dim of (batch, seq, hidden) partials: cut before
  # the dot (a 4-d dot_general output, pieces first), never reduced by a reduction
  assert "reduce_sum" not in jaxpr.split("all_to_all")[1]
  default = str(jax.make_jaxpr(meshslice.transform(step, **options))(params, batch))
  assert "reduce_scatter" in default and "all_to_all" not in default
  new = fast(params, batch)
  assert_trees_close(new, old)
  assert_trees_close(new, single)


@pytest.mark.parametrize("ksplit", [1, 2])
def test_a_strided_scatter_is_cut_before_the_matmul(ksplit):
  """An ls site whose scattered dim (N of (M, N)) does not lead: the moving operand is cut
  into (n, N / n) before the dot, the dot writes (M, n, N / n), moved to (n, M, N / n);
  the all-to-all splits dim 0 and adds sum the pieces. Values as plain jit and the
  unsharded product."""
  m = mesh((2, 4))
  rng = np.random.RandomState(3)
  x = jax.device_put(jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
                     NamedSharding(m, P("x", "y")))
  w = jax.device_put(jnp.asarray(rng.standard_normal((32, 64)), jnp.float32),
                     NamedSharding(m, P("y", "x")))
  step = jax.jit(lambda a, b: a @ b, in_shardings=(x.sharding, w.sharding),
                 out_shardings=NamedSharding(m, P("x", "y")))
  fast = meshslice.transform(step, algorithm="meshslice", ksplit=ksplit,
                             reduce_scatter="all_to_all")
  site, = fast.explain(x, w).rewritten
  assert (site.dataflow, site.reduce_scatter) == ("ls", "all_to_all")
  jaxpr = str(jax.make_jaxpr(fast)(x, w))
  assert jaxpr.count("all_to_all[") == ksplit and "split_axis=0" in jaxpr
  assert "reduce_sum" not in jaxpr and "reduce_scatter" not in jaxpr
  # the dot's output is (M/R=32, n=4, slice of N / n), its pieces dim moved first
  piece = 64 // 4 // ksplit
  assert f"f32[32,4,{piece}]{{V:(x,y)}} = dot_general" in jaxpr, jaxpr
  assert f"f32[4,32,{piece}]{{V:(x,y)}} = transpose[permutation=(1, 0, 2)]" in jaxpr
  assert_trees_close(fast(x, w), step(x, w))
  assert_trees_close(fast(x, w), np.asarray(x) @ np.asarray(w))


@pytest.mark.parametrize("shape, dim, pays", [((1, 6144, 12288), 1, True),
                                               ((6144, 12288), 0, True),
                                               ((4, 2048, 49152), 2, False),
                                               ((1, 4, 8), 2, False)])
def test_pieces_are_contiguous_only_where_the_scattered_dim_leads(shape, dim, pays):
  assert scatter.pieces_contiguous(shape, dim) is pays


@pytest.mark.parametrize("dim, summed_by", [(0, "add"), (1, "reduce_sum")])
def test_contiguous_pieces_are_summed_by_adds(dim, summed_by):
  """Adds fuse into the consumer on TPU; a strided partial keeps the reduction."""
  body = jax.shard_map(lambda a: scatter.reduce_scatter(a, "y", dim, "all_to_all"),
                       mesh=mesh((2, 4)), in_specs=P(), out_specs=P(), check_vma=False)
  jaxpr = str(jax.make_jaxpr(body)(jnp.ones((8, 8), jnp.float32)))
  assert "all_to_all" in jaxpr
  assert ("reduce_sum" in jaxpr) is (summed_by == "reduce_sum")
  assert jaxpr.count(" add ") == (3 if summed_by == "add" else 0), jaxpr


def test_check_passes_with_the_all_to_all_form():
  _, _, step, (params, batch) = _demo()
  result = meshslice.check(step, algorithm="collective", reduce_scatter="all_to_all")(
      params, batch)
  assert result.ok, str(result)


def test_pin_plan_and_errors():
  _, m, step, (params, batch) = _demo()
  report = meshslice.explain(step, algorithm="collective")(params, batch)
  rs = next(s for s in report.rewritten if s.dataflow == "rs")
  os_ = next(s for s in report.rewritten if s.dataflow == "os")
  pinned = meshslice.explain(step, algorithm="collective", overrides={
      rs.index: {"reduce_scatter": "all_to_all"},
      os_.index: {"reduce_scatter": "all_to_all"}})(params, batch)
  by_index = {s.index: s for s in pinned.sites}
  assert [s.index for s in pinned.sites if s.reduce_scatter] == [rs.index]
  assert (f"overrides[{os_.index}]: reduce_scatter='all_to_all' not used: only the ls / rs "
          "sites of meshslice and collective take it (this is collective os)"
          in by_index[os_.index].note)
  # a saved plan carries the form, and only where it is set
  plan = pinned.plan
  text = plan.to_json()
  assert text.count('"reduce_scatter": "all_to_all"') == 1
  assert '"reduce_scatter"' not in report.plan.to_json()
  again = meshslice.explain(step, plan=meshslice.Plan.from_json(text))(params, batch)
  assert [s.index for s in again.sites if s.reduce_scatter] == [rs.index]
  edited = report.plan.edit(rs.index, reduce_scatter="all_to_all")
  assert meshslice.explain(step, plan=edited)(params, batch).sites[rs.index].reduce_scatter \
      == "all_to_all"
  with pytest.raises(ValueError, match=r"^reduce_scatter must be one of 'reduce_scatter', "
                     r"'all_to_all', 'auto' \(or None for 'auto'\), got 'all-to-all'; did "
                     r"you mean 'all_to_all'\?$"):
    meshslice.transform(step, reduce_scatter="all-to-all")
  with pytest.raises(ValueError, match=r"^overrides\[3\]: reduce_scatter must be one of"):
    meshslice.transform(step, overrides={3: {"reduce_scatter": "ring"}})


def test_tune_keeps_the_form_apart():
  assert tune.CANDIDATES["collective+all_to_all"] == {"algorithm": "collective",
                                                       "reduce_scatter": "all_to_all"}
  _, _, step, (params, batch) = _demo()
  plain = tune._frozen(meshslice.explain(step, algorithm="collective")(params, batch))
  a2a = tune._frozen(meshslice.explain(step, algorithm="collective",
                                       reduce_scatter="all_to_all")(params, batch))
  assert tune._decisions(plain) != tune._decisions(a2a)


def test_bf16_all_to_all_site_matches_within_bf16_tolerance():
  m = mesh((2, 4))
  ls = NamedSharding(m, P("x", "y"))
  x = jax.device_put(jnp.asarray(np.random.RandomState(1).standard_normal((64, 128)),
                                 jnp.bfloat16), ls)
  w = jax.device_put(jnp.asarray(np.random.RandomState(2).standard_normal((128, 64)),
                                 jnp.bfloat16), NamedSharding(m, P("x", "y")))
  step = jax.jit(lambda a, b: jax.lax.with_sharding_constraint(a @ b, ls))
  fast = meshslice.transform(step, algorithm="collective", reduce_scatter="all_to_all")
  assert_trees_close(fast(x, w), step(x, w), jnp.bfloat16)
  want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  assert_trees_close(fast(x, w), want, jnp.bfloat16)


def test_auto_takes_the_all_to_all_form_on_tpu_with_async_all_to_all(monkeypatch):
  """The default ("auto"): one reduce-scatter on CPU, and on TPU unless libtpu's async
  all-to-all is on; with it, the all-to-all form where it pays."""
  pytest.importorskip("libtpu")
  from meshslice import aot, backend_flags
  tpu = aot.make_mesh("v4:2x2x2", (2, 4))
  step, params, data = aot.model_step("gpt3", tpu, layers=1, batch=8)

  def explain(flags, **options):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(flags))
    options.setdefault("algorithm", "collective")
    with jax.set_mesh(tpu):
      return meshslice.explain(step, **options)(params, data)

  def forms(flags, **options):
    return {(s.dataflow, s.reduce_scatter) for s in explain(flags, **options).rewritten}

  safe = backend_flags.SAFE_ASYNC_FLAGS
  with_a2a = safe + backend_flags.ASYNC_ALL_TO_ALL_FLAGS
  assert {form for _, form in forms(safe)} == {None}
  auto = forms(with_a2a)
  assert ("rs", "all_to_all") in auto and ("ls", "all_to_all") in auto
  assert forms(with_a2a, reduce_scatter="auto") == auto
  assert {form for _, form in forms(with_a2a, reduce_scatter="reduce_scatter")} == {None}
  assert forms(safe, reduce_scatter="all_to_all") == auto     # asked: whatever the flags
  # a plan keeps the forms it was made with under other flags
  one_collective = explain(safe).plan
  assert '"reduce_scatter"' not in one_collective.to_json()
  assert {f for _, f in forms(with_a2a, plan=one_collective, algorithm=None)} == {None}
  assert forms(safe, plan=explain(with_a2a).plan, algorithm=None) == auto
  # on the CPU mesh the flag means nothing
  _, _, cpu_step, (cpu_params, batch) = _demo()
  monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(with_a2a))
  cpu = meshslice.explain(cpu_step, algorithm="collective")(cpu_params, batch)
  assert all(s.reduce_scatter is None for s in cpu.rewritten)


def test_the_report_asks_for_the_flag_on_tpu(monkeypatch):
  pytest.importorskip("libtpu")
  from meshslice import aot, backend_flags
  v4 = aot.make_mesh("v4:2x2x1", (2, 2))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(v4, P("x", "y")))
  w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(v4, P("y", "x")))

  def notes(flags):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", " ".join(flags))
    with jax.set_mesh(v4):
      report = meshslice.explain(jax.jit(lambda a, b: a @ b), algorithm="collective")(x, w)
    assert [s.dataflow for s in report.rewritten] == ["ls"]
    return report.notes

  note, = notes(backend_flags.SAFE_ASYNC_FLAGS)
  assert note == ("1 rewritten site reduce-scatters its partial products, which libtpu "
                  "keeps synchronous on TPU v4; with --xla_tpu_enable_async_all_to_all=true "
                  "in LIBTPU_INIT_ARGS as well (set before jax starts) the pass sends them as "
                  "async all-to-alls (reduce_scatter='auto'; docs/tpu.md)")
  assert notes(backend_flags.SAFE_ASYNC_FLAGS + backend_flags.ASYNC_ALL_TO_ALL_FLAGS) == ()


def test_auto_reads_an_abstract_tpu_meshs_device_not_the_host():
  """A step planned on the AbstractMesh of a TPU topology, outside any mesh context,
  takes the all-to-all form on this CPU host as on a TPU one: the plan is a function of
  the mesh and the flags, not of the host's backend."""
  pytest.importorskip("libtpu")
  from meshslice import aot, backend_flags
  abstract = aot.make_mesh("v4:2x2x2", (2, 4)).abstract_mesh
  step, params, data = aot.model_step("gpt3", abstract, layers=1, batch=8)
  with_a2a = backend_flags.SAFE_ASYNC_FLAGS + backend_flags.ASYNC_ALL_TO_ALL_FLAGS
  report = meshslice.explain(step, algorithm="collective", compiler_flags=with_a2a)(
      params, data)
  forms = {(s.dataflow, s.reduce_scatter) for s in report.rewritten}
  assert ("rs", "all_to_all") in forms and ("ls", "all_to_all") in forms
