"""Differential fuzzing of the meshslice pass: generators and runners shared by
tests/test_fuzz.py (hypothesis, derandomized) and bench/fuzz.py (N random examples).

Two kinds of examples:

* `DotCase`: one `dot_general` with random dimension numbers (batch, contracting and
  free dims in random orders), a random mesh (1-3 axes, size-1 axes included, Auto or
  Explicit), random per-dim mesh-axis tuples drawn independently for each operand
  (so tuple orders may differ between lhs and rhs, layouts may force resharding), a
  random output sharding or none, every algorithm and ksplit, f32 and bf16. The step
  under test returns the product and the gradients of sum(out * ct) for a fixed random
  cotangent ct.
* `ProgramCase`: a whole program of 2-4 dots composed with elementwise ops, reshapes,
  transposes, sharding constraints, `lax.scan` and `jax.checkpoint`, differentiated with
  `jax.grad`, on Auto or Explicit meshes, called directly or under an outer `jax.jit`,
  `jax.make_jaxpr` or `jax.vmap`.

Each example runs three programs on the same inputs: plain `jax.jit` (GSPMD), the
`meshslice.transform`ed one, and an unsharded reference (numpy float64 for a DotCase, the
same function on one device without shardings for a ProgramCase). Plain GSPMD is itself
wrong on some jax 0.10.2 CPU layouts (DESIGN.md section 6), so the verdict is taken
against the unsharded reference; plain jit disagreeing with it is only counted.

`run_dot_case` / `run_program_case` return an `Outcome`; `Outcome.kind` is one of
KINDS. `case.repro()` is a standalone script reproducing the example.
"""
from __future__ import annotations

import dataclasses
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

ALGORITHMS = (None, "meshslice", "collective", "cannon", "wang", "summa")
KSPLITS = (None, 1, 2, 3, 4)
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
KINDS = ("match", "rewritten-match", "wrong", "crash", "invalid-option", "jax-rejects")
AXIS_NAMES = ("x", "y", "z")


# ----------------------------------------------------------------------------- meshes
_MESHES = {}


def make_mesh(shape, names, explicit):
  key = (tuple(shape), tuple(names), bool(explicit))
  if key not in _MESHES:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    n = int(np.prod(shape))
    _MESHES[key] = jax.make_mesh(tuple(shape), tuple(names), axis_types=(kind,) * len(shape),
                                 devices=jax.devices()[:n])
  return _MESHES[key]


@st.composite
def meshes(draw):
  """(shape, names, explicit): 1-3 axes of size 1, 2 or 4 over at most 8 devices."""
  n_axes = draw(st.integers(1, 3))
  shape = []
  for _ in range(n_axes):
    budget = 8 // int(np.prod(shape or [1]))
    shape.append(draw(st.sampled_from([s for s in (2, 4, 1, 2) if s <= budget])))
  if max(shape) == 1 and draw(st.integers(0, 3)):    # mostly more than one device
    shape[0] = 2
  names = tuple(draw(st.permutations(AXIS_NAMES))[:n_axes])
  return tuple(shape), names, draw(st.booleans())


def _assign_axes(draw, dims, sizes, axis_sizes):
  """Per-dim mesh-axis tuples for an array with dims `dims`: each mesh axis goes to at
  most one dim, in a random order; a dim's tuple keeps only axes its extent divides."""
  entries = [() for _ in dims]
  order = draw(st.permutations(list(axis_sizes)))
  for axis in order:
    target = draw(st.integers(-1, len(dims) - 1))   # -1: axis not used
    if target < 0:
      continue
    used = int(np.prod([axis_sizes[a] for a in entries[target]] or [1]))
    if sizes[dims[target]] % (used * axis_sizes[axis]) == 0:
      entries[target] += (axis,)
  return tuple(entries)


def spec_of(entries):
  return P(*[None if not e else (e[0] if len(e) == 1 else e) for e in entries])


def _spec_src(entries) -> str:
  return repr(spec_of(entries)).replace("PartitionSpec", "P")


# ----------------------------------------------------------------------------- outcomes
@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one example did. kind: one of KINDS."""
  kind: str
  case: object
  rewritten: int = 0
  left_alone: tuple = ()           # reasons of the sites left alone
  gspmd_wrong: bool = False        # plain jit disagreed with the unsharded reference
  detail: str = ""

  @property
  def failed(self) -> bool:
    return self.kind in ("wrong", "crash")

  def describe(self) -> str:
    return f"{self.kind}: {self.detail}\n--- repro ---\n{self.case.repro()}"


def normalize_reason(reason: str) -> str:
  """Group left-alone reasons: numbers, shapes and axis names replaced by placeholders."""
  reason = re.sub(r"P\((?:[^()]|\([^()]*\))*\)", "P(..)", reason)
  reason = re.sub(r"\d+", "N", reason)
  reason = re.sub(r"'[a-z]'", "'A'", reason)
  reason = re.sub(r"axis [a-z](, [a-z])* ", "axis A ", reason)
  return reason[:110]


_INVALID_OPTION = re.compile(r"cannot serve site|does not fit site|does not fit|cannot serve")


def errors(values, reference, dtype: str):
  """[(max abs error, max error relative to max |ref|, ok)] per leaf pair."""
  tol = TOL[dtype]
  out = []
  for v, r in zip(values, reference):
    v = np.asarray(v).astype(np.float32).astype(np.float64)   # on the host: no compile
    r = np.asarray(r, np.float64)
    if v.shape != r.shape:
      out.append((np.inf, np.inf, False))
      continue
    scale = float(np.abs(r).max()) if r.size else 0.0
    diff = np.abs(v - r)
    err = float(diff.max()) if diff.size else 0.0
    ok = bool(np.all(diff <= tol * np.abs(r) + tol * max(scale, 1e-30)))
    out.append((err, err / scale if scale else err, ok))
  return out


def _fmt_errors(errs, names):
  return ", ".join(f"{n}: rel {e[1]:.2e}{'' if e[2] else ' BAD'}" for n, e in zip(names, errs))


# ----------------------------------------------------------------------------- dot cases
@dataclasses.dataclass(frozen=True)
class DotCase:
  """One dot_general on a random mesh with random shardings and options.

  Dims are labelled b0.. (batch), m0.. (lhs free), k0.. (contracting), n0.. (rhs free).
  """
  mesh_shape: tuple
  mesh_names: tuple
  explicit: bool
  sizes: tuple                 # ((label, extent), ...)
  lhs_dims: tuple              # labels in lhs dim order
  rhs_dims: tuple
  lhs_axes: tuple              # per lhs dim: tuple of mesh axis names
  rhs_axes: tuple
  out_axes: tuple | None       # per output dim, or None: no output sharding given
  out_via: str                 # "jit" (out_shardings) | "wsc" | "dot" (out_sharding=)
  dtype: str
  algorithm: str | None
  ksplit: int | None
  strict: bool = False
  seed: int = 0

  # -- derived
  @property
  def extent(self):
    return dict(self.sizes)

  @property
  def labels(self):
    kinds = {}
    for d in self.lhs_dims + self.rhs_dims:
      kinds.setdefault(d[0], [])
      if d not in kinds[d[0]]:
        kinds[d[0]].append(d)
    return {k: sorted(v) for k, v in kinds.items()}

  @property
  def dimension_numbers(self):
    lab = self.labels
    ks, bs = lab.get("k", []), lab.get("b", [])
    return ((tuple(self.lhs_dims.index(k) for k in ks), tuple(self.rhs_dims.index(k) for k in ks)),
            (tuple(self.lhs_dims.index(b) for b in bs), tuple(self.rhs_dims.index(b) for b in bs)))

  @property
  def out_dims(self):
    lab = self.labels
    return (tuple(lab.get("b", [])) + tuple(d for d in self.lhs_dims if d[0] == "m")
            + tuple(d for d in self.rhs_dims if d[0] == "n"))

  @property
  def options(self):
    opts = {}
    if self.algorithm is not None:
      opts["algorithm"] = self.algorithm
    if self.ksplit is not None:
      opts["ksplit"] = self.ksplit
    if self.strict:
      opts["strict"] = True
    return opts

  def shapes(self):
    e = self.extent
    return (tuple(e[d] for d in self.lhs_dims), tuple(e[d] for d in self.rhs_dims),
            tuple(e[d] for d in self.out_dims))

  def data(self):
    """(lhs, rhs, ct) as numpy arrays already rounded to the case's dtype."""
    rng = np.random.RandomState(self.seed)
    dt = jnp.dtype(self.dtype)
    # rounded on the host (ml_dtypes rounds to nearest even, as XLA's convert does): no
    # compile per shape
    return tuple(rng.standard_normal(s).astype(np.float32).astype(dt) for s in self.shapes())

  def reference(self, lhs, rhs, ct):
    """(out, d lhs, d rhs) in float64 with numpy: the unsharded truth."""
    letters = {d: chr(ord("a") + i) for i, d in
               enumerate(sorted(set(self.lhs_dims + self.rhs_dims)))}
    sub = lambda dims: "".join(letters[d] for d in dims)
    l, r, o = sub(self.lhs_dims), sub(self.rhs_dims), sub(self.out_dims)
    f64 = lambda a: np.asarray(a, np.float64)
    lhs, rhs, ct = f64(lhs), f64(rhs), f64(ct)
    return (np.einsum(f"{l},{r}->{o}", lhs, rhs), np.einsum(f"{o},{r}->{l}", ct, rhs),
            np.einsum(f"{l},{o}->{r}", lhs, ct))

  def describe(self) -> str:
    lhs = "[" + ",".join(f"{d}={self.extent[d]}" for d in self.lhs_dims) + "]"
    rhs = "[" + ",".join(f"{d}={self.extent[d]}" for d in self.rhs_dims) + "]"
    out = "none" if self.out_axes is None else f"{_spec_src(self.out_axes)} via {self.out_via}"
    return (f"mesh {dict(zip(self.mesh_names, self.mesh_shape))} "
            f"{'Explicit' if self.explicit else 'Auto'}; lhs {lhs} {_spec_src(self.lhs_axes)}; "
            f"rhs {rhs} {_spec_src(self.rhs_axes)}; out {out}; {self.dtype}; "
            f"options {self.options}")

  def repro(self) -> str:
    return _REPRO.format(describe=self.describe(), case=repr(self), run="run_dot_case")


_REPRO = '''"""Fuzzer repro: {describe}"""
import os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, "tests")          # run from the repository root
from fuzzing import *                 # noqa: F401,F403
case = {case}
outcome = {run}(case)
print(outcome.kind, outcome.detail)
'''


@st.composite
def dot_cases(draw):
  shape, names, explicit = draw(meshes())
  axis_sizes = dict(zip(names, shape))
  n_b, n_m = draw(st.integers(0, 1)), draw(st.integers(0, 2))
  n_k, n_n = draw(st.integers(0, 2)), draw(st.integers(0, 2))
  if n_m + n_n + n_k == 0:
    n_k = 1
  size = st.sampled_from([8, 16, 8, 16, 24, 12, 4])
  labels = ([f"b{i}" for i in range(n_b)] + [f"m{i}" for i in range(n_m)]
            + [f"k{i}" for i in range(n_k)] + [f"n{i}" for i in range(n_n)])
  sizes = {d: draw(size) for d in labels}
  lhs_dims = tuple(draw(st.permutations([d for d in labels if d[0] in "bmk"])))
  rhs_dims = tuple(draw(st.permutations([d for d in labels if d[0] in "bkn"])))
  lhs_axes = _assign_axes(draw, lhs_dims, sizes, axis_sizes)
  rhs_axes = _assign_axes(draw, rhs_dims, sizes, axis_sizes)
  if len(names) >= 2 and draw(st.integers(0, 2)) > 0:
    lhs_axes, rhs_axes = _template(draw, lhs_dims, rhs_dims, sizes, axis_sizes,
                                   lhs_axes, rhs_axes)
  shared = [d for d in lhs_dims if d in rhs_dims]
  big = [a for a in names if axis_sizes[a] > 1]
  if shared and len(big) >= 2 and draw(st.integers(0, 3)) == 0:
    # one contracting/batch dim split over several axes, the tuple order drawn
    # independently per operand (lhs K over ("d", "x"), rhs K over ("x", "d"))
    dim = draw(st.sampled_from(shared))
    axes = draw(st.permutations(big))[:draw(st.integers(2, len(big)))]
    if sizes[dim] % int(np.prod([axis_sizes[a] for a in axes])) == 0:
      def put(dims, entries):
        entries = [tuple(a for a in e if a not in axes) for e in entries]
        entries[dims.index(dim)] = tuple(draw(st.permutations(axes)))
        return tuple(entries)
      lhs_axes, rhs_axes = put(lhs_dims, lhs_axes), put(rhs_dims, rhs_axes)
  elif draw(st.integers(0, 3)) == 0:
    # the same axes on matching dims, tuple orders shuffled independently: the
    # "K over (x, y) on lhs, (y, x) on rhs" family
    lhs_map = dict(zip(lhs_dims, lhs_axes))
    rhs_axes = tuple(tuple(draw(st.permutations(list(lhs_map[d])))) if d in lhs_map
                     else e for d, e in zip(rhs_dims, rhs_axes))
    used = [a for e in rhs_axes for a in e]
    if len(used) != len(set(used)):
      rhs_axes = tuple(tuple(draw(st.permutations(list(lhs_map[d])))) if d in lhs_map else ()
                       for d in rhs_dims)
  case = DotCase(mesh_shape=shape, mesh_names=names, explicit=explicit,
                 sizes=tuple(sorted(sizes.items())), lhs_dims=lhs_dims, rhs_dims=rhs_dims,
                 lhs_axes=lhs_axes, rhs_axes=rhs_axes, out_axes=None, out_via="jit",
                 dtype=draw(st.sampled_from(["float32", "float32", "bfloat16"])),
                 algorithm=draw(st.sampled_from(ALGORITHMS)), ksplit=draw(st.sampled_from(KSPLITS)),
                 strict=draw(st.integers(0, 9)) == 0, seed=draw(st.integers(0, 2**16)))
  if draw(st.booleans()):
    out_axes = _assign_axes(draw, case.out_dims, sizes, axis_sizes)
    out_via = "dot" if explicit else draw(st.sampled_from(["jit", "wsc"]))
    case = dataclasses.replace(case, out_axes=out_axes, out_via=out_via)
  return case


# Operand layouts of the three 2D dataflows (DESIGN.md section 4), r and c mesh axes.
LAYOUTS = {"os": (("r", "c"), ("r", "c")), "ls": (("r", "c"), ("c", "r")),
           "rs": (("c", "r"), ("r", "c"))}


def _template(draw, lhs_dims, rhs_dims, sizes, axis_sizes, lhs_axes, rhs_axes):
  """Overlay a 2D dataflow layout on the first M, K and N dims (where they exist and
  divide): the layouts the pass rewrites, with random extra axes left on other dims."""
  r, c = draw(st.permutations(list(axis_sizes)))[:2]
  (lm, lk), (rk, rn) = LAYOUTS[draw(st.sampled_from(sorted(LAYOUTS)))]
  axis = {"r": r, "c": c}
  want_l = {"m0": axis[lm], "k0": axis[lk]}
  want_r = {"k0": axis[rk], "n0": axis[rn]}

  def overlay(dims, entries, want):
    entries = [tuple(a for a in e if a not in (r, c)) for e in entries]
    for i, d in enumerate(dims):
      a = want.get(d)
      if a is not None:
        used = int(np.prod([axis_sizes[b] for b in entries[i]] or [1]))
        if sizes[d] % (used * axis_sizes[a]) == 0:
          entries[i] = draw(st.sampled_from([entries[i] + (a,), (a,) + entries[i]]))
    return tuple(entries)

  return overlay(lhs_dims, lhs_axes, want_l), overlay(rhs_dims, rhs_axes, want_r)


def _dot_step(case: DotCase, mesh):
  dn = case.dimension_numbers
  ospec = None if case.out_axes is None else NamedSharding(mesh, spec_of(case.out_axes))

  def f(a, b):
    kw = dict(out_sharding=ospec) if case.out_via == "dot" and ospec is not None else {}
    out = jax.lax.dot_general(a, b, dn, **kw)
    if case.out_via == "wsc" and ospec is not None:
      out = jax.lax.with_sharding_constraint(out, ospec)
    return out

  def step(a, b, c):
    def loss(a, b):
      out = f(a, b)
      return jnp.sum(out * c), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(a, b)
    return out, grads

  return f, step


def _site_invariants(report, n_dots):
  """Planning-only properties (cheap: no compilation)."""
  problems = []
  if len(report.sites) != n_dots:
    problems.append(f"{len(report.sites)} sites for {n_dots} dot_generals")
  for s in report.sites:
    if s.rewritten:
      if s.algorithm not in meshslice.rewrites.ALGORITHMS or not s.ksplit or s.ksplit < 1:
        problems.append(f"site {s.index} rewritten with algorithm={s.algorithm} "
                        f"ksplit={s.ksplit}")
    elif not s.reason:
      problems.append(f"site {s.index} left alone without a reason")
  return problems


def run_dot_case(case: DotCase, compare_plain: bool = False) -> Outcome:
  """Run one DotCase. The verdict is against the unsharded float64 reference. Plain jit
  is also run (compiling it doubles the cost of an example) when the transformed program
  disagrees with the reference, for a third of the examples with a rewritten site (by
  seed), and always with compare_plain; a program with nothing rewritten is the plain
  program re-bound."""
  mesh = make_mesh(case.mesh_shape, case.mesh_names, case.explicit)
  x, y, ct = case.data()
  f, step = _dot_step(case, mesh)
  ls = NamedSharding(mesh, spec_of(case.lhs_axes))
  rs = NamedSharding(mesh, spec_of(case.rhs_axes))
  try:   # what plain jax accepts (trace, shardings) defines a valid program
    xs, ys = jax.device_put(x, ls), jax.device_put(y, rs)
    if case.explicit:
      with jax.set_mesh(mesh):
        out_type = jax.eval_shape(f, xs, ys)
      cs = jax.device_put(ct, NamedSharding(mesh, out_type.sharding.spec))
      plain = jax.jit(step)
    else:
      cs = jax.device_put(ct, NamedSharding(mesh, P()))
      outs = (NamedSharding(mesh, spec_of(case.out_axes))
              if case.out_via == "jit" and case.out_axes is not None else None)
      plain = jax.jit(step, in_shardings=(ls, rs, cs.sharding),
                      out_shardings=(outs, (ls, rs)))
    _call(plain.trace, case, mesh, xs, ys, cs)
  except Exception as e:  # noqa: BLE001
    return Outcome(kind="jax-rejects", case=case, detail=f"{type(e).__name__}: {e}"[:300])
  want = case.reference(x, y, ct)
  names = ("out", "d_lhs", "d_rhs")
  try:
    transformed = meshslice.transform(plain, **case.options)
    report = _call(transformed.explain, case, mesh, xs, ys, cs)
    new = _call(transformed, case, mesh, xs, ys, cs)
    new = [new[0], *new[1]]
  except Exception as e:  # noqa: BLE001
    msg = f"{type(e).__name__}: {e}"
    if case.strict and isinstance(e, ValueError) and _INVALID_OPTION.search(str(e)):
      return Outcome(kind="invalid-option", case=case, detail=msg[:300])
    return Outcome(kind="crash", case=case,
                   detail=msg[:2000] + "\n" + traceback.format_exc()[-3000:])
  errs = errors(new, want, case.dtype)
  problems = _site_invariants(report, 3)
  plain_errs, gspmd_wrong = None, False
  if (compare_plain or (report.rewritten and case.seed % 3 == 0) or problems
      or not all(e[2] for e in errs)):
    old = _call(plain, case, mesh, xs, ys, cs)
    plain_errs = errors([old[0], *old[1]], want, case.dtype)
    gspmd_wrong = not all(e[2] for e in plain_errs)
    against_plain = errors(new, [np.asarray(v).astype(np.float32) for v in
                                 [old[0], *old[1]]], case.dtype)
    if not gspmd_wrong and not all(e[2] for e in against_plain):
      problems.append("transformed disagrees with plain jit: "
                      + _fmt_errors(against_plain, names))
    if gspmd_wrong and all(e[2] for e in against_plain):
      # plain jit is off the reference too (bf16 sums in another order, or GSPMD itself)
      # and the transformed program computes what plain jit does: nothing for the pass
      # to answer for
      errs = [(e[0], e[1], True) for e in errs]
  left = tuple(normalize_reason(s.reason) for s in report.left_alone)
  base = dict(case=case, rewritten=len(report.rewritten), left_alone=left,
              gspmd_wrong=gspmd_wrong)
  if problems or not all(e[2] for e in errs):
    plans = "; ".join(f"#{s.index} {s.algorithm} {s.dataflow} S={s.ksplit} {s.mesh_axes}"
                      for s in report.rewritten)
    plain_txt = _fmt_errors(plain_errs, names) if plain_errs else "not run"
    return Outcome(kind="wrong", **base, detail=(
        f"{'; '.join(problems)} transformed vs unsharded: {_fmt_errors(errs, names)}; "
        f"plain jit vs unsharded: {plain_txt}; rewritten: {plans}"))
  return Outcome(kind="rewritten-match" if report.rewritten else "match", **base,
                 detail=_fmt_errors(errs, names))


def _call(fn, case, mesh, *args):
  if case.explicit:
    with jax.set_mesh(mesh):
      return fn(*args)
  return fn(*args)


# ----------------------------------------------------------------------------- programs
T = 16   # tokens: rows of the activations h[T, D]


@dataclasses.dataclass(frozen=True)
class ProgramCase:
  """A small differentiated program: h[T, D] goes through `ops`; the step returns
  loss = sum(exp(sin(h))) and its gradients w.r.t. every weight and the input. (Every
  term is positive, so the loss's relative error is bounded by its terms': a sum of
  sines cancels, and reassociation alone put it 2e-4 to 5e-3 off the reference, plain
  jit's as much as the transformed program's.)

  ops (h is [T, D] between ops):
    ("dense", w, w_transposed, h_transposed, out)  h @ W (W stored [D', D] when
        w_transposed; h contracted on its dim 0 after a transpose when h_transposed);
        out: None or per-dim axis tuples of the result (Auto: a sharding constraint,
        Explicit: dot_general's out_sharding)
    ("scan", w)       lax.scan over W[2, D, D]: h = tanh(h @ W[i])
    ("remat", w)      jax.checkpoint(lambda h, W: tanh(h @ W))
    ("batched", w)    h reshaped to [2, T/2, D], contracted with W, reshaped back
    ("ew", kind)      elementwise: "tanh", "sin", "affine"
    ("wsc", entries)  sharding constraint (Auto) / reshard (Explicit) of h
  """
  mesh_shape: tuple
  mesh_names: tuple
  explicit: bool
  width: int                    # D of the input
  weights: tuple                # ((shape, axis entries), ...)
  x_axes: tuple
  ops: tuple
  wrapper: str                  # "direct" | "jit" | "make_jaxpr" | "vmap"
  out_shardings: bool           # Auto: give jit out_shardings (grads in input layouts)
  dtype: str
  algorithm: str | None
  ksplit: int | None
  seed: int = 0

  @property
  def options(self):
    return {k: v for k, v in (("algorithm", self.algorithm), ("ksplit", self.ksplit))
            if v is not None}

  def describe(self) -> str:
    ws = ", ".join(f"{list(s)} {_spec_src(e)}" for s, e in self.weights)
    return (f"mesh {dict(zip(self.mesh_names, self.mesh_shape))} "
            f"{'Explicit' if self.explicit else 'Auto'}; x [{T},{self.width}] "
            f"{_spec_src(self.x_axes)}; weights {ws}; ops {list(self.ops)}; "
            f"wrapper {self.wrapper}; {self.dtype}; options {self.options}")

  def repro(self) -> str:
    return _REPRO.format(describe=self.describe(), case=repr(self), run="run_program_case")

  def data(self):
    rng = np.random.RandomState(self.seed)
    dt = jnp.dtype(self.dtype)
    lead = (2,) if self.wrapper == "vmap" else ()
    mk = lambda s, scale: (scale * rng.standard_normal(s)).astype(np.float32).astype(dt)
    ws = [mk(s, 1.0 / np.sqrt(s[-2] if len(s) > 1 else 1.0)) for s, _ in self.weights]
    return ws, mk(lead + (T, self.width), 1.0)


@st.composite
def program_cases(draw):
  shape, names, explicit = draw(meshes())
  if len(shape) == 1 or draw(st.booleans()):      # mostly 2D meshes: where sites are
    shape, names = draw(st.sampled_from([((2, 2), ("x", "y")), ((2, 4), ("x", "y")),
                                         ((4, 2), ("x", "y")), ((2, 2, 2), ("d", "x", "y"))]))
  axis_sizes = dict(zip(names, shape))
  r, c = draw(st.permutations(list(names)))[:2]
  width = draw(st.sampled_from([8, 16]))
  x_axes = draw(st.sampled_from([((r,), (c,)), ((c,), (r,)), ((r,), ())]))
  if draw(st.integers(0, 3)) == 0:
    x_axes = _assign_axes(draw, ("t", "d"), {"t": T, "d": width}, axis_sizes)
  ops, weights, d = [], [], width
  n_dots = draw(st.integers(2, 4))
  while sum(op[0] in ("dense", "scan", "remat", "batched") for op in ops) < n_dots:
    kind = draw(st.sampled_from(["dense", "dense", "scan", "remat", "batched", "ew", "wsc"]))
    if kind == "ew":
      ops.append(("ew", draw(st.sampled_from(["tanh", "sin", "affine"]))))
      continue
    if kind == "wsc":
      ops.append(("wsc", _assign_axes(draw, ("t", "d"), {"t": T, "d": d}, axis_sizes)))
      continue
    d_out = d if kind == "scan" else draw(st.sampled_from([8, 16]))
    wt = kind == "dense" and draw(st.booleans())
    w_shape = (d_out, d) if wt else (d, d_out)
    labels = ("o", "i") if wt else ("i", "o")
    if draw(st.booleans()):      # the usual 2D weight layout [in:r, out:c]
      w_axes = tuple((r,) if l == "i" else (c,) for l in labels)
      w_axes = tuple(e if (dict(zip(labels, w_shape))[l] % axis_sizes[e[0]] == 0) else ()
                     for l, e in zip(labels, w_axes))
    else:
      w_axes = _assign_axes(draw, labels, dict(zip(labels, w_shape)), axis_sizes)
    if kind == "scan":
      w_shape, w_axes = (2,) + w_shape, ((),) + w_axes
    weights.append((w_shape, w_axes))
    w = len(weights) - 1
    if kind == "dense":
      out = None
      if draw(st.booleans()):
        out = draw(st.sampled_from([((r,), (c,)), ((c,), (r,)), ((r,), ()), ((), (c,))]))
        if d_out % axis_sizes[out[1][0]] if out[1] else False:
          out = None
      ops.append(("dense", w, wt, draw(st.integers(0, 3)) == 0, out))
    else:
      ops.append((kind, w))
    d = d_out
  return ProgramCase(
      mesh_shape=shape, mesh_names=names, explicit=explicit, width=width,
      weights=tuple(weights), x_axes=x_axes, ops=tuple(ops),
      wrapper=draw(st.sampled_from(["direct", "direct", "jit", "make_jaxpr", "vmap"])),
      out_shardings=draw(st.booleans()),
      dtype=draw(st.sampled_from(["float32", "float32", "float32", "bfloat16"])),
      algorithm=draw(st.sampled_from(ALGORITHMS)), ksplit=draw(st.sampled_from(KSPLITS)),
      seed=draw(st.integers(0, 2**16)))


def _program_fn(case: ProgramCase, mesh):
  """loss(weights, x) of the program; mesh None: the unsharded reference (no constraints,
  no reshards, no out_sharding)."""
  explicit = case.explicit and mesh is not None

  def constrain(h, entries):
    if mesh is None or entries is None:
      return h
    if explicit:
      return jax.sharding.reshard(h, spec_of(entries))
    return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, spec_of(entries)))

  def matmul(h, w, dn, out=None, same_as_h=False):
    """dot_general; Explicit: w's contracting dim takes h's layout (jax requires
    consistent contracting shardings) and out becomes out_sharding."""
    kw = {}
    if explicit:
      (hc, wc), _ = dn
      hspec = list(jax.typeof(h).sharding.spec) + [None] * h.ndim
      wspec = list(jax.typeof(w).sharding.spec) + [None] * w.ndim
      want = hspec[hc[0]]
      if wspec[wc[0]] != want:
        wanted = [None if (i != wc[0] and _overlap(s, want)) else s
                  for i, s in enumerate(wspec[:w.ndim])]
        wanted[wc[0]] = want
        w = jax.sharding.reshard(w, P(*wanted))
      if out is not None:
        kw["out_sharding"] = spec_of(out)
      elif same_as_h:       # a scan carry keeps its type
        kw["out_sharding"] = jax.typeof(h).sharding.spec
      else:                 # free dims keep their axes (jax wants contracted ones named)
        wspec = list(jax.typeof(w).sharding.spec) + [None] * w.ndim
        free = ([s for i, s in enumerate(hspec[:h.ndim]) if i not in hc]
                + [s for i, s in enumerate(wspec[:w.ndim]) if i not in wc])
        seen, entries = set(), []
        for s in free:
          axes = () if s is None else (s if isinstance(s, tuple) else (s,))
          entries.append(None if set(axes) & seen else s)
          seen.update(axes)
        kw["out_sharding"] = P(*entries)
    y = jax.lax.dot_general(h, w, dn, **kw)
    return y if explicit else constrain(y, out)

  def reshape(h, shape):
    """Explicit: [T, D] <-> [2, T/2, D] keeping the T and D axes where they divide."""
    if not explicit:
      return h.reshape(shape)
    spec = list(jax.typeof(h).sharding.spec) + [None] * h.ndim
    spec = spec[:h.ndim]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    size = lambda s: int(np.prod([sizes[a] for a in ((s,) if isinstance(s, str) else s)]))
    t_spec, d_spec = (spec[0], spec[1]) if h.ndim == 2 else (spec[1], spec[2])
    if len(shape) == 3 and t_spec is not None and shape[1] % size(t_spec):
      h = jax.sharding.reshard(h, P(None, d_spec))
      t_spec = None
    if len(shape) == 3:
      out = P(None, t_spec, d_spec)
    else:
      out = P(t_spec, d_spec)
    return jax.lax.reshape(h, shape, out_sharding=out)

  def dense(h, w, wt, ht, out):
    hc = 0 if ht else 1
    if ht:
      h = h.T
    dn = (((hc,), (1 if wt else 0,)), ((), ()))
    y = matmul(h, w, dn, out)
    return y

  def loss(weights, x):
    h = x
    for op in case.ops:
      kind = op[0]
      if kind == "dense":
        h = dense(h, weights[op[1]], op[2], op[3], op[4])
      elif kind == "scan":
        def body(h, w):
          return jnp.tanh(matmul(h, w, (((1,), (0,)), ((), ())), same_as_h=True)), None
        h, _ = jax.lax.scan(body, h, weights[op[1]])
      elif kind == "remat":
        h = jax.checkpoint(lambda h, w: jnp.tanh(matmul(h, w, (((1,), (0,)), ((), ())))))(
            h, weights[op[1]])
      elif kind == "batched":
        t, dd = h.shape
        h3 = reshape(h, (2, t // 2, dd))
        y = matmul(h3, weights[op[1]], (((2,), (0,)), ((), ())))
        h = reshape(y, (t, y.shape[-1]))
      elif kind == "ew":
        h = {"tanh": jnp.tanh, "sin": jnp.sin,
             "affine": lambda v: 1.5 * v + 0.25}[op[1]](h)
      elif kind == "wsc":
        h = constrain(h, op[1])
    return jnp.sum(jnp.exp(jnp.sin(h.astype(jnp.float32))))

  def step(weights, x):
    return jax.value_and_grad(loss, argnums=(0, 1))(weights, x)

  return step


def _overlap(a, b):
  as_set = lambda s: set() if s is None else set(s if isinstance(s, tuple) else (s,))
  return bool(as_set(a) & as_set(b))


def _wrap(case, fn, n_weights):
  """Call `fn(weights, x)` the way the case's wrapper says."""
  if case.wrapper == "jit":
    return jax.jit(fn)
  if case.wrapper == "make_jaxpr":
    def run(weights, x):
      closed = jax.make_jaxpr(fn)(weights, x)
      flat = jax.tree.leaves((weights, x))
      outs = jax.jit(lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a))(*flat)
      return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, weights, x)), outs)
    return run
  if case.wrapper == "vmap":
    return jax.vmap(fn, in_axes=(None, 0))
  return fn


def run_program_case(case: ProgramCase, compare_plain: bool = False) -> Outcome:
  """Run one ProgramCase. Plain jit (compile time) runs for bfloat16 (its error sets the
  tolerance), when the transformed program disagrees with the unsharded reference, or
  with compare_plain."""
  mesh = make_mesh(case.mesh_shape, case.mesh_names, case.explicit)
  ws, x = case.data()
  lead = (None,) if case.wrapper == "vmap" else ()
  step = _program_fn(case, mesh)
  w_sh = [NamedSharding(mesh, spec_of(e)) for _, e in case.weights]
  x_sh = NamedSharding(mesh, spec_of(case.x_axes))
  x_put = NamedSharding(mesh, P(*lead, *spec_of(case.x_axes)))

  def ctx():
    return jax.set_mesh(mesh) if case.explicit else _nullctx()

  try:
    wss = [jax.device_put(w, s) for w, s in zip(ws, w_sh)]
    xs = jax.device_put(x, x_put)
    if case.explicit:
      plain = jax.jit(step)
    else:
      out_sh = ((NamedSharding(mesh, P()), (w_sh, x_sh)) if case.out_shardings else None)
      plain = jax.jit(step, in_shardings=(w_sh, x_sh), out_shardings=out_sh)
    with ctx():
      jax.eval_shape(_wrap(case, plain, len(ws)), wss, xs)
  except Exception as e:  # noqa: BLE001
    return Outcome(kind="jax-rejects", case=case, detail=f"{type(e).__name__}: {e}"[:300])
  with jax.default_device(jax.devices()[0]):
    ref_step = _wrap(case, jax.jit(_program_fn(case, None)), len(ws))
    want = [np.asarray(v, np.float64) for v in jax.tree.leaves(
        ref_step([np.asarray(w, np.float32) for w in ws], np.asarray(x, np.float32)))]
  try:
    transformed = meshslice.transform(plain, **case.options)
    with ctx():
      new = jax.tree.leaves(_wrap(case, transformed, len(ws))(wss, xs))
      report = None if case.wrapper == "vmap" else transformed.explain(wss, xs)
  except Exception as e:  # noqa: BLE001
    return Outcome(kind="crash", case=case, detail=f"{type(e).__name__}: {e}"[:2000] + "\n"
                   + traceback.format_exc()[-3000:])
  names = ["loss"] + [f"d_w{i}" for i in range(len(ws))] + ["d_x"]
  errs = errors(new, want, case.dtype)
  plain_errs = gspmd_wrong = None
  rewritten = len(report.rewritten) if report is not None else -1
  if compare_plain or case.dtype == "bfloat16" or not all(e[2] for e in errs):
    with ctx():
      old = jax.tree.leaves(_wrap(case, plain, len(ws))(wss, xs))
    plain_errs = errors(old, want, case.dtype)
    gspmd_wrong = not all(e[2] for e in plain_errs)
    if case.dtype == "bfloat16":
      errs = [(e[0], e[1], e[2] or (p[2] and e[1] <= 4 * p[1]) or e[1] <= 4 * p[1])
              for e, p in zip(errs, plain_errs)]
  left = () if report is None else tuple(normalize_reason(s.reason) for s in report.left_alone)
  base = dict(case=case, rewritten=max(rewritten, 0), left_alone=left,
              gspmd_wrong=bool(gspmd_wrong))
  if not all(e[2] for e in errs):
    plans = "" if report is None else "; ".join(
        f"#{s.index} {s.algorithm} {s.dataflow} S={s.ksplit} {s.mesh_axes}"
        for s in report.rewritten)
    return Outcome(kind="wrong", **base, detail=(
        f"transformed vs unsharded: {_fmt_errors(errs, names)}; plain jit vs unsharded: "
        f"{_fmt_errors(plain_errs, names)}; rewritten: {plans}"))
  return Outcome(kind="rewritten-match" if rewritten else "match", **base,
                 detail=_fmt_errors(errs, names))


class _nullctx:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False
