"""meshslice installs and runs with the jax its users have (0.10.2 through 0.12.x).

The private JAX APIs the pass needs sit behind `meshslice._jax_internals`, whose compat
shims cover the supported range; `.ci/run` runs this suite on Python 3.11 + jax 0.10.2 and
on Python 3.12 + the newest jax. These tests pin the pieces a jax upgrade breaks first.
"""
import importlib.metadata as metadata
import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from packaging.requirements import Requirement

from meshslice import _jax_internals as internals

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("meshslice_pass", "rewrites", "costmodel")


def _project():
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_private_jax_apis_only_in_jax_internals():
  """A jax upgrade that moves a private API touches one file."""
  offenders = []
  for folder in PACKAGE_DIRS:
    for path in sorted((ROOT / folder).rglob("*.py")):
      if path.name == "_jax_internals.py":
        continue
      for n, line in enumerate(path.read_text().splitlines(), 1):
        if re.search(r"\bjax\._src\b", line):
          offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
  assert not offenders, "\n".join(offenders)


def test_installed_jax_is_in_the_declared_range():
  reqs = {Requirement(r).name: Requirement(r) for r in _project()["dependencies"]}
  for name in ("jax", "jaxlib"):
    assert reqs[name].specifier.contains(metadata.version(name)), (name, reqs[name])
  assert reqs["jax"].specifier.contains("0.10.2")
  assert reqs["jax"].specifier.contains("0.12.0.1")


def test_tpu_extra_gives_the_libtpu_of_the_installed_jax():
  """The `tpu` extra is jax's own `tpu` extra, unpinned within the range: libtpu follows
  the jax pip resolves (0.0.42.x for jax 0.10.2, 0.0.50.x for jax 0.12.0.1)."""
  tpu, = [Requirement(r) for r in _project()["optional-dependencies"]["tpu"]]
  assert tpu.name == "jax" and tpu.extras == {"tpu"} and not tpu.marker
  assert tpu.specifier.contains("0.10.2") and tpu.specifier.contains("0.12.0.1")
  try:
    libtpu = metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    pytest.skip("libtpu not installed (pip install -e '.[tpu]')")
  wanted = [Requirement(r) for r in metadata.requires("jax") or ()]
  wanted = [r for r in wanted if r.name == "libtpu" and r.marker
            and r.marker.evaluate({"extra": "tpu"})]
  assert wanted, "jax's metadata names no libtpu for its tpu extra"
  assert all(r.specifier.contains(libtpu, prereleases=True) for r in wanted), (
      f"libtpu {libtpu} is not the one jax {jax.__version__} asks for: {wanted}")


def test_closed_jaxpr_shim_reads_and_builds_on_this_jax():
  """jax 0.12 merged ClosedJaxpr into Jaxpr; the shim keeps `.jaxpr` / `.consts` and the
  two-argument constructor the pass uses (emit's scan/while handlers)."""
  c = jnp.arange(3.0)
  closed = internals.trace_once(lambda x: [jnp.sin(x) * c], jnp.ones(3))
  assert isinstance(closed, internals.ClosedJaxpr)
  assert [e.primitive.name for e in closed.jaxpr.eqns][:1] == ["sin"]
  assert len(closed.jaxpr.invars) == 1
  out, = internals.eval_closed(closed, jnp.ones(3))
  assert jnp.allclose(out, jnp.sin(1.0) * c)
  opened, consts = internals.hoist_consts(closed)
  rebuilt = internals.ClosedJaxpr(opened, ())
  assert len(rebuilt.jaxpr.invars) == len(consts) + 1 and list(rebuilt.consts) == []
  out2, = internals.eval_closed(rebuilt, *consts, jnp.ones(3))
  assert jnp.array_equal(out, out2)


def test_scan_counts_on_this_jax():
  """jax 0.11 replaced scan's num_consts/num_carry with flat trees (ft_in)."""
  c = jnp.ones(2)
  closed = jax.make_jaxpr(lambda h, xs: jax.lax.scan(
      lambda h, x: (h * c + x, h), h, xs))(jnp.zeros(2), jnp.ones((5, 2)))
  eqn, = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  assert internals.scan_counts(eqn.params) == (1, 1)


def test_partition_spec_text_is_the_same_on_every_jax():
  """jax 0.11 prints `unreduced_kind=sum` with every unreduced spec; reports do not."""
  assert internals.partition_spec_text(P(None, None, unreduced={"y"})) == (
      "P(None, None, unreduced={'y'})")
  assert internals.partition_spec_text(P("x", ("y", "z"))) == str(P("x", ("y", "z")))
