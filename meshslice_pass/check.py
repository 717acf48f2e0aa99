"""`meshslice.check`: one call that verifies the pass on your own inputs.

    result = meshslice.check(step)(params, batch)
    print(result)            # per-output errors; on disagreement, the site responsible
    result.assert_ok()

It runs three programs on the given inputs: the original (plain `jax.jit`), the
transformed one (`meshslice.transform(step, **options)`), and, when the inputs are
concrete and small enough, an unsharded single-device reference: the same traced
program evaluated on one device with every sharding annotation dropped
(`meshslice.reference`). Plain GSPMD is itself wrong on some layouts (docs/design.md,
"Numerics"), so the reference is the judge when it ran; otherwise the transformed program
is judged against plain jit.

The verdict per output leaf (docs/guide.md, "Checking a rewrite on your own inputs"):

- floating outputs (complex ones by the modulus of the difference, so both parts count)
  agree when every element is within the tolerance of the judge: the output dtype's,
  or the rewritten matmuls' dtype's when larger (a rewrite rounds at their precision);
- error model: an output can be ill-conditioned (Adam's first step turns near-zero
  gradients into +-lr), and GSPMD itself is wrong on some layouts. Where plain jit is
  beyond tolerance of the reference, the transformed program agrees when its largest
  absolute error to the reference is at most twice plain jit's; where the reference
  itself moves by more than the tolerance when its floating inputs move by one rounding
  step of the rewritten matmuls' dtype (a second unsharded run), at most twice that
  change (each bound plus one tolerance, `tol * max|reference|`); and where plain jit
  is off, also when it is within tolerance of plain jit;
- integer, bool and PRNG-key outputs (keys by `jax.random.key_data`) agree when equal to
  the reference, or equal to plain jit where plain jit differs from it;
- with no site rewritten, the transformed program is plain jit's program: agreeing with
  plain jit is enough.

When they disagree, the rewritten sites are bisected: the program is re-transformed with
halves of them left alone until one site is found whose rewrite alone makes the outputs
differ. A site is named responsible only when the program with every site left alone
agrees, that site's rewrite alone disagrees, and plain jit is within tolerance of the
reference on an output the transformed program gets wrong.

Inputs the step donates are copied before every run: the caller's arrays survive, and
no array is passed again after a program consumed it.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._jax_internals import jit_params
from ._jax_internals import scan_counts as scan_counts   # re-exported: tests read it here
from .errors import MeshsliceError
from .nnx_jit import is_nnx_jit
from .reference import NoReference, evaluate, shorten
from .transform import Transformed, transform

if TYPE_CHECKING:
  from .planning import Site
  from .report import Report

#: Tolerance per dtype (docs/guide.md, "Numerics"): |a - b| <= tol * |b| + tol * max|b|. Complex
#: outputs use the modulus of the difference; floating dtypes not listed (fp8, ...) use
#: max(2e-2, 2 * eps); integer, bool and key outputs are compared exactly.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2,
             "complex128": 1e-9, "complex64": 1e-4}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Agreement:
  """How far one output leaf of program a is from the same leaf of program b.

  For floating and complex leaves, `ok` is the dtype tolerance test; for integer, bool
  and key leaves, `ok` is equality and `mismatched` counts the elements that differ
  (for keys, the keys whose `key_data` differs)."""
  max_abs: float
  max_rel: float          # max |a - b| / max |b|
  ok: bool
  mismatched: int | None = None

  def __str__(self) -> str:
    if self.mismatched is not None:
      return "equal" if self.ok else f"{self.mismatched} differ DIFFERS"
    return f"{self.max_abs:.2e} / {self.max_rel:.2e} {'ok' if self.ok else 'DIFFERS'}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeafCheck:
  """One output leaf: transformed vs plain, transformed vs reference, plain vs reference
  (the last two None when the reference did not run).

  `ok` is the verdict for this leaf; `judged` says which rule gave it: "reference"
  (within tolerance of / equal to the unsharded reference), "plain's distance" (within
  twice plain jit's distance to the reference, plain jit being itself beyond tolerance
  of it), "sensitivity" (within twice the reference's own change when its inputs move
  by one rounding step), "plain" (within tolerance of / equal to plain jit), or "" when
  it disagrees."""
  path: str
  shape: tuple
  dtype: str
  vs_plain: Agreement
  vs_reference: Agreement | None = None
  plain_vs_reference: Agreement | None = None
  ok: bool = False
  judged: str = ""
  tolerance: float = 0.0   # the `tol` the leaf was judged with (0: compared exactly)
  # largest change of the reference when its inputs move by one rounding step of the
  # rewritten matmuls' dtype (None when not measured)
  sensitivity: float | None = None

  @property
  def plain_off_reference(self) -> bool:
    """Plain jit itself is beyond tolerance of (or unequal to) the reference."""
    return self.plain_vs_reference is not None and not self.plain_vs_reference.ok


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
  """What `meshslice.check` found.

  Attributes:
    ok: every output leaf of the transformed program agrees (see the module docstring
      for the rules: the unsharded reference when it ran, plain jit's own distance to it
      when plain jit is itself off, else plain jit).
    leaves: per output leaf agreement, named by `jax.tree_util.keystr` paths.
    report: the pass's `Report` for these inputs.
    reference: "ran" or why the unsharded reference was skipped.
    culprit: on disagreement, the `Site` whose rewrite alone makes outputs differ (None
      when all agree, nothing was rewritten, or the evidence does not single one out).
    suspects: indices of the rewritten sites bisection narrowed the fault down to.
    note: how bisection went.
  """
  ok: bool
  leaves: tuple
  report: Report
  reference: str
  culprit: Site | None = None
  suspects: tuple = ()
  note: str = ""

  @property
  def plain_disagrees_with_reference(self) -> bool:
    return any(l.plain_off_reference for l in self.leaves)

  def assert_ok(self) -> None:
    """Raise AssertionError with the summary when the outputs disagree."""
    if not self.ok:
      raise AssertionError(str(self))

  def _plain_note(self) -> str:
    """What plain jit's own distance to the reference says, claiming a GSPMD bug only
    when the transformed program is within tolerance of the reference where plain jit
    is not (the two differ only in how the rewritten matmuls are partitioned)."""
    off = [l for l in self.leaves if l.plain_off_reference]
    if not off:
      return ""
    names = ", ".join(l.path or "<out>" for l in off[:4]) + (", ..." if len(off) > 4 else "")
    head = (f"note: plain jax.jit itself is beyond tolerance of the unsharded reference on "
            f"{len(off)} output{'s' if len(off) > 1 else ''} ({names})")
    if not self.report.rewritten:
      return head + "; no site is rewritten, so that is plain jit's own error, not the pass's"
    if all(l.vs_reference.ok for l in off):
      return (head + ", where the transformed program is within tolerance: likely a GSPMD "
              "partitioning bug in plain jit, not the pass")
    return (head + "; the transformed program is judged against plain jit's own distance. "
            "Ill-conditioned outputs do this (Adam's first step turns near-zero gradients "
            "into +-lr), and so do GSPMD partitioning bugs; this check cannot tell them "
            "apart")

  def __str__(self) -> str:
    judge = "unsharded reference" if self.reference == "ran" else "plain jit"
    n_rw, n = len(self.report.rewritten), len(self.report.sites)
    bad = [l for l in self.leaves if not l.ok]
    how = []
    if self.reference == "ran":
      by_distance = sum(l.ok and l.judged == "plain's distance" for l in self.leaves)
      by_plain = sum(l.ok and l.judged == "plain" for l in self.leaves)
      if not n_rw and by_plain:
        how.append("no site rewritten")
      by_sensitivity = sum(l.ok and l.judged == "sensitivity" for l in self.leaves)
      if by_distance:
        how.append(f"{by_distance} within plain jit's own distance to it")
      if by_sensitivity:
        how.append(f"{by_sensitivity} within its own sensitivity")
      if by_plain:
        how.append(f"{by_plain} with plain jit")
    head = (f"meshslice.check: {'OK' if self.ok else 'DISAGREES'}: "
            f"{len(self.leaves) - len(bad)} of {len(self.leaves)} outputs agree with the "
            f"{judge}" + (f" ({', '.join(how)})" if how else "") +
            f"; {n_rw} of {n} matmuls rewritten")
    lines = [head]
    if self.reference != "ran":
      lines.append(f"  (unsharded reference skipped: {self.reference})")
    cols = ("output", "shape", "dtype", "vs plain (abs / rel)", "vs reference",
            "plain vs reference", "verdict")
    rows = [(l.path or "<out>", str(l.shape), l.dtype, str(l.vs_plain),
             "-" if l.vs_reference is None else str(l.vs_reference),
             "-" if l.plain_vs_reference is None else str(l.plain_vs_reference),
             f"ok ({l.judged})" if l.ok else "DIFFERS")
            for l in self.leaves]
    widths = [max(len(c), *(len(r[k]) for r in rows)) if rows else len(c)
              for k, c in enumerate(cols)]
    fmt = lambda r: "  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
    lines += [fmt(cols)] + [fmt(r) for r in rows]
    plain_note = self._plain_note()
    if plain_note:
      lines.append("  " + plain_note)
    touchy = [l.path or "<out>" for l in self.leaves if l.judged == "sensitivity"]
    if touchy:
      lines.append(
          f"  note: {', '.join(touchy[:4])}{', ...' if len(touchy) > 4 else ''}: the "
          "unsharded run itself moves by more than the tolerance when its inputs move by "
          "one rounding step of the rewritten matmuls' dtype; judged against that")
    if self.culprit is not None:
      s = self.culprit
      lines.append(f"  responsible: {s.label}: {s.algorithm} {s.dataflow} S={s.ksplit} "
                   f"over {s.mesh_axes}, lhs {s.lhs_spec} rhs {s.rhs_spec} out {s.out_spec}; "
                   f"leave it alone with overrides={{{s.index}: {{'rewrite': False}}}}")
    elif self.suspects:
      lines.append(f"  suspects: sites {list(self.suspects)}")
    if self.note:
      lines.append(f"  {self.note}")
    return "\n".join(lines)


def check(fn: Callable, *, reference: bool = True, max_reference_bytes: int = 1 << 28,
          bisect: bool = True, tolerance: dict | float | None = None,
          verbose: bool = False, **options) -> Callable[..., CheckResult]:
  """Return a function that runs `fn` plain, transformed, and unsharded on the given
  inputs and reports whether the transformed program computes the same outputs.

  Args:
    fn: what you would pass to `meshslice.transform` (a function or a jitted one with
      its in/out shardings, donation included: donated inputs are copied before each
      run, so the caller's arrays survive the check).
    reference: run the unsharded single-device reference when it fits.
    max_reference_bytes: skip the reference above this total input size.
    bisect: on disagreement, find the rewritten site responsible.
    tolerance: a number (the tolerance of every floating and complex dtype) or a dict
      from dtype name (or dtype) to number, overriding those entries of `TOLERANCE`.
    verbose: print the result before returning it.
    **options: `meshslice.transform` options (algorithm, ksplit, overrides, ...).

  Example:
    >>> result = meshslice.check(step, ksplit=4)(params, batch)   # doctest: +SKIP
    >>> print(result)                                              # doctest: +SKIP
    meshslice.check: OK: 5 of 5 outputs agree with the unsharded reference; 3 of 3
    matmuls rewritten
      output     shape     dtype    vs plain (abs / rel)     vs reference  ...
      [0]        ()        float32  1.19e-07 / 2.01e-08 ok   ...
    >>> result.assert_ok()                                         # doctest: +SKIP
  """
  if not callable(fn):
    raise TypeError(f"meshslice.check expects a callable as fn, got {type(fn).__name__}")
  if isinstance(fn, Transformed) or isinstance(getattr(fn, "jitted_fn", None), Transformed):
    raise TypeError("fn is already a meshslice.transform result; check the original")
  if is_nnx_jit(fn):
    raise TypeError(
        "meshslice.check cannot run an nnx.jit step: each call updates its Modules in "
        "place, and check runs the step several times on the same inputs. Check the "
        "functional step instead: graphdef, state = nnx.split((model, optimizer)), then "
        "meshslice.check(jax.jit(pure_step))(state, batch) with pure_step merging, "
        "stepping and splitting again")
  tol = _tolerances(tolerance)
  transformed = transform(fn, **options)      # validates the options up front
  plain = fn if _is_jitted(fn) else jax.jit(fn)

  def run(*args, **kwargs) -> CheckResult:
    _, dynamic = transformed._split(args, kwargs)     # same flattening as the pass
    in_leaves = jax.tree.leaves(dynamic)
    traced = plain.trace(*args, **kwargs)
    fresh = _Fresh(args, kwargs, in_leaves, jit_params(traced).get("donated_invars", ()))
    report = transformed.explain(*args, **kwargs)
    site_dtypes = [jnp.dtype(s.dtype) for s in report.rewritten if _is_inexact_name(s.dtype)]
    # The reference reads host copies of the caller's arrays, before anything ran.
    ref, why, moved = None, "turned off (reference=False)", None
    if reference:
      roundoff = max((float(jnp.finfo(d).eps) / 2 for d in site_dtypes), default=0.0)
      ref, why, moved = _reference(traced.jaxpr, in_leaves, max_reference_bytes, roundoff)
    paths, new = _host_outputs(transformed(*fresh.args(), **fresh.kwargs()))
    _, old = _host_outputs(plain(*fresh.args(), **fresh.kwargs()))
    # a rewrite rounds at the precision of the matmuls it rewrites (bf16 sites feeding
    # float32 outputs: bf16's tolerance)
    site_tol = max((_tol_of(d, tol) for d in site_dtypes), default=0.0)
    kinds = [(_kind(b), _dtype_name(b.dtype),
              max(_tol_of(b.dtype, tol), site_tol) if _kind(b) in ("float", "complex")
              else 0.0) for b in old]
    rewritten = bool(report.rewritten)
    sens = [_sensitivity(k, ref[i], moved[i]) if moved is not None else 0.0
            for i, (k, _, _) in enumerate(kinds)]
    leaves = []
    for i, (path, a, b, (kind, dtype, t)) in enumerate(zip(paths, new, old, kinds)):
      r = None if ref is None else ref[i]
      ok, judged = _verdict(kind, t, a, b, r, rewritten, sens[i])
      leaves.append(LeafCheck(
          path=path, shape=tuple(b.shape), dtype=dtype, vs_plain=_agree(a, b, t, kind),
          vs_reference=None if r is None else _agree(a, r, t, kind),
          plain_vs_reference=None if r is None else _agree(b, r, t, kind),
          ok=ok, judged=judged, tolerance=t,
          sensitivity=None if moved is None or kind not in ("float", "complex")
          else sens[i]))
    result = CheckResult(ok=all(l.ok for l in leaves), leaves=tuple(leaves),
                         report=report, reference=why if ref is None else "ran")
    if not result.ok and bisect and rewritten:
      def judge(outs):
        return all(_verdict(k, t, a, b, None if ref is None else ref[i], True, sens[i])[0]
                   for i, (a, b, (k, _, t)) in enumerate(zip(outs, old, kinds)))
      result = _bisect(result, fn, options, fresh, judge)
    if verbose:
      print(result)
    return result

  return run


class _Fresh:
  """The caller's arguments with the leaves the step donates replaced by new copies at
  every call: a donating program consumes its inputs, so the caller's arrays are never
  passed to one, and no copy is passed twice."""

  def __init__(self, args, kwargs, leaves, donated_invars):
    self._args, self._kwargs = args, kwargs
    self._donated = {id(x) for x, d in zip(leaves, donated_invars)
                     if d and isinstance(x, jax.Array)}

  def _copy(self, tree):
    if not self._donated:
      return tree
    flat = jax.tree.leaves(tree)
    if not any(id(x) in self._donated for x in flat):
      return tree          # static arguments are never rebuilt
    return jax.tree.map(lambda x: x.copy() if id(x) in self._donated else x, tree)

  def args(self):
    return tuple(self._copy(a) for a in self._args)

  def kwargs(self):
    return {k: self._copy(v) for k, v in self._kwargs.items()}


# -------------------------------------------------------------------------- tolerances
def _tolerances(tolerance) -> dict:
  """TOLERANCE with the user's overrides; key None holds the default of floating dtypes
  that are not listed."""
  tol = dict(TOLERANCE)
  tol[None] = None                      # max(2e-2, 2 * eps) of the dtype
  if tolerance is None:
    return tol
  if _is_number(tolerance):
    value = _tolerance_value(tolerance, "tolerance=")
    return {k: value for k in tol}
  if not isinstance(tolerance, dict):
    raise TypeError("meshslice.check: tolerance= must be a number (used for every floating "
                    "and complex dtype) or a dict from dtype name to number, e.g. "
                    f"{{'bfloat16': 5e-2}}; got {type(tolerance).__name__}")
  for key, value in tolerance.items():
    try:
      dtype = jnp.dtype(key)
    except TypeError:
      raise ValueError(f"meshslice.check: tolerance key {key!r} is not a dtype name (e.g. "
                       "'float32', 'bfloat16')") from None
    if not jnp.issubdtype(dtype, jnp.inexact):
      raise ValueError(f"meshslice.check: tolerance[{key!r}]: {dtype.name} outputs are "
                       "compared exactly; tolerances apply to floating and complex dtypes")
    tol[dtype.name] = _tolerance_value(value, f"tolerance[{key!r}]")
  return tol


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _tolerance_value(value, name) -> float:
  if not _is_number(value):
    raise TypeError(f"meshslice.check: {name} must be a non-negative number, got "
                    f"{type(value).__name__} {value!r}")
  if not (math.isfinite(value) and value >= 0):
    raise ValueError(f"meshslice.check: {name} must be a non-negative finite number, got "
                     f"{value!r}")
  return float(value)


def _is_inexact_name(name) -> bool:
  try:
    return bool(jnp.issubdtype(jnp.dtype(name), jnp.inexact))
  except TypeError:
    return False


def _tol_of(dtype, tol) -> float:
  if _is_key(dtype) or not jnp.issubdtype(dtype, jnp.inexact):
    return 0.0
  name = jnp.dtype(dtype).name
  if name in tol:
    return tol[name]
  if tol[None] is not None:
    return tol[None]
  return float(max(2e-2, 2 * float(jnp.finfo(dtype).eps)))


# -------------------------------------------------------------------------- comparison
def _is_key(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype_name(dtype) -> str:
  return "float0" if dtype == jax.dtypes.float0 else str(dtype)


def _kind(x) -> str:
  """"key", "exact" (integer, bool), "complex" or "float"."""
  dtype = x.dtype
  if _is_key(dtype):
    return "key"
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return "complex"
  if jnp.issubdtype(dtype, jnp.floating):
    return "float"
  return "exact"


class _Host:
  """An output leaf on the host: `value` is numpy (a key's `key_data`), `dtype` the
  leaf's own dtype."""
  __slots__ = ("value", "dtype")

  def __init__(self, value, dtype):
    self.value, self.dtype = value, dtype

  @property
  def shape(self):
    # a key's shape, not its key_data's
    return self.value.shape[:self.value.ndim - _key_data_ndim(self.dtype)]


def _key_data_ndim(dtype) -> int:
  return 1 if _is_key(dtype) else 0


def _to_host(x) -> _Host:
  dtype = getattr(x, "dtype", None)
  if dtype is not None and _is_key(dtype):
    return _Host(np.asarray(jax.random.key_data(x)), dtype)
  value = np.asarray(x)
  return _Host(value, value.dtype if dtype is None else dtype)


def _host_outputs(tree):
  """Paths and host copies of the output leaves (the device arrays are let go)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in flat], [_to_host(x) for _, x in flat]


def _as_wide(h: _Host, kind):
  v = h.value
  if kind == "complex":
    return v.astype(np.complex128)
  if kind == "float":
    return v.astype(np.float64)
  return v


def _distance(a, b) -> np.ndarray:
  """|a - b| per element: 0 where they are equal or both NaN, inf where one is NaN."""
  with np.errstate(invalid="ignore", over="ignore"):
    d = np.abs(a - b)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
  d = np.where(same, 0.0, d)
  return np.where(np.isnan(d), np.inf, d)


def _scale(b) -> float:
  mag = np.abs(b)
  finite = mag[np.isfinite(mag)]
  return float(finite.max()) if finite.size else 0.0


def _agree(a: _Host, b: _Host, tol, kind) -> Agreement:
  """The fixed test: every element within `tol` (floating) or equal (exact kinds)."""
  if a.value.shape != b.value.shape:
    return Agreement(max_abs=float("inf"), max_rel=float("inf"), ok=False,
                     mismatched=None if kind in ("float", "complex") else b.value.size)
  if kind in ("key", "exact"):
    av, bv = a.value, b.value
    if kind == "key":      # one key per trailing key_data row
      differ = np.any(av != bv, axis=-1) if av.ndim else av != bv
    else:
      differ = av != bv
    n = int(np.count_nonzero(differ))
    err = 0.0 if kind == "key" or not n else float(
        np.max(np.abs(av.astype(np.float64) - bv.astype(np.float64))))
    return Agreement(max_abs=err, max_rel=0.0, ok=n == 0, mismatched=n)
  if a.value.size == 0:
    return Agreement(max_abs=0.0, max_rel=0.0, ok=True)
  av, bv = _as_wide(a, kind), _as_wide(b, kind)
  d = _distance(av, bv)
  scale = _scale(bv)
  with np.errstate(invalid="ignore"):
    ok = bool(np.all(d <= tol * np.abs(bv) + tol * scale))
  err = float(d.max())
  return Agreement(max_abs=err, max_rel=err / scale if scale else err, ok=ok)


def _verdict(kind, tol, t: _Host, j: _Host, r, rewritten: bool,
             sensitivity: float = 0.0) -> tuple[bool, str]:
  """(ok, which rule) for one leaf: `t` transformed, `j` plain jit, `r` the reference or
  None, `sensitivity` how far the reference moves when its inputs move by one rounding
  step (largest absolute change). The rules are the module docstring's."""
  if r is None or not rewritten:
    if _agree(t, j, tol, kind).ok:
      return True, "plain"
    if r is None:
      return False, ""
  if _agree(t, r, tol, kind).ok:
    return True, "reference"
  if kind in ("key", "exact"):
    if _agree(j, r, tol, kind).ok:
      return False, ""
    return (True, "plain") if _agree(t, j, tol, kind).ok else (False, "")
  if t.value.shape != r.value.shape:
    return False, ""
  rv = _as_wide(r, kind)
  allowance = tol * _scale(rv)
  plain_off = not _agree(j, r, tol, kind).ok
  if not plain_off and sensitivity <= allowance:
    return False, ""        # plain jit is within tolerance where the rewrite is not
  # The reference is itself one sample of the rounding: where plain jit (or the reference
  # on inputs moved by one rounding step) is d from it, another summation order can be
  # 2d from it (Adam's first step: plain jit 0 where the reference has +-lr, the rewrite
  # -lr where the reference has +lr).
  plain_d = float(_distance(_as_wide(j, kind), rv).max())
  t_d = float(_distance(_as_wide(t, kind), rv).max())
  if plain_off and t_d <= 2 * (plain_d + allowance):
    return True, "plain's distance"
  if t_d <= 2 * (sensitivity + allowance):
    return True, "sensitivity"
  if plain_off and _agree(t, j, tol, kind).ok:
    return True, "plain"
  return False, ""


def _sensitivity(kind, r: _Host, moved: _Host) -> float:
  """Largest change of a floating reference output when its inputs move by one rounding
  step (0 for other kinds)."""
  if kind not in ("float", "complex") or r.value.shape != moved.value.shape:
    return 0.0
  return float(_distance(_as_wide(moved, kind), _as_wide(r, kind)).max()) \
      if r.value.size else 0.0


def _is_jitted(fn) -> bool:
  return hasattr(fn, "trace") and hasattr(fn, "lower")


# -------------------------------------------------------------------------- bisection
def _outputs_agree(fn, options, report, disabled, fresh, judge) -> bool:
  """Re-transform with the sites in `disabled` left alone and every other site exactly
  as planned before (through a plan, so user pins by pattern or location cannot clash
  with the bisection's), run it on fresh copies of the donated inputs, and judge it."""
  plan = report.plan
  for s in report.sites:
    if s.index in disabled or not s.rewritten:
      plan = plan.edit(s.index, rewrite=False)
  base = {k: v for k, v in options.items() if k not in ("overrides", "plan")}
  try:
    out = transform(fn, **base, plan=plan)(*fresh.args(), **fresh.kwargs())
  except MeshsliceError:
    # the plan cannot be re-applied: pin by index on top instead (only the pass's own
    # errors say that; one raised by JAX or by the step itself propagates)
    overrides = dict(options.get("overrides") or {})
    for i in disabled:
      overrides[i] = {"rewrite": False}
    out = transform(fn, **dict(options, overrides=overrides))(*fresh.args(),
                                                               **fresh.kwargs())
  return judge(_host_outputs(out)[1])


def _bisect(result, fn, options, fresh, judge) -> CheckResult:
  """Narrow the disagreement down to one rewritten site: keep only half of the current
  suspects rewritten; whichever half still disagrees holds the fault. A site is named
  only on evidence: the program with every site left alone agrees, the site's rewrite
  alone disagrees, and plain jit is within tolerance of the reference on an output the
  transformed program gets wrong."""
  report = result.report
  rewritten = [s.index for s in report.rewritten]
  runs = 1
  if not _outputs_agree(fn, options, report, rewritten, fresh, judge):
    return dataclasses.replace(result, note=(
        "bisection: with every site left alone the transformed program still disagrees, "
        "so no rewritten site is to blame (the fault is outside the rewrites)"))
  suspects = list(rewritten)
  note = ""
  while len(suspects) > 1:
    half = len(suspects) // 2
    for part in (suspects[:half], suspects[half:]):
      runs += 1
      if not _outputs_agree(fn, options, report, [i for i in rewritten if i not in part],
                            fresh, judge):
        suspects = part
        break
    else:
      note = (f"bisection: no single half of sites {suspects} disagrees on its own; the "
              "fault needs several rewritten sites together")
      break
  culprit = None
  if len(suspects) == 1:
    runs += 1
    if _outputs_agree(fn, options, report, [i for i in rewritten if i != suspects[0]],
                      fresh, judge):
      note = (f"bisection: inconclusive after {runs} re-transforms (site {suspects[0]} "
              "alone agrees)")
    elif any(l.plain_vs_reference is None or l.plain_vs_reference.ok
             for l in result.leaves if not l.ok):
      culprit = next(s for s in report.sites if s.index == suspects[0])
      note = (f"bisection: {runs} re-transforms; with every site left alone the outputs "
              "agree, with only this site rewritten they still disagree")
    else:
      note = (f"bisection: {runs} re-transforms point at site {suspects[0]}, but plain jit "
              "is itself beyond tolerance of the reference on every output the "
              "transformed program gets wrong, so amplified float noise cannot be told "
              "from a wrong rewrite; no site is blamed")
  return dataclasses.replace(result, culprit=culprit, suspects=tuple(suspects), note=note)


# -------------------------------------------------------------------------- reference
def _reference(closed, leaves, limit, roundoff=0.0):
  """(flat outputs as `_Host`s, "", sensitivity) of the unsharded run of the traced
  program `closed` on the flat dynamic inputs `leaves`, or (None, why not, None).

  With `roundoff` > 0 the program also runs on its floating inputs and consts moved by
  that relative amount (random signs, fixed seed): `sensitivity` holds the outputs of
  that run, which show how strongly each output reacts to one rounding step."""
  total = 0
  for x in leaves:
    if isinstance(x, (jax.ShapeDtypeStruct, jax.core.Tracer)):
      return None, "inputs are abstract or traced (call check with concrete arrays)", None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return None, "inputs span several processes", None
    total += int(x.nbytes if hasattr(x, "nbytes") else np.asarray(x).nbytes)
  if total > limit:
    return None, f"inputs total {total} bytes, over max_reference_bytes={limit}", None
  host = [_HostInput(x) for x in leaves]
  consts = [_HostInput(c) for c in closed.consts]
  key_out = [_is_key(aval.dtype) for aval in closed.out_avals]
  n = len(consts)

  def unsharded(*flat):
    cs = [c.wrap(v) for c, v in zip(consts, flat[:n])]
    ins = [h.wrap(v) for h, v in zip(host, flat[n:])]
    outs = evaluate(closed.jaxpr, cs, ins)
    return [jax.random.key_data(o) if k else o for o, k in zip(outs, key_out)]

  values = [c.value for c in consts] + [h.value for h in host]
  try:
    with jax.default_device(jax.devices()[0]):
      run = jax.jit(unsharded)
      outs = run(*values)
      moved = None
      if roundoff > 0:
        rng = np.random.default_rng(0)
        moved = run(*[_moved(v, roundoff, rng) for v in values])
  except NoReference as e:
    return None, str(e), None
  except Exception as e:  # noqa: BLE001  (the check goes on, judged by plain jit)
    return None, f"the unsharded run failed: {type(e).__name__}: {shorten(e)}", None
  wrap = lambda os: [_Host(np.asarray(o), a.dtype) for o, a in zip(os, closed.out_avals)]
  return wrap(outs), "", None if moved is None else wrap(moved)


def _moved(value, roundoff, rng):
  """`value` with each floating element scaled by 1 +- roundoff (anything else as is)."""
  dtype = getattr(value, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.inexact) or not np.ndim(value):
    return value
  wide = np.asarray(value).astype(np.complex128 if jnp.issubdtype(dtype, jnp.complexfloating)
                                  else np.float64)
  signs = rng.choice(np.array([-1.0, 1.0]), size=wide.shape)
  return (wide * (1 + signs * roundoff)).astype(dtype)


class _HostInput:
  """An input or const of the reference as numpy (a key as its `key_data`), and how to
  turn it back into what the program takes inside the unsharded jit."""
  __slots__ = ("value", "impl")

  def __init__(self, x):
    self.impl = None
    if isinstance(x, jax.Array) and _is_key(x.dtype):
      self.impl = jax.random.key_impl(x)
      self.value = np.asarray(jax.random.key_data(x))
    elif isinstance(x, jax.Array) or hasattr(x, "shape"):
      self.value = np.asarray(x)
    else:
      self.value = x

  def wrap(self, v):
    return v if self.impl is None else jax.random.wrap_key_data(v, impl=self.impl)
