"""The mesh study: the best 2D mesh shape for the feed-forward GEMMs of a transformer,
with each GEMM's plan, the per-chip memory and the end-to-end layer time.

  transformer_problems(model, chips, mesh)  the 12 FF GEMMs of one layer
  evaluate_mesh(model, chips, mesh, profile)  every GEMM autotuned on one mesh shape
  recommend_mesh(chips, model=...)          every 2D shape evaluated, the fastest feasible
  compare_algorithms(chips, ...)            each algorithm alone at its own best shape
  paper_assumptions(profile)                the original MeshSlice autotuner's assumptions

Why a module of its own: it asks of whole models what `site_choice.best_plan` answers
for one site, and grows with models, layouts and memory rules, not with how a site is
chosen. It imports `site_choice`; `autotune` re-exports both under the old names.

Everything here is a deterministic function of its arguments (ties: the smaller R, the
earlier layout, `best_plan`'s order), so every process of a multi-host job gets the same
answer.
"""
from __future__ import annotations

import dataclasses
import json

from .memory import ADAM_BYTES_PER_PARAM, MemoryEstimate, site_memory, training_memory
from .memory import gib as _gib
from .profiles import HardwareProfile, load_profile
from .site_choice import EMITTABLE, NEAR_TIE, Choice, _check_choices, _check_positive, best_plan
from .timing import ALGORITHMS, Cost, GemmProblem, lower_bound, why_invalid
from .topology import describe_axes, profile_for_mesh

# ----------------------------------------------------------------------------- transformer

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
  """The shape of a transformer, as far as its feed-forward GEMMs care.

  Example:
    >>> model_spec("gpt3").hidden, model_spec("megatron").hidden
    (12288, 20480)
  """

  name: str
  heads: int
  head_dim: int
  seq: int
  layers: int = 1

  def __post_init__(self):
    for name in ("heads", "head_dim", "seq", "layers"):
      _check_positive(getattr(self, name), name)

  @property
  def hidden(self) -> int:
    return self.heads * self.head_dim


# The paper's workloads (docs/costmodel.md): GPT-3 175B and Megatron-Turing NLG 530B.
MODELS = {
    "gpt3": ModelSpec(name="gpt3", heads=96, head_dim=128, seq=2048, layers=96),
    "megatron": ModelSpec(name="megatron", heads=160, head_dim=128, seq=2048, layers=105),
}

# (name, input width, output width) in multiples of the hidden size H.
FF_LAYERS = (("qkv", 1, 3), ("attn_out", 1, 1), ("mlp_up", 1, 4), ("mlp_down", 4, 1))

# A layer's weight layout fixes the dataflow of all three of its GEMMs. Activations are
# [tokens:r, hidden:c] throughout (docs/design.md); the weight is W[in:r, out:c]
# ("os": the forward matmul is output-stationary) or W[in:c, out:r] ("ls": the forward
# matmul is lhs-stationary). Per phase: (phase, dataflow, (m, n, k) as a function of
# tokens T, d_in, d_out).
LAYOUTS = {
    "os": (("forward", "os", lambda t, i, o: (t, o, i)),          # Y  = X . W
           ("backward_data", "ls", lambda t, i, o: (t, i, o)),    # dX = dY . W^T
           ("backward_weight", "rs", lambda t, i, o: (i, o, t))),  # dW = X^T . dY
    "ls": (("forward", "ls", lambda t, i, o: (t, o, i)),          # Y  = X . W
           ("backward_data", "os", lambda t, i, o: (t, i, o)),    # dX = dY . W^T
           ("backward_weight", "rs", lambda t, i, o: (o, i, t))),  # dW^T = dY^T . X
}

# How evaluate_mesh picks each layer's layout:
#   model  every layout in LAYOUTS, the one with the lowest predicted time wins
#   paper  the original autotuner's rule: os when the output is wider than the input
#          (d_out > d_in), ls otherwise
#   os     the forward matmul always output-stationary (the fixed per-phase dataflows)
DATAFLOW_POLICIES = ("model", "paper", "os")


def paper_layout(d_in: int, d_out: int) -> str:
  """The original MeshSlice autotuner's dataflow rule for a layer d_in -> d_out (with
  more tokens than either width): output-stationary when the output is strictly the
  bigger operand, lhs-stationary otherwise (so a square layer, attention-out, is ls).

  Example:
    >>> paper_layout(12288, 49152), paper_layout(49152, 12288), paper_layout(64, 64)
    ('os', 'ls', 'ls')
  """
  return "os" if d_out > d_in else "ls"


def model_spec(model: str | ModelSpec, *, heads: int | None = None,
               head_dim: int | None = None, seq: int | None = None,
               layers: int | None = None) -> ModelSpec:
  """A preset ("gpt3", "megatron") with optional overrides, or "custom" built from them
  (heads, head_dim and seq required; layers defaults to 1).

  Example:
    >>> model_spec("custom", heads=8, head_dim=64, seq=512)
    ModelSpec(name='custom', heads=8, head_dim=64, seq=512, layers=1)
  """
  if isinstance(model, ModelSpec):
    base = model
  elif model == "custom":
    missing = [n for n, v in (("heads", heads), ("head_dim", head_dim), ("seq", seq))
               if v is None]
    if missing:
      raise ValueError(f"model 'custom' needs {', '.join(missing)}")
    base = ModelSpec(name="custom", heads=heads, head_dim=head_dim, seq=seq)
  elif model in MODELS:
    base = MODELS[model]
  else:
    raise ValueError(f"model must be one of {tuple(MODELS) + ('custom',)}, got {model!r}")
  overrides = {k: v for k, v in (("heads", heads), ("head_dim", head_dim), ("seq", seq),
                                 ("layers", layers)) if v is not None}
  return dataclasses.replace(base, **overrides)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LayerProblem:
  """One GEMM of a transformer layer: which layer, which phase, its dataflow, its shape,
  and the layer's weight layout (`LAYOUTS`: "os" or "ls", the forward dataflow).

  Example:
    >>> transformer_problems("gpt3", 16, (4, 4))[-1].label
    'mlp_down/backward_weight'
  """

  layer: str
  phase: str
  dataflow: str
  problem: GemmProblem
  layout: str = "os"

  @property
  def label(self) -> str:
    return f"{self.layer}/{self.phase}"


def _check_chips(chips):
  if isinstance(chips, bool) or not isinstance(chips, int) or chips < 1:
    raise ValueError(f"chips must be a positive int, got {chips!r}")


def _layouts_for(layouts) -> dict:
  if layouts is None:
    layouts = "os"
  if isinstance(layouts, str):
    layouts = {name: layouts for name, _, _ in FF_LAYERS}
  out = {}
  for name, _, _ in FF_LAYERS:
    value = layouts.get(name, "os")
    if value not in LAYOUTS:
      raise ValueError(f"layout of layer {name!r} must be one of {tuple(LAYOUTS)}, "
                       f"got {value!r}")
    out[name] = value
  unknown = set(layouts) - set(out)
  if unknown:
    raise ValueError(f"unknown layers {sorted(unknown)}; layers are "
                     f"{[n for n, _, _ in FF_LAYERS]}")
  return out


def transformer_problems(model: str | ModelSpec, chips: int, mesh_shape: tuple[int, int], *,
                         batch: int | None = None, seq: int | None = None,
                         heads: int | None = None, head_dim: int | None = None,
                         dtype_bytes: int = 2, layouts=None) -> tuple[LayerProblem, ...]:
  """The 12 feed-forward GEMMs of one transformer layer, forward and backward.

  For each of QKV (H -> 3H), attention-out (H -> H), MLP-up (H -> 4H) and MLP-down
  (4H -> H), with T = batch * seq tokens and a layer d_in -> d_out, the layer's weight
  layout (`layouts`: one of LAYOUTS for all layers, or a dict layer -> layout; default
  "os") fixes the three GEMMs:

    layout os (W[in:r, out:c])                 layout ls (W[in:c, out:r])
    forward          os  m=T,    n=d_out, k=d_in    ls  m=T,     n=d_out, k=d_in
    backward_data    ls  m=T,    n=d_in,  k=d_out   os  m=T,     n=d_in,  k=d_out
    backward_weight  rs  m=d_in, n=d_out, k=T       rs  m=d_out, n=d_in,  k=T  (dW^T)

  `batch` defaults to `chips` (one sequence per chip, as in the paper). The mesh's row
  axis uses profile dim 0 and its column axis profile dim 1.

  Example:
    >>> ps = transformer_problems("gpt3", 16, (4, 4))
    >>> len(ps), ps[0].label, ps[0].problem.m, ps[0].problem.n, ps[0].problem.k
    (12, 'qkv/forward', 32768, 36864, 12288)
    >>> [lp.dataflow for lp in transformer_problems("gpt3", 16, (4, 4), layouts="ls")[:3]]
    ['ls', 'os', 'rs']
  """
  spec = model_spec(model, heads=heads, head_dim=head_dim, seq=seq)
  _check_chips(chips)
  if (not isinstance(mesh_shape, (tuple, list)) or len(mesh_shape) != 2
      or mesh_shape[0] * mesh_shape[1] != chips):
    raise ValueError(f"mesh_shape must be a pair (R, C) with R * C = chips = {chips}, "
                     f"got {mesh_shape!r}")
  batch = chips if batch is None else batch
  _check_positive(batch, "batch")
  _check_positive(dtype_bytes, "dtype_bytes")
  chosen = _layouts_for(layouts)
  rows, cols = mesh_shape
  tokens, hidden = batch * spec.seq, spec.hidden
  out = []
  for layer, d_in, d_out in FF_LAYERS:
    d_in, d_out = d_in * hidden, d_out * hidden
    for phase, dataflow, shape in LAYOUTS[chosen[layer]]:
      m, n, k = shape(tokens, d_in, d_out)
      out.append(LayerProblem(layer=layer, phase=phase, dataflow=dataflow,
                              layout=chosen[layer], problem=GemmProblem(
          m=m, n=n, k=k, rows=rows, cols=cols, in_bytes=dtype_bytes, out_bytes=dtype_bytes)))
  return tuple(out)


# ----------------------------------------------------------------------------- memory

def transformer_memory(model: str | ModelSpec, chips: int, profile: HardwareProfile | str,
                       *, batch: int | None = None, dtype_bytes: int = 2,
                       memory_layers: int | None = None,
                       bytes_per_param: int = ADAM_BYTES_PER_PARAM) -> MemoryEstimate:
  """Per-chip memory of training `memory_layers` layers (default: all of the model's)
  with 2D tensor parallelism over `chips` chips: `memory.training_memory` (states,
  saved activations, working set; formulas there) for a named model. The GEMM buffers
  come on top (evaluate_mesh).

  Example:
    >>> m = transformer_memory("megatron", 256, "tpu-v4")     # all 105 layers
    >>> m.fits, round((m.states + m.saved) / 2**30, 1)
    (False, 39.0)
  """
  spec = model_spec(model)
  _check_chips(chips)
  profile = load_profile(profile)
  batch = chips if batch is None else batch
  layers = spec.layers if memory_layers is None else memory_layers
  _check_positive(layers, "memory_layers")
  _check_positive(bytes_per_param, "bytes_per_param")
  return training_memory(hidden=spec.hidden, heads=spec.heads, seq=spec.seq, layers=layers,
                         batch=batch, chips=chips, capacity=profile.hbm_capacity,
                         dtype_bytes=dtype_bytes, bytes_per_param=bytes_per_param)


def mesh_shapes(chips: int) -> tuple[tuple[int, int], ...]:
  """Every 2D mesh shape (R, C) with R * C = chips and R, C >= 2, R ascending.

  1D shapes (1, P) are left out: on a 1D mesh these layouts would shard the hidden dim
  P ways and the tokens not at all, which is not how 1D tensor parallelism is run
  (model a 1D site with `GemmProblem.one_d` instead).

  Example:
    >>> mesh_shapes(16)
    ((2, 8), (4, 4), (8, 2))
    >>> mesh_shapes(7)                                   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: chips=7 has no 2D mesh shape (R * C = 7 with R, C >= 2): 7 is prime; ...
  """
  _check_chips(chips)
  shapes = tuple((r, chips // r) for r in range(2, chips // 2 + 1)
                 if chips % r == 0 and chips // r >= 2)
  if not shapes:
    why = f"{chips} is prime" if chips > 3 else f"{chips} < 4"
    suggestion = next(c for c in range(max(chips + 1, 4), 2 * chips + 5)
                      if any(c % r == 0 for r in range(2, c)))
    raise ValueError(f"chips={chips} has no 2D mesh shape (R * C = {chips} with R, C >= 2): "
                     f"{why}; use a composite chip count such as {suggestion}")
  return shapes


def paper_mesh_shapes(chips: int) -> tuple[tuple[int, int], ...]:
  """The mesh shapes the original autotuner searches: (4, P/4), (8, P/8), ... while both
  sides are at least 4 (rows doubling); `mesh_shapes(chips)` when there are none.

  Example:
    >>> paper_mesh_shapes(256), paper_mesh_shapes(32)
    (((4, 64), (8, 32), (16, 16), (32, 8), (64, 4)), ((4, 8), (8, 4)))
  """
  _check_chips(chips)
  shapes, rows = [], 4
  while chips % rows == 0 and chips // rows >= 4:
    shapes.append((rows, chips // rows))
    rows *= 2
  return tuple(shapes) or mesh_shapes(chips)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LayerChoice:
  """The autotuner's pick for one transformer GEMM, with its perfect-overlap bound.

  Attributes:
    layout: the layer's weight layout ("os" / "ls", see LAYOUTS).
    memory: bytes of output and communication buffers of the chosen plan.
    baseline_memory: the same for the collective algorithm (what it would need).

  Example:
    >>> r = evaluate_mesh("gpt3", 16, (4, 4), "tpu-v4", check_memory=False)
    >>> lc = r.layers[0]
    >>> lc.label, lc.choice.dataflow, lc.bound.total_s <= lc.choice.cost.total_s
    ('qkv/forward', 'os', True)
  """

  layer: str
  phase: str
  problem: GemmProblem
  choice: Choice
  bound: Cost
  layout: str = "os"
  memory: float = 0.0
  baseline_memory: float = 0.0

  @property
  def label(self) -> str:
    return f"{self.layer}/{self.phase}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshResult:
  """One mesh shape: per-GEMM choices and their sums for one transformer layer.

  `reason` is "" when the shape can run every GEMM (and, when memory is checked, fits);
  otherwise it says why not and the costs are zero. `memory` is the per-chip memory
  estimate (None when not checked). `axes` says where each mesh axis lies on the
  network (topology-derived bandwidths; empty when the profile dims were used), and
  `profile` is the profile the shape was predicted with (topology applied), for
  re-deriving its schedules. `baseline_reason` says why the collective
  algorithm could not run this shape ("" when it can), e.g. its buffers do not fit.

  Example:
    >>> r = evaluate_mesh(model_spec("custom", heads=3, head_dim=16, seq=128), 64, (2, 32),
    ...                   "tpu-v4")
    >>> r.feasible, r.reason.split(":")[0]
    (False, 'qkv')
  """

  shape: tuple[int, int]
  layers: tuple[LayerChoice, ...] = ()
  cost: Cost = Cost()
  baseline: Cost = Cost()
  bound: Cost = Cost()
  reason: str = ""
  memory: MemoryEstimate | None = None
  baseline_reason: str = ""
  axes: tuple[str, ...] = ()
  profile: HardwareProfile | None = None

  @property
  def feasible(self) -> bool:
    return not self.reason

  @property
  def layouts(self) -> dict:
    """Layer -> chosen weight layout."""
    return {lc.layer: lc.layout for lc in self.layers}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshRecommendation:
  """`recommend_mesh`'s answer: every mesh shape evaluated, and the best one.

  Costs are per transformer layer (forward + backward of its 12 FF GEMMs); multiply
  by `model.layers` for a training step. `runner_up` is the second-fastest feasible
  shape (None if there is none) and `margin` its relative extra time over the best
  (runner-up / best - 1); `near_tie` when the margin is below NEAR_TIE.

  Example:
    >>> rec = recommend_mesh(16, model="custom", heads=8, head_dim=64, seq=256)
    >>> rec.best_shape, rec.to_dict()["best_shape"]
    ((4, 4), [4, 4])
  """

  chips: int
  model: ModelSpec
  batch: int
  dtype_bytes: int
  profile: str
  algorithms: tuple[str, ...]
  max_ksplit: int
  results: tuple[MeshResult, ...]
  best: MeshResult
  dataflow_policy: str = "model"
  assume: str = "ours"

  @property
  def best_shape(self) -> tuple[int, int]:
    return self.best.shape

  @property
  def runner_up(self) -> MeshResult | None:
    others = [r for r in self.results if r.feasible and r is not self.best]
    return min(others, key=lambda r: r.cost.total_s) if others else None

  @property
  def margin(self) -> float | None:
    r = self.runner_up
    if r is None or not self.best.cost.total_s:
      return None
    return r.cost.total_s / self.best.cost.total_s - 1

  @property
  def near_tie(self) -> bool:
    return self.margin is not None and self.margin < NEAR_TIE

  def to_dict(self) -> dict:
    """Plain JSON-able data (seconds for every cost, bytes for memory), deterministic."""
    def cost(c):
      return dataclasses.asdict(c)

    def result(r):
      return {"shape": list(r.shape), "feasible": r.feasible, "reason": r.reason,
              "baseline_reason": r.baseline_reason,
              "cost": cost(r.cost), "baseline": cost(r.baseline), "bound": cost(r.bound),
              "memory": None if r.memory is None else dataclasses.asdict(r.memory),
              "axes": list(r.axes),
              "layers": [{"layer": lc.layer, "phase": lc.phase, "layout": lc.layout,
                          "problem": dataclasses.asdict(lc.problem),
                          "algorithm": lc.choice.algorithm, "dataflow": lc.choice.dataflow,
                          "ksplit": lc.choice.ksplit, "options": dict(lc.choice.options),
                          "cost": cost(lc.choice.cost), "memory": lc.memory,
                          "baseline_memory": lc.baseline_memory,
                          "baseline": cost(lc.choice.baseline), "bound": cost(lc.bound)}
                         for lc in r.layers]}
    runner = self.runner_up
    return {"chips": self.chips, "model": dataclasses.asdict(self.model),
            "batch": self.batch, "dtype_bytes": self.dtype_bytes, "profile": self.profile,
            "algorithms": list(self.algorithms), "max_ksplit": self.max_ksplit,
            "dataflow_policy": self.dataflow_policy, "assume": self.assume,
            "best_shape": list(self.best_shape),
            "runner_up": None if runner is None else list(runner.shape),
            "margin": self.margin, "results": [result(r) for r in self.results]}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _check_policy(policy):
  if policy not in DATAFLOW_POLICIES:
    raise ValueError(f"dataflow_policy must be one of {DATAFLOW_POLICIES}, got {policy!r}")


def evaluate_mesh(model: str | ModelSpec, chips: int, mesh_shape: tuple[int, int],
                  profile: HardwareProfile | str, *, batch: int | None = None,
                  dtype_bytes: int = 2, algorithms=EMITTABLE, max_ksplit: int = 16,
                  min_block: int = 1, dataflow_policy: str = "model",
                  check_memory: bool = True, memory_layers: int | None = None,
                  topology: bool = True) -> MeshResult:
  """Autotune every FF GEMM of one transformer layer on one mesh shape.

  Each FF layer gets a weight layout (LAYOUTS; `dataflow_policy`: "model" tries every
  layout and keeps the one whose three GEMMs are predicted fastest, "paper" applies the
  original autotuner's rule `paper_layout`, "os" keeps the forward matmul output-
  stationary); the layout fixes the dataflow of each GEMM and the autotuner picks
  algorithm and ksplit per GEMM.

  Memory (`check_memory`, when the profile has an hbm_capacity): `transformer_memory`
  for `memory_layers` layers (default all of the model's) plus each GEMM plan's buffers
  (`memory.site_memory`) must fit the chip; plans that do not fit are skipped, and a
  shape on which some GEMM has no plan that fits is infeasible, with the reason.

  The bound sums, per layer, the smallest over the allowed layouts of its three GEMMs'
  perfect-overlap bounds (for the candidate `algorithms`).

  topology: when the profile describes its network, the row / column axes get the
  bandwidths `topology.profile_for_mesh` derives for this shape (how create_device_mesh
  lays the axes on the torus or the nodes); otherwise profile dims 0 / 1 as given.

  Example:
    >>> r = evaluate_mesh("gpt3", 16, (4, 4), "tpu-v4", check_memory=False)
    >>> len(r.layers), r.cost.total_s < r.baseline.total_s
    (12, True)
  """
  profile = load_profile(profile)
  _check_policy(dataflow_policy)
  spec = model_spec(model)
  shape = tuple(mesh_shape)
  batch = chips if batch is None else batch
  axes = ()
  if topology and profile.topology is not None:
    try:
      axes = describe_axes(profile, shape)
      profile = profile_for_mesh(profile, shape)
    except ValueError as e:
      return MeshResult(shape=shape, reason=f"topology: {e}")
  memory = None
  budget = None
  if check_memory and profile.hbm_capacity:
    memory = transformer_memory(spec, chips, profile, batch=batch, dtype_bytes=dtype_bytes,
                                memory_layers=memory_layers)
    budget = memory.free_for_gemm
    if budget <= 0:
      return MeshResult(shape=shape, memory=memory, axes=axes,
                        reason=f"memory: {memory.describe()} leaves nothing for the GEMMs")
  per_layout = {lay: transformer_problems(spec, chips, shape, batch=batch,
                                          dtype_bytes=dtype_bytes, layouts=lay)
                for lay in LAYOUTS}
  layers, bound, baseline_reasons = [], Cost(), []
  for index, (name, d_in, d_out) in enumerate(FF_LAYERS):
    if dataflow_policy == "model":
      options = tuple(LAYOUTS)
    elif dataflow_policy == "paper":
      options = (paper_layout(d_in, d_out),)
    else:
      options = ("os",)
    best, failures, bounds = None, [], []
    for lay in options:
      picks = []
      for lp in per_layout[lay][3 * index:3 * index + 3]:
        try:
          choice = best_plan(lp.problem, profile, dataflows=(lp.dataflow,),
                             algorithms=algorithms, max_ksplit=max_ksplit,
                             min_block=min_block, memory_budget=budget)
        except ValueError as e:
          failures.append(f"{lp.label} ({lay} layout): {e}")
          break
        base_need = (site_memory(lp.problem, "collective", lp.dataflow, 1)
                     if not why_invalid(lp.problem, "collective", lp.dataflow, 1) else 0.0)
        picks.append(LayerChoice(
            layer=lp.layer, phase=lp.phase, problem=lp.problem, choice=choice, layout=lay,
            bound=lower_bound(lp.problem, profile, lp.dataflow, algorithms),
            memory=site_memory(lp.problem, choice.algorithm, choice.dataflow, choice.ksplit,
                               **dict(choice.options)),
            baseline_memory=base_need))
      else:
        total = sum(pc.choice.cost.total_s for pc in picks)
        bounds.append(sum((pc.bound for pc in picks), Cost()))
        if best is None or total < best[0]:   # ties keep the earlier layout (os)
          best = (total, picks)
    if best is None:
      return MeshResult(shape=shape, memory=memory, axes=axes,
                        reason=f"{name}: " + "; ".join(failures))
    layers += best[1]
    bound = bound + min(bounds, key=lambda c: c.total_s)
  if budget is not None:
    memory = dataclasses.replace(memory, gemm=max(lc.memory for lc in layers))
    for lc in layers:
      if lc.baseline_memory > budget:
        baseline_reasons.append(f"{lc.label}: the collective algorithm needs "
                                f"{_gib(lc.baseline_memory)} of buffers, "
                                f"{_gib(budget)} free")
  return MeshResult(shape=shape, layers=tuple(layers),
                    cost=sum((lc.choice.cost for lc in layers), Cost()),
                    baseline=sum((lc.choice.baseline for lc in layers), Cost()),
                    bound=bound, memory=memory, baseline_reason="; ".join(baseline_reasons),
                    axes=axes, profile=profile)


ASSUMPTIONS = ("ours", "paper")


def paper_assumptions(profile: HardwareProfile | str = "tpu-v4") -> HardwareProfile:
  """The original MeshSlice autotuner's assumptions on top of `profile` (its collective
  numbers are kept, on fixed profile dims 0 / 1): matmuls at 2.66e14 FLOP/s (the constant
  the original passes to its mesh) at full efficiency, no HBM roofline, no per-op
  overhead, no memory limit, no topology, gathers on the two axes side by side. Use
  with dataflow_policy="paper". Only TPU v4 was calibrated by the original authors.

  Example:
    >>> p = paper_assumptions()
    >>> p.peak_flops, p.gemm.max_efficiency, p.hbm_bandwidth, p.hbm_capacity
    (266000000000000.0, 1.0, 0.0, 0.0)
  """
  profile = load_profile(profile)
  if profile.name != "tpu-v4":
    raise ValueError(f"the paper's assumptions exist for tpu-v4 only (its authors "
                     f"calibrated TPU v4), got profile {profile.name!r}")
  return dataclasses.replace(
      profile, name="tpu-v4-paper", peak_flops=2.66e14,
      gemm=dataclasses.replace(profile.gemm, max_efficiency=1.0),
      hbm_bandwidth=0.0, hbm_capacity=0.0, op_overhead=0.0, topology=None,
      serial_collectives=False,
      description="tpu-v4 with the original MeshSlice autotuner's assumptions")


def recommend_mesh(chips: int, *, model: str | ModelSpec = "gpt3",
                   profile: HardwareProfile | str = "tpu-v4", batch: int | None = None,
                   seq: int | None = None, heads: int | None = None,
                   head_dim: int | None = None, layers: int | None = None,
                   dtype_bytes: int = 2, algorithms=EMITTABLE, max_ksplit: int = 16,
                   min_block: int = 1, dataflow_policy: str | None = None,
                   check_memory: bool = True, memory_layers: int | None = None,
                   assume: str = "ours", topology: bool = True) -> MeshRecommendation:
  """Evaluate every 2D mesh shape of `chips` (see `mesh_shapes`) for the FF GEMMs of
  `model` and pick the fastest feasible one (ties: the smaller R).

  assume: "ours" (the profile as given; dataflow_policy default "model"; every shape of
  `mesh_shapes`) or "paper" (`paper_assumptions(profile)`, dataflow_policy default
  "paper", memory not checked, the original's shapes `paper_mesh_shapes`).
  See `evaluate_mesh` for dataflow_policy, check_memory, memory_layers and topology.

  Raises:
    ValueError: chips not a positive int or with no 2D mesh shape; bad model or
      arguments; or no shape can run every GEMM (the reasons are listed).

  Example:
    >>> rec = recommend_mesh(16, model="custom", heads=8, head_dim=64, seq=256)
    >>> [r.shape for r in rec.results], rec.best_shape
    ([(2, 8), (4, 4), (8, 2)], (4, 4))
  """
  if assume not in ASSUMPTIONS:
    raise ValueError(f"assume must be one of {ASSUMPTIONS}, got {assume!r}")
  spec = model_spec(model, heads=heads, head_dim=head_dim, seq=seq, layers=layers)
  shapes = mesh_shapes(chips)
  profile = load_profile(profile)
  if assume == "paper":
    shapes = paper_mesh_shapes(chips)
    profile = paper_assumptions(profile)
    dataflow_policy = dataflow_policy or "paper"
  dataflow_policy = dataflow_policy or "model"
  _check_policy(dataflow_policy)
  algorithms = _check_choices(algorithms, ALGORITHMS, "algorithms")
  batch = chips if batch is None else batch
  results = tuple(evaluate_mesh(spec, chips, shape, profile, batch=batch,
                                dtype_bytes=dtype_bytes, algorithms=algorithms,
                                max_ksplit=max_ksplit, min_block=min_block,
                                dataflow_policy=dataflow_policy, check_memory=check_memory,
                                memory_layers=memory_layers, topology=topology)
                  for shape in shapes)
  feasible = [r for r in results if r.feasible]
  if not feasible:
    raise ValueError(f"no mesh shape of {chips} chips can run every FF GEMM of "
                     f"{spec.name} with algorithms {algorithms}: "
                     + "; ".join(f"{r.shape}: {r.reason}" for r in results))
  best = min(feasible, key=lambda r: r.cost.total_s)   # min keeps the first of equals
  return MeshRecommendation(chips=chips, model=spec, batch=batch, dtype_bytes=dtype_bytes,
                            profile=profile.name, algorithms=algorithms,
                            max_ksplit=max_ksplit, results=results, best=best,
                            dataflow_policy=dataflow_policy, assume=assume)


# ----------------------------------------------------------------------------- end to end

def other_layer_time(model: str | ModelSpec, chips: int, profile: HardwareProfile | str, *,
                     batch: int | None = None, dtype_bytes: int = 2) -> Cost:
  """Predicted time per chip of the rest of one transformer layer's training step (all
  but the 12 FF GEMMs), forward + backward, with heads and tokens split over all chips
  and no communication (the 2D layout keeps attention local to its head / token shard):

    attention core   flops = 3 * 4 * batch * seq^2 * H / chips   (Q.K^T and P.V, forward
                     once, backward twice) at peak * max_efficiency
    elementwise      bytes = 3 * (36 * T * H + 4 * batch * heads * seq^2) * dtype_bytes / 2
                     / chips at hbm_bandwidth (layer norms, GELU, residual adds, softmax;
                     each pass reads and writes its tensor; backward twice forward)

  A rough estimate, meant for turning FF-GEMM gains into end-to-end ones; 0 for the
  elementwise part when the profile has no HBM bandwidth.

  Example:
    >>> c = other_layer_time("gpt3", 256, "tpu-v4")
    >>> round(c.compute_s * 1e3, 2), c.comm_s
    (8.74, 0.0)
  """
  spec = model_spec(model)
  profile = load_profile(profile)
  _check_chips(chips)
  batch = chips if batch is None else batch
  h, s = spec.hidden, spec.seq
  tokens = batch * s
  flops = 3 * 4 * batch * s * s * h / chips
  attention = flops / (profile.peak_flops * profile.gemm.max_efficiency)
  elementwise = 0.0
  if profile.hbm_bandwidth > 0:
    moved = 3 * (36 * tokens * h + 4 * batch * spec.heads * s * s) * dtype_bytes / 2 / chips
    elementwise = moved / profile.hbm_bandwidth
  t = attention + elementwise
  return Cost(compute_s=t, comm_s=0.0, exposed_comm_s=0.0, total_s=t)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
  """One algorithm at its own best mesh shape (see `compare_algorithms`).

  Attributes:
    algorithm: the only candidate the autotuner had (besides nothing: "collective" is
      not added, so each baseline is its own algorithm everywhere).
    shape: its best mesh shape, or None when no shape can run it.
    ff_s: predicted FF-GEMM seconds per layer (forward + backward).
    other_s: the rest of the layer (`other_layer_time`), the same for every algorithm.
    reason: why no shape can run it ("" otherwise).
  """

  algorithm: str
  shape: tuple[int, int] | None
  ff_s: float
  other_s: float
  reason: str = ""

  @property
  def layer_s(self) -> float:
    return self.ff_s + self.other_s


def compare_algorithms(chips: int, *, model: str | ModelSpec = "gpt3",
                       profile: HardwareProfile | str = "tpu-v4",
                       algorithms=("collective", "wang", "summa", "cannon", "meshslice"),
                       **options) -> tuple[Comparison, ...]:
  """Each algorithm alone, at its own best mesh shape (`recommend_mesh` with
  algorithms=(algorithm,) and `options`), with the end-to-end time of a layer.

  Example:
    >>> rows = compare_algorithms(64, model="gpt3", check_memory=False)
    >>> [r.algorithm for r in rows], rows[-1].ff_s < rows[0].ff_s
    (['collective', 'wang', 'summa', 'cannon', 'meshslice'], True)
  """
  out = []
  assume = options.get("assume", "ours")
  base = load_profile(profile)
  other_profile = paper_assumptions(base) if assume == "paper" else base
  for algorithm in algorithms:
    try:
      rec = recommend_mesh(chips, model=model, profile=base, algorithms=(algorithm,),
                           **options)
    except ValueError as e:
      out.append(Comparison(algorithm=algorithm, shape=None, ff_s=0.0, other_s=0.0,
                            reason=str(e)))
      continue
    other = other_layer_time(rec.model, chips, other_profile, batch=rec.batch,
                             dtype_bytes=rec.dtype_bytes).total_s
    out.append(Comparison(algorithm=algorithm, shape=rec.best_shape,
                          ff_s=rec.best.cost.total_s, other_s=other))
  return tuple(out)
