"""Sphinx configuration of the meshslice documentation site.

Build: `python -m pip install -e '.[docs]' && python -m sphinx -W -b html docs build/docs`
(.ci/run builds it with warnings as errors). Pages are Markdown (MyST); the API reference
(`api.md`) is rendered from the docstrings, the single source of each public name's
documentation.
"""
project = "meshslice"
author = "the meshslice developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
# docstrings are Google style ("Args:", "Example:") with doctest examples
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"         # signatures show the defaults; the prose says the types
autodoc_default_options = {"members": False}
html_theme = "alabaster"
# the pages link to repository files (README.md, bench/*.py, examples/) by path
suppress_warnings = ["myst.xref_missing"]
