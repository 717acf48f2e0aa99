"""A whole training step, 2D-sharded: the benchmark model at pod scale.

`meshslice.gpt` is one layer type behind SGD and a squared-error loss; this module wraps
layers like it into everything else a real step runs, so that a compiled schedule and
its simulation see a step's whole shape:

    tokens [B:x, S]                                           int32
    one_hot(tokens) [B:x, S, V:y] @ embed [V:x, H:y]          token embedding (a matmul)
      (+ pos_embed [S, H:y] for the GPT presets)
    scan over N checkpointed blocks (layers stacked on a leading axis, remat per layer)
      gpt:   gpt.block: layernorm, causal MHA, layernorm, gelu MLP (4x)
      llama: RMSNorm, causal GQA attention with RoPE, RMSNorm, SwiGLU MLP
    final norm, logits = h [B:x, S, H:y] @ unembed [H:x, V:y]
    loss: mean softmax cross-entropy against `targets` (float32)
    Adam (by hand, optax's formula): float32 moments mu / nu laid out like the params

Layout (the project's 2D layer, docs/design.md): activations [tokens: x, hidden: y],
weights [in: x, out: y]. The embedding is a one-hot matmul (as MaxText's
`use_iota_embed`) so that it is a 2D-sharded matmul like the others; its layouts give
the forward os and the weight gradient rs (integer tokens have no data gradient), the
unembedding's all three (os, ls, rs), before the planner picks per site. Embedding and
unembedding are untied; no biases, no dropout. Sites of one step (the scan holds one
copy of each layer's matmuls): 36 for the GPT kind, 40 for the Llama kind
(tests/test_whole_step.py derives them).

Presets (`PRESETS`; params in bfloat16, Adam moments in float32, the loss in float32):

    gpt3      hidden 12288, 96 heads, ffn 4x, seq 2048, vocab 50304 (padded)
    megatron  hidden 20480, 160 heads, ffn 4x, seq 2048, vocab 50304 (padded)
    llama70b  hidden 8192, 64 query / 8 KV heads (GQA), SwiGLU ffn 28672, RMSNorm,
              RoPE, seq 4096, vocab 32000
    tiny, tiny_llama   float32 steps of the same two kinds for an 8-device CPU mesh

    from meshslice import whole_step as ws
    step, params, opt_state, batch = ws.whole_step("gpt3", mesh, layers=4)
    meshslice.explain(step, profile="tpu-v4")(params, opt_state, batch)
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from . import gpt


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WholeConfig:
  """A whole step's sizes (global; batch in sequences), its kind ("gpt": `gpt.block`,
  learned positions, layernorm; "llama": GQA + RoPE + SwiGLU + RMSNorm), its param
  element type and Adam's hyper-parameters (moments are float32 whatever `dtype`).

  Example:
    >>> PRESETS["llama70b"].kv_heads, PRESETS["llama70b"].ffn
    (8, 28672)
  """

  name: str = "custom"
  kind: str = "gpt"
  layers: int = 4
  batch: int = 8
  seq: int = 16
  hidden: int = 64
  heads: int = 4
  kv_heads: int = 0            # 0: as many as `heads` (no GQA)
  ffn: int = 256
  vocab: int = 128
  dtype: str = "bfloat16"
  learning_rate: float = 1e-3
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  rope_theta: float = 10000.0

  @property
  def kv(self) -> int:
    """Key/value heads."""
    return self.kv_heads or self.heads

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads


KINDS = ("gpt", "llama")
_GPT_VOCAB = 50304            # GPT-2's 50257 padded to a multiple of 128

PRESETS = {
    "gpt3": WholeConfig(name="gpt3", seq=2048, hidden=12288, heads=96, ffn=4 * 12288,
                        vocab=_GPT_VOCAB),
    "megatron": WholeConfig(name="megatron", seq=2048, hidden=20480, heads=160,
                            ffn=4 * 20480, vocab=_GPT_VOCAB),
    "llama70b": WholeConfig(name="llama70b", kind="llama", seq=4096, hidden=8192, heads=64,
                            kv_heads=8, ffn=28672, vocab=32000, learning_rate=3e-4),
    # eps 1e-6, not 1e-8: Adam's first step sends a gradient g to about lr * g / (|g| +
    # eps), so a near-zero gradient's rounding (float32 sums reassociated by the
    # sharding, ~1e-9 here) moves its update by up to lr * 1e-9 / eps: 0.1 lr at 1e-8
    # (beyond float32's 1e-4 tolerance), 1e-3 lr at 1e-6 (guide, "Numerics")
    "tiny": WholeConfig(name="tiny", seq=16, hidden=64, heads=4, ffn=256, vocab=128,
                        dtype="float32", eps=1e-6),
    "tiny_llama": WholeConfig(name="tiny_llama", kind="llama", seq=16, hidden=64, heads=8,
                              kv_heads=4, ffn=192, vocab=128, dtype="float32", eps=1e-6),
}

GPT_WEIGHTS = gpt.WEIGHTS                                    # wq wk wv wo w_up w_down
LLAMA_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def config(model: str | WholeConfig, *, layers: int | None = None, batch: int | None = None,
           seq: int | None = None, vocab: int | None = None,
           dtype: str | None = None) -> WholeConfig:
  """A preset by name (or a WholeConfig) with overrides, checked.

  Raises:
    ValueError: an unknown preset, a non-positive size, or sizes that do not divide
      (hidden by heads, heads by kv_heads).

  Example:
    >>> c = config("gpt3", layers=4, batch=256)
    >>> c.hidden, c.heads, c.ffn, c.seq, c.vocab, c.dtype, c.layers
    (12288, 96, 49152, 2048, 50304, 'bfloat16', 4)
  """
  if isinstance(model, WholeConfig):
    base = model
  elif model in PRESETS:
    base = PRESETS[model]
  else:
    raise ValueError(f"model must be one of {', '.join(PRESETS)} or a WholeConfig, "
                     f"got {model!r}")
  overrides = {k: v for k, v in (("layers", layers), ("batch", batch), ("seq", seq),
                                 ("vocab", vocab), ("dtype", dtype)) if v is not None}
  cfg = dataclasses.replace(base, **overrides)
  for name in ("layers", "batch", "seq", "hidden", "heads", "ffn", "vocab"):
    value = getattr(cfg, name)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if cfg.kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {cfg.kind!r}")
  if cfg.dtype not in ("bfloat16", "float32", "float16"):
    raise ValueError(f"dtype must be 'bfloat16', 'float32' or 'float16' (the params'; "
                     f"Adam's moments are float32), got {cfg.dtype!r}")
  if cfg.hidden % cfg.heads or cfg.heads % cfg.kv:
    raise ValueError(f"hidden ({cfg.hidden}) must be a multiple of heads ({cfg.heads}) "
                     f"and heads a multiple of kv_heads ({cfg.kv})")
  return cfg


# ----------------------------------------------------------------------------- params

def _shapes(cfg: WholeConfig) -> dict:
  """{name: shape} of one layer's arrays (without the leading layer axis)."""
  h, f = cfg.hidden, cfg.ffn
  if cfg.kind == "gpt":
    return {"wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h), "w_up": (h, f),
            "w_down": (f, h), "ln1": (h,), "ln2": (h,)}
  kv = cfg.kv * cfg.head_dim
  return {"wq": (h, h), "wk": (h, kv), "wv": (h, kv), "wo": (h, h), "w_gate": (h, f),
          "w_up": (h, f), "w_down": (f, h), "ln1": (h,), "ln2": (h,)}


NORMS_NAMED = ("ln1", "ln2", "final_norm")      # scale vectors, initialised to ones


def param_shapes(cfg: WholeConfig) -> dict:
  """{"embed": [V, H], "pos_embed": [S, H] (gpt only), "layers": {name: [L, ...]},
  "final_norm": [H], "unembed": [H, V]} as `jax.ShapeDtypeStruct`s of `cfg.dtype`."""
  dtype = jnp.dtype(cfg.dtype)
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  h, v = cfg.hidden, cfg.vocab
  tree = {"embed": sds(v, h),
          "layers": {name: sds(cfg.layers, *s) for name, s in _shapes(cfg).items()},
          "final_norm": sds(h), "unembed": sds(h, v)}
  if cfg.kind == "gpt":
    tree["pos_embed"] = sds(cfg.seq, h)
  return tree


def init_params(cfg: WholeConfig, seed: int = 0) -> dict:
  """`param_shapes` filled on the host (numpy; nothing compiled): matrices normal over
  sqrt(fan-in), the token embedding unit normal, positions normal / sqrt(10), norm
  scales ones."""
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = path[-1].key
    if name in NORMS_NAMED:
      return np.ones(leaf.shape, leaf.dtype)
    fan = 1.0 if name == "embed" else 10.0 if name == "pos_embed" else leaf.shape[-2]
    values = rng.standard_normal(leaf.shape, np.float32) / np.float32(math.sqrt(fan))
    return values.astype(leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, param_shapes(cfg))


def batch_shapes(cfg: WholeConfig) -> dict:
  """{"tokens": inputs, "targets": next tokens}, each int32 [batch, seq]."""
  sds = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
  return {"tokens": sds, "targets": sds}


def init_batch(cfg: WholeConfig, seed: int = 0) -> dict:
  """Random tokens (numpy, int32): `targets` is `tokens` shifted by one."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)).astype(np.int32)
  return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def adam_init(params) -> dict:
  """{"count": int32 0, "mu": zeros, "nu": zeros}: moments float32, shaped as params."""
  zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
  return {"count": jnp.zeros((), jnp.int32), "mu": jax.tree.map(zeros, params),
          "nu": jax.tree.map(zeros, params)}


def param_specs(cfg: WholeConfig, row: str = "x", col: str = "y") -> dict:
  """PartitionSpecs of `param_shapes`: matrices [in:row, out:col] (the embedding
  [vocab:row, hidden:col]), vectors over hidden [col], the layer axis unsharded."""
  layers = {name: P(None, col) if len(s) == 1 else P(None, row, col)
            for name, s in _shapes(cfg).items()}
  specs = {"embed": P(row, col), "layers": layers, "final_norm": P(col),
           "unembed": P(row, col)}
  if cfg.kind == "gpt":
    specs["pos_embed"] = P(None, col)
  return specs


def opt_specs(cfg: WholeConfig, row: str = "x", col: str = "y") -> dict:
  """PartitionSpecs of `adam_init`: the moments as the params, the count replicated."""
  specs = param_specs(cfg, row, col)
  return {"count": P(), "mu": specs, "nu": specs}


def batch_specs(row: str = "x", col: str = "y") -> dict:
  """PartitionSpecs of `batch_shapes`: [batch:row, seq] (replicated over `col`)."""
  del col
  return {"tokens": P(row, None), "targets": P(row, None)}


# ----------------------------------------------------------------------------- model

def rmsnorm(x, scale):
  """RMSNorm over the last axis, computed in float32."""
  x32 = x.astype(jnp.float32)
  ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return (x32 * jax.lax.rsqrt(ms + 1e-5)).astype(x.dtype) * scale


def rope(x, theta: float):
  """Rotary position embedding over [b, s, ..., d] (rotate-half form), in float32."""
  s, d = x.shape[1], x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
  angles = np.arange(s, dtype=np.float32)[:, None] * inv[None, :]        # [s, d/2]
  shape = (1, s) + (1,) * (x.ndim - 3) + (d // 2,)
  cos, sin = np.cos(angles).reshape(shape), np.sin(angles).reshape(shape)
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :d // 2], x32[..., d // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def llama_block(cfg: WholeConfig, x, layer):
  """One Llama layer: RMSNorm, causal GQA attention (query head n reads KV head
  n // (heads / kv_heads)) with RoPE, residual; RMSNorm, SwiGLU MLP, residual."""
  b, s, h = x.shape
  n, kv, d = cfg.heads, cfg.kv, cfg.head_dim
  out = gpt.result_layout()
  mm = lambda a, w: jnp.matmul(a, w, out_sharding=out)
  hn = rmsnorm(x, layer["ln1"])
  q = rope(mm(hn, layer["wq"]).reshape(b, s, kv, n // kv, d), cfg.rope_theta)
  k = rope(mm(hn, layer["wk"]).reshape(b, s, kv, d), cfg.rope_theta)
  v = mm(hn, layer["wv"]).reshape(b, s, kv, d)
  scores = jnp.einsum("bskgd,btkd->bkgst", q, k) / np.sqrt(d).astype(np.float32)
  mask = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
  attn = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, h)
  x = x + mm(attn, layer["wo"])
  hn = rmsnorm(x, layer["ln2"])
  return x + mm(jax.nn.silu(mm(hn, layer["w_gate"])) * mm(hn, layer["w_up"]),
                layer["w_down"])


def _gpt_block(cfg: WholeConfig, x, layer):
  return gpt.block(gpt.ModelConfig(heads=cfg.heads), x, layer)


BLOCKS = {"gpt": _gpt_block, "llama": llama_block}
NORMS = {"gpt": gpt.layernorm, "llama": rmsnorm}


def _layout(mesh, spec):
  """Constrain a value to `spec` on `mesh`: with_sharding_constraint on Auto axes,
  reshard on Explicit ones (where the type carries the layout)."""
  if AxisType.Explicit in mesh.axis_types:
    return lambda v: jax.sharding.reshard(v, spec)
  return lambda v: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))


def _one_hot(ids, vocab: int, dtype, constrain):
  """ids [b, s] -> one-hot [b, s, vocab] laid out like the activations (vocab on the
  column axis), built locally from a comparison with an iota."""
  iota = jax.lax.broadcasted_iota(jnp.int32, ids.shape + (vocab,), ids.ndim)
  return constrain((ids[..., None] == iota).astype(dtype))


def loss_fn(cfg: WholeConfig, mesh, params, batch):
  """Mean softmax cross-entropy (float32) of the next tokens: one-hot embedding matmul,
  the scanned checkpointed blocks, final norm, logits matmul."""
  row, col = mesh.axis_names[-2:]
  act = _layout(mesh, P(row, None, col))
  dtype = jnp.dtype(cfg.dtype)
  out = gpt.result_layout()
  x = jnp.matmul(_one_hot(batch["tokens"], cfg.vocab, dtype, act), params["embed"],
                 out_sharding=out)
  if "pos_embed" in params:
    x = x + params["pos_embed"][None, :x.shape[1]]
  block = BLOCKS[cfg.kind]
  body = jax.checkpoint(lambda h, layer: (block(cfg, h, layer), None))
  x, _ = jax.lax.scan(body, x, params["layers"])
  x = NORMS[cfg.kind](x, params["final_norm"])
  logits = jnp.matmul(x, params["unembed"], out_sharding=out).astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.sum(logits * _one_hot(batch["targets"], cfg.vocab, jnp.float32, act), -1)
  return jnp.mean(logz - target)


def adam_update(cfg: WholeConfig, params, grads, state):
  """Adam (optax.adam's formula, eps outside the square root): float32 moments, the
  update computed in float32 and the params cast back to their dtype.

  Returns (new params, new state)."""
  count = state["count"] + 1
  t = count.astype(jnp.float32)
  g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  mu = jax.tree.map(lambda m, g: cfg.b1 * m + (1 - cfg.b1) * g, state["mu"], g32)
  nu = jax.tree.map(lambda v, g: cfg.b2 * v + (1 - cfg.b2) * g * g, state["nu"], g32)
  c1, c2 = 1 - cfg.b1 ** t, 1 - cfg.b2 ** t
  new = jax.tree.map(
      lambda p, m, v: (p.astype(jnp.float32) - cfg.learning_rate * (m / c1)
                       / (jnp.sqrt(v / c2) + cfg.eps)).astype(p.dtype), params, mu, nu)
  return new, {"count": count, "mu": mu, "nu": nu}


def train_step(cfg: WholeConfig, mesh, params, opt_state, batch):
  """One Adam step: (new params, new opt state, loss)."""
  loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, mesh, p, batch))(params)
  params, opt_state = adam_update(cfg, params, grads, opt_state)
  return params, opt_state, loss


# ----------------------------------------------------------------------------- steps

def shardings(cfg: WholeConfig, mesh):
  """(params, opt state, batch) NamedShardings on `mesh` (its last two axes)."""
  row, col = mesh.axis_names[-2:]
  named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)
  return (named(param_specs(cfg, row, col)), named(opt_specs(cfg, row, col)),
          named(batch_specs(row, col)))


def make_step(cfg: WholeConfig, mesh, donate: bool = True):
  """The jitted whole step: in/out shardings set, params and opt state donated."""
  ps, os_, bs = shardings(cfg, mesh)
  return jax.jit(lambda p, o, b: train_step(cfg, mesh, p, o, b),
                 in_shardings=(ps, os_, bs),
                 out_shardings=(ps, os_, NamedSharding(mesh, P())),
                 donate_argnums=(0, 1) if donate else ())


def _check_divides(cfg: WholeConfig, mesh) -> None:
  """Every sharded dim must split evenly over its mesh axis; say which does not."""
  rows, cols = (mesh.shape[a] for a in mesh.axis_names[-2:])
  h, kvd = cfg.hidden, cfg.kv * cfg.head_dim
  need = [("batch", cfg.batch, rows), ("vocab", cfg.vocab, rows), ("vocab", cfg.vocab, cols),
          ("hidden", h, rows), ("hidden", h, cols), ("ffn", cfg.ffn, rows),
          ("ffn", cfg.ffn, cols), ("heads", cfg.heads, cols), ("kv_heads", cfg.kv, cols),
          ("kv_heads * head_dim", kvd, cols)]
  bad = [f"{name} {size} over {n}" for name, size, n in need if size % n]
  if bad:
    raise ValueError(f"sizes do not divide the mesh {rows}x{cols}: " + ", ".join(bad)
                     + "; pick sizes that are multiples of the axis sizes")


def place(cfg: WholeConfig, mesh, seed: int = 0):
  """Concrete, sharded (params, opt state, batch) on a mesh of real devices, made on
  the host and placed (no init program to compile)."""
  _check_divides(cfg, mesh)
  ps, os_, bs = shardings(cfg, mesh)
  params = init_params(cfg, seed)
  zeros = lambda p: np.zeros(p.shape, np.float32)
  opt = {"count": np.zeros((), np.int32), "mu": jax.tree.map(zeros, params),
         "nu": jax.tree.map(zeros, params)}
  put = lambda tree, s: jax.tree.map(jax.device_put, tree, s)
  return put(params, ps), put(opt, os_), put(init_batch(cfg, seed + 1), bs)


def abstract_inputs(cfg: WholeConfig, mesh):
  """(params, opt state, batch) as `jax.ShapeDtypeStruct`s with NamedShardings on
  `mesh` (a Mesh or an AbstractMesh): nothing allocated."""
  _check_divides(cfg, mesh)
  params = param_shapes(cfg)
  opt = jax.eval_shape(adam_init, params)
  batch = batch_shapes(cfg)
  typed = lambda tree, s: jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, s)
  ps, os_, bs = shardings(cfg, mesh)
  return typed(params, ps), typed(opt, os_), typed(batch, bs)


def whole_step(model: str | WholeConfig, mesh, *, layers: int = 4, batch: int | None = None,
               seq: int | None = None, vocab: int | None = None, dtype: str | None = None):
  """A whole training step of `model` (a `PRESETS` name or a WholeConfig) on `mesh`
  (axes (..., row, col), e.g. ("x", "y"); a Mesh, a TPU topology's mesh from
  `aot.make_mesh`, or an AbstractMesh), with abstract inputs, as `aot.model_step`.

  layers: blocks scanned (>= 4 lets a schedule simulator see the steady state); it
    overrides a WholeConfig's own too.
  batch: sequences per step (default: one per device). seq, vocab, dtype: override the
    preset's.

  Returns (step, params, opt_state, batch): `step(params, opt_state, batch) -> (params,
  opt_state, loss)`, jitted with in/out shardings and params + opt state donated; the
  inputs `jax.ShapeDtypeStruct`s sharded on `mesh`.

  Example:
    >>> mesh = jax.sharding.AbstractMesh((64, 4), ("x", "y"))
    >>> step, params, opt, data = whole_step("gpt3", mesh, layers=4)
    >>> params["layers"]["wq"].shape, str(opt["mu"]["embed"].dtype), data["tokens"].shape
    ((4, 12288, 12288), 'float32', (256, 2048))
  """
  n = math.prod(mesh.axis_sizes)
  cfg = config(model, layers=layers, batch=batch or n, seq=seq, vocab=vocab, dtype=dtype)
  return (make_step(cfg, mesh),) + abstract_inputs(cfg, mesh)
