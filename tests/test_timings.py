"""The pass's phase timings: `explain(..., timings=True)` and `Transformed.timings`."""
import jax

import meshslice
from meshslice.gpt import ModelConfig, abstract_inputs, make_mesh, make_step, place

CFG = ModelConfig(layers=1, batch=4, seq=16, hidden=64, heads=4, ffn=128)


def test_explain_with_timings_reports_the_pass_phases():
  mesh = make_mesh((2, 4))
  params, batch = abstract_inputs(CFG, mesh)
  report, seconds = meshslice.explain(make_step(CFG, mesh), timings=True)(params, batch)
  assert report.rewritten
  assert set(seconds) == {"trace", "analysis", "planning", "emission"}
  assert all(v >= 0 for v in seconds.values())
  # without the flag: the report alone, as before
  assert isinstance(meshslice.explain(make_step(CFG, mesh))(params, batch),
                    type(report))


def test_transformed_timings_follow_lower():
  mesh = make_mesh((2, 4))
  params, batch = place(CFG, mesh)
  fast = meshslice.transform(make_step(CFG, mesh, donate=False), ksplit=2)
  assert set(fast.timings(params, batch)) == {"trace", "analysis", "planning"}
  lowered = fast.lower(params, batch)
  assert {"emission", "lowering"} <= set(fast.timings(params, batch))
  compiled = lowered.compile()
  seconds = fast.timings(params, batch)
  assert set(seconds) == {"trace", "analysis", "planning", "emission", "lowering"}
  new_params, loss = compiled(params, batch)
  assert jax.numpy.isfinite(loss)
