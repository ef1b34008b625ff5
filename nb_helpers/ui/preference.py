"""Notebook 07's live "will a DPO step fit?" panel: notebook 03's planner panel, with the planner's DPO prediction
(nb_helpers.plan.preference: chosen and rejected in one batch, the reference forward without gradients) in place of
SFT's."""

from __future__ import annotations

import html

from nb_helpers.config import RunConfig
from nb_helpers.plan.cards import run_card
from nb_helpers.plan.preference import plan_preference_for_config
from nb_helpers.ui.widgets import OVER_COLOR, PlanView, plan_html


class PreferencePlanView(PlanView):
    """PlanView for a DPO step: `update(cfg)` plans micro_batch_size pairs (2 x that many sequences) and the
    reference forward. No time line: the time model prices SFT steps."""

    def update(self, cfg: RunConfig) -> None:
        budget, source = self.budget_for(cfg)
        try:
            if self.shape is None:
                raise ValueError(self.shape_error or "no model shape: pass load_shape(model path)")
            card = run_card(cfg)
            result = plan_preference_for_config(cfg.replace(budget_gib=budget), self.shape,
                                                context_gib=None if card else self.context_gib,
                                                gpu_capability=None if card else self.capability or (7, 5))
        except Exception as e:  # noqa: BLE001 - a widget callback must not raise; say why instead
            self.plan = None
            self.widget.value = (f"<div style='color:{OVER_COLOR}'><b>no prediction</b> for these settings: "
                                 f"{html.escape(str(e))}</div>")
            return
        result.budget_gib = budget
        self.plan = result
        pairs = cfg.micro_batch_size
        self.widget.value = (f"<div><b>a DPO step</b>: {pairs} pair{'s' * (pairs != 1)} a micro-batch, so "
                             f"{2 * pairs} sequences in each forward, then the reference forward</div>"
                             + plan_html(result, source, self.device_note))


def preference_plan_widget(cfg: RunConfig, shape, budget_gib: float | None = None) -> PreferencePlanView:
    """The live DPO panel; wire it to the sliders as notebook 03 does: `config_widgets(cfg, PREFERENCE_FIELDS,
    on_change=view.update)`."""
    return PreferencePlanView(cfg, shape, budget_gib=budget_gib)
