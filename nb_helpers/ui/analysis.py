"""Reading runs back: the reference-style table and flags that say what to change."""

from __future__ import annotations

from nb_helpers.metrics import median
from nb_helpers.plan.cards import COURSE_CARD, find_card

SPIKE_FACTOR = 2.0  # a step this many times slower than the median is a spike


def reference_table(records: list[dict]) -> list[dict]:
    """Epoch | Step | Train Loss | VRAM Usage (GB) | Time/Step (s), the columns the reference recipe reports.
    VRAM is NVML's device-used (context included), i.e. what nvidia-smi shows; empty on CPU."""
    return [{"Epoch": round(r["epoch"], 2), "Step": r["step"], "Train Loss": round(r["loss"], 4),
             "VRAM Usage (GB)": None if r.get("device_used_gib") is None else round(r["device_used_gib"], 2),
             "Time/Step (s)": None if r.get("step_s") is None else round(r["step_s"], 2)}
            for r in records if "loss" in r]


def to_markdown(rows: list[dict], max_rows: int = 30) -> str:
    if not rows:
        return "_no steps recorded_"
    if len(rows) > max_rows:  # keep first and last steps: where it starts and where it ends up
        half = max_rows // 2
        rows = rows[:half] + [{k: "..." for k in rows[0]}] + rows[-half:]
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("—" if r[c] is None else str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


DRIFT_LIMIT = 0.2  # step time rising more than this from the first third of a run to the last is worth a word


def step_time_drift(steps: list[dict]) -> tuple[float, float, float] | None:
    """(median step s in the first third, in the last third, relative rise); None with fewer than 6 timed steps."""
    times = [r["step_s"] for r in steps if r.get("step_s")]
    if len(times) < 6:
        return None
    third = len(times) // 3
    first, last = median(times[:third]), median(times[-third:])
    return first, last, last / first - 1


UNEVEN_FACTOR = 3.0  # a run whose slowest timed step took this many times its fastest ran on a busy machine


def step_time_range(steps: list[dict]) -> tuple[float, float, float] | None:
    """(fastest, median, slowest) seconds per step after the first (which pays for allocation); None with fewer
    than 3 timed steps."""
    times = [r["step_s"] for r in steps[1:] if r.get("step_s")]
    if len(times) < 3:
        return None
    return min(times), median(times), max(times)


def uneven_steps(steps: list[dict]) -> str | None:
    """A warning when step times were so uneven that the run's median says more about the machine's load than about
    its settings (spikes and drift, measured against the median, miss a run that was slow for most of its steps)."""
    spread = step_time_range(steps)
    if spread is None or spread[2] < UNEVEN_FACTOR * spread[0]:
        return None
    fastest, middle, slowest = spread
    return (f"step times ranged {fastest:.2f}-{slowest:.2f} s (median {middle:.2f} s): the same settings ran "
            f"{slowest / fastest:.0f}x slower on some steps, so the machine was busy with something else. This run's "
            "step time and tokens/s measure that load, not its settings: compare runs by their fastest steps, or "
            "train again on an idle machine.")


def flag_problems(records: list[dict], vram_warn_gib: float | None = None) -> list[str]:
    """Plain-language warnings: memory over the card's budget, step-time spikes and drift (another program, or a
    laptop throttling), and a loss that went up. `vram_warn_gib`: default the course's GTX 1650 budget (3.46 GiB)."""
    if vram_warn_gib is None:
        vram_warn_gib = find_card(COURSE_CARD).budget_gib()
    steps = [r for r in records if "loss" in r]
    flags = []
    if over := [r for r in steps if (r.get("device_used_gib") or 0) > vram_warn_gib]:
        worst = max(over, key=lambda r: r["device_used_gib"])
        flags.append(f"VRAM above {vram_warn_gib} GiB on {len(over)} step(s) (worst {worst['device_used_gib']:.2f} GiB "
                     f"at step {worst['step']}): a 4 GB card has under 0.1 GiB left, and one longer batch runs out "
                     "of memory. Lower max_length or "
                     "micro_batch_size (raise grad_accum to keep the effective batch), or keep gradient checkpointing on.")
    typical = median(r.get("step_s") for r in steps[3:] or steps)
    if typical:
        spikes = [r for r in steps[3:] if r.get("step_s") and r["step_s"] > SPIKE_FACTOR * typical]
        if spikes:
            flags.append(f"{len(spikes)} step(s) took over {SPIKE_FACTOR:g}x the median {typical:.2f} s "
                         f"(steps {', '.join(str(r['step']) for r in spikes[:8])}). A single spike is usually another program "
                         "using the machine; regular ones can come from a laptop GPU throttling (check temperature and "
                         "power mode) or from memory pressure (lower memory use).")
    if uneven := uneven_steps(steps):
        flags.append(uneven)
    drift = step_time_drift(steps[3:] or steps)
    if drift is not None and drift[2] > DRIFT_LIMIT:
        first, last, rise = drift
        flags.append(f"step time rose {rise:.0%} over the run (median {first:.2f} s in the first third, {last:.2f} s in "
                     "the last): usually a laptop throttling as it heats up, or another program taking the machine.")
    losses = [r["loss"] for r in steps]
    if len(losses) >= 6 and median(losses[-3:]) > median(losses[:3]):
        flags.append("train loss went up from the first steps to the last: lower learning_rate (try half).")
    return flags


# Components that live outside PyTorch's caching allocator: what the planner predicts for max_memory_reserved is
# the total without them (bench/planner_report.py compares the same way).
OUTSIDE_ALLOCATOR = ("context", "runtime", "optimizer_paged")


def relative_error(predicted: float | None, measured: float | None) -> str | None:
    """predicted / measured - 1, as '+2.7%' (positive: the planner over-predicted)."""
    if predicted is None or not measured:
        return None
    return f"{100 * (predicted / measured - 1):+.1f}%"


def predicted_vs_measured(summary: dict) -> list[dict]:
    """The planner's predicted components and totals next to what the run measured (summary.json), in GiB.

    Rows: each non-zero predicted component (measured: none, NVML sees only the total), then the device peak
    (nvidia-smi's number, context included: `peak_vram_gib`) and PyTorch's reserved peak (`peak_reserved_gib`),
    each with the relative error when the run measured it. Empty when the run predates the planner."""
    from nb_helpers.plan.planner import COMPONENT_LABELS

    components = summary.get("predicted_components_gib")
    total = summary.get("predicted_peak_gib")
    if not components or total is None:
        return []
    row = lambda what, predicted, measured=None: {  # noqa: E731
        "": what, "predicted (GiB)": predicted, "measured (GiB)": measured, "error": relative_error(predicted, measured)}
    rows = [row(COMPONENT_LABELS.get(key, key), value) for key, value in components.items() if value > 0]
    phase = summary.get("predicted_phase")
    rows.append(row(f"**device peak** (nvidia-smi, context included; predicted in {phase or '?'})", total,
                    summary.get("peak_vram_gib")))
    reserved = total - sum(components.get(key, 0.0) for key in OUTSIDE_ALLOCATOR)
    rows.append(row("**PyTorch reserved peak** (device peak less context, runtime and paged optimizer)", reserved,
                    summary.get("peak_reserved_gib")))
    return rows


def predicted_vs_measured_report(summary: dict) -> str:
    """Markdown: a one-line note on what can be compared, then the predicted_vs_measured table."""
    from nb_helpers.plan.step_time import time_note

    rows = predicted_vs_measured(summary)
    if not summary:
        return ("_No summary.json yet: this run is still training, or stopped before writing one. The prediction "
                "and the measured peak are written there when training ends; re-run this cell then._")
    if not rows:
        return ("_No prediction in this run's summary.json: the planner could not read this model's config.json, "
                "or an older version of the course trained it. `python -m nb_helpers plan` with its settings "
                "predicts it now._")
    predicted, measured = summary["predicted_peak_gib"], summary.get("peak_vram_gib")
    if measured is None:
        where = "CPU run" if str(summary.get("device", "")).startswith("cpu") else "NVML could not read this GPU"
        notes = [f"Measured device memory is not available ({where}): only the prediction is shown"
                 + (", made for a GTX 1650-class card." if where == "CPU run" else ".")]
    else:
        notes = [f"Device peak: predicted {predicted:.2f} GiB, measured {measured:.2f} GiB "
                 f"({relative_error(predicted, measured)}; positive means the planner over-predicted)."]
    notes.append("Memory is measured as totals only (NVML, PyTorch), so the components are predictions alone.")
    notes.append(time_note(summary))  # nb_helpers.plan.step_time
    if summary.get("status") not in (None, "completed"):
        notes.append(f"The run ended with status `{summary['status']}`: the measured peak covers only the steps "
                     "that finished.")
    gib = lambda v: None if v is None else ("<0.001" if 0 < v < 0.0005 else f"{v:.3f}")  # noqa: E731
    shown = [{**r, "predicted (GiB)": gib(r["predicted (GiB)"]), "measured (GiB)": gib(r["measured (GiB)"])}
             for r in rows]
    return " ".join(notes) + "\n\n" + to_markdown(shown)
