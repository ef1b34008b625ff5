"""Which modules a LoRA config targets, and at what rank: what the adapter check compares a saved adapter against.

peft's own matchers (check_target_module_exists, get_pattern_key) are not its public API. While their check in
nb_helpers.compat passes they answer; otherwise the same rules, as peft 0.21 applies them, answer here, after one line:
target_modules a regex for the whole key or names matching the key or its last parts, exclude_modules and
modules_to_save never targeted, layers_to_transform read from the first layer number, rank_pattern by name."""

from __future__ import annotations

import re
from typing import Callable

from nb_helpers import compat
from nb_helpers.frontend import say_once


def key_matchers(config) -> tuple[Callable[[str], bool], Callable[[str], int]]:
    """(targeted(module key) -> bool, rank(module key) -> int) for a LoraConfig."""
    if why := compat.failure(compat.PEFT_KEYS):
        say_once("compat-adapter-keys", f"[compat] {compat.PEFT_KEYS} changed in peft {compat.version('peft')} "
                                        f"({why}); the adapter check matches keys by the rules peft 0.21 applies")
        return (lambda key: targeted(config, key)), (lambda key: config.rank_pattern.get(
            pattern_key(config.rank_pattern, key), config.r))
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    return (lambda key: bool(check_target_module_exists(config, key))), (lambda key: config.rank_pattern.get(
        get_pattern_key(config.rank_pattern.keys(), key), config.r))


def _names(spec, key: str) -> bool:
    """A string is a regex for the whole key; a list of names matches the key itself or its last parts."""
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith(f".{name}") for name in spec)


def targeted(config, key: str) -> bool:
    """check_target_module_exists's rules (peft 0.21) for the adapter check's use: a bool."""
    if getattr(config, "exclude_modules", None) and _names(config.exclude_modules, key):
        return False
    if any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in getattr(config, "modules_to_save", None) or ()):
        return False
    targets = config.target_modules
    if targets is None or not _names(targets, key):
        return False
    if isinstance(targets, str) or key in targets:
        return True
    layers, patterns = getattr(config, "layers_to_transform", None), getattr(config, "layers_pattern", None)
    if layers is None or layers == []:
        return True
    patterns = [patterns] if isinstance(patterns, str) else patterns or []
    found = [re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key) for p in patterns] or [
        re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)]  # the first layer number: not a nested (expert) index
    index = next((int(m["idx"]) for m in found if m), None)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def pattern_key(patterns, key: str) -> str:
    """get_pattern_key's rule: the first pattern that matches the key's end (at a dot), else the key itself."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), key)
