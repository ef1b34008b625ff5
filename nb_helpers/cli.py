"""Command line: python -m nb_helpers {env,config,plan,train,validate-data,export,course,clean-notebooks} --help"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nb_helpers.config import PROJECT_ROOT, ConfigError, RunConfig, apply_sets, check_environment, default_config
from nb_helpers.plan_command import add_plan


def cmd_env(args) -> int:
    from nb_helpers.environment import check_environment

    report = check_environment(check_hub=not args.no_hub)
    print(report.text())
    return 1 if report.failed else 0


def cmd_config(args) -> int:
    cfg = apply_sets(default_config(), args.set)
    text = json.dumps(cfg.to_dict(), indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0


def run_config(args) -> RunConfig:
    """The config `train` runs for these options: --config (else this machine's default config), then each --set."""
    return apply_sets(RunConfig.load(args.config) if args.config else default_config(), args.set)


def cmd_train(args) -> int:
    """One process, or one of several under `accelerate launch` (then rank 0 alone prints and writes)."""
    from nb_helpers import distributed
    from nb_helpers.training import train

    if args.resume and (args.config or args.set):
        raise ConfigError("--resume continues a run with its own config.json; leave out --config and --set")
    with distributed.quiet_unless_main():
        if args.resume:
            run_dir = train(RunConfig(), resume_from=args.resume)
        else:
            run_dir = train(run_config(args))
    summary = json.loads((run_dir / "summary.json").read_text())
    distributed.finish()
    return 0 if summary.get("status") == "completed" else 1


def cmd_validate_data(args) -> int:
    """Check a JSONL dataset: FILE:LINE: problem — fix. Exit 0 clean (warnings allowed), 1 errors, 2 unreadable.
    Lengths are counted as `train` with the same --config/--set would count them: its max_length, its model."""
    from nb_helpers.data import check_jsonl
    from nb_helpers.models import embedded_model_dir, load_tokenizer

    cfg = run_config(args) if args.max_length is None else run_config(args).replace(max_length=args.max_length)
    embedded = embedded_model_dir() if (embedded_model_dir() / "tokenizer.json").exists() else None
    model = args.model or cfg.model or embedded
    tokenizer = load_tokenizer(str(model)) if model else None
    report = check_jsonl(args.path, completion_only_loss=cfg.completion_only_loss and not args.all_tokens,
                         tokenizer=tokenizer, max_length=cfg.max_length)
    print(report.text(limit=args.limit))
    where = "--max-length" if args.max_length is not None else "the config `train` runs with these options"
    print(f"(lengths counted against max_length {cfg.max_length}, from {where})" if tokenizer else
          "(length check skipped: pass --model to count tokens with your model's tokenizer)")
    return report.exit_code


def cmd_export(args) -> int:
    """Merge a run's adapter into 16-bit, write GGUF files and the adapter as GGUF, check each in llama.cpp against
    transformers, write Ollama Modelfiles. Exit 0 when every checked file passes its bar (nb_helpers/export/check.py),
    1 when one does not, 2 for bad input."""
    from nb_helpers.data import load_rows
    from nb_helpers.export import GGUF_KINDS, export_gguf, merge_adapter
    from nb_helpers.export.merge import base_folder
    from nb_helpers.models import resolve_model
    from nb_helpers.runs import load_run

    kinds = [k.strip().lower() for k in args.gguf.split(",") if k.strip()]
    if not kinds or any(k not in GGUF_KINDS for k in kinds):
        raise ConfigError(f"--gguf {args.gguf!r}: a comma list of {', '.join(GGUF_KINDS)}")
    try:
        run = load_run(args.run)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    check_export_folder(run.path)
    cfg = RunConfig.from_dict(run.config)
    start = time.perf_counter()
    merged_dir = merge_adapter(run.path, run.path / "merged")
    print(f"[export] merged 16-bit model: {merged_dir} ({time.perf_counter() - start:.1f} s)")
    conversations = None
    if args.prompts and cfg.eval_file:
        conversations = [r["prompt"] for r in load_rows(cfg.eval_file, cfg, args.prompts)]
    results = export_gguf(merged_dir, kinds, conversations, cfg.max_new_tokens, out_dir=run.path / "gguf",
                          adapter_dir=run.path / "adapter", base_dir=base_folder(resolve_model(cfg, False).path))
    wrong = [r for r in results if r.passed is False]
    for r in wrong:
        print(f"error: {r.path.name} answers differently in llama.cpp from the merged model in transformers: "
              f"{r.agreement.line()}", file=sys.stderr)
    return 1 if wrong else 0


def check_export_folder(run_dir: Path) -> None:
    """Before anything is merged: export writes merged/ and gguf/ into the run folder, so it must be writable and
    neither may be a file (a `merged` file let export say it had saved the merged model, then fail)."""
    import os
    import tempfile

    for name in ("merged", "gguf"):
        if (run_dir / name).exists() and not (run_dir / name).is_dir():
            raise ConfigError(f"{run_dir / name} is a file: export writes the {name} folder there. Move or delete that "
                              "file, then export again")
    try:
        handle, probe = tempfile.mkstemp(prefix=".write-check-", dir=run_dir)
        os.close(handle)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--run {run_dir}: export cannot write into the run folder ({e.strerror or e}); make it "
                          "writable, or copy the run folder to a disk you can write and export the copy") from None


def cmd_course(args) -> int:
    """Execute every numbered notebook in order (what `make run` does) and keep the executed copies."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from nb_helpers.runs import resolve_run

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
    folders = [target] + ([Path(args.executed_dir)] if args.executed_dir else [])
    for folder in folders:  # the run's copies, and with --executed-dir the ones the README links
        folder.mkdir(parents=True, exist_ok=True)
        for name, nb in executed:
            nbformat.write(nb, folder / name)
    print(f"[course] executed notebooks saved in {', '.join(map(str, folders))} ({time.time() - started:.0f} s in all)")
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
    for path, nb in read_notebooks(paths):  # every one read before any is rewritten
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            cell.metadata = {k: v for k, v in cell.metadata.items() if k in ("tags",)}
        nb.metadata = {k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info")}
        nbformat.write(nb, path)
        print(f"cleaned {path}")
    return 0


def read_notebooks(paths: list[Path]) -> list[tuple[Path, object]]:
    """The notebooks `clean-notebooks` rewrites in place, all read first: a path that is missing, a folder or not a
    notebook is one line naming it, found before any file is rewritten (it was a traceback after the first ones)."""
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


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="print the environment report (OK/WARN/FAIL) and a recommended config")
    p.add_argument("--no-hub", action="store_true", help="skip the Hugging Face Hub reachability check")
    p.set_defaults(func=cmd_env)


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="print (or write) this machine's default config as JSON")
    p.add_argument("-o", "--output", help="write to this file instead of printing")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob")
    p.set_defaults(func=cmd_config)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="headless training, the same as notebook 03; on several GPUs: "
                                     "accelerate launch --multi_gpu --num_processes N -m nb_helpers train ...")
    p.add_argument("--config", help="JSON config file (see `config`); default: this machine's default config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob, e.g. lora_r=16")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
    p.set_defaults(func=cmd_train)


def count(text: str) -> int:
    """argparse's type for a count the user gives (--limit, --prompts): a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give 0 or more") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def _add_validate_data(sub) -> None:
    p = sub.add_parser("validate-data", help="check a JSONL dataset (exit 0 clean, 1 errors, 2 unreadable)")
    p.add_argument("path")
    p.add_argument("--model", help="tokenizer to count tokens with (default: the config's model, else the embedded one)")
    p.add_argument("--config", help="JSON config file whose max_length and model to check against (see `config`)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob, as for train")
    p.add_argument("--max-length", type=int, help="warn about rows longer than this (default: the config's)")
    p.add_argument("--all-tokens", action="store_true", help="loss on all tokens (completion_only_loss=False)")
    p.add_argument("--limit", type=count, default=200, help="most problems to print")
    p.set_defaults(func=cmd_validate_data)


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="merged 16-bit model -> GGUF (f16, q8_0, q4_k_m) and the adapter as GGUF, "
                       "checked in llama.cpp, + Ollama Modelfiles")
    p.add_argument("--run", default=str(PROJECT_ROOT / "runs" / "latest"), help="run folder (default: runs/latest)")
    p.add_argument("--gguf", default="f16,q8_0", help="comma list of GGUF kinds: f16, q8_0, q4_k_m")
    p.add_argument("--prompts", type=count, default=12,
                   help="held-out prompts whose greedy answers each GGUF must reproduce in llama.cpp (0 skips the check)")
    p.set_defaults(func=cmd_export)


def _add_course(sub) -> None:
    p = sub.add_parser("course", help="execute notebooks 00-07 in order and keep them in the run folder (make run)")
    p.add_argument("--cell-timeout", type=int, default=3600, help="seconds one cell may run")
    p.add_argument("--executed-dir", help="also save the executed notebooks here (make executed: docs/executed)")
    p.set_defaults(func=cmd_course)


def _add_clean_notebooks(sub) -> None:
    p = sub.add_parser("clean-notebooks", help="strip outputs and execution counts (before committing)")
    p.add_argument("paths", nargs="*", help="notebooks to clean; default: notebooks/*.ipynb")
    p.set_defaults(func=cmd_clean_notebooks)


SUBCOMMANDS = (_add_env, _add_config, add_plan, _add_train, _add_validate_data, _add_export, _add_course,
               _add_clean_notebooks)  # in the order --help lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nb_helpers", description="QLoRA on a 4 GB GPU: helper commands")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    from nb_helpers.data import DataError

    args = build_parser().parse_args(argv)
    try:
        check_environment()  # NB_CACHE_DIR, NB_FASTPATH, WORLD_SIZE, ...: one line each, before anything loads
        return args.func(args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a run's folder is already marked and unlocked (training.train)
        print("stopped (Ctrl-C)", file=sys.stderr)
        return 130
