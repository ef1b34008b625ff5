"""The package's shape: no module imports another that imports it back (lazy imports inside functions count too)."""

import ast

from nb_helpers.config import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "nb_helpers"


def internal_imports(source: str, modules: set[str]) -> set[str]:
    """The nb_helpers modules a module's source imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            relative = node.level == 1
            absolute = (node.module or "").split(".")[0] == "nb_helpers"
            if not (relative or absolute):
                continue
            parts = (node.module or "").split(".")[(0 if relative else 1):]
            found |= {parts[0]} if parts and parts[0] else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("nb_helpers.")}
    return found & modules


def import_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {p.stem: internal_imports(p.read_text(encoding="utf-8"), modules) - {p.stem} for p in PACKAGE.glob("*.py")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"memory": {"metrics"}, "metrics": {"memory"}}) == ["memory", "metrics", "memory"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    lazy = "def f():\n    from .memory import enforce_budget\nfrom . import metrics\nimport nb_helpers.runs\n"
    assert internal_imports(lazy, {"memory", "metrics", "runs", "config"}) == {"memory", "metrics", "runs"}


def test_nb_helpers_has_no_import_cycles():
    graph = import_graph()
    assert {"training", "memory", "metrics", "summary"} <= set(graph)  # the scan sees the package
    assert "memory" in graph["metrics"]  # and the imports inside it
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; move what both need into one module"
