"""One config object for every knob: widgets write it, the trainer reads it, each run saves it, and validate() checks
every knob's type and range before anything loads.

The defaults are the reference recipe (TinyLlama-1.1B-Chat, NF4 + double quant, LoRA r=8 on q,k,v,o, batch 1 x
accumulation 8, paged_adamw_8bit, lr 2e-4, clip 0.3, gradient checkpointing, 3 epochs). `default_config()` adapts
only what this machine forces, and prints each change."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from nb_helpers.hub import missing_path_problem
from nb_helpers.plan.cards import CARDS, find_card

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# The one switch that shrinks every notebook and the headless run for CI (nbdev's IN_TEST idea).
CI_ENV_VAR = "NB_CI"
# Keys a run's config.json records beside the knobs (what ran, not what to set); RunConfig.load skips them
RECORD_KEYS = ("fast_levers", "preference_from")
# Optional JSON file of overrides that every notebook's default_config() applies (used by `make run`).
CONFIG_ENV_VAR = "NB_CONFIG"

REFERENCE_MODEL = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
REFERENCE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class ConfigError(ValueError):
    """A setting that cannot work. The message names the knob and the fix."""


def read_knobs(path: str | Path, what: str, fix: str) -> dict:
    """A JSON object of knobs from a file people edit (a Windows editor's byte order mark is fine), or a ConfigError
    naming `what`, the problem and `fix`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except OSError as e:  # missing, a folder, no permission
        raise ConfigError(f"{what}: cannot read it ({e.strerror or e}); {fix}") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8
        raise ConfigError(f"{what}: not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: holds {json.dumps(data)[:40]}, not an object of knobs like {{\"lora_r\": 16}}; {fix}")
    return data


# The environment variables the package reads, each checked once with a one-line message (a bad one was a traceback:
# WORLD_SIZE=abc, NB_CACHE_DIR=/dev/null/x, or NB_FASTPATH=xyz once the fast path was asked for).
# set by accelerate launch and torchrun: each one's least value
LAUNCHER_VARS = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0}
SWITCH_WORDS = {"1", "0", "true", "false", "yes", "no", "on", "off", ""}


def environment_problems(environ=None) -> list[str]:
    """What is wrong with the package's environment variables: each "NAME=value: problem; fix"."""
    environ = os.environ if environ is None else environ
    problems = []
    for name, least in LAUNCHER_VARS.items():
        value = environ.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) >= least):
            problems.append(f"{name}={value[:40]!r}: must be a whole number >= {least} (accelerate launch and torchrun "
                            f"set it); unset it to train in one process (`unset {name}`)")
    problems += fastpath_problems(environ.get("NB_FASTPATH", ""))
    if cache := environ.get("NB_CACHE_DIR"):
        problems += [f"NB_CACHE_DIR={cache[:80]!r}: {why}; point it at a folder you can write, or unset it (the "
                     "default is .cache/ in the project)" for why in [folder_problem(Path(cache).expanduser())] if why]
    return problems


def fastpath_problems(value: str) -> list[str]:
    from nb_helpers.fast.options import FastOptions

    known = [f.name for f in dataclasses.fields(FastOptions)]
    problems = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        lever, _, switch = item.partition("=")
        if lever.strip() not in known or switch.strip().lower() not in SWITCH_WORDS:
            problems.append(f"NB_FASTPATH={value[:80]!r}: {item[:40]!r} is not LEVER=0 or LEVER=1 with a lever of "
                            f"{', '.join(known)}; e.g. NB_FASTPATH=\"kernels=0\", or unset it")
    return problems


def folder_problem(path: Path) -> str | None:
    """Why `path` cannot be (or become) a folder: a file on the way, or a place with no permission to write."""
    for part in [path, *path.parents]:
        if part.exists():
            if not part.is_dir():
                return f"{part} is a file, not a folder"
            return None if os.access(part, os.W_OK) else f"{part} cannot be written"
    return None


def check_environment() -> None:
    if problems := environment_problems():
        raise ConfigError("environment: " + "; ".join(problems) if len(problems) == 1 else
                          "environment:\n  - " + "\n  - ".join(problems))


def ci_mode() -> bool:
    return os.environ.get(CI_ENV_VAR, "").lower() in {"1", "true", "yes"}


@dataclass
class RunConfig:
    # --- model -----------------------------------------------------------------------------
    model: str | None = None  # hub id or local path; None = TinyLlama on a GPU with the hub, else the embedded SmolLM2
    trust_remote_code: bool = False  # only for models whose code you have read
    # --- 4-bit loading (bitsandbytes) -------------------------------------------------------
    load_in_4bit: bool = True
    quant_type: str = "nf4"  # "nf4" suits normally distributed weights; "fp4" is the alternative
    double_quant: bool = True  # quantizes the quantization constants too: ~0.4 bit/param saved
    # auto = bf16 on compute capability >= 8.0, fp16 below (Turing); CPUs: bf16 only with AVX-512 BF16/AMX, else fp32
    compute_dtype: str = "auto"
    # --- LoRA ------------------------------------------------------------------------------
    lora_r: int = 8  # try 4, 8, 16, 32: adapter size and capacity grow linearly
    lora_alpha: int = 16  # scale = alpha / r; the reference uses 2 * r; the LoRA paper fixes alpha as r varies
    lora_dropout: float = 0.05  # 0.0 is faster; 0.05-0.1 regularises small datasets
    target_modules: list[str] = field(default_factory=lambda: list(REFERENCE_TARGETS))  # add gate/up/down_proj for more capacity
    # --- training --------------------------------------------------------------------------
    micro_batch_size: int = 1  # sequences per forward pass; raise it before accumulation if memory allows
    grad_accum: int = 8  # micro-batches per optimizer step; effective batch = micro_batch_size * grad_accum
    learning_rate: float = 2e-4  # 1e-4 to 3e-4 is the usual QLoRA range
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    max_grad_norm: float = 0.3  # the QLoRA paper's clip, for any dtype (fp16 gradients are unscaled before clipping)
    optim: str = "paged_adamw_8bit"  # 8-bit states; pages only tensors >= 100k values (lora.py): r=8 adapters, none
    gradient_checkpointing: bool = True  # recompute activations: less memory, up to 50% more compute (plan/choose.py)
    offload_checkpoints: bool = False  # GPU + GC: keep each layer's checkpoint in CPU RAM (layers x tokens x hidden
    #                                    x 2 bytes off the card); for long rows or bigger micro-batches. auto_fit decides
    # GPU + GC: replay each checkpointed layer as a CUDA graph: several times faster steps, for a memory pool (0.3-0.5
    # GiB for TinyLlama at 1 x 512-2048). None = auto_fit weighs it; hand-set runs stay lean (the reference's memory)
    cuda_graphs: bool | None = None
    # GPU + GC: the last N layers keep their activations, not recomputed: less compute, N layers' activations more
    no_recompute_layers: int = 0  # memory (`plan` shows it); auto_fit takes what fits where it pays. Try 2-4
    num_train_epochs: float = 3.0
    max_steps: int = -1  # > 0 overrides epochs
    max_length: int = 512  # tokens per sequence; longer costs activation memory
    completion_only_loss: bool = True  # loss on answers only; False trains on prompts too
    seed: int = 42
    save_steps: int = 50  # checkpoint every N optimizer steps (kept: the last 2)
    eval_steps: int = 25  # eval loss every N steps, the curve notebook 04 reads for overfitting; 0 = before/after only
    logging_steps: int = 1
    # --- data ------------------------------------------------------------------------------
    train_file: str = "data/train.jsonl"  # JSONL path (relative to the project root) or a hub dataset name
    eval_file: str | None = "data/eval.jsonl"  # held-out rows; None skips evaluation
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    skip_invalid: bool = False  # True drops invalid rows (their line numbers are printed) instead of stopping
    # --- task evaluation (generation on held-out prompts) ------------------------------------
    task_eval_samples: int = 60  # 0 skips the base-vs-tuned comparison
    max_new_tokens: int = 64  # the shipped answers are 38-42 tokens; every generated token costs time: raise it for yours
    # --- run folder and budget -------------------------------------------------------------
    runs_dir: str = "runs"
    run_name: str | None = None  # None = timestamp + model + rank
    budget_gib: float | None = None  # emulate a smaller card on a bigger one (CUDA only), context included
    # the learner's card (plan/cards.py: "gtx1650", "rtx3050-laptop-4gb", "t4", ... or "6 GiB"): plans use its memory
    card: str | None = None  # and compute capability; a bigger GPU emulates it
    desktop_on_card: bool = True  # the screen runs on the card: keep ~0.35 GiB for it; False on a headless machine
    auto_fit: bool = False  # GPU: pick micro-batch x accumulation and GC that fit budget_gib, same effective batch
    # GPU: False (the default) trains the plain transformers + peft + TRL stack that notebooks 01-03 write out; True
    # adds the fast path that notebook 06 teaches (nb_helpers.fast: fused kernels, no mask, CUDA graphs, ...): the same
    # math in less memory and time. No effect on a CPU
    fast_path: bool = False
    vram_warn_gib: float | None = None  # notebook 04 flags steps above this; None = the card's budget (GTX 1650: 3.46)
    # --- preference tuning (notebook 07: DPO on the SFT adapter; the batch, length and optimizer knobs above apply) ---
    dpo_beta: float = 0.1  # how far DPO may move from the SFT model: 0.05 moves further, 0.5 stays close (TRL: 0.1)
    dpo_learning_rate: float = 5e-5  # DPO refines a tuned adapter: well below SFT's 2e-4; try 1e-5 to 1e-4
    dpo_max_steps: int = 40  # optimizer steps of DPO; 600 pairs at 8 pairs a step is 75 steps an epoch
    pairs_train_file: str = "data/pairs_train.jsonl"  # preference pairs (JSONL: prompt, chosen, rejected)
    pairs_eval_file: str | None = "data/pairs_eval.jsonl"  # held-out pairs: reward accuracy and margin; None skips
    pair_eval_samples: int | None = None  # how many of them (None: all 60); each costs 4 forwards (2 answers x 2 models)

    # ------------------------------------------------------------------------------------------
    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum

    @property
    def graphs_wanted(self) -> bool:
        """Whether this run asks for CUDA-graphed layers before any fit check: as set, else only where auto_fit
        chooses the batch (it weighs graphs against the budget; a hand-set run keeps the lean path)."""
        return self.auto_fit if self.cuda_graphs is None else self.cuda_graphs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k not in RECORD_KEYS}
        if unknown := sorted(set(data) - known):
            raise ConfigError(f"unknown config keys {unknown}; valid keys are: {', '.join(sorted(known))}")
        return cls(**data)

    def save(self, path: str | Path, record: dict | None = None) -> None:
        """The knobs, plus `record`: what the run found out about them (RECORD_KEYS, e.g. the fast path's levers
        that ran), which loading the file ignores."""
        data = {**self.to_dict(), **{k: v for k, v in (record or {}).items() if k in RECORD_KEYS}}
        Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        return cls.from_dict(read_knobs(path, str(path), "fix the file, or write one with `python -m nb_helpers config "
                                                         "-o FILE`"))

    def replace(self, **changes) -> "RunConfig":
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def resolve_path(self, value: str | None) -> Path | None:
        """Relative paths are relative to the project root, so notebooks (cwd=notebooks/) and CLI agree."""
        if value is None:
            return None
        p = Path(value).expanduser()
        return p if p.is_absolute() else (PROJECT_ROOT / p)

    def validate(self) -> "RunConfig":
        """Fail before anything loads: every knob checked for type, range and finiteness (settings_problems, below),
        all problems at once, each with the knob, the value and the fix."""
        if problems := settings_problems(self):
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
        return self

    def summary_line(self) -> str:
        steps = f"max_steps={self.max_steps}" if self.max_steps > 0 else f"epochs={self.num_train_epochs:g}"
        gc = ("on" + " (checkpoints in CPU RAM)" * self.offload_checkpoints + f", the last {self.no_recompute_layers} "
              "layers not recomputed" * (self.no_recompute_layers > 0)) if self.gradient_checkpointing else "off"
        return (f"r={self.lora_r} alpha={self.lora_alpha} targets={','.join(self.target_modules)} | "
                f"batch {self.micro_batch_size} x accum {self.grad_accum} | lr {self.learning_rate:g} | "
                f"max_length {self.max_length} | {steps} | GC {gc}")


# --- every knob checked for type, range and finiteness before anything loads (RunConfig.validate) ----------------
# The types come from the dataclass annotations, so a knob added later is type-checked with no entry here; RANGES holds
# what a value of the right type must also satisfy. Unchecked, a wrong type crashed (lora_r="abc": a TypeError
# traceback) or, worse, passed: lora_r=true trained r=1, target_modules="q_proj" became the layers q, _, p, r, o, j,
# max_grad_norm=NaN turned clipping off, a negative max_train_samples dropped rows silently, and NaN, 8.5 or an
# unknown scheduler crashed only after the model had loaded. Every problem is listed at once, each with the knob, the
# value and a fix, so a config file with three mistakes costs one try, not three.

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


# Every number has an upper bound too, far above what a 4 GB card could ever run: lora_r=1000000000 passed and failed
# after the model loaded ("can't allocate 2304000000000 bytes").
MAX_RANK, MAX_STEPS, MAX_LENGTH, MAX_ROWS = 1024, 1_000_000, 131_072, 100_000_000

# knob -> (what a value of the right type must satisfy, the problem and fix when it does not)
RANGES = {
    "lora_r": (lambda v: 1 <= v <= MAX_RANK, f"the LoRA rank must be >= 1 (and at most {MAX_RANK}, far more than a 4 "
                                           "GB card can train); try 8 (the reference) or 16"),
    "lora_alpha": (lambda v: 0 < v <= 65536, "must be > 0 (and at most 65536); use 2 * lora_r"),
    "lora_dropout": (lambda v: 0 <= v < 1, "must be in [0, 1); try 0.05"),
    "target_modules": (lambda v: v and all(t.strip() for t in v),
                       'target_modules is empty, or names an empty layer: LoRA needs at least one layer, e.g. '
                       '["q_proj", "v_proj"]'),
    "quant_type": (lambda v: v in {"nf4", "fp4"}, "choose 'nf4' (recommended) or 'fp4'"),
    "compute_dtype": (COMPUTE_DTYPES.__contains__, f"choose one of {sorted(COMPUTE_DTYPES)}"),
    "micro_batch_size": (lambda v: 1 <= v <= 1024, "must be >= 1 (and at most 1024) sequences per forward pass"),
    "grad_accum": (lambda v: 1 <= v <= 4096, "must be >= 1 (and at most 4096) micro-batches per optimizer step"),
    "learning_rate": (lambda v: 0 < v <= 1, "must be > 0 and at most 1; try 2e-4"),
    "lr_scheduler_type": (scheduler_known, "not a transformers scheduler; try 'linear' (the reference), 'cosine' or "
                                           "'constant'"),
    "warmup_steps": (lambda v: 0 <= v <= MAX_STEPS, f"must be >= 0 (and at most {MAX_STEPS:,}) optimizer steps (0: "
                                                    "no warmup)"),
    "max_grad_norm": (lambda v: 0 <= v <= 1e6, "must be >= 0 (0 turns clipping off); the recipe clips at 0.3"),
    "optim": (OPTIMIZERS.__contains__, f"choose one of {sorted(OPTIMIZERS)}"),
    "num_train_epochs": (lambda v: 0 <= v <= 1000, "must be >= 0 (and at most 1000); try 3"),
    "max_steps": (lambda v: v == -1 or 1 <= v <= MAX_STEPS, f"must be -1 (train num_train_epochs instead) or 1 .. "
                                                           f"{MAX_STEPS:,} optimizer steps; try 60 for a quick run"),
    "no_recompute_layers": (lambda v: 0 <= v <= 1024, "must be >= 0 (and at most 1024) layers (0: every "
                                                      "checkpointed layer recomputes)"),
    "max_length": (lambda v: 16 <= v <= MAX_LENGTH, f"must be >= 16 (to hold a prompt and an answer) and at most "
                                                    f"{MAX_LENGTH:,} tokens; try 512"),
    "seed": (lambda v: 0 <= v < 2**32, "must be in 0 .. 2**32 - 1 (numpy's seeds); try 42"),
    "save_steps": (lambda v: 1 <= v <= MAX_STEPS, f"must be >= 1 (and at most {MAX_STEPS:,}) optimizer steps"),
    "eval_steps": (lambda v: 0 <= v <= MAX_STEPS, "must be >= 0 (0 = eval loss before and after training only)"),
    "logging_steps": (lambda v: 1 <= v <= MAX_STEPS, "must be >= 1 (a log line every N optimizer steps); try 1"),
    "max_train_samples": (lambda v: 1 <= v <= MAX_ROWS, f"must be >= 1 (and at most {MAX_ROWS:,}) rows, or None for "
                                                        "every row"),
    "max_eval_samples": (lambda v: 1 <= v <= MAX_ROWS, f"must be >= 1 (and at most {MAX_ROWS:,}) rows, or None for "
                                                       "every row"),
    "task_eval_samples": (lambda v: 0 <= v <= MAX_ROWS, "must be >= 0 (0 skips the base-vs-tuned comparison)"),
    "pair_eval_samples": (lambda v: 1 <= v <= MAX_ROWS, f"must be >= 1 (and at most {MAX_ROWS:,}) pairs, or None for "
                                                        "every held-out pair (pairs_eval_file=None skips them)"),
    "max_new_tokens": (lambda v: 1 <= v <= MAX_LENGTH, f"must be >= 1 (and at most {MAX_LENGTH:,}) tokens per answer; "
                                                       "try 80"),
    "budget_gib": (lambda v: 0 < v <= 1024, "must be > 0 GiB (and at most 1024), or None for no cap"),
    "card": (card_known, f"not a card preset; choose one of {', '.join(CARDS)}, or '<N> GiB' (e.g. '6 GiB')"),
    "vram_warn_gib": (lambda v: 0 < v <= 1024, "must be > 0 GiB (and at most 1024), or None for the card's budget"),
    "dpo_beta": (lambda v: 0 < v <= 100, "must be > 0 (and at most 100); try 0.1 (TRL's default), 0.05 or 0.5"),
    "dpo_learning_rate": (lambda v: 0 < v <= 1, "must be > 0 (and at most 1); try 5e-5"),
    "dpo_max_steps": (lambda v: 1 <= v <= MAX_STEPS, f"must be >= 1 (and at most {MAX_STEPS:,}) optimizer steps; try "
                                                     "40"),
}


@functools.lru_cache(maxsize=None)
def knob_types(cls) -> dict[str, tuple[object, bool]]:
    """knob -> (its type without None, whether None is allowed), from the dataclass annotations."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        rest = [a for a in args if a is not type(None)]
        out[name] = (rest[0] if len(rest) == 1 else hint, len(rest) < len(args))
    return out


def is_of_type(value, kind) -> bool:
    """int means int, not bool (to Python True is 1: lora_r=true trained r=1); float takes an int, not NaN or
    infinity; list[str] is a list of strings. A type this table does not know passes (RANGES may still check)."""
    if kind is bool or kind is str:
        return isinstance(value, kind)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and finite(value)
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return True


def finite(value) -> bool:
    """math.isfinite, and False for an int too large for a float (a 401-digit number: OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value) -> str:
    """repr(value), cut to 60 characters: a 5,000-digit number is not repeated back whole."""
    big = isinstance(value, int) and abs(value) >= 10**60
    text = f"<a {len(str(abs(value)))}-digit number>" if big else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def type_problem(name: str, value, kind, optional: bool, default) -> str | None:
    if (value is None and optional) or (value is not None and is_of_type(value, kind)):
        return None
    if isinstance(value, str) and typing.get_origin(kind) is list:  # never split into letters
        layers = json.dumps([t.strip() for t in value.split(",") if t.strip()] or ["q_proj"])
        return f"{name}={value!r}: a lone string, not a list of layer names; write {layers}"
    if kind is float and isinstance(value, (float, int)):
        return f"{name}={shown(value)}: not a finite number; e.g. {name}={json.dumps(default)}"
    expected = EXPECTED.get(kind, "a list of strings") + (" or None" if optional else "")
    example = "" if default is None else f"; e.g. {name}={json.dumps(default)}"
    return f"{name}={shown(value)} ({type(value).__name__}): must be {expected}{example}"


def range_problem(name: str, value) -> str | None:
    check, fix = RANGES.get(name, (None, ""))
    if check is None or value is None or check(value):
        return None
    return fix if fix.startswith(name) else f"{name}={shown(value)}: {fix}"  # "target_modules is empty" says it


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def settings_problems(cfg) -> list[str]:
    """Every problem with `cfg`'s knobs, each "knob=value: problem; fix". Ranges are checked only on values of the
    right type, so one mistake gives one line."""
    kinds, problems, typed = knob_types(type(cfg)), [], set()
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


# What the CI switch changes: small for testing speed, same code paths (every knob still applies).
CI_OVERRIDES = dict(max_steps=3, micro_batch_size=2, grad_accum=2, max_length=192, max_train_samples=24,
                    max_eval_samples=8, task_eval_samples=4, max_new_tokens=48, save_steps=2, eval_steps=2,
                    dpo_max_steps=3, pair_eval_samples=8, runs_dir="runs/ci")

# CPU, each change measured on 2 cores (bench/RESULTS.md, "CPU: training speed per instruction set and dtype"):
# - batch 4 x 2 instead of 1 x 8: the same effective batch, so the same optimisation. As AVX2 an SFT step took 5.9 s
#   at 4 x 2 and at 8 x 1, 6.8 s at 2 x 4, 7.2 s at 1 x 8; a DPO step of 8 pairs 15.4 s at 4 x 2, 22.2 s at 8 x 1
#   (16 sequences a forward), 16.8 s at 1 x 8;
# - no gradient checkpointing: recomputing activations cost 12-22% per step (measured), and host RAM holds them easily;
# - 35 steps at lr 4e-4 instead of 70 at 2e-4: the same held-out score (0.958 against 0.956) in half the steps; 30
#   steps scored 0.944;
# - eval loss every 12 steps on 30 of the 60 held-out rows: the curve notebook 04 plots at steps 0, 12, 24 and 35,
#   each point ~6.5 s instead of ~13 s. The same 30 rows at every eval, so the curve's shape is the rows' average
#   loss over ~1,200 answer tokens, not a new sample each time; the task metric still scores all 60 prompts, and
#   notebook 07 all 60 held-out pairs (pair_eval_samples);
# - adamw_8bit: the same 8-bit AdamW; paging (CUDA managed memory, tensors >= 100k values) does not exist on a CPU.
# - DPO (notebook 07): 6 steps of 8 pairs at lr 1e-4: held-out reward accuracy 0.90 and the task metric unchanged
#   from the course's SFT run, ~90 s of training; at lr 2e-4 the task metric fell (0.958 -> 0.942), at 5e-4 to 0.21
#   (the chosen answers lost probability too). The course's own run is in bench/RESULTS.md ("The course on a CPU").
CPU_OVERRIDES = dict(micro_batch_size=4, grad_accum=2, gradient_checkpointing=False, max_steps=35,
                     learning_rate=4e-4, optim="adamw_8bit", max_length=256, eval_steps=12, max_eval_samples=30,
                     dpo_max_steps=6, dpo_learning_rate=1e-4)


def default_config(**overrides) -> RunConfig:
    """The reference recipe, adapted to this machine; every adaptation is printed with its reason."""
    cfg = RunConfig()
    changes: list[tuple[str, dict]] = []
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    if not has_cuda:
        changes.append(("no CUDA GPU: CPU profile (same effective batch, short run, no checkpointing)",
                        CPU_OVERRIDES))
    env_file = os.environ.get(CONFIG_ENV_VAR)
    if env_file:
        data = read_knobs(env_file, f"{CONFIG_ENV_VAR}={env_file}", f"fix the file, or unset {CONFIG_ENV_VAR}")
        changes.append((f"{CONFIG_ENV_VAR}={env_file}", data))
    if ci_mode():
        changes.append((f"{CI_ENV_VAR}=1: shrunk for CI", CI_OVERRIDES))
    if overrides:
        changes.append(("explicit arguments", overrides))
    for reason, values in changes:
        try:
            cfg = RunConfig.from_dict({**cfg.to_dict(), **values})
        except ConfigError as e:
            raise ConfigError(f"{reason}: {e}") from None
        print(f"[config] {reason}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    if not has_cuda and cfg.compute_dtype == "auto":
        from nb_helpers.plan.dtypes import compute_dtype_for, dtype_reason

        dtype = compute_dtype_for(None)
        print(f"[config] compute_dtype=auto on this CPU: {dtype}, because {dtype_reason(None, dtype)}")
    return cfg.validate()


def parse_value(text: str, key: str = "VALUE"):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # bare strings: --set model=path/to/model
    except ValueError:  # an integer of over 4,300 digits: Python refuses to read it (int_max_str_digits)
        raise ConfigError(f"--set {key}=<{len(text)} characters>: a number too long to read; give a value in the "
                          f"knob's range (python -m nb_helpers config shows each default)") from None


def apply_sets(cfg: RunConfig, sets: list[str]) -> RunConfig:
    """The command line's `--set KEY=VALUE` overrides, each VALUE read as JSON (a bare word stays a string)."""
    changes = {}
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: use KEY=VALUE, e.g. --set lora_r=16")
        key, value = item.split("=", 1)
        changes[key.strip()] = parse_value(value, key.strip())
    return RunConfig.from_dict({**cfg.to_dict(), **changes}).validate()
