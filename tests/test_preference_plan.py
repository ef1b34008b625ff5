"""The planner's DPO prediction (nb_helpers.plan.preference), on the CPU: chosen and rejected in one batch (a
micro-batch of B pairs is SFT's forward of 2B sequences), the frozen reference adapter, and the reference forward
under no_grad, which can hold the peak. The GPU check against measured DPO runs is bench/dpo.py."""

from dataclasses import replace

import pytest

from nb_helpers.config import RunConfig
from nb_helpers.plan.activations import GIB, kept_activation_bytes
from nb_helpers.plan.catalog import known_shape
from nb_helpers.plan.engine import PLAIN_TERMS
from nb_helpers.plan.planner import PlanInput, lora_tensors, plan
from nb_helpers.plan.preference import (REFERENCE_PHASE, pair_input, plan_preference, plan_preference_for_config,
                                        reference_forward_bytes)

TINYLLAMA = known_shape("tinyllama-1.1b")


def plain(**knobs) -> PlanInput:
    return PlanInput(**{**dict(seq=512, batch=1, accum=8, compute_dtype="float16", **PLAIN_TERMS), **knobs})


def test_a_pair_is_two_padded_sequences_labelled_on_the_answers():
    pairs = pair_input(plain(batch=4, lora_dropout=0.05), completion_fraction=0.4)
    assert (pairs.batch, pairs.padded, pairs.labelled_fraction, pairs.lora_dropout) == (8, True, 0.4, 0.0)
    with pytest.raises(ValueError, match="completion_fraction=0"):
        pair_input(plain(), completion_fraction=0.0)


@pytest.mark.parametrize("gc", [True, False])
def test_dpo_costs_at_least_sft_at_twice_the_sequences(gc):
    """Everything SFT of 2B sequences holds, plus the reference adapter (and the reference forward where it peaks)."""
    inp = plain(gradient_checkpointing=gc)
    dpo = plan_preference(TINYLLAMA, inp)
    sft_2b = plan(TINYLLAMA, pair_input(inp))
    ref = dpo.components["reference_adapter"]
    assert ref == 4 * sum(lora_tensors(TINYLLAMA, dpo.inputs)) > 0
    assert dpo.peak_bytes >= sft_2b.peak_bytes + ref
    assert dpo.peak_bytes > plan(TINYLLAMA, inp).peak_bytes


def test_without_checkpointing_the_reference_forward_holds_the_peak():
    """With every activation of the policy kept, the reference forward adds its working set on top: the peak."""
    dpo = plan_preference(TINYLLAMA, plain(gradient_checkpointing=False))
    assert dpo.peak_phase == REFERENCE_PHASE
    kept, _ = kept_activation_bytes(TINYLLAMA, dpo.inputs, True)
    assert dpo.components["activations_kept"] == kept
    assert dpo.components["reference_forward"] == reference_forward_bytes(TINYLLAMA, dpo.inputs) > 0
    assert dpo.components["layer_recompute"] == dpo.components["backward_transient"] == 0


def test_with_checkpointing_the_backward_holds_it_and_the_reference_forward_is_not_added():
    dpo = plan_preference(TINYLLAMA, plain(gradient_checkpointing=True))
    assert dpo.peak_phase != REFERENCE_PHASE and dpo.components["reference_forward"] == 0


def test_the_peak_grows_with_pairs_and_length():
    peaks = [plan_preference(TINYLLAMA, plain(seq=seq, batch=b)).peak_gib for seq, b in ((256, 1), (512, 1),
                                                                                        (1024, 1), (1024, 2))]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4


def test_tinyllama_dpo_at_512_tokens_is_predicted_to_fit_the_gtx_1650():
    """The issue's target: TinyLlama DPO at 512 tokens on the GTX 1650 preset (the reference recipe's 1 x 8, GC)."""
    cfg = RunConfig(model=None, card="gtx1650", max_length=512, micro_batch_size=1, grad_accum=8)
    result = plan_preference_for_config(cfg, TINYLLAMA)
    assert result.budget_gib is not None and result.fits, result.table()
    assert result.inputs.compute_dtype == "float16" and result.inputs.batch == 2
    assert "reference adapter (frozen copy)" in result.table()


def test_an_sft_plan_has_no_reference_rows():
    assert "reference_adapter" not in plan(TINYLLAMA, plain()).components
    assert "reference" not in plan(TINYLLAMA, plain()).table()


def test_the_reference_forward_grows_with_the_tokens():
    small = reference_forward_bytes(TINYLLAMA, pair_input(plain(seq=256)))
    large = reference_forward_bytes(TINYLLAMA, pair_input(plain(seq=1024)))
    assert large > 3 * small - 2 * 2 * max(a * b for a, b in TINYLLAMA.linear_dims().values())
    assert large / GIB < 1.0  # working memory of one layer and the head's tiles, not the whole forward


def test_the_panel_plans_dpo_and_fails_softly(no_gpu):
    from nb_helpers.ui.preference import preference_plan_widget

    cfg = RunConfig(card="gtx1650", max_length=512, micro_batch_size=2)
    view = preference_plan_widget(cfg, TINYLLAMA)
    assert view.plan is not None and view.plan.inputs.batch == 4 and "4 sequences" in view.widget.value
    view.update(replace(cfg, target_modules=["no_such_layer"]))
    assert view.plan is None and "no prediction" in view.widget.value
