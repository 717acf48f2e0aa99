"""meshslice.check blames a correct rewrite when plain GSPMD is wrong and the unsharded
reference cannot run (found by examples/maxtext_style_step.py, --data 2).

Plain jax.jit on a (data=2, x=2, y=2) Auto mesh computes the backward-data matmul of an
unembedding (dlogits[b:(data,x), s, v:y] . W[e:x, v:y]^T -> [b:(data,x), s, e:y])
wrongly on CPU (jax 0.10.2): gradients upstream are off by ~1e-3 relative vs a 1-device
run, while meshslice's rewrite of that site (collective LS or meshslice LS) agrees with
the 1-device run to 1e-7. The step also has an embedding lookup (jnp.take), whose
gradient is a scatter-add, for which check's unsharded reference has no rule ("no
unsharded evaluation rule for scatter-add"); check then judges against plain jit and
reports the correct rewrite as "responsible".

Expected: check's reference handles scatter-add (or falls back to a 1-device jit of the
same function), so it says plain jit disagrees with the reference and the transformed
step is OK. Run: python fuzz_findings/03_check_blames_site_when_plain_gspmd_is_wrong.py
"""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import meshslice


def build(mesh):
  s = lambda spec: NamedSharding(mesh, spec)
  act = s(P(("data", "x"), None, "y"))

  def loss(params, tokens):
    x = jax.lax.with_sharding_constraint(jnp.take(params["emb"], tokens, axis=0), act)
    h = jax.lax.with_sharding_constraint(jnp.tanh(jnp.einsum("bse,em->bsm", x, params["w"])), act)
    logits = jax.lax.with_sharding_constraint(jnp.einsum("bsm,mv->bsv", h, params["unemb"]), act)
    return jnp.mean(jnp.square(logits))

  ps = {"emb": s(P(None, "y")), "w": s(P("x", "y")), "unemb": s(P("x", "y"))}
  step = jax.jit(jax.grad(loss), in_shardings=(ps, s(P(("data", "x"), None))), out_shardings=ps)
  k = jax.random.split(jax.random.key(0), 4)
  params = {"emb": jax.random.normal(k[0], (64, 64)), "w": jax.random.normal(k[1], (64, 128)) / 8,
            "unemb": jax.random.normal(k[2], (128, 64)) / 11}
  params = jax.tree.map(jax.device_put, params, ps)
  tokens = jax.device_put(jax.random.randint(k[3], (8, 8), 0, 64), s(P(("data", "x"), None)))
  return step, params, tokens


if __name__ == "__main__":
  auto = (AxisType.Auto,) * 3
  mesh8 = jax.make_mesh((2, 2, 2), ("data", "x", "y"), axis_types=auto, devices=jax.devices()[:8])
  mesh1 = jax.make_mesh((1, 1, 1), ("data", "x", "y"), axis_types=auto, devices=jax.devices()[:1])
  step, params, tokens = build(mesh8)
  step1, params1, tokens1 = build(mesh1)
  truth = step1(params1, tokens1)
  plain = step(params, tokens)
  fast = meshslice.transform(step)(params, tokens)
  rel = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
  for name in truth:
    print(f"{name}: plain vs 1-device {rel(plain[name], truth[name]):.1e}, "
          f"transformed vs 1-device {rel(fast[name], truth[name]):.1e}")
  print(meshslice.check(step)(params, tokens))
