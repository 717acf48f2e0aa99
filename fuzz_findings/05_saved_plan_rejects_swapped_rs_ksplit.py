"""A plan saved from meshslice.explain cannot be applied to the same program (found by
examples/maxtext_style_step.py --data 1).

explain(step, ksplit=2) plans a weight-gradient site (einsum "bse,enh->bsnh", backward,
inside scan > remat) as "meshslice rs S=2 over ('x', 'y')" with the note "operands
swapped: the result is only used transposed", and report.plan records ksplit=2 for it.
explain/transform(step, plan=that_plan) then raises "ksplit=2 does not fit site #28 ...
a rs matmul over ('x', 'y'): its communicated extent 4 must be divisible by ksplit *
lcm(R, C) = 8. Valid ksplit for this site: 1" -- the pin seems to be validated against
the unswapped geometry. Expected: a library-made plan always re-applies.
Run: python fuzz_findings/05_saved_plan_rejects_swapped_rs_ksplit.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import jax  # noqa: E402
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import AxisType  # noqa: E402
import maxtext_style_step as m  # noqa: E402
import meshslice  # noqa: E402

mesh = jax.make_mesh((1, 2, 4), ("data", "x", "y"), axis_types=(AxisType.Auto,) * 3,
                     devices=jax.devices()[:8])
step, abstract, _, _ = m.make_step(m.TINY, mesh)
report = meshslice.explain(step, ksplit=2)(*abstract)
bad = [s for s in report.sites if s.rewritten and s.dataflow == "rs" and s.ksplit == 2
       and "swapped" in (s.note or "")]
print("swapped rs sites planned with S=2:", [s.index for s in bad])
meshslice.explain(step, plan=report.plan)(*abstract)   # raises ValueError
print("no error: fixed")
