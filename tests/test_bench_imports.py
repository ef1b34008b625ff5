"""Every name the bench scripts import from nb_helpers exists: a module moved or renamed in the package fails here,
not on the next lent GPU."""

import ast
import importlib

import pytest

from nb_helpers.config import PROJECT_ROOT

SCRIPTS = sorted((PROJECT_ROOT / "bench").glob("*.py"))


def package_imports(path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("nb_helpers") for alias in node.names]


def test_the_scan_reads_imports():
    found = package_imports(PROJECT_ROOT / "bench" / "throughput.py")
    assert ("nb_helpers.training", "train") in found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports_exist(path):
    for module, name in package_imports(path):
        imported = importlib.import_module(module)
        assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), f"{path.name}: {module}.{name}"
