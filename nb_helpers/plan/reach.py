"""Which model fits a card, and how long a row: the planner asked about every shape in nb_helpers/plan/shapes/ (Qwen3,
Gemma 3, Llama-3.2, Phi-4-mini, SmolLM, TinyLlama). Predictions only: README's reach table holds what was measured."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nb_helpers.plan.catalog import known_shape, known_shapes
from nb_helpers.plan.choose import graphs_dropped_unless_they_fit
from nb_helpers.plan.planner import Plan, plan, plan_for_config

ROW_STEP = 512  # longest_row's resolution in tokens: finer than this the planner's ±5% says nothing


@dataclass
class FitRow:
    name: str
    params_b: float  # billions of parameters
    peak_gib: float  # with the config's knobs as they are
    offload_peak_gib: float | None  # the same with checkpoints in CPU RAM (None: no gradient checkpointing)
    longest_row: int  # tokens per row at batch 1 that fit the budget, checkpoints offloaded; 0: none fits
    max_positions: int | None  # the model's own limit (config.json), which caps longest_row
    budget_gib: float

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.budget_gib

    @property
    def fits_with_offload(self) -> bool:
        return self.offload_peak_gib is not None and self.offload_peak_gib <= self.budget_gib


def longest_row(planned: Plan, budget_gib: float, limit: int | None = None) -> int:
    """The longest row, in steps of ROW_STEP tokens, that `planned`'s inputs fit in budget_gib at batch 1 with
    checkpoints offloaded (the planner's peak grows with length, so a bisection finds it). 0 when none fits."""
    limit = limit or planned.shape.max_positions or 131_072
    # eager layers: a long row whose graphs do not fit runs without them (graphs_dropped_unless_they_fit)
    inp = replace(planned.inputs, batch=1, gradient_checkpointing=True, offload=True, graphs=False)

    def fits(seq: int) -> bool:
        return plan(planned.shape, replace(inp, seq=seq)).peak_gib <= budget_gib

    low, high = 0, limit // ROW_STEP  # fits(low * ROW_STEP) holds (or low is 0); search the steps above it
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * ROW_STEP) else (low, mid - 1)
    return low * ROW_STEP


def fit_table(cfg, budget_gib: float, context_gib: float | None = None,
              gpu_capability: tuple[int, int] | None = None) -> list[FitRow]:
    """One FitRow per known shape, smallest model first: its predicted peak with cfg's knobs (LoRA targets
    translated to each family's layer names), with offloaded checkpoints, and its longest row at batch 1.
    context_gib and gpu_capability default to this GPU's, or a GTX 1650's where there is none."""
    rows = []
    for name in known_shapes():
        shape = known_shape(name)
        planned = graphs_dropped_unless_they_fit(
            plan_for_config(cfg, shape, context_gib=context_gib, gpu_capability=gpu_capability), budget_gib)
        offload = None
        if planned.inputs.gradient_checkpointing:
            offload = graphs_dropped_unless_they_fit(plan(shape, replace(planned.inputs, offload=True)),
                                                     budget_gib).peak_gib
        rows.append(FitRow(name, shape.total_params / 1e9, planned.peak_gib, offload,
                           longest_row(planned, budget_gib), shape.max_positions, budget_gib))
    return sorted(rows, key=lambda r: r.params_b)


def fit_markdown(rows: list[FitRow], seq: int, batch: str) -> str:
    """fit_table as a Markdown table for a notebook."""
    def cell(gib, fits):
        return "—" if gib is None else f"{gib:.2f} {'✓' if fits else '✗'}"

    lines = [f"| model | params | peak GiB at {seq} tokens, {batch} | with offload | longest row at batch 1 |",
             "|---|---|---|---|---|"]
    for r in rows:
        longest = f"{r.longest_row:,}" if r.longest_row else "none fits"
        if r.longest_row and r.longest_row == r.max_positions:
            longest += " (the model's limit)"
        lines.append(f"| {r.name} | {r.params_b:.2f} B | {cell(r.peak_gib, r.fits)} | "
                     f"{cell(r.offload_peak_gib, r.fits_with_offload)} | {longest} |")
    return "\n".join(lines)
