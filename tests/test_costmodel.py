"""The cost model: the cases the per-module test files share (test_costmodel_<module>.py
import them from here) and the docstring examples of every module. No JAX needed."""
import dataclasses
import doctest

import pytest

from meshslice.costmodel import autotune, memory, profiles, timeline, timing, topology
from meshslice.costmodel.profiles import CollectiveParams, GemmEfficiency, HardwareProfile
from meshslice.costmodel.timing import GemmProblem

approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)


def _pair(a, b=None):
  return (a, a if b is None else b)


# Distinct numbers per dim and per kind, so a mixed-up axis or kind shows up.
PROF = HardwareProfile(
    name="test", peak_flops=1e12,
    all_gather=CollectiveParams(bandwidth=(1e9, 2e9), hop_latency=(1e-6, 2e-6),
                                base_overhead=(1e-5, 2e-5)),
    reduce_scatter=CollectiveParams(bandwidth=(0.5e9, 1e9), hop_latency=(1e-6, 2e-6),
                                    base_overhead=(3e-5, 4e-5)),
    permute=CollectiveParams(bandwidth=(2e9, 4e9), hop_latency=_pair(5e-6),
                             base_overhead=_pair(1e-5)),
    # Saturation at 1 element: every matmul runs at peak.
    gemm=GemmEfficiency(max_efficiency=1.0, m_sat=1, n_sat=1, k_sat=1))


# The OS / Wang / SUMMA example: X[2000, 4000] . W[4000, 4000] on a 2 x 4 mesh.
# X shard (m/R)(k/C) = 1000 * 1000 * 2 B = 2e6 B (col link, dim 1, n = 4);
# W shard (k/R)(n/C) = 2000 * 1000 * 2 B = 4e6 B (row link, dim 0, n = 2).
OS = GemmProblem(m=2000, n=4000, k=4000, rows=2, cols=4, in_bytes=2, out_bytes=4)

PROBLEMS = [OS, GemmProblem(m=4096, n=1024, k=2048, rows=4, cols=4, out_bytes=4),
            GemmProblem(m=512, n=8192, k=1024, rows=8, cols=2, batch=3)]

HBM = dataclasses.replace(PROF, hbm_bandwidth=1e10, op_overhead=1e-5)

WIDE = dataclasses.replace(HBM, gemm=GemmEfficiency(max_efficiency=0.8, m_sat=64, n_sat=64,
                                                    k_sat=64))


@pytest.mark.parametrize("module", [profiles, timing, autotune, timeline, topology, memory],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  assert doctest.testmod(module, optionflags=flags).failed == 0
