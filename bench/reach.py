"""Reach under a 4 GiB card (issue 11): bigger models and longer rows on our default GPU path, with the memory options
that make them fit. One fresh process per point (bench/throughput.py's worker, the same measurement), random-weight
models of the real shapes built on the device, effective batch 8 sequences, r=8 on q,k,v,o.

    python bench/reach.py                          # every point: a run file in bench/results/runs/
    python bench/reach.py --only qwen3-4b-2048-1x8-offload --out /tmp/r.json
    python bench/reach.py --predict-from FILE --out FILE2   # the planner beside the points of a raw or run file
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile, add_out_dir  # noqa: E402
from throughput import summarize  # noqa: E402

# name: shape, sequence length, micro-batch, accumulation, fast-path levers (None: the default path)
POINTS = [
    ("tinyllama-1.1b", 16384, 1, 8, "offload=1"),
    # (the committed reach run, bench/RESULTS.md, also holds 24,576 tokens with ordered offload copies, a lever since
    # removed)
    ("qwen3-1.7b", 8192, 1, 8, "offload=1"),
    ("qwen3-4b", 2048, 1, 8, "offload=1"),
    ("qwen3-4b", 2048, 1, 8, None),
]


def point_name(shape, seq, batch, accum, fast) -> str:
    return f"{shape}-{seq}-{batch}x{accum}" + ("-" + fast.replace("=1", "").replace(",", "+") if fast else "")


def build_shape(name: str, out: Path, max_positions: int) -> Path:
    """A random-weight model of nb_helpers/plan/shapes/<name>.json, built once (bench/build_tinyllama_shape.py)."""
    if not (out / "config.json").exists():
        from build_tinyllama_shape import build

        build(name, str(out), ROOT / "data", max_positions=max_positions)
    return out


def predict(row: dict, context_gib: float) -> float:
    """The planner's peak for a measured point (H200: compute capability 9.0, bf16, batch-1 rows carry no padding)."""
    from nb_helpers.plan.planner import PlanInput, load_shape, plan

    shape = load_shape(str(ROOT / "nb_helpers" / "plan" / "shapes" / f"{row['shape']}.json"))
    inp = PlanInput(seq=row["seq"], batch=row["batch"], accum=row["accum"], rank=row["rank"],
                    targets=tuple(row["targets"]), context_gib=context_gib, gpu_capability=(9, 0),
                    offload="offload" in row["options"], offload_overlap=row.get("offload_overlap", True),
                    padded=row["batch"] > 1, fused_kernels=shape.family == "llama")
    return plan(shape, inp).peak_gib


def with_predictions(raw: dict, context_gib: float) -> dict:
    if "results" in raw:  # a run file: the points are its results
        raw["results"] = with_predictions(raw["results"], context_gib)
        return raw
    for row in raw["points"]:
        row["predicted_gib"] = round(predict(row, context_gib), 3)
        if row.get("peak_device_gib"):
            row["error_pct"] = round(100 * (row["predicted_gib"] - row["peak_device_gib"]) / row["peak_device_gib"], 1)
    raw["predicted_with"] = f"nb_helpers.plan.planner, CUDA context {context_gib:.3f} GiB (measured in the same call)"
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma list of point names")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per point (3 warm-up)")
    parser.add_argument("--budget", type=float, default=4.0)
    parser.add_argument("--out", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    parser.add_argument("--deadline-s", type=float, default=1e9)
    parser.add_argument("--predict-from", default=None, help="a raw result file: add the planner's predictions only")
    parser.add_argument("--context-gib", type=float, default=0.601, help="CUDA context for --predict-from")
    args = parser.parse_args()
    if args.predict_from:
        if not args.out:
            parser.error("--predict-from needs --out (the file with the predictions added)")
        raw = with_predictions(json.loads(Path(args.predict_from).read_text()), args.context_gib)
        Path(args.out).write_text(json.dumps(raw, indent=1) + "\n")
        for row in raw.get("results", raw)["points"]:
            print(f"{row['name']:<40} measured {row.get('peak_device_gib') or float('nan'):.2f} GiB "
                  f"predicted {row['predicted_gib']:.2f} GiB {row.get('error_pct', '')}")
        return
    from planner_grid import write_rows
    from transformers import AutoTokenizer

    start, work = time.time(), Path(tempfile.mkdtemp(prefix="reach-"))
    keep = set(args.only.split(",")) if args.only else None
    import torch

    run_file = RunFile("reach", out_dir=args.out_dir, out=args.out)
    out = {"gpu": torch.cuda.get_device_name(0), "budget_gib": args.budget, "points": []}
    for shape, seq, batch, accum, fast in POINTS:
        name = point_name(shape, seq, batch, accum, fast)
        if keep and name not in keep:
            continue
        if time.time() - start > args.deadline_s:
            print(f"[reach] deadline: {name} not run", flush=True)
            continue
        model_dir = build_shape(shape, Path(f"/tmp/shape-{shape}-reach"), max_positions=max(32768, seq))
        data = work / f"{shape}-{seq}.jsonl"
        if not data.exists():
            write_rows(AutoTokenizer.from_pretrained(model_dir), data, 8 * args.steps, seq, seed=seq)
        spec = dict(workload=name, recipe="ours", name=name, batch=batch, accum=accum, gc=True, steps=args.steps,
                    seq=seq, budget=args.budget, model=str(model_dir), data=str(data), fast=fast)
        spec_path, result_path = work / f"{name}.json", work / f"{name}.out"
        spec_path.write_text(json.dumps(spec))
        t0 = time.time()
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--worker", str(spec_path),
                               str(result_path)], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        row = {"name": name, "shape": shape, "seq": seq, "batch": batch, "accum": accum, "rank": 8,
               "targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
               "options": [o.split("=")[0] for o in (fast or "").split(",") if o], "returncode": proc.returncode,
               "offload_overlap": "offload_overlap=0" not in (fast or ""),
               "wall_s": round(time.time() - t0, 1)}
        if result_path.exists():
            s = summarize(spec, json.loads(result_path.read_text()))
            row.update(peak_device_gib=s["peak_device_gib"], peak_reserved_gib=s["peak_reserved_gib"],
                       peak_allocated_gib=s["peak_allocated_gib"], tokens_per_s=s["tokens_per_s"],
                       median_step_s=s["median_step_s"], losses=s["losses"], predicted_gib=s["predicted_peak_gib"])
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-1500:]
            row["error_tail"] = tail
            row["oom"] = "out of memory" in tail.lower() or "OutOfMemory" in tail
        out["points"].append(row)
        print(f"[reach] {name:<40} rc={proc.returncode} dev {row.get('peak_device_gib') or float('nan'):.2f} GiB "
              f"{row.get('tokens_per_s') or 0:8.0f} tok/s {row['wall_s']}s", flush=True)
        if proc.returncode != 0:
            print("    " + row["error_tail"][-500:].replace("\n", "\n    "), flush=True)
        run_file.write(out)  # after every point
    print(f"wrote {run_file.write(out)}")


if __name__ == "__main__":
    main()
