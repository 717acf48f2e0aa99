"""meshslice: a JAX pass that makes 2D tensor parallelism fast.

    fast_step = meshslice.transform(step)         # same signature, shardings, donation
    print(meshslice.explain(step)(*args))          # what was rewritten, how, and why not
"""
from .check import CheckResult, check
from .options import Options
from .plan import Plan
from .planning import Site
from .report import Report
from .transform import Transformed, explain, transform
from .tune import HeldGathers, SlicedSites, tune

__all__ = ["CheckResult", "HeldGathers", "Options", "Plan", "Report", "Site", "SlicedSites",
           "Transformed", "check", "explain", "transform", "tune"]
__version__ = "0.1.0"
