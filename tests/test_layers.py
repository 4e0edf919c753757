"""The package's layers, as docs/architecture.md ("Layers") states them, hold in the code.

An import graph of ``ondevice_moe`` is read from the source with :mod:`ast`: every ``import``
and ``from … import`` of an ``ondevice_moe`` module, at a module's top, inside a function or
under ``if TYPE_CHECKING:`` alike, since an import moved into a function is still a dependency
and breaks no circle. On that graph:

* no circle of imports joins two modules;
* no module imports a module of a higher layer;
* outside ``ondevice_moe/methods/`` no module imports a method's own folder
  (``ondevice_moe.methods.<folder>``): the core knows methods only through ``methods.base`` and
  ``methods.registry`` (the recipe's family sections too: each family's ``MethodSpec`` gives its schema).

Each failure names the importing file, the line and the import as written.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ondevice_moe"
SOURCE = ROOT / PACKAGE
METHODS = f"{PACKAGE}.methods"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    """One import of an ``ondevice_moe`` module: who imports what, where, and how it is written."""

    importer: str
    target: str
    line: int
    statement: str
    where: str  # "" at a module's top, else "in <function>" or "for type checking"

    def __str__(self) -> str:
        place = f" ({self.where})" if self.where else ""
        return f"{module_file(self.importer)}:{self.line}{place}: `{self.statement}`"


def module_file(module: str) -> str:
    """The path of ``module``'s source, relative to the repository."""
    path = SOURCE.joinpath(*module.split(".")[1:])
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(ROOT))


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolved(name: str, modules: dict[str, Path]) -> str:
    """The module ``name`` belongs to: itself, or the longest module prefix of it (a name in a module)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _contexts(tree: ast.Module) -> dict[ast.AST, str]:
    """For each import statement not at a module's top: the function it sits in, or ``for type checking``."""
    where: dict[ast.AST, str] = {}

    def visit(node: ast.AST, context: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = context
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = context or f"in {child.name}"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = context or "for type checking"
            if isinstance(child, (ast.Import, ast.ImportFrom)) and context:
                where[child] = context
            visit(child, inner)

    visit(tree, "")
    return where


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of an ``ondevice_moe`` module in ``module``'s source, wherever it stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    where = _contexts(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, or one of its parents
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from package import submodule`` imports the submodule; any other name is the package's own
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        else:
            continue
        for target in dict.fromkeys(_resolved(name, modules) for name in targets):
            if (target == PACKAGE or target.startswith(f"{PACKAGE}.")) and target != module:
                found.append(Import(module, target, node.lineno, ast.unparse(node), where.get(node, "")))
    return found


def import_graph() -> tuple[dict[str, Path], list[Import]]:
    modules = package_modules()
    return modules, [imp for module, path in modules.items() for imp in imports_of(module, path, modules)]


def circles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan), each sorted; every module of a set
    reaches every other by imports."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.importer, set()).add(imp.target)
        edges.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(edges[module]):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = []
            while not members or members[-1] != module:
                members.append(stack.pop())
                on_stack.discard(members[-1])
            if len(members) > 1:
                found.append(sorted(members))

    for module in sorted(edges):
        if module not in index:
            connect(module)
    return sorted(found)


def shortest_circle(members: list[str], imports: list[Import]) -> list[str]:
    """A shortest circle of imports through the first of ``members``, as the modules along it."""
    inside = set(members)
    edges: dict[str, list[str]] = {}
    for imp in imports:
        if imp.importer in inside and imp.target in inside:
            edges.setdefault(imp.importer, []).append(imp.target)
    start = members[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(set(edges.get(module, []))):
                if target == start:
                    return [*paths[module], start]
                if target not in paths:
                    paths[target] = [*paths[module], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{members} is not a circle")


def _circle_report(members: list[str], imports: list[Import]) -> str:
    inside = set(members)
    lines = [f"circle of {len(members)} modules: " + " -> ".join(shortest_circle(members, imports)),
             "  the imports inside it (cut one of each circle by moving code down, not into a function):"]
    lines += [f"    {imp}" for imp in imports if imp.importer in inside and imp.target in inside]
    return "\n".join(lines)


def test_no_import_circles() -> None:
    _, imports = import_graph()
    found = circles(imports)
    assert not found, "import circles among ondevice_moe modules:\n" + "\n".join(
        _circle_report(members, imports) for members in found)


# -- layers -------------------------------------------------------------------

ROW = re.compile(r"^\|\s*(\d+)\s+([^|]+?)\s*\|([^|]*)\|")


def documented_layers() -> dict[str, tuple[int, str]]:
    """The layer table of docs/architecture.md: each listed module or package (dotted, under
    ``ondevice_moe``; ``__init__`` is the package itself) → (its layer's number, its name)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)
    assert len(section) == 2, f"{ARCHITECTURE.relative_to(ROOT)} has no '## Layers' section"
    layers = {}
    for line in section[1].split("\n## ", 1)[0].splitlines():
        row = ROW.match(line)
        if row:
            for name in re.findall(r"`([^`]+)`", row.group(3)):
                dotted = PACKAGE if name == "__init__" else f"{PACKAGE}.{name.removesuffix('/').replace('/', '.')}"
                assert dotted not in layers, f"{name} is in two layers of {ARCHITECTURE.relative_to(ROOT)}"
                layers[dotted] = (int(row.group(1)), row.group(2))
    assert layers, f"no layer rows under '## Layers' in {ARCHITECTURE.relative_to(ROOT)}"
    return layers


def layer_of(module: str, layers: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The layer of ``module``: that of the longest listed name that is the module or a package above it."""
    name = module
    while name not in layers:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return layers[name]


def test_every_module_has_a_documented_layer() -> None:
    modules = package_modules()
    layers = documented_layers()
    unplaced = [module_file(module) for module in modules if layer_of(module, layers) is None]
    assert not unplaced, (f"modules in no layer of {ARCHITECTURE.relative_to(ROOT)} (add each to the "
                          f"'## Layers' table): {unplaced}")
    stale = sorted(name for name in layers if name not in modules)
    assert not stale, f"{ARCHITECTURE.relative_to(ROOT)}'s layer table names modules that do not exist: {stale}"


def test_no_layer_imports_a_higher_one() -> None:
    _, imports = import_graph()
    layers = documented_layers()
    upward = []
    for imp in imports:
        importer, target = layer_of(imp.importer, layers), layer_of(imp.target, layers)
        if importer is None or target is None:  # test_every_module_has_a_documented_layer names them
            continue
        (own, own_name), (their, their_name) = importer, target
        if their > own:
            upward.append(f"{imp}\n    layer {own} ({own_name}) imports {imp.target}, layer {their} ({their_name})")
    assert not upward, "imports of a higher layer (docs/architecture.md, Layers):\n" + "\n".join(upward)


def test_only_methods_import_a_method_folder() -> None:
    modules, imports = import_graph()
    folders = {name for name in modules if name.startswith(f"{METHODS}.") and (SOURCE / "methods" /
                                                                                  name.split(".")[2]).is_dir()}
    reached = []
    for imp in imports:
        folder = ".".join(imp.target.split(".")[:3])
        if folder not in folders or imp.importer == METHODS or imp.importer.startswith(f"{METHODS}."):
            continue
        reached.append(f"{imp}\n    reaches into the method folder {folder}")
    assert not reached, ("outside ondevice_moe/methods/, modules import a method's own folder (reach it through "
                         "methods.base or methods.registry, or move the code into the folder):\n" + "\n".join(reached))


# -- the tool itself ----------------------------------------------------------


def test_the_graph_sees_imports_in_functions_and_relative_ones(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text("import os\nfrom ondevice_moe.errors import UserError\n"
                      "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ondevice_moe import recipe\n"
                      "def run():\n    from ..federation.job import Job\n    import ondevice_moe.runner\n",
                      encoding="utf-8")
    modules = package_modules()
    found = {(imp.target, imp.line, imp.where) for imp in imports_of(f"{PACKAGE}.data.example", source, modules)}
    assert found == {(f"{PACKAGE}.errors", 2, ""), (f"{PACKAGE}.recipe", 5, "for type checking"),
                     (f"{PACKAGE}.federation.job", 7, "in run"), (f"{PACKAGE}.runner", 8, "in run")}


def test_circles_are_found_with_the_imports_that_make_them() -> None:
    imports = [Import("a", "b", 1, "import b", ""), Import("b", "c", 2, "import c", "in f"),
               Import("c", "a", 3, "import a", ""), Import("c", "d", 4, "import d", ""),
               Import("d", "e", 5, "import e", ""), Import("e", "d", 6, "import d", "")]
    assert circles(imports) == [["a", "b", "c"], ["d", "e"]]
    assert shortest_circle(["a", "b", "c"], imports) == ["a", "b", "c", "a"]
