"""A write that failed: a checkpoint, the adapter, metrics.jsonl, summary.json. Each library reports it its own way:
Python and torch raise OSError with an errno, safetensors a bare `Exception("No space left on device (os error
28)")`, torch's zip writer a RuntimeError ("file write failed") with no errno at all. write_cause reads the errno where
there is one and the message where there is not, so every write failure takes the same way out: the run stops, its
summary says "save failed", the partial checkpoint goes, and the message names the cause and how to resume."""

from __future__ import annotations

import errno
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

from nb_helpers.config import ConfigError
from nb_helpers.frontend import resume_hint

FULL = ("the disk is full", "free some space (`df -h` shows what is left)")
QUOTA = ("your disk quota is used up", "free some space within your quota (`quota -s` shows it)")
READ_ONLY = ("the file system is read-only", "make it writable again, or copy the run folder to a writable disk and "
                                             "resume the copy")
DENIED = ("permission was denied", "make the run folder writable for you (`ls -ld` shows its owner)")
UNKNOWN = ("a file could not be written (most often a full disk)", "check the free space (`df -h`) and that the run "
                                                                   "folder is writable")
BY_ERRNO = {errno.ENOSPC: FULL, getattr(errno, "EDQUOT", -1): QUOTA, errno.EROFS: READ_ONLY, errno.EACCES: DENIED,
            errno.EPERM: DENIED}
BY_MESSAGE = (("no space left", FULL), ("disk quota", QUOTA), ("read-only file system", READ_ONLY),
              ("permission denied", DENIED), ("file write failed", UNKNOWN))
OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")  # how Rust (safetensors, tokenizers) prints an errno


class WriteFailed(ConfigError, RuntimeError):
    """A ConfigError, so that the command line prints the message alone (no traceback); a RuntimeError, as the
    course raised before it told write failures apart."""


def write_cause(error: BaseException) -> tuple[str, str] | None:
    """(cause, fix) when `error`, or one it was raised from, is a failed write; None for any other error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in BY_ERRNO:
            return BY_ERRNO[error.errno]
        number = OS_ERROR_NUMBER.search(str(error))
        if number and int(number.group(1)) in BY_ERRNO:
            return BY_ERRNO[int(number.group(1))]
        text = str(error).lower()
        found = next((cause for words, cause in BY_MESSAGE if words in text), None)
        if found:
            return found
        error = error.__cause__ or error.__context__
    return None


def advice(run_dir: Path, error: BaseException, what: str) -> str:
    """What failed, why, what is still safe, and how to go on: resume from the last complete checkpoint."""
    from nb_helpers.faults.checkpoints import newest_complete

    cause, fix = write_cause(error) or UNKNOWN
    last = newest_complete(Path(run_dir) / "checkpoints")[0]
    kept = f"the last complete checkpoint ({last.name}) is intact" if last else "no checkpoint was complete yet"
    then = resume_hint(run_dir) if last else "start the run again"
    said = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    return (f"could not save {what} in {run_dir}: {cause} ({said}). Nothing already saved was touched: {kept}, and "
            f"metrics.jsonl keeps every finished step. To go on, {fix}; then {then}.")


def as_write_failure(error: BaseException, run_dir: Path, what: str) -> BaseException:
    """A WriteFailed with the advice when `error` is a failed write, else `error` itself (raise it unchanged)."""
    if isinstance(error, WriteFailed) or write_cause(error) is None:
        return error
    failure = WriteFailed(advice(run_dir, error, what))
    failure.__cause__ = error
    return failure


@contextmanager
def stop_cleanly(run, what: str):
    """Around the run's writes: a failed write ends the run with summary.json marked "save failed" and no partial
    checkpoint left (resume takes the last complete one), then raises WriteFailed with the advice."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - what a library raises for a failed write varies (module docstring)
        failure = as_write_failure(error, run.run_dir, what)
        if not isinstance(failure, WriteFailed):
            raise
        mark_save_failed(run)
        raise failure from failure.__cause__


def mark_save_failed(run) -> None:
    from nb_helpers import distributed
    from nb_helpers.faults.checkpoints import discard_staged
    from nb_helpers.summary import write_summary

    try:
        run.metrics.close()
    except OSError:
        pass  # its last line may be torn; a resume moves it aside (nb_helpers.metrics)
    if not distributed.is_main():
        return
    discard_staged(run.run_dir / "checkpoints")
    try:
        write_summary(run.run_dir, run.choice.name, {**run.summary, "status": "save failed"})
    except Exception as again:  # noqa: BLE001 - the disk that failed the first write may fail this one too
        if write_cause(again) is None:
            raise
        print(f"[run] summary.json could not be written either ({again})")


def check_writable(cfg, resume_dir: Path | None = None) -> None:
    """Before the model loads: a folder the run cannot write into (runs_dir, or the run folder it resumes) is found
    now, not after minutes of loading."""
    folder = Path(resume_dir) if resume_dir else cfg.resolve_path(cfg.runs_dir)
    knob, fix = (("--resume", "copy the run folder to a disk you can write and resume the copy") if resume_dir else
                 ("runs_dir", "set runs_dir to a folder you can write (--set runs_dir=PATH, or cfg.runs_dir = PATH "
                              "in a notebook)"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".write-check-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        cause = (write_cause(error) or (error.strerror or str(error),))[0]
        raise ConfigError(f"{knob}={str(folder)!r}: the run cannot write there ({cause}); {fix}") from None
