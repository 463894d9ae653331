"""The house: no import loop at run time in the library's packages, and no module over 500 lines.

Imports are read from the source (no module is run): every ``import`` and ``from ... import``
counts, at module level or inside a function, except those under ``if TYPE_CHECKING:``
(hints only). A loop means one module cannot be read without the other being half-built.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("flashckpt", "elastic", "sharding")
MAX_LINES = 500


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of the library's packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The library modules ``module`` imports when it runs (hint-only imports left out)."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            # ``from pkg import mod`` needs ``pkg`` only begun, which importing ``pkg.mod`` ensures
            out.update(submodules if len(submodules) == len(node.names) else {base} | submodules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in out if name in modules and name != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_loop_at_run_time():
    modules = _modules()
    graph = {m: _runtime_imports(m, p, modules) for m, p in modules.items()}
    loops = _cycles(graph)
    assert not loops, "modules that import each other at run time:\n" + "\n".join(" <-> ".join(c) for c in loops)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_500_lines(package):
    long = {os.path.relpath(p, ROOT): n for m, p in _modules().items() if m.split(".")[0] == package
            and (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
