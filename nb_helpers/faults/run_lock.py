"""One process per run folder. Two `train --resume` of the same run at once both trained, and metrics.jsonl held
the same steps twice. A run that opens (new or resumed) takes runs/<name>/run.lock, an operating-system lock (the
filelock library: flock, LockFileEx on Windows) that the OS lets go of when the process ends, however it ends: a lock
whose process is gone (kill -9, a crash, a reboot) is stale and never blocks; the next run takes it over and says so.
The file holds the holder's PID and host, for the message a second process gets; it is released and removed when the
run finishes, or at the latest when the process exits. One whose file names another host (a shared folder, where not
every file system shares locks between machines) is refused, with the file to delete if nothing trains there. Only
rank 0 of a multi-process run takes it (the other processes write nothing to the folder)."""

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
_held: dict[Path, object] = {}  # lock file -> the FileLock this process holds on it


class RunLocked(ConfigError):
    """Another live process trains this run folder."""


def take_run_lock(run_dir: Path) -> None:
    """Hold `run_dir` for this process, or raise RunLocked naming the process that holds it."""
    from filelock import FileLock, Timeout

    if not distributed.is_main():
        return
    path = Path(run_dir) / LOCK
    if path.absolute() in _held:
        return  # this process already holds it (a notebook re-running its cells)
    claimed = []

    def on_acquired(handle: int) -> None:
        claim(path, handle)
        claimed.append(handle)

    # thread_local=False: held by the process, whichever thread releases it (atexit, a notebook's other cell)
    lock = FileLock(path, thread_local=False, on_acquired=on_acquired)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        raise RunLocked(held_message(path, read_holder(path))) from None
    if not claimed:
        note_unclaimed(path)
    _held[path.absolute()] = lock
    atexit.register(release_run_lock, run_dir)


def claim(path: Path, handle: int) -> None:
    """Run by filelock once this process holds the OS lock, before anything else can: the file's old content is a
    stale holder's (say so; said of this very process only by a copied run folder) or another host's (refuse: its
    lock may not reach this machine); then write ours."""
    os.lseek(handle, 0, os.SEEK_SET)
    old = os.read(handle, 4096)
    holder = parse_holder(old)
    if isinstance(holder.get("pid"), int) and holder.get("host") != socket.gethostname():
        raise RunLocked(other_host_message(path, holder))
    if old.strip() and (holder.get("pid"), holder.get("host")) != (os.getpid(), socket.gethostname()):
        print(f"[run] {path}: {describe(holder)} no longer runs; taking over its stale lock")
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(handle, 0)
    os.lseek(handle, 0, os.SEEK_SET)
    # after a newline: Windows locks the file's first byte, which another process then cannot read (read_holder)
    os.write(handle, b"\n" + json.dumps(mine).encode("utf-8"))


def note_unclaimed(path: Path) -> None:
    """filelock before 3.30 (pyproject's floor, which pip meets; an install with --no-deps beside a torch image's older
    copy does not) ignores on_acquired without a word, and truncates the lock file on every attempt, so no record of
    the holder can be kept: the OS lock still keeps a second process out. Say so, once per run."""
    from importlib import metadata

    print(f"[run] filelock {metadata.version('filelock')} predates 3.30: {path} keeps a second process out but cannot "
          f"name its holder or report a stale one. Fix: pip install 'filelock>=3.30'")


def release_run_lock(run_dir: Path) -> None:
    """Remove the lock file and let go of the lock, if this process holds it (never another process's)."""
    path = Path(run_dir) / LOCK
    lock = _held.pop(path.absolute(), None)
    if lock is None:
        return
    path.unlink(missing_ok=True)  # before letting go: whoever takes the lock next makes a new file
    lock.release()


def read_holder(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            try:
                return parse_holder(f.read())
            except OSError:  # Windows: the holder locks the first byte, a newline; its record follows
                f.seek(1)
                return parse_holder(f.read())
    except OSError:
        return {}  # removed meanwhile: nobody to name


def parse_holder(raw: bytes) -> dict:
    try:
        holder = json.loads(raw.decode("utf-8"))
    except ValueError:
        return {}  # empty, or cut short by a kill during its own write
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    if not holder:
        return "an unreadable lock (its writer was cut short)"
    return f"process {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')})"


def other_host_message(path: Path, holder: dict) -> str:
    return (f"{path.parent} is held by {describe(holder)}, another machine, which this one cannot check. If no "
            f"training runs there, delete {path} and start again")


def held_message(path: Path, holder: dict) -> str:
    """What a second process hears while the lock is held."""
    if not isinstance(holder.get("pid"), int):
        return f"{path}: another process is taking this run's lock right now; wait for it to finish"
    if holder.get("host") != socket.gethostname():
        return other_host_message(path, holder)
    return (f"{path.parent} is being trained by {describe(holder)}: two processes would write the same metrics.jsonl "
            f"and checkpoints. Wait for it to finish, or stop it (Ctrl-C, or `kill {holder['pid']}`) and resume "
            f"then. If no training runs there (a notebook kernel that stopped on an error still holds it: restart that "
            f"kernel), delete {path}")
