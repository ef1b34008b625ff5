"""Where the code runs decides how it talks to you: a notebook kernel gets widget progress bars and notebook
advice ("set RESUME"), a terminal gets text bars and command lines, and a log file (no terminal) stays quiet."""

from __future__ import annotations

import sys
from pathlib import Path

_SAID: set[str] = set()


def say_once(key: str, message: str) -> None:
    """Print `message` the first time `key` is said in this process: a fallback or a choice is news once, not at
    every model or step."""
    if key not in _SAID:
        _SAID.add(key)
        print(message, flush=True)


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbclient, nbmake), False in a terminal or a script."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def progress_bar(total: int, description: str):
    """A progress bar for long silent work (tqdm): a widget in a notebook, text on an interactive terminal, and
    None where nobody watches (CLI output piped to a file or CI), so logs stay clean. Call .update(n), .close()."""
    fmt = "{desc} {bar} {percentage:3.0f}% [{elapsed} elapsed, {remaining} left]"
    if in_notebook():
        from tqdm.notebook import tqdm

        return tqdm(total=total, desc=description, bar_format=fmt)
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=description, bar_format=fmt, file=sys.stderr)
    return None


def resume_hint(run_dir: Path) -> str:
    """How to continue an interrupted run, in the terms of where it ran."""
    if in_notebook():
        return (f"to continue, set RESUME = {str(run_dir)!r} in notebook 03's \"Check first, then load\" cell and run "
                "the notebook from there (or from a terminal: `python -m nb_helpers train --resume RUN_DIR`)")
    return f"resume with `python -m nb_helpers train --resume {run_dir}`"
