"""A GPT-style training step, sharded the 2D way: the model of the demo, `aot.model_step`,
the benches and the tests.

Embedding-free: each layer is layernorm -> attention (Q, K, V, out projections) ->
layernorm -> MLP (up, gelu, down), residual connections; layers are stacked with
`lax.scan` over `jax.checkpoint`-ed blocks; the loss is a mean squared error against a
target; the update is plain SGD.

2D layout (docs/design.md, "The three dataflows"): activations [batch:row, seq, hidden:col],
weights [in:row, out:col], so the forward matmuls are OS, backward-data LS, backward-weight
RS.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
  """The step's sizes (global: batch in sequences, hidden, ffn, heads), its element type
  and its SGD learning rate."""

  layers: int = 2
  batch: int = 8
  seq: int = 32
  hidden: int = 128
  heads: int = 8
  ffn: int = 512
  dtype: str = "float32"
  learning_rate: float = 1e-2


# One GPT-3 175B layer as the paper evaluates it: hidden 12288 (96 heads x 128), FF 4x,
# sequence 2048, one sequence per chip of a 256-chip pod.
GPT3_LAYER = ModelConfig(layers=1, batch=256, seq=2048, hidden=12288, heads=96, ffn=49152,
                         dtype="bfloat16")

WEIGHTS = ("wq", "wk", "wv", "wo", "w_up", "w_down")


def init_params(cfg: ModelConfig, key):
  """{weight name: [layers, in, out]} (scaled normal) and the two layernorm scales."""
  h, f, L = cfg.hidden, cfg.ffn, cfg.layers
  shapes = {"wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h),
            "w_up": (h, f), "w_down": (f, h)}
  keys = jax.random.split(key, len(shapes))
  dtype = jnp.dtype(cfg.dtype)
  params = {name: (jax.random.normal(k, (L,) + s, jnp.float32) / np.sqrt(s[0])).astype(dtype)
            for k, (name, s) in zip(keys, shapes.items())}
  params["ln1"] = jnp.ones((L, h), dtype)
  params["ln2"] = jnp.ones((L, h), dtype)
  return params


def init_batch(cfg: ModelConfig, key):
  """{"x": inputs, "y": targets}, each [batch, seq, hidden]."""
  k1, k2 = jax.random.split(key)
  shape = (cfg.batch, cfg.seq, cfg.hidden)
  dtype = jnp.dtype(cfg.dtype)
  return {"x": jax.random.normal(k1, shape, jnp.float32).astype(dtype),
          "y": jax.random.normal(k2, shape, jnp.float32).astype(dtype)}


def layernorm(x, scale):
  """Layernorm over the last axis, computed in float32, without a bias."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * scale


def result_layout():
  """The `out_sharding` of the model's x @ w: on an Explicit mesh the 2D result layout
  must be spelled out; on an Auto mesh (None) GSPMD (and meshslice's analysis) work it
  out."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.axis_names and AxisType.Explicit in mesh.axis_types:
    row, col = mesh.axis_names[-2:]
    return P(row, None, col)
  return None


def block(cfg: ModelConfig, x, layer):
  """One layer: causal attention then the MLP, each behind a layernorm and a residual.
  `layer`: one layer's slice of `init_params`."""
  b, s, h = x.shape
  n = cfg.heads
  out = result_layout()
  hn = layernorm(x, layer["ln1"])
  q = jnp.matmul(hn, layer["wq"], out_sharding=out).reshape(b, s, n, h // n)
  k = jnp.matmul(hn, layer["wk"], out_sharding=out).reshape(b, s, n, h // n)
  v = jnp.matmul(hn, layer["wv"], out_sharding=out).reshape(b, s, n, h // n)
  scores = jnp.einsum("bsnd,btnd->bnst", q, k) / np.sqrt(h // n).astype(np.float32)
  mask = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
  attn = jnp.einsum("bnst,btnd->bsnd", probs, v).reshape(b, s, h)
  x = x + jnp.matmul(attn, layer["wo"], out_sharding=out)
  hn = layernorm(x, layer["ln2"])
  up = jax.nn.gelu(jnp.matmul(hn, layer["w_up"], out_sharding=out))
  return x + jnp.matmul(up, layer["w_down"], out_sharding=out)


def loss_fn(cfg: ModelConfig, params, batch):
  """Mean squared error of the scanned, checkpointed layers against batch["y"]."""
  body = jax.checkpoint(lambda x, layer: (block(cfg, x, layer), None))
  out, _ = jax.lax.scan(body, batch["x"], params)
  err = (out - batch["y"]).astype(jnp.float32)
  return jnp.mean(jnp.square(err))


def train_step(cfg: ModelConfig, params, batch):
  """One SGD step: (new params, loss)."""
  loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, batch))(params)
  new = jax.tree.map(lambda p, g: (p - cfg.learning_rate * g).astype(p.dtype), params, grads)
  return new, loss


def param_specs(row="x", col="y"):
  """PartitionSpecs of `init_params`: weights [layer, in:row, out:col]."""
  specs = {name: P(None, row, col) for name in WEIGHTS}
  specs["ln1"] = P(None, col)
  specs["ln2"] = P(None, col)
  return specs


def batch_specs(row="x", col="y"):
  """PartitionSpecs of `init_batch`: [batch:row, seq, hidden:col]."""
  return {"x": P(row, None, col), "y": P(row, None, col)}


def make_mesh(shape=(2, 4), names=("x", "y"), explicit=False):
  """A mesh of this process's first prod(shape) devices, Auto (or Explicit) axes."""
  kind = AxisType.Explicit if explicit else AxisType.Auto
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape),
                       devices=jax.devices()[:n])


def make_step(cfg: ModelConfig, mesh, donate=True):
  """The user's existing jitted, 2D-sharded training step (Auto or Explicit mesh)."""
  row, col = mesh.axis_names[-2:]
  ps = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(row, col))
  bs = jax.tree.map(lambda s: NamedSharding(mesh, s), batch_specs(row, col))
  return jax.jit(lambda p, b: train_step(cfg, p, b), in_shardings=(ps, bs),
                 out_shardings=(ps, NamedSharding(mesh, P())),
                 donate_argnums=(0,) if donate else ())


def make_grad_step(cfg: ModelConfig, mesh):
  """The gradients of the loss, jitted with the same 2D shardings (for checking)."""
  row, col = mesh.axis_names[-2:]
  ps = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(row, col))
  bs = jax.tree.map(lambda s: NamedSharding(mesh, s), batch_specs(row, col))
  return jax.jit(lambda p, b: jax.grad(lambda q: loss_fn(cfg, q, b))(p),
                 in_shardings=(ps, bs), out_shardings=ps)


def place(cfg: ModelConfig, mesh, seed=0):
  """Concrete, sharded params and batch."""
  row, col = mesh.axis_names[-2:]
  kp, kb = jax.random.split(jax.random.key(seed))
  params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                        init_params(cfg, kp), param_specs(row, col))
  batch = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                       init_batch(cfg, kb), batch_specs(row, col))
  return params, batch


def abstract_inputs(cfg: ModelConfig, mesh):
  """Params and batch as `jax.ShapeDtypeStruct`s sharded on `mesh` (which may be a
  `jax.sharding.AbstractMesh`): enough to plan, nothing allocated."""
  row, col = mesh.axis_names[-2:]

  def typed(shapes, specs):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                          sharding=NamedSharding(mesh, s)),
                        shapes, specs)

  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  batch = jax.eval_shape(lambda: init_batch(cfg, jax.random.key(0)))
  return typed(params, param_specs(row, col)), typed(batch, batch_specs(row, col))
