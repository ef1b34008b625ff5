"""Our default GPU path at this commit against a baseline commit's, alternating on one GPU in one call.

Absolute speed moves by up to 1.5x between hosts of the same GPU kind, so "is the engine still as fast as it was?"
has one honest answer: run both engines on the same card, back to back, more than once. Each round runs the baseline
tree's own bench/throughput.py and this tree's, the baseline first in the first round and second in the next, and so
on (a host that drifts over the call weighs on both alike), both `--only ours` (our default: auto-fit, CUDA graphs,
every lever that commit ships) at the same workloads and steps, each in fresh processes on the same random-weight
model and data. The run file keeps every round's figures and, per workload, the median of each engine and their ratio.
With --with-reference the reference recipe (this tree's) runs first, once, so each engine's speed over it comes from
the same card and host: the reference follows the host's CPU far more than either engine does.

    python bench/against_commit.py --extract 22d453c                 # here, where the history is: bench/baseline/
    python bench/against_commit.py --out-dir $OUT                    # on the GPU (carry bench/baseline)
    python bench/against_commit.py --with-reference --rounds 1 --out-dir $OUT   # and both against the reference

--extract writes the baseline's package, bench scripts and data to bench/baseline/ (git-ignored), with
BASELINE.json naming its commit and date. Both scripts measure the same way (bench/throughput.py: median step after
warm-up, non-padding tokens, and the GPU compute of one profiled step per token), so their figures compare directly.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_file import RunFile, add_out_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASELINE_TREE = ROOT / "bench" / "baseline"
BASELINE_PATHS = ("nb_helpers", "bench", "data", "pyproject.toml")  # what its throughput.py runs on


def extract(commit: str, tree: Path) -> dict:
    """The baseline commit's files into `tree` (its bench/results left out: history, not code), and BASELINE.json."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *BASELINE_PATHS], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--extract {commit}: git archive failed ({archive.stderr.decode().strip()}); "
                         "give a commit of this repository's history")
    shutil.rmtree(tree, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    shutil.rmtree(tree / "bench" / "results", ignore_errors=True)
    shown = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %cs", commit], capture_output=True,
                           text=True, check=True).stdout.split()
    baseline = {"commit": shown[0], "date": shown[1]}
    (tree / "BASELINE.json").write_text(json.dumps(baseline) + "\n")
    return baseline


def read_baseline(tree: Path) -> dict:
    try:
        return json.loads((tree / "BASELINE.json").read_text())
    except (OSError, ValueError):
        raise SystemExit(f"{tree}: no baseline there; extract one first where the git history is: "
                         f"python bench/against_commit.py --extract COMMIT") from None


def ours_figures(data: dict, recipe: str = "ours") -> dict:
    """Per workload, our default's figures (or the reference's) from either script's output: a run file
    (results.workloads) or the single throughput.json older scripts wrote (workloads at the top)."""
    workloads = (data.get("results") or data).get("workloads") or {}
    out = {}
    for name, workload in workloads.items():
        run = workload.get(recipe) or (workload.get("runs") or {}).get(recipe)
        if not run or run.get("returncode", 0) != 0 or not run.get("tokens_per_s"):
            continue
        busy = run.get("busy") or {}
        out[name] = {"tokens_per_s": run["tokens_per_s"], "compute_us_per_token": busy.get("compute_us_per_token"),
                     "us_per_token": busy.get("us_per_token"), "median_step_s": run.get("median_step_s"),
                     "peak_device_gib": run.get("peak_device_gib"), "micro_batch": run.get("micro_batch")}
    return out


def compare(rounds: list[dict], reference: dict | None = None) -> dict:
    """Per workload: each engine's median over the rounds, and now / baseline (tokens/s: above 1 is faster now;
    GPU compute per token: below 1 is less work now); with the reference's figures, each engine's tokens/s over
    the reference's."""
    out = {}
    for workload in sorted({w for r in rounds for engine in r.values() for w in engine}):
        medians = {}
        for engine in ("baseline", "now"):
            seen = [r[engine][workload] for r in rounds if workload in r.get(engine, {})]
            medians[engine] = {key: statistics.median(v) if (v := [s[key] for s in seen if s[key] is not None])
                               else None for key in ("tokens_per_s", "compute_us_per_token")}
            medians[engine]["rounds"] = len(seen)
        baseline, now = medians["baseline"], medians["now"]
        ratio = {key: now[key] / baseline[key] if now[key] and baseline[key] else None
                 for key in ("tokens_per_s", "compute_us_per_token")}
        out[workload] = {**medians, "now_over_baseline": ratio}
        if (ref := (reference or {}).get(workload, {}).get("tokens_per_s")):
            out[workload]["reference"] = {"tokens_per_s": ref}
            out[workload]["over_reference"] = {engine: medians[engine]["tokens_per_s"] / ref
                                               if medians[engine]["tokens_per_s"] else None
                                               for engine in ("baseline", "now")}
    return out


def run_engine(tree: Path, commit: str | None, args, out_json: Path, recipe: str = "ours") -> dict:
    """One engine's `--only ours` run (or the reference recipe's), its own script and package, in a fresh process."""
    command = [sys.executable, str(tree / "bench" / "throughput.py"), "--workloads", args.workloads, "--only", recipe,
               "--steps", str(args.steps), "--model-dir", args.model_dir, "--out", str(out_json)]
    env = {**os.environ, "BENCH_COMMIT": commit or ""}
    started = time.time()
    # its own process group: a run past its time is stopped with the workers it started, which then free the GPU
    proc = subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.run_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\n(stopped after --run-timeout-s {args.run_timeout_s:g})"
    print(output[-2000:], flush=True)
    figures = ours_figures(json.loads(out_json.read_text()), recipe) if out_json.exists() else {}
    return {"returncode": proc.returncode, "wall_s": round(time.time() - started, 1), "figures": figures}


def round_order(index: int) -> tuple[str, str]:
    """The engines of round `index` (from 0) in the order they run: the baseline first in even rounds, this tree's
    first in odd ones. At 8 x 2048 one engine's tokens/s moved by 10% between two runs on one warm H200 (the host
    keeps the GPU waiting), so a fixed order would lay any drift over the call on the engine that always runs last."""
    return ("baseline", "now") if index % 2 == 0 else ("now", "baseline")


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extract", metavar="COMMIT", help="write COMMIT's files to --tree, then stop")
    parser.add_argument("--tree", default=str(BASELINE_TREE), help="the baseline's files (default bench/baseline)")
    parser.add_argument("--workloads", default="w2048,w512")
    parser.add_argument("--rounds", type=int, default=2,
                        help="both engines this many times, their order swapped each round")
    # 40: at 8 x 2048 both engines ran spells of steps 10-40% slower than their own median on an H100 (2026-12-07);
    # a median over 13 timed steps can land inside one
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model-dir", default="/tmp/shape-tinyllama-1.1b")
    parser.add_argument("--run-timeout-s", type=float, default=240)
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no new engine run after this many s")
    parser.add_argument("--with-reference", action="store_true",
                        help="first run the reference recipe once: each engine's tokens/s over it, same host")
    add_out_dir(parser)
    return parser.parse_args(argv)


def shown(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: dict, baseline: dict) -> None:
    print(f"\n{'workload':10} {'tok/s baseline':>14} {'tok/s now':>10} {'now/baseline':>12} "
          f"{'us/tok baseline':>15} {'us/tok now':>11} {'now/baseline':>12}   (baseline: {baseline['date']})")
    for workload, row in summary.items():
        base, now, ratio = row["baseline"], row["now"], row["now_over_baseline"]
        print(f"{workload:10} {shown(base['tokens_per_s'], ',.0f'):>14} {shown(now['tokens_per_s'], ',.0f'):>10} "
              f"{shown(ratio['tokens_per_s'], '.3f'):>12} {shown(base['compute_us_per_token'], '.2f'):>15} "
              f"{shown(now['compute_us_per_token'], '.2f'):>11} {shown(ratio['compute_us_per_token'], '.3f'):>12}")
    for workload, row in summary.items():
        if "reference" in row:
            over = row["over_reference"]
            print(f"{workload:10} the reference {row['reference']['tokens_per_s']:,.0f} tok/s: baseline "
                  f"{shown(over['baseline'], '.2f')}x, now {shown(over['now'], '.2f')}x")


def main(argv=None) -> None:
    args = arguments(argv)
    tree = Path(args.tree).resolve()
    if args.extract:
        print(f"{tree}: the baseline of {extract(args.extract, tree)['date']}")
        return
    baseline = read_baseline(tree)
    run = RunFile("against-commit", out_dir=args.out_dir)
    started, rounds, log, reference = time.time(), [], [], None
    engines = {"baseline": (tree, baseline["commit"]), "now": (ROOT, run.header["commit"])}  # where each runs from
    with tempfile.TemporaryDirectory() as work:
        if args.with_reference:  # once: the reference's speed is the host's, not an engine's
            result = run_engine(ROOT, run.header["commit"], args, Path(work) / "reference.json", "reference")
            reference = result["figures"]
            log.append({"round": 0, "engine": "reference", "returncode": result["returncode"],
                        "wall_s": result["wall_s"]})
        for index in range(args.rounds):
            if time.time() - started > args.deadline_s:
                break
            rounds.append({})
            for engine in round_order(index):
                if time.time() - started > args.deadline_s:
                    break
                where, commit = engines[engine]
                result = run_engine(where, commit, args, Path(work) / f"{engine}-{index}.json")
                rounds[-1][engine] = result["figures"]
                log.append({"round": index + 1, "engine": engine, "returncode": result["returncode"],
                            "wall_s": result["wall_s"]})
                run.write({"baseline": baseline, "workloads": args.workloads, "steps": args.steps,
                           "rounds": rounds, "runs": log, "reference": reference,
                           "summary": compare(rounds, reference)})
    print_table(compare(rounds, reference), baseline)


if __name__ == "__main__":
    main()
