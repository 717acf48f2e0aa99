"""What a report adds up: plans by kind (`Report.plan_counts`) and the step's predicted
time, each site counted as often as it runs (`Site.runs`: the product of the lengths of
the scans around it)."""
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import _jax_internals

from helpers import mesh


def _nested_scans_report(**options):
  """x @ w inside a scan of 3 inside a scan of 2, then @ v in the outer scan's body and
  once more outside both."""
  msh = mesh((2, 4))
  xs = NamedSharding(msh, P("x", "y"))
  ws = NamedSharding(msh, P(None, None, "x", "y"))

  def step(x, w, v):
    def outer(c, wl):
      c, _ = jax.lax.scan(lambda c, wi: (c @ wi, None), c, wl)
      return c @ v, None
    y, _ = jax.lax.scan(outer, x, w)
    return y @ v

  f = jax.jit(step, in_shardings=(xs, ws, xs), out_shardings=xs)
  x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=xs)
  w = jax.ShapeDtypeStruct((2, 3, 512, 512), jnp.float32, sharding=ws)
  v = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=xs)
  return meshslice.explain(f, profile="tpu-v4", **options)(x, w, v)


def test_runs_is_the_product_of_the_enclosing_scan_lengths():
  report = _nested_scans_report()
  assert [(s.context, s.runs) for s in report.sites] == [
      ("scan > scan", 6), ("scan", 2), ("top", 1)]
  assert report.rewritten == report.sites
  # one call of the step: each site's time times its runs
  assert report.predicted_step_seconds == sum(s.predicted_seconds * s.runs
                                               for s in report.sites)
  assert report.baseline_step_seconds == sum(s.baseline_seconds * s.runs
                                             for s in report.sites)
  assert report.predicted_step_seconds > report.predicted_seconds


def test_runs_changes_no_plan_report_text_or_site_equality():
  report = _nested_scans_report()
  once = dataclasses.replace(report, sites=tuple(dataclasses.replace(s, runs=1)
                                                 for s in report.sites))
  assert once.sites == report.sites and once == report
  assert "runs" not in repr(report.sites[0])
  assert once.plan.to_json() == report.plan.to_json() and "runs" not in report.plan.to_json()
  # the report's text is per listed site, except the step's sum against XLA's program
  per_step = lambda text: [l for l in text.splitlines() if "priced against XLA" not in l]
  assert per_step(str(once)) == per_step(str(report))
  assert once.predicted_step_seconds == once.predicted_seconds
  assert once.xla_sites_seconds < report.xla_sites_seconds


def test_scopes_are_the_parts_of_context():
  report = _nested_scans_report()
  assert [s.scopes for s in report.sites] == [("scan", "scan"), ("scan",), ()]
  assert all((" > ".join(s.scopes) or "top") == s.context for s in report.sites)
  # not part of site equality, repr, plan JSON or report text
  bare = dataclasses.replace(report, sites=tuple(dataclasses.replace(s, scopes=())
                                                 for s in report.sites))
  assert bare.sites == report.sites and "scopes" not in repr(report.sites[0])
  assert bare.plan.to_json() == report.plan.to_json()
  assert "scopes" not in report.plan.to_json() and str(bare) == str(report)


def test_sites_priced_against_xla_add_up_per_step():
  report = _nested_scans_report()
  # tpu-v4's compiler terms: every automatic site is priced against XLA's own program
  assert report.compared == list(report.sites)
  assert all(s.xla_seconds > 0 for s in report.sites)
  assert report.xla_sites_seconds == sum(s.xla_seconds * s.runs for s in report.sites)
  assert report.plan_sites_seconds == sum(s.predicted_seconds * s.runs
                                          for s in report.sites)
  xla, plan = report.xla_sites_seconds, report.plan_sites_seconds
  assert (f"the 3 sites priced against XLA's own program: {plan * 1e6:.1f} us vs "
          f"{xla * 1e6:.1f} us per step ({xla / plan:.2f}x; nothing else of the step "
          "priced)") in str(report)
  # not part of site equality, repr or plan JSON
  assert "xla_seconds" not in repr(report.sites[0])
  assert "xla_seconds" not in report.plan.to_json()
  # no XLA candidate (xla_baseline="none"): nothing compared, no line
  alone = _nested_scans_report(xla_baseline="none")
  assert alone.compared == [] and alone.xla_sites_seconds == 0.0
  assert "priced against XLA" not in str(alone)


def test_scan_length_reads_scans_only():
  closed = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c @ c, None), x, None,
                                                 length=3)[0])(jnp.ones((2, 2)))
  scan, = closed.jaxpr.eqns
  assert _jax_internals.scan_length(scan) == 3
  loop = jax.make_jaxpr(lambda x: jax.lax.while_loop(lambda c: c[0, 0] < 3,
                                                     lambda c: c @ c, x))(jnp.ones((2, 2)))
  assert [_jax_internals.scan_length(e) for e in loop.jaxpr.eqns] == [None]


def test_plan_counts_counts_rewritten_sites_by_plan():
  report = _nested_scans_report()
  a, b, c = report.sites
  assert report.plan_counts() == {"collective os S=1": 3}
  report = dataclasses.replace(report, sites=(
      dataclasses.replace(a, algorithm="meshslice", dataflow="ls", ksplit=2,
                          reduce_scatter="all_to_all"),
      dataclasses.replace(b, algorithm="meshslice", dataflow="ls", ksplit=2),
      dataclasses.replace(c, rewritten=False, algorithm=None, dataflow=None, ksplit=None,
                          reason="left alone as requested (override or plan)")))
  assert report.plan_counts() == {"meshslice ls S=2": 2}
  counts = report.plan_counts(reduce_scatter=True)
  assert counts == {"meshslice ls S=2": 1, "meshslice ls S=2 rs=all_to_all": 1}
  assert list(counts) == sorted(counts)
