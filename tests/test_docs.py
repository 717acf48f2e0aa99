"""The documentation has one source per fact: every option is documented once, in the
`Options` docstring (which the API reference renders), and every public name is in the
API reference. Building the site itself (`sphinx -W`) is .ci/run's docs step."""
import pathlib
import re

import meshslice
from meshslice import pins
from meshslice.options import Options

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _attributes(doc: str) -> list:
  """The names an "Attributes:" section of a Google-style docstring documents."""
  section = doc.split("Attributes:", 1)[1]
  return re.findall(r"^    (\w+):", section, flags=re.M)


def test_every_option_is_documented_once_in_the_options_docstring():
  fields = list(Options.names())
  documented = _attributes(Options.__doc__)
  assert sorted(documented) == sorted(fields)
  assert len(set(documented)) == len(documented)


def test_every_pin_key_is_documented_with_overrides():
  overrides = Options.__doc__.split("    overrides:", 1)[1].split("\n    plan:", 1)[0]
  for key in pins.PIN_KEYS:
    assert f'"{key}"' in overrides, key


def test_transform_documents_its_options_by_reference_not_by_copy():
  """transform's and explain's docstrings point at Options instead of keeping a second
  option list that drifts (the old one lacked reduce_scatter and hold_gathers)."""
  fields = list(Options.names())
  for fn in (meshslice.transform, meshslice.explain):
    assert "meshslice.Options" in fn.__doc__ or "Options" in fn.__doc__
    named = [f for f in fields if re.search(rf"\b{f}\b", fn.__doc__)]
    assert len(named) <= 1, (fn.__name__, named)


def test_the_api_reference_lists_every_public_name():
  api = (DOCS / "api.md").read_text()
  for name in meshslice.__all__:
    assert re.search(rf"auto\w+:: meshslice\.{name}\b", api), name


def test_every_page_is_in_the_site():
  index = (DOCS / "index.md").read_text()
  pages = sorted(p.stem for p in DOCS.glob("*.md") if p.stem not in ("index",))
  missing = [p for p in pages if not re.search(rf"^{p}$", index, flags=re.M)]
  assert not missing
