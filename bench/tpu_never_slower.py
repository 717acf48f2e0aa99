"""The never-slower rule on a MaxText-style step (examples/maxtext_style_step.py at
emb 2048, mlp 8192, seq 2048, 2 layers, bf16) compiled for v4:2x2x2 as (data 1, x 2,
y 4): plain jit vs meshslice's default plan under the rule (costing.XLA_MARGIN, ties to
XLA on TPU) and under the rule before it (collective kept on a tie, sliced rewrites kept
when strictly faster). argv[1]: libtpu flag presets (default: async); optional argv[2:]:
topology, mesh as DATAxXxY, layers, batch.

  python bench/tpu_never_slower.py async    # ~3 min, 3 compiles
  python bench/tpu_never_slower.py dense,async,all_to_all v4:8x8x4 1x64x4 2 256
"""
import os
import sys
import json
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from meshslice import aot, costing
preset = sys.argv[1] if len(sys.argv) > 1 else "async"
aot.set_flags(*aot.preset_flags(preset, "v4"))
import jax
jax.config.update("jax_platforms", "cpu")
import maxtext_style_step as ex
import meshslice
topology = sys.argv[2] if len(sys.argv) > 2 else "v4:2x2x2"
shape = tuple(int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "1x2x4").split("x"))
layers = int(sys.argv[4]) if len(sys.argv) > 4 else 2
batch = int(sys.argv[5]) if len(sys.argv) > 5 else 8
cfg = ex.Config(layers=layers, batch=batch, seq=2048, embed=2048, heads=16, mlp=8192,
                vocab=32768, dtype="bfloat16")
tpu = aot.make_mesh(topology, shape, ("data", "x", "y"))
step, args, _, _ = ex.make_step(cfg, tpu)
def old_rule(best, coll, xla, margin=0.0, **_):
  if coll and not xla.windowed:
    return best > xla.seconds * (1 + 1e-9)
  return best >= xla.seconds
out = {"flags": os.environ.get("LIBTPU_INIT_ARGS", ""), "topology": topology,
       "mesh": shape, "layers": layers, "batch": batch}
variants = [("plain", None), ("new rule", None), ("old rule", old_rule)]
for name, rule in variants:
  fn = step
  if name != "plain":
    if rule is not None:
      real = costing.leave_to_xla
      costing.leave_to_xla = rule
    fn = meshslice.transform(step, profile="tpu-v4")
    with jax.set_mesh(tpu):
      rep = fn.explain(*args)
    print(f"== {name}: {rep.summary()}", flush=True)
    for s in rep.sites:
      plan = (f"REWRITTEN {s.algorithm} {s.dataflow} S={s.ksplit}" if s.rewritten
              else "left: " + s.reason[:160])
      print(f"  #{s.index} {s.direction} {s.lhs_shape}x{s.rhs_shape} "
            f"{plan}"
            f" pred {s.predicted_seconds and s.predicted_seconds*1e6:.1f}us"
            if s.predicted_seconds else "", flush=True)
  compiled, secs = aot.compile(fn, *args, mesh=tpu)
  if name != "plain" and rule is not None:
    costing.leave_to_xla = real
  r = aot.analyze(compiled, "tpu-v4", compile_s=secs, mesh_shape=None).row()
  out[name] = {k: r[k] for k in ("step_s", "compute_s", "exposed_s", "collective_bytes",
                                 "compute_cycles", "collectives", "sync_collectives",
                                 "async_collectives", "compile_s")}
  print(name, json.dumps(out[name]), flush=True)
print("RESULT " + json.dumps(out))
