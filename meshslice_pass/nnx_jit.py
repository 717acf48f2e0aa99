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
