"""A GPT-style training step, sharded the 2D way, for the demo, tests and benches.

The demo tells two parts of one story: (1) plan the step at GPT-3 size for a TPU v4 pod
on abstract inputs (nothing is allocated) and show what the cost model predicts there;
(2) run the same step, small, on an emulated 8-device CPU mesh with slicing forced on,
and check every number against the untransformed step.

Embedding-free: each layer is layernorm -> attention (Q, K, V, out projections) ->
layernorm -> MLP (up, gelu, down), residual connections; layers are stacked with
`lax.scan` over `jax.checkpoint`-ed blocks; the loss is a mean squared error against a
target; the update is plain SGD.

2D layout (docs/design.md, "The three dataflows"): activations [batch:row, seq, hidden:col], weights
[in:row, out:col], so the forward matmuls are OS, backward-data LS, backward-weight RS.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
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
  k1, k2 = jax.random.split(key)
  shape = (cfg.batch, cfg.seq, cfg.hidden)
  dtype = jnp.dtype(cfg.dtype)
  return {"x": jax.random.normal(k1, shape, jnp.float32).astype(dtype),
          "y": jax.random.normal(k2, shape, jnp.float32).astype(dtype)}


def _layernorm(x, scale):
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * scale


def _result_layout():
  """On an Explicit mesh the 2D result layout of x @ w must be spelled out; on an Auto
  mesh GSPMD (and meshslice's analysis) work it out."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.axis_names and AxisType.Explicit in mesh.axis_types:
    row, col = mesh.axis_names[-2:]
    return P(row, None, col)
  return None


def _block(cfg: ModelConfig, x, layer):
  b, s, h = x.shape
  n = cfg.heads
  out = _result_layout()
  hn = _layernorm(x, layer["ln1"])
  q = jnp.matmul(hn, layer["wq"], out_sharding=out).reshape(b, s, n, h // n)
  k = jnp.matmul(hn, layer["wk"], out_sharding=out).reshape(b, s, n, h // n)
  v = jnp.matmul(hn, layer["wv"], out_sharding=out).reshape(b, s, n, h // n)
  scores = jnp.einsum("bsnd,btnd->bnst", q, k) / np.sqrt(h // n).astype(np.float32)
  mask = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
  attn = jnp.einsum("bnst,btnd->bsnd", probs, v).reshape(b, s, h)
  x = x + jnp.matmul(attn, layer["wo"], out_sharding=out)
  hn = _layernorm(x, layer["ln2"])
  up = jax.nn.gelu(jnp.matmul(hn, layer["w_up"], out_sharding=out))
  return x + jnp.matmul(up, layer["w_down"], out_sharding=out)


def loss_fn(cfg: ModelConfig, params, batch):
  block = jax.checkpoint(lambda x, layer: (_block(cfg, x, layer), None))
  out, _ = jax.lax.scan(block, batch["x"], params)
  err = (out - batch["y"]).astype(jnp.float32)
  return jnp.mean(jnp.square(err))


def train_step(cfg: ModelConfig, params, batch):
  loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, batch))(params)
  new = jax.tree.map(lambda p, g: (p - cfg.learning_rate * g).astype(p.dtype), params, grads)
  return new, loss


def param_specs(row="x", col="y"):
  specs = {name: P(None, row, col) for name in WEIGHTS}
  specs["ln1"] = P(None, col)
  specs["ln2"] = P(None, col)
  return specs


def batch_specs(row="x", col="y"):
  return {"x": P(row, None, col), "y": P(row, None, col)}


def make_mesh(shape=(2, 4), names=("x", "y"), explicit=False):
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


def plan_at_scale(cfg: ModelConfig = GPT3_LAYER, mesh_shape=(64, 4), echo=print, **options):
  """Plan `cfg`'s training step for a pod of prod(mesh_shape) chips from this machine
  and print the cost model's verdict. Returns the `Report`."""
  from .transform import explain
  mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), ("x", "y"),
                                   axis_types=(AxisType.Auto,) * 2)
  report = explain(make_step(cfg, mesh), **options)(*abstract_inputs(cfg, mesh))
  plans = {}
  for s in report.rewritten:
    key = f"{s.algorithm} {s.dataflow} S={s.ksplit}"
    plans[key] = plans.get(key, 0) + 1
  chips = int(np.prod(mesh_shape))
  echo(f"part 1 -- plan for the real target: one GPT-3 layer (hidden {cfg.hidden}, ffn "
       f"{cfg.ffn}, {cfg.batch} x {cfg.seq} tokens, {cfg.dtype}), fwd + bwd, on {chips} "
       f"chips as a {mesh_shape[0]}x{mesh_shape[1]} mesh, profile {report.profile}")
  echo(f"  {len(report.rewritten)} of {len(report.sites)} matmuls planned: "
       + ", ".join(f"{n} x {k}" for k, n in sorted(plans.items()))
       + f"; {len(report.left_alone)} left alone (attention einsums: nothing to "
         "communicate)")
  gain = report.baseline_seconds / report.predicted_seconds if report.predicted_seconds else 1
  echo(f"  predicted time of those matmuls: {report.predicted_seconds * 1e3:.1f} ms vs "
       f"{report.baseline_seconds * 1e3:.1f} ms with the plain collective algorithm "
       f"({gain:.2f}x, cost model only; `python -m meshslice aot` shows what the TPU "
       "compiler makes of it)")
  return report


def _time(fn, args_fn, repeats):
  out = fn(*args_fn())
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    args = args_fn()
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def run_demo(mesh_shape=(2, 4), dtype="float32", explicit=False, repeats=5, echo=print,
             target=(64, 4), **options):
  """Plan at scale (`target` mesh, None to skip), then transform the small demo step,
  print the report, check it, time it. Returns the max relative error.

  `options` go to `meshslice.transform` (e.g. ksplit=4, profile="cpu")."""
  from .transform import transform  # imported late: this module is also used standalone
  if target is not None:
    plan_at_scale(GPT3_LAYER, target, echo=echo,
                  **{k: v for k, v in options.items() if k == "profile"})
    echo("")
  cfg = ModelConfig(dtype=dtype)
  mesh = make_mesh(mesh_shape, explicit=explicit)
  step = make_step(cfg, mesh)
  fast = transform(step, **options)
  with jax.set_mesh(mesh):
    params, batch = place(cfg, mesh)
    echo(f"part 2 -- check the numbers on this machine: {cfg.layers}-layer GPT-style step, "
         f"hidden {cfg.hidden}, ffn {cfg.ffn}, "
         f"batch {cfg.batch}x{cfg.seq}, {dtype}, mesh {dict(mesh.shape)} "
         f"({'Explicit' if explicit else 'Auto'} axes), options {options or 'default'}")
    if options.get("ksplit", 1) > 1:
      echo(f"  slicing is forced (ksplit={options['ksplit']}) so that the sliced pipeline "
           "runs here; at these sizes the cost model would not slice, and the 'pred us' "
           "column says so")
    echo(str(fast.explain(params, batch)))
    copy = lambda: jax.tree.map(jnp.copy, params)
    ref_params, ref_loss = step(copy(), batch)
    new_params, new_loss = fast(copy(), batch)
    grad_step = make_grad_step(cfg, mesh)
    ref_grads = grad_step(params, batch)
    new_grads = transform(grad_step, **options)(params, batch)
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
                             / (np.max(np.abs(np.asarray(a, np.float32))) + 1e-30))
    loss_err = abs(float(ref_loss) - float(new_loss)) / abs(float(ref_loss))
    grad_err = max(rel(ref_grads[k], new_grads[k]) for k in ref_grads)
    param_err = max(rel(ref_params[k], new_params[k]) for k in ref_params)
    echo(f"loss: original {float(ref_loss):.6f}  transformed {float(new_loss):.6f}  "
         f"(rel diff {loss_err:.2e})")
    echo(f"gradients: max difference {grad_err:.2e} of each gradient's largest entry")
    echo(f"updated parameters: max difference {param_err:.2e} of each tensor's largest entry")
    worst = max(loss_err, grad_err, param_err)
    t_ref = _time(step, lambda: (copy(), batch), repeats)
    t_new = _time(fast, lambda: (copy(), batch), repeats)
    echo(f"step time (median of {repeats}): original {t_ref * 1e3:.1f} ms, transformed "
         f"{t_new * 1e3:.1f} ms, ratio {t_new / t_ref:.2f}x (CPU: no real interconnect, "
         "so no overlap gain is possible here)")
  return worst
