"""What the learner moves is what trains, and what a cell shows is what ran: a completed run is never resumed or
trained again, a slider moved after loading says so, the plan panel says what will train, figures fit their
legends."""

import pytest

from nb_helpers.config import ConfigError, RunConfig


def test_a_completed_run_is_never_resumed(shared_run):
    from nb_helpers.training import prepare_run

    _, run_dir = shared_run
    with pytest.raises(ConfigError, match="completed its training: there is nothing to resume"):
        prepare_run(RunConfig(), resume_from=run_dir, verbose=False)


def test_a_finished_run_is_not_trained_again():
    from nb_helpers.training import TrainingRun, guard_training

    run = TrainingRun(RunConfig(), finished=True, run_dir="runs/x")
    with pytest.raises(RuntimeError, match="this run is finished .* re-run the notebook from \"Check first, then load\""):
        with guard_training(run, trainer=None):
            pass


def test_a_slider_moved_after_loading_says_the_loaded_run_does_not_train_it():
    from nb_helpers.ui.widgets import TRAIN_FIELDS, config_widgets

    cfg = RunConfig()
    panel = config_widgets(cfg, fields=TRAIN_FIELDS)
    assert "loaded run" not in panel.binding.status.value  # nothing loaded yet: no note
    panel.mark_loaded(cfg.replace(micro_batch_size=8, grad_accum=1), "section 4")
    status = panel.binding.status.value
    assert "the loaded run trains</b>: r=8 alpha=16" in status and "batch 8 x accum 1" in status
    assert "moved after loading" not in status
    panel.binding.controls["lora_r"].value = 16
    status = panel.binding.status.value
    assert "moved after loading</b> (lora_r 8 &rarr; 16, lora_alpha 16 &rarr; 32)" in status
    assert "Re-run section 4 to start a new run" in status
    panel.binding.controls["lora_r"].value = 8  # moved back: nothing to say
    assert "moved after loading" not in panel.binding.status.value


def test_the_plan_panel_says_what_will_train(no_gpu):
    from nb_helpers.plan.catalog import known_shape
    from nb_helpers.ui.widgets import plan_widget

    view = plan_widget(RunConfig(), known_shape("tinyllama-1.1b"))
    assert view.widget.value.startswith("<div><b>these settings train as set</b>")
    view.update(RunConfig(auto_fit=True))  # no GPU here: auto-fit cannot run, and the panel says so
    assert "these settings train as set</b> (auto-fit needs a CUDA GPU)" in view.widget.value
    shape = known_shape("tinyllama-1.1b")  # on a GPU, the longest training row not given: auto-fit chooses at loading
    view = plan_widget(RunConfig(auto_fit=True, budget_gib=4.0), shape, gpu_total_gib=24.0)
    assert "<b>auto-fit will choose</b>" in view.widget.value and "longest_row" in view.widget.value
    cfg = RunConfig(auto_fit=True, budget_gib=4.0)  # given: its choice, written into the sliders' settings
    view = plan_widget(cfg, shape, longest_row=119, gpu_total_gib=24.0)
    assert "<b>auto-fit will train</b> micro-batch 8 x accumulation 1" in view.widget.value
    assert (cfg.micro_batch_size, cfg.grad_accum) == (8, 1)


def test_a_legend_of_long_run_names_stays_inside_the_figure():
    from nb_helpers.ui.plots import plot_training

    records = [{"step": s, "loss": 1.0 / s, "step_s": 1.0} for s in range(1, 5)]
    runs = {f"20261201-12000{i}_SmolLM2-135M-Instruct_r8 (r=8, alpha=16, 2x2)": records for i in range(3)}
    fig = plot_training(runs)
    fig.canvas.draw()
    box, legend = fig.bbox, fig.legends[0].get_window_extent()
    assert box.x0 <= legend.x0 and legend.x1 <= box.x1 and box.y0 <= legend.y0, (legend, box)
    assert all(label in fig.alt for label in runs)


def test_a_slider_moved_after_loading_changes_the_learners_config_not_the_runs(tiny_cfg):
    """Notebook 03 loads a run from the sliders' cfg, then builds the trainer from run.cfg cells later: a move in
    between must not reach the trainer (config.json and the panel say the loaded run trains what it was loaded with)."""
    from nb_helpers.training import prepare_run

    run = prepare_run(tiny_cfg)
    loaded = (run.cfg.lora_r, run.cfg.learning_rate, list(run.cfg.target_modules))
    tiny_cfg.lora_r, tiny_cfg.learning_rate = tiny_cfg.lora_r * 2, tiny_cfg.learning_rate * 2
    tiny_cfg.target_modules.append("up_proj")
    assert (run.cfg.lora_r, run.cfg.learning_rate, list(run.cfg.target_modules)) == loaded
