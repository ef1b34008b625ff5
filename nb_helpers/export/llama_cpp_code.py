"""llama.cpp's own conversion scripts, matched to the llama.cpp that runs the files.

llama.cpp decides what a GGUF says: tensor names and layouts per architecture, hyperparameters, and which
pre-tokenizer splits the text (`convert_hf_to_gguf.py` hashes the tokenizer's output on a fixed text and looks the
hash up in its own table). The course does not keep a copy of those decisions: it runs llama.cpp's scripts. They are
not in llama-cpp-python's wheel, but its source archive on PyPI vendors the llama.cpp it was built from, scripts and
`gguf-py` included. The first export downloads that archive (`pip download`, from pip's cache where the wheel was
built on this machine) and keeps only the scripts (about 2 MB) under .cache/.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from nb_helpers.export.errors import ExportError

LLAMA_CPP_PYTHON = "0.3.36"  # the version requirements-test.txt pins: the scripts must match the runtime's llama.cpp
SCRIPTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
NEEDED = (*SCRIPTS, "conversion/", "gguf-py/", "LICENSE")  # what the scripts import, and llama.cpp's MIT licence
_VENDORED = "vendor/llama.cpp/"


def runtime_version() -> str | None:
    """llama-cpp-python's version where it is installed, else None."""
    try:
        from importlib.metadata import version

        return version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or a broken install: treated as not installed
        return None


def scripts_dir(log=print) -> Path:
    """The folder holding convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/ and gguf-py/.

    $LLAMA_CPP_DIR, when set, names a llama.cpp checkout to use instead (it must match the llama.cpp that will run
    the files). Otherwise they come from the source archive of the installed llama-cpp-python (or of the pinned
    version when none is installed), once."""
    if os.environ.get("LLAMA_CPP_DIR"):
        folder = Path(os.environ["LLAMA_CPP_DIR"])
        if not (folder / SCRIPTS[0]).is_file():
            raise ExportError(f"LLAMA_CPP_DIR={folder}: no {SCRIPTS[0]} there; point it at a llama.cpp checkout, or "
                              "unset it to use the scripts of the installed llama-cpp-python")
        return folder
    from nb_helpers.models import cache_dir, cache_entry

    version = runtime_version() or LLAMA_CPP_PYTHON
    folder = cache_dir() / f"llama.cpp-scripts-{version}"
    if not (folder / SCRIPTS[0]).is_file():
        log(f"[export] llama.cpp's conversion scripts: taken once from llama-cpp-python {version}'s source archive "
            f"(PyPI) into {folder}")
        with cache_entry(folder) as partial, source_archive(version) as archive:
            _extract(archive, partial)
    return folder


@contextlib.contextmanager
def source_archive(version: str):
    """llama-cpp-python's source archive from PyPI, in a temporary folder that goes, archive and all, when the block
    ends (also when the download or what reads it fails)."""
    with tempfile.TemporaryDirectory(prefix="llama-cpp-python-") as tmp:
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                                  "-d", tmp, f"llama-cpp-python=={version}"], capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if fetched.returncode != 0 or not archives:
            raise ExportError(f"pip could not download llama-cpp-python {version}'s source archive, which holds "
                              f"llama.cpp's conversion scripts:\n{fetched.stderr.strip()[-1500:]}\nFix: check that "
                              "PyPI answers, or set LLAMA_CPP_DIR to a llama.cpp checkout of the same version")
        yield archives[0]


def _extract(archive: Path, folder: Path) -> None:
    """Only the vendored scripts, gguf-py and the licence, into `folder` (a cache entry: complete or absent)."""
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            inner = member.name.split(_VENDORED, 1)[-1] if _VENDORED in member.name else None
            if inner and any(inner == n or (n.endswith("/") and inner.startswith(n)) for n in NEEDED):
                member.name = inner
                members.append(member)
        tar.extractall(folder, members=members, filter="data")  # "data": no links out, no absolute paths
    if not (folder / SCRIPTS[0]).is_file():
        raise ExportError(f"{archive.name} holds no {_VENDORED}{SCRIPTS[0]}: set LLAMA_CPP_DIR to a llama.cpp "
                          "checkout instead")


def run_script(script: str, args: list, log=print) -> str:
    """Run one of llama.cpp's scripts with this Python, offline, on its own gguf-py (it puts its copy first on the
    path: the `gguf` on PyPI may be older than the llama.cpp that reads the file). Returns its log; a failure raises
    ExportError with the script's last lines, which name the problem."""
    folder = scripts_dir(log)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NO_LOCAL_GGUF", None)
    done = subprocess.run([sys.executable, str(folder / script), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=folder)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith(("ERROR:", "WARNING:hf-to-gguf:** chkhsh"))]
        raise ExportError(f"llama.cpp's {script} stopped: {lines[-1] if lines else 'no output'}"
                          + "".join(f"\n  {line}" for line in said[-3:]))
    return output
