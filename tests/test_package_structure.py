"""The package's shape, checked over every module at any depth (imports inside functions count too):

  * no import cycles;
  * the course reaches the fast path through its entry point alone (`nb_helpers.fast`), never its modules;
  * the planner (`plan/`) does not import the training code;
  * modules and functions short enough to read: <= 400 lines a module, <= 60 a function;
  * the course outside `fast/`, `plan/`, `compat/` and `safety/` stays a thin layer: under 4,000 lines (like the
    fast path, the fault handling in `safety/` and the checks of other libraries' private APIs in `compat/` are not
    needed to follow the course).
"""

import ast

import pytest

from nb_helpers.config import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "nb_helpers"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_COURSE_LINES = 400, 60, 4000
TRAINING_CODE = {"training", "trainer_setup", "autofit", "recovery", "runs", "metrics", "summary", "task_metric",
                 "export", "cli"}


def module_name(path) -> str:
    """nb_helpers/fast/options.py -> "fast.options"; nb_helpers/fast/__init__.py -> "fast"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, object]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if module_name(p) not in ("", "__main__")}


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
    return found - {""}


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


def test_nb_helpers_has_no_import_cycles():
    graph = import_graph()
    assert {"training", "fast", "fast.options", "plan.planner", "ui.widgets"} <= set(graph)  # the scan sees it all
    assert "plan.memory" in graph["metrics"] and "fast" in graph["training"]  # and the imports inside modules
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; move what both need into one module"


def test_the_course_reaches_the_fast_path_through_its_entry_point_only():
    wrong = {name: sorted(i for i in imports if i.startswith("fast."))
             for name, imports in import_graph().items() if not (name == "fast" or name.startswith("fast."))}
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, f"import nb_helpers.fast (the entry point), not its modules: {wrong}"


def test_the_planner_does_not_import_the_training_code():
    reached = {name: sorted(i for i in imports if i in TRAINING_CODE or i.startswith("ui."))
               for name, imports in import_graph().items() if name.startswith("plan.")}
    assert not {k: v for k, v in reached.items() if v}, reached


def function_lengths(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_and_functions_are_short_enough_to_read(name):
    path = modules()[name]
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PROJECT_ROOT)} has {lines} lines; split it by concept"
    long = [(fn, n) for fn, n in function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(PROJECT_ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_course_outside_the_engine_stays_thin():
    engine = ("fast", "plan", "compat", "safety")
    course = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in engine]
    assert PACKAGE / "__init__.py" in course and PACKAGE / "training.py" in course
    total = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in course)
    assert total < MAX_COURSE_LINES, f"{total} lines outside fast/, plan/, compat/ and safety/"
