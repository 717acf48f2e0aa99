"""`meshslice.check`: one call that verifies the pass on your own inputs.

    result = meshslice.check(step)(params, batch)
    print(result)            # per-output errors; on disagreement, the site responsible
    result.assert_ok()

It runs three programs on the given inputs: the original (plain `jax.jit`), the
transformed one (`meshslice.transform(step, **options)`), and, when the inputs are
concrete and small enough, an unsharded single-device reference: the same traced
program evaluated on one device with every sharding annotation dropped. Plain GSPMD is
itself wrong on some layouts (DESIGN.md section 6), so the reference is the judge when
it ran; otherwise the transformed program is judged against plain jit.

When they disagree, the rewritten sites are bisected: the program is re-transformed with
halves of them left alone (`overrides={i: {"rewrite": False}}`) until one site is found
whose rewrite alone makes the outputs differ.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .transform import Transformed, transform

#: Tolerance per dtype (README "Numerics"): |a - b| <= tol * |b| + tol * max|b|.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Agreement:
  """How far one output leaf of program a is from the same leaf of program b."""
  max_abs: float
  max_rel: float          # max |a - b| / max |b|
  ok: bool

  def __str__(self) -> str:
    return f"{self.max_abs:.2e} / {self.max_rel:.2e} {'ok' if self.ok else 'DIFFERS'}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeafCheck:
  """One output leaf: transformed vs plain, transformed vs reference, plain vs reference
  (the last two None when the reference did not run)."""
  path: str
  shape: tuple
  dtype: str
  vs_plain: Agreement
  vs_reference: Agreement | None = None
  plain_vs_reference: Agreement | None = None

  @property
  def ok(self) -> bool:
    judge = self.vs_reference if self.vs_reference is not None else self.vs_plain
    return judge.ok


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
  """What `meshslice.check` found.

  Attributes:
    ok: every output leaf of the transformed program agrees with the judge (the
      unsharded reference when it ran, else plain jit).
    leaves: per output leaf agreement, named by `jax.tree_util.keystr` paths.
    report: the pass's `Report` for these inputs.
    reference: "ran" or why the unsharded reference was skipped.
    culprit: on disagreement, the `Site` whose rewrite alone makes outputs differ (None
      when all agree, nothing was rewritten, or bisection was off / inconclusive).
    suspects: indices of the rewritten sites bisection narrowed the fault down to.
    note: how bisection went.
  """
  ok: bool
  leaves: tuple
  report: object
  reference: str
  culprit: object = None
  suspects: tuple = ()
  note: str = ""

  @property
  def plain_disagrees_with_reference(self) -> bool:
    return any(l.plain_vs_reference is not None and not l.plain_vs_reference.ok
               for l in self.leaves)

  def assert_ok(self) -> None:
    """Raise AssertionError with the summary when the outputs disagree."""
    if not self.ok:
      raise AssertionError(str(self))

  def __str__(self) -> str:
    judge = "unsharded reference" if self.reference == "ran" else "plain jit"
    n_rw, n = len(self.report.rewritten), len(self.report.sites)
    bad = [l for l in self.leaves if not l.ok]
    head = (f"meshslice.check: {'OK' if self.ok else 'DISAGREES'}: "
            f"{len(self.leaves) - len(bad)} of {len(self.leaves)} outputs agree with the "
            f"{judge}; {n_rw} of {n} matmuls rewritten")
    lines = [head]
    if self.reference != "ran":
      lines.append(f"  (unsharded reference skipped: {self.reference})")
    cols = ("output", "shape", "dtype", "vs plain (abs / rel)", "vs reference",
            "plain vs reference")
    rows = [(l.path or "<out>", str(l.shape), l.dtype, str(l.vs_plain),
             "-" if l.vs_reference is None else str(l.vs_reference),
             "-" if l.plain_vs_reference is None else str(l.plain_vs_reference))
            for l in self.leaves]
    widths = [max(len(c), *(len(r[k]) for r in rows)) if rows else len(c)
              for k, c in enumerate(cols)]
    fmt = lambda r: "  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
    lines += [fmt(cols)] + [fmt(r) for r in rows]
    if self.plain_disagrees_with_reference:
      lines.append("  note: plain jax.jit itself disagrees with the unsharded reference "
                   "(a GSPMD partitioning bug, not the pass)")
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
          bisect: bool = True, tolerance: dict | None = None, verbose: bool = False,
          **options) -> Callable[..., CheckResult]:
  """Return a function that runs `fn` plain, transformed, and unsharded on the given
  inputs and reports whether the transformed program computes the same outputs.

  Args:
    fn: what you would pass to `meshslice.transform` (a function or a jitted one with
      its in/out shardings).
    reference: run the unsharded single-device reference when it fits.
    max_reference_bytes: skip the reference above this total input size.
    bisect: on disagreement, find the rewritten site responsible.
    tolerance: per-dtype-name overrides of `TOLERANCE`.
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
  if isinstance(fn, Transformed):
    raise TypeError("fn is already a meshslice.transform result; check the original")
  tol = dict(TOLERANCE, **(tolerance or {}))
  transformed = transform(fn, **options)      # validates the options up front
  plain = fn if _is_jitted(fn) else jax.jit(fn)

  def run(*args, **kwargs) -> CheckResult:
    report = transformed.explain(*args, **kwargs)
    new_out = transformed(*args, **kwargs)
    old_out = plain(*args, **kwargs)
    paths, new = _leaves_with_paths(new_out)
    old = jax.tree.leaves(old_out)
    ref, why = None, "turned off (reference=False)"
    if reference:
      ref, why = _reference(plain, transformed, args, kwargs, max_reference_bytes)
    leaves = []
    for i, (path, a, b) in enumerate(zip(paths, new, old)):
      dtype = str(jnp.dtype(getattr(b, "dtype", np.float32)))
      t = tol.get(dtype, 0.0)
      leaves.append(LeafCheck(
          path=path, shape=tuple(np.shape(b)), dtype=dtype, vs_plain=_agree(a, b, t),
          vs_reference=None if ref is None else _agree(a, ref[i], t),
          plain_vs_reference=None if ref is None else _agree(b, ref[i], t)))
    result = CheckResult(ok=all(l.ok for l in leaves), leaves=tuple(leaves),
                         report=report, reference=why if ref is None else "ran")
    if not result.ok and bisect and report.rewritten:
      # Bisection re-runs the program with sites left alone, which converges to plain
      # jit: judge by the reference only when plain jit agrees with it.
      if not result.plain_disagrees_with_reference:
        judge = ref if ref is not None else [np.asarray(x) for x in old]
        result = _bisect(result, fn, options, args, kwargs, judge, tol)
      elif all(l.vs_plain.ok for l in leaves):
        result = dataclasses.replace(result, note=(
            "the transformed program agrees with plain jit; both disagree with the "
            "unsharded reference, so no site is to blame on its own"))
      else:
        result = _bisect(result, fn, options, args, kwargs,
                         [np.asarray(x) for x in old], tol)
        result = dataclasses.replace(result, note=result.note + " (judged against plain "
                                     "jit, which itself disagrees with the reference)")
    if verbose:
      print(result)
    return result

  return run


# -------------------------------------------------------------------------- comparison
def _agree(a, b, tol) -> Agreement:
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape:
    return Agreement(max_abs=float("inf"), max_rel=float("inf"), ok=False)
  if a.size == 0:
    return Agreement(max_abs=0.0, max_rel=0.0, ok=True)
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  diff = np.abs(a64 - b64)
  scale = float(np.abs(b64).max())
  with np.errstate(invalid="ignore"):
    ok = bool(np.all((diff <= tol * np.abs(b64) + tol * scale)
                     | (np.isnan(a64) & np.isnan(b64)) | (a64 == b64)))
  err = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("inf")
  return Agreement(max_abs=err, max_rel=err / scale if scale else err, ok=ok)


def _leaves_with_paths(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]


def _is_jitted(fn) -> bool:
  return hasattr(fn, "trace") and hasattr(fn, "lower")


# -------------------------------------------------------------------------- bisection
def _outputs_agree(fn, options, report, disabled, args, kwargs, judge, tol) -> bool:
  """Re-transform with the sites in `disabled` left alone and every other site exactly
  as planned before (through a plan, so user pins by pattern or location cannot clash
  with the bisection's), and compare with the judge."""
  plan = report.plan
  for s in report.sites:
    if s.index in disabled or not s.rewritten:
      plan = plan.edit(s.index, rewrite=False)
  base = {k: v for k, v in options.items() if k not in ("overrides", "plan")}
  try:
    out = transform(fn, **base, plan=plan)(*args, **kwargs)
  except ValueError:      # the plan cannot be re-applied: pin by index on top instead
    overrides = dict(options.get("overrides") or {})
    for i in disabled:
      overrides[i] = {"rewrite": False}
    out = transform(fn, **dict(options, overrides=overrides))(*args, **kwargs)
  _, leaves = _leaves_with_paths(out)
  return all(_agree(a, b, tol.get(str(jnp.dtype(getattr(b, "dtype", np.float32))), 0.0)).ok
             for a, b in zip(leaves, judge))


def _bisect(result, fn, options, args, kwargs, judge, tol) -> CheckResult:
  """Narrow the disagreement down to one rewritten site: keep only half of the current
  suspects rewritten; whichever half still disagrees holds the fault."""
  rewritten = [s.index for s in result.report.rewritten]
  suspects = list(rewritten)
  runs = 0
  note = ""
  while len(suspects) > 1:
    half = len(suspects) // 2
    for part in (suspects[:half], suspects[half:]):
      runs += 1
      if not _outputs_agree(fn, options, result.report,
                            [i for i in rewritten if i not in part], args, kwargs, judge, tol):
        suspects = part
        break
    else:
      note = (f"bisection: no single half of sites {suspects} disagrees on its own; the "
              "fault needs several rewritten sites together")
      break
  culprit = None
  if len(suspects) == 1:
    runs += 1
    alone_bad = not _outputs_agree(fn, options, result.report,
                                   [i for i in rewritten if i != suspects[0]], args, kwargs,
                                   judge, tol)
    if alone_bad:
      culprit = next(s for s in result.report.sites if s.index == suspects[0])
      note = f"bisection: {runs} re-transforms; only this site rewritten still disagrees"
    else:
      note = (f"bisection: inconclusive after {runs} re-transforms (site {suspects[0]} "
              "alone agrees)")
  return dataclasses.replace(result, culprit=culprit, suspects=tuple(suspects), note=note)


# -------------------------------------------------------------------------- reference
class _NoReference(Exception):
  """The program cannot be evaluated unsharded (the message says why)."""


def _reference(plain, transformed, args, kwargs, limit):
  """(flat outputs as numpy, "") of the unsharded run, or (None, why not)."""
  _, dynamic = transformed._split(args, kwargs)     # same flattening as the pass
  leaves = jax.tree.leaves(dynamic)
  total = 0
  for x in leaves:
    if isinstance(x, (jax.ShapeDtypeStruct, jax.core.Tracer)):
      return None, "inputs are abstract or traced (call check with concrete arrays)"
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return None, "inputs span several processes"
    total += int(np.prod(np.shape(x))) * np.dtype(getattr(x, "dtype", np.float32)).itemsize
  if total > limit:
    return None, (f"inputs total {total} bytes, over max_reference_bytes={limit}")
  try:
    closed = plain.trace(*args, **kwargs).jaxpr
    host = [np.asarray(x) if hasattr(x, "shape") else x for x in leaves]
    consts = [np.asarray(c) if isinstance(c, jax.Array) else c for c in closed.consts]
    run = jax.jit(lambda *flat: _eval(closed.jaxpr, consts, flat))
    with jax.default_device(jax.devices()[0]):
      outs = run(*host)
  except _NoReference as e:
    return None, str(e)
  return [np.asarray(o) for o in outs], ""


_STRIPPED = ("sharding", "out_sharding")
_IDENTITY = ("sharding_constraint", "reshard", "device_put", "mesh_cast")


def _eval(jaxpr, consts, args):
  """Evaluate a jaxpr with its sharding annotations dropped (one device)."""
  env = {}
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [_read(env, v) for v in eqn.invars]
    name = eqn.primitive.name
    rule = _RULES.get(name)
    if rule is not None:
      outs = rule(eqn, invals)
    elif name in _IDENTITY:
      outs = invals[:len(eqn.outvars)]
    elif name == "shard_map":
      raise _NoReference("the program contains a shard_map (manual collectives), which "
                         "cannot run unsharded")
    else:     # everything else (scatter-add's update_jaxpr included) binds as is
      params = {k: (None if k in _STRIPPED else p) for k, p in eqn.params.items()}
      try:
        outs = eqn.primitive.bind(*invals, **params)
      except Exception as e:  # noqa: BLE001
        raise _NoReference(f"no unsharded evaluation of {name}: {type(e).__name__}: "
                           f"{str(e)[:200]}") from None
      outs = outs if eqn.primitive.multiple_results else [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [_read(env, v) for v in jaxpr.outvars]


def _read(env, v):
  return v.val if type(v).__name__ == "Literal" else env[v]


def _closed(c):
  return (c.jaxpr, c.consts) if hasattr(c, "consts") else (c, ())


def _inline(param):
  def rule(eqn, invals):
    jaxpr, consts = _closed(eqn.params[param])
    return _eval(jaxpr, consts, invals)
  return rule


def _scan(eqn, invals):
  p = eqn.params
  if "num_consts" not in p:
    raise _NoReference("unsupported scan parameters (newer jax)")
  jaxpr, consts = _closed(p["jaxpr"])
  nc, nk = p["num_consts"], p["num_carry"]
  cs, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

  def body(carry, x):
    outs = _eval(jaxpr, consts, list(cs) + list(carry) + list(x))
    return outs[:nk], outs[nk:]

  carry, ys = jax.lax.scan(body, list(init), list(xs), length=p["length"],
                           reverse=p["reverse"])
  return list(carry) + list(ys)


def _while(eqn, invals):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cj, cc = _closed(p["cond_jaxpr"])
  bj, bc = _closed(p["body_jaxpr"])
  ccs, bcs, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  return jax.lax.while_loop(lambda c: _eval(cj, cc, list(ccs) + list(c))[0],
                            lambda c: _eval(bj, bc, list(bcs) + list(c)), list(init))


def _cond(eqn, invals):
  branches = [(lambda *ops, br=br: _eval(*_closed(br), ops)) for br in eqn.params["branches"]]
  return jax.lax.switch(invals[0], branches, *invals[1:])


_RULES = {"jit": _inline("jaxpr"), "pjit": _inline("jaxpr"),
          "remat2": _inline("jaxpr"), "checkpoint": _inline("jaxpr"),
          "custom_jvp_call": _inline("call_jaxpr"), "custom_vjp_call": _inline("call_jaxpr"),
          "closed_call": _inline("call_jaxpr"), "core_call": _inline("call_jaxpr"),
          "scan": _scan, "while": _while, "cond": _cond}
