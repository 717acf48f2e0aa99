"""The autotuner: the best (algorithm, dataflow, ksplit) of one site, and the best mesh
shape for the feed-forward GEMMs of a transformer.

Everything here is a deterministic function of its arguments: no timing, no
randomness, ties broken by a fixed order (ALGORITHMS order, then DATAFLOWS order, then
each algorithm's option variants, then the smaller ksplit). Every process of a
multi-host job gets the same answer.
"""
from __future__ import annotations

import dataclasses
import json

from .profiles import HardwareProfile, load_profile
from .timing import (ALGORITHMS, DATAFLOWS, Cost, GemmProblem, lower_bound, predict,
                     wang_ring_axis, why_invalid)

# What the pass can emit today (meshslice.rewrites.ALGORITHMS); the default choice set.
EMITTABLE = ("collective", "meshslice")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
  """The autotuner's pick for one site.

  Attributes:
    algorithm, dataflow, ksplit: what to emit.
    options: the algorithm's keyword options as sorted (name, value) pairs, e.g.
      (("bidirectional", True), ("ring", "row")) for wang; pass them on with
      `**dict(choice.options)` (to `predict`, `schedule` or rewrites.build_body).
    cost: its predicted Cost.
    baseline: the predicted Cost of the plain collective algorithm, same dataflow.

  Example:
    >>> p = GemmProblem(m=65536, n=12288, k=12288, rows=8, cols=8)
    >>> c = best_plan(p, "tpu-v4", dataflows=("os",))
    >>> c.algorithm, c.dataflow, c.ksplit, c.options, c.speedup > 1
    ('meshslice', 'os', 6, (), True)
  """

  algorithm: str
  dataflow: str
  ksplit: int
  options: tuple[tuple[str, object], ...] = ()
  cost: Cost
  baseline: Cost

  @property
  def speedup(self) -> float:
    """baseline time / predicted time."""
    return self.baseline.total_s / self.cost.total_s if self.cost.total_s else 1.0

  @property
  def label(self) -> str:
    """The algorithm with its options, e.g. "wang(bidirectional=True, ring=row)"."""
    if not self.options:
      return self.algorithm
    return f"{self.algorithm}({', '.join(f'{k}={v}' for k, v in self.options)})"


def _check_choices(values, allowed, name):
  values = tuple(values)
  if not values:
    raise ValueError(f"{name} must not be empty; choose from {allowed}")
  for v in values:
    if v not in allowed:
      raise ValueError(f"{name} must be drawn from {allowed}, got {v!r}")
  return values


def _check_positive(value, name):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def variants(problem: GemmProblem, algorithm: str) -> tuple[dict, ...]:
  """The option sets the autotuner tries for `algorithm`, in its fixed order.

  wang: ring over row, then col (no ring option on a 1D problem: its one real axis is
  the default), each unidirectional then bidirectional. Others: no options.

  Example:
    >>> variants(GemmProblem(m=8, n=8, k=8, rows=2, cols=2), "wang")[:2]
    ({'ring': 'row', 'bidirectional': False}, {'ring': 'row', 'bidirectional': True})
  """
  if algorithm != "wang":
    return ({},)
  rings = ("row", "col") if min(problem.rows, problem.cols) > 1 else (None,)
  return tuple({**({"ring": r} if r else {}), "bidirectional": b}
               for r in rings for b in (False, True))


def _block(problem, algorithm, dataflow, ksplit, options) -> int:
  """Elements of the communicated dim in one slice / chunk of one device's block."""
  extent = problem.extent(dataflow)
  if algorithm == "wang":
    n = problem.rows if wang_ring_axis(problem, options.get("ring")) == "row" else problem.cols
    return extent // (n * ksplit * (2 if options.get("bidirectional") else 1))
  return extent // (ksplit * problem.lcm)


def valid_ksplits(problem: GemmProblem, dataflow: str, max_ksplit: int = 16,
                  min_block: int = 1, algorithm: str = "meshslice",
                  **options) -> tuple[int, ...]:
  """The ksplits <= max_ksplit that `algorithm` (with `options`) can use on `problem`
  (see `why_invalid`), keeping only those whose slices / chunks hold >= min_block
  elements of the communicated dim (ksplit = 1 is always kept when valid). For
  meshslice: S * lcm(R, C) divides the extent and B = extent / (S * lcm(R, C)).

  Example:
    >>> p = GemmProblem(m=64, n=64, k=96, rows=2, cols=4)
    >>> valid_ksplits(p, "os", 16)
    (1, 2, 3, 4, 6, 8, 12)
    >>> valid_ksplits(p, "os", 16, algorithm="wang", ring="col", bidirectional=True)
    (1, 2, 3, 4, 6, 12)
  """
  _check_positive(max_ksplit, "max_ksplit")
  _check_positive(min_block, "min_block")
  return tuple(s for s in range(1, max_ksplit + 1)
               if not why_invalid(problem, algorithm, dataflow, s, **options)
               and (s == 1 or _block(problem, algorithm, dataflow, s, options) >= min_block))


def best_plan(problem: GemmProblem, profile: HardwareProfile | str, *,
              dataflows=DATAFLOWS, algorithms=EMITTABLE, max_ksplit: int = 16,
              min_block: int = 1) -> Choice:
  """The fastest predicted (algorithm, dataflow, ksplit, options) for `problem`.

  Args:
    dataflows: the dataflows the site's layouts allow (a transformer's forward matmul
      is "os", backward-data "ls", backward-weight "rs").
    algorithms: candidates, by name; default what the pass emitted when this was
      written (collective, meshslice). Each algorithm tries its `variants` and every
      `valid_ksplits` value.
    max_ksplit, min_block: bounds on slicing (see `valid_ksplits`).

  Candidates are tried in a fixed order (ALGORITHMS, DATAFLOWS, variants, ksplit
  ascending) and only a strictly faster one replaces the best so far, so ties go to the
  earlier: collective before meshslice with S = 1 (the same program), smaller ksplit
  before larger.

  Raises:
    ValueError: bad arguments, or no candidate can run the problem (the message says
      why each could not).

  Example:
    >>> tiny = GemmProblem(m=64, n=64, k=64, rows=2, cols=2)   # compute is negligible
    >>> c = best_plan(tiny, "tpu-v4", dataflows=("os",))
    >>> c.algorithm, c.ksplit
    ('collective', 1)
  """
  profile = load_profile(profile)
  dataflows = _check_choices(dataflows, DATAFLOWS, "dataflows")
  algorithms = _check_choices(algorithms, ALGORITHMS, "algorithms")
  _check_positive(max_ksplit, "max_ksplit")
  _check_positive(min_block, "min_block")
  best, reasons = None, {}
  for algorithm in (a for a in ALGORITHMS if a in algorithms):
    for dataflow in (d for d in DATAFLOWS if d in dataflows):
      for options in variants(problem, algorithm):
        ksplits = valid_ksplits(problem, dataflow, max_ksplit, min_block, algorithm,
                                **options)
        if not ksplits:
          reason = why_invalid(problem, algorithm, dataflow, 1, **options)
          reasons.setdefault(f"{algorithm}/{dataflow}: {reason}", None)
        for ksplit in ksplits:
          cost = predict(problem, algorithm, dataflow, ksplit, profile, **options)
          if best is None or cost.total_s < best.cost.total_s:
            best = Choice(algorithm=algorithm, dataflow=dataflow, ksplit=ksplit,
                          options=tuple(sorted(options.items())), cost=cost, baseline=cost)
  if best is None:
    raise ValueError(f"no candidate can run {problem}: " + "; ".join(reasons))
  baseline = predict(problem, "collective", best.dataflow, 1, profile)
  return dataclasses.replace(best, baseline=baseline)


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


# The paper's workloads (DESIGN.md section 5): GPT-3 175B and Megatron-Turing NLG 530B.
MODELS = {
    "gpt3": ModelSpec(name="gpt3", heads=96, head_dim=128, seq=2048, layers=96),
    "megatron": ModelSpec(name="megatron", heads=160, head_dim=128, seq=2048, layers=105),
}

# (name, input width, output width) in multiples of the hidden size H.
FF_LAYERS = (("qkv", 1, 3), ("attn_out", 1, 1), ("mlp_up", 1, 4), ("mlp_down", 4, 1))

# With activations [tokens:r, hidden:c] and weights [in:r, out:c] (DESIGN.md section 4).
PHASES = (("forward", "os"), ("backward_data", "ls"), ("backward_weight", "rs"))


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
  """One GEMM of a transformer layer: which layer, which phase, its dataflow, its shape.

  Example:
    >>> transformer_problems("gpt3", 16, (4, 4))[-1].label
    'mlp_down/backward_weight'
  """

  layer: str
  phase: str
  dataflow: str
  problem: GemmProblem

  @property
  def label(self) -> str:
    return f"{self.layer}/{self.phase}"


def _check_chips(chips):
  if isinstance(chips, bool) or not isinstance(chips, int) or chips < 1:
    raise ValueError(f"chips must be a positive int, got {chips!r}")


def transformer_problems(model: str | ModelSpec, chips: int, mesh_shape: tuple[int, int], *,
                         batch: int | None = None, seq: int | None = None,
                         heads: int | None = None, head_dim: int | None = None,
                         dtype_bytes: int = 2) -> tuple[LayerProblem, ...]:
  """The 12 feed-forward GEMMs of one transformer layer, forward and backward.

  For each of QKV (H -> 3H), attention-out (H -> H), MLP-up (H -> 4H) and MLP-down
  (4H -> H), with T = batch * seq tokens and a layer d_in -> d_out:

    forward          Y  = X . W        m=T,    n=d_out, k=d_in    dataflow os
    backward_data    dX = dY . W^T     m=T,    n=d_in,  k=d_out   dataflow ls
    backward_weight  dW = X^T . dY     m=d_in, n=d_out, k=T       dataflow rs

  `batch` defaults to `chips` (one sequence per chip, as in the paper). The mesh's row
  axis uses profile dim 0 and its column axis profile dim 1.

  Example:
    >>> ps = transformer_problems("gpt3", 16, (4, 4))
    >>> len(ps), ps[0].label, ps[0].problem.m, ps[0].problem.n, ps[0].problem.k
    (12, 'qkv/forward', 32768, 36864, 12288)
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
  rows, cols = mesh_shape
  tokens, hidden = batch * spec.seq, spec.hidden
  out = []
  for layer, d_in, d_out in FF_LAYERS:
    d_in, d_out = d_in * hidden, d_out * hidden
    shapes = {"os": (tokens, d_out, d_in), "ls": (tokens, d_in, d_out),
              "rs": (d_in, d_out, tokens)}
    for phase, dataflow in PHASES:
      m, n, k = shapes[dataflow]
      out.append(LayerProblem(layer=layer, phase=phase, dataflow=dataflow, problem=GemmProblem(
          m=m, n=n, k=k, rows=rows, cols=cols, in_bytes=dtype_bytes, out_bytes=dtype_bytes)))
  return tuple(out)


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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LayerChoice:
  """The autotuner's pick for one transformer GEMM, with its perfect-overlap bound.

  Example:
    >>> r = evaluate_mesh("gpt3", 16, (4, 4), "tpu-v4")
    >>> lc = r.layers[0]
    >>> lc.label, lc.choice.dataflow, lc.bound.total_s <= lc.choice.cost.total_s
    ('qkv/forward', 'os', True)
  """

  layer: str
  phase: str
  problem: GemmProblem
  choice: Choice
  bound: Cost

  @property
  def label(self) -> str:
    return f"{self.layer}/{self.phase}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshResult:
  """One mesh shape: per-GEMM choices and their sums for one transformer layer.

  `reason` is "" when the shape can run every GEMM; otherwise it says why not and the
  costs are zero.

  Example:
    >>> r = evaluate_mesh(model_spec("custom", heads=3, head_dim=16, seq=128), 64, (2, 32),
    ...                   "tpu-v4")
    >>> r.feasible, r.reason.split(":")[0]
    (False, 'qkv/forward')
  """

  shape: tuple[int, int]
  layers: tuple[LayerChoice, ...] = ()
  cost: Cost = Cost()
  baseline: Cost = Cost()
  bound: Cost = Cost()
  reason: str = ""

  @property
  def feasible(self) -> bool:
    return not self.reason


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshRecommendation:
  """`recommend_mesh`'s answer: every mesh shape evaluated, and the best one.

  Costs are per transformer layer (forward + backward of its 12 FF GEMMs); multiply
  by `model.layers` for a training step.

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

  @property
  def best_shape(self) -> tuple[int, int]:
    return self.best.shape

  def to_dict(self) -> dict:
    """Plain JSON-able data (seconds for every cost), deterministic."""
    def cost(c):
      return dataclasses.asdict(c)

    def result(r):
      return {"shape": list(r.shape), "feasible": r.feasible, "reason": r.reason,
              "cost": cost(r.cost), "baseline": cost(r.baseline), "bound": cost(r.bound),
              "layers": [{"layer": lc.layer, "phase": lc.phase,
                          "problem": dataclasses.asdict(lc.problem),
                          "algorithm": lc.choice.algorithm, "dataflow": lc.choice.dataflow,
                          "ksplit": lc.choice.ksplit, "options": dict(lc.choice.options),
                          "cost": cost(lc.choice.cost),
                          "baseline": cost(lc.choice.baseline), "bound": cost(lc.bound)}
                         for lc in r.layers]}
    return {"chips": self.chips, "model": dataclasses.asdict(self.model),
            "batch": self.batch, "dtype_bytes": self.dtype_bytes, "profile": self.profile,
            "algorithms": list(self.algorithms), "max_ksplit": self.max_ksplit,
            "best_shape": list(self.best_shape), "results": [result(r) for r in self.results]}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def evaluate_mesh(model: str | ModelSpec, chips: int, mesh_shape: tuple[int, int],
                  profile: HardwareProfile | str, *, batch: int | None = None,
                  dtype_bytes: int = 2, algorithms=EMITTABLE, max_ksplit: int = 16,
                  min_block: int = 1) -> MeshResult:
  """Autotune every FF GEMM of one transformer layer on one mesh shape.

  Each GEMM keeps the dataflow its layout dictates (forward os, backward-data ls,
  backward-weight rs); the autotuner picks algorithm and ksplit.

  Example:
    >>> r = evaluate_mesh("gpt3", 16, (4, 4), "tpu-v4")
    >>> len(r.layers), r.cost.total_s < r.baseline.total_s
    (12, True)
  """
  profile = load_profile(profile)
  layers = []
  for lp in transformer_problems(model, chips, mesh_shape, batch=batch,
                                 dtype_bytes=dtype_bytes):
    try:
      choice = best_plan(lp.problem, profile, dataflows=(lp.dataflow,),
                         algorithms=algorithms, max_ksplit=max_ksplit, min_block=min_block)
    except ValueError as e:
      return MeshResult(shape=tuple(mesh_shape), reason=f"{lp.label}: {e}")
    layers.append(LayerChoice(layer=lp.layer, phase=lp.phase, problem=lp.problem,
                              choice=choice, bound=lower_bound(lp.problem, profile,
                                                               lp.dataflow)))
  return MeshResult(shape=tuple(mesh_shape), layers=tuple(layers),
                    cost=sum((lc.choice.cost for lc in layers), Cost()),
                    baseline=sum((lc.choice.baseline for lc in layers), Cost()),
                    bound=sum((lc.bound for lc in layers), Cost()))


def recommend_mesh(chips: int, *, model: str | ModelSpec = "gpt3",
                   profile: HardwareProfile | str = "tpu-v4", batch: int | None = None,
                   seq: int | None = None, heads: int | None = None,
                   head_dim: int | None = None, layers: int | None = None,
                   dtype_bytes: int = 2, algorithms=EMITTABLE, max_ksplit: int = 16,
                   min_block: int = 1) -> MeshRecommendation:
  """Evaluate every 2D mesh shape of `chips` (see `mesh_shapes`) for the FF GEMMs of
  `model` and pick the fastest (ties: the smaller R).

  Raises:
    ValueError: chips not a positive int or with no 2D mesh shape; bad model or
      arguments; or no shape can run every GEMM (the reasons are listed).

  Example:
    >>> rec = recommend_mesh(16, model="custom", heads=8, head_dim=64, seq=256)
    >>> [r.shape for r in rec.results], rec.best_shape
    ([(2, 8), (4, 4), (8, 2)], (4, 4))
  """
  spec = model_spec(model, heads=heads, head_dim=head_dim, seq=seq, layers=layers)
  shapes = mesh_shapes(chips)
  profile = load_profile(profile)
  algorithms = _check_choices(algorithms, ALGORITHMS, "algorithms")
  batch = chips if batch is None else batch
  results = tuple(evaluate_mesh(spec, chips, shape, profile, batch=batch,
                                dtype_bytes=dtype_bytes, algorithms=algorithms,
                                max_ksplit=max_ksplit, min_block=min_block)
                  for shape in shapes)
  feasible = [r for r in results if r.feasible]
  if not feasible:
    raise ValueError(f"no mesh shape of {chips} chips can run every FF GEMM of "
                     f"{spec.name} with algorithms {algorithms}: "
                     + "; ".join(f"{r.shape}: {r.reason}" for r in results))
  best = min(feasible, key=lambda r: r.cost.total_s)   # min keeps the first of equals
  return MeshRecommendation(chips=chips, model=spec, batch=batch, dtype_bytes=dtype_bytes,
                            profile=profile.name, algorithms=algorithms,
                            max_ksplit=max_ksplit, results=results, best=best)
