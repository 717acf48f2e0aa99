"""meshslice on a Flax NNX transformer over an Explicit mesh, trained with optax.

What this shows, in order:
  1. an NNX model (attention + MLP blocks) on a 2x4 mesh with *Explicit* axes (the
     default of `jax.make_mesh` in jax 0.10): every array's type carries its sharding.
     Kernels are created sharded [in:x, out:y] (`nnx.with_partitioning`), and each matmul
     spells out its 2D result layout with `out_sharding=P("x", None, "y")`: activations are
     [batch:x, seq, embed:y]. (Under Explicit axes JAX itself rejects `x @ w` with both
     operands 2D-sharded unless the result layout is given.)
  2. a functional optax (adamw) training step over the model's `nnx.Param` state, jitted,
     run under `jax.set_mesh(mesh)`;
  3. meshslice.transform, meshslice.explain (the report), meshslice.check (the
     transformed step against plain jit and an unsharded run), a saved plan applied again;
  4. planning the same model at pod size (abstract inputs on a 32x8 AbstractMesh: nothing
     is allocated) and, when libtpu is installed, an ahead-of-time compile for a small
     TPU topology.

Run:  python examples/flax_nnx_explicit.py [--tiny] [--no-aot]
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

import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402
import optax                                   # noqa: E402
from flax import nnx                           # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P    # noqa: E402

import meshslice                               # noqa: E402

ACT = P("x", None, "y")        # activations [batch:x, seq, embed:y]
HEADS = P("x", None, "y", None)  # [batch:x, seq, heads:y, head_dim]


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


def linear(n_in, n_out, cfg, rngs):
  """A bias-free Linear whose kernel is created 2D-sharded: [in:x, out:y]."""
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype,
                    kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                      ("x", "y")), rngs=rngs)


class Attention(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.cfg = cfg
    self.query, self.key, self.value, self.out = (
        linear(cfg.embed, cfg.embed, cfg, rngs) for _ in range(4))

  def __call__(self, x):
    cfg = self.cfg
    b, s, _ = x.shape
    head_dim = cfg.embed // cfg.heads
    # project, then split embed into (heads, head_dim): heads keep embed's axis y
    split = lambda t: t.reshape(b, s, cfg.heads, head_dim, out_sharding=HEADS)
    q = split(self.query(x, out_sharding=ACT))
    k = split(self.key(x, out_sharding=ACT))
    v = split(self.value(x, out_sharding=ACT))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim).astype(cfg.dtype)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.embed, out_sharding=ACT)
    return self.out(out, out_sharding=ACT)


class Mlp(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.wi = linear(cfg.embed, cfg.mlp, cfg, rngs)
    self.wo = linear(cfg.mlp, cfg.embed, cfg, rngs)

  def __call__(self, x):
    return self.wo(jax.nn.gelu(self.wi(x, out_sharding=ACT)), out_sharding=ACT)


class Block(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    norm = lambda: nnx.LayerNorm(cfg.embed, use_bias=False, dtype=cfg.dtype,
                                 param_dtype=cfg.dtype, rngs=rngs,
                                 scale_init=nnx.with_partitioning(nnx.initializers.ones,
                                                                  ("y",)))
    self.ln1, self.attn, self.ln2, self.mlp = norm(), Attention(cfg, rngs), norm(), Mlp(cfg, rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class Model(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def build(cfg: Config, mesh):
  """The user's training step and abstract inputs for it (call under jax.set_mesh or
  jax.sharding.use_abstract_mesh). `mesh` may be a real Mesh or an AbstractMesh."""
  tx = optax.adamw(1e-3)
  abstract_model = nnx.eval_shape(lambda: Model(cfg, nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  shape = (cfg.batch, cfg.seq, cfg.embed)

  def train_step(params, opt_state, x, y):
    def loss_fn(p):
      out = nnx.merge(graphdef, p)(x)
      return jnp.mean(jnp.square((out - y).astype(jnp.float32)))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # Explicit axes: no in_shardings needed, the inputs' types carry their layouts
  step = jax.jit(train_step)
  data = jax.ShapeDtypeStruct(shape, cfg.dtype, sharding=NamedSharding(mesh, ACT))
  abstract = (abstract_params, jax.eval_shape(tx.init, abstract_params), data, data)

  def init(seed=0):
    """Concrete, sharded params, optimizer state and a batch."""
    kx, ky = jax.random.split(jax.random.key(seed + 1))
    _, params = nnx.split(Model(cfg, nnx.Rngs(seed)), nnx.Param)
    x = jax.device_put(jax.random.normal(kx, shape, cfg.dtype), ACT)
    y = jax.device_put(jax.random.normal(ky, shape, cfg.dtype), ACT)
    return params, tx.init(params), x, y

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
  explicit = (AxisType.Explicit,) * 2

  # --- 1. the user's program on a 2x4 Explicit mesh ---------------------------------------
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=explicit, devices=jax.devices()[:8])
  print(f"== {cfg} on mesh {dict(mesh.shape)} ({jax.devices()[0].platform}, Explicit axes)")
  with jax.set_mesh(mesh):
    step, _, init = build(cfg, mesh)
    params, opt_state, x, y = init()

    # explain: what the pass does to each matmul and why (nothing is compiled)
    report = meshslice.explain(step)(params, opt_state, x, y)
    print(report)

    # transform: a drop-in replacement; the cost model picks each site's plan. On these
    # small sizes it mostly keeps the plain collective; force slicing with ksplit=2 to
    # exercise the pipelined code. NNX sites are named by the parameter they read or
    # make (its attribute path in the model state), so overrides can select e.g. every
    # projection of the MLPs: "*/mlp/*", one in every block: "blocks/mlp/wo", or one
    # block's: "blocks/1/mlp/wo" (a list of layers is named per position).
    options = dict(ksplit=2, overrides={"*/mlp/*": {"ksplit": 1}})
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
  pod = jax.sharding.AbstractMesh((rows, cols), ("x", "y"), axis_types=explicit)
  pod_cfg = POD if not args.tiny else dataclasses.replace(
      POD, batch=rows, seq=256, embed=64 * cols, heads=cols, mlp=256 * cols)
  with jax.sharding.use_abstract_mesh(pod):
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
    devices = aot.make_mesh("v4:2x2x2", (2, 4)).devices   # 8 compile-only TPU v4 chips
    tpu = jax.sharding.Mesh(devices, ("x", "y"), axis_types=explicit)
    with jax.set_mesh(tpu):
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
