"""Training steps shaped the way Keras 3 (`JAXTrainer`) and penzai (`StatefulTrainer`)
build them, in plain JAX (issue 20, deliverable 4): which matmuls become 2D sites, and
that the transformed step's loss and updated parameters match plain jit and an unsharded
float64 numpy run. Also the layout rules these steps need (split/stack of rotary
embeddings, iota, penzai's batch-only `x * scale` dot_general), each against what XLA's
own propagation does, and the real frameworks where they are importable
(`pytest.importorskip`; docs/frameworks.md says how to install them)."""
import collections
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice

from helpers import assert_trees_close, mesh

V, D, N, H, F = 64, 32, 4, 8, 64      # vocab, embedding, heads, head dim, mlp
B, S = 4, 8
LR = 0.1


# ------------------------------------------------------------- the model, in float64 numpy

def _rotate(q, xp):
  """Rotary-style mixing of the head dim's halves (split + stack, as keras-hub does)."""
  x1, x2 = xp.split(q, 2, axis=-1)
  return xp.stack([-x2, x1], axis=-1).reshape(q.shape)


def _rotate_transposed(g):
  pair = g.reshape(g.shape[:-1] + (H // 2, 2))
  return np.concatenate([pair[..., 1], -pair[..., 0]], axis=-1)


def _numpy_loss_and_grads(p, tokens, labels):
  """Loss and gradients of the model below in float64 (canonical kernel orientation:
  emb [V,D], scale [D], wq [D,N,H], wo [N,H,D], wg [D,F], wl [F,D]), backward by hand."""
  emb, scale, wq, wo, wg, wl = (p[k] for k in ("emb", "scale", "wq", "wo", "wg", "wl"))
  h0 = emb[tokens]
  hs = h0 * scale
  q = np.einsum("btd,dnh->btnh", hs, wq)
  a = np.tanh(_rotate(q, np))
  o = np.einsum("btnh,nhd->btd", a, wo)
  h2 = hs + o
  g = np.tanh(h2 @ wg)
  z = h2 + g @ wl
  logits = z @ emb.T
  shifted = logits - logits.max(-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  onehot = np.eye(V)[labels]
  loss = -np.mean(np.sum(onehot * logp, -1))
  dlogits = (np.exp(logp) - onehot) / (B * S)
  demb = np.einsum("btv,btd->vd", dlogits, z)
  dz = dlogits @ emb
  dwl = np.einsum("btf,btd->fd", g, dz)
  du = (dz @ wl.T) * (1 - g ** 2)
  dwg = np.einsum("btd,btf->df", h2, du)
  dh2 = dz + du @ wg.T
  dwo = np.einsum("btnh,btd->nhd", a, dh2)
  dq = _rotate_transposed(np.einsum("btd,nhd->btnh", dh2, wo) * (1 - a ** 2))
  dwq = np.einsum("btd,btnh->dnh", hs, dq)
  dhs = dh2 + np.einsum("btnh,dnh->btd", dq, wq)
  dscale = np.sum(dhs * h0, axis=(0, 1))
  np.add.at(demb, tokens, dhs * scale)
  return loss, {"emb": demb, "scale": dscale, "wq": dwq, "wo": dwo, "wg": dwg, "wl": dwl}


def _canonical_params(seed=0):
  shapes = {"emb": (V, D), "scale": (D,), "wq": (D, N, H), "wo": (N, H, D), "wg": (D, F),
            "wl": (F, D)}
  rng = np.random.default_rng(seed)
  out = {k: rng.normal(size=s) / np.sqrt(s[0]) for k, s in shapes.items()}
  out["scale"] = 1.0 + 0.1 * rng.normal(size=(D,))
  return out


def _data(seed=1):
  rng = np.random.default_rng(seed)
  return (rng.integers(0, V, (B, S)).astype(np.int32),
          rng.integers(0, V, (B, S)).astype(np.int32))


def _forward_loss(emb, wo, wg, wl, tokens, labels, *, lookup, scale, query):
  """The same model in JAX; each framework writes the embedding lookup, the norm scale
  and the query projection its own way (`lookup(emb, tokens)`, `scale(h0)`, `query(hs)`)."""
  hs = scale(lookup(emb, tokens))
  a = jnp.tanh(_rotate(query(hs), jnp))
  h2 = hs + jnp.einsum("btnh,nhd->btd", a, wo)
  z = h2 + jnp.einsum("btf,fd->btd", jnp.tanh(jnp.einsum("btd,df->btf", h2, wg)), wl)
  logits = jnp.einsum("btd,vd->btv", z, emb)          # tied, as keras-hub's Gemma
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _forward_by_shapes(report):
  return {(s.lhs_shape, s.rhs_shape): _plan_of(s) for s in report.sites
          if s.direction.startswith("for")}


def _plan_of(site):
  return (site.dataflow, tuple(site.mesh_axes)) if site.rewritten else site.reason


# ------------------------------------------------------------------- Keras 3 style

# kernel layouts keyed by variable path, like keras-hub's GemmaBackbone.get_layout_map
_KERAS_LAYOUT_MAP = {
    "token_embedding/embeddings": ("model", "batch"),
    "pre_attention_norm/scale": (None,),
    "attention/query/kernel": ("model", "batch", None),
    "attention/attention_output/kernel": ("model", None, "batch"),
    "ffw_gating/kernel": ("batch", "model"),
    "ffw_linear/kernel": ("model", "batch"),
}
_KERAS_ORDER = tuple(_KERAS_LAYOUT_MAP)


def _keras_style(output_layout=None):
  """A step shaped like keras JAXTrainer.train_step: `state` is (trainable,
  non_trainable, optimizer, metrics) variable lists, `data` is (x, y, sample_weight);
  jitted as `make_train_function` does (donate the state, out_shardings from the
  variables). Only the kernels are laid out (by the layout map); `output_layout` plays
  a LayoutMap entry "…/pre_attention_norm/output" (a constraint on that layer's output)."""
  msh = mesh((2, 4), ("batch", "model"))

  def hs_fn(h0, scale):
    hs = h0 * scale
    if output_layout is not None:
      hs = jax.lax.with_sharding_constraint(hs, NamedSharding(msh, P(*output_layout)))
    return hs

  def compute_loss(trainable, x, y):
    emb, scale, wq, wo, wg, wl = trainable
    return _forward_loss(emb, wo, wg, wl, x, y,
                         lookup=lambda t, i: jnp.take(t, i, axis=0),    # ops.take: a gather
                         scale=lambda h0: hs_fn(h0, scale),
                         query=lambda hs: jnp.einsum("btd,ndh->btnh", hs, wq))

  def train_step(state, data):
    trainable, non_trainable, optimizer_vars, metrics = state
    x, y, _ = data
    loss, grads = jax.value_and_grad(compute_loss)(trainable, x, y)
    iterations, momenta = optimizer_vars[0], optimizer_vars[1:]
    # keras SGD with momentum, as `optimizer.stateless_apply` runs it
    momenta = [0.9 * m - LR * g for m, g in zip(momenta, grads)]
    trainable = [p + m for p, m in zip(trainable, momenta)]
    seed = non_trainable[0] + jnp.array([0, 1], jnp.uint32)
    total, count = metrics
    logs = {"loss": (total + loss) / (count + 1)}
    return logs, (trainable, [seed], [iterations + 1, *momenta], [total + loss, count + 1])

  layouts = [NamedSharding(msh, P(*_KERAS_LAYOUT_MAP[k])) for k in _KERAS_ORDER]
  replicated = NamedSharding(msh, P())
  state_shardings = (layouts, [replicated], [replicated, *layouts], [replicated] * 2)

  def make_state():
    """Fresh arrays every call: the step donates its state."""
    p = _canonical_params()
    values = [p["emb"], p["scale"], p["wq"].transpose(1, 0, 2), p["wo"], p["wg"], p["wl"]]
    trainable = [jax.device_put(np.asarray(v, np.float32), s) for v, s in zip(values, layouts)]
    momenta = [jax.device_put(np.zeros(v.shape, np.float32), s)
               for v, s in zip(values, layouts)]
    return (trainable, [jax.device_put(np.zeros(2, np.uint32), replicated)],
            [jax.device_put(np.int32(0), replicated), *momenta],
            [jax.device_put(np.float32(0), replicated) for _ in range(2)])

  tokens, labels = _data()
  batch = NamedSharding(msh, P("batch", None))       # keras's data layout: batch dim split
  data = (jax.device_put(tokens, batch), jax.device_put(labels, batch), None)
  step = jax.jit(train_step, donate_argnums=0, out_shardings=(None, state_shardings))
  return step, make_state, data


def _keras_expected_updates():
  p = _canonical_params()
  loss, grads = _numpy_loss_and_grads(p, *_data())
  order = ("emb", "scale", "wq", "wo", "wg", "wl")
  new = [p[k] - LR * grads[k] for k in order]
  new[2] = new[2].transpose(1, 0, 2)
  return loss, new


@pytest.mark.parametrize("output_layout", [None, ("batch", None, "model")],
                         ids=["kernels-only", "norm-output-layout"])
def test_keras_style_step_sites_and_values(output_layout):
  step, make_state, data = _keras_style(output_layout)
  report = meshslice.explain(step)(make_state(), data)
  assert not [s for s in report.sites if s.reason.startswith("operand sharding unknown")]
  plans = _forward_by_shapes(report)
  forward = {"query": plans[((B, S, D), (N, D, H))],
             "attention_output": plans[((B, S, N, H), (N, H, D))],
             "gating": plans[((B, S, D), (D, F))], "linear": plans[((B, S, F), (F, D))]}
  # kernels only: the activations are split over `batch` alone (from the data), so the
  # projections whose kernel splits the embedding dim over `batch` gather that kernel
  # (OS with no column axis); the ones contracting over `model` are full 2D LS
  both = ("ls", ("batch", "model"))
  if output_layout is None:
    assert forward == {"query": ("os", ("batch", None)), "attention_output": both,
                       "gating": ("os", ("batch", None)), "linear": both}
  else:   # the embedding dim of the norm's output over `model`: 2D OS for query, gating
    assert forward == {"query": ("os", ("batch", "model")), "attention_output": both,
                       "gating": ("os", ("batch", "model")), "linear": both}

  fast = meshslice.transform(step, ksplit=2)
  logs, state = fast(make_state(), data)
  ref_logs, ref_state = step(make_state(), data)
  assert_trees_close(state, ref_state)
  np.testing.assert_allclose(logs["loss"], ref_logs["loss"], rtol=1e-5)
  loss, new = _keras_expected_updates()
  np.testing.assert_allclose(float(logs["loss"]), loss, rtol=1e-5)
  for got, want in zip(state[0], new):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4,
                               atol=1e-5 * np.abs(want).max())
  assert int(state[2][0]) == 1 and list(np.asarray(state[1][0])) == [0, 1]


# ------------------------------------------------------------------- penzai style

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _ParameterValue:
  """Like penzai's pz.ParameterValue: a labelled parameter, its named axes static."""
  value: jax.Array
  label: str = dataclasses.field(metadata={"static": True})
  names: tuple = dataclasses.field(metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _TrainerState:
  step: jax.Array
  opt_state: object


_PENZAI_NAMES = {"embedder": ("vocabulary", "embedding"), "scale": ("embedding",),
                 "query": ("embedding", "heads", "projection"),
                 "out": ("heads", "projection", "embedding"),
                 "gating": ("embedding", "neurons"), "out_linear": ("neurons", "embedding")}
_PARAM_RULES = {"embedding": "x", "heads": "y", "neurons": "y", "vocabulary": "y"}


def _name_to_name_sharding(msh, names, rules):
  """penzai's sharding_util.name_to_name_sharding for one array: axis names -> mesh axes."""
  return NamedSharding(msh, P(*(rules.get(n) for n in names)))


def _named_scale(h0, scale):
  """The norm scale as penzai's named-axis code lowers it: a dot_general whose only dims
  are the batch dim `embedding` (the result [d, b, s]), then transposed back."""
  out = jax.lax.dot_general(h0, scale, (((), ()), ((2,), (0,))))
  return jnp.transpose(out, (1, 2, 0))


def _penzai_model_loss(*, model, state, rng, tokens, labels):
  """A penzai-style loss_fn: keyword-only, returns (loss, new_state, aux)."""
  p = {v.label: v.value for v in model}
  loss = _forward_loss(
      p["embedder"], p["out"], p["gating"], p["out_linear"], tokens, labels,
      lookup=jax.jit(lambda table, ids: table[ids]),   # penzai's named gather: a nested jit
      scale=lambda h0: _named_scale(h0, p["scale"]),
      query=lambda hs: jnp.einsum("bsd,dnh->bsnh", hs, p["query"]))
  del rng
  return loss, state, {"loss": loss}


def _penzai_step(root_rng, state, stateless_model, trainable_params, frozen_params,
                 state_vars, loss_fn, optimizer_def, kwargs):
  """Shaped like penzai.toolshed.basic_training._stateful_trainer_step."""
  step_rng = jax.random.fold_in(root_rng, state.step)

  def compute_loss(trainable_params):
    model = tuple(trainable_params) + tuple(frozen_params)
    loss, _, aux = loss_fn(model=model, state=None, rng=step_rng, **kwargs)
    return loss, aux

  grads, aux = jax.grad(compute_loss, has_aux=True)(trainable_params)
  updates, opt_state = optimizer_def.update(grads, state.opt_state, trainable_params)
  new_params = optax.apply_updates(trainable_params, updates)
  return aux, new_params, state_vars, _TrainerState(step=state.step + 1,
                                                    opt_state=opt_state)


def _penzai_style():
  msh = mesh((2, 4))
  p = _canonical_params()
  optimizer = optax.sgd(LR)
  params = tuple(
      _ParameterValue(jax.device_put(np.asarray(p[k], np.float32),
                                     _name_to_name_sharding(msh, names, _PARAM_RULES)),
                      label=label, names=names)
      for (label, names), k in zip(_PENZAI_NAMES.items(),
                                   ("emb", "scale", "wq", "wo", "wg", "wl")))
  tokens, labels = _data()
  batch = _name_to_name_sharding(msh, ("batch", "seq"), {"batch": "x"})
  kwargs = dict(
      root_rng=jax.random.key(1),
      state=_TrainerState(step=jnp.int32(0), opt_state=optimizer.init(params)),
      stateless_model=None, trainable_params=params, frozen_params=(), state_vars=(),
      loss_fn=_penzai_model_loss, optimizer_def=optimizer,
      kwargs={"tokens": jax.device_put(tokens, batch), "labels": jax.device_put(labels, batch)})
  step = jax.jit(_penzai_step, static_argnames=["loss_fn", "optimizer_def"])
  return step, kwargs


def test_penzai_style_step_sites_and_values():
  step, kwargs = _penzai_style()
  report = meshslice.explain(step)(**kwargs)
  assert not [s for s in report.sites if s.reason.startswith("operand sharding unknown")]
  fwd = [s for s in report.sites if s.direction.startswith("for")]
  # the norm scale: a batch-only dot_general whose batch dim is split on the scale only;
  # left alone, but its result keeps the activations' batch split (the larger operand),
  # as XLA's propagation does, so the query projection after it is a 2D-kernel OS site
  scale_sites = [s for s in fwd if s.rhs_shape == (D,)]
  assert scale_sites and all(s.reason.startswith("batch dims sharded differently")
                             for s in scale_sites)
  by_shape = _forward_by_shapes(report)
  assert by_shape[((B, S, D), (D, N, H))] == ("os", ("x", None))        # query
  assert by_shape[((B, S, N, H), (N, H, D))] == ("ls", ("x", "y"))      # out
  assert by_shape[((B, S, D), (D, F))] == ("os", ("x", None))           # gating
  assert by_shape[((B, S, F), (F, D))] == ("ls", ("x", "y"))            # out_linear

  fast = meshslice.transform(step, ksplit=2)
  aux, new_params, _, new_state = fast(**kwargs)
  ref_aux, ref_params, _, ref_state = step(**kwargs)
  assert_trees_close(new_params, ref_params)
  np.testing.assert_allclose(aux["loss"], ref_aux["loss"], rtol=1e-5)
  assert int(new_state.step) == 1
  loss, grads = _numpy_loss_and_grads(_canonical_params(), *_data())
  np.testing.assert_allclose(float(aux["loss"]), loss, rtol=1e-5)
  canon = _canonical_params()
  for got, k in zip(new_params, ("emb", "scale", "wq", "wo", "wg", "wl")):
    want = canon[k] - LR * grads[k]
    np.testing.assert_allclose(np.asarray(got.value), want, rtol=1e-4,
                               atol=1e-5 * np.abs(want).max())


# ------------------------------------------------------ the layout rules these steps need

def _xla_specs(fn, *args):
  """The layouts XLA's own propagation gives `fn`'s outputs (no out_shardings: its
  choice), as the report writes specs."""
  from meshslice import specs as S
  compiled = jax.jit(fn).lower(*args).compile()
  sizes = dict(args[0].sharding.mesh.shape)
  return [S.describe(S.from_partition_spec(sh.spec, len(o.shape), sizes))
          for sh, o in zip(compiled.output_shardings, jax.eval_shape(fn, *args))]


def _scale_inputs():
  msh = mesh((2, 4))
  s = lambda *spec: NamedSharding(msh, P(*spec))
  rng = np.random.default_rng(2)
  x = jax.device_put(rng.normal(size=(B, S, D)).astype(np.float32), s("x", None, None))
  scale = jax.device_put((1 + 0.1 * rng.normal(size=(D,))).astype(np.float32), s("x"))
  w = jax.device_put((rng.normal(size=(D, F)) / 8).astype(np.float32), s("x", "y"))
  return x, scale, w


def test_batch_only_dot_general_with_conflicting_batch_split_keeps_the_larger_layout():
  """penzai's `x * scale` over the named axis `embedding` is a dot_general with only batch
  dims; the scale is split over x on that dim, the activations over x on their batch dim.
  XLA keeps the activations' layout (the larger operand); so does the analysis, and the
  matmul after it is an OS site instead of 'operand sharding unknown'."""
  x, scale, w = _scale_inputs()

  def forward(x, scale, w):
    hs = _named_scale(x, scale)
    return hs, hs @ w

  report = meshslice.explain(jax.jit(forward))(x, scale, w)
  first, matmul = report.sites
  assert first.reason.startswith("batch dims sharded differently")
  hs_spec, y_spec = _xla_specs(forward, x, scale, w)
  assert (matmul.lhs_spec, matmul.out_spec) == (hs_spec, y_spec) == (
      "P('x', None, None)", "P('x', None, 'y')")
  assert (matmul.dataflow, matmul.mesh_axes) == ("os", ("x", None))

  def loss(x, scale, w):
    return jnp.sum(jnp.tanh(forward(x, scale, w)[1]) ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))
  (value, grads), (ref_value, ref_grads) = meshslice.transform(step, ksplit=2)(x, scale, w), \
      step(x, scale, w)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(grads, ref_grads)
  xs, ss, ws = (np.asarray(a, np.float64) for a in (x, scale, w))
  y = np.tanh((xs * ss) @ ws)
  np.testing.assert_allclose(value, np.sum(y ** 2), rtol=1e-4)
  dy = 2 * y * (1 - y ** 2)
  np.testing.assert_allclose(grads[1], np.einsum("bsd,bsf->df", xs * ss, dy), rtol=1e-4,
                             atol=1e-4)
  np.testing.assert_allclose(grads[0], np.einsum("bsf,df,bsd->d", dy, ws, xs), rtol=1e-4,
                             atol=1e-4)


def _rope(t, positions):
  """Rotary embedding as keras-hub writes it: angles from iota (an outer product
  dot_general), the head dim split in halves, rotated, stacked and interleaved back."""
  half = t.shape[-1] // 2
  freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = jnp.einsum("s,j->sj", positions, freq)[None, :, None, :]
  t1, t2 = jnp.split(t, 2, axis=-1)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  return jnp.stack([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1).reshape(t.shape)


def test_attention_scores_after_rotary_embeddings_have_layouts():
  """Both operands of q·k come out of split/stack/reshape (and iota-made angles): with
  layout rules for them, the scores matmul is a local batch-dim site (as XLA lays it
  out), not 'operand sharding unknown'; values match plain jit and float64 numpy."""
  msh = mesh((2, 4))
  s = lambda *spec: NamedSharding(msh, P(*spec))
  rng = np.random.default_rng(3)
  x = jax.device_put(rng.normal(size=(B, S, D)).astype(np.float32), s("x", None, None))
  wq, wk = (jax.device_put((rng.normal(size=(D, N, H)) / 6).astype(np.float32),
                           s(None, "y", None)) for _ in range(2))

  def scores(x, wq, wk):
    positions = jnp.arange(S, dtype=jnp.float32)
    q = _rope(jnp.einsum("bsd,dnh->bsnh", x, wq), positions)
    k = _rope(jnp.einsum("bsd,dnh->bsnh", x, wk), positions)
    return q, jnp.einsum("btnh,bsnh->bnts", q, k)

  def loss(x, wq, wk):
    return jnp.sum(jax.nn.softmax(scores(x, wq, wk)[1], axis=-1) ** 2)

  report = meshslice.explain(jax.jit(scores))(x, wq, wk)
  assert not [t for t in report.sites if t.reason.startswith("operand sharding unknown")]
  site = [t for t in report.sites if t.lhs_shape == (B, S, N, H)][0]
  assert site.reason.startswith("no mesh axis shards a non-batch dim")
  assert [site.lhs_spec, site.out_spec] == _xla_specs(scores, x, wq, wk)

  step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))
  (value, grads), (ref_value, ref_grads) = meshslice.transform(step)(x, wq, wk), \
      step(x, wq, wk)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(grads, ref_grads)
  xs, qs, ks = (np.asarray(a, np.float64) for a in (x, wq, wk))
  freq = 1.0 / (10000.0 ** (np.arange(H // 2) / (H // 2)))
  ang = np.arange(S)[:, None] * freq[None, :]
  c, sn = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]

  def rope(t):
    t1, t2 = np.split(t, 2, axis=-1)
    return np.stack([t1 * c - t2 * sn, t2 * c + t1 * sn], axis=-1).reshape(t.shape)

  sc = np.einsum("btnh,bsnh->bnts", rope(np.einsum("bsd,dnh->bsnh", xs, qs)),
                 rope(np.einsum("bsd,dnh->bsnh", xs, ks)))
  p = np.exp(sc - sc.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(value, np.sum(p ** 2), rtol=1e-4)


# ------------------------------------------- the real frameworks, where they are installed

def _example(name):
  import importlib.util
  path = os.path.join(os.path.dirname(__file__), "..", "examples", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_real_keras_hub_gemma_model_parallel():
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  pytest.importorskip("keras_hub")
  if keras.backend.backend() != "jax":
    pytest.skip("keras was imported with another backend")
  step, state, data = _example("keras_model_parallel").build(False, layers=1)
  report = meshslice.explain(step)(state, data)
  assert not [s for s in report.sites if s.reason.startswith("operand sharding unknown")]
  forward = {s.module.rsplit("/", 2)[-2]: _plan_of(s) for s in report.sites
             if s.direction.startswith("for") and s.rewritten and "decoder_block" in s.module}
  assert forward["query"] == forward["ffw_gating"] == ("os", ("batch", None))
  assert forward["attention_output"] == forward["ffw_linear"] == ("ls", ("batch", "model"))
  # the source is the keras-hub line calling each projection, not Keras's einsum wrapper
  source = {s.module.rsplit("/", 2)[-2]: s.source for s in report.sites
            if s.direction.startswith("for") and "decoder_block" in s.module}
  assert source["query"].startswith("keras_hub/src/models/gemma/gemma_attention.py:")
  assert len({source[k] for k in ("query", "key", "value", "attention_output")}) == 4
  meshslice.check(step, ksplit=2)(state, data).assert_ok()


def test_real_penzai_llamalike_stateful_trainer():
  pytest.importorskip("penzai")
  example = _example("penzai_stateful")
  trainer, kwargs = example.build(False, layers=1)
  step = trainer.step_fn
  report = meshslice.explain(step)(**kwargs)
  assert not [s for s in report.sites if s.reason.startswith("operand sharding unknown")]
  plans = collections.Counter(_plan_of(s) for s in report.sites if s.rewritten)
  assert plans[("os", ("x", None))] and plans[("ls", ("x", "y"))]
  # named by penzai's parameter labels, not its Sequentials' index scopes: a module
  # pattern pins one projection (forward, backward-data, weight gradient)
  modules = {s.module for s in report.sites}
  assert {"transformer/block_0/attention/query", "transformer/block_0/mlp/out_linear",
          "transformer/lm_head"} <= modules
  pinned = meshslice.explain(step, overrides={"*/attention/query": {"ksplit": 2}})(**kwargs)
  assert {s.module for s in pinned.sites if s.ksplit == 2} == {
      "transformer/block_0/attention/query"}
  meshslice.check(step, ksplit=2)(**kwargs).assert_ok()
  trainer = dataclasses.replace(trainer, step_fn=meshslice.transform(step))
  trainer.step(tokens=kwargs["kwargs"]["tokens"])
  assert int(trainer.state.value.step) == 1


_KERAS_LIKE = '''
class EinsumDense:
  def call(self, x):
    return einsum(x)

class Layer:
  def __call__(self, x):
    return self.call(x)

def error_handler(*args):
  return fn(*args)

class Attention:
  def call(self, x):
    query = self.query_dense(x)
    return self.helper(query)

  def helper(self, q):
    return self.key_dense(q)
'''


def test_the_source_falls_back_to_the_enclosing_keras_layers_call_line():
  from meshslice import provenance
  code = {}

  def collect(c):
    code[c.co_qualname] = c
    for const in c.co_consts:
      if hasattr(const, "co_qualname"):
        collect(const)

  collect(compile(_KERAS_LIKE, "/venv/lib/python3.12/site-packages/fakekeras/layers.py",
                  "exec"))
  dispatch = [code["error_handler"], code["Layer.__call__"], code["error_handler"]]
  # innermost first: EinsumDense.call <- dispatch <- Attention.call (`query = ...`)
  chain = [code["EinsumDense.call"], *dispatch, code["Attention.call"]]
  assert provenance.enclosing_call_method(chain) == len(chain) - 1
  # MaxText's `__call__` rule finds nothing there (its dispatch is a __call__ too)
  assert provenance.enclosing_layer_call(chain) is None
  # a helper method between them is not dispatch: no line (JAX's guess stays)
  assert provenance.enclosing_call_method(
      [code["EinsumDense.call"], *dispatch, code["Attention.helper"],
       code["Attention.call"]]) is None
  # no `call` method at all
  assert provenance.enclosing_call_method([code["error_handler"]]) is None
