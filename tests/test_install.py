"""`pip install .` gives a package that imports and runs, without the source tree.

The wheel is built from a copy of the source tree (pyproject.toml, README.md, nb_helpers/): an in-tree build would
write build/ and nb_helpers.egg-info/ into the project, and setuptools packs whatever an earlier build left in
build/lib, modules since removed included. The wheel must list every folder of nb_helpers/ holding an __init__.py and
the planner's shapes. It is installed, with --no-deps --no-index (no network), into a fresh virtual environment whose
site-packages reaches the pinned stack through a .pth file naming this interpreter's site-packages. That directory
also holds the project's editable install (__editable__*.pth and its finder); a path line in a .pth adds the
directory to sys.path but runs none of its .pth files, so the editable finder stays off, which the test checks. From
a folder outside the source tree, under `python -I` (no PYTHONPATH, no user site, no current directory on sys.path),
every module of the installed package imports, nb_helpers comes from the fresh environment, and `python -m nb_helpers
--help` and `plan` on a shipped shape (no hub, no download) run.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from nb_helpers.config import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "nb_helpers"
SHAPE = "qwen3-0.6b"  # one of nb_helpers/plan/shapes/*.json: `plan` reads its config.json, no hub needed
GPU_ONLY = {"triton"}  # a module may fail to import for lack of these alone, and only where they are not installed


def subpackages_on_disk() -> set[str]:
    return {".".join(p.parent.relative_to(PROJECT_ROOT).parts) for p in PACKAGE.rglob("__init__.py")
            if "__pycache__" not in p.parts}


def source_copy(dest: Path) -> Path:
    """What the build reads: pyproject.toml, README.md (the project's readme) and nb_helpers/, without bytecode."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(PROJECT_ROOT / name, dest / name)
    shutil.copytree(PACKAGE, dest / "nb_helpers", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def run(args, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    assert out.returncode == 0, f"{' '.join(map(str, args))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def clean_env() -> dict:
    """No PYTHONPATH, no virtual environment of ours, no pip configuration that could reach an index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    return {**env, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1"}


def build_wheel(tmp: Path) -> Path:
    import importlib.util

    assert importlib.util.find_spec("setuptools"), "setuptools is not installed here: pip cannot build the wheel"
    src, dist = source_copy(tmp / "src"), tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
         str(dist), str(src)], cwd=src, env=clean_env())
    wheels = list(dist.glob("nb_helpers-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def fresh_venv(tmp: Path, wheel: Path) -> tuple[Path, Path]:
    """(its python, its site-packages): the wheel installed, then the pinned stack reachable through a .pth file.
    The .pth comes after the install, so pip never sees the project's own editable nb_helpers there."""
    from importlib.metadata import version

    root, ours = tmp / "venv", tuple(int(x) for x in version("pip").split(".")[:2]) >= (22, 3)
    venv.EnvBuilder(with_pip=not ours).create(root)  # pip 22.3 installs into another interpreter (--python)
    python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    pip = [sys.executable, "-m", "pip", "--python", str(python)] if ours else [str(python), "-m", "pip"]
    run([*pip, "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=tmp, env=clean_env())
    site = Path(run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp, env=clean_env()).stdout.strip())
    assert site.is_relative_to(root), site
    (site / "pinned_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    return python, site


IMPORT_ALL = """
import importlib, importlib.util, json, pkgutil, sys
import nb_helpers
imported, gpu_only = ["nb_helpers"], {}
for info in pkgutil.walk_packages(nb_helpers.__path__, "nb_helpers."):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        continue  # the command line itself, run below
    try:
        importlib.import_module(info.name)
        imported.append(info.name)
    except ModuleNotFoundError as e:
        if e.name not in GPU_ONLY or importlib.util.find_spec(e.name) is not None:
            raise
        gpu_only[info.name] = e.name
print(json.dumps({"file": nb_helpers.__file__, "imported": imported, "gpu_only": gpu_only,
                  "editable": sorted(m for m in sys.modules if "editable" in m),
                  "finders": [getattr(f, "__module__", "") for f in sys.meta_path]}))
"""


def test_the_wheel_installs_a_package_that_imports_and_runs(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    packaged = {".".join(Path(n).parent.parts) for n in names if n.endswith("/__init__.py")}
    missing = subpackages_on_disk() - packaged
    assert not missing, f"{wheel.name} lacks {sorted(missing)}: pyproject.toml's package list misses them"
    shapes = {Path(n).name for n in names if n.startswith("nb_helpers/plan/shapes/") and n.endswith(".json")}
    assert shapes == {p.name for p in (PACKAGE / "plan" / "shapes").glob("*.json")} and f"{SHAPE}.json" in shapes

    python, site = fresh_venv(tmp_path, wheel)
    env, work = clean_env(), tmp_path / "elsewhere"
    work.mkdir()
    code = f"GPU_ONLY = {sorted(GPU_ONLY)!r}\n{IMPORT_ALL}"
    found = json.loads(run([str(python), "-I", "-c", code], cwd=work, env=env).stdout.strip().splitlines()[-1])
    assert Path(found["file"]).resolve() == (site / "nb_helpers" / "__init__.py").resolve(), found["file"]
    assert not found["editable"] and not any("editable" in f for f in found["finders"]), found
    modules = {".".join(p.relative_to(PROJECT_ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and p.stem != "__main__"}
    assert set(found["imported"]) | set(found["gpu_only"]) == modules, "the installed modules are not the tree's"
    assert {"nb_helpers.compat", "nb_helpers.cli", "nb_helpers.training", "nb_helpers.fast.fused_lora"} <= set(
        found["imported"])

    help_out = run([str(python), "-I", "-m", "nb_helpers", "--help"], cwd=work, env=env).stdout
    assert help_out.startswith("usage: python -m nb_helpers") and "plan" in help_out and "train" in help_out
    shape = site / "nb_helpers" / "plan" / "shapes" / f"{SHAPE}.json"
    plan = subprocess.run([str(python), "-I", "-m", "nb_helpers", "plan", "--model", str(shape)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert plan.stdout.startswith(f"model {SHAPE}: Qwen3: 28 layers"), plan.stdout
    assert "predicted peak:" in plan.stdout and "fits)" in plan.stdout, plan.stdout
    script = python.parent / ("nb-helpers.exe" if os.name == "nt" else "nb-helpers")
    assert run([str(script), "--help"], cwd=work, env=env).stdout == help_out  # the console script pyproject names


def test_the_wheel_check_notices_a_missing_subpackage():
    packaged = {"nb_helpers", "nb_helpers.fast", "nb_helpers.plan", "nb_helpers.ui"}  # the old hand-kept list
    assert {"nb_helpers.compat"} <= subpackages_on_disk() - packaged
    assert pytest.importorskip("tomllib").loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"] == ["nb_helpers*"]
