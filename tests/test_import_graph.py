"""lmc's modules import one way: no module imports, anywhere in it (inside functions and under
TYPE_CHECKING included), a module that imports it back, however long the way round."""

from __future__ import annotations

import ast
from pathlib import Path

import lmc

ROOT = Path(lmc.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    return modules


def import_graph() -> dict[str, set[str]]:
    """{module: the lmc modules it names in an import statement, wherever that statement is}. `from a
    import b` counts as a.b when that is a module, else as a. A package's __init__ running before its
    submodules is not counted as an edge (every submodule would otherwise close a cycle with a package
    that imports it)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            edges.update(target for target in map(known, (t for t in targets if t.split(".")[0] == "lmc")) if target)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_of_lmc_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_imports_inside_functions_and_under_type_checking():
    graph = import_graph()
    # Known edges of each kind, so a parser that missed them could not pass the test above by accident.
    assert "lmc.runtime.scheduler" in graph["lmc.runtime.core"]  # inside Runtime.__init__
    assert "lmc.runtime.engines.hf" in graph["lmc.runtime.engines"]  # inside create_engine
    assert "lmc.runtime.core" in graph["lmc.runtime.openai_api"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_routes_never_import_the_app():
    graph = import_graph()
    for route_module in ("lmc.runtime.lmi_api", "lmc.runtime.openai_api", "lmc.runtime.core", "lmc.runtime.jobs",
                         "lmc.runtime.scheduler"):
        assert "lmc.runtime.server" not in graph[route_module], route_module
