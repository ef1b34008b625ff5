"""Widgets and the course's carried config, without a browser (tests/browser drives the same in JupyterLab)."""

import json

import pytest

from nb_helpers.config import ConfigError, RunConfig


def controls_of(box):
    return {c.description: c for c in box.children[:-1]}


def test_alpha_follows_r_until_moved_by_hand():
    from nb_helpers.ui.widgets import TRAIN_FIELDS, config_widgets

    cfg = RunConfig(lora_r=8, lora_alpha=16)
    box = config_widgets(cfg, fields=TRAIN_FIELDS)
    c = controls_of(box)
    c["LoRA rank r"].value = 32
    assert (cfg.lora_r, cfg.lora_alpha, c["LoRA alpha"].value) == (32, 64, 64)
    assert "alpha/r</b> = 64/32 = 2 (follows r" in box.children[-1].value
    c["LoRA alpha"].value = 16  # a choice: alpha stays where it was put
    c["LoRA rank r"].value = 4
    assert (cfg.lora_r, cfg.lora_alpha) == (4, 16)
    assert "16/4 = 4" in box.children[-1].value and "follows" not in box.children[-1].value
    c["LoRA alpha"].value = 8  # back on the recipe's 2r: following again
    c["LoRA rank r"].value = 1
    assert (cfg.lora_r, cfg.lora_alpha) == (1, 2)


def test_alpha_set_off_the_recipe_does_not_follow_and_panel_without_alpha_still_moves_it():
    from nb_helpers.ui.widgets import config_widgets

    cfg = RunConfig(lora_r=8, lora_alpha=8)  # e.g. carried from notebook 02, where alpha was moved
    controls_of(config_widgets(cfg, fields=("lora_r", "lora_alpha")))["LoRA rank r"].value = 16
    assert (cfg.lora_r, cfg.lora_alpha) == (16, 8)
    cfg = RunConfig(lora_r=8, lora_alpha=16)
    box = config_widgets(cfg, fields=("lora_r",))  # no alpha control: alpha/r must not change silently
    controls_of(box)["LoRA rank r"].value = 2
    assert (cfg.lora_r, cfg.lora_alpha) == (2, 4) and "4/2 = 2" in box.children[-1].value


def test_targets_are_validated_on_every_change_and_errors_reach_the_panel(tmp_path):
    from nb_helpers.ui.widgets import LORA_FIELDS, config_widgets

    cfg = RunConfig(runs_dir=str(tmp_path / "runs"))
    errors, changes = [], []
    box = config_widgets(cfg, fields=LORA_FIELDS, targets=["k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
                         on_change=changes.append, on_error=errors.append, carry=True)
    targets = controls_of(box)["targets"]
    assert set(targets.value) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    targets.value = ("k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert cfg.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]  # the config's order kept
    assert "up_proj" in box.children[-1].value and len(changes) == 1
    targets.value = ()
    assert cfg.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]
    assert len(errors) == 1 and "target_modules is empty" in errors[0] and "keeps target_modules" in errors[0]
    assert "color:#b00" in box.children[-1].value and "target_modules is empty" in box.children[-1].value
    saved = json.loads((tmp_path / "runs" / "course-config.json").read_text())
    assert saved["target_modules"] == cfg.target_modules  # the refused choice was never carried


def test_plan_panel_shows_the_error_then_recovers(tiny_model_dir, tiny_cfg):
    from nb_helpers.plan.planner import load_shape
    from nb_helpers.ui.widgets import LORA_FIELDS, config_widgets, plan_widget

    view = plan_widget(tiny_cfg, load_shape(tiny_model_dir))
    box = config_widgets(tiny_cfg, fields=LORA_FIELDS, targets=["q_proj", "v_proj"], on_change=view.update,
                         on_error=view.show_error)
    controls_of(box)["targets"].value = ()
    assert view.plan is None and "no prediction" in view.widget.value and "target_modules is empty" in view.widget.value
    controls_of(box)["targets"].value = ("q_proj",)
    assert view.plan is not None and "predicted peak" in view.widget.value


def test_controls_are_wide_enough_and_fall_back_to_static_html():
    from nb_helpers.ui.widgets import CONTROL_WIDTH, FIT_WIDTH, LABEL_WIDTH, TRAIN_FIELDS, config_widgets

    box = config_widgets(RunConfig(), fields=TRAIN_FIELDS)
    for control in box.children[:-1]:  # as wide as the window allows, up to the width the labels were laid out for
        assert (control.layout.width, control.layout.max_width) == (FIT_WIDTH, CONTROL_WIDTH)
        assert control.style.description_width == LABEL_WIDTH
    bundle = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # live where a widget frontend runs
    assert "LoRA rank r</td><td>8</td>" in bundle["text/html"] and "effective batch" in bundle["text/html"]
    assert "learning rate: 0.0002" in bundle["text/plain"]


def test_choices_are_carried_to_the_next_notebook(tmp_path, monkeypatch, capsys):
    from nb_helpers.course import carry_path, course_config, save_choices
    from nb_helpers.ui.widgets import TRAIN_FIELDS, config_widgets

    overrides = tmp_path / "over.json"
    overrides.write_text(json.dumps({"runs_dir": str(tmp_path / "runs")}))
    monkeypatch.setenv("NB_CONFIG", str(overrides))
    first = course_config()  # nothing carried yet: the machine's defaults
    assert "carried from earlier notebooks" not in capsys.readouterr().out
    box = config_widgets(first, fields=TRAIN_FIELDS, carry=True)  # notebook 03's panel
    controls_of(box)["grad accum"].value = 4
    controls_of(box)["LoRA rank r"].value = 16
    save_choices(first.replace(lora_dropout=0.1), ["lora_dropout"])  # another notebook's choice stays beside them
    second = course_config()
    out = capsys.readouterr().out
    assert (second.grad_accum, second.lora_r, second.lora_alpha, second.lora_dropout) == (4, 16, 32, 0.1)
    assert "carried from earlier notebooks" in out and str(carry_path(first)) in out and "grad_accum=4" in out
    assert course_config(lora_r=4).lora_r == 4  # an explicit argument still wins

    carry_path(first).write_text('{"lora_r": 0}')
    with pytest.raises(ConfigError, match="(?s)course-config.json.*lora_r=0.*Delete the file"):
        course_config()
    carry_path(first).write_text("{not json")
    with pytest.raises(ConfigError, match="(?s)not valid JSON.*delete it"):
        course_config()


def test_live_plot_caption_and_a_point_per_step(monkeypatch):
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(obj)

    monkeypatch.setattr("IPython.display.display", lambda obj, display_id=None: shown.append(obj) or Handle())
    from nb_helpers.ui.plots import LivePlot

    live = LivePlot(name="this run", every=1)
    live({"step": 0, "eval_loss": 1.0})
    for step in (1, 2, 3):
        live({"step": step, "loss": 2.0 / step, "step_s": 1.5})
    assert len(shown) == 3  # once per step: the evaluation before training waits for the first step's cell
    html = shown[-1]._repr_html_()
    assert html.count("<img") == 1 and "data:image/png;base64," in html
    assert "<figcaption>this run: step 3, loss 0.667, 1.50 s/step</figcaption>" in html
    assert "train-loss points: this run: 3 (steps 1, 2, 3)" in shown[-1].alt
    eval_panel = [ax for ax in shown[0].axes if ax.get_title().startswith("eval loss")][0]
    assert list(eval_panel.lines[0].get_xdata()) == [0]  # the starting point is drawn with the first step
    every_fifth = LivePlot(name="this run", every=5)
    for step in range(1, 11):
        every_fifth({"step": step, "loss": 1.0})
    assert len(shown) == 3 + 3  # the first step (so the figure is there at once), then steps 5 and 10


def test_progress_bar_only_where_someone_watches(monkeypatch):
    import io

    from nb_helpers import frontend

    monkeypatch.setattr(frontend, "in_notebook", lambda: False)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # output piped to a log: quiet
    assert frontend.progress_bar(10, "scoring") is None
    assert "python -m nb_helpers train --resume runs/x" in frontend.resume_hint("runs/x")
    monkeypatch.setattr(frontend, "in_notebook", lambda: True)
    bar = frontend.progress_bar(10, "scoring the base model: 4 prompts")
    assert type(bar).__module__ == "tqdm.notebook"
    bar.close()
    hint = frontend.resume_hint("/r/runs/x")
    assert "set RESUME = '/r/runs/x'" in hint and "notebook 03" in hint


def test_generation_moves_the_bar_once_per_decoding_step(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nb_helpers import frontend
    from nb_helpers.task_metric import generate

    bars = []

    class Bar:
        def __init__(self, total, description):
            self.total, self.description, self.updates, self.closed = total, description, [], False
            bars.append(self)

        def update(self, n):
            self.updates.append(n)

        def close(self):
            self.closed = True

    monkeypatch.setattr(frontend, "progress_bar", Bar)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [[{"role": "user", "content": f"order {i}"}] for i in range(3)]
    answers = generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=2, label="scoring the base model")
    (bar,) = bars
    assert len(answers) == 3 and bar.closed and bar.description == "scoring the base model: 3 prompts"
    assert bar.total == 2 * 6 and sum(bar.updates) == bar.total
    assert bar.updates.count(1) >= 2  # ticks while generating, not one jump at the end
