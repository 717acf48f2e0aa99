"""meshslice.check crashes while bisecting when the user's options pin sites by a
module-path pattern (found by examples/maxtext_style_step.py, --data 2).

check(step, ksplit=2, overrides={"*bse,ev->bsv": {"ksplit": 1}}) finds a disagreement
(caused by plain GSPMD, see finding 03), bisects, and a re-transform raises
"overrides['*bse,ev->bsv'] pins ksplit=1 on site #8 (...:147), which cannot be
rewritten: left alone as requested (override or plan)". Bisection's {i: {"rewrite":
False}} should win over the user's pattern pin on the sites it turns off. (The same
merge done by hand on a smaller program did not raise; so far it reproduces only here.)
Run (about 2 minutes): python fuzz_findings/04_check_bisect_conflicts_with_pattern_overrides.py
"""
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import jax  # noqa: E402
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import AxisType  # noqa: E402
import maxtext_style_step as m  # noqa: E402
import meshslice  # noqa: E402

cfg = m.TINY
mesh = jax.make_mesh((2, 2, 2), ("data", "x", "y"), axis_types=(AxisType.Auto,) * 3,
                     devices=jax.devices()[:8])
step, _, param_sh, token_sh = m.make_step(cfg, mesh)
kp, kt = jax.random.split(jax.random.key(0))
params = jax.jit(functools.partial(m.init_params, cfg), out_shardings=param_sh)(kp)
tokens = jax.random.randint(kt, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
args = (params, jax.device_put(tokens[:, :-1], token_sh), jax.device_put(tokens[:, 1:], token_sh))
print(meshslice.check(step, ksplit=2, overrides={"*bse,ev->bsv": {"ksplit": 1}})(*args))
print("no error: fixed")
