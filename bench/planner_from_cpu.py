"""Every committed H200 point of the GPU path as it runs today, planned the way a learner plans it from a machine
without that GPU: `python -m nb_helpers plan --gpu-capability 9.0 --context-gib <measured>` on a CPU, i.e.
plan_for_config on a RunConfig with the point's knobs (no PlanInput written by hand, nothing read from this
machine's installed packages). Beside it, the same plan without the GPU extras (what the planner assumed before
issue 26 on a machine without liger-kernel).

    python bench/planner_from_cpu.py     # a run file of kind "planner-from-cpu"; prints the worst and mean error

Points: the newest "planner-validation" run file's rows (bench/planner_report.py) measured on the current path (lean, no mask, fused kernels,
expandable segments; graphs and offloaded checkpoints as each row ran). Rows of paths since removed (the old
prepare_model_for_kbit path, offload without overlap, levers alone) are left out and counted.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from build_tinyllama_shape import shape_config  # noqa: E402
from run_file import RunFile, add_out_dir, newest  # noqa: E402

from nb_helpers.config import RunConfig  # noqa: E402
from nb_helpers.plan.planner import Shape, plan_for_config  # noqa: E402

CURRENT_PATH = dict(lean=True, nomask=True, fused_kernels=True, expandable=True, offload_overlap=True)
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def on_current_path(row: dict) -> bool:
    return all(row["path"].get(k, v) == v for k, v in CURRENT_PATH.items())


def config_of(row: dict) -> RunConfig:
    return RunConfig(max_length=row["seq"], micro_batch_size=row["batch"], grad_accum=row["accum"],
                     lora_r=row["rank"], lora_alpha=2 * row["rank"], gradient_checkpointing=row["gc"],
                     target_modules=["all-linear"] if row["targets"] == "all-linear" else QKVO,
                     cuda_graphs=bool(row["path"].get("graphs")), offload_checkpoints=bool(row["path"].get("offload")),
                     budget_gib=row["budget_gib"], compute_dtype="bfloat16",
                     no_recompute_layers=row["path"].get("no_recompute_layers", 0), fast_path=True)


def planned_from_cpu(row: dict, gpu_extras: bool | None = None) -> float:
    """The plan from a CPU. A point measured before a memory lever existed (LoRA's dropout kernels: call 39; the
    absmax kept decoded: call 45; the recompute's weights kept: call 49; the LoRA products reused: call 55) is planned
    with it off, as a learner who turns it off plans it (NB_FASTPATH)."""
    shape = Shape.from_config(shape_config(row["shape"]), name=row["shape"])
    lever = ",".join(f"{name}=0" for name in ("dropout_kernels", "absmax_once", "down_once")
                     if not row["path"].get(name))
    with patch.dict(os.environ, {"NB_FASTPATH": lever}):
        return plan_for_config(config_of(row), shape, context_gib=row["context_gib"], gpu_capability=(9, 0),
                               gpu_extras=gpu_extras).peak_gib


def error_pct(predicted: float, measured: float) -> float:
    return round(100 * (predicted - measured) / measured, 1)


def validation_points() -> list[dict]:
    return newest("planner-validation")["results"]["points"]


def rows() -> list[dict]:
    points = validation_points()
    out = []
    for r in filter(on_current_path, points):
        cpu, without = planned_from_cpu(r), planned_from_cpu(r, gpu_extras=False)
        out.append(dict(id=r["id"], set=r["set"], shape=r["shape"], measured_gib=r["measured_gib"],
                        planned_from_cpu_gib=round(cpu, 3), error_pct=error_pct(cpu, r["measured_gib"]),
                        without_gpu_extras_gib=round(without, 3),
                        without_gpu_extras_error_pct=error_pct(without, r["measured_gib"])))
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_dir(parser)
    args = parser.parse_args()
    run_file = RunFile("planner-from-cpu", out_dir=args.out_dir, device="cpu")
    points = rows()
    errors = [abs(p["error_pct"]) for p in points]
    old = [abs(p["without_gpu_extras_error_pct"]) for p in points]
    skipped = len(validation_points()) - len(points)
    result = {"gpu": "NVIDIA H200 (measured); planned on a CPU", "points": len(points), "skipped_other_paths": skipped,
              "worst_abs_error_pct": max(errors), "mean_abs_error_pct": round(statistics.mean(errors), 2),
              "without_gpu_extras": {"worst_abs_error_pct": max(old), "mean_abs_error_pct": round(statistics.mean(old), 2),
                                     "beyond_10_pct": sum(e > 10 for e in old)},
              "rows": points}
    print(f"wrote {run_file.write(result)}")
    print(f"{len(points)} GPU points on today's path ({skipped} of other paths left out), planned from this CPU:")
    print(f"  with the GPU extras assumed: worst {max(errors):.1f}%, mean {statistics.mean(errors):.2f}%")
    print(f"  without them (before):       worst {max(old):.1f}%, mean {statistics.mean(old):.2f}%, "
          f"{sum(e > 10 for e in old)} beyond 10%")


if __name__ == "__main__":
    main()
