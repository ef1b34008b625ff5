"""Notebooks read for `clean-notebooks`, which rewrites them in place: a path that is missing, a folder or not a
notebook is one line naming it, found before any file is rewritten (it was a traceback after the first ones)."""

from __future__ import annotations

from pathlib import Path

from nb_helpers.config import ConfigError


def read_notebooks(paths: list[Path]) -> list[tuple[Path, object]]:
    import nbformat

    notebooks = []
    for path in paths:
        try:
            notebooks.append((path, nbformat.read(path, as_version=4)))
        # OSError: missing, a folder; ValueError: not JSON; the others: JSON that is no notebook ('5', '{}')
        except (OSError, ValueError, AttributeError, nbformat.ValidationError) as e:
            what = f"{type(e).__name__}: {e.strerror}" if isinstance(e, OSError) else str(e).splitlines()[0][:200]
            raise ConfigError(f"{path}: cannot read it as a notebook ({what}); give .ipynb files, or no path for "
                              "notebooks/*.ipynb") from None
    return notebooks
