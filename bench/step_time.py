"""Step time and GPU-busy time of real training runs (GPU only): what nb_helpers.plan.step_time predicts, measured.

Each point is `nb_helpers.training.train` (the user's path) in a fresh process, on a random-weight model shape under
an emulated budget, for a few optimizer steps: 3 warm-up steps, the median of the next ones (wall time, synchronized)
and one profiled step at the end (torch.profiler: the union of kernel and copy intervals, and the kernel time by
kind: matmul, attention, dequantize, copy, other). The peak memory is read as bench/planner_grid.py reads it, so
the same rows validate the planner. The rows go to a run file (bench/run_file.py) as they finish, and with --out
also to that file as JSON lines.

    python bench/step_time.py --points fit,cards26 --out-dir $OUT     # on the lent device; cp back into runs/
    python bench/step_time_report.py      # every step-time run file and raw step_time-*.jsonl: predicted against measured

FIT points set the time model's constants (nb_helpers/plan/step_time.py); the CARDS26 points of bench/planner_grid.py
(six families, 256 to 4,096 tokens, r 8 to 32, GC on and off) are held out to validate it.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import add_out_dir  # noqa: E402

from planner_grid import CARDS26, QKVO, peak_memory, write_rows  # noqa: E402

WARMUP = 3
# (id, shape, seq, micro-batch, accumulation, rank, targets, GC, budget GiB, extra RunConfig fields)
FIT = [
    ("s1", "tinyllama-1.1b", 512, 8, 1, 8, QKVO, True, 4, {"cuda_graphs": True}),    # auto-fit's W512 choice
    ("s2", "tinyllama-1.1b", 2048, 8, 1, 8, QKVO, True, 4, {"offload_checkpoints": True}),  # and W2048's
    ("s3", "tinyllama-1.1b", 512, 1, 8, 8, QKVO, True, 4, {}),                          # the recipe's settings
    ("s4", "tinyllama-1.1b", 1024, 2, 4, 8, QKVO, True, 4, {"cuda_graphs": True}),
    ("s5", "tinyllama-1.1b", 512, 2, 4, 16, "all-linear", False, 8, {}),
    ("s6", "llama-3.2-1b", 1024, 4, 2, 8, QKVO, True, 8, {}),
    ("s7", "smollm2-135m", 512, 8, 1, 8, QKVO, True, 4, {"cuda_graphs": True}),
    ("s8", "qwen3-1.7b", 1024, 1, 4, 8, QKVO, True, 8, {}),
]
SETS = {"fit": FIT, "cards26": [(*p, {}) for p in CARDS26]}


def config_for(point, model_dir: Path, data: Path, work: Path, steps: int) -> dict:
    pid, shape, seq, batch, accum, rank, targets, gc, budget, extra = point
    return dict(model=str(model_dir), train_file=str(data), eval_file=None, task_eval_samples=0, max_length=seq,
                micro_batch_size=batch, grad_accum=accum, lora_r=rank, lora_alpha=2 * rank,
                target_modules=targets.split(",") if targets != "all-linear" else ["all-linear"],
                gradient_checkpointing=gc, max_steps=steps, save_steps=10_000, budget_gib=budget,
                runs_dir=str(work / "runs"), run_name=pid, compute_dtype="bfloat16", **{"fast_path": True, **extra})


def worker(config_path: str, out_path: str) -> None:
    """One run in this process, the last step profiled."""
    from throughput import Recorder

    from nb_helpers.config import RunConfig
    from nb_helpers.training import train

    cfg = RunConfig.from_dict(json.loads(Path(config_path).read_text()))
    recorder = Recorder({"steps": cfg.max_steps, "profile": True})
    run = train(cfg, listeners=[lambda r: recorder.step_done(r) if "loss" in r else None], verbose=True)
    Path(out_path).write_text(json.dumps({"busy": getattr(recorder, "busy", None), "run": str(run)}))


def measure(point, model_dir: Path, work: Path, steps: int) -> dict:
    from transformers import AutoTokenizer

    pid, shape, seq, batch, accum, rank, targets, gc, budget, extra = point
    data = work / f"{pid}.jsonl"
    write_rows(AutoTokenizer.from_pretrained(model_dir), data, steps * batch * accum, seq, seed=seq)
    config_path, out_path = work / f"{pid}.json", work / f"{pid}.out"
    config_path.write_text(json.dumps(config_for(point, model_dir, data, work, steps)))
    start = time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(config_path),
                           str(out_path)], capture_output=True, text=True, timeout=400, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))})
    row = dict(id=pid, shape=shape, seq=seq, batch=batch, accum=accum, rank=rank, targets=targets, gc=gc,
               budget_gib=budget, extra=extra, wall_s=round(time.time() - start, 1), returncode=proc.returncode)
    run = work / "runs" / pid
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    steps_done = [m for m in metrics if "loss" in m]
    timed = steps_done[WARMUP:-1]  # the last step is profiled: not timed
    if timed:
        row.update(median_step_s=statistics.median(m["step_s"] for m in timed),
                   step_s_all=[round(m["step_s"], 4) for m in steps_done],
                   tokens_per_step=statistics.median(m.get("tokens", 0) for m in timed), **peak_memory(steps_done))
        row["profiled_tokens"] = steps_done[-1].get("tokens")
    if out_path.exists():
        row["busy"] = json.loads(out_path.read_text()).get("busy")
    if (run / "summary.json").exists():
        summary = json.loads((run / "summary.json").read_text())
        chosen = json.loads((run / "config.json").read_text())
        row.update(context_gib=summary.get("cuda_context_gib"), predicted_at_run_gib=summary.get("predicted_peak_gib"),
                   fast_levers=summary.get("fast_levers"),
                   chosen={k: chosen.get(k) for k in ("micro_batch_size", "grad_accum", "gradient_checkpointing",
                                                      "offload_checkpoints", "cuda_graphs")})
    row["log"] = [line for line in proc.stdout.splitlines() if line.startswith(("[fast]", "[plan]", "[auto-fit]"))]
    if proc.returncode != 0:
        row["error_tail"] = (proc.stderr or proc.stdout)[-1500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="fit,cards26", help="comma list of sets (fit, cards26) or point ids")
    parser.add_argument("--out", help="also append the rows to this JSON lines file")
    add_out_dir(parser)
    parser.add_argument("--steps", type=int, default=WARMUP + 4, help="optimizer steps per point (the last profiled)")
    parser.add_argument("--deadline-s", type=float, default=540, help="start no new point after this many seconds")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from build_tinyllama_shape import shape_dir
    from run_file import RunFile

    run_file = RunFile("step-time", out_dir=args.out_dir)
    result = {"points": args.points, "steps": args.steps, "rows": []}

    pool = {p[0]: p for points in SETS.values() for p in points}
    chosen = [p for name in args.points.split(",") for p in (SETS.get(name) or [pool[name]])]
    work, start = Path(tempfile.mkdtemp(prefix="step-time-")), time.time()
    for point in chosen:
        if time.time() - start > args.deadline_s:
            print(f"[step-time] deadline: {point[0]} and later points not run", flush=True)
            break
        row = measure(point, shape_dir(point[1]), work, args.steps)
        result["rows"].append(row)
        run_file.write(result)  # after every point: a time limit loses nothing
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        busy = row.get("busy") or {}
        print(f"[step-time] {row['id']:<4}{point[1]:<15}{point[2]:>5} b{point[3]}x{point[4]} gc={int(point[7])} "
              f"{row.get('median_step_s') or float('nan'):.3f} s/step busy {busy.get('busy_s') or float('nan'):.3f} s "
              f"dev {row.get('measured_gib') or float('nan'):.2f} GiB rc={row['returncode']} {row['wall_s']}s "
              f"{ {k: round(v, 3) for k, v in (busy.get('categories_s') or {}).items()} }", flush=True)


if __name__ == "__main__":
    main()
