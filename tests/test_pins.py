"""The pinned stack is the tested stack: each path's requirements file names the versions its tests and benchmarks ran
on, this machine runs them, and pyproject.toml's bounds admit them."""

import importlib.metadata as md
import json
import re

import pytest

from packaging.requirements import Requirement
from packaging.version import Version

from nb_helpers.config import PROJECT_ROOT

CORE = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets")


def pins(name: str) -> dict[str, str]:
    """package -> pinned version, following `-r other.txt` lines."""
    found = {}
    for line in (PROJECT_ROOT / name).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            found.update(pins(line[3:].strip()))
        elif "==" in line:
            package, version = line.split("==")
            found[package.strip().lower()] = version.strip()
    return found


def base(version: str) -> str:
    return re.sub(r"\+.*", "", version)  # 2.11.0+cu130 is torch 2.11.0


def test_the_gpu_pins_are_what_the_committed_gpu_results_ran_on():
    ran = json.loads((PROJECT_ROOT / "bench" / "results" / "latest.json").read_text())["throughput"]["versions"]
    gpu = pins("requirements-gpu.txt")
    differ = {p: (gpu.get(p), base(ran[p])) for p in (*CORE, "liger-kernel") if ran.get(p) and gpu.get(p) != base(ran[p])}
    assert ran["torch"] and not differ, f"requirements-gpu.txt pins against bench/results/latest.json's: {differ}"


def test_this_machine_runs_its_paths_pins():
    import torch

    path = "requirements-gpu.txt" if torch.cuda.is_available() else "requirements.txt"
    pinned = pins(path)
    differ = {p: (pinned[p], base(md.version(p))) for p in CORE if p in pinned and base(md.version(p)) != pinned[p]}
    assert not differ, f"installed against {path}: {differ}; `make setup` installs the pins"


def test_pyproject_bounds_admit_every_pinned_version():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    needs = {Requirement(r).name.lower(): Requirement(r).specifier
             for r in tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for path in ("requirements.txt", "requirements-gpu.txt"):
        for package, version in pins(path).items():
            if package in needs:
                assert Version(version) in needs[package], (path, package, version, str(needs[package]))
    assert needs["torch"] and needs["transformers"]  # the bounds are there at all
