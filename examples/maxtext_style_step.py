"""meshslice on a plain-JAX training step written the MaxText way.

What this shows, in order:
  1. a decoder-only LM as a params dict (token embedding, per-layer attention + MLP
     weights stacked on a leading layer axis, unembedding), layers run by `jax.lax.scan`
     over a `jax.checkpoint`-ed (rematerialized) block, activations pinned with
     `jax.lax.with_sharding_constraint`, attention projections as einsums with 3D kernels
     ("bse,enh->bsnh"), a cross-entropy loss and an SGD update;
  2. a 3-axis Auto mesh (data, x, y) on 8 devices: data parallelism over "data" (1, or 2
     with --data 2), 2D tensor parallelism over x and y. Activations are
     [batch:(data, x), seq, embed:y] (the batch is split over two axes, the one meshslice
     communicates over, x, is the minor one) and kernels [in:x, out:y];
  3. meshslice.transform, meshslice.explain (the report), meshslice.check (the
     transformed step against plain jit and an unsharded run), a saved plan applied again;
  4. planning the same model at pod size (abstract inputs on a 2x16x8 AbstractMesh:
     nothing is allocated) and, when libtpu is installed, an ahead-of-time compile for a
     small TPU topology.

Run:  python examples/maxtext_style_step.py [--tiny] [--data 1|2] [--no-aot]
(on a CPU-only machine it emulates 8 devices). Exits non-zero if the check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)    # 8 emulated devices when running on CPU

import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P    # noqa: E402

import meshslice                               # noqa: E402

BATCH = ("data", "x")          # the batch is split over data and x
# Logical layouts, as MaxText's rules would resolve them on a (data, x, y) mesh.
SPECS = {
    "activation": P(BATCH, None, "y"),             # [batch, seq, embed]
    "activation_heads": P(BATCH, None, "y", None),  # [batch, seq, heads, head_dim]
    "activation_mlp": P(BATCH, None, "y"),         # [batch, seq, mlp]
    "logits": P(BATCH, None, "y"),                 # [batch, seq, vocab]
    "tokens": P(BATCH, None),                      # [batch, seq]
}
PARAM_SPECS = {
    "embedding": P(None, "y"),                     # [vocab, embed]
    "unembedding": P("x", "y"),                    # [embed, vocab]
    "layers": {
        "query": P(None, "x", "y", None),          # [layer, embed, heads, head_dim]
        "key": P(None, "x", "y", None),
        "value": P(None, "x", "y", None),
        "out": P(None, "x", None, "y"),            # [layer, heads, head_dim, embed]
        "wi": P(None, "x", "y"),                   # [layer, embed, mlp]
        "wo": P(None, "x", "y"),                   # [layer, mlp, embed]
        "ln1": P(None, "y"), "ln2": P(None, "y"),  # [layer, embed]
    },
}


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 2
  batch: int = 16
  seq: int = 64
  embed: int = 256
  heads: int = 8
  mlp: int = 1024
  vocab: int = 512
  dtype: str = "float32"
  learning_rate: float = 1e-2


TINY = Config(layers=2, batch=8, seq=8, embed=64, heads=4, mlp=128, vocab=64)
# What we plan for the pod: a GPT-3-sized layer, one 2048-token sequence per chip.
POD = Config(layers=1, batch=256, seq=2048, embed=12288, heads=96, mlp=49152, vocab=32768,
             dtype="bfloat16")


def param_shapes(cfg: Config):
  L, E, N, M, V = cfg.layers, cfg.embed, cfg.heads, cfg.mlp, cfg.vocab
  D = E // N
  dt = jnp.dtype(cfg.dtype)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
  return {"embedding": s(V, E), "unembedding": s(E, V),
          "layers": {"query": s(L, E, N, D), "key": s(L, E, N, D), "value": s(L, E, N, D),
                     "out": s(L, N, D, E), "wi": s(L, E, M), "wo": s(L, M, E),
                     "ln1": s(L, E), "ln2": s(L, E)}}


def init_params(cfg: Config, key):
  """Random weights scaled by 1/sqrt(fan-in); layernorm scales of one."""
  fan_in = {"embedding": 1, "unembedding": cfg.embed, "query": cfg.embed, "key": cfg.embed,
            "value": cfg.embed, "out": cfg.embed, "wi": cfg.embed, "wo": cfg.mlp}
  leaves, tree = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
  keys = jax.random.split(key, len(leaves))

  def one(k, path, s):
    name = path[-1].key
    if name.startswith("ln"):
      return jnp.ones(s.shape, s.dtype)
    return (jax.random.normal(k, s.shape, jnp.float32) / np.sqrt(fan_in[name])).astype(s.dtype)

  return jax.tree.unflatten(tree, [one(k, path, s) for k, (path, s) in zip(keys, leaves)])


def rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
  return x32.astype(x.dtype) * scale


def decoder_layer(cfg: Config, constrain, x, layer):
  """One block: attention + MLP, pre-norm, residuals; activations constrained."""
  _, s, _ = x.shape
  h = rms_norm(x, layer["ln1"])
  proj = lambda w: constrain(jnp.einsum("bse,enh->bsnh", h, w), "activation_heads")
  q, k, v = proj(layer["query"]), proj(layer["key"]), proj(layer["value"])
  scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1]).astype(cfg.dtype)
  causal = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
  attn = constrain(jnp.einsum("bnqk,bknh->bqnh", probs, v), "activation_heads")
  x = constrain(x + jnp.einsum("bsnh,nhe->bse", attn, layer["out"]), "activation")
  h = rms_norm(x, layer["ln2"])
  h = constrain(jax.nn.gelu(jnp.einsum("bse,em->bsm", h, layer["wi"])), "activation_mlp")
  return constrain(x + jnp.einsum("bsm,me->bse", h, layer["wo"]), "activation")


def make_step(cfg: Config, mesh):
  """The user's jitted training step (and its shardings) on a (data, x, y) mesh, which
  may be an AbstractMesh."""
  named = lambda spec: NamedSharding(mesh, spec)
  constrain = lambda t, name: jax.lax.with_sharding_constraint(t, named(SPECS[name]))

  def loss_fn(params, tokens, targets):
    x = constrain(jnp.take(params["embedding"], tokens, axis=0), "activation")
    # scan over the stacked layers; full remat of each block (MaxText's remat_policy=full)
    block = jax.checkpoint(functools.partial(decoder_layer, cfg, constrain),
                           policy=jax.checkpoint_policies.nothing_saveable)
    x, _ = jax.lax.scan(lambda c, layer: (block(c, layer), None), x, params["layers"])
    logits = constrain(jnp.einsum("bse,ev->bsv", x, params["unembedding"]), "logits")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

  def train_step(params, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    new = jax.tree.map(lambda p, g: (p - cfg.learning_rate * g).astype(p.dtype), params, grads)
    return new, loss

  param_sh = jax.tree.map(named, PARAM_SPECS)
  token_sh = named(SPECS["tokens"])
  step = jax.jit(train_step, in_shardings=(param_sh, token_sh, token_sh),
                 out_shardings=(param_sh, named(P())))
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32, sharding=token_sh)
  abstract = (jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                           param_shapes(cfg), param_sh), tokens, tokens)
  return step, abstract, param_sh, token_sh


def gain(report) -> str:
  pred, base = report.predicted_seconds, report.baseline_seconds
  return (f"predicted matmul time {pred * 1e3:.2f} ms vs {base * 1e3:.2f} ms with the plain "
          f"collective algorithm: {base / pred if pred else 1.0:.2f}x")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true",
                      default=bool(os.environ.get("MESHSLICE_EXAMPLE_TINY")),
                      help="tiny sizes (for tests); also MESHSLICE_EXAMPLE_TINY=1")
  parser.add_argument("--data", type=int, default=1, choices=(1, 2),
                      help="size of the data-parallel axis (x and y share the rest of 8); "
                           "with 2, plain jax.jit itself computes wrong gradients on CPU "
                           "(jax 0.10.2); the check shows the transformed step agrees "
                           "with the unsharded reference")
  parser.add_argument("--no-aot", action="store_true", help="skip the TPU ahead-of-time part")
  parser.add_argument("--pod", default="2x16x8", help="pod mesh data x X x Y (default 2x16x8)")
  args = parser.parse_args(argv)
  cfg = TINY if args.tiny else Config()
  shape = (args.data, 2, 4 // args.data)
  auto = (AxisType.Auto,) * 3

  # --- 1. the user's program on an 8-device (data, x, y) Auto mesh --------------------------
  mesh = jax.make_mesh(shape, ("data", "x", "y"), axis_types=auto, devices=jax.devices()[:8])
  print(f"== {cfg} on mesh {dict(mesh.shape)} ({jax.devices()[0].platform})")
  step, _, param_sh, token_sh = make_step(cfg, mesh)
  kp, kt = jax.random.split(jax.random.key(0))
  params = jax.jit(functools.partial(init_params, cfg), out_shardings=param_sh)(kp)
  tokens = jax.device_put(jax.random.randint(kt, (cfg.batch, cfg.seq + 1), 0, cfg.vocab),
                          NamedSharding(mesh, P()))
  inputs = jax.device_put(tokens[:, :-1], token_sh)
  targets = jax.device_put(tokens[:, 1:], token_sh)
  args_ = (params, inputs, targets)

  # explain: what the pass does to each matmul and why (nothing is compiled)
  report = meshslice.explain(step)(*args_)
  print(report)

  # transform: a drop-in replacement; the cost model picks each site's plan. On these small
  # sizes it mostly keeps the plain collective; force slicing with ksplit=2 to exercise the
  # pipelined code.
  options = dict(ksplit=2)
  fast_step = meshslice.transform(step, **options)
  _, loss = fast_step(*args_)
  print(f"transformed step: loss {float(loss):.5f}")

  # check: plain jit vs transformed vs an unsharded single-device run, on these inputs
  result = meshslice.check(step, **options)(*args_)
  print(result)
  print(f"forced ksplit=2: {result.report.summary()}")

  # a plan: save the cost model's plan (portable JSON), edit one site, apply it later or
  # on every host of a job
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "plan.json")
    first = report.rewritten[0].index
    report.plan.edit(first, ksplit=2).save(path)
    planned = meshslice.transform(step, plan=path)
    new_params, loss = planned(*args_)
    print(f"plan saved to plan.json (site #{first} edited to ksplit=2) and applied: "
          f"{planned.explain(*args_).summary()}; loss {float(loss):.5f}")
  print(f"report summary (cost model's choice): {report.summary()}")

  # --- 2. plan for the pod, from this machine: abstract inputs, nothing allocated -------------
  pod_shape = tuple(int(v) for v in args.pod.split("x"))
  pod = jax.sharding.AbstractMesh(pod_shape, ("data", "x", "y"), axis_types=auto)
  n = pod_shape[0] * pod_shape[1]
  heads = math.lcm(*pod_shape[1:])     # heads are split over y (q, k, v) and x (out)
  pod_cfg = POD if not args.tiny else dataclasses.replace(
      POD, batch=n, seq=256, embed=64 * heads, heads=heads, mlp=256 * heads, vocab=128 * heads)
  pod_step, pod_args, _, _ = make_step(pod_cfg, pod)
  pod_report = meshslice.explain(pod_step, profile="tpu-v4")(*pod_args)
  print(f"pod plan ({args.pod} TPU v4, {pod_cfg}): {pod_report.summary()}")
  print(f"pod plan: {gain(pod_report)}")

  # --- 3. ahead-of-time compile for a small TPU topology (needs libtpu) ----------------------
  from meshslice import aot
  if args.no_aot:
    print("aot: skipped (--no-aot)")
  elif not aot.have_libtpu():
    print("aot: skipped (libtpu not installed: pip install 'jax[tpu]')")
  else:
    tpu = aot.make_mesh("v4:2x2x2", shape, ("data", "x", "y"))  # 8 compile-only v4 chips
    tpu_step, tpu_args, _, _ = make_step(cfg, tpu)
    fast = meshslice.transform(tpu_step, profile="tpu-v4")
    tpu_report = fast.explain(*tpu_args)
    print(f"aot plan on v4:2x2x2: {tpu_report.summary()}")
    plain, plain_s = aot.compile(tpu_step, *tpu_args, mesh=tpu)
    before = aot.analyze(plain, "tpu-v4").simulation.step_s
    if not tpu_report.rewritten:
      # every site left to XLA: the transformed step compiles to plain jit's program
      print(f"aot: compiled for v4:2x2x2 in {plain_s:.1f} s; every site left to XLA, so "
            f"the transformed step is the plain program: simulated step "
            f"{before * 1e3:.3f} ms")
    else:
      compiled, fast_s = aot.compile(fast, *tpu_args, mesh=tpu)
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
