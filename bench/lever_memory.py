"""The memory side of pruning the fast path's levers: for each lever, what auto-fit chooses under the GTX 1650
preset (its budget, desktop reserve and context) with the lever and without it, planned from config.json alone (the
planner is what auto-fit ranks by; its trial step only confirms). A lever whose memory changes that choice earns its
place on a 4 GB card even where its speed does not. Runs anywhere (no GPU needed); writes a run file.

    python bench/lever_memory.py
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile, add_out_dir  # noqa: E402

# the course's data (the longest shipped row, padded to 64 tokens: what auto-fit fits for), and the two benchmark lengths
LENGTHS = {"shipped": 192, "w512": 512, "w2048": 2048}
MODELS = ("tinyllama-1.1b", "qwen3-1.7b", "smollm2-135m")


def choice(model: str, seq: int, lever: str | None) -> dict:
    from nb_helpers.config import RunConfig
    from nb_helpers.plan.catalog import known_shape
    from nb_helpers.plan.cards import budget_of
    from nb_helpers.plan.choose import auto_fit, fewer_recomputes_on
    from nb_helpers.plan.planner import plan_for_config
    from nb_helpers.plan.step_time import timing_gpu

    cfg = RunConfig(card="gtx1650", max_length=seq, micro_batch_size=1, grad_accum=8, auto_fit=True, fast_path=True)
    shape = known_shape(model)
    with patch.dict(os.environ, {"NB_FASTPATH": f"{lever}=0" if lever else ""}):
        base = plan_for_config(cfg, shape, gpu_capability=(7, 5), gpu_extras=True).inputs
        try:
            c = auto_fit(shape, base, 8, budget_of(cfg), log=lambda *_: None, gpu=timing_gpu(cfg),
                         fewer_recomputes=fewer_recomputes_on(cfg, shape))
        except MemoryError:
            return {"fits": False}
    return {"fits": True, "micro_batch": c.batch, "accum": c.accum, "gc": c.gradient_checkpointing,
            "offload": c.offload, "graphs": c.graphs, "no_recompute_layers": c.no_recompute_layers,
            "predicted_gib": round(c.predicted_gib, 3), "predicted_step_s": c.predicted_step_s}


def main() -> None:
    from nb_helpers.fast.options import FastOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_dir(parser)
    args = parser.parse_args()
    run = RunFile("lever-memory", out_dir=args.out_dir, device="cpu")
    levers = [f.name for f in fields(FastOptions) if f.name != "lean"]
    out = {"card": "gtx1650", "effective_batch": 8, "points": []}
    for model in MODELS:
        for workload, seq in LENGTHS.items():
            ours = choice(model, seq, None)
            for lever in levers:
                without = choice(model, seq, lever)
                changed = {k: (ours.get(k), without.get(k)) for k in ("fits", "micro_batch", "accum", "gc",
                                                                      "offload", "graphs", "no_recompute_layers")
                           if ours.get(k) != without.get(k)}
                out["points"].append({"model": model, "workload": workload, "seq": seq, "lever": lever,
                                      "ours": ours, "without": without, "choice_changed": changed})
                if changed:
                    print(f"{model:15s} {workload:8s} {lever:18s} {changed}")
    print(f"wrote {run.write(out)}")


if __name__ == "__main__":
    main()
