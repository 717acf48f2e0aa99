"""Report.write_trace times each site with the profile the planner used for it."""
import json

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import costing, costmodel

from helpers import mesh


def test_trace_spans_last_the_predicted_time_under_the_site_profile(tmp_path):
  # GPT-3-sized abstract operands on a (2, 4) mesh, planned with tpu-v4: its topology
  # gives the 2-long row axis a different bandwidth from the profile's fixed dim 0, so a
  # trace timed with the base profile would disagree with the planner's prediction.
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s)
  f = jax.jit(lambda x, w: x @ w, in_shardings=(s, s), out_shardings=s)
  report = meshslice.explain(f, profile="tpu-v4", relayout=False)(spec((1024, 12288)),
                                                                  spec((12288, 12288)))
  sites = report.rewritten
  assert sites
  path = tmp_path / "trace.json"
  report.write_trace(str(path))
  spans = {e["name"]: e for e in json.loads(path.read_text())["traceEvents"]
           if e.get("ph") == "X" and e["tid"] == 3}
  base = costmodel.load_profile("tpu-v4")
  for site in sites:
    label = f"#{site.index} {site.algorithm} {site.dataflow} S={site.ksplit} ({site.source})"
    flow = costing.model_dataflow(site.dataflow)
    own = costing.site_profile(base, site.geometry, report.mesh_shape)
    assert own.name == "tpu-v4@2x4"
    # the span is the analytic schedule under the profile the planner used for the site
    planned = costmodel.schedule(site.problem, site.algorithm, flow, site.ksplit, own)
    assert abs(spans[label]["dur"] - planned.cost().total_s * 1e6) < 1e-2, label
    # the base profile's fixed dims would have timed it differently
    plain = costmodel.schedule(site.problem, site.algorithm, flow, site.ksplit, base)
    assert abs(plain.cost().total_s - planned.cost().total_s) > 0.05 * planned.cost().total_s


def test_report_head_names_only_the_axes_that_shard():
  msh = mesh((1, 2, 1, 4), names=("data", "x", "stage", "y"))
  s = NamedSharding(msh, P("x", "y"))
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=s)
  w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=s)
  report = meshslice.explain(lambda x, w: x @ w)(x, w)
  assert report.mesh_shape == {"data": 1, "x": 2, "stage": 1, "y": 4}
  assert str(report).splitlines()[0].startswith(
      "meshslice report: mesh x=2 x y=4 (+2 axes of size 1), profile tpu-v4; 1 matmul: ")
