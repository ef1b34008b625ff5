"""Which model fits, and how long a row (nb_helpers.plan.reach), and notebook 02's model choice (family_plan_widget)."""
from dataclasses import replace

import pytest

from nb_helpers.config import RunConfig
from nb_helpers.plan.catalog import known_shapes, plan_for_family
from nb_helpers.plan.choose import graphs_dropped_unless_they_fit
from nb_helpers.plan.planner import plan
from nb_helpers.plan.reach import ROW_STEP, fit_markdown, fit_table, longest_row

# the GPU recipe (1 x 8, gradient checkpointing, 512 tokens, r=8 on q,k,v,o) with CUDA graphs asked for: the rows
# then show where graphs fit and where a run drops them (left unset, a hand-set run plans eager layers throughout)
RECIPE = RunConfig(cuda_graphs=True, fast_path=True)  # graphs are the fast path's: their drop is tested here


@pytest.fixture(scope="module")
def table():
    return fit_table(RECIPE, 4.0, context_gib=0.3)


def test_one_row_per_shipped_shape_smallest_first_with_the_plan_of_that_family(table):
    assert sorted(r.name for r in table) == sorted(known_shapes())
    assert [r.params_b for r in table] == sorted(r.params_b for r in table)
    qwen = next(r for r in table if r.name == "qwen3-4b")
    graphed = plan_for_family(RECIPE, "qwen3-4b", context_gib=0.3)
    # what a run would use: its CUDA graphs where they fit, as Qwen3-4B's do at 4 GiB (Phi-4-mini's do not: below)
    assert qwen.peak_gib == pytest.approx(graphs_dropped_unless_they_fit(graphed, 4.0).peak_gib)
    assert 3.9 < qwen.params_b < 4.1
    assert qwen.offload_peak_gib < qwen.peak_gib  # offload moves checkpoints off the card


@pytest.mark.parametrize("name", ["qwen3-4b", "gemma3-1b", "phi-4-mini"])
def test_longest_row_fits_and_one_step_more_does_not(name):
    planned = plan_for_family(RECIPE, name, context_gib=0.3)
    longest = longest_row(planned, 4.0)
    assert longest > 0 and longest % ROW_STEP == 0
    at = replace(planned.inputs, batch=1, offload=True, graphs=False)  # long rows run eagerly where graphs miss
    assert plan(planned.shape, replace(at, seq=longest)).peak_gib <= 4.0
    if longest < planned.shape.max_positions:
        assert plan(planned.shape, replace(at, seq=longest + ROW_STEP)).peak_gib > 4.0


def test_longest_row_stops_at_the_models_own_limit_and_a_tiny_budget_fits_nothing(table):
    tiny = next(r for r in table if r.name == "tinyllama-1.1b")
    assert tiny.longest_row == tiny.max_positions == 2048  # TinyLlama's config.json: 2,048 positions
    assert "2,048 (the model's limit)" in fit_markdown(table, 512, "1 x 8")
    assert longest_row(plan_for_family(RECIPE, "qwen3-4b", context_gib=0.3), 1.0) == 0


def test_lora_targets_are_translated_per_family(table):
    phi = plan_for_family(RECIPE, "phi-4-mini", context_gib=0.3)
    assert phi.inputs.targets == ("qkv_proj", "o_proj")  # q,k,v live in Phi's one fused projection
    row = next(r for r in table if r.name == "phi-4-mini")
    assert row.peak_gib == pytest.approx(graphs_dropped_unless_they_fit(phi, 4.0).peak_gib)
    assert row.peak_gib < phi.peak_gib  # Phi-4-mini's graphs do not fit 4 GiB: the run (and the row) goes eager
    lean = next(r for r in fit_table(RunConfig(fast_path=True), 4.0, context_gib=0.3) if r.name == "phi-4-mini")
    assert lean.peak_gib == pytest.approx(row.peak_gib)  # cuda_graphs unset: eager layers, as planned above


def test_model_choice_replans_with_the_same_knobs(no_gpu):  # the catalogue's plans, for no GPU in particular
    from nb_helpers.ui.widgets import family_plan_widget

    cfg = RECIPE.replace(lora_r=16, lora_alpha=32)
    box, choice, view = family_plan_widget(cfg, start="qwen3-1.7b", budget_gib=4.0)
    assert view.plan.shape.name == "qwen3-1.7b" and view.plan.inputs.rank == 16
    choice.value = "qwen3-4b"
    assert view.plan.shape.name == "qwen3-4b" and view.plan.inputs.rank == 16
    assert view.plan.peak_gib == pytest.approx(plan_for_family(cfg.replace(budget_gib=4.0), "qwen3-4b").peak_gib)
    assert "qwen3-4b" in view.widget.value and "fits" in view.widget.value
