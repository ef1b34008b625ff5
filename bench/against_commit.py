"""Our default GPU path at this commit against a baseline commit's, alternating on one GPU in one call.

Absolute speed moves by up to 1.5x between hosts of the same GPU kind, so "is the engine still as fast as it was?"
has one honest answer: run both engines on the same card, back to back, more than once. Each round runs the baseline
tree's own bench/throughput.py and then this tree's, both `--only ours` (our default: auto-fit, CUDA graphs, every
lever that commit ships) at the same workloads and steps, each in fresh processes on the same random-weight model
and data. The run file keeps every round's figures and, per workload, the median of each engine and their ratio.

    git archive 22d453c nb_helpers bench data pyproject.toml | tar -x -C /tmp/baseline     # where the history is
    python bench/against_commit.py --tree /tmp/baseline --baseline-commit 22d453c --out-dir $OUT   # on the GPU

Both scripts measure the same way (bench/throughput.py: median step after warm-up, non-padding tokens, and the
GPU compute of one profiled step per token), so their figures compare directly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_file import RunFile, add_out_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def ours_figures(data: dict) -> dict:
    """Per workload, our default's figures from either script's output: a run file (results.workloads) or the
    single throughput.json older scripts wrote (workloads at the top)."""
    workloads = (data.get("results") or data).get("workloads") or {}
    out = {}
    for name, workload in workloads.items():
        run = workload.get("ours") or (workload.get("runs") or {}).get("ours")
        if not run or run.get("returncode", 0) != 0 or not run.get("tokens_per_s"):
            continue
        busy = run.get("busy") or {}
        out[name] = {"tokens_per_s": run["tokens_per_s"], "compute_us_per_token": busy.get("compute_us_per_token"),
                     "us_per_token": busy.get("us_per_token"), "median_step_s": run.get("median_step_s"),
                     "peak_device_gib": run.get("peak_device_gib"), "micro_batch": run.get("micro_batch")}
    return out


def compare(rounds: list[dict]) -> dict:
    """Per workload: each engine's median over the rounds, and now / baseline (tokens/s: above 1 is faster now;
    GPU compute per token: below 1 is less work now)."""
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
    return out


def run_engine(tree: Path, commit: str | None, args, out_json: Path) -> dict:
    """One engine's `--only ours` run, its own script and package, in a fresh process."""
    command = [sys.executable, str(tree / "bench" / "throughput.py"), "--workloads", args.workloads, "--only", "ours",
               "--steps", str(args.steps), "--model-dir", args.model_dir, "--out", str(out_json)]
    env = {**os.environ, "BENCH_COMMIT": commit or ""}
    started = time.time()
    proc = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=args.run_timeout_s)
    print(proc.stdout[-1500:], proc.stderr[-1500:] if proc.returncode else "", sep="\n", flush=True)
    figures = ours_figures(json.loads(out_json.read_text())) if out_json.exists() else {}
    return {"returncode": proc.returncode, "wall_s": round(time.time() - started, 1), "figures": figures}


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", required=True, help="the baseline commit's files (nb_helpers, bench, data)")
    parser.add_argument("--baseline-commit", required=True, help="which commit --tree holds, for the run file")
    parser.add_argument("--workloads", default="w2048,w512")
    parser.add_argument("--rounds", type=int, default=2, help="baseline then now, this many times")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--model-dir", default="/tmp/shape-tinyllama-1.1b")
    parser.add_argument("--run-timeout-s", type=float, default=240)
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no new engine run after this many s")
    add_out_dir(parser)
    return parser.parse_args(argv)


def shown(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: dict, baseline_commit: str) -> None:
    print(f"\n{'workload':10} {'tok/s baseline':>14} {'tok/s now':>10} {'now/baseline':>12} "
          f"{'us/tok baseline':>15} {'us/tok now':>11} {'now/baseline':>12}   (baseline = {baseline_commit})")
    for workload, row in summary.items():
        base, now, ratio = row["baseline"], row["now"], row["now_over_baseline"]
        print(f"{workload:10} {shown(base['tokens_per_s'], ',.0f'):>14} {shown(now['tokens_per_s'], ',.0f'):>10} "
              f"{shown(ratio['tokens_per_s'], '.3f'):>12} {shown(base['compute_us_per_token'], '.2f'):>15} "
              f"{shown(now['compute_us_per_token'], '.2f'):>11} {shown(ratio['compute_us_per_token'], '.3f'):>12}")


def main(argv=None) -> None:
    args = arguments(argv)
    tree = Path(args.tree).resolve()
    if not (tree / "bench" / "throughput.py").exists():
        raise SystemExit(f"--tree {tree}: no bench/throughput.py there; extract the baseline commit with "
                         f"`git archive COMMIT nb_helpers bench data pyproject.toml | tar -x -C DIR`")
    run = RunFile("against-commit", out_dir=args.out_dir)
    started, rounds, log = time.time(), [], []
    with tempfile.TemporaryDirectory() as work:
        for index in range(args.rounds):
            rounds.append({})
            for engine, where, commit in (("baseline", tree, args.baseline_commit), ("now", ROOT, None)):
                if time.time() - started > args.deadline_s:
                    break
                result = run_engine(where, commit or run.header["commit"], args,
                                    Path(work) / f"{engine}-{index}.json")
                rounds[-1][engine] = result["figures"]
                log.append({"round": index + 1, "engine": engine, "returncode": result["returncode"],
                            "wall_s": result["wall_s"]})
                run.write({"baseline_commit": args.baseline_commit, "workloads": args.workloads, "steps": args.steps,
                           "rounds": rounds, "runs": log, "summary": compare(rounds)})
    print_table(compare(rounds), args.baseline_commit)


if __name__ == "__main__":
    main()
