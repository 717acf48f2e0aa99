"""`meshslice.transform` of a Flax `nnx.jit` step: the NNX wrapper is kept, its jit swapped.

`nnx.jit(step)` is a Python wrapper around a real `jax.jit` (its `jitted_fn`): the wrapper
splits the Modules and Optimizers it is called with into pure state, calls the jit, and
writes the returned state back into those objects, in place. Transforming the wrapper as
an opaque function would run it inside another jit, where its in-place updates land on
copies and are lost. So a copy of the wrapper is made whose `jitted_fn` is the
transformed jit: the splitting, merging and in-place updates stay NNX's own.

Example:
  >>> step = nnx.jit(train_step)                        # doctest: +SKIP
  >>> fast_step = meshslice.transform(step)   # still an nnx.jit wrapper  # doctest: +SKIP
  >>> loss = fast_step(model, optimizer, batch)   # updates them in place  # doctest: +SKIP
  >>> fast_step.explain(model, optimizer, batch)  # the report            # doctest: +SKIP

The jit sees no Modules, only the containers the wrapper splits them into: in graph mode
(the default) a `NodeStates` per Module, its leaves a flat list whose names are in its
GraphDef (with `graph_updates=False`, a `TreeState`, its state nested by name); in tree
mode (`graph=False`) the Modules themselves, and as results an `Updates` list of the
changed Variables with their paths. `nnx_key_paths` reads those names, so sites are
named by their parameters' attribute paths (`down`, `layers/0/mlp/wo`) in every mode, as
for `jax.jit` over `nnx.split` state, not by the containers (`states`, `_values`,
`__state__`).
"""
from __future__ import annotations

import copy
import dataclasses

from ._jax_internals import jit_function, rejit


def is_nnx_jit(fn) -> bool:
  """Whether `fn` is a wrapper made by `flax.nnx.jit` (any of its variants)."""
  return (type(fn).__module__.startswith("flax.nnx")
          and hasattr(getattr(fn, "jitted_fn", None), "trace"))


def transform_nnx_jit(fn, make_transformed):
  """A copy of the `nnx.jit` wrapper `fn` whose jit is `make_transformed(its jit)`, with
  an `.explain(*args)` that takes what the wrapper takes (Modules, Optimizers, ...)."""
  new = copy.copy(fn)
  inner = jit_function(fn.jitted_fn)
  if dataclasses.is_dataclass(inner) and getattr(inner, "ctxtag", None) is fn:
    # graph-mode wrappers match their inner function to themselves by this tag
    inner = dataclasses.replace(inner, ctxtag=new)
    jitted = rejit(inner, fn.jitted_fn)
  else:
    jitted = fn.jitted_fn
  new.jitted_fn = make_transformed(jitted)
  new.explain = lambda *args, **kwargs: _explain(new, args, kwargs)
  return new


def _explain(wrapper, args, kwargs):
  """The report for the pure state `wrapper` would pass to its jit for these inputs."""
  from flax.nnx import graphlib
  if hasattr(wrapper, "_get_pure_args_kwargs"):
    with graphlib.update_context(wrapper):
      pure_args, pure_kwargs = wrapper._get_pure_args_kwargs(args, kwargs)
      return wrapper.jitted_fn.explain(*pure_args, **pure_kwargs)
  args = (*getattr(wrapper, "partial_args", ()), *args)
  if hasattr(wrapper, "_maybe_to_tree"):
    args, kwargs = wrapper._maybe_to_tree(args, kwargs)
  return wrapper.jitted_fn.explain(*args, **kwargs)


# The containers `nnx.jit` passes its jit, by class name (flax.nnx.extract): their leaves
# are named by `nnx_key_paths`, not by their fields.
_CONTAINERS = frozenset({"NodeStates", "TreeState", "Updates"})


def is_nnx_container(node) -> bool:
  """Whether `node` is a container `nnx.jit` passes to or returns from its jit (a Module's
  `NodeStates` or `TreeState`, tree mode's `Updates`)."""
  kind = type(node)
  return kind.__name__ in _CONTAINERS and kind.__module__.startswith("flax.nnx")


def nnx_key_paths(node) -> list | None:
  """The key path of each leaf of the `nnx.jit` container `node` (`is_nnx_container`),
  relative to it, as `jax.tree_util.keystr` would write the Module's own pytree:
  `['down']['kernel']` for a NodeStates leaf (and a TreeState's), `[0].down.kernel.value`
  for an Updates leaf of the step's first argument. None when the layout is not one
  understood here (several states per Module, an Updates of flat positions): no names
  then."""
  try:
    kind = type(node).__name__
    if kind == "Updates":
      return _updates_paths(node)
    if kind == "TreeState":               # its one field holds the state, nested by name
      return _tree_state_paths(node)
    return _node_states_paths(node)
  except (AttributeError, TypeError, ValueError, StopIteration):
    return None


def _updates_paths(updates) -> list | None:
  """Tree mode: each changed Variable with its path in `labeled(args=..., kwargs=...)`."""
  import jax
  paths = []
  for key, value in zip(updates._keys, updates._values):
    if not isinstance(key, tuple) or not key:
      return None          # jit_partial keeps only a position: nothing to name it by
    head, rest = key[0], key[1:]
    if getattr(head, "name", None) not in ("args", "kwargs"):
      return None
    # a TreeState's field is no name (as NNX itself drops it from paths)
    name = jax.tree_util.keystr(tuple(k for k in rest
                                      if getattr(k, "name", None) != "__state__"))
    paths += [name + jax.tree_util.keystr(p)
              for p, _ in jax.tree_util.tree_flatten_with_path(value)[0]]
  return paths if len(paths) == len(jax.tree_util.tree_leaves(updates)) else None


def _tree_state_paths(tree_state) -> list:
  """Graph mode without graph updates: the paths in the nested state, without the field."""
  import jax
  state = tree_state.state
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _node_states_paths(node_states) -> list | None:
  """Graph mode: the leaves of a Module's single state, in GraphDef order."""
  import jax
  graphdef, states = node_states._graphdef, node_states.states
  if graphdef is None or len(states) != 1 or not isinstance(states[0], list):
    return None
  parts = _graphdef_paths(graphdef)
  if parts is None or len(parts) != len(states[0]):
    return None
  paths = []
  for path, leaf in zip(parts, states[0]):
    name = "".join(f"[{p}]" if isinstance(p, int) else f"['{p}']" for p in path)
    paths += [name] * len(jax.tree_util.tree_leaves(leaf))
  return paths if len(paths) == len(jax.tree_util.tree_leaves(node_states)) else None


def _graphdef_paths(graphdef) -> list | None:
  """The attribute path of each leaf of an NNX GraphDef, in leaf order: the walk
  `graphlib.unflatten` makes over its nodes and attributes (a node or Variable met again,
  a NodeRef, has no leaf of its own)."""
  nodes, attributes, paths = iter(graphdef.nodes), iter(graphdef.attributes), []
  first = next(nodes, None)
  if first is None:
    return [()] * graphdef.num_leaves      # a single leaf, not a node
  kind = type(first).__name__
  if kind == "TreeNodeDef":                # a pytree split in tree mode: sorted paths
    return [tuple(path) for path, _ in first.path_index]

  def visit(nodedef, path):
    kind = type(nodedef).__name__
    if kind == "VariableDef":
      if type(getattr(nodedef, "array_refdef", None)).__name__ != "NodeRef":
        paths.append(path)
    elif kind == "ArrayRefDef":
      paths.append(path)
    elif kind == "NodeDef":
      for _ in range(nodedef.num_attributes):
        key, value = next(attributes)
        attr = type(value).__name__
        if attr == "LeafAttr":
          paths.append(path + (key,))
        elif attr == "NodeAttr":
          visit(next(nodes), path + (key,))
        elif attr not in ("Static", "NodeRef"):
          raise ValueError(f"unknown GraphDef attribute {attr}")
    elif kind != "NodeRef":
      raise ValueError(f"unknown GraphDef node {kind}")

  visit(first, ())
  return paths
