"""Turn the GPU measurements (bench/results/raw/*.jsonl from bench/planner_grid.py and bench/step_time.py, the
throughput runs, and the run files of those scripts) into a run file of kind "planner-validation" (bench/run_file.py):
the planner's prediction beside every measured peak. bench/summarize.py puts its errors in bench/RESULTS.md.

    python bench/planner_report.py            # a new run file in bench/results/runs/; prints a table and the worst error

The prediction uses each point's measured CUDA context (0.60 GiB on the H200) and compute capability 9.0, as
`python -m nb_helpers plan` does on that GPU. Measured = the highest NVML device "used" delta over the steps
(context included); reserved = torch.cuda.max_memory_reserved().
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from build_tinyllama_shape import SHAPES  # noqa: E402
from run_file import RunFile, add_out_dir, load_runs, migrated_workloads  # noqa: E402

from nb_helpers.plan.planner import ALL_LINEAR, QKVO, PlanInput, Shape, plan  # noqa: E402

RAW = ROOT / "bench" / "results" / "raw"
RESULTS = ROOT / "bench" / "results"
OLD_PATH = dict(lean=False, fused_kernels=False, nomask=False, expandable=False)
# Which measurements the planner's two fitted constants (runtime overhead, allocator share) were read from, and
# which came after. The loading phase was added after holdout point l1b missed by -8.9%; l6, h6, h7 and the
# auto-fit runs were measured after the planner was final. These four sets ran the older path
# (prepare_model_for_kbit_training: fp32 embeddings, head, norms and residual stream; stock layers; masks).
SETS = {"grid1-fit.jsonl": "fit", "grid2-holdout.jsonl": "holdout", "grid3-holdout-final.jsonl": "holdout (final)",
        "autofit.jsonl": "auto-fit runs"}
# The lean GPU path (issue 8), two device calls on 2026-11-30. Call 2's grid ran with expandable segments; the
# allocator constants (EXPANDABLE_OVERHEAD_GIB, ALLOCATOR_OVERHEAD_GC_LEAN) were fitted on these same points, after
# both calls: there was no device time left for a holdout call.
LEAN_GRID = {"grid4-lean.jsonl": "lean path, grid (call 2)",
             # issue 11: Qwen3, Gemma 3, Llama-3.2-1B, Phi-4-mini, Qwen2.5 shapes (bench/planner_grid.py --points
             # families); the planner's constants were not refitted on them
             "grid5-families.jsonl": "families, grid",
             # checkpointed layers as CUDA graphs (the GPU default since device call 11): the graph terms were
             # fitted on call 11's TinyLlama throughput runs; these points (call 12) were not seen then
             "grid6-graphed.jsonl": "graphed layers, grid (held out)",
             # the five points call 12's deadline cut, run in call 13 (2026-12-01, 7839746): held out too
             "grid7-graphed.jsonl": "graphed layers, grid (held out, call 13)"}
# Old aggregates are read back from the run files bench/split_results.py made of them (run_file.migrated_workloads).
# throughput.json: the runs of its latest call (2026-12-01, call 24: auto-fit, and the reference's 1 x 8 set by hand,
# batches padded to 64 tokens; held out), and under "earlier" those of call 20 and of calls 15 and 16 (auto-fit, the
# 1 x 8 set by hand, eager and graphed; held out), of calls 11 and 12 (CUDA-graphed layers; the graph
# terms were fitted on call 11's), of call 9 (24fdab3, eager layers) and of 2026-11-30 (b121a9f,
# expandable segments on; the runs named "...-at-c8e6f11" are from call 1, before expandable segments). The 2026-11-30
# offloaded runs copied on the compute stream, without the one input the side-stream copies keep in flight, so the
# planner (which counts it) predicts them about 64 MiB high.
# issue 26 (2026-12-02, device calls 28-29 at 838da76): bench/step_time.py's runs, the planner not refitted on them: held out. Graphs and
# offloaded checkpoints as each run's log says.
STEP_TIME = {"step_time-call28-838da76.jsonl": "step-time runs (issue 26, call 28, held out)",
             "step_time-call29-838da76.jsonl": "step-time runs (issue 26, call 29, held out)"}
NEW_STEP_TIME = "step-time runs (held out)"  # every run file of bench/step_time.py: the planner is not fitted on them
# bench/planner_grid.py's run files (bench/results/runs/<name>.json) -> their role, and whether its GC points ran as
# CUDA graphs (as grid6/grid7 did); a new grid joins the report here
GRID_RUNS: dict[str, tuple[str, bool]] = {}
THROUGHPUT = {"throughput.json": ("throughput runs, padded batches (call 24, held out)", True, None),
              "throughput-levers.json": ("lean path, lever runs (call 2)", True, None),
              # call 11's 8 x 2048 runs (throughput.json holds call 12's there): fitted on too
              "raw/throughput-call11-646270b.json": ("graphed layers, throughput runs (fitted)", True, {"w2048"}),
              # issue 27 (2026-12-02): the recompute's dead product skipped (dead_tail; calls 31 and 33) and, in
              # call 32, only the runs without the LoRA dropout kernels (removed since): held out
              "raw/throughput-call31-dca9720.json": ("dead tail, throughput runs (call 31, held out)", True, None),
              "raw/throughput-call32-9fdf01b.json": ("dead tail, throughput runs (call 32, held out)", True, None,
                                                     {"no-dropout-kernels"}),
              "raw/throughput-call33-e14dedb.json": ("dead tail, throughput runs (call 33, held out)", True, None),
              "raw/throughput-call33-e14dedb-w512-turing.json": ("GTX 1650 card, bf16 and fp16 (call 33, held out)",
                                                                 True, None),
              # Llama layers as fused blocks (fast.fused_block, calls 34-35): held out
              "raw/throughput-call34-b25e3a2-w2048.json": ("fused blocks, 8 x 2048 (call 34, held out)", True, None),
              "raw/throughput-call34-b25e3a2-w512.json": ("fused blocks, 8 x 512 (call 34, held out)", True, None),
              "raw/throughput-call35-358a82c-w2048-reference_ours_ours-1x8.json": (
                  "fused blocks, 8 x 2048 and the reference's settings (call 35, held out)", True, None),
              "raw/throughput-call35-358a82c-w512-reference_ours_no-fused-block.json": (
                  "fused blocks, 8 x 512 (call 35, held out)", True, None),
              "raw/throughput-turing-call36-93ad4e3.json": ("fused blocks, GTX 1650 card, bf16 and fp16 (call 36, "
                                                            "held out)", True, None),
              # LoRA's dropout inside its rank-r products (fast.lora_dropout, calls 39-42), with and without: held
              # out; the planner counts the input it saves instead of the dropped copies and masks
              "raw/throughput-call39-w2048.json": ("dropout kernels, 8 x 2048 (call 39, held out)", True, None),
              "raw/throughput-call40-w512.json": ("dropout kernels, 8 x 512 (call 40, held out)", True, None),
              "raw/throughput-turing-call40.json": ("dropout kernels, GTX 1650 card, fp16 (call 40, held out)", True,
                                                    None),
              "raw/throughput-call41-w2048.json": ("dropout kernels, 8 x 2048 and the reference's settings (call 41, "
                                                   "held out)", True, None),
              "raw/throughput-call42-w512.json": ("dropout kernels, 8 x 512 (call 42, held out)", True, None),
              "raw/throughput-call42-w2048.json": ("dropout kernels, 8 x 2048 (call 42, held out)", True, None),
              # the absmax kept decoded in fp32 (absmax_once, call 45), with and without: held out
              "raw/throughput-call45-w2048.json": ("absmax kept decoded, 8 x 2048 (call 45, held out)", True, None),
              "raw/throughput-call45-w512.json": ("absmax kept decoded, 8 x 512 (call 45, held out)", True, None),
              # the recompute's weights kept dequantized (keep_dequantized, calls 49-50), with and without: held out
              "raw/throughput-call49.json": ("weights kept dequantized, 8 x 2048 and 8 x 512 (call 49, held out)", True,
                                             None),
              "raw/throughput-call50-w2048.json": ("weights kept dequantized, 8 x 2048 (call 50, held out)", True, None),
              "raw/throughput-call50-w512.json": ("weights kept dequantized, 8 x 512 (call 50, held out)", True, None),
              # the last layers not recomputed (fewer_recomputes, calls 52-54), with and without: held out. Call 51
              # (its graphed kept layers fell back to eager) and call 52's 8 x 512 (the warm-up's cache beside the
              # pool, fixed in 64485e1) ran code that is gone
              "raw/throughput-call52.json": ("layers not recomputed, 8 x 2048 (call 52, held out)", True, {"w2048"}),
              "raw/throughput-call53.json": ("layers not recomputed, 8 x 512 (call 53, held out)", True, None),
              "raw/throughput-call54.json": ("layers not recomputed, 8 x 2048 and 8 x 512 (call 54, held out)", True,
                                             None),
              # the recompute reusing its forward's LoRA products (down_once, calls 55 and 57), with and without:
              # held out
              "raw/throughput-call55.json": ("LoRA products reused, 8 x 2048 and 8 x 512 (call 55, held out)", True,
                                             None),
              "raw/throughput-call57.json": ("LoRA products reused, 8 x 2048 (call 57, held out)", True, None),
              "raw/throughput-call57b-w512.json": ("LoRA products reused, 8 x 512 (call 57, held out)", True, None),
              # a Triton dequantize kernel and a DataLoader worker (calls 58-59, both removed: no GPU memory either
              # way), and 4 x 2 graphed with offloaded checkpoints at 8 x 2048 (call 59): held out
              "raw/throughput-call58.json": ("levers since removed, 8 x 2048 (call 58, held out)", True, None),
              "raw/throughput-call59.json": ("4 x 2 graphed and offloaded, levers since removed, 8 x 2048 and 8 x 512 "
                                             "(call 59, held out)", True, None),
              # the host's share of the step (fast.host_step, call 60: no GPU memory either way), with and without
              "raw/throughput-call60.json": ("host-side levers, 8 x 2048 and 8 x 512 (call 60, held out)", True, None),
              "raw/throughput-call62.json": ("the default path, all three workloads (call 62, held out)", True, None),
              "raw/throughput-call63.json": ("the norms' backward for frozen weights, with and without (call 63, "
                                             "held out)", True, None),
              "raw/throughput-call64.json": ("the default path, 8 x 2048 and shipped (call 64, held out)", True, None),
              "raw/throughput-call65.json": ("NF4 dequantized inside CUDA graphs, with and without (call 65, held out)",
                                             True, None),
              **{f"raw/throughput-call66-{pair}.json": (f"NF4 inside graphs, order swapped (call 66, {pair}, held out)",
                                                       True, None) for pair in ("1-no-nf4", "1-ours", "2-no-nf4", "2-ours")},
              # keep_dequantized where the plan holds the kept weights, LoRA's swept launch settings (calls 68-70)
              "raw/throughput-call68.json": ("kept weights against none, 8 x 2048 and 8 x 512 (call 68, held out)", True,
                                             None),
              "raw/throughput-call69.json": ("kept weights where they fit, launch settings, each taken out (call 69, "
                                             "held out)", True, None),
              **{f"raw/throughput-call70{again}.json": (f"the default path (call 70{again}, held out)", True, None)
                 for again in ("", "-again")},
              # q, k and v as one function (fast.qkv, call 71)
              "raw/throughput-call71.json": ("q, k and v as one function, with and without (call 71, held out)", True,
                                             None),
              "raw/throughput-call72.json": ("q, k and v as one function, with and without (call 72, held out)", True,
                                             None),
              # the attention an offloaded checkpoint keeps for its recompute (call 73)
              "raw/throughput-call73.json": ("the kept attention, the default path (call 73, held out)", True, None),
              "raw/throughput-call73-pair.json": ("the kept attention, with and without (call 73, held out)", True,
                                                  None)}
EARLIER = {"call20": ("throughput runs (call 20, held out)", False),
           "calls15-16": ("graphed and lean hand-set runs, throughput (calls 15-16, held out)", False),
           "calls11-12": ("graphed layers, throughput runs (fitted)", False),
           "call9-24fdab3": ("lean path, throughput runs (call 9)", False),
           "2026-11-30": ("lean path, throughput runs (2026-11-30)", True)}
BEFORE_EXPANDABLE = "-at-c8e6f11"


def flags(fast: str | None, expandable_default: bool, log: list[str] | None = None,
          overlap_before: bool = False, graphs: bool = False, ran: dict | None = None) -> dict:
    """PlanInput switches for a run made with NB_FASTPATH=fast. Offloaded checkpoints and CUDA graphs are read from
    the run's own log, since auto-fit may choose them without NB_FASTPATH saying so; LoRA's dropout kernels from the
    levers the run recorded (`ran`: summary.json's fast_levers; runs before call 39 had none)."""
    fast = fast or ""
    off = {item.partition("=")[0] for item in fast.split(",") if item.endswith("=0")}
    offload = any("checkpoints offloaded to pinned CPU RAM" in line for line in log or [])
    chosen = [line for line in log or [] if line.startswith("[auto-fit] chose")]
    if chosen:  # auto-fit's own choice (its trial steps may have tried graphs on candidates it then dropped)
        graphs = "layers as CUDA graphs" in chosen[-1]
    elif log is not None:
        graphs = any("checkpointed layers replayed as CUDA graphs" in line for line in log)
    # runs before the side-stream copies (2026-11-30 and earlier) copied on the compute stream: no input in flight
    overlap = "offload_overlap" not in off and not overlap_before
    return dict(lean="lean" not in off, fused_kernels=not off & {"kernels", "lean"},
                nomask=not off & {"nomask", "lean"}, expandable=expandable_default and "expandable" not in off,
                offload=offload, offload_overlap=overlap, graphs=graphs and "graphs" not in off,
                dropout_kernels=bool((ran or {}).get("dropout_kernels")),
                absmax_once=bool((ran or {}).get("absmax_once")),
                down_once=bool((ran or {}).get("down_once")))


def rows():
    for name, role in SETS.items():
        for line in (RAW / name).read_text().splitlines():
            r = json.loads(line)
            if r["returncode"] != 0:
                continue
            if name == "autofit.jsonl":
                r.update(batch=r["chosen_batch"], accum=r["chosen_accum"], gc=r["chosen_gc"])
            yield role, r, OLD_PATH
    for name, role in LEAN_GRID.items():
        if not (RAW / name).exists():
            continue
        for line in (RAW / name).read_text().splitlines():
            r = json.loads(line)
            if r["returncode"] == 0:  # the graphed grid ran with fixed settings: every GC point as graphs
                yield role, r, flags(None, True, graphs=name.startswith(("grid6", "grid7")) and r["gc"])
    for name, (role, graphs) in GRID_RUNS.items():
        for r in json.loads((RESULTS / "runs" / name).read_text())["results"]["rows"]:
            if r["returncode"] == 0:
                yield role, r, flags(None, True, graphs=graphs and r["gc"])
    step_time = [(role, (RAW / name).read_text().splitlines()) for name, role in STEP_TIME.items()]
    step_time += [(NEW_STEP_TIME, [json.dumps(r) for r in run["results"]["rows"]]) for run in load_runs("step-time")]
    for role, lines in step_time:
        for line in lines:
            r = json.loads(line)
            if r["returncode"] == 0 and r.get("measured_gib"):
                yield role, r, flags(None, True, r.get("log") or [])
    for name, (role, expandable, only, *runs) in THROUGHPUT.items():
        if name.startswith("raw/"):
            workloads = json.loads((RESULTS / name).read_text())["workloads"]
        else:  # an old aggregate's top level
            workloads = migrated_workloads(name)
        workloads = {k: v for k, v in workloads.items() if only is None or k in only}
        suffix = "@" + name.split("-")[1] if name.startswith("raw/") else ""  # raw/throughput-callN-...: @callN
        yield from throughput_rows(workloads, role, expandable, suffix, runs=runs[0] if runs else None)
        if name == "throughput.json":  # and the records it kept under "earlier"
            for key, (earlier_role, before_overlap) in EARLIER.items():
                yield from throughput_rows(migrated_workloads(name, f"earlier/{key}"), earlier_role, expandable,
                                           f"@{key}", before_overlap)


def throughput_rows(workloads: dict, role: str, expandable: bool, suffix: str, before_overlap: bool = False,
                    runs: set | None = None):
    for workload, entry in workloads.items():
        if workload == "shipped":  # ragged rows: the planner plans for full-length ones (max_length)
            continue
        for run, r in entry["runs"].items():
            if r.get("recipe") != "ours" or r.get("returncode") != 0 or (runs is not None and run not in runs):
                continue
            yield role, dict(id=f"{workload}/{run}{suffix}", shape="tinyllama-1.1b", seq=entry["seq"],
                             batch=r["micro_batch"],
                             accum=r["accum"], rank=8, targets="q_proj,k_proj,v_proj,o_proj", gc=r["gc"],
                             budget_gib=4.0, measured_gib=r["peak_device_gib"], reserved_gib=r["peak_reserved_gib"],
                             allocated_gib=r["peak_allocated_gib"], context_gib=r["context_gib"]), \
                {**flags(r.get("fast"), expandable and BEFORE_EXPANDABLE not in run, r.get("log") or [],
                         overlap_before=before_overlap, ran=r.get("fast_levers")),  # 2026-11-30's: copies on the
                 "no_recompute_layers": r.get("no_recompute_layers") or 0}  # compute stream


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_dir(parser)
    args = parser.parse_args()
    run_file = RunFile("planner-validation", out_dir=args.out_dir, device="cpu")
    out = []
    for role, r, path in rows():
        shape = Shape.from_config(SHAPES[r["shape"]], name=r["shape"])
        targets = ALL_LINEAR if r["targets"] == "all-linear" else QKVO  # under each model's names (Phi: qkv_proj)
        inp = PlanInput(seq=r["seq"], batch=r["batch"], accum=r["accum"], rank=r["rank"], targets=targets,
                        gradient_checkpointing=r["gc"], context_gib=r["context_gib"], gpu_capability=(9, 0), **path)
        p = plan(shape, inp)
        out.append(dict(id=r["id"], set=role, shape=r["shape"], seq=r["seq"], batch=r["batch"], accum=r["accum"],
                        rank=r["rank"], targets="all-linear" if r["targets"] == "all-linear" else "q,k,v,o",
                        gc=r["gc"], budget_gib=r["budget_gib"], predicted_gib=round(p.peak_gib, 3),
                        measured_gib=round(r["measured_gib"], 3), error_pct=round(100 * (p.peak_gib / r["measured_gib"] - 1), 1),
                        measured_reserved_gib=round(r["reserved_gib"], 3),
                        measured_allocated_gib=round(r["allocated_gib"], 3),
                        predicted_allocated_gib=round(sum(v for k, v in p.components.items() if k not in
                                                          ("context", "runtime", "optimizer_paged", "allocator")) / 2**30, 3),
                        context_gib=round(r["context_gib"], 3), peak_phase=p.peak_phase,
                        path={k: v for k, v in path.items()}))
    print(f"wrote {run_file.write({'measured_on': 'NVIDIA H200', 'points': out})}")
    print("| id | set | shape | seq | batch×accum | rank | targets | GC | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for o in [o for o in out if o["set"].startswith(("lean", "families", "graphed"))]:
        print(f"| {o['id']} | {o['set']} | {o['shape']} | {o['seq']} | {o['batch']}×{o['accum']} | {o['rank']} | "
              f"{o['targets']} | {'on' if o['gc'] else 'off'} | {o['predicted_gib']:.2f} | {o['measured_gib']:.2f} | "
              f"{o['error_pct']:+.1f}% |")
    lean = [o for o in out if o["set"].startswith(("lean", "families", "graphed"))]
    worst = max(lean, key=lambda o: abs(o["error_pct"]))
    print(f"\nlean path: {len(lean)} points, {len({o['shape'] for o in lean})} shapes; worst error {worst['error_pct']:+.1f}% "
          f"({worst['id']}); mean |error| {sum(abs(o['error_pct']) for o in lean) / len(lean):.1f}%")
    worst = max(out, key=lambda o: abs(o["error_pct"]))
    print(f"all: {len(out)} points, {len({o['shape'] for o in out})} shapes; worst error {worst['error_pct']:+.1f}% "
          f"({worst['id']}); mean |error| {sum(abs(o['error_pct']) for o in out) / len(out):.1f}%")
    for role in dict.fromkeys(o["set"] for o in out):
        errs = [abs(o["error_pct"]) for o in out if o["set"] == role]
        print(f"  {role}: {len(errs)} points, worst |error| {max(errs):.1f}%")


if __name__ == "__main__":
    main()
