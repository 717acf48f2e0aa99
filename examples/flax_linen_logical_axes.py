"""meshslice on a Flax Linen transformer with logical axis annotations and optax.

What this shows, in order:
  1. a Linen model (attention + MLP blocks) whose parameters and activations carry
     *logical* axis names (`nn.with_logical_partitioning`, `nn.with_logical_constraint`),
     mapped to a 2x4 Auto mesh by `nn.logical_axis_rules` so that activations are
     [batch:x, seq, embed:y] and every kernel is [input side:x, output side:y]: the 2D
     layout whose matmuls meshslice rewrites;
  2. an optax (adamw) training step, jitted with the shardings the rules give;
  3. meshslice.transform, meshslice.explain (the report), meshslice.check (the
     transformed step against plain jit and an unsharded run), a saved plan applied again;
  4. planning the same model at pod size (abstract inputs on a 32x8 AbstractMesh: nothing
     is allocated) and, when libtpu is installed, an ahead-of-time compile for a small
     TPU topology.

Run:  python examples/flax_linen_logical_axes.py [--tiny] [--no-aot]
(on a CPU-only machine it emulates 8 devices). Exits non-zero if the check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)    # 8 emulated devices when running on CPU

import flax.linen as nn                        # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402
import optax                                   # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P    # noqa: E402

import meshslice                               # noqa: E402

# Logical axis -> mesh axis. Activations: batch over x, features (embed, mlp, heads) over
# y. Kernels: the side a matmul contracts ("*_in") over x, the side it produces over y.
# So every forward matmul is X[M:x, K:y] . W[K:x, N:y] -> Y[M:x, N:y] (meshslice's OS
# pattern); its backward-data and backward-weight matmuls are the LS and RS patterns.
RULES = (("batch", "x"), ("seq", None), ("embed", "y"), ("mlp", "y"), ("heads", "y"),
         ("kv", None), ("embed_in", "x"), ("mlp_in", "x"))


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 2
  batch: int = 16
  seq: int = 64
  embed: int = 256
  heads: int = 8
  mlp: int = 1024
  dtype: str = "float32"


TINY = Config(layers=1, batch=8, seq=8, embed=64, heads=4, mlp=128)
# What we plan for the pod: a GPT-3-sized layer, one 2048-token sequence per chip.
POD = Config(layers=1, batch=256, seq=2048, embed=12288, heads=96, mlp=49152, dtype="bfloat16")


def kernel(*names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Attention(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    b, s, _ = x.shape
    head_dim = cfg.embed // cfg.heads
    dense = lambda name, t: nn.Dense(cfg.embed, use_bias=False, dtype=cfg.dtype, name=name,
                                     kernel_init=kernel("embed_in", "embed"))(t)
    # [batch, seq, embed] -> [batch, seq, heads, kv]: heads inherit embed's mesh axis
    split = lambda t: nn.with_logical_constraint(t.reshape(b, s, cfg.heads, head_dim),
                                                 ("batch", "seq", "heads", "kv"))
    q, k, v = (split(dense(name, x)) for name in ("query", "key", "value"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim).astype(cfg.dtype)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.embed)
    out = nn.with_logical_constraint(out, ("batch", "seq", "embed"))
    return dense("out", out)


class Mlp(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    h = nn.Dense(cfg.mlp, use_bias=False, dtype=cfg.dtype, name="wi",
                 kernel_init=kernel("embed_in", "mlp"))(x)
    h = nn.with_logical_constraint(nn.gelu(h), ("batch", "seq", "mlp"))
    return nn.Dense(cfg.embed, use_bias=False, dtype=cfg.dtype, name="wo",
                    kernel_init=kernel("mlp_in", "embed"))(h)


class Block(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    norm = lambda name: nn.LayerNorm(dtype=self.cfg.dtype, name=name, use_bias=False,
                                     scale_init=nn.with_logical_partitioning(
                                         nn.initializers.ones, ("embed",)))
    act = lambda t: nn.with_logical_constraint(t, ("batch", "seq", "embed"))
    x = act(x + Attention(self.cfg)(norm("ln1")(x)))
    return act(x + Mlp(self.cfg)(norm("ln2")(x)))


class Model(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    for i in range(self.cfg.layers):
      x = Block(self.cfg, name=f"block_{i}")(x)
    return x


def build(cfg: Config, mesh):
  """The user's training step and the shardings of its inputs, from the logical rules.
  `mesh` may be a real Mesh or an AbstractMesh (shapes and shardings only)."""
  model = Model(cfg)
  tx = optax.adamw(1e-3)
  shape = (cfg.batch, cfg.seq, cfg.embed)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(shape, cfg.dtype)))
  # optax keeps Flax's partitioning boxes, so adam's moments get the params' specs
  boxed_opt = jax.eval_shape(tx.init, boxed)
  to_sharding = lambda tree: nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh,
                                                         RULES)
  param_sh, opt_sh = to_sharding(boxed), to_sharding(boxed_opt)
  data_sh = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq", "embed"), RULES))

  def train_step(params, opt_state, x, y):
    def loss_fn(p):
      return jnp.mean(jnp.square((model.apply(p, x) - y).astype(jnp.float32)))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(train_step, in_shardings=(param_sh, opt_sh, data_sh, data_sh),
                 out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P())))
  # drop the boxes (their value is the array; `nn.meta.unbox` would add constraints)
  unbox = lambda tree: jax.tree.map(lambda v: v.value if isinstance(v, nn.Partitioned) else v,
                                    tree, is_leaf=lambda v: isinstance(v, nn.Partitioned))
  abstract = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           unbox(boxed), param_sh),
              jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           unbox(boxed_opt), opt_sh),
              jax.ShapeDtypeStruct(shape, cfg.dtype, sharding=data_sh),
              jax.ShapeDtypeStruct(shape, cfg.dtype, sharding=data_sh))

  def init(seed=0):
    """Concrete, sharded params, optimizer state and a batch."""
    kp, kx, ky = jax.random.split(jax.random.key(seed), 3)
    x = jax.device_put(jax.random.normal(kx, shape, cfg.dtype), data_sh)
    y = jax.device_put(jax.random.normal(ky, shape, cfg.dtype), data_sh)
    params = jax.jit(lambda k: unbox(model.init(k, x)), out_shardings=param_sh)(kp)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    return params, opt_state, x, y

  return step, abstract, init


def gain(report) -> str:
  pred, base = report.predicted_seconds, report.baseline_seconds
  return (f"predicted matmul time {pred * 1e3:.2f} ms vs {base * 1e3:.2f} ms with the plain "
          f"collective algorithm: {base / pred if pred else 1.0:.2f}x")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true",
                      default=bool(os.environ.get("MESHSLICE_EXAMPLE_TINY")),
                      help="tiny sizes (for tests); also MESHSLICE_EXAMPLE_TINY=1")
  parser.add_argument("--no-aot", action="store_true", help="skip the TPU ahead-of-time part")
  parser.add_argument("--pod", default="32x8", help="pod mesh to plan for (default 32x8)")
  args = parser.parse_args(argv)
  cfg = TINY if args.tiny else Config()

  # --- 1. the user's program on a 2x4 Auto mesh -------------------------------------------
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:8])
  print(f"== {cfg} on mesh {dict(mesh.shape)} ({jax.devices()[0].platform})")
  # Flax reads the rules, and with_logical_constraint the mesh, while the step is traced:
  # keep both active around every call that traces (transform's first call, explain, check).
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    step, _, init = build(cfg, mesh)
    params, opt_state, x, y = init()

    # explain: what the pass does to each matmul and why (nothing is compiled)
    report = meshslice.explain(step)(params, opt_state, x, y)
    print(report)

    # transform: a drop-in replacement; the cost model picks each site's plan. On these
    # small sizes it mostly keeps the plain collective; force slicing with ksplit=2 to
    # exercise the pipelined code, and pin a module-path pattern for one layer type.
    options = dict(ksplit=2, overrides={"*/Mlp_0/wo": {"ksplit": 1}})
    fast_step = meshslice.transform(step, **options)
    new_params, new_opt, loss = fast_step(params, opt_state, x, y)
    print(f"transformed step: loss {float(loss):.5f}")

    # check: plain jit vs transformed vs an unsharded single-device run, on these inputs.
    # Adam divides by the root of the second moment, so near-zero gradient entries turn
    # float reassociation into ~1e-4..1e-3 relative differences in the updated params;
    # plain jit differs from the unsharded run by as much, so judge at 1e-3.
    result = meshslice.check(step, tolerance={"float32": 1e-3}, **options)(
        params, opt_state, x, y)
    print(result)
    print(f"forced ksplit=2: {result.report.summary()}")

    # a plan: save it (portable JSON), apply it later or on every host of a job
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "plan.json")
      fast_step.explain(params, opt_state, x, y).plan.save(path)
      planned = meshslice.transform(step, plan=path)
      replay = planned(params, opt_state, x, y)
      same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                 zip(jax.tree.leaves(replay), jax.tree.leaves((new_params, new_opt, loss))))
      print(f"plan saved to plan.json and applied: "
            f"{planned.explain(params, opt_state, x, y).summary()}; "
            f"outputs {'identical' if same else 'DIFFER'}")
  print(f"report summary (cost model's choice): {report.summary()}")

  # --- 2. plan for the pod, from this machine: abstract inputs, nothing allocated -------------
  rows, cols = (int(v) for v in args.pod.split("x"))
  pod = jax.sharding.AbstractMesh((rows, cols), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  pod_cfg = POD if not args.tiny else dataclasses.replace(
      POD, batch=rows, seq=256, embed=64 * cols, heads=cols, mlp=256 * cols)
  with jax.sharding.use_abstract_mesh(pod), nn.logical_axis_rules(RULES):
    pod_step, pod_args, _ = build(pod_cfg, pod)
    pod_report = meshslice.explain(pod_step, profile="tpu-v4")(*pod_args)
  print(f"pod plan ({rows}x{cols} TPU v4, {pod_cfg}): {pod_report.summary()}")
  print(f"pod plan: {gain(pod_report)}")

  # --- 3. ahead-of-time compile for a small TPU topology (needs libtpu) ----------------------
  from meshslice import aot
  if args.no_aot:
    print("aot: skipped (--no-aot)")
  elif not aot.have_libtpu():
    print("aot: skipped (libtpu not installed: pip install 'jax[tpu]')")
  else:
    tpu = aot.make_mesh("v4:2x2x2", (2, 4))       # 8 compile-only TPU v4 chips
    with jax.set_mesh(tpu), nn.logical_axis_rules(RULES):
      tpu_step, tpu_args, _ = build(cfg, tpu)
      fast = meshslice.transform(tpu_step, profile="tpu-v4")
      print(f"aot plan on v4:2x2x2: {fast.explain(*tpu_args).summary()}")
      plain, plain_s = aot.compile(tpu_step, *tpu_args, mesh=tpu)
      compiled, fast_s = aot.compile(fast, *tpu_args, mesh=tpu)
    before = aot.analyze(plain, "tpu-v4").simulation.step_s
    after = aot.analyze(compiled, "tpu-v4").simulation.step_s
    print(f"aot: compiled for v4:2x2x2 in {plain_s:.1f} s (plain) and {fast_s:.1f} s "
          f"(transformed); simulated step {before * 1e3:.3f} ms plain, "
          f"{after * 1e3:.3f} ms transformed")

  if not result.ok:
    print("FAILED: the transformed step disagrees with the reference", file=sys.stderr)
    return 1
  print("OK")
  return 0


if __name__ == "__main__":
  sys.exit(main())
