"""run_name names a folder under runs_dir, nothing else. A name such as "../x" or "/tmp/x" wrote the run anywhere,
and "latest" is the link to the newest run. runs/latest itself is replaced only when it is what the course made: a
symlink, or the one-line text file naming a run that stands in for one where symlinks are not allowed (Windows)."""

from __future__ import annotations

import re
from pathlib import Path

from nb_helpers.config import ConfigError

PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")
RESERVED = {".", "..", "latest"}
MAX_LEN = 100


def check_run_name(name: str | None) -> None:
    """Refuse a run_name that is not a plain folder name, with the fix, before anything loads."""
    if name is None:
        return
    if not isinstance(name, str) or not PLAIN_NAME.fullmatch(name) or name in RESERVED or len(name) > MAX_LEN:
        raise ConfigError(f"run_name={name!r}: use a plain folder name of letters, digits, '.', '_' and '-' (up to "
                          f"{MAX_LEN} characters, not '.', '..' or 'latest'), e.g. run_name='r16-lr1e-4'. The run "
                          "goes under runs_dir; to write runs elsewhere, set runs_dir")


def is_ours(latest: Path) -> bool:
    """runs/latest may be replaced: absent, a symlink, or a small text file holding just a run's name."""
    if latest.is_symlink() or not latest.exists():
        return True
    if not latest.is_file() or latest.stat().st_size > MAX_LEN + 2:
        return False
    try:
        name = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(PLAIN_NAME.fullmatch(name)) and name not in RESERVED
