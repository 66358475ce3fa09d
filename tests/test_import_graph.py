"""The import graph of the project's packages: every import counted, lazy ones inside functions too (a cycle
hidden behind a lazy import is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "server", "training", "benchmarks")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The module names an import statement may load: the module, and each name as a submodule."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target, *(f"{target}.{alias.name}" for alias in node.names)]


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= {t for t in imported(name, path, node) if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (popped := stack.pop()) != node:
                component.append(popped)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_finds_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_training_imports_nothing_from_the_server():
    """training/ borrows the server's parts only as handed in by rnnserve_cli.py (training/completions.py's
    EvalParts): an import of server/ from it would tie training to the HTTP product."""
    graph = import_graph()
    reaching = {
        m: sorted(t for t in targets if t.split(".")[0] == "server")
        for m, targets in graph.items()
        if m.split(".")[0] == "training"
    }
    assert not {m: t for m, t in reaching.items() if t}, reaching


def test_the_engine_imports_neither_the_http_layer_nor_the_drain():
    """server/engine/ runs models and hands out events; HTTP (server/api/: status codes, request state) and the
    server's drain sit above it and call into it, never the other way round."""
    graph = import_graph()
    above = ("server.api", "server.drain")
    reaching = {
        m: sorted(t for t in targets if any(t == a or t.startswith(f"{a}.") for a in above))
        for m, targets in graph.items()
        if m == "server.engine" or m.startswith("server.engine.")
    }
    assert not {m: t for m, t in reaching.items() if t}, {m: t for m, t in reaching.items() if t}


def test_the_layer_check_sees_an_import_from_above():
    """The walk counts an engine module's lazy import of the HTTP layer (so the check above can fail)."""
    source = "def handler():\n    from server.api.errors import APIError\n"
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom))
    assert "server.api.errors" in imported("server.engine.registry", ROOT / "server/engine/registry.py", node)
