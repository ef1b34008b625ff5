"""Every RunConfig knob checked for type, range and finiteness before anything loads (RunConfig.validate asks here).

The types come from the dataclass annotations, so a knob added later is type-checked with no entry here; RANGES holds
what a value of the right type must also satisfy. Unchecked, a wrong type crashed (lora_r="abc": a TypeError
traceback) or, worse, passed: lora_r=true trained r=1, target_modules="q_proj" became the layers q, _, p, r, o, j,
max_grad_norm=NaN turned clipping off, a negative max_train_samples dropped rows silently, and NaN, 8.5 or an
unknown scheduler crashed only after the model had loaded. Every problem is listed at once, each with the knob, the
value and a fix, so a config file with three mistakes costs one try, not three.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing

from nb_helpers.plan.cards import CARDS, find_card
from nb_helpers.safety.local_paths import missing_path_problem

OPTIMIZERS = {"paged_adamw_8bit", "adamw_8bit", "paged_adamw_32bit", "adamw_torch", "adamw_torch_fused", "sgd"}
COMPUTE_DTYPES = {"auto", "bfloat16", "float16", "float32"}
# Schedulers checked without importing transformers (seconds); any other name is looked up in its SchedulerType
COMMON_SCHEDULERS = {"linear", "cosine", "constant", "constant_with_warmup"}
EXPECTED = {bool: "true/false", int: "a whole number", float: "a finite number", str: "a string"}


@functools.lru_cache(maxsize=1)
def schedulers() -> tuple[str, ...]:
    from transformers.trainer_utils import SchedulerType

    return tuple(s.value for s in SchedulerType)


def scheduler_known(name: str) -> bool:
    return name in COMMON_SCHEDULERS or name in schedulers()


def card_known(name: str) -> bool:
    try:
        find_card(name)
    except ValueError:
        return False
    return True


# knob -> (what a value of the right type must satisfy, the problem and fix when it does not)
RANGES = {
    "lora_r": (lambda v: v >= 1, "the LoRA rank must be >= 1; try 8 (the reference) or 16"),
    "lora_alpha": (lambda v: v > 0, "must be > 0; use 2 * lora_r"),
    "lora_dropout": (lambda v: 0 <= v < 1, "must be in [0, 1); try 0.05"),
    "target_modules": (lambda v: v and all(t.strip() for t in v),
                       'target_modules is empty, or names an empty layer: LoRA needs at least one layer, e.g. '
                       '["q_proj", "v_proj"]'),
    "quant_type": (lambda v: v in {"nf4", "fp4"}, "choose 'nf4' (recommended) or 'fp4'"),
    "compute_dtype": (COMPUTE_DTYPES.__contains__, f"choose one of {sorted(COMPUTE_DTYPES)}"),
    "micro_batch_size": (lambda v: v >= 1, "must be >= 1 sequence per forward pass"),
    "grad_accum": (lambda v: v >= 1, "must be >= 1 micro-batch per optimizer step"),
    "learning_rate": (lambda v: v > 0, "must be > 0; try 2e-4"),
    "lr_scheduler_type": (scheduler_known, "not a transformers scheduler; try 'linear' (the reference), 'cosine' or "
                                           "'constant'"),
    "warmup_steps": (lambda v: v >= 0, "must be >= 0 optimizer steps (0: no warmup)"),
    "max_grad_norm": (lambda v: v >= 0, "must be >= 0 (0 turns clipping off); the recipe clips at 0.3"),
    "optim": (OPTIMIZERS.__contains__, f"choose one of {sorted(OPTIMIZERS)}"),
    "num_train_epochs": (lambda v: v >= 0, "must be >= 0; try 3"),
    "no_recompute_layers": (lambda v: v >= 0, "must be >= 0 layers (0: every checkpointed layer recomputes)"),
    "max_length": (lambda v: v >= 16, "too short to hold a prompt and an answer; try 512"),
    "seed": (lambda v: 0 <= v < 2**32, "must be in 0 .. 2**32 - 1 (numpy's seeds); try 42"),
    "save_steps": (lambda v: v >= 1, "must be >= 1 optimizer step"),
    "eval_steps": (lambda v: v >= 0, "must be >= 0 (0 = eval loss before and after training only)"),
    "logging_steps": (lambda v: v >= 1, "must be >= 1 (a log line every N optimizer steps); try 1"),
    "max_train_samples": (lambda v: v >= 1, "must be >= 1 row, or None for every row"),
    "max_eval_samples": (lambda v: v >= 1, "must be >= 1 row, or None for every row"),
    "task_eval_samples": (lambda v: v >= 0, "must be >= 0 (0 skips the base-vs-tuned comparison)"),
    "max_new_tokens": (lambda v: v >= 1, "must be >= 1 token per answer; try 80"),
    "budget_gib": (lambda v: v > 0, "must be > 0 GiB, or None for no cap"),
    "card": (card_known, f"not a card preset; choose one of {', '.join(CARDS)}, or '<N> GiB' (e.g. '6 GiB')"),
    "vram_warn_gib": (lambda v: v > 0, "must be > 0 GiB, or None for the card's budget"),
}


@functools.lru_cache(maxsize=None)
def annotations(cls) -> dict[str, tuple[object, bool]]:
    """knob -> (its type without None, whether None is allowed), from the dataclass annotations."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        rest = [a for a in args if a is not type(None)]
        out[name] = (rest[0] if len(rest) == 1 else hint, len(rest) < len(args))
    return out


def fits(value, kind) -> bool:
    """int means int, not bool (to Python True is 1: lora_r=true trained r=1); float takes an int, not NaN or
    infinity; list[str] is a list of strings. A type this table does not know passes (RANGES may still check)."""
    if kind is bool or kind is str:
        return isinstance(value, kind)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return True


def type_problem(name: str, value, kind, optional: bool, default) -> str | None:
    if (value is None and optional) or (value is not None and fits(value, kind)):
        return None
    if isinstance(value, str) and typing.get_origin(kind) is list:  # never split into letters
        layers = json.dumps([t.strip() for t in value.split(",") if t.strip()] or ["q_proj"])
        return f"{name}={value!r}: a lone string, not a list of layer names; write {layers}"
    if kind is float and isinstance(value, float):
        return f"{name}={value!r}: not a finite number; e.g. {name}={json.dumps(default)}"
    expected = EXPECTED.get(kind, "a list of strings") + (" or None" if optional else "")
    example = "" if default is None else f"; e.g. {name}={json.dumps(default)}"
    return f"{name}={value!r} ({type(value).__name__}): must be {expected}{example}"


def range_problem(name: str, value) -> str | None:
    check, fix = RANGES.get(name, (None, ""))
    if check is None or value is None or check(value):
        return None
    return fix if fix.startswith(name) else f"{name}={value!r}: {fix}"  # "target_modules is empty" says the value


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def settings_problems(cfg) -> list[str]:
    """Every problem with `cfg`'s knobs, each "knob=value: problem; fix". Ranges are checked only on values of the
    right type, so one mistake gives one line."""
    kinds, problems, typed = annotations(type(cfg)), [], set()
    for f in dataclasses.fields(cfg):
        value, (kind, optional) = getattr(cfg, f.name), kinds[f.name]
        problem = type_problem(f.name, value, kind, optional, field_default(f))
        if problem is None:
            typed.add(f.name)
            problem = range_problem(f.name, value)
        problems += [problem] if problem else []
    return problems + combined_problems(cfg, typed)


def combined_problems(cfg, typed: set[str]) -> list[str]:
    """What no single knob shows: nothing to train, and folders that do not exist (`typed`: knobs of the right type).
    The data files are checked where they are read (data.load_rows): `plan` needs a config, not its data."""
    problems = []
    if {"max_steps", "num_train_epochs"} <= typed and cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        problems.append("set max_steps > 0 or num_train_epochs > 0: otherwise nothing trains")
    if "model" in typed and cfg.model:
        problems.append(missing_path_problem("model", cfg.model, cfg.resolve_path, "folder"))
    if "runs_dir" in typed and cfg.resolve_path(cfg.runs_dir).is_file():
        problems.append(f"runs_dir={cfg.runs_dir!r} is a file; point it at a folder")
    return [p for p in problems if p]
