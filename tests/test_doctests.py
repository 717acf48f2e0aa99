"""Every docstring example of the package runs and prints what it says (the examples are
API documentation: a stale one misleads exactly the reader who trusts it)."""
import doctest
import importlib
import pkgutil

import pytest


_PACKAGES = ("meshslice", "meshslice.rewrites", "meshslice.costmodel")


def _modules():
  names = set()
  for package in _PACKAGES:
    names.add(package)
    names.update(f"{package}.{m.name}" for m in
                 pkgutil.iter_modules(importlib.import_module(package).__path__))
  return sorted(n for n in names if not n.endswith("__main__"))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
  result = doctest.testmod(importlib.import_module(name),
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
