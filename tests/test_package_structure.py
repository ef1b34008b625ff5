"""The package's shape, checked over every module at any depth (imports inside functions count too, those under
`if TYPE_CHECKING:` do not: Python never runs them):

  * layers only point down: every module has a place in LAYERS, and no import goes from a lower layer to a higher one;
  * no import cycles;
  * functions short enough to read in one screen: <= 60 lines.
"""

import ast

import pytest

from nb_helpers.config import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "nb_helpers"
ROOT = "__init__"  # nb_helpers/__init__.py, which runs before any module of the package
MAX_FUNCTION_LINES = 60

# The house, bottom to top. A module may import its own layer and those below it, never one above. "x.*" places every
# module under package x. docs/layout.md names the same layers.
LAYERS = {
    # 0 base: what everything may use
    "frontend": 0, "hub": 0, "compat": 0, "compat.*": 0,
    # 1 plan: what will run and whether it fits: arithmetic over shapes, cards and dtypes, no model loaded. It defines
    # what it needs from an engine (plan.engine) and never imports one
    "plan": 1, "plan.*": 1,
    # 2 engine: the GPU fast path, a plugin (fast_path=False trains without it); it describes itself to the planner
    "fast": 2, "fast.*": 2,
    # The package's __init__ runs first, whichever module is imported: it may use the base and register the engine
    # with the planner (fast.plan_terms imports no torch), nothing above
    ROOT: 2,
    # 3 config: the one config object and its validation
    "config": 3,
    # 4 course: what the notebooks call, and the fault handling a run needs
    "environment": 4, "models": 4, "lora": 4, "data": 4, "distributed": 4, "metrics": 4, "runs": 4, "summary": 4,
    "task_metric": 4, "trainer_setup": 4, "recovery": 4, "export": 4, "course": 4, "autofit": 4, "preflight": 4,
    "faults": 4, "faults.*": 4, "pairs": 4, "export.*": 4,
    # 5 app: the entry points that compose the course: training's steps, the command line, the notebooks' widgets
    "training": 5, "dpo": 5, "cli": 5, "plan_command": 5, "__main__": 5, "ui": 5, "ui.*": 5,
}


def module_name(path) -> str:
    """nb_helpers/fast/options.py -> "fast.options"; nb_helpers/fast/__init__.py -> "fast"; nb_helpers/__init__.py
    -> ROOT."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or ROOT


def modules() -> dict[str, object]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(importer: str, node: ast.ImportFrom, known: set[str]) -> set[str]:
    """The package modules one `from ... import ...` reaches: a submodule named in it, else the module itself."""
    if node.level:  # relative: a module's package is its parent; a package (an __init__) is its own
        parts = importer.split(".") if is_package(importer) else importer.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, *(node.module.split(".") if node.module else [])])
    elif (node.module or "").split(".")[0] == "nb_helpers":
        base = ".".join(node.module.split(".")[1:])
    else:
        return set()
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        found.add(sub if sub in known else base)
    return found - {""}  # names the package's __init__ defines (__version__): importing nb_helpers runs it anyway


def is_package(name: str) -> bool:
    return (PACKAGE / name.replace(".", "/") / "__init__.py").exists()


def runtime_nodes(tree):
    """Every node but those under `if TYPE_CHECKING:`, which type checkers read and Python never runs."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def internal_imports(source: str, importer: str, known: set[str]) -> set[str]:
    found = set()
    for node in runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found |= resolve(importer, node, known)
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("nb_helpers.")}
    return {name for name in found if name in known} - {importer}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: internal_imports(path.read_text(encoding="utf-8"), name, set(mods)) for name, path in mods.items()}


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


def layer_of(name: str, layers: dict[str, int]) -> int | None:
    """The module's own entry, else its nearest package's "x.*"; None when it has no place."""
    if name in layers:
        return layers[name]
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if (wildcard := ".".join(parts[:end]) + ".*") in layers:
            return layers[wildcard]
    return None


def upward_edges(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Each import from a lower layer to a higher one, as "importer (layer) -> imported (layer)"."""
    edges = []
    for importer, imported in sorted(graph.items()):
        low = layer_of(importer, layers)
        for name in sorted(imported):
            high = layer_of(name, layers)
            if None not in (low, high) and high > low:
                edges.append(f"{importer} ({low}) -> {name} ({high})")
    return edges


def test_the_checks_find_what_they_look_for():
    assert find_cycle({"memory": {"metrics"}, "metrics": {"memory"}}) == ["memory", "metrics", "memory"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    known = {"memory", "metrics", "runs", "config", "fast", "fast.options", "plan.planner"}
    lazy = ("def f():\n    from .memory import enforce_budget\nfrom nb_helpers import metrics\nimport nb_helpers.runs\n"
            "from nb_helpers.fast import options, FastOptions\nfrom nb_helpers.plan.planner import plan\n"
            "if TYPE_CHECKING:\n    from nb_helpers.config import RunConfig\n")
    assert internal_imports(lazy, "training", known) == {"memory", "metrics", "runs", "fast", "fast.options",
                                                         "plan.planner"}


def test_the_layer_check_catches_an_upward_import():
    layers = {"frontend": 0, "plan.*": 1, "fast": 2, "fast.*": 2, "config": 3, "models": 4, "training": 5}
    graph = {"training": {"models", "config", "fast"}, "models": {"config", "fast", "frontend"},
             "config": {"plan.cards", "models"},  # config -> models goes up: 3 -> 4
             "fast.kernels": {"fast", "plan.cards"}, "plan.cards": {"training"},  # and plan.cards -> training: 1 -> 5
             "frontend": set()}
    assert upward_edges(graph, layers) == ["config (3) -> models (4)", "plan.cards (1) -> training (5)"]
    assert layer_of("fast.kernels", layers) == 2 and layer_of("fast", layers) == 2
    assert layer_of("plan", layers) is None and layer_of("ui.widgets", layers) is None  # unplaced: reported below
    assert upward_edges({"training": {"models"}}, layers) == []


def test_every_module_has_a_layer():
    graph = import_graph()
    assert {ROOT, "__main__", "training", "fast", "fast.options", "plan.planner", "ui.widgets"} <= set(graph)
    unplaced = sorted(name for name in graph if layer_of(name, LAYERS) is None)
    assert not unplaced, (f"modules with no layer: {unplaced}; place each in LAYERS (tests/test_package_structure.py) "
                          "at the layer of what it is, and in docs/layout.md")


def test_imports_only_point_down():
    graph = import_graph()
    assert "plan.memory" in graph["metrics"] and "fast" in graph["training"]  # the scan sees imports inside modules
    up = upward_edges(graph, LAYERS)
    assert not up, ("imports from a lower layer to a higher one (move the code to the layer that owns it, or what "
                    "both need into a lower module):\n  " + "\n  ".join(up))


def test_nb_helpers_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; move what both need into one module"


def function_lengths(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("name", sorted(modules()))
def test_functions_are_short_enough_to_read(name):
    path = modules()[name]
    long = [(fn, n) for fn, n in function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(PROJECT_ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"
