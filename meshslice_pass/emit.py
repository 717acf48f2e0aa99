"""Emission: an interpreter that re-stages every equation of the traced program, replacing
planned dot_generals with shard_map calls built from `meshslice.rewrites`.

Sub-jaxprs that contain a rewritten site (jit, scan, while, cond, remat, custom_jvp/vjp
bodies) are re-traced through the same interpreter and the higher-order primitive is
re-bound with the new body; sub-jaxprs without sites are kept untouched. Existing
shard_maps are left as they are.

What is cheap to re-use is re-used, so that the pass costs well under the plain
lowering: equations whose inputs keep their types are staged as they are rather
than re-bound; sites with the same plan and operand types share one traced shard_map,
copied into the program at each site; a sub-jaxpr object that JAX shares between calls
(every block of an unrolled `jax.checkpoint` model) is rewritten once per distinct set of
plans inside it.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, NamedSharding

from meshslice.rewrites import GemmGeometry, build_body, build_summed_body, summable
from meshslice.rewrites.nesting import in_own_computation
from meshslice.rewrites.platform import target_platform
from meshslice.rewrites.slicing import not_before

from . import specs as S
from .matmul_sums import shared_reductions
from ._jax_internals import (ClosedJaxpr, Literal, bind, copy_eqn, eqn_context, higher_order,
                             hoist_consts, inline_closed, rebind_context, retrace,
                             scan_params_with_consts, sub_jaxprs, trace_once, while_counts,
                             while_params_with_consts)

# Re-binding a higher-order primitive with rewritten bodies, by its `HIGHER_ORDER` kind.
_HANDLERS = {}


def handler(*kinds):
  def register(fn):
    for kind in kinds:
      _HANDLERS[kind] = fn
    return fn
  return register


class Emitter:
  """Evaluates a traced program with the planned sites rewritten."""

  def __init__(self, sites, mesh, nest_sites=True):
    self.mesh = mesh
    on_cpu = target_platform(mesh) == "cpu"
    # The weight-gradient tie (`_gathers_wait`): by default on the CPU compiler only
    # (see `_holds_gathers_back`); a site's `hold_gathers` (option or pin) decides it.
    self.ties_gathers = on_cpu
    # Running each pipelined site as its own computation (`_nests`) pays on the CPU
    # compiler only; not when the program may be transformed further (`nest_sites`
    # False): JAX 0.10.2 fails to differentiate a `cond` inside a shard_map under
    # vmap(spmd_axis_name=...).
    self.nests_pipelines = on_cpu and nest_sites
    self._traced = {}
    self._bodies = {}
    self.plans = {s.path: s for s in sites if s.rewritten}
    # every path prefix that leads to a rewritten site: only those sub-jaxprs are re-traced
    self.live = {p[:k] for p in self.plans for k in range(1, len(p))}
    # for each such prefix, what the sites below it were planned as, relative to it
    self._below = {}
    for path, site in self.plans.items():
      for k in range(1, len(path)):
        self._below.setdefault(path[:k], set()).add((path[k:], self._plan_key(site)))

  def _ties(self, site) -> bool:
    """Whether `site`'s gathers wait for its other operand (`_gathers_wait`)."""
    if site.hold_gathers is not None:
      return site.hold_gathers and site.swapped
    return self.ties_gathers and _holds_gathers_back(site)

  def _nests(self, site) -> bool:
    """Whether `site` runs as its own computation (`rewrites.nesting`): on the CPU
    compiler, pipelined sites (any algorithm but the collective one). It shortens the
    compile and lowers temp memory at some step time (docs/benchmarks-log.md, "Pass cost,
    XLA compile and temp memory")."""
    return self.nests_pipelines and site.algorithm != "collective"

  def _plan_key(self, site):
    """What the emitted code of a planned site depends on besides its operand types."""
    return (site.algorithm, site.geometry, site.ksplit, site.reduce_scatter, site.specs,
            site.swapped, self._ties(site), self._nests(site))

  def run(self, closed: ClosedJaxpr, *args):
    return self.eval(closed.jaxpr, closed.consts, args, ())

  def eval(self, jaxpr, consts, args, prefix):
    env = {}

    def read(v):
      return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    folded = {}  # index of a reshape folded into its site -> the site's reshaped result
    has_sites = any(prefix + (i,) in self.plans for i in range(len(jaxpr.eqns)))
    users = _users(jaxpr) if has_sites else {}
    # sums of sites planned alike, each emitted at its last add with one reduce-scatter;
    # their terms and inner adds are not emitted on their own
    sums = self._shared_sums(jaxpr, prefix) if has_sites else {}
    deferred = {j for terms, adds in sums.values() for j in terms + adds}
    for i, eqn in enumerate(jaxpr.eqns):
      if i in folded:
        env[eqn.outvars[0]] = folded.pop(i)
        continue
      if i in deferred:
        continue
      path = prefix + (i,)
      if i in sums:
        terms = [jaxpr.eqns[j] for j in sums[i][0]]
        with rebind_context(eqn), eqn_context(terms[0]):
          out = self.rewrite_sum([self.plans[prefix + (j,)] for j in sums[i][0]], terms,
                                 [tuple(read(v) for v in t.invars) for t in terms])
        env[eqn.outvars[0]] = out
        continue
      invals = [read(v) for v in eqn.invars]
      with rebind_context(eqn), eqn_context(eqn):
        if path in self.plans:
          site = self.plans[path]
          reshape = _heads_reshape(jaxpr, i, site, users, self.mesh.shape)
          if reshape is not None:
            j, head_size = reshape
            folded[j] = self.rewrite(site, eqn, *invals, head_size=head_size)
            continue
          outs = [self.rewrite(site, eqn, *invals)]
        elif any(prefix + ((i, p, b),) in self.live
                 for (p, b), _ in sub_jaxprs(eqn)):
          outs = _HANDLERS[higher_order(eqn).kind](self, eqn, invals, prefix + (i,))
        else:
          outs = copy_eqn(eqn, invals)
          if outs is None:
            outs = bind(eqn, invals)
      for v, x in zip(eqn.outvars, outs):
        env[v] = x
    return [read(v) for v in jaxpr.outvars]

  def rewrite_sum(self, sites, eqns, operands):
    """The sum of the results of `sites` (their `eqns`, `operands` their (lhs, rhs)
    values) with one reduce-scatter for all (`matmul_sums.shared_reductions` found them
    planned alike)."""
    site, eqn = sites[0], eqns[0]
    lhs_spec, rhs_spec, out_spec = site.specs
    if site.swapped:
      operands = [(rhs, lhs) for lhs, rhs in operands]
    flat = [x for pair in operands for x in pair]
    key = ("sum", len(sites)) + self._plan_key(site) + tuple(jax.typeof(x) for x in flat)
    traced = self._traced.get(key)
    if traced is None:
      options = {"scatter": site.reduce_scatter} if site.reduce_scatter else {}
      body = build_summed_body(site.algorithm, site.geometry, site.ksplit, len(sites),
                               **options)
      if self._nests(site):
        body = in_own_computation(body)
      in_specs = (S.to_partition_spec(lhs_spec), S.to_partition_spec(rhs_spec)) * len(sites)
      mapped = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                             out_specs=S.to_partition_spec(out_spec))

      def call(*xs):
        return [mapped(*(_reshard_explicit(v, spec) for v, spec in zip(xs, in_specs)))]

      traced = self._traced[key] = trace_once(call, *flat)
    out, = inline_closed(traced, *flat)
    return self._as_original(site, eqn, out)

  def _as_original(self, site, eqn, out):
    """A site's local result as the original equation returns it: transposed back if the
    site was planned swapped, in the result layout it was typed with."""
    if site.swapped:
      lhs, rhs = (v.aval for v in eqn.invars)
      (lc, _), (lb, _) = eqn.params["dimension_numbers"]
      nb, nl = len(lb), lhs.ndim - len(lc) - len(lb)
      nr = rhs.ndim - len(lc) - len(lb)
      out = jax.lax.transpose(out, tuple(range(nb)) + tuple(range(nb + nr, nb + nr + nl))
                              + tuple(range(nb, nb + nr)))
    # Explicit mode: the rest of the program was typed with the original result layout.
    want = getattr(eqn.outvars[0].aval, "sharding", None)
    if isinstance(want, NamedSharding) and _is_explicit(want):
      out = _reshard_explicit(out, want.spec)
    return out

  def rewrite(self, site, eqn, lhs, rhs, head_size=None):
    lhs_spec, rhs_spec, out_spec = site.specs
    if site.swapped:
      # planned as rhs . lhs, which is the transpose of the original result
      lhs, rhs = rhs, lhs
    if head_size is not None:
      # the result's last dim split into (heads, head_size): split the rhs's free dim
      # the same way, so that the local dot writes the 4-d result itself and XLA can
      # lay it out for its consumer (as it does when it folds the reshape into the dot)
      rhs = rhs.reshape(rhs.shape[:-1] + (rhs.shape[-1] // head_size, head_size))
      rhs_spec = tuple(rhs_spec) + ((),)
      out_spec = tuple(out_spec) + ((),) * (eqn.outvars[0].aval.ndim + 1 - len(out_spec))
    # Sites with the same plan and operand types (Q/K/V projections, a checkpointed
    # block's recomputation) share one traced shard_map: tracing is the pass's main cost.
    key = self._plan_key(site) + (jax.typeof(lhs), jax.typeof(rhs), head_size)
    traced = self._traced.get(key)
    if traced is None:
      options = {"scatter": site.reduce_scatter} if site.reduce_scatter else {}
      body = build_body(site.algorithm, site.geometry, site.ksplit, **options)
      if self._nests(site):
        body = in_own_computation(body)
      if self._ties(site):
        body = _gathers_wait(body, site.geometry)
      in_specs = (S.to_partition_spec(lhs_spec), S.to_partition_spec(rhs_spec))
      mapped = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                             out_specs=S.to_partition_spec(out_spec))

      def call(a, b):
        # A plan may reshard an operand first (another dataflow pays off). Auto mode:
        # the shard_map's in_specs make GSPMD do it; Explicit mode: types must match.
        a, b = (_reshard_explicit(v, spec) for v, spec in zip((a, b), in_specs))
        return [mapped(a, b)]

      traced = self._traced[key] = trace_once(call, lhs, rhs)
    out, = inline_closed(traced, lhs, rhs)
    return self._as_original(site, eqn, out)

  def _shared_sums(self, jaxpr, prefix) -> dict:
    """The sums of `jaxpr` whose terms planning said share one reduce-scatter
    (`Site.shared_reduction`), found again here (`matmul_sums.shared_reductions`) with
    the emitter's own plan key, in the result layout the sites return (not Explicit
    mode's retyped results)."""
    def key_of(i):
      site = self.plans.get(prefix + (i,))
      if site is None or not site.shared_reduction or not summable(site.algorithm,
                                                                  site.geometry):
        return None
      eqn = jaxpr.eqns[i]
      if any(_is_explicit(getattr(v.aval, "sharding", None)) for v in eqn.outvars):
        return None
      return ((site.shared_reduction,) + self._plan_key(site)
              + tuple((v.aval.shape, v.aval.dtype) for v in eqn.invars))
    return shared_reductions(jaxpr, key_of)

  def subjaxpr(self, closed_or_open, prefix_key):
    """Re-trace a sub-jaxpr through this interpreter; returns a ClosedJaxpr.

    JAX traces a `jax.checkpoint`-ed function once and gives every call the same body
    object (the 64 backward blocks of an unrolled model share one), so a body re-traced
    with the same plans below it is re-used: same jaxpr object, same input types, same
    plan for every site inside, hence the same rewritten body.
    """
    if isinstance(closed_or_open, ClosedJaxpr):
      jaxpr, consts = closed_or_open.jaxpr, closed_or_open.consts
    else:
      jaxpr, consts = closed_or_open, ()
    avals = [v.aval for v in jaxpr.invars]
    key = (id(closed_or_open), tuple(avals), frozenset(self._below.get(prefix_key, ())))
    cached = self._bodies.get(key)
    if cached is not None and cached[0] is closed_or_open:
      return cached[1]
    fun = lambda *a: self.eval(jaxpr, consts, a, prefix_key)
    new = retrace(fun, avals, jaxpr.debug_info)
    # the original is kept in the value so that its id cannot be reused by another object
    self._bodies[key] = (closed_or_open, new)
    return new


# The algorithms whose os body takes an rhs with its free dim split (`_heads_reshape`).
_SPLITS_RHS = ("collective", "meshslice")


def _users(jaxpr) -> dict:
  """{id of a variable: indices of the equations that read it}, once per jaxpr."""
  users = {}
  for j, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, Literal):
        users.setdefault(id(v), []).append(j)
  return users


def _heads_reshape(jaxpr, i, site, users, axis_sizes):
  """(index, head size) of the reshape that follows site `i` when the site can write its
  result already split; None otherwise. `users`: `_users(jaxpr)`.

  The pattern is attention's projection: `(x @ wq).reshape(b, s, heads, head)`. XLA folds
  such a reshape into the dot (the weight's free dim is split, the dot writes the 4-d
  result) and lays the result out for the scores matmul; behind a shard_map boundary it
  cannot, and libtpu relayouts q and k inside the scores fusion, which then no longer
  fuses with the softmax: more compute and a higher peak (docs/design.md, "Algorithms";
  docs/benchmarks-log.md, "The headline now: projections that write attention heads
  themselves"). So the site does the split itself, when it is an os site of an algorithm
  that gathers whole operand slices, the reshape is its result's only use, splits only
  the last dim (the rhs's only free dim), and the heads divide over that dim's mesh axes.
  """
  eqn, geometry = jaxpr.eqns[i], site.geometry
  if (site.swapped or site.algorithm not in _SPLITS_RHS
      or getattr(geometry, "dataflow", None) != "os"):
    return None
  (_, rhs_contract), (_, rhs_batch) = geometry.dimension_numbers
  rhs_ndim = eqn.invars[1].aval.ndim
  if [d for d in range(rhs_ndim) if d not in (*rhs_contract, *rhs_batch)] != [rhs_ndim - 1]:
    return None
  out = eqn.outvars[0]
  if _is_explicit(getattr(out.aval, "sharding", None)) or any(v is out for v in jaxpr.outvars):
    return None
  readers = users.get(id(out), [])
  if len(readers) != 1 or jaxpr.eqns[readers[0]].primitive.name != "reshape":
    return None
  reshape = jaxpr.eqns[readers[0]]
  old, new = tuple(out.aval.shape), tuple(reshape.params["new_sizes"])
  if (reshape.params.get("dimensions") is not None or len(new) != len(old) + 1
      or new[:-2] != old[:-1] or new[-2] * new[-1] != old[-1]):
    return None
  specs = site.specs
  last = specs[2][len(old) - 1] if len(specs[2]) >= len(old) else ()
  rhs_last = specs[1][rhs_ndim - 1] if len(specs[1]) >= rhs_ndim else ()
  if tuple(last) != tuple(rhs_last) or new[-2] % math.prod(axis_sizes[a] for a in last):
    return None
  return readers[0], new[-1]


def _holds_gathers_back(site) -> bool:
  """Whether `site`'s gathers wait for its other operand (`_gathers_wait`) by default
  (option hold_gathers="auto"), when the target is the CPU compiler: weight gradients
  (swapped sites) outside loop bodies. The option or a pin decides otherwise: holding
  weight gradients back inside a scanned layer trades a little step time for a lower
  peak on the TPU compiler (docs/benchmarks-log.md), so the measurements behind this
  default hold for the plans they were taken on, not every plan.

  Inside a `scan` / `while` body a hoisted gather stays within its iteration, and there
  the tie costs more than it saves: on the TPU compiler it stops XLA from sharing the
  slices and gathers of x between sites. TPU targets never tie: libtpu's scheduler does
  not hoist the gathers the way the CPU compiler's does, so the tie only costs it memory
  and compute (both: docs/benchmarks-log.md, "Pass cost, XLA compile and temp memory")."""
  return site.swapped and not _in_loop(site)


def _in_loop(site) -> bool:
  """Whether `site` is inside a `scan` or `while` body."""
  return bool({"scan", "while"} & set(site.scopes))


# Which operands a 2D dataflow communicates (gathers or passes around the ring).
_MOVING = {"os": (True, True), "ls": (False, True), "rs": (True, False)}


def _gathers_wait(body, geometry):
  """`body` with each communicated operand held back until the other operand exists.

  Used for weight gradients outside loops (`_holds_gathers_back`): the forward activation
  they gather is ready long before the cotangent, and XLA would otherwise hoist its
  gather (and the checkpointed recomputation) into the forward pass, each gathered copy
  live until its backward; held back, an unrolled step's temp memory falls below plain
  jit's on CPU (docs/benchmarks-log.md, "Pass cost, XLA compile and temp memory"). Values
  are bit for bit the same (`rewrites.slicing.not_before`)."""
  if not isinstance(geometry, GemmGeometry):
    return body
  lhs_moves, rhs_moves = _MOVING[geometry.dataflow]

  def held_back(lhs, rhs):
    return body(not_before(lhs, rhs) if lhs_moves else lhs,
                not_before(rhs, lhs) if rhs_moves else rhs)

  return held_back


def _reshard_explicit(value, spec):
  """Explicit mode: give `value` exactly the type `spec` (a shard_map checks its in_specs
  against the types, size-1 axes included, which the analysis drops)."""
  sharding = jax.typeof(value).sharding
  if (isinstance(sharding, NamedSharding) and _is_explicit(sharding)
      and _entries(sharding.spec, value.ndim) != _entries(spec, value.ndim)):
    return jax.sharding.reshard(value, spec)
  return value


def _entries(pspec, ndim):
  entries = list(pspec) + [None] * (ndim - len(pspec))
  return tuple(() if e is None else (e if isinstance(e, tuple) else (e,)) for e in entries)


def _is_explicit(sharding):
  mesh = getattr(sharding, "mesh", None)
  return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def _body_key(path, param, branch=0):
  """The path key of a sub-jaxpr of the equation at `path` (as `Site.path` spells it)."""
  return path[:-1] + ((path[-1], param, branch),)


@handler("call")
def _call(em, eqn, invals, path):
  """jit, remat, custom_jvp/vjp: the body re-traced; an open body (remat's) takes the
  consts of the new one as leading operands."""
  h = higher_order(eqn)
  param, = h.bodies
  new = em.subjaxpr(eqn.params[param], _body_key(path, param))
  if h.closed:
    return bind(eqn, invals, dict(eqn.params, **{param: new}))
  jaxpr, consts = hoist_consts(new)
  return bind(eqn, consts + list(invals), dict(eqn.params, **{param: jaxpr}))


@handler("cond")
def _cond(em, eqn, invals, path):
  branches = tuple(em.subjaxpr(br, _body_key(path, "branches", b))
                   for b, br in enumerate(eqn.params["branches"]))
  return bind(eqn, invals, dict(eqn.params, branches=branches))


@handler("scan")
def _scan(em, eqn, invals, path):
  p = eqn.params
  new = em.subjaxpr(p["jaxpr"], _body_key(path, "jaxpr"))
  jaxpr, consts = hoist_consts(new)
  params = scan_params_with_consts(p, len(consts), ClosedJaxpr(jaxpr, ()))
  return bind(eqn, consts + list(invals), params)


@handler("while")
def _while(em, eqn, invals, path):
  p = eqn.params
  cn, bn = while_counts(p)
  body, body_consts = hoist_consts(em.subjaxpr(p["body_jaxpr"], _body_key(path, "body_jaxpr")))
  cond, cond_consts = hoist_consts(em.subjaxpr(p["cond_jaxpr"], _body_key(path, "cond_jaxpr")))
  operands = (cond_consts + list(invals[:cn]) + body_consts + list(invals[cn:cn + bn])
              + list(invals[cn + bn:]))
  params = while_params_with_consts(p, len(cond_consts), ClosedJaxpr(cond, ()),
                                    len(body_consts), ClosedJaxpr(body, ()))
  return bind(eqn, operands, params)
