"""What learners read, generated from the run files: bench/results/latest.json (the newest figure for each thing the
README and the notebooks read) and bench/RESULTS.md (the same as tables). Both come from bench/results/runs/*.json
only (bench/run_file.py), never edited by hand; tests/test_benchmarks.py fails when they differ from what this
script writes.

    python bench/summarize.py      # or `make results`

Every figure names the machine, the date and the command that measured it. Commands are shown as run, without
their output paths (--out, --out-dir, --trace: where a file went, not what was measured).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RESULTS, RUNS, load_runs, order  # noqa: E402

LATEST = RESULTS / "latest.json"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
WORKLOADS = {"w512": "8 × 512 tokens", "w2048": "8 × 2048 tokens", "shipped": "the shipped data (~110 tokens a row)"}
GTX1650 = {"bfloat16": "ours-bfloat16-gtx1650", "float16": "ours-float16-gtx1650"}
SPREAD = "tokens per second, reference and ours"


# --- reading the runs ---------------------------------------------------------------------------------------------
def shown(command) -> str:
    """The command as a reader is shown it (nb_helpers.ui.benchmarks.shown_command, the notebooks' too)."""
    from nb_helpers.ui.benchmarks import shown_command

    return shown_command(command)


def machine(run: dict) -> str:
    m = run.get("machine") or {}
    if m.get("gpu"):
        return f"{m['gpu_count']} × {m['gpu']}" if (m.get("gpu_count") or 1) > 1 else m["gpu"]
    if m.get("cpu"):
        return f"{m['cpu']}, {m['cores']} cores" if m.get("cores") else m["cpu"]
    return (run.get("results") or {}).get("measured_on") or (run.get("results") or {}).get("gpu") or "not recorded"


def source(run: dict) -> dict:
    return {"machine": machine(run), "date": run["date"], "command": shown(run.get("command")), "run_file": run["file"]}


def report_source(run: dict, measured_on: str) -> dict:
    """A report (planner, time model): the GPU measured, the report computed its predictions where it ran."""
    where = machine(run) if (run.get("machine") or {}).get("cpu") else None
    return {**source(run), "machine": f"measured on {measured_on}" + (f", predicted on {where}" if where else "")}


def runs_of(run: dict, workload: str) -> dict:
    return ((run["results"].get("workloads") or {}).get(workload) or {}).get("runs") or {}


def batch(record: dict) -> tuple:
    if record.get("micro_batch") is not None:
        return record["micro_batch"], record.get("accum")
    found = re.match(r"(\d+) x (\d+)", record.get("micro_batch_x_accum") or "")
    return (int(found.group(1)), int(found.group(2))) if found else (None, None)


def side(record: dict) -> dict:
    micro, accum = batch(record)
    return {"micro_batch": micro, "accum": accum, "median_step_s": record.get("median_step_s"),
            "tokens_per_s": record["tokens_per_s"], "peak_device_gib": record.get("peak_device_gib")}


# --- each thing learners read ---------------------------------------------------------------------------------------
def throughput(runs: list[dict]) -> dict:
    """Per workload, the newest run with the reference and our default path, both measured in it."""
    out, picked, versions = {}, {}, None
    for workload, label in WORKLOADS.items():
        for run in reversed(runs):
            pair = runs_of(run, workload)
            ref, ours = pair.get("reference") or {}, pair.get("ours") or {}
            if ref.get("tokens_per_s") and ours.get("tokens_per_s"):
                out[workload] = {"label": label, **source(run), "reference": side(ref), "ours": side(ours),
                                 "ratio": ours["tokens_per_s"] / ref["tokens_per_s"]}
                picked[workload] = run
                versions = versions or run.get("versions")
                break
    spread = {}
    for workload in WORKLOADS:  # the reference's own speed over every run: it follows the host
        seen = []
        for run in runs:
            ref = runs_of(run, workload).get("reference") or {}
            pair = ((run["results"].get("summaries") or {}).get(SPREAD) or {}).get(workload) or {}
            value = ref.get("tokens_per_s") or pair.get("reference_tokens_per_s")
            if value:
                seen.append(value)
        if seen:
            spread[workload] = {"min": min(seen), "max": max(seen), "runs": len(seen)}
    newest = max(runs, key=lambda r: r["date"]) if runs else {}
    return {"what": "the reference recipe (1 × 8, plain transformers + peft + TRL) against our default GPU path "
                    "(auto-fit), both in the same run on one GPU; TinyLlama-1.1B shape with random weights, "
                    "effective batch 8",
            "budget_gib": (newest.get("results") or {}).get("budget_gib", 4.0), "versions": versions,
            "workloads": out, "reference_range": spread, "ours_copies": copies_over_runs(runs, picked)}


def copies_of(run: dict, workload: str) -> dict | None:
    """Our default path's copies in its profiled step (checkpoints to CPU RAM and back), in ms: all of them, and
    the part with no compute beside it. None where it copied less than 10 ms (no offload)."""
    busy = (runs_of(run, workload).get("ours") or {}).get("busy") or {}
    if (busy.get("copy_s") or 0) < 0.010 or busy.get("compute_busy_s") is None:
        return None
    return {"copy_ms": busy["copy_s"] * 1e3, "alone_ms": (busy["busy_s"] - busy["compute_busy_s"]) * 1e3}


def copies_over_runs(runs: list[dict], shown: dict) -> dict:
    """Per workload where ours copies: the range over every committed run, and the run the table shows (`shown`,
    per workload). Ours follows the host there too: how much of the copying the compute hides depends on the host."""
    out = {}
    for workload in WORKLOADS:
        seen = [c for run in runs if (c := copies_of(run, workload))]
        if not seen:
            continue
        ranges = {key: [min(c[key] for c in seen), max(c[key] for c in seen)] for key in ("copy_ms", "alone_ms")}
        out[workload] = {"runs": len(seen), "shown": copies_of(shown[workload], workload) if workload in shown
                         else None, **ranges}
    return out


def plain_vs_reference(runs: list[dict]) -> dict:
    """fast_path=False at the reference's 1 × 8 against the reference, the newest run that measured both."""
    out = {}
    for workload in WORKLOADS:
        for run in reversed(runs):
            entry = (run["results"].get("workloads") or {}).get(workload) or {}
            same, r = entry.get("plain_vs_reference"), entry.get("runs") or {}
            if same and r.get("ours-plain-1x8"):
                out[workload] = {"label": WORKLOADS[workload], **source(run), **same,
                                 "reference": side(r["reference"]), "plain": side(r["ours-plain-1x8"]),
                                 "ours": side(r["ours"]) if (r.get("ours") or {}).get("tokens_per_s") else None,
                                 "ours_1x8": side(r["ours-1x8"]) if (r.get("ours-1x8") or {}).get("tokens_per_s")
                                 else None}
                break
    return out


def gtx1650(runs: list[dict]) -> dict:
    """The GTX 1650 card emulated on the H200 (its budget and capability; the H200's speed, not the card's)."""
    out = {}
    for workload in ("w512", "w2048"):
        for dtype, name in GTX1650.items():
            for run in reversed(runs):
                r = runs_of(run, workload).get(name) or {}
                if r.get("tokens_per_s"):
                    losses = r.get("losses") or []
                    out.setdefault(workload, {})[dtype] = {
                        **source(run), **side(r), "gc": r.get("gc"), "steps": len(losses),
                        "last_loss": losses[-1] if losses else None}
                    break
    return out


def newest(runs: list[dict]) -> dict | None:
    return runs[-1] if runs else None


def cpu(runs: list[dict]) -> dict | None:
    """The newest measurement of each variant per ISA limit (a run may measure only some: --variants), each row with
    its batch (the profile it ran under, with the variant's change) and the run that measured it."""
    if not runs:
        return None
    rows = {}
    for run in runs:
        r = run["results"]
        for row in r["rows"]:
            shape = {**r["profile"], **(row.get("changes") or {})}
            rows[(row["isa_limit"], row["variant"])] = {
                **{k: row.get(k) for k in ("isa_limit", "variant", "compute_dtype", "threads", "steps_done",
                                           "stopped_after_s", "median_step_s", "tokens_per_s")},
                "phase": row.get("phase", "sft"), "batch": f"{shape['micro_batch_size']} × {shape['grad_accum']}",
                "steps": r["steps"], **source(run)}
    return {"rows": sorted(rows.values(), key=lambda row: (row["isa_limit"] != "native", row["phase"] == "dpo"))}


def course(runs: list[dict]) -> list[dict]:
    """Every timed fresh-clone course (bench/course_time.py), oldest first: setup, make run, make test, per notebook."""
    rows = []
    for run in runs:
        r = run["results"]
        env = run.get("environment") or {}
        rows.append({**source(run), "as_avx2": env.get("ATEN_CPU_CAPABILITY") == "avx2",
                     **{k: r.get(k) for k in ("setup_s", "setup_exit", "run_s", "run_exit", "test_s",
                                              "test_exit", "notebooks_s")},
                     "sft": (r.get("runs") or {}).get("sft"), "dpo": (r.get("runs") or {}).get("dpo")})
    return rows


def planner(validation: dict | None, from_cpu: dict | None) -> dict | None:
    if not validation:
        return None
    points = validation["results"]["points"]
    errors = [abs(p["error_pct"]) for p in points]
    held = [abs(p["error_pct"]) for p in points if "held out" in p["set"] or p["set"].startswith("holdout")]
    measured_on = validation["results"].get("measured_on", "NVIDIA H200")
    out = {**report_source(validation, measured_on), "measured_on": measured_on,
           "points": len(points), "shapes": len({p["shape"] for p in points}),
           "worst_abs_error_pct": max(errors), "mean_abs_error_pct": round(statistics.mean(errors), 2),
           "held_out_points": len(held), "held_out_worst_abs_error_pct": max(held) if held else None,
           "held_out_mean_abs_error_pct": round(statistics.mean(held), 2) if held else None}
    if from_cpu:
        r = from_cpu["results"]
        out["planned_from_cpu"] = {**report_source(from_cpu, measured_on), **{k: r[k] for k in (
            "points", "skipped_other_paths", "worst_abs_error_pct", "mean_abs_error_pct", "without_gpu_extras")}}
    return out


def step_time(run: dict | None) -> dict | None:
    if not run:
        return None
    r = run["results"]
    out = {**report_source(run, r.get("gpu") or "NVIDIA H200"), "measured_on": r.get("gpu"), "fit_points": r["fit_points"],
           "held_out_points": r["held_out_points"], "held_out": r["held_out"]}
    if r.get("changed_path"):
        out["later_runs"] = {"points": len(r["changed_path"]["points"]), **r["changed_path"]["summary"]}
    return out


def multi_gpu(runs: list[dict]) -> dict:
    out = {}
    for run in runs:
        r = run["results"]
        worlds = r.get("worlds") or {}
        out[str(r["seq"])] = {
            **source(run), "seq": r["seq"], "global_batch": r["global_batch"],
            "micro_batch_per_gpu": r["micro_batch_per_gpu"], "budget_gib_per_gpu": r["budget_gib_per_gpu"],
            "tokens_per_s": {world: w.get("tokens_per_s") for world, w in sorted(worlds.items())},
            "scaling_2_gpus": r.get("scaling_2_gpus"), "target_scaling": r.get("target_scaling")}
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def reach(run: dict | None) -> dict | None:
    if not run:
        return None
    r = run["results"]
    return {**source(run), "budget_gib": r["budget_gib"],
            "points": [{k: p.get(k) for k in ("name", "shape", "seq", "batch", "accum", "options", "returncode",
                                              "oom", "peak_device_gib", "predicted_gib", "error_pct",
                                              "tokens_per_s")} for p in r["points"]]}


def reproducibility(runs: list[dict]) -> dict | None:
    """Each variant's newest pair (a run may have measured only some: --only), with the run that measured it."""
    if not runs:
        return None
    pairs = {}
    for run in runs:
        for p in run["results"]["pairs"]:
            pairs[p["variant"]] = {**{k: p.get(k) for k in ("variant", "against", "steps", "identical",
                                                           "max_relative_loss_difference")}, **source(run)}
    first = next(iter(pairs.values()))
    return {k: first[k] for k in ("machine", "date", "command", "run_file")} | {"pairs": list(pairs.values())}


# A lever stays where, taken out alone in one run beside our default, it costs at least this share of the step (on
# the H200, host-bound) or of the GPU's compute per token (the step of a GPU-bound 4 GB card) at some workload
KEEP_SHARE = 0.03
TAKES_ALONG = {"down_once": "taken out, it takes saved_attention with it (which reuses its stash): at 8 × 2048 the "
                            "two are measured together"}


def lever_gains(runs: list[dict]) -> dict:
    """Each lever's gain, from the runs that took levers out one at a time beside our default (bench/throughput.py
    --gains): per workload, our default's median step (the median over its runs in that file) against the step
    and GPU compute per token without the lever; the newest measurement of each lever wins."""
    levers: dict[str, dict] = {}
    for run in runs:
        for workload in WORKLOADS:
            found = runs_of(run, workload)
            ours = [r for name, r in found.items() if name.startswith("ours") and r.get("median_step_s")]
            if not ours:
                continue
            steps = [r["median_step_s"] for r in ours]
            # our default's own spread here; None where it ran once (a cut call): no bracket, so no step verdict
            step = statistics.median(steps)
            noise = round(max(steps) / min(steps) - 1, 4) if len(steps) > 1 else None
            compute = statistics.median((r.get("busy") or {}).get("compute_us_per_token") or 0 for r in ours)
            for name, r in found.items():
                if not name.startswith("no-") or not r.get("median_step_s"):
                    continue
                off = (r.get("busy") or {}).get("compute_us_per_token")
                levers.setdefault(name[3:].replace("-", "_"), {"workloads": {}})["workloads"][workload] = {
                    "step_s": round(step, 4), "step_s_without": round(r["median_step_s"], 4),
                    "step_gain": round(r["median_step_s"] / step - 1, 4), "step_noise": noise,
                    "compute_us_per_token": round(compute, 2) if compute else None,
                    "compute_us_per_token_without": round(off, 2) if off else None,
                    "compute_gain": round(off / compute - 1, 4) if off and compute else None,
                    "peak_gib": round(statistics.median(o["peak_device_gib"] for o in ours), 2),
                    "peak_gib_without": r.get("peak_device_gib") and round(r["peak_device_gib"], 2),
                    **source(run)}
    from nb_helpers.fast.options import FastOptions

    present = {f.name for f in fields(FastOptions)}
    for lever, entry in levers.items():
        entry["in_the_package"] = lever in present
        entry["earns_its_place"] = any(
            (w["step_noise"] is not None and w["step_gain"] >= max(KEEP_SHARE, w["step_noise"]))
            or (w["compute_gain"] or 0) >= KEEP_SHARE
            for w in entry["workloads"].values())
        if lever in TAKES_ALONG:
            entry["note"] = TAKES_ALONG[lever]
    return {"rule": f"kept where taking it out costs at least {KEEP_SHARE:.0%} of the GPU's compute per token, or of "
                    "the step and more than our default's own step varied between its runs beside it, at one "
                    "workload", "levers": dict(sorted(levers.items()))}


def lever_memory(run: dict | None) -> dict | None:
    """Per lever, where taking it out changes what auto-fit picks under the GTX 1650 preset (bench/lever_memory.py)."""
    if run is None:
        return None
    changes: dict[str, list[str]] = {}
    for p in run["results"]["points"]:
        if p["choice_changed"]:
            ours, without = p["ours"], p["without"]
            say = (f"{p['model']} at {p['seq']} tokens: {ours.get('micro_batch')} × {ours.get('accum')}"
                   f"{'' if ours.get('gc') else ' without checkpointing'} → {without.get('micro_batch')} × "
                   f"{without.get('accum')}{'' if without.get('gc') else ' without checkpointing'}"
                   if p["choice_changed"].keys() & {"micro_batch", "gc"} else
                   f"{p['model']} at {p['seq']} tokens: " + ", ".join(
                       f"{k} {a} → {b}" for k, (a, b) in p["choice_changed"].items()))
            changes.setdefault(p["lever"], []).append(say)
    levers = sorted({p["lever"] for p in run["results"]["points"]})
    return {"card": run["results"]["card"], "levers": {lever: changes.get(lever, []) for lever in levers},
            **source(run)}


def dpo(runs: list[dict]) -> dict | None:
    """bench/dpo.py: the newest measurement of each (shape, length, run), with the planner's prediction beside its
    peak; and, where one run file measured TRL's plain DPO beside ours at a point, their speed and memory (same-call
    ratios only)."""
    if not runs:
        return None
    points, speed = {}, []
    for run in runs:
        by_point: dict[tuple, dict] = {}
        for p in run["results"]["points"]:
            row = {k: p.get(k) for k in ("shape", "seq", "run", "micro_batch", "accum", "gc", "returncode",
                                         "median_step_s", "tokens_per_s", "peak_device_gib", "peak_reserved_gib",
                                         "predicted_here_gib", "predicted_phase", "planner_error",
                                         "predicted_gtx1650_gib", "gtx1650_budget_gib")}
            row.update(source(run))
            points[(p["shape"], p["seq"], p["run"])] = row
            by_point.setdefault((p["shape"], p["seq"]), {})[p["run"]] = row
        for (shape, seq), runs_here in by_point.items():
            plain = runs_here.get("plain")
            if plain and plain.get("tokens_per_s"):
                speed.append({"shape": shape, "seq": seq, "plain": plain, **source(run), **{
                    name: {**runs_here[name], "speedup": runs_here[name]["tokens_per_s"] / plain["tokens_per_s"]}
                    for name in ("ours", "ours-fit") if (runs_here.get(name) or {}).get("tokens_per_s")}})
    validated = [p for p in points.values() if p.get("planner_error") is not None]
    return {"points": sorted(points.values(), key=lambda p: (p["shape"], p["seq"], p["run"])),
            "within_10_percent": sum(abs(p["planner_error"]) <= 0.10 for p in validated), "validated": len(validated),
            "speed": speed}


def against_baseline(runs: list[dict]) -> list[dict]:
    """Every bench/against_commit.py run, oldest first: our default GPU path at the commit measured against an
    earlier engine, alternating on one card in one run (the only comparison of two engines that host speed does not
    bend). Runs are never pooled: each is its own host. The earlier engine is named by its date."""
    out = []
    for run in sorted(runs, key=lambda r: order(r, r["file"])):
        r = run["results"]
        out.append({"baseline_date": r["baseline"]["date"], "rounds": len(r["rounds"]),
                    "workloads": {w: r["summary"][w] for w in WORKLOADS if w in r["summary"]}, **source(run)})
    return out


def latest(runs_dir: Path = RUNS) -> dict:
    by_kind: dict[str, list[dict]] = {}
    for run in load_runs(runs_dir=runs_dir):
        by_kind.setdefault(run["kind"], []).append(run)
    tp = by_kind.get("throughput", [])
    seqs = {}
    for run in by_kind.get("multi-gpu", []):  # the newest run per sequence length
        seqs[run["results"]["seq"]] = run
    return {
        "about": "generated by `python bench/summarize.py` from bench/results/runs/*.json; do not edit",
        "throughput": throughput(tp),
        "plain_vs_reference": plain_vs_reference(tp),
        "gtx1650_emulated": gtx1650(tp),
        "cpu": cpu(by_kind.get("cpu", [])),
        "course": course(by_kind.get("course", [])),
        "planner": planner(newest(by_kind.get("planner-validation", [])), newest(by_kind.get("planner-from-cpu", []))),
        "step_time": step_time(newest(by_kind.get("step-time-model", []))),
        "multi_gpu": multi_gpu(list(seqs.values())),
        "reach": reach(newest(by_kind.get("reach", []))),
        "reproducibility": reproducibility(by_kind.get("reproducibility", [])),
        "lever_gains": lever_gains(sorted([r for r in by_kind.get("lever-gains", []) + tp if "--gains" in
                                           str(r.get("command"))], key=lambda r: order(r, r["file"]))),
        "lever_memory": lever_memory(newest(by_kind.get("lever-memory", []))),
        "against_baseline": against_baseline(by_kind.get("against-commit", [])),
        "dpo": dpo(by_kind.get("dpo", [])),
    }


# --- RESULTS.md -----------------------------------------------------------------------------------------------------
def n(value, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def head(*cells: str) -> list[str]:
    """A table's header row and the separator under it, one column a cell."""
    return ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]


class Refs:
    """Rows cite their run as [n]; the list under the table names its machine, date, command and run file (rows of
    one run share its note, each run has its own)."""

    def __init__(self):
        self.items: list[dict] = []

    def __call__(self, src: dict) -> str:
        key = (src["machine"], src["date"], src["command"], src["run_file"])
        for i, item in enumerate(self.items, 1):
            if (item["machine"], item["date"], item["command"], item["run_file"]) == key:
                return f"[{i}]"
        self.items.append(src)
        return f"[{len(self.items)}]"

    def lines(self) -> list[str]:
        return ["", *[f"[{i}] {s['machine']}, {s['date']}: `{s['command']}` (`{s['run_file']}`)"
                      for i, s in enumerate(self.items, 1)]]


def speed_table(data: dict) -> list[str]:
    """The reference recipe against our default GPU path, one row a workload."""
    tp = data["throughput"]
    if not tp["workloads"]:
        return []
    refs = Refs()
    out = ["", "## Speed: the reference recipe against our default GPU path", "",
           f"{tp['what'][0].upper() + tp['what'][1:]}, under an emulated {tp['budget_gib']:g} GiB budget "
           "(allocator capped, CUDA context included). Ratios mean something within one run only: the "
           "reference's speed follows the host's CPU.", "",
           *head("workload", "reference (1 × 8): s/step, tokens/s, peak GiB",
                 "ours: micro-batch × accum, s/step, tokens/s, peak GiB", "ratio", "measured")]
    for workload, e in tp["workloads"].items():
        ref, ours = e["reference"], e["ours"]
        out.append(f"| {e['label']} | {n(ref['median_step_s'], 3)}, {n(ref['tokens_per_s'])}, "
                   f"{n(ref['peak_device_gib'], 2)} | {ours['micro_batch']} × {ours['accum']}, "
                   f"{n(ours['median_step_s'], 3)}, {n(ours['tokens_per_s'])}, {n(ours['peak_device_gib'], 2)} | "
                   f"**{e['ratio']:.1f}×** | {e['machine']}, {e['date']} {refs(e)} |")
    out += refs.lines()
    if tp["reference_range"]:
        out += ["", "The reference recipe's own speed over every committed run (the same code, other hosts): " +
                "; ".join(f"{WORKLOADS[w]} {n(r['min'])}–{n(r['max'])} tokens/s ({r['runs']} runs)"
                          for w, r in tp["reference_range"].items()) + "."]
    for workload, c in tp.get("ours_copies", {}).items():
        shown = c["shown"]
        out += ["", f"At {WORKLOADS[workload]} our path keeps its checkpoints in CPU RAM: over every committed run "
                f"({c['runs']}, earlier engines included) its "
                f"copies out and back took {n(c['copy_ms'][0])}–{n(c['copy_ms'][1])} ms of the profiled step, and "
                f"for {n(c['alone_ms'][0])}–{n(c['alone_ms'][1])} ms of them no compute ran beside them, so ours "
                "follows the host there too" + (f" (the run above: {n(shown['alone_ms'])} of {n(shown['copy_ms'])} "
                                                 "ms)." if shown else ".")]
    return out


def plain_table(data: dict) -> list[str]:
    """`fast_path=False` at the reference's 1 × 8, beside the reference."""
    pv = data["plain_vs_reference"]
    if not pv:
        return []
    refs = Refs()
    out = ["", "## `fast_path=False` against the reference", "",
           "Our course's code on the plain stack (`RunConfig(fast_path=False)`) at the reference's 1 × 8, beside "
           "the reference in the same run: the same peak memory, losses within a percent (LoRA's random A "
           "differs between the two runs).", "",
           *head("workload", "reference tokens/s", "`fast_path=False` tokens/s", "speed ratio",
                 "peak GiB, reference / plain", "largest loss difference", "ours at 1 × 8 set by hand: peak GiB",
                 "measured")]
    for workload, e in pv.items():
        out.append(f"| {e['label']} | {n(e['reference']['tokens_per_s'])} | {n(e['plain']['tokens_per_s'])} | "
                   f"{e['speed_ratio']:.2f} | {n(e['reference']['peak_device_gib'], 2)} / "
                   f"{n(e['plain']['peak_device_gib'], 2)} | {e['max_loss_rel_diff']:.2%} over "
                   f"{e['steps_compared']} steps | "
                   f"{n((e['ours_1x8'] or {}).get('peak_device_gib'), 2) if e['ours_1x8'] else 'not run'} | "
                   f"{e['machine']}, {e['date']} {refs(e)} |")
    out += refs.lines()
    return out


def gtx1650_table(data: dict) -> list[str]:
    """Auto-fit for the GTX 1650, emulated: memory, settings and numerics in bf16 and fp16."""
    g = data["gtx1650_emulated"]
    if not g:
        return []
    refs = Refs()
    out = ["", "## The GTX 1650 card, emulated", "",
           "The GTX 1650 (4 GB) card's budget and compute capability on the H200, auto-fit choosing for that "
           "card: memory, settings and numerics in bf16 and in fp16 (what that card computes in). The H200 "
           "computes both, so the tokens/s are the H200's, not a GTX 1650's.", "",
           *head("workload", "dtype", "auto-fit chose", "checkpointing", "peak GiB", "s/step", "tokens/s (H200)",
                 "last loss", "measured")]
    for workload, dtypes in g.items():
        for dtype, e in dtypes.items():
            out.append(f"| {WORKLOADS[workload]} | {dtype} | {e['micro_batch']} × {e['accum']} | "
                       f"{'on' if e['gc'] else 'off'} | {n(e['peak_device_gib'], 2)} | {n(e['median_step_s'], 3)} | "
                       f"{n(e['tokens_per_s'])} | {n(e['last_loss'], 2)} after {e['steps']} steps | "
                       f"{e['machine']}, {e['date']} {refs(e)} |")
    out += refs.lines()
    return out


def planner_table(data: dict) -> list[str]:
    """The memory planner against every committed measured peak."""
    p = data["planner"]
    if not p:
        return []
    refs = Refs()
    out = ["", "## The memory planner against measured peaks", "",
           f"`python -m nb_helpers plan` beside every committed peak measured on {p['measured_on']} "
           "(NVML device memory, CUDA context included).", "",
           *head("points", "shapes", "worst error", "mean error", "held out of every fit: points, worst, mean",
                 "report"),
           f"| {p['points']} | {p['shapes']} | {p['worst_abs_error_pct']:.1f}% | {p['mean_abs_error_pct']:.2f}% | "
           f"{p['held_out_points']}, {n(p['held_out_worst_abs_error_pct'], 1)}%, "
           f"{n(p['held_out_mean_abs_error_pct'], 2)}% | {p['date']} {refs(p)} |"]
    c = p.get("planned_from_cpu")
    if c:
        w = c["without_gpu_extras"]
        out += ["", f"The {c['points']} points of today's GPU path planned from a machine without the GPU (as a "
                    f"learner plans a card they do not have): worst {c['worst_abs_error_pct']:.1f}%, mean "
                    f"{c['mean_abs_error_pct']:.2f}% (without the GPU extras assumed: worst "
                    f"{w['worst_abs_error_pct']:.1f}%, mean {w['mean_abs_error_pct']:.2f}%, {w['beyond_10_pct']} "
                    f"beyond 10%); {c['skipped_other_paths']} points of paths since removed left out. "
                    f"{c['date']} {refs(c)}."]
    out += refs.lines()
    return out


def step_time_table(data: dict) -> list[str]:
    """The step-time model against measured steps it was not fitted on."""
    s = data["step_time"]
    if not s:
        return []
    refs = Refs()
    step, busy = s["held_out"]["step_error"], s["held_out"]["busy_error"]
    out = ["", "## The step-time model against measured steps", "",
           f"`nb_helpers/plan/step_time.py` against {s['measured_on']}'s measured step and GPU-busy times; "
           f"its constants fitted on {s['fit_points']} points, validated on {s['held_out_points']} it did not "
           "see.", "",
           *head("held-out points", "step time within 15%", "worst, mean step error", "GPU busy within 15%",
                 "worst, mean busy error", "report"),
           f"| {s['held_out_points']} | {step['within_15pct']} | {step['worst']:.1%}, {step['mean']:.1%} | "
           f"{busy['within_15pct']} | {busy['worst']:.1%}, {busy['mean']:.1%} | {s['date']} {refs(s)} |"]
    if s.get("later_runs"):
        lr = s["later_runs"]
        out += ["", f"Later runs of the changed GPU path ({lr['points']} profiled runs, held out): step within "
                    f"15% at {lr['step_error']['within_15pct']} (worst {lr['step_error']['worst']:.1%}, mean "
                    f"{lr['step_error']['mean']:.1%}), GPU busy at {lr['busy_error']['within_15pct']} (worst "
                    f"{lr['busy_error']['worst']:.1%}, mean {lr['busy_error']['mean']:.1%})."]
    out += refs.lines()
    return out


def multi_gpu_table(data: dict) -> list[str]:
    """One GPU against two at the same global batch."""
    m = data["multi_gpu"]
    if not m:
        return []
    refs = Refs()
    out = ["", "## Several GPUs (DDP)", "",
           "The same global batch on one GPU and on two, each under its own 4 GiB budget.", "",
           *head("tokens a row", "global batch", "micro-batch per GPU", "1 GPU tokens/s", "2 GPUs tokens/s",
                 "2 GPUs over 1", "measured")]
    for e in m.values():
        t = e["tokens_per_s"]
        out.append(f"| {e['seq']:,} | {e['global_batch']} | {e['micro_batch_per_gpu']} | {n(t.get('1'))} | "
                   f"{n(t.get('2'))} | {e['scaling_2_gpus']:.2f}× | {e['machine']}, {e['date']} {refs(e)} |")
    out += refs.lines()
    return out


def reach_table(data: dict) -> list[str]:
    """Bigger models and longer rows under 4 GiB, with the planner's prediction."""
    r = data["reach"]
    if not r:
        return []
    refs = Refs()
    out = ["", "## Reach: bigger models and longer rows under 4 GiB", "",
           f"Random weights of the real shapes, effective batch 8, under an emulated {r['budget_gib']:g} GiB "
           f"budget; the planner's prediction beside each peak. {r['machine']}, {r['date']} {refs(r)}.", "",
           *head("model", "tokens a row", "micro-batch × accum", "options", "peak GiB", "planner", "tokens/s")]
    for pt in r["points"]:
        fitted = pt["returncode"] == 0
        peak = n(pt["peak_device_gib"], 2) if fitted else "out of memory" if pt.get("oom") else "failed"
        error = f" ({pt['error_pct']:+.1f}%)" if fitted and pt.get("error_pct") is not None else ""
        out.append(f"| {pt['shape']} | {pt['seq']:,} | {pt['batch']} × {pt['accum']} | "
                   f"{', '.join(pt['options']) or 'none'} | {peak} | {n(pt['predicted_gib'], 2)}{error} | "
                   f"{n(pt['tokens_per_s']) if fitted else '–'} |")
    out += refs.lines()
    return out


def cpu_table(data: dict) -> list[str]:
    """CPU training speed per instruction set and dtype."""
    c = data["cpu"]
    if not c:
        return []
    refs = Refs()
    out = ["", "## CPU: training speed per instruction set and dtype", "",
           "SmolLM2-135M at 256 tokens, the CPU profile with one change per variant (the batch column shows "
           "micro-batch × accumulation, the effective batch is 8 in every row); each run times a few optimizer "
           "steps per variant, the first not timed; on the CPU as it is and limited to AVX2. A DPO row is one "
           "step of notebook 07 (8 pairs: chosen, rejected and the reference forward).", "",
           *head("CPU as", "variant", "batch", "dtype", "threads", "s/step", "tokens/s", "measured")]
    for row in c["rows"]:
        stopped = f" (stopped after {row['stopped_after_s']:g} s, {row['steps_done']} steps)" \
            if row["stopped_after_s"] else ""
        out.append(f"| {'itself' if row['isa_limit'] == 'native' else 'AVX2 only'} | {row['variant']} | "
                   f"{row['batch']} | {row['compute_dtype']} | {row['threads']} | "
                   f"{n(row['median_step_s'], 2)}{stopped} | {n(row['tokens_per_s'], 1)} | {row['machine']}, "
                   f"{row['date']} {refs(row)} |")
    out += refs.lines()
    return out


def _make_minutes(seconds, exit_code, failed: str) -> str:
    """A timed make command's cell: "–" where it never ran (make setup failed, or the file of a course still running:
    bench/course_time.py writes it after each step), else its minutes, and `failed` where it exited non-zero."""
    if seconds is None:
        return "–"
    return f"{seconds / 60:.1f} min" + ("" if exit_code == 0 else failed)


def course_table(data: dict) -> list[str]:
    """A fresh clone's make setup, make run and make test on a CPU."""
    if not data.get("course"):
        return []
    refs = Refs()
    out = ["", "## The course on a CPU: a fresh clone's `make setup`, `make run` and `make test`", "",
           "`python bench/course_time.py --test`: a fresh clone of the commit, each command timed as a learner runs "
           "it (make run as `make executed`: the same notebooks, their copies kept). Task metric: notebook 03's "
           "SFT run, base → tuned, on 60 held-out prompts; DPO: notebook 07's held-out reward accuracy and the "
           "task metric of the SFT model → after DPO. A `make test` that failed shows its exit code and the time to "
           "the failure (the unit tests stop it before the notebooks run).", "",
           *head("machine", "setup", "make run", "per notebook (s)", "make test", "SFT task metric",
                 "DPO reward accuracy, task metric", "measured")]
    for c in data["course"]:
        per = ", ".join(f"{name[:2]}: {sec}" for name, sec in (c["notebooks_s"] or {}).items())
        sft, dpo = c["sft"] or {}, c["dpo"] or {}
        setup = f"{n(c['setup_s'])} s" + ("" if c["setup_exit"] in (0, None) else f" (exit {c['setup_exit']})")
        run = _make_minutes(c["run_s"], c["run_exit"], " (failed)")
        test = _make_minutes(c["test_s"], c["test_exit"], f" (exit {c['test_exit']})")
        out.append(f"| {c['machine']}{' as AVX2' if c['as_avx2'] else ''} | {setup} | {run} | {per} | {test} | "
                   f"{n(sft.get('task_base'), 3)} → {n(sft.get('task_tuned'), 3)} | "
                   f"{n(dpo.get('pairs_reward_accuracy'), 3)}, {n(dpo.get('task_base'), 3)} → "
                   f"{n(dpo.get('task_tuned'), 3)} | {c['date']} {refs(c)} |")
    out += refs.lines()
    return out


def reproducibility_table(data: dict) -> list[str]:
    """Two same-seed runs' losses."""
    rp = data["reproducibility"]
    if not rp:
        return []
    refs = Refs()
    out = ["", "## Same seed, same losses", "",
           "Two CPU runs of the course's training with the same seed, one after the other.", "",
           *head("variant", "against", "steps", "identical", "largest relative loss difference", "measured")]
    for pair in rp["pairs"]:
        out.append(f"| {pair['variant']} | {pair['against'] or 'its own second run'} | {pair['steps']} | "
                   f"{'yes' if pair['identical'] else 'no'} | {pair['max_relative_loss_difference']:.2%} | "
                   f"{pair['machine']}, {pair['date']} {refs(pair)} |")
    out += refs.lines()
    return out


def lever_gains_table(data: dict) -> list[str]:
    """Each kept lever's measured gain, taken out alone."""
    lg = data.get("lever_gains") or {}
    if not lg.get("levers"):
        return []
    refs = Refs()
    out = ["", "## What each lever of the fast path gains", "",
           f"Each lever taken out alone, in one run beside our default path (auto-fit on both), under a 4 GiB "
           f"budget: the median step, and the GPU's compute per token of one profiled step (what a GPU-bound "
           f"card such as a GTX 1650 pays). A lever is {lg['rule']}; the others were removed (git keeps them).",
           "", *head("lever", "workload", "step s: ours, without", "GPU µs/token: ours, without",
                     "peak GiB: ours, without", "earns its place", "measured")]
    for lever, entry in lg["levers"].items():
        for workload, w in entry["workloads"].items():
            gain = f"{w['step_gain']:+.1%}; " + ("ours ran once" if w["step_noise"] is None
                                                 else f"ours varied {w['step_noise']:.1%}")
            compute = (f"{n(w['compute_us_per_token'], 2)}, {n(w['compute_us_per_token_without'], 2)} "
                       f"({w['compute_gain']:+.1%})" if w["compute_gain"] is not None else "–")
            out.append(f"| `{lever}` | {WORKLOADS[workload]} | {n(w['step_s'], 4)}, {n(w['step_s_without'], 4)} "
                       f"({gain}) | {compute} | {n(w['peak_gib'], 2)}, {n(w['peak_gib_without'], 2)} | "
                       f"{'yes' if entry['earns_its_place'] else 'no'}"
                       f"{'' if entry['in_the_package'] else ', removed'} | {w['machine']}, {w['date']} "
                       f"{refs(w)} |")
    notes = [f"`{lever}`: {entry['note']}." for lever, entry in lg["levers"].items() if entry.get("note")]
    out += refs.lines() + (["", *notes] if notes else [])
    return out


def against_baseline_table(data: dict) -> list[str]:
    """Our engine now against an earlier one, on one card in one run: a row per workload of each run."""
    runs = data.get("against_baseline")
    if not runs:
        return []
    refs = Refs()
    dates = sorted({ab["baseline_date"] for ab in runs})
    then = dates[0] if len(dates) == 1 else "then"
    out = ["", "## Our engine against an earlier one, on one card", "",
           f"`bench/against_commit.py`: our default GPU path (auto-fit, CUDA graphs, the levers it ships) at the "
           f"commit measured, and the engine of {', '.join(dates)} run by its own benchmark script, one after the "
           "other on one card in one run (each engine a fresh process, in rounds): the same workloads, data and "
           "steps, under a 4 GiB budget. Hosts of one GPU kind differ by up to 1.5×, so only ratios within one run "
           "compare the two engines, and runs are not pooled. Each figure is its engine's median over the run's "
           "rounds; GPU µs/token is the compute of one profiled step per token (the host's speed leaves it alone, "
           "while tokens/s follows the host where it keeps the GPU waiting). Where the run measured the reference "
           "recipe too (once, before the rounds), each engine's speed over it on that host.", "",
           *head("workload", f"tokens/s: {then}, now (now / then)", f"GPU µs/token: {then}, now (now / then)",
                 f"× the reference: {then}, now", "rounds", "measured")]
    for ab in runs:
        for workload, w in ab["workloads"].items():
            cells = []
            for key, digits in (("tokens_per_s", 0), ("compute_us_per_token", 2)):
                ratio = w["now_over_baseline"][key]
                cells.append(f"{n(w['baseline'][key], digits)}, {n(w['now'][key], digits)} "
                             f"({'–' if ratio is None else f'{ratio:.3f}'})")
            over = w.get("over_reference")
            cells.append("–" if not over else ", ".join("–" if over[e] is None else f"{over[e]:.1f}×"
                                                         for e in ("baseline", "now")))
            out.append(f"| {WORKLOADS[workload]} | {cells[0]} | {cells[1]} | {cells[2]} | {ab['rounds']} | "
                       f"{ab['machine']}, {ab['date']} {refs(ab)} |")
    out += refs.lines()
    return out


def lever_memory_table(data: dict) -> list[str]:
    """Where taking a lever out changes auto-fit's choice on a GTX 1650."""
    lm = data.get("lever_memory")
    if not lm:
        return []
    refs = Refs()
    out = ["", "## Which levers change what auto-fit picks on a GTX 1650", "",
           "Each lever taken out alone, auto-fit planned under the GTX 1650 preset (3.81 GiB, desktop reserve, "
           "context) for an effective batch of 8, from config.json alone (what auto-fit ranks by). A change means "
           f"the lever's memory decides the card's batch or checkpointing. {lm['machine']}, {lm['date']} {refs(lm)}.",
           "", *head("lever", "where taking it out changes auto-fit's choice")]
    for lever, where in lm["levers"].items():
        out.append(f"| `{lever}` | {'; '.join(where) if where else 'nowhere'} |")
    out += refs.lines()
    return out


def dpo_tables(data: dict) -> list[str]:
    """DPO's memory against the planner, and its speed against TRL's plain recipe."""
    d = data.get("dpo")
    if not d:
        return []
    refs = Refs()
    out = ["", "## DPO (notebook 07) under the GTX 1650 preset", "",
           "`bench/dpo.py`: each run a fresh process, its allocator capped where the GTX 1650's would be; random "
           "weights of the real shapes, prompt + answer rows of the length shown, 8 pairs an optimizer step. "
           "*plain* is TRL's DPO recipe for QLoRA as its documentation writes it (a fresh adapter, the reference = "
           "the adapter disabled); *ours* notebook 07's DPOConfig on an adapter; *ours-fit* the same with the "
           "micro-batch and checkpointing the planner picks for the card. The planner's peak (nb_helpers.plan."
           f"preference, for this GPU's context) against the measured NVML peak: {d['within_10_percent']} of "
           f"{d['validated']} points within ±10%.", "",
           *head("model shape", "tokens", "run", "batch, GC", "s/step", "tokens/s", "peak GiB (NVML)", "planned GiB",
                 "error", "planned for the GTX 1650 / its budget", "measured")]
    for p in d["points"]:
        failed = "" if p["returncode"] == 0 else f" (exit {p['returncode']})"
        error = "–" if p["planner_error"] is None else f"{p['planner_error']:+.1%}"
        out.append(f"| {p['shape']} | {p['seq']} | {p['run']}{failed} | {p['micro_batch']} × {p['accum']}, "
                   f"{'on' if p['gc'] else 'off'} | {n(p['median_step_s'], 3)} | {n(p['tokens_per_s'])} | "
                   f"{n(p['peak_device_gib'], 2)} | {n(p['predicted_here_gib'], 2)} | {error} | "
                   f"{n(p['predicted_gtx1650_gib'], 2)} / {n(p['gtx1650_budget_gib'], 2)} | {p['machine']}, "
                   f"{p['date']} {refs(p)} |")
    if d["speed"]:
        out += ["", "Same run, same point: ours against TRL's plain DPO recipe.", "",
                *head("model shape", "tokens", "plain tokens/s, peak GiB", "ours", "ours-fit", "measured")]
        for sp in d["speed"]:
            cells = [f"{n(sp[k]['tokens_per_s'])}, {n(sp[k]['peak_device_gib'], 2)} ({sp[k]['speedup']:.2f}×)"
                     if k in sp else "–" for k in ("ours", "ours-fit")]
            out.append(f"| {sp['shape']} | {sp['seq']} | {n(sp['plain']['tokens_per_s'])}, "
                       f"{n(sp['plain']['peak_device_gib'], 2)} | {cells[0]} | {cells[1]} | {sp['machine']}, "
                       f"{sp['date']} {refs(sp)} |")
    out += refs.lines()
    return out


# the sections of bench/RESULTS.md, in order; each returns no lines when its runs are missing
TABLES = (speed_table, plain_table, gtx1650_table, planner_table, step_time_table, multi_gpu_table, reach_table,
          cpu_table, course_table, reproducibility_table, lever_gains_table, against_baseline_table, lever_memory_table,
          dpo_tables)


def markdown(data: dict) -> str:
    out = ["# Benchmark results", "",
           "Generated by `python bench/summarize.py` (`make results`) from the run files in `bench/results/runs/`: "
           "one file per run, written by the script that measured it, with its command, package versions, machine "
           "and commit. Do not edit this file or `bench/results/latest.json`: run the benchmark again (it writes a "
           "new run file), then `make results`. Each row names the machine and the date that measured it and cites "
           "its command below the table (output paths left out). Older runs stay in `bench/results/runs/`; raw "
           "output and traces in `bench/results/raw/`."]
    for table in TABLES:
        out += table(data)
    return "\n".join(out) + "\n"


def render(runs_dir: Path = RUNS) -> tuple[str, str]:
    data = latest(runs_dir)
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n", markdown(data)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if either file is out of date")
    args = parser.parse_args()
    latest_json, results_md = render()
    if args.check:
        stale = [p.relative_to(ROOT).as_posix() for p, text in ((LATEST, latest_json), (RESULTS_MD, results_md))
                 if not p.exists() or p.read_text(encoding="utf-8") != text]
        print(f"out of date: {', '.join(stale)} (run `make results`)" if stale else "up to date")
        sys.exit(1 if stale else 0)
    LATEST.write_text(latest_json, encoding="utf-8")
    RESULTS_MD.write_text(results_md, encoding="utf-8")
    print(f"wrote {LATEST.relative_to(ROOT)} and {RESULTS_MD.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
