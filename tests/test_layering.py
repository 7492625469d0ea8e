"""The dependency floors of docs/design.md ("Dependency direction") hold: no module imports a
floor above its own, no import circle, every module placed; imports inside functions count.

The floors are read from the design doc's block, so the doc and this test cannot drift apart.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("glm5_jax", "pallas_kernels", "configs", "experiments", "tools")
DESIGN = os.path.join(ROOT, "docs", "design.md")


def read_floors(design_text: str) -> list[list[str]]:
  """The names of each floor, top floor first, from the fenced block after the
  "### Dependency direction" heading: one floor a line, `name, name  -- comment`."""
  section = design_text.split("### Dependency direction", 1)[1]
  block = section.split("```", 2)[1]
  floors = []
  for line in block.strip().splitlines():
    names = line.split("--", 1)[0]
    floors.append([n.strip() for n in names.split(",") if n.strip()])
  return floors


def find_modules(root: str) -> dict[str, str]:
  """{dotted module name: file path} for every .py file of PACKAGES under root."""
  modules = {}
  for top in PACKAGES:
    for dirpath, _, files in os.walk(os.path.join(root, top)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(dirpath, f)
          name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
          modules[name.removesuffix(".__init__")] = path
  return modules


def _is_type_checking(node: ast.AST) -> bool:
  test = getattr(node, "test", None)
  return isinstance(node, ast.If) and (
      (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
      or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def module_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
  """The modules of `known` that `module`'s source imports anywhere (top level, functions,
  classes), each resolved to the most specific known module: `from pkg import sub` is `pkg.sub`
  when that is a module, else `pkg`. Relative imports are resolved against `module`."""
  found = set()
  stack = [ast.parse(source)]
  while stack:
    node = stack.pop()
    if _is_type_checking(node):  # never runs; its else branch still does
      stack.extend(getattr(node, "orelse", []))
      continue
    stack.extend(ast.iter_child_nodes(node))
    targets = []
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
        base = ".".join(parts + ([node.module] if node.module else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    for target in targets:
      parts = target.split(".")
      for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in known:
          if candidate != module:
            found.add(candidate)
          break
  return found


def import_map(root: str) -> dict[str, set[str]]:
  modules = find_modules(root)
  known = set(modules)
  result = {}
  for name, path in modules.items():
    with open(path) as f:
      result[name] = module_imports(f.read(), name, path.endswith("__init__.py"), known)
  return result


def floor_of(module: str, floors: list[list[str]]) -> int | None:
  """Index of the floor (0 = top) placing `module`: the longest name that is the module or a
  package holding it; `pkg.__init__` places the package module `pkg` alone."""
  best, best_len = None, -1
  for i, names in enumerate(floors):
    for name in names:
      if name.endswith(".__init__"):
        hit = module == name.removesuffix(".__init__")
      else:
        hit = module == name or module.startswith(name + ".")
      if hit and len(name) > best_len:
        best, best_len = i, len(name)
  return best


def layering_errors(imports: dict[str, set[str]], floors: list[list[str]]) -> list[str]:
  """Every unplaced module, upward import and import circle, as sentences."""
  errors = []
  floor = {m: floor_of(m, floors) for m in imports}
  for m in sorted(imports):
    if floor[m] is None:
      errors.append(f"{m}: on no floor of docs/design.md (Dependency direction)")
  for m in sorted(imports):
    for target in sorted(imports[m]):
      if floor[m] is not None and floor.get(target) is not None and floor[target] < floor[m]:
        errors.append(f"upward import: {m} (floor {floors[floor[m]]}) imports {target} "
                      f"(floor {floors[floor[target]]})")
  errors.extend(f"import circle: {' -> '.join(c + [c[0]])}" for c in circles(imports))
  return errors


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
  """The import circles: strongly connected groups of more than one module (Tarjan), each
  sorted."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(imports.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  for v in sorted(imports):
    if v not in index:
      visit(v)
  return out


@pytest.fixture(scope="module")
def floors():
  with open(DESIGN) as f:
    return read_floors(f.read())


@pytest.fixture(scope="module")
def repo_imports():
  return import_map(ROOT)


def test_the_repository_keeps_its_floors(floors, repo_imports):
  assert len(floors) >= 10, floors
  assert repo_imports["glm5_jax.decoder"] >= {"glm5_jax.config", "glm5_jax.moe"}
  errors = layering_errors(repo_imports, floors)
  assert not errors, "\n".join(errors)


def test_every_floor_name_is_a_module(floors, repo_imports):
  """A misspelt floor name would place nothing and silently stop checking that package."""
  for names in floors:
    for name in names:
      assert name.removesuffix(".__init__") in repo_imports, name


def test_an_injected_upward_import_fails(floors, repo_imports):
  """A deferred import inside a function, from config up into the training loop."""
  source = "def f():\n  from glm5_jax.train import loop\n  return loop\n"
  known = set(repo_imports)
  injected = module_imports(source, "glm5_jax.config", False, known)
  assert injected == {"glm5_jax.train.loop"}
  imports = {**repo_imports, "glm5_jax.config": repo_imports["glm5_jax.config"] | injected}
  errors = layering_errors(imports, floors)
  assert any(e.startswith("upward import: glm5_jax.config ") and "glm5_jax.train.loop" in e
             for e in errors), errors
  # config is imported by the loop (through several floors), so this also closes a circle.
  assert any(e.startswith("import circle:") and "glm5_jax.config" in e for e in errors), errors


def test_a_circle_inside_one_floor_and_an_unplaced_module_fail():
  floors = [["a"], ["b"]]
  imports = {"a.x": {"a.y"}, "a.y": {"a.x", "b.z"}, "b.z": set(), "c": set()}
  errors = layering_errors(imports, floors)
  assert "import circle: a.x -> a.y -> a.x" in errors
  assert "c: on no floor of docs/design.md (Dependency direction)" in errors
  assert not any("upward" in e for e in errors)


def test_relative_and_type_checking_imports():
  known = {"p", "p.a", "p.b", "p.c"}
  source = ("from . import a\nfrom .b import thing\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n  from p import c\n")
  assert module_imports(source, "p.x", False, known) == {"p.a", "p.b"}
  assert module_imports("from .a import y\n", "p", True, known) == {"p.a"}
