"""Reading runs back: the reference-style table and flags that say what to change."""

from __future__ import annotations

from .metrics import median

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


def flag_problems(records: list[dict], vram_warn_gib: float = 3.9) -> list[str]:
    """Plain-language warnings: memory over the card's budget, and time spikes that suggest spill or throttling."""
    steps = [r for r in records if "loss" in r]
    flags = []
    over = [r for r in steps if (r.get("device_used_gib") or 0) > vram_warn_gib]
    if over:
        worst = max(over, key=lambda r: r["device_used_gib"])
        flags.append(f"VRAM above {vram_warn_gib} GiB on {len(over)} step(s) (worst {worst['device_used_gib']:.2f} GiB "
                     f"at step {worst['step']}): on a 4 GB card this spills or OOMs. Lower max_length or "
                     "micro_batch_size (raise grad_accum to keep the effective batch), or keep gradient checkpointing on.")
    typical = median(r.get("step_s") for r in steps[3:] or steps)
    if typical:
        spikes = [r for r in steps[3:] if r.get("step_s") and r["step_s"] > SPIKE_FACTOR * typical]
        if spikes:
            flags.append(f"{len(spikes)} step(s) took over {SPIKE_FACTOR:g}x the median {typical:.2f} s "
                         f"(steps {', '.join(str(r['step']) for r in spikes[:8])}). A single spike is usually another program "
                         "using the machine; regular ones suggest paged-optimizer spill to host RAM (lower memory "
                         "use) or a laptop GPU throttling (check temperature and power mode).")
    losses = [r["loss"] for r in steps]
    if len(losses) >= 6 and median(losses[-3:]) > median(losses[:3]):
        flags.append("train loss went up from the first steps to the last: lower learning_rate (try half).")
    return flags
