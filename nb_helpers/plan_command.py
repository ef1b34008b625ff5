"""`python -m nb_helpers plan`: will it fit? The planner's predicted peak from config.json alone, for a config file,
flags or both; exit 0 when it fits the budget, 3 when it does not."""

from __future__ import annotations

import json

from nb_helpers.config import ConfigError, RunConfig, apply_sets
from nb_helpers.plan.cards import COURSE_CARD, budget_of, card_names, run_card


PLAN_DOES_NOT_FIT = 3


def plan_config(args) -> RunConfig:
    """The run `plan` predicts: --config (or the reference recipe, RunConfig()), then the flags given, then --set.
    A flag left out keeps the config's value, so `plan --config run.json` predicts exactly what `train` would run."""
    for name, value in (("--seq", args.seq), ("--batch", args.batch), ("--accum", args.accum), ("--rank", args.rank)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value}: must be >= 1")
    if args.context_gib is not None and not 0 <= args.context_gib < 100:  # NaN fails too
        raise ConfigError(f"--context-gib {args.context_gib}: the CUDA context in GiB, 0 or more; try 0.3")
    if not 0 < args.labelled_fraction <= 1:
        raise ConfigError(f"--labelled-fraction {args.labelled_fraction}: a share of tokens, above 0 and at most 1")
    cfg = RunConfig.load(args.config) if args.config else RunConfig()
    flags = {"model": args.model, "max_length": args.seq, "micro_batch_size": args.batch, "grad_accum": args.accum,
             "lora_r": args.rank, "optim": args.optim, "compute_dtype": args.dtype, "lora_dropout": args.dropout,
             "budget_gib": args.budget, "card": args.card}
    changes = {k: v for k, v in flags.items() if v is not None}
    if args.targets:
        changes["target_modules"] = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.no_gc:
        changes["gradient_checkpointing"] = False
    if args.no_double_quant:
        changes["double_quant"] = False
    if args.fast_path:
        changes["fast_path"] = True
    cfg = apply_sets(RunConfig.from_dict({**cfg.to_dict(), **changes}), args.set)
    # no budget and no card: the course's card (a GTX 1650), whatever GPU this machine has
    return cfg if cfg.budget_gib is not None or cfg.card else cfg.replace(card=COURSE_CARD)


def gpu_capability(text: str | None) -> tuple[int, int] | None:
    """--gpu-capability "7.5" -> (7, 5); None: this GPU's, else the course card's."""
    if not text:
        return None
    major, dot, minor = text.strip().partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise ConfigError(f"--gpu-capability {text!r}: use MAJOR.MINOR, e.g. 7.5 for a GTX 1650 or 8.6 for an RTX 3050")
    return int(major), int(minor)


def cmd_plan(args) -> int:
    """Predicted peak memory from config.json alone; exit 0 when it fits the budget, 3 when it does not."""
    from nb_helpers.plan.choose import auto_fit, fewer_recomputes_on, graphs_dropped_unless_they_fit
    from nb_helpers.plan.planner import default_context_gib, load_shape, plan_for_config
    from nb_helpers.plan.step_time import time_line, timing_gpu

    cfg, capability = plan_config(args), gpu_capability(args.gpu_capability)
    model = cfg.model
    if model is None:
        from nb_helpers.models import resolve_model

        model = resolve_model(cfg, verbose=True).path
    try:
        shape = load_shape(model)
    except ValueError as e:  # a family the planner does not model: its own message says what is missing
        raise ConfigError(f"--model {model}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a missing folder, an unreachable hub: one line, not a traceback
        raise ConfigError(f"--model {model}: cannot read its config.json ({e}); give a local model folder, "
                          "a path to config.json or a hub id") from None
    card = run_card(cfg)  # a card brings its context and capability; the flags still override them
    context = args.context_gib if args.context_gib is not None else card.context_gib if card else default_context_gib()
    extras = False if args.no_gpu_extras else None
    try:
        planned = plan_for_config(cfg, shape, context_gib=context, gpu_capability=capability,
                                  labelled_fraction=args.labelled_fraction, gpu_extras=extras)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # a run drops CUDA graphs its budget cannot hold: plan what it runs (auto-fit below weighs both itself)
    budget = budget_of(cfg)
    result = graphs_dropped_unless_they_fit(planned, budget) if budget else planned
    inp = result.inputs
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"model {shape.name or model}: {shape.describe()}")
        if card is not None and args.budget is None:
            print(f"card {card.describe(cfg.desktop_on_card)} (--card to change, --budget to set GiB)")
        print(f"seq {inp.seq} | micro-batch {inp.batch} x accumulation {inp.accum} | r={inp.rank} on "
              f"{','.join(inp.targets)} | GC {'on' if inp.gradient_checkpointing else 'off'} | {inp.optim} | "
              f"{inp.compute_dtype} | context {context:.2f} GiB | compute capability "
              f"{inp.gpu_capability[0]}.{inp.gpu_capability[1]}")
        print(result.table())
        for note in result.notes:
            print(f"note: {note}")
        line = time_line(result, cfg)
        if line:
            print(line)
        if args.auto_fit:
            try:
                fitting = plan_for_config(cfg.replace(auto_fit=True), shape, context_gib=context,  # graphs weighed
                                          gpu_capability=capability, labelled_fraction=args.labelled_fraction,
                                          gpu_extras=extras)
                choice = auto_fit(shape, fitting.inputs, inp.batch * inp.accum, budget, log=lambda *_: None,
                                  gpu=timing_gpu(cfg), fewer_recomputes=fewer_recomputes_on(cfg, shape))
                print(f"auto-fit for effective batch {inp.batch * inp.accum}: {choice.describe()}")
            except MemoryError as e:
                print(f"auto-fit: {e}")
        print(result.verdict())
    return 0 if result.fits else PLAN_DOES_NOT_FIT


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="will it fit? predicted peak GPU memory from config.json alone (exit 0 fits, 3 not)")
    p.add_argument("--config", help="JSON config file (see `config`) to plan; default: the reference recipe")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob, e.g. lora_r=16")
    p.add_argument("--model", help="hub id, local folder or config.json (default: the config's, else the model "
                   "training would pick)")
    p.add_argument("--seq", type=int, help="tokens per sequence (max_length; default: the config's, 512)")
    p.add_argument("--batch", type=int, help="micro-batch: sequences per forward pass (default: the config's, 1)")
    p.add_argument("--accum", type=int, help="gradient accumulation steps (default: the config's, 8)")
    p.add_argument("--rank", type=int, help="LoRA rank r (default: the config's, 8)")
    p.add_argument("--budget", type=float, help="GiB the run may use, CUDA context included (default: the config's "
                   "budget_gib, else its card's)")
    p.add_argument("--card", help=f"the card to plan for: {', '.join(card_names())} (default: the config's, "
                   f"else {COURSE_CARD})")
    p.add_argument("--fast-path", action="store_true", help="plan the fast path that notebook 06 switches on "
                   "(default: the config's, else the plain transformers + peft + TRL stack)")
    p.add_argument("--no-gpu-extras", action="store_true", help="with --fast-path: plan a GPU without liger-kernel "
                   "(default: with it, as make installs it beside an NVIDIA driver; this GPU: as installed here)")
    p.add_argument("--targets", help="comma list, or all-linear (default: the config's, q,k,v,o; Phi's fused layers "
                   "are found from these names)")
    p.add_argument("--no-gc", action="store_true", help="without gradient checkpointing")
    p.add_argument("--context-gib", type=float, default=None,
                   help="CUDA context size (default: the card's, else measured on this GPU, else 0.30)")
    p.add_argument("--optim", help="paged_adamw_8bit, adamw_8bit, adamw_torch, ... (default: the config's)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], help="compute dtype (default: by compute capability)")
    p.add_argument("--gpu-capability", help="e.g. 7.5 for a GTX 1650 (default: the card's, else this GPU's, else 7.5)")
    p.add_argument("--dropout", type=float, help="LoRA dropout (0 saves its masks; default: the config's, 0.05)")
    p.add_argument("--no-double-quant", action="store_true", help="fp32 quantization constants")
    p.add_argument("--labelled-fraction", type=float, default=1.0,
                   help="share of tokens with a loss (default 1.0, the worst case)")
    p.add_argument("--auto-fit", action="store_true", help="also print the fastest micro-batch x accumulation that fits")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)
