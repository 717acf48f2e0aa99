"""The bridge from a planned site to the cost model: describe it as a `GemmProblem`,
predict candidate plans (re-priced with the profile's TPU compiler terms when it has
them, `meshslice.costmodel.xla_baseline`), predict XLA's own program for the site, pick
the fastest deterministically.

Only the site's shapes, dtypes and mesh sizes enter, so the choice is a pure function of
(program, mesh shape, options, profile): no timing, no host state.
"""
from __future__ import annotations

import math
import typing

import jax.numpy as jnp

from meshslice import costmodel
from meshslice.costmodel import xla_baseline
from meshslice.costmodel.timing import copy_time, permute_time

# Candidates tried in this order; a later one must be strictly faster to win, so ties go
# to the simpler algorithm and the smaller ksplit.
AUTO_ALGORITHMS = ("collective", "meshslice")

# A runner-up predicted within this fraction of the chosen plan is reported as a near tie.
NEAR_TIE = costmodel.autotune.NEAR_TIE


def model_dataflow(dataflow: str) -> str:
  """The cost model predicts 1D sites as the 2D formulas with one axis of size 1 ("rs"),
  with M standing for whichever free dim the site communicates (see `problem_for`)."""
  return "rs" if dataflow.startswith("1d") else dataflow


def site_profile(profile, geometry, axis_sizes, devices=None):
  """`profile` with its dim 0 / dim 1 derived for this site's mesh axes (row, col; or the
  one axis of a 1D site) from the profile's topology and the mesh's device order. A
  profile without a topology, or a mesh bigger than its network, comes back unchanged.

  devices: the concrete mesh's device grid (`Mesh.devices`), or None (an AbstractMesh).
  With it, a mesh axis whose devices lie on several TPU slices (their `slice_index`)
  gets the data-centre network's figures (`costmodel.topology.profile_for_devices`).

  Example:
    >>> from meshslice.costmodel import load_profile
    >>> from meshslice.rewrites import OneDGeometry
    >>> g = OneDGeometry(dimension_numbers=(((1,), (0,)), ((), ())), kind="all_gather",
    ...                  axis="y", axis_size=8, lhs_dim=0, rhs_dim=None, out_dim=0,
    ...                  global_extent=64)
    >>> site_profile(load_profile("tpu-v4"), g, {"x": 32, "y": 8}).name
    'tpu-v4@32x8'
  """
  if getattr(profile, "topology", None) is None or len(axis_sizes) < 2:
    return profile
  order = list(axis_sizes)
  axes = ((geometry.axis,) * 2 if _one_d(geometry) else (geometry.row_axis, geometry.col_axis))
  if any(a is None for a in axes):     # OS with one axis absent: both dims are that axis
    axes = (next(a for a in axes if a is not None),) * 2
  axes = tuple(order.index(a) for a in axes)
  try:
    if devices is not None:
      return costmodel.topology.profile_for_devices(profile, devices, axes=axes)
    return costmodel.profile_for_mesh(profile, tuple(axis_sizes.values()), axes=axes)
  except ValueError:
    return profile


def _one_d(geometry) -> bool:
  return not hasattr(geometry, "row_axis")


def problem_for(geometry, lhs_shape, rhs_shape, lhs_spec, rhs_spec, lhs_dtype, out_dtype,
                axis_sizes, profile=None) -> costmodel.GemmProblem:
  """The site as the cost model sees it. Dims split over extra mesh axes (data, fsdp)
  shrink the per-device problem without any communication, so they divide the sizes."""
  (lc, rc), (lb, rb) = geometry.dimension_numbers
  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  one_d = _one_d(geometry)
  tp = {geometry.axis} if one_d else {geometry.row_axis, geometry.col_axis}

  def size(shape, spec, dims):
    total = 1
    for d in dims:
      extra = math.prod(axis_sizes[a] for a in spec[d] if a not in tp)
      total *= shape[d] // extra
    return total

  sizes = dict(m=size(lhs_shape, lhs_spec, lf), n=size(rhs_shape, rhs_spec, rf),
               k=size(lhs_shape, lhs_spec, lc), batch=size(lhs_shape, lhs_spec, lb),
               in_bytes=jnp.dtype(lhs_dtype).itemsize, out_bytes=jnp.dtype(out_dtype).itemsize)
  mesh_order = list(axis_sizes)
  # a profile from `site_profile` already has dim 0 = row axis, dim 1 = col axis
  derived = getattr(profile, "topology", None) is not None and len(axis_sizes) >= 2
  if one_d:
    # The 1D model communicates M ("rs" with one axis of size 1). When the emitted code
    # moves an rhs free dim instead (a gathered weight, partial sums scattered along N),
    # the same product with M and N exchanged is the one that is emitted.
    if _moves_rhs_free_dim(geometry, len(lb), len(lf)):
      sizes["m"], sizes["n"] = sizes["n"], sizes["m"]
    # an all-reduce site psums its partial sums: both halves of the all-reduce are priced
    collective = "all_reduce" if getattr(geometry, "all_reduce", False) else geometry.kind
    return costmodel.GemmProblem.one_d(
        size=geometry.axis_size, collective=collective,
        profile_dim=0 if derived else min(mesh_order.index(geometry.axis), 1), **sizes)
  position = lambda axis: mesh_order.index(axis) if axis in mesh_order else len(mesh_order)
  row_first = derived or position(geometry.row_axis) < position(geometry.col_axis)
  return costmodel.GemmProblem(
      rows=geometry.row_size, cols=geometry.col_size,
      row_profile_dim=0 if row_first else 1, col_profile_dim=1 if row_first else 0, **sizes)


def _moves_rhs_free_dim(geometry, n_batch, n_lhs_free) -> bool:
  if geometry.kind == "all_gather":
    return geometry.lhs_dim is None
  return geometry.out_dim >= n_batch + n_lhs_free


def reshard_seconds(shape, dtype, new_spec, axis_sizes, profile) -> float:
  """Predicted time to reshard an operand into `new_spec` before a site, priced
  conservatively: a reshard that swaps which axis splits which dim is an all-to-all over
  the whole mesh, so every device's shard crosses both mesh dims, and is packed and
  unpacked in memory on the way (the TPU compiler emits relayout copies for it)."""
  devices = math.prod(axis_sizes[a] for entry in new_spec for a in entry)
  nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize / devices
  return (sum(permute_time(profile, dim, nbytes) for dim in (0, 1))
          + 2 * copy_time(profile, nbytes))


def predict(problem, profile, algorithm, dataflow, ksplit, terms=None,
            offloaded=frozenset(), forward=False) -> float:
  """Predicted seconds of a candidate plan: the analytic model, re-priced with the
  compiler terms when given (`xla_baseline.compiled_seconds`). With collectives
  offloaded to the SparseCore (`offloaded`, v5p / v6e: `backend_flags.sparse_core_offload`)
  the collective and meshslice algorithms, whose collectives libtpu offloads as it does
  XLA's, are priced at their overlap limit, or for a forward-pass site (`forward`) with
  its activations' collectives waited on (`xla_baseline.offloaded_seconds`)."""
  if offloaded and algorithm in ("collective", "meshslice"):
    return float(xla_baseline.offloaded_seconds(problem, dataflow, profile, terms, offloaded,
                                                algorithm, ksplit, forward=forward))
  if terms is not None:
    return float(xla_baseline.compiled_seconds(problem, algorithm, dataflow, ksplit,
                                               profile, terms))
  return float(costmodel.predict(problem, algorithm, dataflow, ksplit, profile).total_s)


def xla_program(problem, profile, dataflow, baseline, terms,
                windowed_off=frozenset(), offloaded=frozenset(),
                forward=False) -> xla_baseline.XlaProgram:
  """XLA's own program for the site under `baseline` ("windowed" or "dense"). Windowed
  einsum loops an all-gather or a reduce-scatter, never an all-reduce, so an all-reduce
  site gets XLA's dense program either way; nor does it fire for a collective the
  user's libtpu flags turn it off for (`windowed_off`: a subset of {"all_gather",
  "reduce_scatter"}, `backend_flags.windowed_einsum_off`), which XLA then runs dense.
  When the flags offload collectives to the SparseCore (`offloaded`, v5p / v6e:
  `backend_flags.sparse_core_offload`), XLA's dense program runs the offloaded ones
  beside its compute (`xla_baseline.offloaded_seconds`; `forward`: a forward-pass site,
  whose activations' collectives are waited on).

  Example:
    >>> from meshslice.costmodel import GemmProblem, load_profile
    >>> p = GemmProblem(m=65536, n=8192, k=8192, rows=8, cols=8)
    >>> terms = xla_baseline.builtin_terms("tpu-v4")
    >>> xla_program(p, load_profile("tpu-v4"), "ls", "windowed", terms).windowed
    True
    >>> xla_program(p, load_profile("tpu-v4"), "ls", "windowed", terms,
    ...             windowed_off={"reduce_scatter"}).windowed
    False
  """
  if problem.reduction == "all_reduce":
    baseline = "dense"
  elif baseline == "windowed" and windowed_off:
    (kind, *_), _ = xla_baseline.windowed_movement(problem, dataflow)
    if kind in windowed_off:
      baseline = "dense"
  xla = xla_baseline.xla_seconds(problem, dataflow, profile, terms, baseline)
  if offloaded and not xla.windowed:
    seconds = xla_baseline.offloaded_seconds(problem, dataflow, profile, terms, offloaded,
                                             forward=forward)
    names = [k.replace("_", "-") + "s" for k in sorted(offloaded)]
    kinds = " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))
    return xla_baseline.XlaProgram(
        seconds=min(seconds, xla.seconds), windowed=False,
        description=f"dense program, {kinds} offloaded to the SparseCore")
  return xla


# A rewrite is emitted only when it is predicted faster than XLA's own program for the
# site (under the same flags) by more than this fraction: inside it the prediction
# cannot tell them apart, and leaving the site to XLA costs nothing (the program compiles
# as plain jit would). Larger than NEAR_TIE, the margin between two rewrites: a rewrite
# also pays what the per-site model does not see (pipeline fill and drain at site
# boundaries, barriers that stop XLA's scheduler overlapping independent work across
# sites, docs/tpu.md), which XLA's own program does not.
XLA_MARGIN = 0.05


def leave_to_xla(best_seconds, best_is_collective, xla, margin=XLA_MARGIN, *,
                 same_program=False) -> bool:
  """Whether XLA's program should run the site rather than the best rewrite: unless the
  rewrite is predicted faster than XLA's program by more than `margin` (a fraction of
  the rewrite's time: best * (1 + margin) < xla), the site is left to XLA.

  same_program: the collective rewrite compiles to the very program XLA would run for
  the site (CPU and GPU meshes: the same synchronous all-gathers, dot and
  reduce-scatter), so a tie with XLA's dense program keeps it. Not on TPU, where XLA
  schedules its own collectives under the async flags and may partition differently
  (issue 18: a MaxText-style step re-emitting such ties simulated 1.33x slower).

  Example:
    >>> from meshslice.costmodel.xla_baseline import XlaProgram
    >>> xla = XlaProgram(seconds=1.0, windowed=False, description="dense program")
    >>> leave_to_xla(0.97, False, xla), leave_to_xla(0.90, False, xla)
    (True, False)
    >>> leave_to_xla(1.0, True, xla), leave_to_xla(1.0, True, xla, same_program=True)
    (True, False)
  """
  if best_is_collective and same_program and not xla.windowed:
    return best_seconds > xla.seconds * (1 + 1e-9)
  return not best_seconds * (1 + margin) < xla.seconds


class PlanChoice(typing.NamedTuple):
  """What `choose` picked: the plan, its predicted seconds and a note. When no candidate
  fits the chip's memory, algorithm, ksplit and seconds are None and note says why
  ("no plan fits HBM: ...")."""

  algorithm: str | None
  ksplit: int | None
  seconds: float | None
  note: str


# The old name, kept for importers; PlanChoice tells it apart from costmodel.autotune.Choice.
Choice = PlanChoice


# Prefix of the reason a site is left alone with when none of its plans fits HBM.
NO_PLAN_FITS = "no plan fits HBM"


def choose(problem, profile, dataflow, *, algorithms, ksplits, terms=None,
           offloaded=frozenset(), forward=False) -> PlanChoice:
  """Among the candidates that fit the chip's memory (`costmodel.why_too_big` with the
  profile's HBM capacity; a profile without one excludes nothing), the one with the
  fewest slices (candidate order: collective, then meshslice by ascending ksplit) whose
  predicted time is within `NEAR_TIE` of the fastest, as a `PlanChoice`. The note says when
  that overrode the fastest prediction, else names a runner-up within `NEAR_TIE` (a
  decision on a thin margin), and the candidates excluded for memory. None when no
  candidate can run the problem.

  `ksplits` are the slice counts the site's geometry can realise exactly; the cost
  model is asked only about those; `offloaded` and `forward` are `predict`'s.

  Example:
    >>> from meshslice.costmodel import GemmProblem, load_profile
    >>> p = GemmProblem(m=524288, n=81920, k=20480, rows=2, cols=128)   # 40 GiB unsliced
    >>> pick = choose(p, load_profile("tpu-v4"), "ls", algorithms=AUTO_ALGORITHMS,
    ...               ksplits=(1, 2, 4, 16))
    >>> pick.algorithm, pick.ksplit      # S=16 is predicted 0.0% faster: inside the error
    ('meshslice', 4)
    >>> pick.note.split("; ")[-1]                       # doctest: +NORMALIZE_WHITESPACE
    'excluded for memory: collective S=1 needs 40.4 GiB per chip (input shards 92.5 MiB,
     output and buffers 40.3 GiB), 32.0 GiB free of 32.0 GiB HBM (+1 more)'
  """
  # meshslice with one slice emits the collective algorithm: not a different plan
  same = lambda a, k: ("collective", 1) if a == "meshslice" and k == 1 else (a, k)
  ranked, too_big = [], {}
  for algorithm in algorithms:
    for ksplit in ((1,) if algorithm == "collective" else ksplits):
      if costmodel.why_invalid(problem, algorithm, dataflow, ksplit):
        continue
      why = costmodel.why_too_big(problem, algorithm, dataflow, ksplit, profile)
      if why:
        too_big.setdefault(same(algorithm, ksplit), why)
        continue
      ranked.append((predict(problem, profile, algorithm, dataflow, ksplit, terms, offloaded,
                             forward), len(ranked), algorithm, ksplit))
  if not ranked and too_big:
    # the plan nearest to fitting says how far off the site is
    (algorithm, ksplit), why = min(too_big.items(), key=lambda item: costmodel.site_peak_bytes(
        problem, item[0][0], dataflow, item[0][1]))
    return PlanChoice(None, None, None, f"{NO_PLAN_FITS}: {algorithm} S={ksplit} {why}")
  if not ranked:
    return None
  ranked.sort()   # ties keep candidate order: the simpler algorithm, the smaller ksplit
  fastest = ranked[0]
  # Inside the model's error the simplest candidate wins (candidate order: collective,
  # then fewer slices). Every extra slice costs the compiled program more than the model
  # prices (cutting lane-dim slices, float32 partial-sum passes, thinner dots; measured
  # on the TPU compiler, docs/tpu.md), so a predicted gain this small is not one.
  simplest = min((r for r in ranked if r[0] <= fastest[0] * (1 + NEAR_TIE)),
                 key=lambda r: r[1])
  best, _, algorithm, ksplit = simplest
  rest = [r for r in ranked if same(r[2], r[3]) != same(algorithm, ksplit)]
  notes = []
  if simplest is not fastest:
    notes.append(f"fewer slices than {fastest[2]} S={fastest[3]} (predicted "
                 f"{(best / fastest[0] - 1) * 100:.1f}% faster, within the model's "
                 f"{NEAR_TIE:.0%} error)")
  elif rest and best > 0 and rest[0][0] / best - 1 < NEAR_TIE:
    _, _, other, other_k = rest[0]
    notes.append(f"near tie: {other} S={other_k} predicted within "
                 f"{(rest[0][0] / best - 1) * 100:.1f}%")
  if too_big:
    (first, first_k), why = next(iter(too_big.items()))
    more = f" (+{len(too_big) - 1} more)" if len(too_big) > 1 else ""
    notes.append(f"excluded for memory: {first} S={first_k} {why}{more}")
  return PlanChoice(algorithm, ksplit, best, "; ".join(notes))
