"""The time model (nb_helpers/plan/step_time.py) against the H200's measured step and GPU-busy times.

    python bench/step_time_report.py           # validate the module's constants: a run file of kind "step-time-model"
    python bench/step_time_report.py --fit     # also fit them again from the FIT points and print them

Rows: bench/results/raw/step_time-*.jsonl and the "step-time" run files (bench/step_time.py). The constants are fitted on the FIT points (s1-s8,
TinyLlama, Llama-3.2-1B, SmolLM2 and Qwen3 shapes, graphed and eager) plus c14, the one point with sliding-window
attention (no FIT point had it), and validated on the other CARDS26 points, which no constant saw. Each kind of GPU
time is fitted apart, on the kernel time the profiler gave that kind (non-negative least squares); the host's
constants then on the step times.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from build_tinyllama_shape import shape_config  # noqa: E402
from planner_report import flags  # noqa: E402
from run_file import RunFile, add_out_dir, load_runs  # noqa: E402

from nb_helpers.plan import step_time as st  # noqa: E402
from nb_helpers.plan.architecture import Shape  # noqa: E402
from nb_helpers.plan.planner import PlanInput  # noqa: E402

FIT_IDS = {"s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "c14"}


def load_rows() -> list[dict]:
    rows = []
    for path in sorted(glob.glob(str(ROOT / "bench" / "results" / "raw" / "step_time-*.jsonl"))):
        rows += [dict(json.loads(line), source=Path(path).name) for line in Path(path).read_text().splitlines()]
    for run in load_runs("step-time"):
        rows += [dict(row, source=Path(run["file"]).name) for row in run["results"]["rows"]]
    return [r for r in rows if r.get("busy") and r.get("median_step_s")]


def plan_input(row: dict) -> tuple[Shape, PlanInput]:
    shape = Shape.from_config(shape_config(row["shape"]), name=row["shape"])
    chosen = row.get("chosen") or {}
    targets = ("all-linear",) if row["targets"] == "all-linear" else tuple(row["targets"].split(","))
    return shape, PlanInput(seq=row["seq"], batch=row["batch"], accum=row["accum"], rank=row["rank"],
                            targets=targets, gradient_checkpointing=row["gc"], fused_kernels=True,
                            offload=bool(chosen.get("offload_checkpoints")), graphs=bool(chosen.get("cuda_graphs")),
                            dead_tail=bool((row.get("fast_levers") or {}).get("dead_tail")),  # from device call 31
                            absmax_once=bool((row.get("fast_levers") or {}).get("absmax_once")),  # from call 45
                            dropout_kernels=bool((row.get("fast_levers") or {}).get("dropout_kernels")),
                            no_recompute_layers=row.get("no_recompute_layers") or 0,
                            down_once=bool((row.get("fast_levers") or {}).get("down_once")),
                            one_token_count=bool((row.get("fast_levers") or {}).get("one_token_count")),  # call 60
                            frozen_norms=bool((row.get("fast_levers") or {}).get("frozen_norms")),  # call 63
                            saved_attention=bool((row.get("fast_levers") or {}).get("saved_attention")))  # call 73


def nnls(a, y, iterations: int = 20000) -> np.ndarray:
    """Non-negative least squares by projected gradient on scaled columns (numpy only)."""
    a, y = np.asarray(a, float), np.asarray(y, float)
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1
    scaled = a / scale
    x = np.maximum(np.linalg.lstsq(scaled, y, rcond=None)[0], 0)
    step = 1 / np.linalg.norm(scaled, 2) ** 2
    for _ in range(iterations):
        x = np.maximum(x - step * scaled.T @ (scaled @ x - y), 0)
    return x / scale


def fit_gpu(rows: list[dict]) -> dict[str, float]:
    """Seconds per unit, each kind of kernel time on its own units."""
    units_of = {}
    for unit in st.GPU_SECONDS:
        units_of.setdefault(st.CATEGORY.get(unit, "other"), []).append(unit)
    fitted = {}
    for kind, units in units_of.items():
        a, y = [], []
        for row in rows:
            work = st.work_per_micro_step(*plan_input(row))
            a.append([work[u] for u in units])
            y.append(row["busy"]["categories_s"].get(kind, 0.0) / row["accum"])
        fitted.update(zip(units, nnls(a, y)))
    return fitted


def host_features(shape: Shape, inp: PlanInput) -> list[float]:
    """Coefficients of HOST_LAYER_S, HOST_GC_LAYER_S, HOST_GC_STOCK_LAYER_S, HOST_EXTRA_NORM_LAYER_S, GRAPHED_MICRO_S
    in one micro-step's host time."""
    if inp.graphs and inp.gradient_checkpointing:
        return [0, 0, 0, 0, 1]
    stock = not st.fused_kernels_apply(shape, inp)
    gc = int(inp.gradient_checkpointing)
    return [shape.layers, shape.layers * gc, shape.layers * gc * stock,
            shape.layers * max(0, shape.norms_per_layer - 2), 0]


def fit_host(rows: list[dict]) -> np.ndarray:
    """The host's constants and STEP_S, on step times relative to the measured (eager micro-steps bound by the host
    or the GPU, whichever is slower; graphed ones add theirs), iterated until the bound of each point settles."""
    fitted = None
    for _ in range(20):
        a, y = [], []
        for row in rows:
            shape, inp = plan_input(row)
            busy = busy_seconds(shape, inp) / inp.accum
            weight, feats = 1 / row["median_step_s"], host_features(shape, inp)
            host = None if fitted is None else float(np.dot(feats, fitted[:-1]))
            graphed = bool(feats[4])
            if graphed or fitted is None or host >= busy:
                a.append([inp.accum * f * weight for f in feats] + [weight])
                y.append(1.0 - (inp.accum * busy * weight if graphed else 0.0))
            else:
                a.append([0.0] * len(feats) + [weight])
                y.append((row["median_step_s"] - inp.accum * busy) * weight)
        fitted = nnls(a, y)
    return fitted


# Issue 27's path (the recompute's dead product skipped, device calls 31-33; Llama layers as fused blocks, calls 34-35,
# whose `no-fused-block` runs are the path before them): the throughput runs of our path, held out
CHANGED_PATH = {"throughput-call31-dca9720.json": None, "throughput-call32-9fdf01b.json": {"no-dropout-kernels"},
                "throughput-call33-e14dedb.json": None, "throughput-call34-b25e3a2-w2048.json": None,
                "throughput-call34-b25e3a2-w512.json": None,
                "throughput-call35-358a82c-w2048-reference_ours_ours-1x8.json": None,
                "throughput-call35-358a82c-w512-reference_ours_no-fused-block.json": None,
                "throughput-call35-358a82c-w512-no-fused-block_ours.json": None,
                # LoRA's dropout kernels (calls 39-42), with and without
                "throughput-call39-w2048.json": None, "throughput-call40-w512.json": None,
                "throughput-call41-w2048.json": None, "throughput-call42-w512.json": None,
                "throughput-call42-w2048.json": None,
                # the absmax kept decoded (call 45), with and without
                "throughput-call45-w2048.json": None, "throughput-call45-w512.json": None,
                # the host's share of the step (fast.host_step, call 60), with and without each lever
                "throughput-call60.json": None, "throughput-call62.json": {"ours"},  # shipped rows: not here
                # the norms' backward for frozen weights (fast.frozen_norms, call 63), with and without
                "throughput-call63.json": None, "throughput-call64.json": None,
                # NF4 dequantized by one Triton kernel inside CUDA graphs (fast.nf4, calls 65-66), with and without
                "throughput-call65.json": None, "throughput-call66-1-no-nf4.json": None,
                "throughput-call66-1-ours.json": None, "throughput-call66-2-no-nf4.json": None,
                "throughput-call66-2-ours.json": None,
                # keep_dequantized where the plan holds it, LoRA's swept launch settings (calls 68-70), with and without
                "throughput-call68.json": None, "throughput-call69.json": None, "throughput-call70.json": None,
                "throughput-call70-again.json": None,
                # q, k and v as one function (fast.qkv, call 71), with and without
                "throughput-call71.json": None, "throughput-call72.json": None,
                # the attention an offloaded checkpoint keeps for its recompute (fast.saved_attention, call 73)
                "throughput-call73.json": None, "throughput-call73-pair.json": None}


def throughput_rows() -> list[dict]:
    """bench/throughput.py's profiled runs of our path as step-time rows (offload and graphs from each run's log, as
    bench/planner_report.py reads them)."""
    rows = []
    for name, keep in CHANGED_PATH.items():
        data = json.loads((ROOT / "bench" / "results" / "raw" / name).read_text())
        for workload, entry in data["workloads"].items():
            if workload == "shipped":  # rows of every length: not one shape the model can price
                continue
            for run, r in entry["runs"].items():
                if r.get("recipe") != "ours" or not r.get("busy") or (keep is not None and run not in keep):
                    continue
                path = flags(None, True, r.get("log") or [])
                rows.append(dict(id=f"{workload}/{run}@{name.split('-')[1].removesuffix('.json')}", shape="tinyllama-1.1b",
                                 seq=entry["seq"], batch=r["micro_batch"], accum=r["accum"], rank=8,
                                 targets="q_proj,k_proj,v_proj,o_proj", gc=r["gc"], source=name,
                                 median_step_s=r["median_step_s"], busy=r["busy"], fast_levers=r.get("fast_levers"),
                                 no_recompute_layers=r.get("no_recompute_layers") or 0,
                                 chosen={"offload_checkpoints": path["offload"], "cuda_graphs": path["graphs"]}))
    return rows


def busy_seconds(shape: Shape, inp: PlanInput) -> float:
    return st.predict_step_time(shape, inp, st.H200).gpu_busy_s


def validate(rows: list[dict]) -> dict:
    points = []
    for row in rows:
        shape, inp = plan_input(row)
        predicted = st.predict_step_time(shape, inp, st.H200)
        points.append({
            "id": row["id"], "shape": row["shape"], "seq": row["seq"], "batch": row["batch"], "accum": row["accum"],
            "rank": row["rank"], "targets": row["targets"], "gc": row["gc"], "graphs": inp.graphs,
            "offload": inp.offload, "held_out": row["id"] not in FIT_IDS, "source": row["source"],
            "measured_step_s": row["median_step_s"], "predicted_step_s": round(predicted.step_s, 4),
            "measured_busy_s": row["busy"]["busy_s"], "predicted_busy_s": round(predicted.gpu_busy_s, 4),
            "step_error": predicted.step_s / row["median_step_s"] - 1,
            "busy_error": predicted.gpu_busy_s / row["busy"]["busy_s"] - 1,
            "measured_by_kind_s": row["busy"]["categories_s"],
            "predicted_by_kind_s": {k: round(v, 5) for k, v in predicted.gpu_by_kind_s.items()}})
    held = [p for p in points if p["held_out"]]
    return {"gpu": "NVIDIA H200", "held_out_points": len(held), "fit_points": len(points) - len(held),
            "held_out": error_summary(held), "measured_with": "python bench/step_time.py --points fit,cards26",
            "points": points}


def error_summary(points: list[dict]) -> dict:
    return {key: {"worst": max(abs(p[key]) for p in points), "mean": statistics.mean(abs(p[key]) for p in points),
                  "within_15pct": sum(abs(p[key]) <= 0.15 for p in points)} for key in ("step_error", "busy_error")}


def print_fit(rows: list[dict]) -> None:
    gpu = fit_gpu(rows)
    print("GPU_SECONDS (seconds per unit on the H200):")
    for unit, value in gpu.items():
        print(f'    "{unit}": ({value:.5e}, "{st.GPU_SECONDS[unit][1]}"),')
    saved = dict(st.GPU_SECONDS)
    st.GPU_SECONDS.update({u: (v, st.GPU_SECONDS[u][1]) for u, v in gpu.items()})
    try:
        host = fit_host(rows)
    finally:
        st.GPU_SECONDS.update(saved)
    names = ["HOST_LAYER_S", "HOST_GC_LAYER_S", "HOST_GC_STOCK_LAYER_S", "HOST_EXTRA_NORM_LAYER_S", "GRAPHED_MICRO_S",
             "STEP_S"]
    for name, value in zip(names, host):
        print(f"{name} = {value:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="fit the constants again and print them")
    add_out_dir(parser)
    args = parser.parse_args()
    run_file = RunFile("step-time-model", out_dir=args.out_dir, device="cpu")
    rows = load_rows()
    if args.fit:
        print_fit([r for r in rows if r["id"] in FIT_IDS])
    result = validate(rows)
    changed = validate(throughput_rows())["points"]
    result["changed_path"] = {"what": "the GPU path since the recompute's dead product was skipped (dead_tail), and "
                              "its lever runs: bench/throughput.py's profiled runs in CHANGED_PATH, held out",
                              "summary": error_summary(changed), "points": changed}
    print(f"wrote {run_file.write(result)}")
    for p in result["points"]:
        print(f"{p['id']:<4}{p['shape']:<16}{p['seq']:>5} {p['batch']}x{p['accum']} gc={int(p['gc'])} "
              f"{'graphs ' if p['graphs'] else ''}{'offload ' if p['offload'] else ''}"
              f"step {p['measured_step_s']:.3f} -> {p['predicted_step_s']:.3f} ({p['step_error']:+.0%})  busy "
              f"{p['measured_busy_s']:.3f} -> {p['predicted_busy_s']:.3f} ({p['busy_error']:+.0%})"
              f"{'' if p['held_out'] else '  [fit]'}")
    for key, s in result["held_out"].items():
        print(f"held out ({result['held_out_points']} points), {key}: worst {s['worst']:.1%}, mean {s['mean']:.1%}, "
              f"within 15%: {s['within_15pct']}")
    for p in changed:
        print(f"{p['id']:<34} step {p['measured_step_s']:.3f} -> {p['predicted_step_s']:.3f} ({p['step_error']:+.1%})"
              f"  busy {p['measured_busy_s']:.3f} -> {p['predicted_busy_s']:.3f} ({p['busy_error']:+.1%})")


if __name__ == "__main__":
    main()
