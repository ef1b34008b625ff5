"""Command line: python -m nb_helpers {env,config,plan,train,validate-data,export,course,clean-notebooks} --help"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import COURSE_CARD_GIB, PROJECT_ROOT, ConfigError, RunConfig, default_config


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # bare strings: --set model=path/to/model


def _apply_sets(cfg: RunConfig, sets: list[str]) -> RunConfig:
    changes = {}
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: use KEY=VALUE, e.g. --set lora_r=16")
        key, value = item.split("=", 1)
        changes[key.strip()] = _parse_value(value)
    return RunConfig.from_dict({**cfg.to_dict(), **changes}).validate() if changes else cfg


def cmd_env(args) -> int:
    from .environment import check_environment

    report = check_environment(check_hub=not args.no_hub)
    print(report.text())
    return 1 if report.failed else 0


def cmd_config(args) -> int:
    cfg = _apply_sets(default_config(), args.set)
    text = json.dumps(cfg.to_dict(), indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0


def cmd_train(args) -> int:
    """One process, or one of several under `accelerate launch` (then rank 0 alone prints and writes)."""
    from . import distributed
    from .training import train

    if args.resume and (args.config or args.set):
        raise ConfigError("--resume continues a run with its own config.json; leave out --config and --set")
    with distributed.quiet_unless_main():
        if args.resume:
            run_dir = train(RunConfig(), resume_from=args.resume)
        else:
            cfg = RunConfig.load(args.config) if args.config else default_config()
            run_dir = train(_apply_sets(cfg, args.set))
    summary = json.loads((run_dir / "summary.json").read_text())
    distributed.finish()
    return 0 if summary.get("status") == "completed" else 1


PLAN_DOES_NOT_FIT = 3


def plan_config(args) -> RunConfig:
    """The run `plan` predicts: --config (or the reference recipe, RunConfig()), then the flags given, then --set.
    A flag left out keeps the config's value, so `plan --config run.json` predicts exactly what `train` would run."""
    for name, value in (("--seq", args.seq), ("--batch", args.batch), ("--accum", args.accum), ("--rank", args.rank)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value}: must be >= 1")
    cfg = RunConfig.load(args.config) if args.config else RunConfig()
    flags = {"model": args.model, "max_length": args.seq, "micro_batch_size": args.batch, "grad_accum": args.accum,
             "lora_r": args.rank, "optim": args.optim, "compute_dtype": args.dtype, "lora_dropout": args.dropout,
             "budget_gib": args.budget}
    changes = {k: v for k, v in flags.items() if v is not None}
    if args.targets:
        changes["target_modules"] = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.no_gc:
        changes["gradient_checkpointing"] = False
    if args.no_double_quant:
        changes["double_quant"] = False
    cfg = _apply_sets(RunConfig.from_dict({**cfg.to_dict(), **changes}), args.set)
    return cfg if cfg.budget_gib is not None else cfg.replace(budget_gib=COURSE_CARD_GIB)


def cmd_plan(args) -> int:
    """Predicted peak memory from config.json alone; exit 0 when it fits the budget, 3 when it does not."""
    from .planner import auto_fit, default_context_gib, graphs_dropped_unless_they_fit, load_shape, plan_for_config

    cfg = plan_config(args)
    model = cfg.model
    if model is None:
        from .models import resolve_model

        model = resolve_model(cfg, verbose=True).path
    try:
        shape = load_shape(model)
    except ValueError as e:  # a family the planner does not model: its own message says what is missing
        raise ConfigError(f"--model {model}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a missing folder, an unreachable hub: one line, not a traceback
        raise ConfigError(f"--model {model}: cannot read its config.json ({e}); give a local model folder, "
                          "a path to config.json or a hub id") from None
    capability = tuple(int(x) for x in args.gpu_capability.split(".")) if args.gpu_capability else None
    context = args.context_gib if args.context_gib is not None else default_context_gib()
    try:
        planned = plan_for_config(cfg, shape, context_gib=context, gpu_capability=capability,
                                  labelled_fraction=args.labelled_fraction)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # a run drops CUDA graphs its budget cannot hold: plan what it runs (auto-fit below weighs both itself)
    result = graphs_dropped_unless_they_fit(planned, cfg.budget_gib) if cfg.budget_gib else planned
    inp = result.inputs
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"model {shape.name or model}: {shape.describe()}")
        print(f"seq {inp.seq} | micro-batch {inp.batch} x accumulation {inp.accum} | r={inp.rank} on "
              f"{','.join(inp.targets)} | GC {'on' if inp.gradient_checkpointing else 'off'} | {inp.optim} | "
              f"{inp.compute_dtype} | context {context:.2f} GiB | compute capability "
              f"{inp.gpu_capability[0]}.{inp.gpu_capability[1]}")
        print(result.table())
        for note in result.notes:
            print(f"note: {note}")
        if args.auto_fit:
            try:
                fitting = plan_for_config(cfg.replace(auto_fit=True), shape, context_gib=context,  # graphs weighed
                                          gpu_capability=capability, labelled_fraction=args.labelled_fraction)
                choice = auto_fit(shape, fitting.inputs, inp.batch * inp.accum, cfg.budget_gib, log=lambda *_: None)
                print(f"auto-fit for effective batch {inp.batch * inp.accum}: {choice.describe()}")
            except MemoryError as e:
                print(f"auto-fit: {e}")
        print(result.verdict())
    return 0 if result.fits else PLAN_DOES_NOT_FIT


def cmd_validate_data(args) -> int:
    """Check a JSONL dataset: FILE:LINE: problem — fix. Exit 0 clean (warnings allowed), 1 errors, 2 unreadable."""
    from .data import check_jsonl
    from .models import embedded_model_dir, load_tokenizer

    tokenizer = None
    if args.model:
        tokenizer = load_tokenizer(args.model)
    elif (embedded_model_dir() / "tokenizer.json").exists():
        tokenizer = load_tokenizer(str(embedded_model_dir()))
    report = check_jsonl(args.path, completion_only_loss=not args.all_tokens, tokenizer=tokenizer,
                         max_length=args.max_length)
    print(report.text(limit=args.limit))
    if tokenizer is None:
        print("(length check skipped: pass --model to count tokens with your model's tokenizer)")
    return report.exit_code


def cmd_export(args) -> int:
    """Merge a run's adapter into 16-bit, write GGUF files, check their greedy answers, write an Ollama Modelfile.
    Exit 0 when every F16 GGUF answers as the merged model, 1 when one does not, 2 for bad input."""
    from .data import load_rows
    from .export import GGUF_KINDS, export_gguf, merge_adapter
    from .runs import load_run

    kinds = [k.strip().lower() for k in args.gguf.split(",") if k.strip()]
    if not kinds or any(k not in GGUF_KINDS for k in kinds):
        raise ConfigError(f"--gguf {args.gguf!r}: a comma list of {', '.join(GGUF_KINDS)}")
    try:
        run = load_run(args.run)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    cfg = RunConfig.from_dict(run.config)
    start = time.perf_counter()
    _, merged_dir = merge_adapter(run.path, run.path / "merged")
    print(f"[export] merged 16-bit model: {merged_dir} ({time.perf_counter() - start:.1f} s)")
    conversations = None
    if args.prompts and cfg.eval_file:
        conversations = [r["prompt"] for r in load_rows(cfg.eval_file, cfg, args.prompts)]
    results = export_gguf(merged_dir, kinds, conversations, cfg.max_new_tokens, out_dir=run.path / "gguf")
    wrong = [r for r in results if r.kind == "f16" and r.total and r.agree != r.total]
    for r in wrong:
        print(f"error: {r.path.name} answers differently from the merged model on {r.total - r.agree} prompt(s)",
              file=sys.stderr)
    return 1 if wrong else 0


def cmd_course(args) -> int:
    """Execute every numbered notebook in order (what `make run` does) and keep the executed copies."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from .runs import resolve_run

    notebooks_dir = PROJECT_ROOT / "notebooks"
    paths = sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb"))
    executed, started, failure = [], time.time(), None
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t0 = time.time()
        print(f"[course] running {path.name} ...", flush=True)
        client = NotebookClient(nb, timeout=args.cell_timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(notebooks_dir)}})
        try:
            client.execute()
        except CellExecutionError as e:
            failure = (path.name, e)
        executed.append((path.name, nb))
        print(f"[course] {path.name}: {'FAILED' if failure else 'ok'} in {time.time() - t0:.0f} s", flush=True)
        if failure:
            break
    latest = PROJECT_ROOT / "runs" / "latest"
    target = (resolve_run(latest) if latest.exists() else PROJECT_ROOT / "runs" / "course-without-run") / "notebooks"
    target.mkdir(parents=True, exist_ok=True)
    for name, nb in executed:
        nbformat.write(nb, target / name)
    print(f"[course] executed notebooks saved in {target} ({time.time() - started:.0f} s in all)")
    if failure:
        print(f"[course] {failure[0]} failed:\n{failure[1]}", file=sys.stderr)
        return 1
    summary = target.parent / "summary.json"
    if summary.exists():
        print(f"[course] run summary ({summary}):\n{summary.read_text()}")
    return 0


def cmd_clean_notebooks(args) -> int:
    """Strip outputs, execution counts and widget state, the way notebooks are committed."""
    import nbformat

    paths = [Path(p) for p in args.paths] or sorted((PROJECT_ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            cell.metadata = {k: v for k, v in cell.metadata.items() if k in ("tags",)}
        nb.metadata = {k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info")}
        nbformat.write(nb, path)
        print(f"cleaned {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nb_helpers", description="QLoRA on a 4 GB GPU: helper commands")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("env", help="print the environment report (OK/WARN/FAIL) and a recommended config")
    p.add_argument("--no-hub", action="store_true", help="skip the Hugging Face Hub reachability check")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("config", help="print (or write) this machine's default config as JSON")
    p.add_argument("-o", "--output", help="write to this file instead of printing")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("plan", help="will it fit? predicted peak GPU memory from config.json alone (exit 0 fits, 3 not)")
    p.add_argument("--config", help="JSON config file (see `config`) to plan; default: the reference recipe")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob, e.g. lora_r=16")
    p.add_argument("--model", help="hub id, local folder or config.json (default: the config's, else the model "
                   "training would pick)")
    p.add_argument("--seq", type=int, help="tokens per sequence (max_length; default: the config's, 512)")
    p.add_argument("--batch", type=int, help="micro-batch: sequences per forward pass (default: the config's, 1)")
    p.add_argument("--accum", type=int, help="gradient accumulation steps (default: the config's, 8)")
    p.add_argument("--rank", type=int, help="LoRA rank r (default: the config's, 8)")
    p.add_argument("--budget", type=float, help="GiB the card has, CUDA context included (default: the config's "
                   "budget_gib, else 4)")
    p.add_argument("--targets", help="comma list, or all-linear (default: the config's, q,k,v,o; Phi's fused layers "
                   "are found from these names)")
    p.add_argument("--no-gc", action="store_true", help="without gradient checkpointing")
    p.add_argument("--context-gib", type=float, default=None,
                   help="CUDA context size (default: measured on this GPU, else 0.30 for consumer cards)")
    p.add_argument("--optim", help="paged_adamw_8bit, adamw_8bit, adamw_torch, ... (default: the config's)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], help="compute dtype (default: by compute capability)")
    p.add_argument("--gpu-capability", help="e.g. 7.5 for a GTX 1650 (default: this GPU, else 7.5)")
    p.add_argument("--dropout", type=float, help="LoRA dropout (0 saves its masks; default: the config's, 0.05)")
    p.add_argument("--no-double-quant", action="store_true", help="fp32 quantization constants")
    p.add_argument("--labelled-fraction", type=float, default=1.0,
                   help="share of tokens with a loss (default 1.0, the worst case)")
    p.add_argument("--auto-fit", action="store_true", help="also print the fastest micro-batch x accumulation that fits")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("train", help="headless training, the same as notebook 03; on several GPUs: "
                                     "accelerate launch --multi_gpu --num_processes N -m nb_helpers train ...")
    p.add_argument("--config", help="JSON config file (see `config`); default: this machine's default config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob, e.g. lora_r=16")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("validate-data", help="check a JSONL dataset (exit 0 clean, 1 errors, 2 unreadable)")
    p.add_argument("path")
    p.add_argument("--model", help="tokenizer to count tokens with (default: the embedded model's, if present)")
    p.add_argument("--max-length", type=int, default=RunConfig().max_length, help="warn about rows longer than this")
    p.add_argument("--all-tokens", action="store_true", help="loss on all tokens (completion_only_loss=False)")
    p.add_argument("--limit", type=int, default=200, help="most problems to print")
    p.set_defaults(func=cmd_validate_data)

    p = sub.add_parser("export", help="merged 16-bit model -> GGUF (f16, q8_0), checked, + Ollama Modelfile")
    p.add_argument("--run", default=str(PROJECT_ROOT / "runs" / "latest"), help="run folder (default: runs/latest)")
    p.add_argument("--gguf", default="f16,q8_0", help="comma list of GGUF kinds: f16, q8_0")
    p.add_argument("--prompts", type=int, default=12,
                   help="held-out prompts whose greedy answers each GGUF must reproduce (0 skips the check)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("course", help="execute notebooks 00-05 in order and keep them in the run folder (make run)")
    p.add_argument("--cell-timeout", type=int, default=3600, help="seconds one cell may run")
    p.set_defaults(func=cmd_course)

    p = sub.add_parser("clean-notebooks", help="strip outputs and execution counts (before committing)")
    p.add_argument("paths", nargs="*", help="notebooks to clean; default: notebooks/*.ipynb")
    p.set_defaults(func=cmd_clean_notebooks)
    return parser


def main(argv=None) -> int:
    from .data import DataError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
