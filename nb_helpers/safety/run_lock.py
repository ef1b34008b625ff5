"""One process per run folder. Two `train --resume` of the same run at once both trained, and metrics.jsonl held
the same steps twice. A run that opens (new or resumed) takes runs/<name>/run.lock, created with O_CREAT | O_EXCL (an
atomic create on every OS, Windows included, unlike fcntl) and holding its PID and host; it is released when the run
finishes, or at the latest when the process exits. A lock whose process is gone (kill -9, a crash, a reboot) is
stale: the next run takes it over and says so. One taken on another host (a shared folder) cannot be checked from
here: it is refused, with the file to delete if nothing trains there. Only rank 0 of a multi-process run takes
it (the other processes write nothing to the folder)."""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path

from nb_helpers import distributed
from nb_helpers.config import ConfigError

LOCK = "run.lock"
FRESH_S = 5  # an empty lock younger than this is being written by its taker, not left by a kill


class RunLocked(ConfigError):
    """Another live process trains this run folder."""


def take_run_lock(run_dir: Path) -> None:
    """Hold `run_dir` for this process, or raise RunLocked naming the process that holds it."""
    if not distributed.is_main():
        return
    path = Path(run_dir) / LOCK
    for _ in range(2):  # the second try follows a stale lock's removal
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = read_holder(path)
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                return  # this process already holds it (a notebook re-running its cells)
            refuse_if_alive(path, holder)
            print(f"[run] {path}: {describe(holder)} no longer runs; taking over its stale lock")
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")},
                      f)
        atexit.register(release_run_lock, run_dir)
        return
    raise RunLocked(f"{path}: another process took this run's lock just now; wait for it to finish")


def release_run_lock(run_dir: Path) -> None:
    """Remove the lock if this process holds it (never another process's)."""
    path = Path(run_dir) / LOCK
    if read_holder(path).get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # missing, or cut short by a kill during its own write: nobody to wait for
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    if not holder:
        return "an unreadable lock (its writer was cut short)"
    return f"process {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')})"


def refuse_if_alive(path: Path, holder: dict) -> None:
    if not holder and age_s(path) < FRESH_S:
        raise RunLocked(f"{path}: another process is taking this run's lock right now; wait for it to finish")
    if not isinstance(holder.get("pid"), int):
        return  # unreadable: nobody to wait for
    if holder.get("host") != socket.gethostname():  # a shared folder: that host may be training it now
        raise RunLocked(f"{path.parent} is held by {describe(holder)}, another machine, which this one cannot "
                        f"check. If no training runs there, delete {path} and start again")
    if pid_alive(holder["pid"]):
        raise RunLocked(f"{path.parent} is being trained by {describe(holder)}: two processes would write the same "
                        f"metrics.jsonl and checkpoints. Wait for it to finish, or stop it (Ctrl-C, or `kill "
                        f"{holder['pid']}`) and resume then. If no training runs there (a notebook kernel that "
                        f"stopped on an error still holds it: restart that kernel), delete {path}")


def age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")  # removed meanwhile: nobody to wait for


def pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process on Windows
        import ctypes

        kernel32 = ctypes.windll.kernel32
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return kernel32.GetLastError() == 5  # access denied: it exists, as another user's
        code = ctypes.c_ulong()
        kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        kernel32.CloseHandle(handle)
        return code.value == 259  # STILL_ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
