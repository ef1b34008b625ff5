"""Measure the real peak memory of QLoRA training for a grid of configs (GPU only), one fresh process per point.

Each point is a real `python -m nb_helpers train` run (the user's path) on a random-weight model shape, under an
emulated budget, for a few optimizer steps. The peak is read the two ways the issue asks for: NVML's device "used"
minus the baseline before the process touched CUDA (context included, sampled every step) and PyTorch's
max_memory_reserved. Rows are written to a run file (bench/run_file.py) as they finish, so a time limit loses
nothing, and with --out also appended to that file as JSON lines.

    python bench/planner_grid.py --points all --out-dir $OUT       # on the lent device; cp back into runs/
    python bench/planner_grid.py --points f1,f2,f6,f7 --out /tmp/grid.jsonl

Shapes are built once per machine under /tmp/shape-<name> (bench/build_tinyllama_shape.py), any family it knows.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import add_out_dir  # noqa: E402

QKVO = "q_proj,k_proj,v_proj,o_proj"
# (id, shape, seq, micro-batch, accumulation, rank, targets, gradient checkpointing, budget GiB)
POINTS = [
    ("t1", "tinyllama-1.1b", 512, 1, 8, 8, QKVO, True, 4),      # the reference recipe
    ("t2", "tinyllama-1.1b", 512, 8, 1, 8, QKVO, True, 4),
    ("t3", "tinyllama-1.1b", 512, 1, 1, 8, QKVO, False, 4),
    ("t4", "tinyllama-1.1b", 1024, 4, 1, 16, "all-linear", True, 4),
    ("t5", "tinyllama-1.1b", 2048, 1, 2, 8, QKVO, True, 4),
    ("t6", "tinyllama-1.1b", 2048, 2, 1, 64, "all-linear", True, 48),
    ("t7", "tinyllama-1.1b", 2048, 1, 1, 8, QKVO, False, 48),
    ("t8", "tinyllama-1.1b", 4096, 1, 1, 8, QKVO, True, 48),
    ("t9", "tinyllama-1.1b", 4096, 1, 1, 32, "all-linear", True, 48),
    ("s1", "smollm2-135m", 512, 8, 1, 8, QKVO, False, 4),
    ("s2", "smollm2-135m", 1024, 4, 1, 16, "all-linear", True, 4),
    ("s3", "smollm2-135m", 2048, 4, 1, 8, QKVO, True, 4),
    ("s4", "smollm2-135m", 4096, 2, 1, 8, QKVO, False, 48),
    ("s5", "smollm2-135m", 4096, 4, 1, 64, "all-linear", True, 48),
    ("l1", "llama-3.2-3b", 512, 1, 1, 8, QKVO, True, 4),
    ("l2", "llama-3.2-3b", 2048, 1, 1, 8, QKVO, True, 48),
    ("l3", "llama-3.2-3b", 1024, 2, 1, 16, "all-linear", True, 48),
    ("l4", "llama-3.2-3b", 4096, 1, 1, 8, QKVO, True, 48),
    ("l5", "llama-3.2-3b", 512, 4, 1, 8, QKVO, False, 48),
    ("l6", "llama-3.2-3b", 4096, 2, 1, 16, "all-linear", True, 48),
]
# Second call: points the planner's two fitted constants never saw (held out), plus the two that failed above
# with a budget too small for them (s1 ran out of memory at 4 GiB as the planner predicts; l1's 3B weights need
# more than 4 GiB), re-measured with room.
HOLDOUT = [
    ("s1b", "smollm2-135m", 512, 8, 1, 8, QKVO, False, 16),
    ("l1b", "llama-3.2-3b", 512, 1, 1, 8, QKVO, True, 8),
    ("h1", "tinyllama-1.1b", 1024, 2, 1, 16, QKVO, False, 48),
    ("h2", "tinyllama-1.1b", 4096, 2, 1, 8, QKVO, True, 48),
    ("h3", "tinyllama-1.1b", 512, 4, 2, 32, "all-linear", True, 4),
    ("h4", "smollm2-135m", 2048, 8, 1, 32, "all-linear", True, 48),
    ("h5", "smollm2-135m", 512, 16, 1, 8, QKVO, True, 4),
    ("h6", "llama-3.2-3b", 2048, 2, 1, 8, "all-linear", True, 48),
    ("h7", "llama-3.2-3b", 1024, 1, 1, 8, QKVO, False, 48),
    ("l6", "llama-3.2-3b", 4096, 2, 1, 16, "all-linear", True, 48),
]
# The lean GPU path (nb_helpers.fast.fastpath: 16-bit residual stream, fused kernels, no mask for right padding), after
# issue 8. Its constants were fitted on the TinyLlama runs of bench/throughput.py; these points were not seen then.
LEAN = [
    ("n1", "tinyllama-1.1b", 512, 1, 8, 8, QKVO, True, 4),      # the reference recipe's settings
    ("n2", "tinyllama-1.1b", 512, 8, 1, 8, QKVO, True, 4),
    ("n3", "tinyllama-1.1b", 512, 2, 1, 8, QKVO, False, 4),
    ("n4", "tinyllama-1.1b", 1024, 4, 1, 16, "all-linear", True, 4),
    ("n5", "tinyllama-1.1b", 2048, 4, 2, 8, QKVO, True, 4),
    ("n6", "tinyllama-1.1b", 2048, 1, 1, 8, QKVO, False, 48),
    ("n7", "tinyllama-1.1b", 4096, 2, 1, 8, QKVO, True, 48),
    ("n8", "tinyllama-1.1b", 2048, 2, 1, 64, "all-linear", True, 48),
    ("m1", "smollm2-135m", 512, 8, 1, 8, QKVO, False, 16),
    ("m2", "smollm2-135m", 2048, 4, 1, 8, QKVO, True, 4),
    ("m3", "smollm2-135m", 4096, 4, 1, 64, "all-linear", True, 48),
    ("m4", "smollm2-135m", 1024, 16, 1, 16, "all-linear", True, 48),
    ("m5", "smollm2-135m", 512, 16, 1, 8, QKVO, True, 4),
    ("k1", "llama-3.2-3b", 512, 1, 1, 8, QKVO, True, 8),
    ("k2", "llama-3.2-3b", 2048, 2, 1, 8, "all-linear", True, 48),
    ("k3", "llama-3.2-3b", 1024, 1, 1, 8, QKVO, False, 48),
]
# Model families beyond Llama (issue 11), on the lean GPU path (the non-Llama families run stock layers: liger is
# wired for Llama only). Shapes from nb_helpers/plan/shapes/; budget 4 GiB where the planner predicts a fit on the H200
# (0.60 GiB context), more where it does not (those points measure the formulas, not the fit). Each family has one
# point without checkpointing: it measures every per-layer term directly.
FAMILIES = [
    ("f1", "qwen3-1.7b", 512, 1, 8, 8, QKVO, True, 4),       # issue 11's table: 2.27 GiB on the plain recipe
    ("f2", "qwen3-1.7b", 2048, 1, 8, 8, QKVO, True, 4),      # 2.63 GiB there
    ("f3", "qwen3-1.7b", 1024, 4, 2, 16, "all-linear", True, 4),
    ("f4", "qwen3-1.7b", 512, 2, 1, 8, QKVO, False, 16),
    ("f5", "qwen3-1.7b", 8192, 1, 2, 8, QKVO, True, 8),      # issue 11's target: <= 4.0 GiB
    ("f6", "qwen3-4b", 512, 1, 8, 8, QKVO, True, 4),         # 3.61 GiB there
    ("f7", "qwen3-4b", 2048, 1, 8, 8, QKVO, True, 8),        # 4.26 GiB there: over a 4 GB card
    ("f8", "qwen3-0.6b", 512, 8, 1, 8, QKVO, True, 4),
    ("f9", "qwen3-0.6b", 2048, 4, 2, 16, "all-linear", True, 4),
    ("g1", "gemma3-1b", 512, 1, 8, 8, QKVO, True, 4),        # window 512: no sliding mask
    ("g2", "gemma3-1b", 2048, 1, 8, 8, QKVO, True, 4),       # 22 of 26 layers need the sliding mask
    ("g3", "gemma3-1b", 1024, 4, 2, 16, "all-linear", True, 4),
    ("g4", "gemma3-1b", 1024, 2, 1, 8, QKVO, False, 16),
    ("g5", "gemma3-270m", 2048, 4, 2, 8, QKVO, True, 4),
    ("e1", "llama-3.2-1b", 512, 1, 8, 8, QKVO, True, 4),
    ("e2", "llama-3.2-1b", 2048, 2, 4, 8, QKVO, True, 4),
    ("e3", "llama-3.2-1b", 1024, 2, 1, 16, "all-linear", False, 16),
    ("p1", "phi-4-mini", 512, 1, 8, 8, QKVO, True, 6),       # predicted 3.94 GiB: a cap at 4 would cut it off
    ("p2", "phi-4-mini", 1024, 2, 4, 16, "all-linear", True, 8),
    ("p3", "phi-4-mini", 512, 2, 1, 8, QKVO, False, 16),
    ("w1", "qwen2.5-0.5b", 2048, 4, 2, 16, "all-linear", True, 4),
    ("w2", "qwen2.5-0.5b", 512, 4, 1, 8, QKVO, False, 16),
]
# Checkpointed layers as CUDA graphs (nb_helpers.fast.graphed_layers, the GPU default): the graph terms were fitted on
# five TinyLlama runs of bench/throughput.py (call 11); none of these points was seen then. Shapes first, so that a
# deadline still leaves all three.
GRAPHED = [
    ("x1", "tinyllama-1.1b", 1024, 2, 4, 8, QKVO, True, 4),
    ("x5", "smollm2-135m", 512, 8, 1, 8, QKVO, True, 4),
    ("x8", "llama-3.2-1b", 512, 1, 8, 8, QKVO, True, 4),
    ("x2", "tinyllama-1.1b", 512, 4, 2, 16, "all-linear", True, 4),
    ("x6", "smollm2-135m", 2048, 4, 1, 8, QKVO, True, 4),
    ("x9", "llama-3.2-1b", 1024, 4, 2, 8, QKVO, True, 4),
    ("x3", "tinyllama-1.1b", 2048, 2, 4, 8, QKVO, True, 4),
    ("x7", "smollm2-135m", 1024, 8, 1, 16, "all-linear", True, 4),
    ("x10", "llama-3.2-1b", 2048, 1, 8, 16, "all-linear", True, 4),
    ("x4", "tinyllama-1.1b", 256, 8, 1, 8, QKVO, True, 4),
    ("x11", "smollm2-135m", 512, 16, 1, 8, QKVO, True, 4),
    ("x12", "llama-3.2-1b", 256, 8, 1, 8, QKVO, True, 4),
]
# Issue 26: points none of the planner's constants saw, on the default GPU path as it is now (fast path, liger's kernels
# on Llama shapes, no graphs for hand-set runs), six families, 256 to 4,096 tokens, r 8 to 32, with and without
# checkpointing. bench/planner_from_cpu.py plans them as a CPU-only machine would (`plan --gpu-capability 9.0`).
CARDS26 = [
    ("c1", "tinyllama-1.1b", 256, 4, 2, 8, QKVO, False, 4),
    ("c2", "tinyllama-1.1b", 1024, 2, 4, 32, "all-linear", True, 4),
    ("c3", "tinyllama-1.1b", 4096, 1, 8, 16, QKVO, True, 48),
    ("c4", "smollm2-135m", 2048, 2, 4, 32, "all-linear", False, 48),
    ("c5", "smollm2-135m", 4096, 1, 8, 8, QKVO, True, 4),
    ("c6", "qwen3-0.6b", 1024, 2, 4, 8, QKVO, False, 48),
    ("c7", "qwen3-0.6b", 4096, 1, 8, 16, "all-linear", True, 4),
    ("c8", "qwen3-1.7b", 256, 8, 1, 32, "all-linear", True, 4),
    ("c9", "qwen3-1.7b", 2048, 1, 8, 8, QKVO, False, 48),
    ("c10", "llama-3.2-1b", 2048, 1, 8, 32, "all-linear", True, 4),
    ("c11", "llama-3.2-1b", 512, 8, 1, 8, QKVO, False, 48),
    ("c12", "qwen2.5-0.5b", 1024, 4, 2, 16, QKVO, False, 48),
    ("c13", "qwen2.5-0.5b", 4096, 2, 4, 8, "all-linear", True, 4),
    ("c14", "gemma3-270m", 2048, 4, 2, 32, "all-linear", False, 48),
    ("c15", "gemma3-1b", 4096, 1, 8, 8, QKVO, True, 4),
    ("c16", "gemma3-1b", 512, 4, 2, 32, "all-linear", False, 48),
]
# Auto-fit against the reference recipe on the TinyLlama shape at 4 GiB, effective batch 8, in one call.
AUTOFIT = [(f"{name}-{seq}", seq, extra) for seq in (512, 2048) for name, extra in (
    ("reference", dict(micro_batch_size=1, grad_accum=8, gradient_checkpointing=True)),
    ("autofit", dict(micro_batch_size=1, grad_accum=8, gradient_checkpointing=True, auto_fit=True)))]
AUTOFIT_STEPS = 13  # 3 warm-up steps are dropped, the median of 10 is reported
STEPS = 3


def write_rows(tokenizer, path: Path, count: int, seq: int, seed: int) -> None:
    """Text rows of seq-1-k tokens (k in 0..15, +EOS): full-length work, with padding whenever micro-batch > 1."""
    words = Path(ROOT / "data" / "train.jsonl").read_text(encoding="utf-8").replace('"', " ").split()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            target = seq - 1 - rng.randrange(16)
            text = " ".join(rng.choice(words) for _ in range(2 * seq))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            while len(ids) < target:
                text += " " + " ".join(rng.choice(words) for _ in range(seq))
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            f.write(json.dumps({"text": tokenizer.decode(ids[:target])}) + "\n")


def peak_memory(steps: list[dict]) -> dict:
    """The highest NVML device-used (context included), PyTorch reserved and allocated GiB over a run's steps."""
    return dict(measured_gib=max(m.get("device_used_gib") or 0 for m in steps),
                reserved_gib=max(m.get("torch_peak_gib") or 0 for m in steps),
                allocated_gib=max(m.get("torch_peak_allocated_gib") or 0 for m in steps))


def run_point(point, model_dir: Path, work: Path, steps: int = STEPS, overrides: dict | None = None) -> dict:
    from transformers import AutoTokenizer

    pid, shape, seq, batch, accum, rank, targets, gc, budget = point
    data = work / f"{pid}.jsonl"
    write_rows(AutoTokenizer.from_pretrained(model_dir), data, steps * batch * accum, seq, seed=seq)
    config = dict(model=str(model_dir), train_file=str(data), eval_file=None, task_eval_samples=0,
                  max_length=seq, micro_batch_size=batch, grad_accum=accum, lora_r=rank, lora_alpha=2 * rank,
                  target_modules=targets.split(",") if targets != "all-linear" else ["all-linear"],
                  gradient_checkpointing=gc, max_steps=steps, save_steps=1000, budget_gib=budget,
                  runs_dir=str(work / "runs"), run_name=pid, compute_dtype="bfloat16",
                  **{"fast_path": True, **(overrides or {})})  # the validated points are the fast path's
    (work / f"{pid}.json").write_text(json.dumps(config))
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "nb_helpers", "train", "--config", str(work / f"{pid}.json")],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    row = dict(id=pid, shape=shape, seq=seq, batch=batch, accum=accum, rank=rank, targets=targets, gc=gc,
               budget_gib=budget, wall_s=round(time.time() - start, 1), returncode=proc.returncode)
    run = work / "runs" / pid
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    steps = [m for m in metrics if "loss" in m]
    if steps:
        row.update(
            **peak_memory(steps),
            device_used_per_step=[round(m.get("device_used_gib") or 0, 4) for m in steps],
            median_step_s=sorted(m["step_s"] for m in steps)[len(steps) // 2],
        )
    summary = run / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        row.update(context_gib=s.get("cuda_context_gib"), status=s.get("status"), tokens_per_s=s.get("tokens_per_s"),
                   summary_median_step_s=s.get("median_step_s"), predicted_at_run_gib=s.get("predicted_peak_gib"))
        chosen = json.loads((run / "config.json").read_text())
        row.update(chosen_batch=chosen["micro_batch_size"], chosen_accum=chosen["grad_accum"],
                   chosen_gc=chosen["gradient_checkpointing"])
        row["autofit_log"] = [line for line in proc.stdout.splitlines() if line.startswith("[auto-fit]")]
    if proc.returncode != 0:
        row["error_tail"] = (proc.stderr or proc.stdout)[-1500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="all",
                        help="comma list of point ids, all, holdout, lean, families, graphed, cards26, or autofit")
    parser.add_argument("--out", help="also append the rows to this JSON lines file")
    add_out_dir(parser)
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per point (more: a step time too)")
    parser.add_argument("--deadline-s", type=float, default=540, help="start no new point after this many seconds")
    args = parser.parse_args()
    from build_tinyllama_shape import shape_dir
    from run_file import RunFile

    work = Path(tempfile.mkdtemp(prefix="grid-"))
    run_file = RunFile("planner-grid", out_dir=args.out_dir)
    result = {"points": args.points, "steps": args.steps, "rows": []}

    def keep(row: dict) -> None:
        result["rows"].append(row)
        run_file.write(result)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    if args.points == "autofit":
        model_dir = shape_dir("tinyllama-1.1b")
        for pid, seq, extra in AUTOFIT:
            row = run_point((pid, "tinyllama-1.1b", seq, 1, 8, 8, QKVO, True, 4), model_dir, work,
                            steps=AUTOFIT_STEPS, overrides={k: v for k, v in extra.items()
                                                            if k not in ("micro_batch_size", "grad_accum", "gradient_checkpointing")})
            keep(row)
            print(f"[autofit] {pid:<16} b{row.get('chosen_batch')}x{row.get('chosen_accum')} gc={row.get('chosen_gc')} "
                  f"{row.get('summary_median_step_s') or float('nan'):.3f} s/step {row.get('tokens_per_s') or 0:.0f} tok/s "
                  f"device {row.get('measured_gib', float('nan')):.2f} GiB rc={row['returncode']}", flush=True)
            for line in row.get("autofit_log", []):
                print("   ", line, flush=True)
        return
    sets = {"holdout": HOLDOUT, "lean": LEAN, "families": FAMILIES, "graphed": GRAPHED, "cards26": CARDS26}
    pool = sets.get(args.points) or \
        POINTS + [p for p in HOLDOUT if p[0] not in {q[0] for q in POINTS}] + LEAN + FAMILIES + GRAPHED + CARDS26
    if args.points == "all" or args.points in sets:
        chosen = pool
    else:  # in the order given
        by_id = {p[0]: p for p in pool}
        chosen = [by_id[i] for i in args.points.split(",")]
    start = time.time()
    for point in chosen:
        if time.time() - start > args.deadline_s:
            print(f"[grid] deadline: {point[0]} and later points not run", flush=True)
            break
        shape = point[1]
        row = run_point(point, shape_dir(shape), work, steps=args.steps)
        keep(row)
        print(f"[grid] {row['id']:<4}{shape:<16}seq {point[2]:>5} b{point[3]}x{point[4]} r{point[5]:<3}"
              f"{point[6][:10]:<11}gc={int(point[7])} -> device {row.get('measured_gib', float('nan')):.3f} "
              f"reserved {row.get('reserved_gib', float('nan')):.3f} alloc {row.get('allocated_gib', float('nan')):.3f}"
              f" ctx {row.get('context_gib') or float('nan'):.3f} rc={row['returncode']} {row['wall_s']}s", flush=True)


if __name__ == "__main__":
    main()
