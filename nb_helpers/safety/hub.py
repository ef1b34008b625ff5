"""What goes to the Hugging Face Hub, decided before any hub library is imported.

huggingface_hub reads HF_HUB_OFFLINE once, at its import (into huggingface_hub.constants; transformers and datasets
ask it from there), so setting the variable later changes nothing: a hub id without a network then retries for about
a minute and ends in a chained traceback. `decide_offline` runs from nb_helpers/__init__.py, before any of them is
imported: one quick probe, and offline mode when the Hub does not answer, so a cached model loads at once and an
uncached one gets one line saying so. (Names that look like local paths never go to the Hub: local_paths.py.)
"""

from __future__ import annotations

import os
import sys
import urllib.request

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
PROBE_URL = "https://huggingface.co/api/models/TinyLlama/TinyLlama-1.1B-Chat-v1.0"
PROBE_TIMEOUT_S = 3.0

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


def require_cached_model(name: str, resolve) -> None:
    """A Hub model id while offline must already be in the local cache: say so now, not after transformers' retries."""
    from huggingface_hub import try_to_load_from_cache

    if not offline():
        return
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not even a valid Hub id (HFValidationError)
        cached = False
    if cached:
        return
    from nb_helpers.config import ConfigError

    raise ConfigError(f"model={name!r}: no local folder {resolve(name)}, not in the Hugging Face cache, and the Hub is "
                      f"offline ({offline_reason()}). Connect to the internet and run again (the model is then "
                      "cached), or set model to a local folder (or None for the default model)")
