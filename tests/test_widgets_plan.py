"""The live "will it fit?" widget: the planner's predicted peak against the budget, following the sliders."""

import re

import pytest

from nb_helpers.plan.planner import load_shape
from nb_helpers.plan.cards import CARDS, COURSE_CARD, find_card
from nb_helpers.ui.widgets import TRAIN_FIELDS, config_widgets, plan_widget

COURSE_CARD_GIB = find_card(COURSE_CARD).budget_gib()  # the course's GTX 1650: 3.81 GiB less the desktop's 0.35


def shown_peak(view) -> float:
    return float(re.search(r"predicted peak <b>([0-9.]+) GiB</b>", view.widget.value).group(1))


def controls_of(box):
    return {c.description: c for c in box.children[:-1]}


def test_verdict_line_budget_source_and_breakdown(tiny_model_dir, tiny_cfg, no_gpu):  # card unset: the course card
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


def test_gradient_checkpointing_off_can_stop_it_fitting_on_4gb(tmp_path, no_gpu):  # judged on the course card
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


# --- the panel before loading says what auto-fit trains ----------------------------------------------------------
def _fit_as_the_run_does(cfg, shape, tokenizer_dir, gpu_total, context_gib, monkeypatch):
    """fit_to_budget as load_for_training calls it on a GPU of `gpu_total` GiB, its trial steps accepted (the trial
    runs on the GPU; here the planner's choice stands): returns the run after auto-fit."""
    from types import SimpleNamespace

    import torch

    from nb_helpers import autofit, fast
    from nb_helpers.data import load_train_eval
    from nb_helpers.fast.state import attach
    from nb_helpers.models import load_tokenizer
    from nb_helpers.plan import memory

    monkeypatch.setattr(autofit, "gpu_total_gib", lambda: gpu_total)
    monkeypatch.setattr(autofit, "trial_step", lambda *args, **kwargs: None)
    monkeypatch.setattr(memory, "memory_snapshot", lambda: {"device_used_gib": None})
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)

    class Model(torch.nn.Module):
        def gradient_checkpointing_disable(self):
            self.checkpointing = False

    model = Model()
    attach(model, fast.options_for(cfg), use_graphs=cfg.graphs_wanted, no_recompute=0)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    rows, _ = load_train_eval(cfg, tokenizer)
    run = SimpleNamespace(cfg=cfg.replace(), model=model, tokenizer=tokenizer, train_rows=rows, shape=shape,
                          summary={"cuda_context_gib": context_gib}, prediction=None)
    autofit.fit_to_budget(run, verbose=False)
    return run


@pytest.mark.parametrize("card", [*sorted(CARDS), None])
def test_the_panel_before_loading_shows_what_auto_fit_trains(card, tokenizer_dir, monkeypatch):
    """For every card preset (on a bigger GPU that emulates it) and for an unset card on a GTX 1650 itself, with the
    shipped data: the micro-batch, accumulation and checkpointing the panel writes into the sliders before loading,
    and its budget, are what auto-fit trains. The course's GPU model shape (TinyLlama-1.1B); its rows measured with
    the embedded model's tokenizer, which stands in for TinyLlama's (no hub here)."""
    from nb_helpers.autofit import longest_training_row, training_length
    from nb_helpers.config import RunConfig
    from nb_helpers.plan.cards import machine_budget_gib
    from nb_helpers.plan.catalog import known_shape

    shape, gpu_total = known_shape("tinyllama-1.1b"), (3.81 if card is None else 24.0)
    cfg = RunConfig(model=str(tokenizer_dir), card=card, auto_fit=True, max_length=512)
    longest = longest_training_row(cfg)
    assert longest < cfg.max_length  # the shipped rows are short: fitting at max_length would plan the wrong run
    view = plan_widget(cfg, shape, longest_row=longest, gpu_total_gib=gpu_total)
    assert view.choice is not None, view.widget.value
    shown = (cfg.micro_batch_size, cfg.grad_accum, cfg.gradient_checkpointing)
    assert shown == (view.choice.batch, view.choice.accum, view.choice.gradient_checkpointing)
    assert "auto-fit will train" in view.widget.value and f"{longest} tokens" in view.widget.value
    budget, _ = view.budget_for(cfg)

    run = _fit_as_the_run_does(cfg, shape, tokenizer_dir, gpu_total, view.context_gib, monkeypatch)
    assert (run.cfg.micro_batch_size, run.cfg.grad_accum, run.cfg.gradient_checkpointing) == shown
    assert machine_budget_gib(run.cfg, gpu_total) == budget
    assert run.prediction.inputs.seq == training_length(cfg, longest)
    assert run.cfg.effective_batch == cfg.effective_batch == 8


def test_an_unset_card_on_a_gpu_is_judged_against_that_gpu_less_the_desktop(tiny_model_dir, tiny_cfg):
    """The panel's budget and auto-fit's are one: with no card on a real GPU, its total less the desktop reserve
    (none on a headless machine), not the course's GTX 1650 and not the whole GPU."""
    from nb_helpers.plan.cards import DESKTOP_RESERVE_GIB

    shape = load_shape(str(tiny_model_dir))
    view = plan_widget(tiny_cfg.replace(card=None, budget_gib=None), shape, gpu_total_gib=7.8)
    budget, source = view.budget_for(tiny_cfg.replace(card=None, budget_gib=None))
    assert budget == pytest.approx(7.8 - DESKTOP_RESERVE_GIB) and "this GPU" in source
    assert view.budget_for(tiny_cfg.replace(card=None, budget_gib=None, desktop_on_card=False))[0] == 7.8


def test_sliders_auto_fit_decides_say_so_and_follow_its_choice(tokenizer_dir):
    """With auto-fit deciding, the micro-batch, accumulation and checkpointing controls are marked and locked, show
    auto-fit's choice, and follow it when another knob moves (max_length here)."""
    from nb_helpers.autofit import longest_training_row
    from nb_helpers.config import RunConfig
    from nb_helpers.plan.catalog import known_shape

    cfg = RunConfig(model=str(tokenizer_dir), card="gtx1650", auto_fit=True, max_length=512)
    view = plan_widget(cfg, known_shape("tinyllama-1.1b"), longest_row=longest_training_row(cfg), gpu_total_gib=24.0)
    box = config_widgets(cfg, fields=TRAIN_FIELDS, on_change=view.update, auto_fit=view)
    controls = controls_of(box)
    batch = controls["micro-batch (auto-fit)"]
    assert batch.disabled and controls["grad accum (auto-fit)"].disabled
    assert batch.value == cfg.micro_batch_size == view.choice.batch
    controls["LoRA rank r"].value = 64  # another knob: auto-fit decides again, and the locked sliders follow
    assert (batch.value, controls["grad accum (auto-fit)"].value) == (view.choice.batch, view.choice.accum)
    plain = config_widgets(RunConfig(), fields=TRAIN_FIELDS)
    assert "micro-batch" in controls_of(plain) and not controls_of(plain)["micro-batch"].disabled
