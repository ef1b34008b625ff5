"""The live "will it fit?" widget: the planner's predicted peak against the budget, following the sliders."""

import re

import pytest

from nb_helpers.plan.planner import load_shape
from nb_helpers.plan.cards import COURSE_CARD, find_card
from nb_helpers.ui.widgets import TRAIN_FIELDS, config_widgets, plan_widget

COURSE_CARD_GIB = find_card(COURSE_CARD).budget_gib()  # the course's GTX 1650: 3.81 GiB less the desktop's 0.35


def shown_peak(view) -> float:
    return float(re.search(r"predicted peak <b>([0-9.]+) GiB</b>", view.widget.value).group(1))


def controls_of(box):
    return {c.description: c for c in box.children[:-1]}


def test_verdict_line_budget_source_and_breakdown(tiny_model_dir, tiny_cfg):
    import torch

    view = plan_widget(tiny_cfg, load_shape(tiny_model_dir))
    text = view.widget.value
    assert view.plan is not None and view.plan.budget_gib == COURSE_CARD_GIB
    assert "fits</b>" in text and "does not fit" not in text and "color:#080" in text
    assert "GTX 1650 (4 GB): 3.81 GiB as PyTorch reports it" in text and "set cfg.card for yours" in text
    assert ("GTX 1650-class" in text) != torch.cuda.is_available()
    assert "CUDA context</td>" in text and "LM head + loss (fused)" in text and "total</b>" in text
    assert abs(shown_peak(view) - view.plan.peak_gib) < 0.006
    bundle = view._repr_mimebundle_()  # display(view): the live widget, with a static HTML copy as fallback
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/html"] == text

    tiny_cfg.budget_gib = 0.4  # below context + runtime overhead: nothing fits
    view = plan_widget(tiny_cfg, tiny_model_dir)  # a model folder works too (read once)
    assert "does not fit" in view.widget.value and "color:#b00" in view.widget.value
    assert "budget 0.40 GiB: cfg.budget_gib" in view.widget.value
    tiny_cfg.budget_gib, tiny_cfg.card = None, "t4"  # a named card: its budget (no desktop on a T4)
    assert "budget 14.75 GiB: Tesla T4" in plan_widget(tiny_cfg, tiny_model_dir).widget.value
    given = plan_widget(tiny_cfg, tiny_model_dir, budget_gib=8.0).widget.value  # the argument beats cfg.budget_gib
    assert "fits</b>" in given and "does not fit" not in given and "budget 8.00 GiB: given to plan_widget" in given


def test_follows_the_sliders_live(tiny_model_dir, tiny_cfg):
    view = plan_widget(tiny_cfg, load_shape(tiny_model_dir), budget_gib=COURSE_CARD_GIB)
    box = config_widgets(tiny_cfg, fields=TRAIN_FIELDS, on_change=view.update)
    controls = controls_of(box)
    start, peak = shown_peak(view), view.plan.peak_gib

    controls["micro-batch"].value = 16  # 4 -> 16 sequences per forward pass: more activations and logit tiles
    assert tiny_cfg.micro_batch_size == 16 and shown_peak(view) > start

    peak = view.plan.peak_gib
    controls["LoRA rank r"].value = 64
    assert tiny_cfg.lora_r == 64 and view.plan.inputs.rank == 64 and view.plan.peak_gib > peak

    peak = view.plan.peak_gib
    controls["max length"].value = 128
    assert tiny_cfg.max_length == 128 and view.plan.peak_gib < peak

    controls["gradient checkpointing"].value = False
    assert tiny_cfg.gradient_checkpointing is False and view.plan.inputs.gradient_checkpointing is False
    assert "GC off" in box.children[-1].value


# TinyLlama-1.1B's config.json (the reference model): big enough for activations to matter, unlike the tiny one.
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
             "tie_word_embeddings": False}


def test_gradient_checkpointing_off_can_stop_it_fitting_on_4gb(tmp_path):
    import json

    from nb_helpers.config import RunConfig

    (tmp_path / "config.json").write_text(json.dumps(TINYLLAMA))
    cfg = RunConfig(micro_batch_size=8, grad_accum=1, max_length=512)
    view = plan_widget(cfg, tmp_path / "config.json")
    box = config_widgets(cfg, fields=TRAIN_FIELDS, on_change=view.update)
    assert "fits</b>" in view.widget.value and "does not fit" not in view.widget.value
    on = shown_peak(view)
    controls_of(box)["gradient checkpointing"].value = False  # every layer keeps its activations
    assert shown_peak(view) > on + 1.0 and "does not fit" in view.widget.value
    assert "turn gradient checkpointing on" in view.widget.value


def test_unplannable_settings_say_why_instead_of_raising(tiny_model_dir, tiny_cfg):
    view = plan_widget(tiny_cfg, load_shape(tiny_model_dir))
    tiny_cfg.target_modules = ["lm_head"]  # a linear layer, but not one the planner models
    view.update(tiny_cfg)
    assert view.plan is None and "no prediction" in view.widget.value and "lm_head" in view.widget.value
    missing = plan_widget(tiny_cfg, tiny_model_dir.parent / "no-such-model")
    assert missing.plan is None and "config.json" in missing.widget.value


@pytest.mark.parametrize("value", [True, False])
def test_gradient_checkpointing_checkbox_writes_the_config(value):
    from nb_helpers.config import RunConfig

    cfg = RunConfig(gradient_checkpointing=not value)
    box = config_widgets(cfg, fields=("gradient_checkpointing",))
    controls_of(box)["gradient checkpointing"].value = value
    assert cfg.gradient_checkpointing is value
