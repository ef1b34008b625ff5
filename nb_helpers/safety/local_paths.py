"""A name that looks like a path on this machine is never looked up on the Hugging Face Hub.

A model, train_file or eval_file is either a local path or a Hub id (org/name). A typo in a local path
(train_file="data/trian") used to go to the Hub as a dataset: half a minute of network, then a traceback. Here it is
one line with the path that was looked for and, when one is close, the name that was probably meant.
"""

from __future__ import annotations

import difflib
from pathlib import Path

# Files people keep data or weights in; a Hub id never ends this way
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".gz", ".zip", ".safetensors",
                  ".gguf", ".bin")


def looks_local(name: str, resolve) -> bool:
    """Whether `name` is meant as a path here rather than a Hub id: it starts with . / ~, has a backslash or two
    slashes, ends like a data or weights file, or its first part is a local folder ("data/trian" is a typo for
    data/train.jsonl, not the Hub user "data"'s dataset). `resolve` maps a name to its Path."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or name.lower().endswith(LOCAL_SUFFIXES):
        return True
    return "/" in name and resolve(name.split("/", 1)[0]).is_dir()


def missing_path_problem(knob: str, name: str, resolve, kind: str) -> str | None:
    """The problem with a local-looking `name` that does not exist (kind: "file" or "folder"), else None."""
    path = resolve(name)
    if not looks_local(name, resolve) or path.exists():
        return None
    beside = {key: p.name for p in (path.parent.iterdir() if path.parent.is_dir() else []) for key in (p.stem, p.name)}
    near = difflib.get_close_matches(path.name, sorted(beside), n=1, cutoff=0.6)  # "trian" is near train.jsonl's stem
    guess = f"Did you mean {str(Path(name).parent / beside[near[0]])!r}? " if near else ""
    hub = " or a Hub id (org/name)" if kind == "folder" else ""
    return f"{knob}={name!r}: no such {kind} ({path}). {guess}Give an existing path (relative to the project root, " \
           f"or absolute){hub}"
