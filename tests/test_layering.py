"""The import layering of docs/design.md, as a test: an AST scan of every module's imports
(function-level ones included, which hide cycles from Python's import order).

Rules: `meshslice.rewrites` and `meshslice.costmodel` never import the pass
(`meshslice_pass`, the `meshslice` package itself); `rewrites` never imports `costmodel`
(an algorithm does not know what it costs); and no two modules import each other through
a cycle. Edges to a package's `__init__` count like any other.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"meshslice_pass": "meshslice", "rewrites": "meshslice.rewrites",
            "costmodel": "meshslice.costmodel"}
# Cycles tolerated (none: the last one, profiles -> xla_baseline for the "compiler_terms"
# section check, became a check xla_baseline registers with profiles).
KNOWN_CYCLES: list = []


def _modules() -> dict:
  """{dotted module name: path} for every module of the three packages."""
  found = {}
  for folder, package in PACKAGES.items():
    for path in sorted((ROOT / folder).rglob("*.py")):
      parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      found[".".join([package] + parts)] = path
  return found


def _imports(name: str, path: pathlib.Path, known: set) -> set:
  """The package modules `name` imports anywhere in its file."""
  is_package = path.name == "__init__.py"
  here = name if is_package else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = here.split(".")
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      # `from pkg import submodule` imports that module; `from pkg import name`, pkg
      subs = [f"{base}.{alias.name}" for alias in node.names]
      targets = [t for t in subs if t in known]
      if len(targets) < len(subs):
        targets.append(base)
    else:
      continue
    for target in targets:
      while target and target not in known:
        target = target.rpartition(".")[0]
      if target and target != name:
        out.add(target)
  return out


def _graph() -> dict:
  modules = _modules()
  return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _package_of(module: str) -> str:
  for package in ("meshslice.rewrites", "meshslice.costmodel"):
    if module == package or module.startswith(package + "."):
      return package
  return "meshslice"


def test_the_scan_sees_the_packages_imports():
  graph = _graph()
  assert "meshslice.costmodel.timing" in graph["meshslice.costmodel.autotune"]
  assert "meshslice.rewrites" in graph["meshslice.emit"]
  assert len(graph) > 40


def test_rewrites_and_costmodel_never_import_the_pass_and_rewrites_never_costmodel():
  bad = []
  for module, targets in _graph().items():
    package = _package_of(module)
    for target in targets:
      other = _package_of(target)
      if package != "meshslice" and other == "meshslice":
        bad.append(f"{module} imports the pass: {target}")
      if package == "meshslice.rewrites" and other == "meshslice.costmodel":
        bad.append(f"{module} imports the cost model: {target}")
  assert not bad, "\n".join(bad)


def test_no_import_cycles_but_the_known_ones():
  graph = _graph()
  # strongly connected components (Tarjan), each a set of modules importing in a circle
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(frozenset(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  new = [sorted(c) for c in cycles if not any(c <= known for known in KNOWN_CYCLES)]
  assert not new, new
