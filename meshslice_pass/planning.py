"""Planning: one `Site` per dot_general of the program, rewritten or left alone (with why).

A plan's inputs are data: the program (its jaxpr, the layouts the analysis gave its
values, its parameters' names), the mesh (its axis sizes; for a concrete `Mesh` also its
devices: which axes cross TPU slices, and whether they are TPUs) and the `Options`, which
carry the hardware profile (`profile`, loaded when the options are made) and
`compiler_flags`, the libtpu flags the program will be compiled with (given, or this
process's LIBTPU_INIT_ARGS, which `Options` reads once, when `transform` / `explain` /
`check` is called). Planning times nothing and reads no environment variable, so every
process of a multi-host job emits the same program. One input is still read from the
process: reduce_scatter "auto" without a concrete mesh asks `target_platform()`, i.e. the
mesh being traced under, else this process's default JAX backend
(`_automatic_scatter_form`).

Unless the user pins them, algorithm and ksplit come from the cost model
(`meshslice.costmodel`, profile option): among the slice counts S for which block-cyclic
slicing is exact (S * lcm(R, C) divides the communicated extent), S <= max_ksplit, with
blocks of at least min_block elements, the plan that fits the chip's HBM
(`costmodel.why_too_big`) with the fewest slices among those predicted within NEAR_TIE
(2%, the model's error) of the fastest wins: collective before meshslice, smaller S
before larger (each slice costs the compiled program more than the model prices). When
no plan fits, the site is left alone ("no plan fits HBM: ..."). On a profile with TPU
compiler terms every plan is priced as compiled (`costmodel.xla_baseline`), and the
winner must beat XLA's own program for the site (option xla_baseline; priced under
`Options.compiler_flags`: windowed einsum turned off there is not XLA's program) by more
than XLA_MARGIN (the model's error): otherwise the site is left alone, its reason naming
both predicted times, and compiles as plain jit would. The rule's code is the cost model's
(`meshslice.costmodel.site_choice`: `choose`, `leave_to_xla`), called through `costing`.
Two exceptions rest on compiled programs, not on the per-site model: on tpu7x a tie with
XLA goes to the collective rewrite (`_COLLECTIVE_OVER_XLA_MEASURED`), and on v4 a step
with enough compute follows one plan for the whole step, the step template
(`_STEP_TEMPLATE_MEASURED`, decided in `plan_program`), under the flags each was
measured under.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from meshslice import costmodel, rewrites
from meshslice.rewrites import GemmGeometry
from meshslice.rewrites.platform import target_platform

from . import analysis as A
from . import backend_flags
from . import costing
from . import matching
from . import pins
from . import specs as S
from .errors import PinError
from ._jax_internals import eqn_name_stack, is_literal, scan_length, sub_jaxprs
from .matmul_sums import shared_reductions, summed_matmuls
from .provenance import module_path, name_stack, source_location


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Site:
  """One dot_general the pass looked at, and what it decided.

  `path` locates the equation: indices into nested jaxprs, e.g.
  ((3, "jaxpr", 0), (12, "jaxpr", 0), 5) is eqn 5 of the body of eqn 12 of eqn 3;
  `runs` is how often it runs per call: the product of the lengths of the scans around
  it (a while loop's body counts once).
  `source` is the innermost 'file:line' of the user's code (library frames skipped, the
  file relative to the project: see `provenance.portable_path`); `module` the module
  path from the JAX name stack, e.g. 'Model/MlpBlock_0/Dense_1' (`module_path`).
  `rule` names the rule measured on compiled steps that planned the site instead of the
  per-site cost model, if one did ("step_template" on v4, or "step_template_guard" in
  a step with too little compute for it; "collective_over_xla" on tpu7x; docs/tpu.md),
  e.g. `[s.index for s in report.sites if s.rule]`.
  """
  index: int
  path: tuple
  source: str
  module: str = ""
  context: str
  direction: str
  lhs_shape: tuple
  rhs_shape: tuple
  lhs_spec: str
  rhs_spec: str
  out_spec: str
  dtype: str
  rewritten: bool
  algorithm: str | None = None
  dataflow: str | None = None
  ksplit: int | None = None
  block: int | None = None
  # the form of an ls / rs site's reduce-scatter when not one collective ("all_to_all")
  reduce_scatter: str | None = None
  # whether a weight gradient's gathers wait for its cotangent (option / pin hold_gathers);
  # None: the emitter's default rule (`emit._holds_gathers_back`)
  hold_gathers: bool | None = None
  mesh_axes: tuple = ()
  reason: str = ""
  note: str = ""
  # what this site did not do of its pins, as "<where>: <key>=<value> not used: <why>"
  # (`pins.judge`; also in `note`): the report shows them for left-alone sites too
  pin_notes: tuple = ()
  swapped: bool = False
  # its result is added to another matmul's (`matmul_sums.summed_matmuls`): one term of a gradient
  # summed over several projections, e.g. dx = dq Wq^T + dk Wk^T + dv Wv^T
  summed: bool = False
  # the indices of the sites whose results are summed with this one's and share its
  # reduce-scatter (this one's included: `_share_reductions`); () when it sends its own
  shared_reduction: tuple = ()
  predicted_seconds: float | None = None
  baseline_seconds: float | None = None
  # XLA's own program for the site as the planner priced it (`costing.xla_program`),
  # where the plan was compared with it: `Report.xla_sites_seconds` sums it
  xla_seconds: float | None = dataclasses.field(default=None, repr=False, compare=False)
  geometry: GemmGeometry | None = dataclasses.field(default=None, repr=False, compare=False)
  specs: tuple | None = dataclasses.field(default=None, repr=False, compare=False)
  problem: object = dataclasses.field(default=None, repr=False, compare=False)
  # the hardware profile the site was priced with (`costing.site_profile`)
  profile: object = dataclasses.field(default=None, repr=False, compare=False)
  # how often the site runs per call: the product of its enclosing scans' lengths
  runs: int = dataclasses.field(default=1, repr=False, compare=False)
  # the enclosing higher-order primitives, outermost first ("scan", "while", ...): the
  # parts `context` joins for display, for code that asks what a site is inside
  scopes: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)
  # the rule measured on compiled steps that planned the site instead of the per-site
  # model, if one did (`pins.STEP_TEMPLATE_RULE`, `STEP_TEMPLATE_GUARD_RULE`,
  # `COLLECTIVE_OVER_XLA_RULE`); `note` says it in words
  rule: str = ""

  @property
  def label(self) -> str:
    return f"site #{self.index} ({self.source or 'unknown source'})"


@dataclasses.dataclass(frozen=True)
class Context:
  """What planning knows besides the program: the mesh's axis sizes, the options, and
  the mesh itself when it is concrete (its devices say which axes cross TPU slices; an
  AbstractMesh, or None, plans as one slice)."""

  axis_sizes: dict
  options: object
  mesh: object = dataclasses.field(default=None, compare=False)
  # Decisions by everything a decision depends on: the layers of an unrolled model repeat
  # the same sites, and planning is pure, so each distinct site is planned once.
  decided: dict = dataclasses.field(default_factory=dict, compare=False)
  # the parameters the program's values carry (`param_names.ParamNames`), or None
  param_names: object = dataclasses.field(default=None, compare=False)
  # The step template decides on the whole step (`plan_program`): "probe" plans every site
  # it could take as one with too little compute for it, recording each one's compute in
  # `template_compute`; "on" gives them the template, sized against the largest of
  # those computes (`template_largest_s`).
  template_mode: str = dataclasses.field(default="probe", compare=False)
  template_compute: list = dataclasses.field(default_factory=list, compare=False)
  # and, of its forward-pass sites, the token rows each device holds (`_local_tokens`)
  template_tokens: list = dataclasses.field(default_factory=list, compare=False)
  # and the devices of the mesh axis those rows are split over (the site's mesh rows)
  template_row_devices: list = dataclasses.field(default_factory=list, compare=False)
  template_largest_s: float = dataclasses.field(default=0.0, compare=False)
  # False once the step has too little compute for `_COLLECTIVE_OVER_XLA_MEASURED`'s rule
  # (`plan_program`): its ties with XLA's program then stay XLA's
  collective_over_xla: bool = dataclasses.field(default=True, compare=False)


def _devices(ctx):
  """The concrete mesh's device grid, or None (no mesh, or an AbstractMesh)."""
  return ctx.mesh.devices if isinstance(ctx.mesh, jax.sharding.Mesh) else None


def _profile(ctx, geometry):
  return costing.site_profile(ctx.options.profile, geometry, ctx.axis_sizes, _devices(ctx))


def plan_program(closed, analysis: A.JaxprAnalysis, ctx: Context) -> tuple:
  sites = []
  _walk(closed.jaxpr, analysis, ctx, (), [], sites)
  # The step template (`_STEP_TEMPLATE_MEASURED`) is a plan for the whole step: it is
  # taken when the step's largest matmul it could plan computes long enough to hide its
  # collectives under, and then for every site it can plan, small ones included (the
  # step's other work hides theirs). Else the first plan stands: those sites unsliced, in
  # their own layout.
  if _step_template_pays(ctx):
    ctx = dataclasses.replace(ctx, decided={}, template_mode="on", template_compute=[],
                              template_tokens=[], template_row_devices=[],
                              template_largest_s=max(ctx.template_compute))
    sites = []
    _walk(closed.jaxpr, analysis, ctx, (), [], sites)
  elif not _collective_over_xla_pays(sites):
    # the rule's sites were planned against XLA alone: in a step too small for it, plan
    # them so again, each saying why the rule was not taken
    ruled = {s.index for s in sites if s.rule == pins.COLLECTIVE_OVER_XLA_RULE}
    ctx = dataclasses.replace(ctx, decided={}, collective_over_xla=False)
    sites = []
    _walk(closed.jaxpr, analysis, ctx, (), [], sites)
    sites = [dataclasses.replace(s, note=_join(s.note, _COLLECTIVE_OVER_XLA_SMALL_NOTE))
             if s.index in ruled else s for s in sites]
  return _judge_pins(tuple(sites), ctx)


def _judge_pins(sites, ctx) -> tuple:
  """`sites` with the pin rule applied (`pins.judge`, pins.py's docstring): every pinned
  setting is honoured, noted on its site, or an error naming it. Each site is judged by
  its own request (sites planned once and shared have different pins' origins). A plan
  is first checked to be this program's, so its pins are judged on the sites it names."""
  plan = getattr(ctx.options, "plan", None)
  if plan is not None:
    plan.check_matches(sites, ctx.axis_sizes)
  notes = pins.judge(sites, lambda s: ctx.options.request_for(
      index=s.index, source=s.source, module=s.module))
  return tuple(dataclasses.replace(s, note=_join(s.note, *notes[s.index]),
                                   pin_notes=notes[s.index]) if s.index in notes else s
               for s in sites)


def _walk(jaxpr, analysis, ctx, prefix, context, sites, runs=1):
  consumers = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if not is_literal(v):
        consumers.setdefault(v, []).append(eqn)
  for v in jaxpr.outvars:
    if not is_literal(v):
      consumers.setdefault(v, []).append(None)
  summed = summed_matmuls(jaxpr)
  here = {}  # eqn index -> position in `sites` of the sites of this jaxpr
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name == "dot_general":
      transposed_by = _swapping_transpose(eqn, consumers.get(eqn.outvars[0], []))
      param = ctx.param_names.of_site(prefix, jaxpr, eqn) if ctx.param_names else ""
      site = _plan_site(eqn, analysis, ctx, prefix + (i,), context, len(sites),
                        transposed_by, param, summed=i in summed)
      site = _with_layout_hint(site, jaxpr, eqn, analysis)
      # sites planned once and shared (ctx.decided) may run a different number of times
      here[i] = len(sites)
      sites.append(site if site.runs == runs else dataclasses.replace(site, runs=runs))
      continue
    for (param, branch), sub in sub_jaxprs(eqn):
      child = analysis.children.get((i, param, branch)) if analysis else None
      _walk(sub, child, ctx, prefix + ((i, param, branch),),
            context + [(eqn.primitive.name, "transpose" in name_stack(eqn),
                        eqn_name_stack(eqn))], sites, runs * (scan_length(eqn) or 1))
  if getattr(ctx.options, "share_reductions", False):
    _share_reductions(jaxpr, here, sites, ctx)


def _share_reductions(jaxpr, here, sites, ctx):
  """Which sites of each sum of matmul results share one reduce-scatter
  (`Site.shared_reduction`, which the emitter follows): rewritten terms planned alike
  (plan and operand types), whose reduce-scatter is not offloaded to the SparseCore
  (there it runs beside the TensorCore's work already, and adding the partials only adds
  to that work: MaxText-style Llama step on tpu7x, 0.2 % slower shared). Noted on each;
  under the step template such sites sliced in two run unsliced
  (`_SHARED_TEMPLATE_NOTE`), unless a pin asked for their algorithm or slice count."""
  def key_of(i):
    site = sites[here[i]] if i in here else None
    if site is None or not site.rewritten or not rewrites.summable(site.algorithm,
                                                                   site.geometry):
      return None
    if _offloaded(ctx, site.profile):
      return None
    eqn = jaxpr.eqns[i]
    return (site.algorithm, site.geometry, site.ksplit, site.reduce_scatter, site.specs,
            site.swapped, site.hold_gathers,
            tuple((v.aval.shape, v.aval.dtype) for v in eqn.invars))

  for terms, _ in shared_reductions(jaxpr, key_of).values():
    group = [sites[here[j]] for j in terms]
    unslice = all(s.rule == pins.STEP_TEMPLATE_RULE and s.ksplit == 2
                  and _unpinned_plan(ctx, s) for s in group)
    for position, (j, site) in enumerate(zip(terms, group)):
      others = ", ".join(f"#{s.index}" for s in group if s is not site)
      note = (f"one reduce-scatter with sites {others}: their results are only summed, "
              "so the partial products are added before it")
      if unslice:
        site = dataclasses.replace(site, algorithm="collective", ksplit=1,
                                   block=site.geometry.block_size(1))
        note = _join(note, _SHARED_TEMPLATE_NOTE)
      if position and site.predicted_seconds is not None:
        # the first term sends the sum's reduce-scatter; the others' is not sent
        site = dataclasses.replace(site, predicted_seconds=max(
            site.predicted_seconds - _reduce_scatter_seconds(site), 0.0))
      sites[here[j]] = dataclasses.replace(site, note=_join(site.note, note),
                                           shared_reduction=tuple(s.index for s in group))


def _reduce_scatter_seconds(site) -> float:
  """The per-site model's time of `site`'s reduce-scatter of its whole partial product
  (`costmodel.timing.movements`: an ls / rs site's second movement)."""
  problem, profile = site.problem, site.profile
  _, scattered = costmodel.timing.movements(problem, costing.model_dataflow(site.dataflow))
  if scattered.size <= 1:
    return 0.0
  return float(costmodel.timing.collective_time(profile, scattered.kind, scattered.dim,
                                                scattered.size, scattered.shard_bytes))


def _unpinned_plan(ctx, site) -> bool:
  """Whether no pin of `site` asks for its algorithm or slice count."""
  request = ctx.options.request_for(index=site.index, source=site.source,
                                    module=site.module)
  return request.algorithm is None and request.ksplit is None


# The step template's sites of one shared sum that it slices in two run unsliced: the one
# reduce-scatter moves a term's bytes for all of them, which the rest of the step hides
# without slices. (The large ones it slices in four, the gated MLP's, keep their slices:
# not measured unsliced.)
# Measured on v4 at 256 chips (docs/benchmarks.md, "Sums that share one reduce-scatter"):
# GPT-3 layer's attention input gradients (three ls terms) 155.01 / 160.21 ms unsliced
# against 155.57 / 160.78 sliced in two and 156.86 / 163.01 in four (alpha-beta / routed).
_SHARED_TEMPLATE_NOTE = ("unsliced: the step template's terms of one shared sum, "
                         "whose one reduce-scatter hides under the step")


def _with_layout_hint(site, jaxpr, eqn, analysis):
  """A site left alone for an unknown operand layout, with where each unknown operand
  lost it (`analysis.where_layout_lost`): what the user adds to fix it."""
  if site.rewritten or not site.reason.startswith("operand sharding unknown"):
    return site
  hints = []
  for role, v in zip(("lhs", "rhs"), eqn.invars):
    if _spec_of(analysis, v) is None:
      hint = A.where_layout_lost(jaxpr, analysis, v, source_location)
      if hint:
        hints.append(f"{role}: {hint}")
  if not hints:
    return site
  return dataclasses.replace(site, reason=f"{site.reason}; {'; '.join(hints)}")


def _spec_of(analysis, v):
  if analysis is None:
    return None
  if is_literal(v):
    return S.replicated(len(getattr(v.aval, "shape", ())))
  return analysis.specs.get(v)


def _swapping_transpose(eqn, users):
  """The transpose that is the only user of this dot_general's result, when it just
  swaps the lhs-free and rhs-free dims (how JAX writes a weight gradient), else None."""
  if len(users) != 1 or users[0] is None or users[0].primitive.name != "transpose":
    return None
  (lc, _), (lb, _) = eqn.params["dimension_numbers"]
  lhs, rhs = eqn.invars
  nb, nl = len(lb), lhs.aval.ndim - len(lc) - len(lb)
  nr = rhs.aval.ndim - len(lc) - len(lb)
  swap = tuple(range(nb)) + tuple(range(nb + nl, nb + nl + nr)) + tuple(range(nb, nb + nl))
  return users[0] if tuple(users[0].params["permutation"]) == swap else None


def _swapped(dimension_numbers):
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(rc), tuple(lc)), (tuple(rb), tuple(lb)))


def _plan_site(eqn, analysis, ctx, path, context, index, transposed_by=None, param="",
               summed=False):
  """Plan one dot_general. When its result is only ever used transposed (lhs-free and
  rhs-free dims swapped), it is planned as the equal product with operands swapped, whose
  result already has the consumer's layout: a weight gradient becomes the RS matmul of
  docs/design.md rather than an LS matmul followed by a transpose."""
  if transposed_by is None:
    return _plan_operands(eqn, analysis, ctx, path, context, index, param=param, summed=summed)
  # The swapped form is preferred whenever it can be rewritten, so a pin (from a saved
  # plan, which records the swapped form) is only checked against the other form when
  # the swapped one cannot serve the site.
  try:
    swapped = _plan_operands(eqn, analysis, ctx, path, context, index, swap=transposed_by,
                             param=param, summed=summed)
  except PinError as error:
    try:
      site = _plan_operands(eqn, analysis, ctx, path, context, index, param=param, summed=summed)
    except PinError:
      raise error from None
    if site.rewritten:
      return site
    raise
  if swapped.rewritten:
    return swapped
  site = _plan_operands(eqn, analysis, ctx, path, context, index, param=param, summed=summed)
  return site if site.rewritten else swapped


def _plan_operands(eqn, analysis, ctx, path, context, index, swap=None, param="",
                   summed=False):
  lhs, rhs = eqn.invars
  out = eqn.outvars[0]
  dimension_numbers = eqn.params["dimension_numbers"]
  if swap is not None:
    lhs, rhs = rhs, lhs
    dimension_numbers = _swapped(dimension_numbers)
    out = swap.outvars[0]
  lhs_spec, rhs_spec, out_demand = (_spec_of(analysis, v) for v in (lhs, rhs, out))
  stack = name_stack(eqn)
  base: dict[str, Any] = dict(
      index=index, path=path,
      source=source_location(eqn, getattr(ctx.options, "source_packages", ())),
      # the name stack's modules (Linen, named scopes), else the parameter the matmul
      # reads or updates (NNX, Equinox, penzai), else the chain of layer classes it ran in
      module=_module(module_path(eqn, [scope for *_, scope in context], call_chain=False),
                     param, lambda: module_path(eqn, [scope for *_, scope in context])),
      context=" > ".join(name for name, *_ in context) or "top",
      scopes=tuple(name for name, *_ in context),
      direction="backward" if "transpose" in stack or any(t for _, t, *_ in context)
      else "forward",
      lhs_shape=tuple(lhs.aval.shape), rhs_shape=tuple(rhs.aval.shape),
      lhs_spec=S.describe(lhs_spec), rhs_spec=S.describe(rhs_spec),
      out_spec=S.describe(out_demand), dtype=str(jnp.dtype(out.aval.dtype)),
      swapped=swap is not None, summed=summed,
      note="operands swapped: the result is only used transposed" if swap is not None else "")
  if not ctx.axis_sizes or all(n == 1 for n in ctx.axis_sizes.values()):
    return Site(rewritten=False, reason="no multi-device mesh: nothing is sharded", **base)
  if not jnp.issubdtype(out.aval.dtype, jnp.floating):
    return Site(rewritten=False, reason=f"{out.aval.dtype} matmul: only floating-point "
                                        "matmuls are rewritten", **base)
  request = ctx.options.request_for(index=index, source=base["source"], module=base["module"])
  if request.rewrite is False:
    return Site(rewritten=False, reason="left alone as requested (override or plan)", **base)
  key = (swap is not None, dimension_numbers, lhs.aval.shape, str(lhs.aval.dtype),
         rhs.aval.shape, str(rhs.aval.dtype), str(out.aval.dtype), lhs_spec, rhs_spec,
         out_demand, request, eqn.params.get("precision"),
         str(eqn.params.get("preferred_element_type")),
         # under SparseCore offload a forward site is priced differently (`_plan_match`)
         base["direction"], summed)
  same = ctx.decided.get(key)
  if same is not None:
    return dataclasses.replace(same, **{k: base[k] for k in _IDENTITY})
  site = _hold_gathers(_decide(eqn, ctx, base, request, dimension_numbers, lhs, rhs, out,
                                lhs_spec, rhs_spec, out_demand, index), request)
  ctx.decided[key] = site
  return site


def _hold_gathers(site, request):
  """`site` with the hold_gathers request applied: only a rewritten weight gradient (a
  swapped site) gathers an operand that is ready long before the other (a pin elsewhere
  is noted by the pin rule, `pins.PIN_RULES`)."""
  if request.hold_gathers is None or not site.rewritten or not site.swapped:
    return site
  return dataclasses.replace(site, hold_gathers=request.hold_gathers)


# What differs between two sites with the same decision.
_IDENTITY = ("index", "path", "source", "module", "context", "scopes", "direction")


def _decide(eqn, ctx, base, request, dimension_numbers, lhs, rhs, out, lhs_spec, rhs_spec,
            out_demand, index):
  """The plan of one site (see `_plan_operands`): dataflow, algorithm, ksplit."""
  found = matching.classify(dimension_numbers, lhs.aval.shape, rhs.aval.shape,
                            lhs_spec, rhs_spec, ctx.axis_sizes)
  pinned = request.dataflow
  if pinned is not None and found.matches:
    wanted = [m for m in found.matches if m.dataflow == pinned]
    found = dataclasses.replace(found, matches=tuple(wanted or found.matches))
  match, reason = matching.choose(found, out_demand)
  if match is None:
    return Site(rewritten=False, reason=reason, **base)
  plan = functools.partial(_plan_match, eqn, ctx, base, request, dimension_numbers,
                           lhs.aval, rhs.aval, out.aval)
  site = plan(match, lhs_spec, rhs_spec)
  # a site none of whose plans fits HBM may still fit in another dataflow
  if not site.rewritten and not site.reason.startswith(costing.NO_PLAN_FITS):
    return site
  # Other dataflows with the same output layout, after resharding an operand: the cost
  # model picks the dataflow per site (e.g. LS for a matmul whose input is wider than its
  # output), or the user pinned one the current layouts do not give.
  options = [site] if site.rewritten and pinned in (None, site.dataflow) else []
  cheapest_elsewhere = None   # another dataflow's collective, unresharded (_versus_xla)
  refused = None      # the first alternative that cannot honour a pin (its error)
  # Under SparseCore offload XLA's program hides a collective wherever independent work
  # can run beside it. In the backward pass the data- and weight-gradient matmuls of a
  # layer are independent, so the layout's collectives are hidden already and reshards
  # predicted to win there lost when compiled. In the forward pass each matmul feeds the
  # next: its collectives are waited on, and a reshard that moves fewer bytes wins
  # (docs/benchmarks-log.md, "Forward sites under SparseCore offload"). So under offload
  # only forward sites reshard on their own; a pinned dataflow always may. Only where that
  # was measured: on tpu7x the same forward reshards compiled slower than XLA (the
  # reshards' collective-permutes, which the SparseCore does not take, are waited on;
  # docs/benchmarks.md, "Ironwood (tpu7x)"), so there no site reshards on its own.
  offloaded = site.profile is not None and _offloaded(ctx, site.profile)
  # Nor a site the step template could plan in a step without the compute for it (the
  # first pass of `plan_program`): a reshard's relayout copies cost more than the model
  # prices and nothing hides them (GPT-3 at seq 256 on v4: one site resharded to os
  # compiled 1.3 % slower than XLA)
  automatic = ctx.options.relayout and site.rule != pins.STEP_TEMPLATE_GUARD_RULE and (
      not offloaded or (base["direction"] == "forward" and backend_flags.profile_generation(
          site.profile.name) in _FORWARD_RESHARDS_MEASURED
          and min(ctx.axis_sizes[match.row_axis], ctx.axis_sizes[match.col_axis])
          >= _FORWARD_RESHARD_MIN_AXIS))
  # Where the collective rewrite is taken over a tie with XLA (`_COLLECTIVE_OVER_XLA_
  # MEASURED`), the other dataflows are priced even though no reshard is adopted: that
  # rule needs to know whether another dataflow would move less.
  priced_only = (pinned is None and not automatic and ctx.options.relayout
                 and _collective_over_xla(ctx, site.profile))
  for alt, alt_lhs, alt_rhs in matching.relayouts(
      dimension_numbers, lhs.aval.shape, rhs.aval.shape, lhs_spec, rhs_spec, match,
      ctx.axis_sizes):
    if pinned not in (None, alt.dataflow) or (pinned is None and not automatic
                                              and not priced_only):
      continue
    try:
      candidate = plan(alt, alt_lhs, alt_rhs)
    except PinError as e:
      # a pin (e.g. ksplit) another dataflow cannot take rules that dataflow out, not the
      # site: the site's own dataflow, or another alternative, may take it
      refused = refused or e
      continue
    if not candidate.rewritten or not _honours(candidate, request, site):
      continue
    if priced_only:
      # the collective in that dataflow, as if the operands were laid out for it: XLA's
      # partitioner picks how to split a dot without resharding a weight first
      seconds = candidate.baseline_seconds
      if seconds is not None:
        cheapest_elsewhere = seconds if cheapest_elsewhere is None else min(
            cheapest_elsewhere, seconds)
      continue
    moved = [(name, a, b, aval) for name, a, b, aval in
             (("lhs", lhs_spec, alt_lhs, lhs.aval), ("rhs", rhs_spec, alt_rhs, rhs.aval))
             if a != b]
    extra = sum(costing.reshard_seconds(aval.shape, aval.dtype, b, ctx.axis_sizes,
                                        ctx.options.profile) for _, _, b, aval in moved)
    how = ", ".join(f"{name} {S.describe(a)} -> {S.describe(b)}" for name, a, b, _ in moved)
    own = _as_planned(site)
    options.append(dataclasses.replace(
        candidate, predicted_seconds=candidate.predicted_seconds + extra,
        baseline_seconds=site.baseline_seconds,
        lhs_spec=S.describe(alt_lhs), rhs_spec=S.describe(alt_rhs),
        note=_join(candidate.note, f"{alt.dataflow} instead of {site.dataflow}: reshards "
                                   f"{how} first (~{extra * 1e6:.0f} us, included); "
                                   f"{own}")))
  if automatic and pinned is None and base["swapped"] and out_demand is not None:
    options += _other_output_layouts(found, match, plan, out.aval, out_demand, lhs_spec,
                                     rhs_spec, ctx, site)
  if not options:
    if not site.rewritten and pinned in (None, site.dataflow):
      return site     # no plan fits HBM, in any dataflow
    if refused is not None:
      raise refused
    raise PinError(
        f"{_pinned_by(request, 'dataflow')}dataflow={pinned!r} cannot serve site #{index} "
        f"({base['source']}): its operand "
        f"layouts allow {', '.join(sorted({m.dataflow for m in found.matches}))}, and no reshard "
        f"of the operands gives {pinned!r} with the same output layout")
  # a relayout must win clearly: the model does not see every cost of a reshard
  best = min(options, key=lambda c: c.predicted_seconds if c is site
             else c.predicted_seconds / RELAYOUT_MARGIN)
  if (base["summed"] and best.rewritten and best.rule == pins.STEP_TEMPLATE_RULE
      and site.problem is not None
      and _term_left_to_xla(site, sliced=best.ksplit > 1)):
    return dataclasses.replace(site, rewritten=False, algorithm=None, ksplit=None,
                               block=None, predicted_seconds=None,
                               rule=pins.STEP_TEMPLATE_RULE,
                               reason=f"{pins.LEFT_TO_XLA}: {_SUMMED_REASON}")
  return _versus_xla(best, site, ctx, request, base, cheapest_elsewhere)


def _other_output_layouts(found, match, plan, out, out_demand, lhs_spec, rhs_spec, ctx,
                          site) -> list:
  """A weight gradient (a swapped site: its result, summed over the batch, is small) in
  the other output layouts its operands allow, each priced with resharding its result to
  the layout the program wants. The wanted layout of a weight gradient is often only the
  analysis's guess (a scan stacks the gradients and the optimizer reads them elsewhere),
  and the layout decides which operand is gathered: on MaxText's Llama2-70B (w_out laid
  out [mlp: tensor, embed: fsdp]) the guessed layout gathered the 28672-wide MLP
  activations where the other gathers the 8192-wide output gradient (docs/benchmarks.md,
  "MaxText's Llama2-70B on v4")."""
  if not _gathers_far_more_than_it_returns(match, site, out, ctx):
    return []
  # the result's reshard into the wanted layout, whichever layout it is computed in
  extra = costing.reshard_seconds(out.shape, out.dtype, out_demand, ctx.axis_sizes,
                                  ctx.options.profile)
  own = _as_planned(site)
  candidates = []
  for other in found.matches:
    if other.out_spec == match.out_spec or other.dataflow.startswith("1d"):
      continue
    minor = out.shape[-1] // math.prod(ctx.axis_sizes.get(a, 1) for a in other.out_spec[-1])
    if minor < _MIN_MINOR_DIM:
      continue
    candidate = plan(other, lhs_spec, rhs_spec, result_resharded=True)
    if not candidate.rewritten:
      continue
    candidates.append(dataclasses.replace(
        candidate, predicted_seconds=candidate.predicted_seconds + extra,
        baseline_seconds=site.baseline_seconds,
        note=_join(candidate.note, f"{other.dataflow} into result layout "
                                   f"{S.describe(other.out_spec)} instead of "
                                   f"{S.describe(match.out_spec)}, then resharded "
                                   f"(~{extra * 1e6:.0f} us, included); {own}")))
  return candidates


def _as_planned(site) -> str:
  """What a site costs (or why it is not rewritten) in the layout it was planned in: the
  comparison a relayout's note gives."""
  return (f"{site.predicted_seconds * 1e6:.1f} us as {site.dataflow}" if site.rewritten
          else f"as {site.dataflow}: {site.reason}")


def _gathers_far_more_than_it_returns(match, site, out, ctx) -> bool:
  """Whether a weight gradient's operands differ in size by at least
  `_LAYOUT_CHOICE_MIN_SAVING` times its result: per device, the larger operand's rows
  gathered less the smaller's, against the result before its reduce-scatter."""
  lhs, rhs = site.lhs_shape, site.rhs_shape
  rows = ctx.axis_sizes.get(match.row_axis, 1)
  cols = ctx.axis_sizes.get(match.col_axis, 1)
  itemsize = jnp.dtype(out.dtype).itemsize
  saved = abs(math.prod(lhs) - math.prod(rhs)) * itemsize / rows
  return saved >= _LAYOUT_CHOICE_MIN_SAVING * math.prod(out.shape) * itemsize / cols


# A weight gradient is computed in another result layout only when the gather it saves
# is this many times its result (per device, `_gathers_far_more_than_it_returns`): with
# less, the reshard and a gather of the just-arrived output gradient (which nothing can
# hide, unlike the activations' gather) cost more than they save. Measured on v4 (docs/
# benchmarks.md): MaxText's Llama2-70B down projection, 23x (11x at half the batch),
# 1.021x faster routed; GPT-3's, 2.0x, 1.9 % slower as a layer, 1.5 % as a whole step.
_LAYOUT_CHOICE_MIN_SAVING = 8

# Nor into a layout whose result shard is narrower than this along its minor dim (a TPU
# vreg's 128 lanes): the Llama-shaped step's key and value weight gradients, 1024 wide
# over 64 devices, computed 16 lanes wide and compiled 8 % slower (78 ms more compute).
_MIN_MINOR_DIM = 128


def _xla_baseline(options) -> str:
  mode = getattr(options, "xla_baseline", "none")
  if mode == "auto":     # Options built without from_kwargs
    return "windowed" if getattr(options, "compiler_terms", None) else "none"
  return mode


def _versus_xla(best, site, ctx, request, base, cheapest_elsewhere=None):
  """`best`, or the site left to XLA unless the rewrite is predicted faster than XLA's
  own program for it (in the operands' own layouts, under `Options.compiler_flags`)
  by more than `costing.XLA_MARGIN` (`costing.leave_to_xla`). Only automatic plans are
  compared: a pinned algorithm, ksplit or dataflow is the user's call.

  Where compiled programs showed the plain collective rewrite faster than XLA's own
  program (`_COLLECTIVE_OVER_XLA_MEASURED`), a site that would be left to XLA is
  rewritten as the collective algorithm in its own layout instead, if no other
  dataflow's collective is predicted faster (`cheapest_elsewhere`, priced as if the
  operands were laid out for it): there XLA's partitioner may move the smaller operand,
  and it won."""
  mode = _xla_baseline(ctx.options)
  pinned = (request.algorithm, request.ksplit, request.dataflow) != (None, None, None)
  if mode == "none" or pinned or request.rewrite is True:
    return best
  profile = _profile(ctx, site.geometry)
  flow = costing.model_dataflow(site.dataflow)
  # XLA's program under the flags the program is compiled with (`Options.compiler_flags`)
  flags = ctx.options.compiler_flags
  xla = costing.xla_program(site.problem, profile, flow, mode, ctx.options.compiler_terms,
                            windowed_off=backend_flags.windowed_einsum_off(flags),
                            offloaded=_offloaded(ctx, profile),
                            forward=base["direction"] == "forward")
  collective = best.algorithm == "collective" or best.ksplit == 1
  too_big = "" if xla.windowed else costmodel.why_too_big(site.problem, "collective", flow, 1,
                                                          profile)
  if too_big:
    # XLA's dense program holds what the collective plan holds: no more a choice than it
    return dataclasses.replace(best, note=_join(
        best.note, f"XLA's own program ({xla.description}) does not fit HBM either"))
  # the step template was compared with XLA's program on the compiled step, not per site
  templated = best.rewritten and best.rule == pins.STEP_TEMPLATE_RULE
  if templated or not costing.leave_to_xla(best.predicted_seconds, collective, xla,
                                           same_program=_compiles_as_xla(ctx)):
    return dataclasses.replace(best, xla_seconds=xla.seconds, note=_join(
        best.note, f"XLA's own program ({xla.description}): {xla.seconds * 1e6:.1f} us"))
  plan = f"{best.algorithm} {best.dataflow} S={best.ksplit}"
  if (site.rewritten and _collective_over_xla(ctx, profile)
      and (cheapest_elsewhere is None or site.baseline_seconds <= cheapest_elsewhere)):
    generation = backend_flags.profile_generation(profile.name)
    return dataclasses.replace(
        site, algorithm="collective", ksplit=1, block=site.geometry.block_size(1),
        reduce_scatter=None, predicted_seconds=site.baseline_seconds,
        xla_seconds=xla.seconds, rule=pins.COLLECTIVE_OVER_XLA_RULE, note=_join(site.note, (
            f"collective S=1 rather than XLA's own program ({xla.description}) "
            f"{xla.seconds * 1e6:.1f} us, which the model prices the same: on {generation} "
            "under SparseCore offload the collective rewrite compiled faster than XLA's "
            "program wherever no other dataflow moves less (docs/benchmarks.md, "
            "\"Ironwood (tpu7x)\")")))
  return Site(rewritten=False, predicted_seconds=xla.seconds, xla_seconds=xla.seconds,
              baseline_seconds=site.baseline_seconds, profile=profile,
              reason=(f"{pins.LEFT_TO_XLA}: the best rewrite ({plan}) "
                      f"{best.predicted_seconds * 1e6:.1f} us is not predicted faster than "
                      f"XLA's own program ({xla.description}) {xla.seconds * 1e6:.1f} us "
                      f"by more than the {costing.XLA_MARGIN:.0%} margin"),
              **base)


# TPU generations where forward-pass reshards under SparseCore offload were compiled and
# measured faster than XLA's program (docs/benchmarks-log.md, "Forward sites under SparseCore
# offload"); elsewhere under offload a site keeps the dataflow its layouts give.
_FORWARD_RESHARDS_MEASURED = ("v5p", "v6e")

# ... on a mesh whose axes both have at least this many devices. With a 2-device axis the
# activation gather the reshard saves moves half a block to one neighbour: on 64 chips
# as 32x2 (GPT-3 and a 32-head layer at seq 2048, `bench/tpu_never_slower_sweep.py`) the
# default plan that resharded the MLP down projection compiled 0.993x XLA on v5p (both,
# alpha-beta) and 1.001-1.013x on v6e, against 1.03-1.09x with 4- and 8-device axes
# (docs/tpu.md, "Forward reshards need two axes of four")
_FORWARD_RESHARD_MIN_AXIS = 4


# TPU generations where, under SparseCore offload with windowed einsum off (the
# `dense,async,all_to_all` preset), the sites XLA's own program is priced as tying ran
# faster rewritten as the plain collective algorithm (one all-gather per operand, one
# ring reduce-scatter) in their own layouts than left to XLA: tpu7x, the default plan
# 1.13-1.59x XLA on GPT-3 / Llama-shaped layers and whole steps from 8 to 2048
# TensorCores (1.30-1.34x on the 256-chip whole steps with each side at its best of
# two meshes), and 0.996x on a 0.7 ms toy step (docs/benchmarks.md, "Ironwood (tpu7x),
# 256 chips: a whole step"). XLA's program there moved up to twice the collective bytes.
# Where another dataflow's collective moves less (GPT-3 at seq 256), XLA's program won by
# 2x, so such sites stay XLA's.
_COLLECTIVE_OVER_XLA_MEASURED = ("tpu7x",)


def _collective_over_xla(ctx, profile) -> bool:
  """Whether a tie with XLA's program goes to the collective rewrite on this profile's
  generation under the compiler flags in force (`_COLLECTIVE_OVER_XLA_MEASURED`): with
  SparseCore offload and windowed einsum off, the flags it was measured under, in a step
  with the compute for it (`_collective_over_xla_pays`)."""
  flags = ctx.options.compiler_flags
  if profile is None or not ctx.collective_over_xla or not _offloaded(ctx, profile) or not (
      backend_flags.windowed_einsum_off(flags)):
    return False
  return backend_flags.profile_generation(profile.name) in _COLLECTIVE_OVER_XLA_MEASURED


# The step whose sites take `_COLLECTIVE_OVER_XLA_MEASURED`'s rule needs one of them to
# compute for at least this long. On tpu7x:4x4x2 (64 TensorCores, one sequence each,
# `bench/tpu_never_slower_sweep.py`, 2026-12-07) GPT-3 layers whose largest such matmul
# computes for 0.60 ms (seq 512) compiled 1.02-1.15x XLA and at 2.4 ms (seq 2048)
# 1.02-1.28x; a 32-head layer at seq 2048 (largest 0.27 ms) 0.897x on 16x4. The same
# layer gained on its other meshes and at seq 512 (1.005-1.119x, largest 0.07-0.27 ms):
# compute does not separate its one loss from its wins, so the floor gives those up
# (`meshslice.tune` compiles the collective candidate and keeps it where it wins;
# docs/tpu.md, "The never-slower sweep on v5p, v6e and Ironwood").
_COLLECTIVE_OVER_XLA_MIN_COMPUTE_SECONDS = 5e-4

_COLLECTIVE_OVER_XLA_SMALL_NOTE = (
    "not the collective rewrite over a tie with XLA: the step's largest such matmul "
    "computes for less than 0.5 ms, where it compiled slower than XLA's program "
    "(docs/tpu.md, \"The never-slower sweep on v5p, v6e and Ironwood\")")


def _collective_over_xla_pays(sites) -> bool:
  """Whether the sites `_collective_over_xla` gave the collective rewrite (none: True)
  hold one that computes for `_COLLECTIVE_OVER_XLA_MIN_COMPUTE_SECONDS` unsliced."""
  ruled = [s for s in sites if s.rule == pins.COLLECTIVE_OVER_XLA_RULE]
  if not ruled:
    return True
  return max(costmodel.predict(s.problem, "collective", costing.model_dataflow(s.dataflow),
                               1, s.profile).compute_s
             for s in ruled) >= _COLLECTIVE_OVER_XLA_MIN_COMPUTE_SECONDS


def _offloaded(ctx, profile) -> frozenset:
  """The collectives the compiler flags (`Options.compiler_flags`) offload to the
  SparseCore on the profile's TPU generation (`backend_flags.sparse_core_offload`)."""
  return backend_flags.sparse_core_offload(ctx.options.compiler_flags,
                                           backend_flags.profile_generation(profile.name))


def _plans_for_tpu(ctx) -> bool:
  """Whether the program is planned for TPU: its mesh's devices, or an AbstractMesh's."""
  mesh = ctx.mesh if isinstance(ctx.mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)) \
      else None
  return target_platform(mesh) == "tpu"


def _why_slices_cannot_overlap(ctx, profile) -> str:
  """Why a sliced plan's collectives would not overlap its matmuls where the program
  runs, or "" when they can. On TPU (a mesh of TPU devices, or an AbstractMesh of them)
  libtpu runs collectives asynchronously only under the generation's overlap flags
  (`backend_flags.tpu_overlap_flags`); without them in `Options.compiler_flags` every
  slice's collective waits for the chip, the slices run one after another, and a sliced
  plan is slower than XLA's program (MaxText's published v5p flags: docs/benchmarks.md);
  unsliced, the rewrite is XLA's dense program at best. The planner then leaves the site
  to XLA, unless the user asked for a rewrite (an algorithm, a dataflow or
  `rewrite=True`): then it is rewritten, unsliced. Elsewhere the cost model's overlap
  stands (CPU runs collectives synchronously anyway, and GPU's flags are XLA_FLAGS)."""
  if not _plans_for_tpu(ctx):
    return ""
  flags = " ".join(ctx.options.compiler_flags or ())
  missing = backend_flags.missing_overlap_flags(
      "tpu", {"LIBTPU_INIT_ARGS": flags},
      generation=backend_flags.profile_generation(profile.name))
  if not missing:
    return ""
  return (f"libtpu runs the rewrite's collectives synchronously without "
          f"{' '.join(missing)} in the compiler flags (docs/tpu.md)")


def _why_one_axis_mesh_is_left(ctx) -> str:
  """Why an automatic site of a one-axis TPU mesh is left to XLA, or "". A mesh with one
  axis of size > 1 (pure data or FSDP parallelism: its sites gather a weight, or
  all-reduce a partial, over that one axis) is not the two-axis problem the rewrite and
  its step template were measured on. Compiled with libtpu 0.0.42.1 on v4 at 64 and 256
  chips under `dense,async,all_to_all`, the step template compiled slower than XLA's own
  program on 5 of the 7 one-axis programs it rewrote (0.94-0.99x under the least
  favourable model; faster on 2, 1.14x and 1.18x), and the per-site model's sliced plan
  slower still (0.89x): docs/tpu.md, "One-axis meshes". `tune`, which compiles the
  candidates and keeps XLA's program unless one beats it, is the way to the wins; a pin
  (`rewrite`, `algorithm` or `dataflow`) rewrites the site anyway."""
  if not _plans_for_tpu(ctx):
    return ""
  if sum(size > 1 for size in ctx.axis_sizes.values()) != 1:
    return ""
  return ("a one-axis mesh (pure data / FSDP parallelism): on TPU the rewrite compiled "
          "slower than XLA's own program on 5 of 7 such programs measured (docs/tpu.md, "
          "\"One-axis meshes\"); meshslice.tune compiles it and keeps it where it wins")


def _compiles_as_xla(ctx) -> bool:
  """Whether the collective rewrite compiles to XLA's own program for a site: on a
  concrete mesh of CPU or GPU devices (synchronous collectives, the same partitioning).
  On TPU devices, or an AbstractMesh planned with a TPU profile, it does not
  (`costing.leave_to_xla`)."""
  devices = _devices(ctx)
  return devices is not None and getattr(devices.flat[0], "platform", "tpu") != "tpu"


def _honours(candidate, request, site) -> bool:
  """Whether a relayout candidate gives what the user asked for as exactly as the site's
  own layout does (it must not win by falling back to another algorithm or ksplit)."""
  if request.algorithm is not None and candidate.algorithm != site.algorithm:
    return False
  return request.ksplit is None or candidate.ksplit == site.ksplit


# A dataflow that needs an operand resharded first is chosen only when it is predicted
# faster than the site's own layout by more than this factor.
RELAYOUT_MARGIN = 0.9


def _plan_match(eqn, ctx, base: dict[str, Any], request, dimension_numbers, lhs, rhs, out, match,
                lhs_spec, rhs_spec, result_resharded=False):
  """The site planned as `match` on operands laid out as lhs_spec / rhs_spec (and, with
  `result_resharded`, a result layout other than the program's: `_other_output_layouts`).
  Every match comes from `matching.classify`, which has proved it exact
  (`validation.site_reason`)."""
  base = dict(base, out_spec=S.describe(match.out_spec))
  geometry = matching.geometry_of(
      match, dimension_numbers, ctx.axis_sizes, precision=eqn.params.get("precision"),
      preferred_element_type=eqn.params.get("preferred_element_type"),
      out_dtype=out.dtype)
  mesh_axes = ((match.row_axis,) if match.dataflow.startswith("1d")
               else (match.row_axis, match.col_axis))
  decided: dict[str, Any] = dict(dataflow=match.dataflow, mesh_axes=mesh_axes,
                                 geometry=geometry, specs=(lhs_spec, rhs_spec, match.out_spec))
  if not geometry.valid_ksplits():
    return Site(rewritten=False, reason=(
        f"communicated extent {match.global_extent} is not divisible by "
        f"{'the axis size' if len(mesh_axes) == 1 else 'lcm(R, C)'} = {geometry.lcm}"),
        **base, **decided)
  profile = _profile(ctx, geometry)
  problem = costing.problem_for(geometry, lhs.shape, rhs.shape, lhs_spec, rhs_spec,
                                lhs.dtype, out.dtype, ctx.axis_sizes, profile)
  flow = costing.model_dataflow(match.dataflow)
  terms = getattr(ctx.options, "compiler_terms", None)
  offloaded = _offloaded(ctx, profile)
  forward = base["direction"] == "forward"
  baseline = costing.predict(problem, profile, "collective", flow, 1, terms, offloaded,
                             forward)
  site = Site(rewritten=True, algorithm="collective", ksplit=1, block=geometry.block_size(1),
              baseline_seconds=baseline, predicted_seconds=baseline, problem=problem,
              profile=profile, **base, **decided)
  algorithm, note = _choose_algorithm(geometry, request, site)
  site = dataclasses.replace(site, note=_join(site.note, note))
  if request.ksplit is not None or algorithm not in (None, "meshslice", "collective"):
    algorithm = algorithm or "meshslice"
    ksplit, note = _requested_ksplit(algorithm, geometry, request, site)
    seconds = costing.predict(problem, profile, algorithm, flow, ksplit, terms, offloaded,
                              forward)
    # a pinned plan is the user's call: kept, but said when it will not fit
    too_big = costmodel.why_too_big(problem, algorithm, flow, ksplit, profile)
    note = _join(note, too_big and f"the requested plan does not fit HBM: {too_big}")
  else:
    # the cost model picks among the slice counts this site can realise exactly, and
    # slices at all only where their collectives can overlap the matmuls
    ksplits = tuple(k for k in geometry.valid_ksplits() if k <= ctx.options.max_ksplit
                    and geometry.global_extent // (k * geometry.lcm) >= ctx.options.min_block)
    no_overlap = _why_slices_cannot_overlap(ctx, profile)
    asked = (request.algorithm, request.dataflow) != (None, None) or request.rewrite is True
    one_axis = _why_one_axis_mesh_is_left(ctx)
    if one_axis and not asked:
      return dataclasses.replace(site, rewritten=False, algorithm=None, ksplit=None,
                                 block=None, predicted_seconds=None,
                                 reason=f"{pins.LEFT_TO_XLA}: {one_axis}")
    if no_overlap and not asked:
      # unsliced, the rewrite is XLA's dense program at best (MaxText's 2023 v5p flags,
      # simulated: its plain collective sites 0.92-0.96x of XLA's program)
      return dataclasses.replace(site, rewritten=False, algorithm=None, ksplit=None,
                                 block=None, predicted_seconds=None,
                                 reason=f"{pins.LEFT_TO_XLA}: {no_overlap}")
    if no_overlap:
      ksplits = (1,)
      site = dataclasses.replace(site, note=_join(site.note, no_overlap))
    templated = (not no_overlap and not one_axis and algorithm is None
                 and _step_template_applies(ctx, profile, request))
    # the site as the collective algorithm, unsliced: what the template sizes sites by
    unsliced = (costmodel.predict(problem, "collective", flow, 1, profile) if templated
                else costmodel.Cost())
    compute_s = unsliced.compute_s
    if templated and ctx.template_mode == "probe":
      # the step's compute decides (`plan_program`); until then, a site of a step with
      # too little compute for the template's collectives to hide under, or a sliced
      # plan's: compiled, such steps ran slower than XLA sliced as well (GPT-3 at seq 256)
      ctx.template_compute.append(compute_s)
      if forward and flow in ("os", "ls"):
        ctx.template_tokens.append(_local_tokens(problem))
        ctx.template_row_devices.append(problem.rows)
      ksplits = (1,)
      site = dataclasses.replace(site, rule=pins.STEP_TEMPLATE_GUARD_RULE,
                                 note=_join(site.note, _TOO_LITTLE_COMPUTE_NOTE))
    elif templated:
      algorithm, ksplit = _step_template(
          match.dataflow, ksplits, compute_s, ctx.template_largest_s, forward=forward,
          weight_contracted_last=_weight_contracted_last(dimension_numbers, rhs),
          taller_than_wide=problem.m > problem.n, result_resharded=result_resharded)
      if not costmodel.why_too_big(problem, algorithm, flow, ksplit, profile):
        # priced at most as the collective: the per-site model charges the slices' all-
        # to-alls as exposed, where on the compiled step the second slice's matmul hides
        # the first's (so the dataflow is chosen as tune's collective base chose it)
        seconds = min(baseline, costing.predict(problem, profile, algorithm, flow, ksplit,
                                                terms, offloaded, forward))
        form = _scatter_form(request, algorithm, match.dataflow, _automatic_scatter_form(ctx))
        return dataclasses.replace(
            site, algorithm=algorithm, ksplit=ksplit, block=geometry.block_size(ksplit),
            reduce_scatter=form, predicted_seconds=seconds, rule=pins.STEP_TEMPLATE_RULE,
            note=_join(site.note, _STEP_TEMPLATE_NOTE.format(
                generation=backend_flags.profile_generation(profile.name))))
      algorithm = None    # the template does not fit HBM: the cost model chooses
    algorithm, ksplit, seconds, note = costing.choose(
        problem, profile, flow, ksplits=ksplits or (1,),
        algorithms=(algorithm,) if algorithm else costing.AUTO_ALGORITHMS, terms=terms,
        offloaded=offloaded, forward=forward)
    if algorithm is None:     # every candidate is too big for the chip
      return dataclasses.replace(site, rewritten=False, algorithm=None, ksplit=None,
                                 block=None, predicted_seconds=None, reason=note)
  form = _scatter_form(request, algorithm, match.dataflow, _automatic_scatter_form(ctx))
  return dataclasses.replace(site, algorithm=algorithm, ksplit=ksplit,
                             block=geometry.block_size(ksplit) if algorithm != "wang" else None,
                             reduce_scatter=form, predicted_seconds=seconds,
                             note=_join(site.note, note))


# TPU generations where, under the `dense,async,all_to_all` preset without SparseCore
# offload, one plan for the whole step compiled faster than the per-site model's choices
# (`_step_template` says it site by site): every 2D site rewritten in its own dataflow as
# the plain collective algorithm, except the lhs-stationary ones (their output
# reduce-scattered and read right away), sliced in two, the MLP's in four, and the down
# projection's backward sites sliced in two; all reduce-scatters sent as all-to-alls. On
# v4 at 256 chips (docs/benchmarks.md, "TPU v4, 256 chips"): GPT-3 layer 1.102x XLA
# against the per-site plan's 1.065x, Megatron-NLG layer 1.104x against 1.069x, within
# 0.4 % and 0.9 % of the best plan `tune(refine=1)` found, the least favourable of the
# alpha-beta and routed models. Why it wins where the per-site model does not see it: a
# weight gradient's all-to-all hides under the rest of the backward pass unsliced; an
# lhs-stationary site's does not, and slices hide it where more add compute (each slice
# costs ~3-7 % of the site's dots); the collective rewrite of an os site exposes less of
# its gathers than XLA's program for it. On v5p the first template (ls sites in two)
# lost to the per-site plan (0.976x XLA routed), so it is v4's only.
_STEP_TEMPLATE_MEASURED = ("v4",)

_STEP_TEMPLATE_NOTE = (
    "the step template measured on {generation} (collective S=1; lhs-stationary sites "
    "sliced in two, the MLP's in four, its down projection's gradients in two; all-to-all "
    "reduce-scatters): it compiled faster than the per-site "
    "model's plan and XLA's program (docs/benchmarks.md, \"Where the tuned plan's gain "
    "comes from\")")


# The step template needs a step whose largest matmul it can plan is predicted to compute
# for at least this long: the work the collectives hide under. In every program it won on
# the largest computes for 7.6 ms or more (GPT-3, Megatron-NLG and Llama-shaped steps, one
# sequence of 2048-4096 tokens per chip, 256 to 4096 chips; their smallest sites, 0.28 ms,
# gained with them); it lost where the largest computes for 1.2 ms: GPT-3 at seq 256
# (1.105x XLA alpha-beta but 0.826x routed, 0.613x by libtpu's scheduler), and a 4 x
# 128-head layer at seq 128 (0.896x routed).
_STEP_TEMPLATE_MIN_COMPUTE_SECONDS = 2e-3


# ... or whose forward-pass matmuls hold at least this many token rows on each device
# (the activation block's rows: the batch's tokens over the mesh's row axis) while its
# largest computes for at least `_STEP_TEMPLATE_MIN_TOKENS_COMPUTE_SECONDS`. Measured on
# v4 with libtpu 0.0.42.1 (docs/tpu.md, "The step template on smaller layers"): on layers
# of 16-32 heads of 128 whose largest matmul computes for 0.14-1.1 ms, every step of 2048
# or more token rows a device compiled faster than XLA's program under both time models
# (1.10-1.70x, the least favourable); with 1024 rows three of four compiled slower (GPT-3
# at seq 256: 0.82x and 0.96x routed; 16 heads at seq 256: 0.89x alpha-beta), and layers
# of 4-8 heads on 8 chips (largest 0.01-0.02 ms) slower at 2048-8192 rows (0.94-0.99x).
_STEP_TEMPLATE_MIN_TOKENS = 2048
_STEP_TEMPLATE_MIN_TOKENS_COMPUTE_SECONDS = 1e-4

# A step whose largest matmul computes for `_STEP_TEMPLATE_MIN_COMPUTE_SECONDS` or more
# (GPT-3-sized layers) needs at least this many token rows a device as well. On v4:8x8x4
# as 64x4 (256 chips, one sequence per chip, `bench/tpu_never_slower_sweep.py`,
# 2026-12-07) GPT-3 and Megatron-NLG layers at seq 512 (2048 rows, largest 3.3 / 6.8 ms)
# compiled 0.948x and 0.936x XLA's program (routed links; 1.153x / 1.596x alpha-beta):
# the plan's weight gathers over the 64-chip axis waited 17.7 ms where XLA's waited 12.3.
# At seq 1024 (4096 rows) they won, 1.072x and 1.049x, as at 8192 rows and more on every
# GPT-3-sized step measured. Narrower layers won at 2048 rows, on 64x4 too (32 heads of
# 128: 1.223x; docs/tpu.md, "The step template on smaller layers"). What separates the
# two at 2048 rows was not found: this is the measured line, not a model of it.
_STEP_TEMPLATE_MIN_TOKENS_LARGE = 4096

# ... and at least this many rows per device of the axis they are split over (the mesh
# rows R: 64 R rows). At 1024 v4 chips (`v4:16x16x4`, same flags and sweep) GPT-3 at seq
# 512 as 128x8 holds 4096 rows, 32 per row device, and compiled 0.981x XLA's program
# (routed; 1.079x alpha-beta); as 64x16 (8192 rows, 128 per row device) 1.031x, and at
# seq 1024 128x8 (64 per row device) 1.131x, 64x16 1.179x. Every GPT-3-sized step that
# won held 64 or more (64x4 at seq 1024: 64; 32x8 at seq 512: 128, Megatron-NLG 1.007x);
# the two 256-chip losses above held 32.
_STEP_TEMPLATE_MIN_TOKENS_PER_ROW_DEVICE = 64


def _step_template_pays(ctx) -> bool:
  """Whether the probed step takes the step template (`plan_program`): its largest
  templated matmul computes for `_STEP_TEMPLATE_MIN_TOKENS_COMPUTE_SECONDS` while its
  forward sites hold the token rows a device `_rows_the_template_needs`."""
  if not ctx.template_compute:
    return False
  largest = max(ctx.template_compute)
  rows = max(ctx.template_tokens, default=0)
  return (largest >= _STEP_TEMPLATE_MIN_TOKENS_COMPUTE_SECONDS
          and rows >= _rows_the_template_needs(ctx))


def _rows_the_template_needs(ctx) -> int:
  """The token rows a device the probed step's forward sites must hold for the step
  template (`_step_template_pays`): `_STEP_TEMPLATE_MIN_TOKENS`, and where its largest
  matmul computes for `_STEP_TEMPLATE_MIN_COMPUTE_SECONDS` or more
  `_STEP_TEMPLATE_MIN_TOKENS_LARGE` and `_STEP_TEMPLATE_MIN_TOKENS_PER_ROW_DEVICE` per
  device of the mesh rows."""
  if max(ctx.template_compute, default=0.0) < _STEP_TEMPLATE_MIN_COMPUTE_SECONDS:
    return _STEP_TEMPLATE_MIN_TOKENS
  return max(_STEP_TEMPLATE_MIN_TOKENS_LARGE,
             _STEP_TEMPLATE_MIN_TOKENS_PER_ROW_DEVICE * max(ctx.template_row_devices,
                                                             default=1))


def step_notes(ctx) -> tuple:
  """What the report says of the step as a whole, once `plan_program` has planned it with
  `ctx` (the Context passed in: its probe walk filled `ctx.template_*`): why a step that
  could take the step template did not (its sites' own notes are replaced where they are
  left to XLA)."""
  if not ctx.template_compute or _step_template_pays(ctx):
    return ()
  largest = max(ctx.template_compute)
  rows = max(ctx.template_tokens, default=0)
  if largest < _STEP_TEMPLATE_MIN_TOKENS_COMPUTE_SECONDS:
    short = (f"its largest matmul computes for {largest * 1e3:.3f} ms, under the "
             f"{_STEP_TEMPLATE_MIN_TOKENS_COMPUTE_SECONDS * 1e3:.1f} ms it needs")
  else:
    short = (f"its forward matmuls hold {rows} token rows a device, where a step whose "
             f"largest matmul computes for {largest * 1e3:.2f} ms on "
             f"{max(ctx.template_row_devices, default=1)} mesh rows needs "
             f"{_rows_the_template_needs(ctx)}")
  return (f"the step template was not taken: {short} (steps with less compiled slower than "
          "XLA's program with it; docs/tpu.md, \"The step template on smaller layers\" and "
          "\"GPT-3-sized steps need 4096 token rows\")",)


def _local_tokens(problem) -> int:
  """The token rows of a forward site's activation block on one device: its M over the
  mesh rows (M is the activations' tokens in a forward os or ls site)."""
  return problem.m // max(problem.rows, 1)


def _term_left_to_xla(site, sliced: bool) -> bool:
  """Whether the step template leaves to XLA `site`, a matmul whose result is one term of
  a sum of matmul results (`Site.summed`), planned in its own layout: when its collective
  (the per-site model, unsliced) takes `_SUMMED_TERM_COMM_OVER_COMPUTE` times its
  compute, or, where its plan is not `sliced` (nothing of its own hides the collective),
  `_UNSLICED_TERM_COMM_OVER_COMPUTE` times. XLA reduce-scatters the sum once where the
  rewrite sends a collective a term."""
  cost = costmodel.predict(site.problem, "collective", costing.model_dataflow(site.dataflow),
                           1, site.profile)
  ratio = _SUMMED_TERM_COMM_OVER_COMPUTE if sliced else _UNSLICED_TERM_COMM_OVER_COMPUTE
  return cost.comm_s >= ratio * cost.compute_s


# Measured on v4 (docs/benchmarks.md, "MaxText's Llama2-70B on v4"): MaxText's
# Llama2-70B lost to XLA with its key and value projections' data gradients (8 of 64
# heads, sliced in two: 12x) rewritten and won with them left; its query's term
# (unsliced, gathering the query heads: 1.5x) left too gained 0.6 % more, and on
# Llama3.1-70B 1.7 %, turning a loss into a win. Left to XLA, GPT-3's query, key and value
# terms (sliced, 1.3x) lost 1.6 % (routed), and the Llama-shaped step's query term
# (sliced, 1.7x) 3.1 %: a sliced term hides its collective under its second slice.
_SUMMED_TERM_COMM_OVER_COMPUTE = 2.0
_UNSLICED_TERM_COMM_OVER_COMPUTE = 1.4
_SUMMED_REASON = (
    "one term of a sum of matmul results (a gradient summed over projections), which XLA "
    "reduce-scatters once where the step template would send a collective a term")

_TOO_LITTLE_COMPUTE_NOTE = (
    "unsliced, in its own layout: under the flags of the step template, a step whose "
    "matmuls compute for too little, or hold too few token rows a device, to hide sliced "
    "collectives or relayouts under (GPT-3 at seq 256, and at seq 512 on 256 chips as "
    "64x4, compiled slower than XLA with the template; docs/tpu.md)")


def _step_template_applies(ctx, profile, request) -> bool:
  """Whether the step template (`_STEP_TEMPLATE_MEASURED`) plans an automatic site: a
  TPU generation it was measured on, compiled under the flags it was measured under
  (windowed einsum off, async all-to-all on, no SparseCore offload), reduce-scatters in
  the all-to-all form, and neither algorithm nor ksplit pinned. In a step whose largest
  such site computes for less than `_STEP_TEMPLATE_MIN_COMPUTE_SECONDS` they are planned
  by the per-site model instead, unsliced and in their own layout (`plan_program`)."""
  if profile is None or request.ksplit is not None or request.algorithm is not None:
    return False
  if backend_flags.profile_generation(profile.name) not in _STEP_TEMPLATE_MEASURED:
    return False
  flags = ctx.options.compiler_flags
  return not (_offloaded(ctx, profile) or len(backend_flags.windowed_einsum_off(flags)) < 2
              or _scatter_form(request, "collective", "ls", _automatic_scatter_form(ctx))
              != "all_to_all")


def _step_template(dataflow, ksplits, compute_s, largest_s, *, forward=True,
                   weight_contracted_last=False, taller_than_wide=False,
                   result_resharded=False) -> tuple:
  """(algorithm, ksplit) the step template gives a site of `dataflow` that computes for
  `compute_s` in a step whose largest templated site computes for `largest_s`:

  - an lhs-stationary site sliced in two, or in four when it is one of the step's large
    matmuls (`_TEMPLATE_LARGE_FRACTION` of the largest: the MLP's), except a weight
    gradient computed into another result layout (`result_resharded`,
    `_other_output_layouts`), whose slices each re-lay out the whole batch's activations
    (MaxText's Llama2-70B: 20 ms of copies a layer at S=4);
  - in the backward pass (`forward` False), a large output-stationary site whose weight is
    contracted on its last dimension (dy @ W^T, the activation gradient of an
    lhs-stationary forward site, which waits on the gradient that just arrived) sliced in
    two; a large reduce-scatter site (a weight gradient) whose result is taller than wide
    (`taller_than_wide`: a down projection's, the first the backward pass computes)
    sliced in two when each slice still computes for `_TEMPLATE_SLICED_GRADIENT_SECONDS`;
  - every other site the collective algorithm.

  `ksplits` are the slice counts the site can realise: a site that cannot be sliced as
  the template says runs it sliced in two if it can, else the collective algorithm."""
  flow = costing.model_dataflow(dataflow)
  large = compute_s >= _TEMPLATE_LARGE_FRACTION * largest_s
  if dataflow.startswith("1d"):
    wanted = 1
  elif flow == "ls" and result_resharded:
    wanted = 1
  elif flow == "ls":
    wanted = 4 if large else 2
  elif flow == "os" and large and not forward and weight_contracted_last:
    wanted = 2
  elif (flow == "rs" and large and not forward and taller_than_wide
        and compute_s / 2 >= _TEMPLATE_SLICED_GRADIENT_SECONDS):
    wanted = 2
  else:
    wanted = 1
  if wanted > 1 and wanted not in ksplits:
    wanted = 2 if 2 in ksplits else 1
  return ("meshslice", wanted) if wanted > 1 else ("collective", 1)


# A site of the step template is one of the step's large matmuls (sliced finer) when it
# computes for at least this fraction of the step's largest: the MLP's projections
# (0.9-1.0 of the largest on the GPT-3, Megatron-NLG and Llama-shaped steps measured, the
# unembedding included), not the attention projections (about a quarter or less).
_TEMPLATE_LARGE_FRACTION = 0.5

# A down projection's weight gradient is sliced in two when each slice computes for at
# least this long. Measured on v4 at 256 chips (docs/benchmarks.md): GPT-3's (9.8 ms)
# compiled slower sliced (163.32 against 161.13 ms routed), Megatron-NLG's (27.2 ms)
# faster (397.34 against 400.43); Megatron-NLG's up projection's gradient, the same size,
# slower (403.35 against 397.62).
_TEMPLATE_SLICED_GRADIENT_SECONDS = 8e-3


def _weight_contracted_last(dimension_numbers, rhs) -> bool:
  """Whether the rhs is contracted on its last dimension only (x @ W^T: how JAX writes
  the activation gradient of y = x @ W), not its first (x @ W)."""
  (_, rc), (_, rb) = dimension_numbers
  return tuple(rc) == (rhs.ndim - 1,) and rhs.ndim - len(rb) >= 2


def _automatic_scatter_form(ctx) -> str | None:
  """What reduce_scatter="auto" (the default) means for this mesh: "all_to_all" when it
  compiles for TPU with libtpu's async all-to-all on in `Options.compiler_flags` (by
  default this process's LIBTPU_INIT_ARGS, which libtpu reads once): libtpu keeps
  reduce-scatters synchronous on v4 (and on v5p in the programs measured) but overlaps
  those all-to-alls (docs/tpu.md); else None (one reduce-scatter, the only form that
  overlaps anything on GPU). Whether it compiles for TPU is `target_platform`'s answer
  for the site's mesh: a concrete mesh's devices, an AbstractMesh's abstract device (a
  plan made on an abstract TPU mesh is the same on every host), else the mesh being
  traced under, else the default backend."""
  mesh = ctx.mesh if isinstance(ctx.mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)) \
      else None
  if target_platform(mesh) != "tpu":
    return None
  if not backend_flags.async_all_to_all(ctx.options.compiler_flags):
    return None
  return "all_to_all"


def _scatter_form(request, algorithm, dataflow, automatic=None):
  """The site's reduce-scatter form, None for one collective: only ls / rs sites of
  meshslice and collective reduce-scatter (a form pinned on another site is noted by the
  pin rule, `pins.PIN_RULES`); "auto" (or None) is `automatic`, what it means for this
  mesh."""
  asked = request.reduce_scatter
  if asked in (None, "auto"):
    asked = automatic
  if asked in (None, "reduce_scatter") or not pins.takes_reduce_scatter(algorithm, dataflow):
    return None
  return asked


def _module(scoped: str, param: str, call_chain) -> str:
  """The module column: the name stack's path, unless it is positions only (penzai's
  `Sequential`s scope each sublayer by its index: '1/0/1/0' is block 0's attention)
  and the matmul's parameter has a name; else the parameter; else the call chain."""
  if scoped and not (param and all(part.isdigit() for part in scoped.split("/"))):
    return scoped
  return param or scoped or call_chain()


def _pinned_by(request, name) -> str:
  """'overrides[key]: ' (or 'plan site #k: ') when `name` was pinned there, for errors."""
  where = request.pinned_by(name)
  return f"{where}: " if where else ""


def _join(*notes):
  return "; ".join(n for n in notes if n)


def _choose_algorithm(geometry, request, site):
  """The requested algorithm if it can serve the site (None: let the cost model pick)."""
  algorithm = request.algorithm
  if algorithm is None:
    return None, ""
  why_not = rewrites.supports(algorithm, geometry)
  if not why_not:
    return algorithm, ""
  if request.strict:
    raise PinError(f"{_pinned_by(request, 'algorithm')}algorithm={algorithm!r} cannot "
                   f"serve {site.label}: {why_not}")
  return None, f"{why_not}; chose among {', '.join(costing.AUTO_ALGORITHMS)}"


def _fits(algorithm, geometry, ksplit) -> str:
  """Why `algorithm` cannot run this geometry with `ksplit` slices ("" when it can): the
  builder itself validates, so ask it."""
  try:
    rewrites.build_body(algorithm, geometry, ksplit)
  except ValueError as e:
    return str(e)
  return ""


def _requested_ksplit(algorithm, geometry: GemmGeometry, request, site: Site):
  wanted = 1 if request.ksplit is None or algorithm == "collective" else request.ksplit
  why_not = _fits(algorithm, geometry, wanted)
  if not why_not:
    return wanted, ""
  valid = [k for k in range(1, geometry.global_extent + 1)
           if geometry.global_extent % k == 0 and not _fits(algorithm, geometry, k)]
  if request.strict:
    raise PinError(
        f"{_pinned_by(request, 'ksplit')}ksplit={wanted} does not fit {site.label}, a "
        f"{site.dataflow} matmul over "
        f"{site.mesh_axes}: its communicated extent {geometry.global_extent} must be "
        f"divisible by ksplit * lcm(R, C) = {wanted * geometry.lcm}. Valid ksplit "
        f"for this site: {', '.join(map(str, valid))}")
  nearest = min(valid, key=lambda k: (abs(k - wanted), -k))
  return nearest, (f"ksplit={wanted} does not divide extent {geometry.global_extent} into "
                   f"ksplit*lcm(R,C) blocks; used {nearest}")
