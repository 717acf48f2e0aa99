"""Which parameter a matmul reads or produces, named by its place in the step's pytrees.

Flax NNX, Equinox and MaxText's NNX layers put no module names on JAX's name stack, and
the chain of classes a matmul was called from (`Model/Mlp/Linear`) cannot tell `up` from
`down`. The step's own arguments can: the kernel a forward or backward-data matmul reads
is a leaf of the parameter pytree, and the gradient a weight-gradient matmul makes flows
into an output leaf (the gradient itself) or into an optimizer update next to the
parameter or its optimizer state. Those leaves have key paths, e.g.
`['mlp']['wo']['kernel']`; the module of that parameter is `mlp/wo`.

Names follow a parameter through the ops it passes on its way to a matmul (casts,
transposes, reshapes, layer-stack slicing, sharding constraints) and into the bodies of
jit, remat, scan, while and cond. Names are kept per place in the program (a body JAX
shares between unrolled layers is named once per call).

Example:
  >>> module_of_key_path("['params']['decoder']['mlp']['wo']['kernel']")
  'decoder/mlp/wo'
  >>> module_of_key_path("[0]['embed']['kernel'].value")
  'embed'
  >>> module_of_key_path("[0]['layers']['mlp']['wo']")
  'layers/mlp/wo'
  >>> module_of_key_path("[0]['attn']['value']['kernel'].value")
  'attn/value'
  >>> module_of_key_path("[0]['optimizer']['opt_state'][0]['mu']['decoder']['mlp']['wo']"
  ...                     "['kernel'].value")
  'decoder/mlp/wo'
"""
from __future__ import annotations

import re

from ._jax_internals import Literal, scan_counts, sub_jaxprs, while_counts

# A parameter passes through these unchanged in meaning: re-typed, re-laid, sliced.
_PASS_THROUGH = frozenset({
    "convert_element_type", "transpose", "reshape", "squeeze", "expand_dims", "copy",
    "copy_p", "sharding_constraint", "reshard", "reduce_precision", "device_put",
    "slice", "dynamic_slice", "optimization_barrier",
})
# A gradient meets its parameter (or optimizer state) in these: `p - lr * g`, `b1*m + g`.
_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "neg", "add_any", "select_n", "max",
                          "min", "sqrt", "rsqrt", "integer_pow", "square"})
_CALLS = frozenset({"jit", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call"})
# key-path parts that are containers, not names: variable collections and optimizer
# states (dict keys), and the attribute a framework keeps the array in (`.value`; a dict
# key 'value' is a name: an attention's value projection). 'model' and 'optimizer' are
# the halves of an NNX train state (MaxText's TrainStateNNX, nnx.Optimizer): without
# them a weight gradient, named through the optimizer state it updates, gets the same
# module as its parameter ('decoder/layers/mlp/wo' for both).
_NOT_NAMES = frozenset({"params", "param", "state", "opt_state", "variables",
                        "trainable_variables", "mu", "nu", "trace", "inner_state",
                        "model", "optimizer"})
_NOT_ATTRIBUTES = frozenset({"value", "raw_value", "_value", "mu", "nu", "trace",
                             "inner_state"})


# the names layers give their arrays: dropped, so `up/kernel` is the module `up`
_LEAF_NAMES = frozenset({"kernel", "bias", "scale", "embedding", "embeddings", "weight",
                         "weights", "w", "b", "gamma", "beta"})


def module_of_key_path(key_path: str) -> str:
  """The module of a parameter from its pytree key path: the names along it without
  positions, collections ('params'), optimizer states, value attributes, and a layer's
  name for its array ('kernel'); '' for a leaf with no name (a data input)."""
  parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)", key_path)
  names = [(name or attr) for name, _, attr in parts
           if (name and name not in _NOT_NAMES) or (attr and attr not in _NOT_ATTRIBUTES)]
  if len(names) > 1 and names[-1] in _LEAF_NAMES:
    names = names[:-1]
  return "/".join(names)


class ParamNames:
  """Key paths of the values that are parameters (or their gradients), per program place:
  forward from the step's inputs through `_PASS_THROUGH` ops, backward from its outputs
  through those and same-shape elementwise ops (an update `p - lr * g` names `g`).

  `prefix` is a path into nested jaxprs as planning writes it: () for the top level,
  then (eqn index, param name, branch) per level."""

  def __init__(self, jaxpr, in_names, out_names):
    self._names = {}
    self._forward(jaxpr, (), list(in_names))
    self._backward(jaxpr, (), list(out_names))

  def get(self, prefix, v):
    return None if isinstance(v, Literal) else self._names.get((prefix, v))

  def _module(self, prefix, v):
    """The module of the parameter `v` carries; '' for data (a leaf with no module)."""
    name = self.get(prefix, v)
    return module_of_key_path(name) if name else ""

  def of_site(self, prefix, jaxpr, eqn) -> str:
    """The module of the parameter the dot_general `eqn` (in `jaxpr` at `prefix`) reads,
    else of the one its result updates or becomes; '' when none is found."""
    for v in reversed(eqn.invars):       # rhs first: the weight of x @ w
      name = self._module(prefix, v)
      if name:
        return name
    consumers = {}
    for e in jaxpr.eqns:
      for v in e.invars:
        if not isinstance(v, Literal):
          consumers.setdefault(v, []).append(e)
    seen, frontier = set(), [eqn.outvars[0]]
    while frontier:
      v = frontier.pop(0)
      if v in seen:
        continue
      seen.add(v)
      name = self._module(prefix, v)
      if name:
        return name
      for e in consumers.get(v, ()):
        prim = e.primitive.name
        if prim in _PASS_THROUGH:
          frontier.append(e.outvars[0])
        elif prim in _ELEMENTWISE:
          shape = _shape(v)
          named = [self._module(prefix, u) for u in e.invars
                   if u is not v and _shape(u) == shape and self._module(prefix, u)]
          if named:
            return named[0]
          frontier.append(e.outvars[0])
    return ""

  def _set(self, prefix, v, name):
    if name and not isinstance(v, Literal):
      self._names.setdefault((prefix, v), name)

  def _forward(self, jaxpr, prefix, in_names):
    for v, n in zip(jaxpr.invars, in_names):
      self._set(prefix, v, n)
    for i, eqn in enumerate(jaxpr.eqns):
      ins = [self.get(prefix, v) for v in eqn.invars]
      if eqn.primitive.name in _PASS_THROUGH and ins and ins[0]:
        self._set(prefix, eqn.outvars[0], ins[0])
      for (param, branch), sub in sub_jaxprs(eqn):
        inner = prefix + ((i, param, branch),)
        self._forward(sub, inner, _body_operands(eqn, param, ins, len(sub.invars)))
        if eqn.primitive.name in _CALLS:
          for o, v in zip(eqn.outvars, sub.outvars):
            self._set(prefix, o, self.get(inner, v))

  def _backward(self, jaxpr, prefix, out_names):
    producers = {v: (i, eqn) for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    frontier = [(v, n) for v, n in zip(jaxpr.outvars, out_names) if n]
    while frontier:
      v, n = frontier.pop()
      if isinstance(v, Literal) or (prefix, v) in self._names:
        continue
      self._names[(prefix, v)] = n
      i, eqn = producers.get(v, (None, None))
      if eqn is None:
        continue
      if eqn.primitive.name in _PASS_THROUGH:
        frontier.append((eqn.invars[0], n))
      elif eqn.primitive.name in _ELEMENTWISE:      # back through `p - lr * g`
        frontier += [(u, n) for u in eqn.invars if _shape(u) == _shape(v)]
      elif eqn.primitive.name in _CALLS or eqn.primitive.name == "scan":
        for (param, branch), sub in sub_jaxprs(eqn):
          outs = [self.get(prefix, o) for o in eqn.outvars]
          if eqn.primitive.name == "scan":          # carries: not one layer's gradient
            outs[:scan_counts(eqn.params)[1]] = [None] * scan_counts(eqn.params)[1]
          self._backward(sub, prefix + ((i, param, branch),), outs)


def _shape(v):
  return getattr(getattr(v, "aval", None), "shape", None)


def _body_operands(eqn, param, ins, n):
  """The names of the operands a sub-jaxpr's invars stand for."""
  prim = eqn.primitive.name
  if prim == "cond":
    return ins[1:]
  if prim == "while":
    cond_consts, body_consts = while_counts(eqn.params)
    if param == "cond_jaxpr":
      return ins[:cond_consts] + ins[cond_consts + body_consts:]
    return ins[cond_consts:]
  if prim == "scan":
    consts, carry = scan_counts(eqn.params)
    return ins[:consts] + [None] * carry + ins[consts + carry:]   # xs: one layer's slice
  return ins[:n]
