"""Sharding analysis: the layout of every variable of a jaxpr, in both JAX modes.

Explicit mode: every aval carries its NamedSharding, so the layout is read off the type.
Auto mode: avals say nothing; layouts come from jit in/out shardings, sharding
constraints, device_put and shard_map specs, and are propagated forward *and* backward
through the common primitives until nothing changes. Unknown stays unknown.

Correctness never depends on this analysis: a rewritten site's shard_map pins its own
operand and result layouts, and GSPMD reshards around it if the guess was off. The
analysis only decides which sites are worth rewriting and how.

Rules are registered per primitive with `@rule("name", ...)`. A rule receives the
current in/out specs (None = unknown) and returns its best guess for all of them; the
driver only fills unknowns, so rules never overwrite what is already known.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from . import matching
from . import specs as S
from .validation import layout_reason
from ._jax_internals import (ClosedJaxpr, Literal, consts_of, higher_order, open_jaxpr,
                             scan_counts, traversed_names, while_counts)
from ._jax_internals import sub_jaxprs as sub_jaxprs   # re-exported: callers read it here

_RULES = {}
_MAX_SWEEPS = 6


def rule(*names):
  def register(fn):
    for n in names:
      _RULES[n] = fn
    return fn
  return register


@dataclasses.dataclass
class JaxprAnalysis:
  """Specs of one (sub-)jaxpr's variables, plus the analyses of its sub-jaxprs keyed by
  (eqn index, param name, branch index)."""
  specs: dict
  children: dict
  boundary: tuple = ()


@dataclasses.dataclass(frozen=True)
class Context:
  axis_sizes: dict          # mesh axis name -> size, in mesh order
  # Sub-jaxpr analyses by (body, analysis it continued from, boundary specs). JAX gives
  # every call of a `jax.checkpoint`-ed function the same body object, so the identical
  # layers of an unrolled model are analysed once; analyses are never changed after they
  # are made (a re-analysis continues from a copy), which makes sharing them safe. Also
  # the results of the pure layout checks, by their arguments.
  memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


def _shape(v):
  return tuple(getattr(v.aval, "shape", ()))


def _explicit_spec(aval, axis_sizes):
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not getattr(mesh, "axis_names", ()):
    return None
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return None
  return S.from_partition_spec(sharding.spec, len(aval.shape), axis_sizes)


def _value_spec(value, ndim, ctx):
  """The layout of a concrete value the program holds (a constant the step closes over,
  or a literal): its own `jax.Array.sharding` when that is a NamedSharding over this
  mesh's axes; numpy values, scalars and arrays on one device (or fully replicated) are
  the same on every device, i.e. replicated; anything else is unknown (None)."""
  if not ndim:
    return S.replicated(0)
  if isinstance(value, jax.core.Tracer):
    return None     # a value of an enclosing trace: its layout is not ours to read
  sharding = getattr(value, "sharding", None)
  if isinstance(sharding, NamedSharding):
    if S.named_axes(sharding.spec) <= set(ctx.axis_sizes):
      return S.from_partition_spec(sharding.spec, ndim, ctx.axis_sizes)
    return None     # sharded over axes this mesh does not have: unknown
  if sharding is None or getattr(sharding, "is_fully_replicated", False):
    return S.replicated(ndim)
  return None       # another kind of sharding (e.g. GSPMDSharding) that splits the value


def _const_specs(jaxpr, consts, ctx):
  """Specs of a jaxpr's constvars from the constant values (`ClosedJaxpr.consts`)."""
  if len(consts) != len(jaxpr.constvars):
    return [S.replicated(len(_shape(v))) for v in jaxpr.constvars]
  return [_value_spec(c, len(_shape(v)), ctx) for v, c in zip(jaxpr.constvars, consts)]


def analyze(closed: ClosedJaxpr, in_specs, out_specs, ctx: Context) -> JaxprAnalysis:
  """Analyse a closed jaxpr given (possibly None) specs for its inputs and outputs.

  The constants it closes over (`closed.consts`, e.g. a sharded weight the step reads
  from an enclosing scope) carry their own arrays' shardings."""
  return _analyze(closed.jaxpr, list(in_specs), list(out_specs), ctx, None,
                  _const_specs(closed.jaxpr, consts_of(closed), ctx))


def _analyze(jaxpr, in_specs, out_specs, ctx, previous, const_specs=None):
  if previous is None:
    state = JaxprAnalysis(specs={}, children={})
  else:     # copy: `previous` may be shared by other equations with the same body
    state = JaxprAnalysis(specs=dict(previous.specs), children=dict(previous.children))
  specs = state.specs

  def get(v):
    if isinstance(v, Literal):
      return _value_spec(v.val, len(np.shape(v.val)), ctx)
    if v in specs:
      return specs[v]
    explicit = _explicit_spec(v.aval, ctx.axis_sizes)
    if explicit is not None:
      specs[v] = explicit
    return explicit

  changed = False

  def put(v, spec):
    nonlocal changed
    if spec is None or isinstance(v, Literal) or v in specs:
      return
    explicit = _explicit_spec(v.aval, ctx.axis_sizes)
    if explicit is not None:
      spec = explicit   # Explicit mode: the type in the program wins (over out_shardings)
    if not _possible_layout(ctx, _shape(v), spec):
      return          # an inferred layout that cannot exist stays unknown
    specs[v] = spec
    changed = True

  for v, s in zip(jaxpr.invars, in_specs):
    put(v, s)
  for v, s in zip(jaxpr.outvars, out_specs):
    put(v, s)
  if const_specs is None:
    const_specs = [S.replicated(len(_shape(v))) for v in jaxpr.constvars]
  for v, s in zip(jaxpr.constvars, const_specs):
    put(v, s)

  # Phase 1 pushes what the inputs say forward only, so facts from the program's inputs
  # are settled before any guess flows backward from a replicated constant. Phase 2 then
  # fills what is left in both directions (e.g. which layout a consumer wants).
  order = list(enumerate(jaxpr.eqns))
  # Equations whose operands and results all have layouts are skipped in later sweeps,
  # except those with sub-jaxprs: their bodies are analysed from the boundary each time.
  has_body = [bool(sub_jaxprs(eqn)) for eqn in jaxpr.eqns]
  settled = set()
  phases = [(order, True), (order[::-1] + order, False)]
  while phases:
    sweeps, forward_only = phases.pop(0)
    for _ in range(_MAX_SWEEPS):
      changed = False
      for index, eqn in sweeps:
        if index in settled:
          continue
        ins = [get(v) for v in eqn.invars]
        outs = [get(v) for v in eqn.outvars]
        if None not in ins and None not in outs and not has_body[index]:
          settled.add(index)     # every layout known: a rule can add nothing here
          continue
        fn = _RULES.get(eqn.primitive.name, _elementwise_or_unknown)
        new_ins, new_outs = fn(eqn, ins, outs, ctx, state, index)
        if not forward_only:
          for v, s in zip(eqn.invars, new_ins):
            put(v, s)
        for v, s in zip(eqn.outvars, new_outs):
          put(v, s)
      if not changed:
        break
    if not phases:
      # Phase 3: a matmul whose consumers never said which of LS/RS output layout they
      # want gets the first (LS: M keeps the row axis, like the activations); then
      # propagate again.
      changed = False
      for _, eqn in order:
        if eqn.primitive.name == "dot_general" and get(eqn.outvars[0]) is None:
          lhs, rhs = (get(v) for v in eqn.invars)
          found = _classify(ctx, eqn.params["dimension_numbers"], _shape(eqn.invars[0]),
                            _shape(eqn.invars[1]), lhs, rhs)
          if found.matches:
            put(eqn.outvars[0], found.matches[0].out_spec)
      if changed:
        phases.append((order[::-1] + order, False))
  return state


def _possible_layout(ctx, shape, spec) -> bool:
  """Whether `spec` is a layout `shape` can have (memoized: layers repeat the same ones)."""
  key = ("layout", shape, spec)
  found = ctx.memo.get(key)
  if found is None:
    found = ctx.memo[key] = not layout_reason("value", shape, spec, ctx.axis_sizes)
  return found


def _classify(ctx, dimension_numbers, lhs_shape, rhs_shape, lhs_spec, rhs_spec):
  """`matching.classify`, memoized per distinct matmul (it is pure)."""
  key = ("classify", dimension_numbers, lhs_shape, rhs_shape, lhs_spec, rhs_spec)
  found = ctx.memo.get(key)
  if found is None:
    found = ctx.memo[key] = matching.classify(dimension_numbers, lhs_shape, rhs_shape,
                                              lhs_spec, rhs_spec, ctx.axis_sizes)
  return found


# ---------------------------------------------------------------- generic rules

def _elementwise_or_unknown(eqn, ins, outs, ctx, state, index):
  """Operands and results of one rank share one layout; size-1 dims (implicit
  broadcasting) and rank-0 operands are never split."""
  variables = list(eqn.invars) + list(eqn.outvars)
  shapes = [_shape(v) for v in variables]
  full = max(shapes, key=len) if shapes else ()
  if not all(s == () or (len(s) == len(full) and all(a in (b, 1) for a, b in zip(s, full)))
             for s in shapes):
    return ins, outs
  if full == ():
    return [S.replicated(0)] * len(ins), [S.replicated(0)] * len(outs)

  def fit(spec, shape):
    if shape == ():
      return S.replicated(0)
    return tuple(e if n == m else () for e, n, m in zip(spec, shape, full))

  # only full-shape values inform the others: a size-1 dim says nothing about layout
  merged = S.merge([s for s, shape in zip(ins + outs, shapes) if s is not None and shape == full])
  if merged is None:
    return ins, outs
  specs = [s if s is not None else fit(merged, shape) for s, shape in zip(ins + outs, shapes)]
  return specs[:len(ins)], specs[len(ins):]


@rule("broadcast_in_dim")
def _broadcast_in_dim(eqn, ins, outs, ctx, state, index):
  operand, out_v = eqn.invars[0], eqn.outvars[0]
  bdims = eqn.params["broadcast_dimensions"]
  in_shape, out_shape = _shape(operand), _shape(out_v)
  new_out = outs[0]
  # a broadcast scalar has no layout of its own: let its consumers decide
  if new_out is None and ins[0] is not None and in_shape:
    entries = [()] * len(out_shape)
    for j, d in enumerate(bdims):
      if in_shape[j] == out_shape[d]:
        entries[d] = ins[0][j]
    new_out = tuple(entries)
  new_in = ins[0]
  if new_in is None and outs[0] is not None:
    new_in = tuple(outs[0][d] if in_shape[j] == out_shape[d] else ()
                   for j, d in enumerate(bdims))
  return [new_in] + ins[1:], [new_out]


def _reshape_map(src_shape, dst_shape, spec, axis_sizes):
  """Carry a spec across a reshape that splits or merges dims (first dim of a group
  keeps the sharding when its size allows it)."""
  out = [()] * len(dst_shape)
  i = j = 0
  while i < len(src_shape) and j < len(dst_shape):
    gi, gj = [i], [j]
    a, b = src_shape[i], dst_shape[j]
    while a != b:
      if a < b:
        i += 1
        if i >= len(src_shape):
          return None
        a *= src_shape[i]
        gi.append(i)
      else:
        j += 1
        if j >= len(dst_shape):
          return None
        b *= dst_shape[j]
        gj.append(j)
    sharded = [d for d in gi if spec[d]]
    if sharded:
      if sharded != [gi[0]]:
        return None        # an inner dim of a merge is split: not a plain layout
      entry = spec[gi[0]]
      if dst_shape[gj[0]] % math.prod(axis_sizes[x] for x in entry):
        return None
      out[gj[0]] = entry
    i += 1
    j += 1
  return tuple(out)


@rule("reshape")
def _reshape(eqn, ins, outs, ctx, state, index):
  src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  new_out = outs[0] if outs[0] is not None else (
      _reshape_map(src, dst, ins[0], ctx.axis_sizes) if ins[0] is not None else None)
  new_in = ins[0] if ins[0] is not None else (
      _reshape_map(dst, src, outs[0], ctx.axis_sizes) if outs[0] is not None else None)
  return [new_in] + ins[1:], [new_out]


@rule("transpose")
def _transpose(eqn, ins, outs, ctx, state, index):
  perm = eqn.params["permutation"]
  new_out = outs[0] if outs[0] is not None or ins[0] is None else tuple(ins[0][p] for p in perm)
  new_in = ins[0]
  if new_in is None and outs[0] is not None:
    inv = np.argsort(perm)
    new_in = tuple(outs[0][int(p)] for p in inv)
  return [new_in], [new_out]


@rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
      "argmax", "argmin")
def _reduce(eqn, ins, outs, ctx, state, index):
  axes = eqn.params["axes"]
  new_out = outs[0]
  if new_out is None and ins[0] is not None:
    new_out = tuple(e for d, e in enumerate(ins[0]) if d not in axes)
  new_in = ins[0]
  if new_in is None and outs[0] is not None:
    kept = iter(outs[0])
    new_in = tuple(() if d in axes else next(kept) for d in range(len(_shape(eqn.invars[0]))))
  return [new_in] + ins[1:], [new_out] + outs[1:]


@rule("squeeze")
def _squeeze(eqn, ins, outs, ctx, state, index):
  dims = eqn.params["dimensions"]
  new_out = outs[0]
  if new_out is None and ins[0] is not None:
    new_out = tuple(e for d, e in enumerate(ins[0]) if d not in dims)
  new_in = ins[0]
  if new_in is None and outs[0] is not None:
    kept = iter(outs[0])
    new_in = tuple(() if d in dims else next(kept) for d in range(len(_shape(eqn.invars[0]))))
  return [new_in], [new_out]


def _same_size_dims(spec, src_shape, dst_shape):
  return tuple(e if a == b else () for e, a, b in zip(spec, src_shape, dst_shape))


@rule("slice", "dynamic_slice", "pad", "rev", "cumsum", "cumprod", "cummax", "cumlogsumexp")
def _resize(eqn, ins, outs, ctx, state, index):
  src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  if len(src) != len(dst):
    return ins, outs
  new_out = outs[0] if outs[0] is not None or ins[0] is None else _same_size_dims(ins[0], src, dst)
  new_in = ins[0] if ins[0] is not None or outs[0] is None else _same_size_dims(outs[0], dst, src)
  return [new_in] + ins[1:], [new_out]


@rule("iota")
def _iota(eqn, ins, outs, ctx, state, index):
  """`jnp.arange` and positions: a value the program makes from nothing, the same on
  every device, i.e. replicated, exactly as a closed-over numpy constant (constvars) is
  (Explicit mode: the type's sharding wins in `put`)."""
  return ins, [o if o is not None else S.replicated(len(_shape(v)))
               for o, v in zip(outs, eqn.outvars)]


@rule("split")
def _split(eqn, ins, outs, ctx, state, index):
  """`jnp.split` (rotary embeddings split the head dim in halves): every piece keeps the
  operand's layout on the dims it keeps whole, the split dim is whole in the pieces;
  the operand takes back what a piece knows, the split dim whole as well (as `slice`)."""
  src = _shape(eqn.invars[0])
  new_outs = [o if o is not None or ins[0] is None else _same_size_dims(ins[0], src, _shape(v))
              for o, v in zip(outs, eqn.outvars)]
  new_in = ins[0]
  if new_in is None:
    new_in = S.merge([_same_size_dims(o, _shape(v), src) for o, v in zip(outs, eqn.outvars)
                      if o is not None])
  return [new_in], new_outs


@rule("stack")
def _stack_rule(eqn, ins, outs, ctx, state, index):
  """`jnp.stack`: the new dim is whole, the others are laid out like the operands (which
  share one layout, as operands of an elementwise op do)."""
  axis = eqn.params["axis"]
  merged = S.merge(ins + [None if outs[0] is None else outs[0][:axis] + outs[0][axis + 1:]])
  if merged is None:
    return ins, outs
  new_out = outs[0] if outs[0] is not None else merged[:axis] + ((),) + merged[axis:]
  return [s if s is not None else merged for s in ins], [new_out]


@rule("unstack")
def _unstack_rule(eqn, ins, outs, ctx, state, index):
  """The transpose of `stack`: every piece is the operand without the unstacked dim."""
  axis = eqn.params["axis"]
  known = ins[0] if ins[0] is not None else S.merge(
      [o[:axis] + ((),) + o[axis:] for o in outs if o is not None])
  if known is None:
    return ins, outs
  piece = known[:axis] + known[axis + 1:]
  return [known], [o if o is not None else piece for o in outs]


def _without_repeated_axes(entries, order):
  """Drop a mesh axis from every entry after the first that uses it (visited in `order`):
  one axis splits one dim."""
  used, entries = set(), list(entries)
  for d in order:
    entries[d] = tuple(a for a in entries[d] if a not in used)
    used.update(entries[d])
  return tuple(entries)


@rule("gather")
def _gather(eqn, ins, outs, ctx, state, index):
  """An embedding lookup and named-axis indexing, laid out as GSPMD lays them out: the
  result's batch dims split like the indices' dims, its offset dims like the operand dims
  they slice whole; the indices' layout also follows back from a known result."""
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  op_shape, idx_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
  out_shape = _shape(eqn.outvars[0])
  batch_out = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
  kept = [d for d in range(len(op_shape))
          if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  if (dn.operand_batching_dims or len(batch_out) != len(idx_shape) - 1
      or len(kept) != len(dn.offset_dims)):
    return ins, outs                       # batched gathers: not modelled
  new_out, new_idx = outs[0], ins[1]
  if new_out is None and ins[0] is not None and ins[1] is not None:
    entries = [()] * len(out_shape)
    for k, d in enumerate(batch_out):
      entries[d] = ins[1][k]
    for j, d in enumerate(kept):
      if sizes[d] == op_shape[d]:
        entries[dn.offset_dims[j]] = ins[0][d]
    new_out = _without_repeated_axes(entries, batch_out + list(dn.offset_dims))
  if new_idx is None and outs[0] is not None:
    new_idx = tuple(outs[0][d] for d in batch_out) + ((),)   # the index vector: whole
  return [ins[0], new_idx] + ins[2:], [new_out]


@rule("scatter-add", "scatter_add", "scatter")
def _scatter(eqn, ins, outs, ctx, state, index):
  """The gradient of a gather (and `.at[].set/add`): the result is laid out like the
  operand it updates; with neither known, like the updates' window dims."""
  merged = S.merge([ins[0], outs[0]])
  dn = eqn.params["dimension_numbers"]
  updates = ins[2] if len(ins) > 2 else None
  if merged is None and updates is not None and not dn.operand_batching_dims:
    op_shape, upd_shape = _shape(eqn.invars[0]), _shape(eqn.invars[2])
    window = [d for d in range(len(op_shape)) if d not in dn.inserted_window_dims]
    if len(window) == len(dn.update_window_dims):
      entries = [()] * len(op_shape)
      for d, u in zip(window, dn.update_window_dims):
        if upd_shape[u] == op_shape[d]:
          entries[d] = updates[u]
      merged = _without_repeated_axes(entries, window)
  if merged is None:
    return ins, outs
  return [merged] + ins[1:], [merged]


@rule("dynamic_update_slice")
def _dynamic_update_slice(eqn, ins, outs, ctx, state, index):
  merged = S.merge([ins[0], outs[0]])
  return [merged] + ins[1:], [merged]


@rule("concatenate")
def _concatenate(eqn, ins, outs, ctx, state, index):
  dim = eqn.params["dimension"]
  merged = S.merge(ins + outs)
  if merged is None:
    return ins, outs
  merged = tuple(() if d == dim else e for d, e in enumerate(merged))
  return [s if s is not None else merged for s in ins], [outs[0] or merged]


@rule("sharding_constraint", "reshard")
def _sharding_constraint(eqn, ins, outs, ctx, state, index):
  sharding = eqn.params.get("sharding", eqn.params.get("dst_sharding"))
  spec = S.from_sharding(sharding, len(_shape(eqn.outvars[0])), ctx.axis_sizes)
  return [ins[0] if ins[0] is not None else spec], [spec]


@rule("device_put")
def _device_put(eqn, ins, outs, ctx, state, index):
  new_outs = []
  for v, s, dev in zip(eqn.outvars, ins, eqn.params.get("devices", [None] * len(ins))):
    spec = S.from_sharding(dev, len(_shape(v)), ctx.axis_sizes)
    new_outs.append(spec if spec is not None else s)
  return ins, [o if o is not None else n for o, n in zip(outs, new_outs)]


@rule("shard_map")
def _shard_map(eqn, ins, outs, ctx, state, index):
  new_ins = [s if s is not None else S.from_partition_spec(p, len(_shape(v)), ctx.axis_sizes)
             for s, p, v in zip(ins, eqn.params["in_specs"], eqn.invars)]
  new_outs = [s if s is not None else S.from_partition_spec(p, len(_shape(v)), ctx.axis_sizes)
              for s, p, v in zip(outs, eqn.params["out_specs"], eqn.outvars)]
  return new_ins, new_outs


def _fill_operand(dimension_numbers, known_spec, out_spec, unknown_ndim, unknown_is_lhs):
  """Layout for the unknown operand that needs no communication beyond the known
  operand's: contracting and batch dims copy the known operand, free dims the result."""
  (lc, rc), (lb, rb) = dimension_numbers
  mine_c, other_c = (lc, rc) if unknown_is_lhs else (rc, lc)
  mine_b, other_b = (lb, rb) if unknown_is_lhs else (rb, lb)
  entries = [()] * unknown_ndim
  for a, b in zip(mine_c, other_c):
    entries[a] = known_spec[b]
  for a, b in zip(mine_b, other_b):
    entries[a] = known_spec[b]
  free = [d for d in range(unknown_ndim) if d not in mine_c and d not in mine_b]
  # contracting and batch dims first: they must agree with the known operand; a free
  # dim takes the result's axis only where that axis is still unused
  used = {a for e in entries for a in e}
  if out_spec is not None:
    offset = len(lb) + (0 if unknown_is_lhs else len(out_spec) - len(lb) - len(free))
    for k, d in enumerate(free):
      entry = out_spec[offset + k]
      if not set(entry) & used:
        entries[d] = entry
        used.update(entry)
  return tuple(entries)


def _batch_conflict_output(dimension_numbers, lhs_shape, rhs_shape, lhs, rhs):
  """The result layout of a dot_general whose batch dims are split differently on its
  operands and whose contracting dims are whole (penzai's named-axis `x * scale`, a
  batch-only dot_general of the activations [b,s,d] with a norm scale [d]): as Shardy's
  propagation resolves the conflict, the larger operand's layout wins; the other
  operand's free dims keep the axes still unused. None when the batch dims agree or a
  contracting dim is split (a partial sum: the consumers decide)."""
  (lc, rc), (lb, rb) = dimension_numbers
  if all(lhs[a] == rhs[b] for a, b in zip(lb, rb)):
    return None
  if any(lhs[a] or rhs[b] for a, b in zip(lc, rc)):
    return None
  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  lhs_wins = math.prod(lhs_shape) >= math.prod(rhs_shape)
  batch = [lhs[a] if lhs_wins else rhs[b] for a, b in zip(lb, rb)]
  entries = batch + [lhs[d] for d in lf] + [rhs[d] for d in rf]
  n, nl = len(lb), len(lf)
  winner = list(range(n + nl)) if lhs_wins else list(range(n)) + list(range(n + nl, len(entries)))
  order = winner + [d for d in range(len(entries)) if d not in winner]
  return _without_repeated_axes(entries, order)


@rule("dot_general")
def _dot_general(eqn, ins, outs, ctx, state, index):
  dn = eqn.params["dimension_numbers"]
  if (ins[0] is None) != (ins[1] is None) and outs[0] is not None:
    unknown_is_lhs = ins[0] is None
    known = ins[1] if unknown_is_lhs else ins[0]
    filled = _fill_operand(dn, known, outs[0], len(_shape(eqn.invars[0 if unknown_is_lhs else 1])),
                           unknown_is_lhs)
    return ([filled, ins[1]] if unknown_is_lhs else [ins[0], filled]), outs
  if outs[0] is not None or ins[0] is None or ins[1] is None:
    return ins, outs
  natural = matching.natural_output_spec(dn, ins[0], ins[1])
  if natural is not None:
    return ins, [natural]
  batch_conflict = _batch_conflict_output(dn, _shape(eqn.invars[0]), _shape(eqn.invars[1]),
                                          ins[0], ins[1])
  if batch_conflict is not None:
    return ins, [batch_conflict]
  found = _classify(ctx, dn, _shape(eqn.invars[0]), _shape(eqn.invars[1]), ins[0], ins[1])
  # OS has one output layout; LS vs RS waits for a consumer to say which it wants
  # (the backward sweep), so only fill it in when the choice is forced.
  if len(found.matches) == 1:
    return ins, [found.matches[0].out_spec]
  return ins, outs


# ---------------------------------------------------------- higher-order rules

def _child(state, key, jaxpr, in_specs, out_specs, ctx, consts=()):
  """(Re-)analyse a sub-jaxpr when its boundary specs changed; `consts` are the values
  of its constvars (a ClosedJaxpr's), whose shardings are their layouts."""
  const_specs = tuple(_const_specs(jaxpr, consts, ctx))
  boundary = (tuple(in_specs), tuple(out_specs), const_specs)
  previous = state.children.get(key)
  if previous is not None and previous.boundary == boundary:
    return previous
  memo_key = (id(jaxpr), id(previous), boundary)
  found = ctx.memo.get(memo_key)
  if found is not None and found[0] is jaxpr and found[1] is previous:
    child = found[2]
  else:
    child = _analyze(jaxpr, in_specs, out_specs, ctx, previous, list(const_specs))
    child.boundary = boundary
    # keyed by ids: the value holds the objects so that their ids stay theirs
    ctx.memo[memo_key] = (jaxpr, previous, child)
  state.children[key] = child
  return child


def _read(child, variables):
  return [child.specs.get(v) if not isinstance(v, Literal) else None for v in variables]


@rule(*traversed_names("call"))
def _call(eqn, ins, outs, ctx, state, index):
  """A call's body takes its operands and gives its results; a jit's in/out shardings
  fill in what neither says."""
  param, = higher_order(eqn).bodies
  sub = eqn.params[param]
  jaxpr = open_jaxpr(sub)
  in_specs, out_specs = list(ins), list(outs)
  if eqn.primitive.name == "jit":
    in_specs = [s if s is not None else S.from_sharding(sh, len(_shape(v)), ctx.axis_sizes)
                for s, sh, v in zip(in_specs, eqn.params["in_shardings"], eqn.invars)]
    out_specs = [s if s is not None else S.from_sharding(sh, len(_shape(v)), ctx.axis_sizes)
                 for s, sh, v in zip(out_specs, eqn.params["out_shardings"], eqn.outvars)]
  child = _child(state, (index, param, 0), jaxpr, in_specs, out_specs, ctx, consts_of(sub))
  return _read(child, jaxpr.invars), _read(child, jaxpr.outvars)


def _unstack(spec):
  return None if spec is None else spec[1:]


def _stack(spec):
  return None if spec is None else ((),) + tuple(spec)


@rule(*traversed_names("scan"))
def _scan(eqn, ins, outs, ctx, state, index):
  p = eqn.params
  nc, ncarry = scan_counts(p)
  jaxpr = open_jaxpr(p["jaxpr"])
  consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
  carry_out, ys = outs[:ncarry], outs[ncarry:]
  carry = [a if a is not None else b for a, b in zip(init, carry_out)]
  child = _child(state, (index, "jaxpr", 0), jaxpr,
                 consts + carry + [_unstack(s) for s in xs],
                 carry + [_unstack(s) for s in ys], ctx, consts_of(p["jaxpr"]))
  body_in, body_out = _read(child, jaxpr.invars), _read(child, jaxpr.outvars)
  b_consts, b_carry, b_xs = body_in[:nc], body_in[nc:nc + ncarry], body_in[nc + ncarry:]
  carry = [a if a is not None else b for a, b in zip(carry, b_carry)]
  new_ins = b_consts + carry + [_stack(s) for s in b_xs]
  new_outs = carry + [_stack(s) for s in body_out[ncarry:]]
  return new_ins, new_outs


@rule(*traversed_names("while"))
def _while(eqn, ins, outs, ctx, state, index):
  p = eqn.params
  cn, bn = while_counts(p)
  cond_consts, body_consts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
  carry = [a if a is not None else b for a, b in zip(init, outs)]
  body = open_jaxpr(p["body_jaxpr"])
  child = _child(state, (index, "body_jaxpr", 0), body, body_consts + carry, carry, ctx,
                 consts_of(p["body_jaxpr"]))
  b_in = _read(child, body.invars)
  carry = [a if a is not None else b for a, b in zip(carry, b_in[bn:])]
  cond = open_jaxpr(p["cond_jaxpr"])
  _child(state, (index, "cond_jaxpr", 0), cond, cond_consts + carry, [None], ctx,
         consts_of(p["cond_jaxpr"]))
  return cond_consts + b_in[:bn] + carry, carry


@rule(*traversed_names("cond"))
def _cond(eqn, ins, outs, ctx, state, index):
  operands = ins[1:]
  new_operands, new_outs = list(operands), list(outs)
  for b, branch in enumerate(eqn.params["branches"]):
    jaxpr = open_jaxpr(branch)
    child = _child(state, (index, "branches", b), jaxpr, operands, outs, ctx,
                   consts_of(branch))
    b_in, b_out = _read(child, jaxpr.invars), _read(child, jaxpr.outvars)
    new_operands = [a if a is not None else c for a, c in zip(new_operands, b_in)]
    new_outs = [a if a is not None else c for a, c in zip(new_outs, b_out)]
  return [ins[0]] + new_operands, new_outs


# ---------------------------------------------------------------- why a layout is unknown

def where_layout_lost(jaxpr, analysis: JaxprAnalysis, var, source_of=None) -> str:
  """Why `var` (an operand of a matmul in `jaxpr`) has no layout, as a hint the user can
  act on: the equation where the layouts known upstream stop (its primitive, its source
  line, and that a `with_sharding_constraint` on its result fixes it), or the program
  input that no sharding reaches. '' when nothing better can be said.

  `source_of(eqn)` gives an equation's 'file:line' (planning passes its own)."""
  if analysis is None:
    return ""
  producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  inputs = {v: k for k, v in enumerate(jaxpr.invars)}
  seen, frontier, reached = set(), [var], []
  while frontier:
    v = frontier.pop(0)                    # breadth first: the nearest cause
    if v in seen or isinstance(v, Literal):
      continue
    seen.add(v)
    if v in inputs:
      reached.append(inputs[v])
      continue
    eqn = producers.get(v)
    if eqn is None:
      continue
    known = [u for u in eqn.invars if not isinstance(u, Literal)
             and analysis.specs.get(u) is not None and _shape(u)]
    if known:
      where = f" ({source_of(eqn)})" if source_of is not None and source_of(eqn) else ""
      shape = "x".join(map(str, _shape(v))) or "scalar"
      return (f"the layout is lost at `{eqn.primitive.name}`{where}, whose inputs have "
              f"layouts but no layout rule carries them to its [{shape}] result; add "
              "jax.lax.with_sharding_constraint on that result")
    # unknown all the way up this equation: follow its array operands
    frontier.extend(u for u in eqn.invars if not isinstance(u, Literal) and _shape(u))
  if reached:
    which = ", ".join(map(str, sorted(reached)[:4])) + (", ..." if len(reached) > 4 else "")
    return (f"it comes from input{'s' if len(reached) > 1 else ''} {which} of this "
            "(sub)program, which no in_shardings, committed array or constraint reaches")
  return ""
