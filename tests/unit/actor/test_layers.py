"""The import contract of `regent.actor`: each module sits in one layer and imports only from its own layer or
below, and no modules import each other in a circle.

`LAYERS` is the one list of the layers (docs/architecture.md's actor section shows it, checked below). Every
import counts, also one inside a function (there it would only dodge a circle) and one under `TYPE_CHECKING`
(a lower layer does not even name a higher layer's types); a type-only import runs nothing at import time, so
only it may close a circle within a layer.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "src" / "regent" / "actor"

# bottom to top: (layer name, its modules)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("values", ("_config", "_errors", "_shape", "_pickle", "_child_process", "_future")),
    ("wire", ("_transport", "_messages")),
    ("routing", ("_runtime",)),
    ("process state", ("_directory", "_supervision", "_tree", "_process")),
    ("actors", ("_actor", "_context", "_port", "_cell", "_spawner", "_handlers")),
    ("api", ("_mesh", "_proc_logs", "_proc_mesh", "_host_mesh", "_proc_main", "commands", "__init__")),
]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_imports(source: str, package: str = "regent.actor") -> list[tuple[str, int, bool]]:
    """The modules of `package` that `source` imports, anywhere in it: (module, line, type_only)."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
            elif node.level == 0 and node.module == package:
                names = [a.name if a.name.startswith("_") or a.name == "commands" else "__init__"
                         for a in node.names]
            elif node.level == 0 and node.module and node.module.startswith(package + "."):
                names = [node.module[len(package) + 1:].split(".")[0]]
            else:
                names = []
            found.extend((name, node.lineno, type_only) for name in names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package:
                    found.append(("__init__", node.lineno, type_only))
                elif alias.name.startswith(package + "."):
                    found.append((alias.name[len(package) + 1:].split(".")[0], node.lineno, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(source), False)
    return found


def layer_of(layers: list[tuple[str, tuple[str, ...]]]) -> dict[str, int]:
    return {module: index for index, (_name, modules) in enumerate(layers) for module in modules}


def violations(graph: dict[str, list[tuple[str, int, bool]]], layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Every import of a higher layer, every module in no layer, and every circle of run-time imports."""
    where = layer_of(layers)
    names = [name for name, _modules in layers]
    problems = [f"{module}: in no layer of LAYERS" for module in sorted(graph) if module not in where]
    edges: dict[str, set[str]] = {module: set() for module in graph}
    for module, imports in sorted(graph.items()):
        for target, line, type_only in imports:
            if target == module:
                continue
            if target in where and module in where and where[target] > where[module]:
                problems.append(f"{module}.py:{line} imports {target} ({names[where[target]]}) from a lower layer "
                                f"({names[where[module]]})")
            if not type_only and target in edges:
                edges[module].add(target)
    problems.extend(f"import circle: {' -> '.join(cycle)}" for cycle in cycles(edges))
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), as a path back to its start."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
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
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [_path(group, edges) for group in groups]


def _path(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A circle inside `group` from its first module back to it (breadth first: a shortest one)."""
    start = group[0]
    members = set(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return group


def package_graph() -> dict[str, list[tuple[str, int, bool]]]:
    return {path.stem: module_imports(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def test_regent_actor_keeps_its_layers() -> None:
    problems = violations(package_graph(), LAYERS)
    assert not problems, "regent.actor breaks its import contract (tests/unit/actor/test_layers.py):\n" + \
        "\n".join(problems)


def test_every_layer_module_exists() -> None:
    present = {path.stem for path in PACKAGE.glob("*.py")}
    assert sorted(set(layer_of(LAYERS)) - present) == []


def test_the_architecture_document_shows_the_layers() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    shown = "\n".join(f"| {i} {name} | {', '.join(f'`{m}`' for m in modules)} |"
                      for i, (name, modules) in reversed(list(enumerate(LAYERS))))
    assert shown in doc, f"docs/architecture.md should show the layers of tests/unit/actor/test_layers.py:\n{shown}"


# ---- the checker itself, on small made-up packages ---------------------------------------------------------
TWO = [("low", ("a",)), ("high", ("b",))]


def test_an_import_from_a_higher_layer_is_reported_even_inside_a_function() -> None:
    graph = {"a": module_imports("def f():\n    from regent.actor.b import x\n"), "b": []}
    assert violations(graph, TWO) == ["a.py:2 imports b (high) from a lower layer (low)"]


def test_a_type_only_import_from_a_higher_layer_is_reported() -> None:
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from regent.actor.b import B\n"
    assert violations({"a": module_imports(src), "b": []}, TWO) == ["a.py:3 imports b (high) from a lower layer (low)"]


def test_the_package_itself_counts_as_its_top() -> None:
    assert module_imports("import regent.actor as api\nfrom regent.actor import context\n") == [
        ("__init__", 1, False), ("__init__", 2, False)]
    assert module_imports("from . import _runtime\nfrom ._shape import Point\n") == [
        ("_runtime", 1, False), ("_shape", 2, False)]


def test_a_circle_within_a_layer_is_reported_unless_one_side_is_type_only() -> None:
    one = [("one", ("a", "b", "c"))]
    graph = {"a": [("b", 1, False)], "b": [("c", 1, False)], "c": [("a", 5, False)]}
    assert violations(graph, one) == ["import circle: a -> b -> c -> a"]
    graph["c"] = [("a", 5, True)]
    assert violations(graph, one) == []


def test_a_module_in_no_layer_is_reported() -> None:
    assert violations({"z": []}, TWO) == ["z: in no layer of LAYERS"]


@pytest.mark.parametrize("module", ["_runtime", "_supervision", "_future"])
def test_the_lower_modules_import_without_the_rest(module: str) -> None:
    """Their imports, followed to the end, stay in their layer or below (what the layers promise)."""
    graph = package_graph()
    where = layer_of(LAYERS)
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(t for t, _line, type_only in graph.get(m, []) if not type_only)
    assert max(where[m] for m in seen) == where[module]
