"""What goes to the Hugging Face Hub, decided before any hub library is imported, and what never goes there.

huggingface_hub reads HF_HUB_OFFLINE once, at its import (into huggingface_hub.constants; transformers and datasets
ask it from there), so setting the variable later changes nothing: a hub id without a network then retries for about
a minute and ends in a chained traceback. `decide_offline` runs from nb_helpers/__init__.py, before any of them is
imported: one quick probe, and offline mode when the Hub does not answer, so a cached model loads at once and an
uncached one gets one line saying so.

A model, train_file or eval_file is either a local path or a Hub id (org/name), and a name that looks like a path on
this machine is never looked up on the Hub. A typo in a local path (train_file="data/trian") used to go to the Hub
as a dataset: half a minute of network, then a traceback. Here it is one line with the path that was looked for and,
when one is close, the name that was probably meant.

Nothing here imports the rest of nb_helpers (the package's __init__ runs decide_offline before anything else): the
checks return the problem as text, and the caller raises it as its own error.
"""

from __future__ import annotations

import difflib
import os
import sys
import urllib.request
from pathlib import Path

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
PROBE_URL = "https://huggingface.co/api/models/TinyLlama/TinyLlama-1.1B-Chat-v1.0"
PROBE_TIMEOUT_S = 3.0
# Files people keep data or weights in; a Hub id never ends this way
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".gz", ".zip", ".safetensors",
                  ".gguf", ".bin")

_decided = {"reason": ""}  # why this process is offline, when nb_helpers decided it


def hub_answers(timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(PROBE_URL, timeout=timeout) as response:
            return response.status < 500
    except Exception:  # noqa: BLE001 - DNS failure, refused, timeout, proxy: all mean "not usable now"
        return False


def decide_offline(probe=hub_answers) -> None:
    """Offline mode when the Hub does not answer, unless the user chose (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set
    to anything, 0 included, is their choice)."""
    if any(name in os.environ for name in OFFLINE_VARS) or probe():
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    _decided["reason"] = f"the Hub ({PROBE_URL.split('/api')[0]}) did not answer within {PROBE_TIMEOUT_S:g} s"
    # imported before nb_helpers (a notebook that imported transformers first): tell them too
    for module in ("huggingface_hub.constants", "datasets.config"):
        if module in sys.modules:
            sys.modules[module].HF_HUB_OFFLINE = True


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def offline_reason() -> str:
    return _decided["reason"] or "HF_HUB_OFFLINE=1 is set"


def uncached_model_problem(name: str, resolve) -> str | None:
    """A Hub model id while offline must already be in the local cache: the problem, said now rather than after
    transformers' retries, else None. `resolve` maps a name to its local Path."""
    from huggingface_hub import try_to_load_from_cache

    if not offline():
        return None
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not even a valid Hub id (HFValidationError)
        cached = False
    if cached:
        return None
    return (f"model={name!r}: no local folder {resolve(name)}, not in the Hugging Face cache, and the Hub is "
            f"offline ({offline_reason()}). Connect to the internet and run again (the model is then "
            "cached), or set model to a local folder (or None for the default model)")


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
