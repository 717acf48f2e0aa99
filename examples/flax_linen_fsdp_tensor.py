"""meshslice on a Flax Linen LM sharded three ways: data, fsdp and tensor parallelism.

The logical axis rules follow the pattern of Flax's lm1b example (written here from
scratch): the batch is split over ("data", "fsdp"), parameters' embed dim over "fsdp"
(fully sharded data parallelism) and their mlp / heads / vocab dims over "tensor"; the
activations' embed dim stays whole. On a (data=2, fsdp=2, tensor=2) mesh that gives
three kinds of matmul site:

  - tensor-parallel projections, whose weight is gathered over fsdp: OS / LS sites;
  - weight gradients, whose contraction (the batch) is split over data and fsdp while
    the optimizer wants the gradient laid out (fsdp, tensor): reduce-scatter sites
    (`1d-scatter`: scattered over fsdp, summed over data);
  - attention's q.k and p.v, local on every device: left alone, nothing to overlap.

The script prints the report's summary and the sites per class, then checks the
transformed step (slicing forced with --ksplit) against plain jit and an unsharded run.

Run:  python examples/flax_linen_fsdp_tensor.py [--tiny] [--ksplit 2]
(on a CPU-only machine it emulates 8 devices). Exits non-zero if the check fails.
"""
from __future__ import annotations

import argparse
import collections
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)    # 8 emulated devices when running on CPU

import flax.linen as nn                        # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402
import optax                                   # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P    # noqa: E402

import meshslice                               # noqa: E402
from meshslice.report import reason_class     # noqa: E402

RULES = (("batch", ("data", "fsdp")), ("length", None), ("act_embed", None),
         ("act_mlp", "tensor"), ("act_heads", "tensor"), ("act_kv", None),
         ("act_vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"),
         ("heads", "tensor"), ("kv", None), ("vocab", "tensor"))


def _kernel(*names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


def _constrain(x, *names):
  return nn.with_logical_constraint(x, names)


class Attention(nn.Module):
  heads: int
  head_dim: int

  @nn.compact
  def __call__(self, x):
    embed = x.shape[-1]
    shape = (embed, self.heads, self.head_dim)

    def project(name):
      w = self.param(name, _kernel("embed", "heads", "kv"), shape)
      return _constrain(jnp.einsum("ble,ehd->blhd", x, w),
                        "batch", "length", "act_heads", "act_kv")

    q, k, v = project("query"), project("key"), project("value")
    length = x.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
    scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
    out = _constrain(out, "batch", "length", "act_heads", "act_kv")
    w_out = self.param("out", _kernel("heads", "kv", "embed"),
                       (self.heads, self.head_dim, embed))
    return jnp.einsum("blhd,hde->ble", out, w_out)


class Mlp(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.hidden, use_bias=False, kernel_init=_kernel("embed", "mlp"))(x)
    h = _constrain(nn.relu(h), "batch", "length", "act_mlp")
    return nn.Dense(x.shape[-1], use_bias=False, kernel_init=_kernel("mlp", "embed"))(h)


class LanguageModel(nn.Module):
  layers: int
  heads: int
  head_dim: int
  hidden: int
  vocab: int

  @nn.compact
  def __call__(self, x):
    act = ("batch", "length", "act_embed")
    for i in range(self.layers):
      x = _constrain(x + Attention(self.heads, self.head_dim, name=f"attention_{i}")(
          nn.LayerNorm(use_bias=False)(x)), *act)
      x = _constrain(x + Mlp(self.hidden, name=f"mlp_{i}")(
          nn.LayerNorm(use_bias=False)(x)), *act)
    logits = nn.Dense(self.vocab, use_bias=False, kernel_init=_kernel("embed", "vocab"),
                      name="logits")(x)
    return _constrain(logits, "batch", "length", "act_vocab")


def _sharding(mesh, *names):
  return NamedSharding(mesh, nn.logical_to_mesh_axes(names, RULES))


def build(tiny: bool):
  """The mesh, the jitted adamw training step and its arguments."""
  batch, length, embed = (8, 16, 64) if tiny else (16, 64, 256)
  model = LanguageModel(layers=2, heads=4, head_dim=embed // 4, hidden=2 * embed,
                        vocab=4 * embed)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                       axis_types=(AxisType.Auto,) * 3, devices=jax.devices()[:8])
  tx = optax.adamw(1e-3)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                              jnp.zeros((batch, length, embed))))
    param_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    opt_sh = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(jax.eval_shape(tx.init, boxed)), mesh, RULES)
    x_sh = _sharding(mesh, "batch", "length", "act_embed")
    y_sh = _sharding(mesh, "batch", "length", "act_vocab")

    def train_step(params, opt_state, x, y):
      loss, grads = jax.value_and_grad(
          lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step, in_shardings=(param_sh, opt_sh, x_sh, y_sh),
                   out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P())))
    kx, ky, kp = jax.random.split(jax.random.key(1), 3)
    x = jax.device_put(jax.random.normal(kx, (batch, length, embed)), x_sh)
    y = jax.device_put(jax.random.normal(ky, (batch, length, 4 * embed)), y_sh)
    unbox = lambda tree: nn.meta.unbox(tree)
    params = jax.jit(lambda k: unbox(model.init(k, x)), out_shardings=param_sh)(kp)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  return mesh, step, (params, opt_state, x, y)


def site_classes(report) -> collections.Counter:
  """Sites per (what happened, dataflow or reason class)."""
  classes = collections.Counter()
  for s in report.sites:
    if s.rewritten:
      classes[("sliced" if s in report.sliced else "collective", s.dataflow)] += 1
    else:
      classes[("left alone", reason_class(s.reason))] += 1
  return classes


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="smallest sizes (tests)")
  parser.add_argument("--ksplit", type=int, default=2,
                      help="slices forced on every site for the numerics check")
  args = parser.parse_args(argv)
  mesh, step, step_args = build(args.tiny)
  with jax.set_mesh(mesh):
    report = meshslice.explain(step)(*step_args)
  print(report.summary())
  for (what, kind), n in sorted(site_classes(report).items()):
    print(f"  {n:3d}  {what}: {kind}")
  with jax.set_mesh(mesh):
    forced = meshslice.explain(step, ksplit=args.ksplit)(*step_args)
    result = meshslice.check(step, ksplit=args.ksplit,
                             tolerance={"float32": 1e-3})(*step_args)
  print(f"forced ksplit={args.ksplit}: {forced.summary()}")
  print(str(result).splitlines()[0])       # the per-output table: print(result)
  print("OK" if result.ok else "DIFFER")
  return 0 if result.ok else 1


if __name__ == "__main__":
  sys.exit(main())
