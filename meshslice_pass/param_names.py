"""Which parameter a matmul reads or produces, named by its place in the step's pytrees.

Flax NNX, Equinox and MaxText's NNX layers put no module names on JAX's name stack, and
the chain of classes a matmul was called from (`Model/Mlp/Linear`) cannot tell `up` from
`down`. The step's own arguments can: the kernel a forward or backward-data matmul reads
is a leaf of the parameter pytree, and the gradient a weight-gradient matmul makes flows
into an output leaf (the gradient itself) or into an optimizer update next to the
parameter or its optimizer state. Those leaves have key paths, e.g.
`['mlp']['wo']['kernel']`; the module of that parameter is `mlp/wo`.

The naming rule (`module_of_key_path`): the names along the key path, joined by '/',
without variable collections ('params'), optimizer and train-state containers
('opt_state', 'mu', 'model', 'optimizer', ...), the attribute a framework keeps the array
in (a trailing `.value`) and a layer's name for its array ('kernel', 'weight'). A list
or tuple position is kept when it follows a kept name: the second layer of a list is
`layers/1/mlp/wo`; positions anywhere else (the step's argument positions, an optax
chain's states) name nothing and are dropped. Layers stacked into one parameter with a
leading layer axis (used inside `scan`) are one leaf: one name, `layers/mlp/wo`.
The steps of `nnx.jit` are named alike, graph and tree mode (`key_paths`): a Module's
state by the attribute path of each Variable (`down`, `layers/0/mlp/wo`), the same
names `jax.jit` over `nnx.split` state gets.

The matching rule for module-path patterns (`module_matches`, used by `overrides` and
`meshslice.tune`'s `modules`): a glob pattern (fnmatch, `*` also crosses '/') matched
against the whole module path, or against that path without its positions. So
`layers/1/mlp/wo` and `layers/*/mlp/wo` pick layers, while `layers/mlp/wo` and
`*/mlp/wo` (patterns written before positions were kept) match the site of every layer,
as before.

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
  >>> module_of_key_path("[0]['layers'][1]['mlp']['wo']['kernel']")
  'layers/1/mlp/wo'
  >>> module_of_key_path("[0]['attn']['value']['kernel'].value")
  'attn/value'
  >>> module_of_key_path("[0][0].attn.value.kernel.value")
  'attn/value'
  >>> module_of_key_path("[0]['optimizer']['opt_state'][0]['mu']['decoder']['mlp']['wo']"
  ...                     "['kernel'].value")
  'decoder/mlp/wo'
  >>> module_matches("layers/1/mlp/wo", "layers/mlp/wo")
  True
  >>> module_matches("layers/1/mlp/wo", "layers/0/*")
  False
"""
from __future__ import annotations

import fnmatch
import re

import jax

from ._jax_internals import Literal, scan_counts, sub_jaxprs, while_counts
from .nnx_jit import is_nnx_container, nnx_key_paths

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
# states (dict keys or attributes). 'model' and 'optimizer' are the halves of an NNX train
# state (MaxText's TrainStateNNX, nnx.Optimizer): without them a weight gradient, named
# through the optimizer state it updates, gets the same module as its parameter
# ('decoder/layers/mlp/wo' for both).
_NOT_NAMES = frozenset({"params", "param", "state", "opt_state", "variables",
                        "trainable_variables", "mu", "nu", "trace", "inner_state",
                        "model", "optimizer"})
# the attribute a framework keeps the array in, when it ends the path (`.value`); inside
# a path it is a name (an NNX attention's `value` projection: `.attn.value.kernel.value`),
# as a dict key 'value' always is
_VALUE_ATTRIBUTES = frozenset({"value", "raw_value", "_value"})


# the names layers give their arrays: dropped, so `up/kernel` is the module `up`
_LEAF_NAMES = frozenset({"kernel", "bias", "scale", "embedding", "embeddings", "weight",
                         "weights", "w", "b", "gamma", "beta"})


def module_of_key_path(key_path: str) -> str:
  """The module of a parameter from its pytree key path: the names along it without
  collections ('params'), optimizer states, a trailing value attribute and a layer's
  name for its array ('kernel'); a position is kept after a kept name (`layers/1/mlp`),
  dropped elsewhere; '' for a leaf with no name (a data input)."""
  parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)", key_path)
  names, after_name = [], False
  for k, (key, position, attr) in enumerate(parts):
    if position:
      keep = after_name
    elif attr and attr in _VALUE_ATTRIBUTES:
      keep = k < len(parts) - 1
    else:
      keep = (key or attr) not in _NOT_NAMES
    if keep:
      names.append(position or key or attr)
    after_name = keep
  if len(names) > 1 and names[-1] in _LEAF_NAMES:
    names = names[:-1]
  return "/".join(names)


def without_positions(module: str) -> str:
  """`module` without its list positions: 'layers/1/mlp/wo' -> 'layers/mlp/wo'."""
  return "/".join(part for part in module.split("/") if not part.isdigit())


def module_matches(module: str, pattern: str) -> bool:
  """Whether the module-path glob `pattern` (fnmatch; `*` also matches '/') matches the
  whole of `module`, or the whole of it without list positions (`without_positions`):
  `layers/1/*` matches layer 1's sites only, `layers/mlp/wo` every layer's `mlp/wo`."""
  return (fnmatch.fnmatchcase(module, pattern)
          or fnmatch.fnmatchcase(without_positions(module), pattern))


def _labelled(node) -> bool:
  """A variable that carries its own name: penzai's Parameter / ParameterValue /
  StateVariable (`label="transformer/block_0/attention/query.weights"`, `value=...`)."""
  fields = getattr(type(node), "__dataclass_fields__", {})
  # fields, not attributes: an unbound penzai slot raises on `.value`
  return "label" in fields and "value" in fields and isinstance(node.label, str)


def key_paths(tree) -> list:
  """The key path of every leaf of `tree`, as `jax.tree_util.keystr` writes it; the
  leaves of a labelled variable get its label as the path instead (penzai keeps its
  parameters in a flat tuple, whose positions name nothing), and those of the containers
  `nnx.jit` passes Modules in their Variables' attribute paths (`nnx_jit.nnx_key_paths`;
  '' where NNX's layout is not understood: no name rather than an internal one)."""
  paths = []
  is_leaf = lambda node: _labelled(node) or is_nnx_container(node)
  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
    if _labelled(node):
      name = "".join(f"['{part}']" for part in re.split(r"[/.]", node.label) if part)
      paths += [name] * len(jax.tree_util.tree_leaves(node))
    elif is_nnx_container(node):
      prefix = jax.tree_util.keystr(path)
      inner = nnx_key_paths(node)
      paths += ([prefix + p for p in inner] if inner is not None
                else [""] * len(jax.tree_util.tree_leaves(node)))
    else:
      paths.append(jax.tree_util.keystr(path))
  return paths


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
