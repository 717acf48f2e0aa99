"""The step template (planning._STEP_TEMPLATE_MEASURED): on v4 under the flags it was
measured under (windowed einsum off, async all-to-all on), the default plan is the plan
that compiled fastest for whole steps and layers: every 2D site the plain collective
algorithm, lhs-stationary sites sliced in two (the step's large ones, the MLP's, in
four), the backward pass' large activation gradient dy @ W^T in two, a large down
projection's weight gradient in two when its slices still compute for long enough,
reduce-scatters as all-to-alls. Anything else (other flags, another generation, a pinned
algorithm, ksplit or reduce-scatter form) keeps the per-site model's choices. Planning
only, on v4:2x2x2 as 2x4: nothing compiles (8 sequences on 8 chips: each chip's matmuls
are those of one sequence per chip at any scale)."""
import pytest

from meshslice import aot

pytest.importorskip("libtpu")

import meshslice  # noqa: E402

# the sites of the GPT-3 layer step no mesh axis shards a non-batch dimension of
NOT_2D = [3, 4, 11, 12, 21, 22, 23, 24]
TEMPLATE = "the step template measured on v4"


@pytest.fixture(scope="module")
def layer():
  mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  step, params, batch = aot.model_step("gpt3", mesh, batch=8)
  return step, params, batch


def _explain(layer, generation="v4", presets="dense,async,all_to_all", **options):
  step, params, batch = layer
  return meshslice.explain(step, profile=f"tpu-{generation}",
                           compiler_flags=aot.preset_flags(presets, generation),
                           **options)(params, batch)


def test_default_plan_is_the_step_template_on_v4(layer):
  report = _explain(layer)
  assert [s.index for s in report.sites if not s.rewritten] == NOT_2D
  assert all(TEMPLATE in s.note for s in report.rewritten)
  assert {s.rule for s in report.rewritten} == {"step_template"}
  plans = {s.index: (s.algorithm, s.dataflow, s.ksplit, s.reduce_scatter)
           for s in report.rewritten}
  ls = [i for i, p in plans.items() if p[1] == "ls"]
  assert ls == [16, 18, 20, 26, 28, 30]
  # the MLP's (w_down, w_up: 4x the attention projections' compute) in four
  assert [report.sites[i].module for i in ls[:2]] == ["w_down", "w_up"]
  assert {plans[i] for i in ls[:2]} == {("meshslice", "ls", 4, "all_to_all")}
  assert plans[20] == ("meshslice", "ls", 2, "all_to_all")        # wo's input gradient
  # the attention input gradients, summed into one: one reduce-scatter, unsliced
  assert {plans[i] for i in ls[3:]} == {("collective", "ls", 1, "all_to_all")}
  assert [report.sites[i].module for i in ls[3:]] == ["wv", "wk", "wq"]
  for i in ls[3:]:
    assert "one reduce-scatter with sites" in report.sites[i].note
    assert "unsliced: the step template's terms of one shared sum" in report.sites[i].note
  # priced as sent: the first term carries the sum's reduce-scatter, the others none (the
  # three terms are the same problem, so they would be priced alike otherwise)
  from meshslice.planning import _reduce_scatter_seconds
  first, *others = (report.sites[i] for i in ls[3:])
  assert _reduce_scatter_seconds(first) > 0
  for s in others:
    assert s.predicted_seconds == pytest.approx(
        first.predicted_seconds - _reduce_scatter_seconds(first), rel=1e-9)
  rs = [i for i, p in plans.items() if p[1] == "rs"]
  assert rs == [15, 17, 19, 25, 27, 29]
  assert {plans[i] for i in rs} == {("collective", "rs", 1, "all_to_all")}
  assert {p for i, p in plans.items() if p[1] == "os"} == {("collective", "os", 1, None)}
  assert len(plans) == 23 and report.plan_counts(reduce_scatter=True) == {
      "collective os S=1": 11, "collective rs S=1 rs=all_to_all": 6,
      "collective ls S=1 rs=all_to_all": 3, "meshslice ls S=2 rs=all_to_all": 1,
      "meshslice ls S=4 rs=all_to_all": 2}
  # compared with XLA's program for the site (explain's prediction sums both), but not
  # left to it: the template was measured against XLA's program on the compiled step
  assert all(s.xla_seconds is not None and "XLA's own program" in s.note
             for s in report.rewritten)
  # priced at most as the collective: the per-site model charges the slices as exposed
  assert all(s.predicted_seconds <= s.baseline_seconds for s in report.rewritten)
  # the report says its per-site sum does not hold the template's gain
  assert report.measured_on_compiled_steps == report.rewritten
  assert ("23 of them follow a plan chosen on compiled steps, not on this per-site model"
          in str(report))


@pytest.mark.parametrize("model", ["gpt3", "megatron"])
def test_the_mlp_sites_are_sliced_as_measured_at_256_chips(model):
  """At 256 v4 chips as 64x4 (the mesh the template was measured on; planning only) the
  MLP's sites take the moves `meshslice.tune(refine=1)` found on both layers: its
  lhs-stationary sites (the forward w_down, the backward w_up) in four, w_down's
  activation gradient dy @ W^T in two; w_down's weight gradient in two on Megatron-NLG
  only (27 ms of compute; GPT-3's, 9.8 ms, compiled slower sliced), never w_up's."""
  mesh = aot.make_mesh("v4:8x8x4", (64, 4))
  step, params, batch = aot.model_step(model, mesh)
  report = meshslice.explain(step, profile="tpu-v4", compiler_flags=aot.preset_flags(
      "dense,async,all_to_all", "v4"))(params, batch)
  assert {s.rule for s in report.rewritten} == {"step_template"}
  sliced = {(s.module, s.direction, s.dataflow): s.ksplit
            for s in report.rewritten if s.algorithm == "meshslice"}
  # wq, wk, wv's input gradients share one reduce-scatter, unsliced
  attention = {("wo", "backward", "ls"): 2}
  mlp = {("w_down", "forward", "ls"): 4, ("w_up", "backward", "ls"): 4,
         ("w_down", "backward", "os"): 2}
  if model == "megatron":
    mlp[("w_down", "backward", "rs")] = 2
  assert sliced == {**attention, **mlp}
  assert all(s.algorithm == "collective" and s.ksplit == 1
             for s in report.rewritten if s.algorithm != "meshslice")


def test_step_template_rules():
  """`planning._step_template` on its own: the slice count per dataflow, size and pass,
  and the fallback when the wanted count cannot be realised."""
  from meshslice.planning import _step_template as template
  largest, big, small = 0.030, 0.027, 0.007
  both = (1, 2, 4)
  assert template("ls", both, small, largest) == ("meshslice", 2)
  assert template("ls", both, big, largest) == ("meshslice", 4)
  assert template("ls", (1, 2), big, largest) == ("meshslice", 2)
  assert template("ls", (1, 3), big, largest) == ("collective", 1)
  assert template("1d_ls", both, big, largest) == ("collective", 1)
  # an output-stationary site: sliced only as a large backward activation gradient
  assert template("os", both, big, largest, forward=False,
                  weight_contracted_last=True) == ("meshslice", 2)
  for kw in (dict(forward=True, weight_contracted_last=True),
             dict(forward=False, weight_contracted_last=False)):
    assert template("os", both, big, largest, **kw) == ("collective", 1)
  assert template("os", both, small, largest, forward=False,
                  weight_contracted_last=True) == ("collective", 1)
  # a weight gradient: a down projection's (taller than wide), each slice >= 8 ms
  assert template("rs", both, big, largest, forward=False,
                  taller_than_wide=True) == ("meshslice", 2)
  assert template("rs", both, big, largest, forward=False,
                  taller_than_wide=False) == ("collective", 1)
  assert template("rs", both, 0.0098, 0.0099, forward=False,
                  taller_than_wide=True) == ("collective", 1)
  # a weight gradient computed into another result layout, lhs-stationary: unsliced
  assert template("ls", both, big, largest, forward=False,
                  result_resharded=True) == ("collective", 1)


@pytest.mark.parametrize("case", ["windowed einsum on", "v5p", "pinned algorithm",
                                  "pinned ksplit", "ring reduce-scatters"])
def test_the_template_needs_what_it_was_measured_under(layer, case):
  options = {
      "windowed einsum on": dict(presets="async,all_to_all"),
      "v5p": dict(generation="v5p"),
      "pinned algorithm": dict(algorithm="collective"),
      "pinned ksplit": dict(ksplit=2),
      "ring reduce-scatters": dict(reduce_scatter="reduce_scatter"),
  }[case]
  report = _explain(layer, **options)
  assert not any(TEMPLATE in (s.note or "") for s in report.sites)
  assert not report.measured_on_compiled_steps
  assert "plan chosen on compiled steps" not in str(report)
  if case == "pinned algorithm":
    assert {s.ksplit for s in report.rewritten} == {1}


def test_a_pinned_site_keeps_its_pin_and_the_rest_the_template(layer):
  report = _explain(layer, overrides={18: {"ksplit": 2}, 0: {"rewrite": False}})
  assert report.sites[18].ksplit == 2 and TEMPLATE not in report.sites[18].note
  assert report.sites[18].rule == "" and report.sites[20].rule == "step_template"
  assert not report.sites[0].rewritten
  assert TEMPLATE in report.sites[20].note and report.sites[20].ksplit == 2


@pytest.mark.parametrize("shape", ["gpt3 at seq 256", "4 x 128 heads at seq 128"])
def test_sites_with_little_compute_keep_the_per_site_model(shape):
  """Sites whose matmul is predicted to compute for less than
  `_STEP_TEMPLATE_MIN_COMPUTE_SECONDS` have too little work to hide the template's
  collectives under: compiled, GPT-3 at seq 256 (sites of 0.3-1.2 ms at 256 chips) ran
  0.826x XLA routed under the template, a 4 x 128-head layer at seq 128 0.896x. The
  per-site model plans them."""
  from meshslice.costmodel import model_spec
  mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  model = (model_spec("custom", heads=4, head_dim=128, seq=128)
           if shape.startswith("4 x") else "gpt3")
  step, params, batch = aot.model_step(model, mesh, batch=8,
                                       seq=256 if model == "gpt3" else None)
  report = meshslice.explain(step, profile="tpu-v4", compiler_flags=aot.preset_flags(
      "dense,async,all_to_all", "v4"))(params, batch)
  assert not any(TEMPLATE in (s.note or "") for s in report.sites)
  assert not report.measured_on_compiled_steps
  # nor sliced or resharded by the per-site model: at seq 256 on 256 chips its sliced os
  # sites compiled 0.94x XLA, and with them unsliced, one resharded site 0.985x: left to
  # XLA, the step is XLA's program
  assert not report.rewritten
  assert all(s.reason.startswith(("left to XLA", "no mesh axis")) for s in report.sites)


@pytest.mark.parametrize("seq, templated", [(512, False), (1024, True)])
def test_a_gpt3_sized_step_needs_4096_token_rows_a_device_for_the_template(seq, templated):
  """A GPT-3 layer's largest matmul computes for over `_STEP_TEMPLATE_MIN_COMPUTE_SECONDS`
  at seq 512, yet there (2048 token rows a device) the template compiled slower than XLA's
  program on 256 chips as 64x4: 0.948x routed, Megatron-NLG 0.936x; at seq 1024 (4096
  rows) 1.072x and 1.049x (docs/tpu.md, "GPT-3-sized steps need 4096 token rows"). Below
  `_STEP_TEMPLATE_MIN_TOKENS_LARGE` the per-site model plans it, which leaves it to XLA.
  One sequence per chip on 8 chips: each chip's matmuls are those of 256 chips."""
  from meshslice import costing, planning
  from meshslice.costmodel import predict
  mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  step, params, batch = aot.model_step("gpt3", mesh, batch=8, seq=seq)
  report = meshslice.explain(step, profile="tpu-v4", compiler_flags=aot.preset_flags(
      "dense,async,all_to_all", "v4"))(params, batch)
  rows = 8 * seq // 2
  assert (rows >= planning._STEP_TEMPLATE_MIN_TOKENS_LARGE) is templated
  assert rows >= planning._STEP_TEMPLATE_MIN_TOKENS
  if templated:
    assert {s.rule for s in report.rewritten} == {"step_template"}
    assert len(report.rewritten) == 23
    compute = [predict(s.problem, "collective", costing.model_dataflow(s.dataflow), 1,
                       s.profile).compute_s for s in report.rewritten]
    # at twice the line: at seq 512 (half the tokens) the largest is still above it, so
    # only the token rows keep the template off there
    assert max(compute) >= 2 * planning._STEP_TEMPLATE_MIN_COMPUTE_SECONDS
  else:
    assert not report.rewritten
    assert all(s.reason.startswith(("left to XLA", "no mesh axis")) for s in report.sites)
    assert len([s for s in report.sites if s.reason.startswith("left to XLA")]) == 23
  # the report says why the step did not take it
  said = [n for n in report.notes if n.startswith("the step template was not taken")]
  if templated:
    assert not said
  else:
    note, = said
    assert note.startswith("the step template was not taken: its forward matmuls hold 2048 "
                           "token rows a device, where a step whose largest matmul computes "
                           "for ")
    assert " ms on 2 mesh rows needs 4096 (steps with less compiled slower than XLA's" in note
    assert f"note: {note}" in str(report)


@pytest.mark.parametrize("seq, templated", [(512, False), (1024, True)])
def test_a_long_row_axis_needs_64_token_rows_per_row_device(seq, templated):
  """At 1024 v4 chips as 128x8 GPT-3 at seq 512 holds 4096 token rows a device, enough
  for `_STEP_TEMPLATE_MIN_TOKENS_LARGE`, but 32 per device of the 128-device row axis:
  the template compiled 0.981x XLA's program there (routed links), and 1.131x at seq 1024
  (64 per row device: `_STEP_TEMPLATE_MIN_TOKENS_PER_ROW_DEVICE`). Planning only, on
  abstract inputs of the 1024-chip mesh, one sequence per chip."""
  from meshslice import planning
  mesh = aot.make_mesh("v4:16x16x4", (128, 8))
  step, params, batch = aot.model_step("gpt3", mesh, batch=1024, seq=seq)
  report = meshslice.explain(step, profile="tpu-v4", compiler_flags=aot.preset_flags(
      "dense,async,all_to_all", "v4"))(params, batch)
  rows = 1024 * seq // 128
  assert rows >= planning._STEP_TEMPLATE_MIN_TOKENS_LARGE
  assert (rows >= planning._STEP_TEMPLATE_MIN_TOKENS_PER_ROW_DEVICE * 128) is templated
  said = [n for n in report.notes if n.startswith("the step template was not taken")]
  if templated:
    assert {s.rule for s in report.rewritten} == {"step_template"} and not said
  else:
    assert not report.rewritten
    note, = said
    assert "hold 4096 token rows a device, where a step whose largest matmul" in note
    assert " ms on 128 mesh rows needs 8192 (steps with less" in note


def test_the_step_decides_so_small_sites_of_a_large_step_take_the_template():
  """The template is a plan for the whole step: a Llama-shaped step (GQA, 8 key / value
  heads) has projections that compute for well under `_STEP_TEMPLATE_MIN_COMPUTE_SECONDS`
  beside ones far above it, and all of them follow the template (compiled at 256 chips:
  1.184x XLA, against 1.099x with the small ones left to XLA). Only the key and value
  projections' data gradients are left to XLA, as terms of a gradient sum whose
  collectives their compute cannot hide (the template's own rule)."""
  from meshslice import costing
  from meshslice.costmodel import predict
  from meshslice.planning import _STEP_TEMPLATE_MIN_COMPUTE_SECONDS as least
  mesh = aot.make_mesh("v4:2x2x2", (2, 4))
  step, *args = aot.model_step("llama70b", mesh, whole=True, layers=1, batch=8)
  report = meshslice.explain(step, profile="tpu-v4", compiler_flags=aot.preset_flags(
      "dense,async,all_to_all", "v4"))(*args)
  compute = {s.index: predict(s.problem, "collective", costing.model_dataflow(s.dataflow),
                              1, s.profile).compute_s for s in report.rewritten}
  assert min(compute.values()) < least < max(compute.values())
  assert report.measured_on_compiled_steps == report.rewritten and len(compute) == 30
  left = [s for s in report.sites if s.rule == "step_template" and not s.rewritten]
  assert [(s.module, s.direction, s.summed) for s in left] == [
      ("layers/wv", "backward", True), ("layers/wk", "backward", True)]


def test_summed_matmuls_are_the_terms_of_a_sum_of_matmul_results():
  """`matmul_sums.summed_matmuls`: the dot_generals whose results, through layout-only ops
  and chains of adds, are added to another matmul's; a value used elsewhere too (a
  residual stream) is not a term."""
  import jax
  import jax.numpy as jnp
  from meshslice.matmul_sums import summed_matmuls

  def fan_in(a, b, c, w):          # dx = a w1 + b w2 + c w3, one term through a convert
    return (a @ w + (b @ w).astype(jnp.float32).astype(a.dtype)) + c @ w

  def residual(x, w):              # x2 = x1 + x1 w, x1 = x + x w: x1 is used twice
    x1 = x + x @ w
    return x1 + x1 @ w

  def lone(x, w):
    return x + x @ w

  x = jnp.ones((4, 4))
  jaxpr = jax.make_jaxpr(fan_in)(x, x, x, x).jaxpr
  dots = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"]
  assert len(dots) == 3 and summed_matmuls(jaxpr) == frozenset(dots)
  assert summed_matmuls(jax.make_jaxpr(residual)(x, x).jaxpr) == frozenset()
  assert summed_matmuls(jax.make_jaxpr(lone)(x, x).jaxpr) == frozenset()
  # a chain of adds deeper than Python's recursion limit (a gradient accumulated over
  # unrolled steps), walked once
  chain = jax.make_jaxpr(lambda x, w: sum(x @ (w + i) for i in range(1500)))(x, x).jaxpr
  assert len(summed_matmuls(chain)) == 1500


def test_a_gradient_terms_collective_without_compute_to_hide_it_is_left_to_xla():
  """The Llama-shaped whole step at 256 v4 chips as 64x4 (planning only): the key and
  value projections' data gradients (8 of 64 heads: their collectives 12x their compute)
  are terms of dx = dq Wq^T + dk Wk^T + dv Wv^T, left to XLA, which reduce-scatters the
  sum once; the query's term (1.7x, sliced in two: its second slice hides the first's
  collective) and the gated MLP's two terms (0.6x) keep the template."""
  from meshslice import whole_step
  mesh = aot.make_mesh("v4:8x8x4", (64, 4))
  step, params, opt, data = whole_step.whole_step("llama70b", mesh, layers=4)
  report = meshslice.explain(step, profile="tpu-v4", compiler_flags=aot.preset_flags(
      "dense,async,all_to_all", "v4"))(params, opt, data)
  summed = {(s.module, s.rewritten) for s in report.sites if s.summed}
  assert summed == {("layers/wk", False), ("layers/wv", False), ("layers/wq", True),
                    ("layers/w_gate", True), ("layers/w_up", True)}
  left = [s for s in report.sites if s.summed and not s.rewritten]
  assert all(s.direction == "backward" and s.rule == "step_template" for s in left)
  assert all(s.reason == "left to XLA: one term of a sum of matmul results (a gradient "
             "summed over projections), which XLA reduce-scatters once where the step "
             "template would send a collective a term" for s in left)
  kept = {s.module: (s.algorithm, s.ksplit) for s in report.sites if s.summed and s.rewritten}
  assert kept == {"layers/wq": ("meshslice", 2), "layers/w_gate": ("meshslice", 4),
                  "layers/w_up": ("meshslice", 4)}
  # the gated MLP's two terms, planned alike, share one reduce-scatter and keep their four
  # slices (only the template's sites sliced in two run unsliced when shared)
  mlp = [s for s in report.sites if s.summed and s.module in ("layers/w_gate", "layers/w_up")]
  assert all("one reduce-scatter with sites #" in s.note and "unsliced" not in s.note
             for s in mlp)
  query = next(s for s in report.sites if s.summed and s.module == "layers/wq")
  assert "one reduce-scatter with" not in query.note     # its fellow terms went to XLA
  # the query's term unsliced (as MaxText's, gathering its heads, was) would be left too:
  # its collective takes 1.7x its compute, over the unsliced threshold (1.4x)
  from meshslice.planning import _term_left_to_xla
  query = next(s for s in report.sites if s.summed and s.module == "layers/wq")
  assert not _term_left_to_xla(query, sliced=True) and _term_left_to_xla(query, sliced=False)


@pytest.mark.parametrize("seq, templated", [(1024, True), (256, False)])
def test_a_smaller_layer_takes_the_template_when_each_device_holds_enough_tokens(
    seq, templated):
  """A layer of 16 heads of 128 on 64 chips as 16x4: its largest matmul computes for well
  under `_STEP_TEMPLATE_MIN_COMPUTE_SECONDS`, but at seq 1024 each device holds 4096
  token rows (>= `_STEP_TEMPLATE_MIN_TOKENS`) and the template compiled 1.14x XLA's
  program (1.17x routed); at seq 256 (1024 rows) such steps compiled slower, and the
  sites stay with the per-site model, which leaves them to XLA (docs/tpu.md, "The step
  template on smaller layers")."""
  from meshslice import costing, planning
  from meshslice.costmodel import model_spec, predict
  mesh = aot.make_mesh("v4:4x4x4", (16, 4))
  spec = model_spec("custom", heads=16, head_dim=128, seq=seq)
  step, *args = aot.model_step(spec, mesh, seq=seq)
  report = meshslice.explain(step, profile="tpu-v4", compiler_flags=aot.preset_flags(
      "dense,async,all_to_all", "v4"))(*args)
  tokens = 64 // 16 * seq
  assert (tokens >= planning._STEP_TEMPLATE_MIN_TOKENS) is templated
  follows = [s for s in report.sites if TEMPLATE in (s.note or "")]
  if templated:
    assert len(report.rewritten) == 20 and len(follows) == 23
    compute = [predict(s.problem, "collective", costing.model_dataflow(s.dataflow), 1,
                       s.profile).compute_s for s in report.rewritten]
    assert (planning._STEP_TEMPLATE_MIN_TOKENS_COMPUTE_SECONDS <= max(compute)
            < planning._STEP_TEMPLATE_MIN_COMPUTE_SECONDS)
  else:
    assert not report.rewritten and not follows
    assert all(s.reason.startswith(("left to XLA", "no mesh axis")) for s in report.sites)
