"""The course as a person uses it: JupyterLab in Chromium, notebooks 02 -> 03 -> 04 in CI mode, then reopened.

One flow, in order (each test continues where the one before stopped, in the same server and browser): what is
asserted is what the page shows, plus the files the notebooks wrote. Screenshots of each notebook's final state
go to runs/browser/. `make test-browser` runs this alone; `make test` includes it."""

import contextlib
import io
import json
import os
import re

import pytest
from lab import Notebook
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

PROGRESS = ".widget-hbox:has(.widget-hprogress)"  # tqdm's bar: label, bar, percentage and times
TRAINING_TIMEOUT = 1800  # s: a hang detector, not a speed check (as nbmake's); CI-sized training takes ~1 min
STATE: dict = {}  # what one step of the flow leaves for the next


def bar_texts(cell) -> list[str]:
    """The progress bars' text (tqdm draws spaces as U+2007 figure spaces, which keep its columns steady)."""
    return [t.replace("\u2007", " ") for t in cell.locator(PROGRESS).all_inner_texts()]


def slider(cell, label: str):
    return cell.locator(".widget-slider", has_text=label)


def move(page, control, steps: int) -> None:
    """Keyboard, as a person without a mouse would: focus the handle, press an arrow key per step."""
    control.locator(".noUi-handle").focus()
    for _ in range(abs(steps)):
        page.keyboard.press("ArrowRight" if steps > 0 else "ArrowLeft")


def readout(control) -> str:
    return control.locator(".widget-readout").inner_text().strip()


def shown_peak(cell) -> float:
    text = cell.locator(".widget-html", has_text="predicted peak").inner_text()
    return float(re.search(r"predicted peak ([0-9.]+) GiB", text).group(1))


def status_line(cell):
    return cell.locator(".widget-html", has_text="alpha/r")


def ci_config(**changes):
    """This machine's CI-mode default config, as the notebooks' server computes it, with `changes` applied."""
    from nb_helpers.config import default_config

    saved = os.environ.get("NB_CI")
    os.environ["NB_CI"] = "1"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return default_config(**changes)
    finally:
        os.environ.pop("NB_CI") if saved is None else os.environ.__setitem__("NB_CI", saved)


def cli_plan_peak(cfg, model_dir) -> float:
    """`python -m nb_helpers plan --json` in this process, for cfg's settings."""
    from nb_helpers.cli import main

    args = ["plan", "--model", str(model_dir), "--seq", cfg.max_length, "--batch", cfg.micro_batch_size,
            "--accum", cfg.grad_accum, "--rank", cfg.lora_r, "--targets", ",".join(cfg.target_modules),
            "--dropout", cfg.lora_dropout, "--optim", cfg.optim, "--json"]
    if not cfg.gradient_checkpointing:
        args.append("--no-gc")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(a) for a in args]) == 0
    return json.loads(out.getvalue())["peak_gib"]


def assert_controls_render(nb, cell, labels) -> None:
    """Every control is drawn (a widget that stops rendering fails here, by name) and nothing shows an error."""
    for label in labels:
        expect(cell.locator(".jupyter-widgets", has_text=label).first, f"control {label!r} not shown") \
            .to_be_visible()
    assert nb.errors() == []


def assert_fits_a_narrow_window(page, cell, width: int = 900) -> None:
    """In a narrow window (900 px, the file browser open) nothing in the cell's output reaches past the cell: the
    panels were reported clipped on the right at 1,000 px. Then the window goes back to its size."""
    size = page.viewport_size
    page.set_viewport_size({"width": width, "height": size["height"]})
    try:
        page.wait_for_timeout(500)  # JupyterLab lays the panel out again
        edge = cell.locator(".jp-OutputArea").first.evaluate("e => e.getBoundingClientRect().right")
        for widget in cell.locator(".jp-OutputArea .widget-inline-hbox, .jp-OutputArea .widget-html").all():
            right, text = widget.evaluate("e => [e.getBoundingClientRect().right, e.textContent.slice(0, 40)]")
            assert right <= edge + 1, f"at {width} px, {text!r} ends at {right:.0f} px, past the cell's {edge:.0f} px"
    finally:
        page.set_viewport_size(size)


def assert_readable_layout(cell) -> None:
    """No label cut off, and slider tracks wide enough to aim at (they were ~54 px, labels ended in '…')."""
    for label in cell.locator("label.widget-label").all():
        text, scroll, client = label.evaluate("e => [e.textContent, e.scrollWidth, e.clientWidth]")
        assert scroll <= client, f"label {text!r} is cut off ({scroll} px of text in {client} px)"
    widths = [t.evaluate("e => e.getBoundingClientRect().width") for t in cell.locator(".slider-container").all()]
    assert widths and min(widths) >= 200, f"slider tracks {widths} px wide: too narrow to aim at"


def test_02_rank_slider_moves_the_plan_and_empty_targets_are_refused(page, lab, project, embedded_dir,
                                                                       screenshots):
    nb = Notebook(page, lab, "02_attach_lora.ipynb").open()
    panel = nb.index_of("config_widgets(")
    nb.run_all_from(0, panel + 1)
    cell = nb.cell(panel)
    expect(cell.locator(".widget-html", has_text="predicted peak")).to_be_visible()
    assert_controls_render(nb, cell, ["LoRA rank r", "LoRA alpha", "LoRA dropout", "targets", "effective batch"])
    assert_readable_layout(cell)
    assert_fits_a_narrow_window(page, cell)

    rank, alpha = slider(cell, "LoRA rank r"), slider(cell, "LoRA alpha")
    assert (readout(rank), readout(alpha)) == ("8", "16")
    rank.locator(".widget-readout").focus()  # typing into the readout (it once went blank, r unchanged)
    page.keyboard.type("1000")
    page.keyboard.press("Enter")
    assert readout(rank) == "8"  # the readout shows the choice; the handle and the arrow keys move it
    before = shown_peak(cell)
    assert before == pytest.approx(cli_plan_peak(ci_config(), embedded_dir), abs=0.005)
    move(page, rank, +1)  # 8 -> 16
    expect(status_line(cell)).to_contain_text("alpha/r = 32/16 = 2 (follows r")
    assert readout(alpha) == "32"  # alpha followed r: the update's scale alpha/r stayed 2
    planned = cli_plan_peak(ci_config(lora_r=16, lora_alpha=32), embedded_dir)
    assert f"{planned:.2f}" != f"{before:.2f}"  # the plan for the card, the same on every machine: r=16 shows a move
    # the peak re-renders after the status line and the saved choices (the planner runs last): wait for it
    expect(cell.locator(".widget-html", has_text="predicted peak")).to_contain_text(f"predicted peak {planned:.2f} GiB")
    after = shown_peak(cell)
    assert after > before
    carried = json.loads((project / "runs" / "ci" / "course-config.json").read_text())
    assert (carried["lora_r"], carried["lora_alpha"]) == (16, 32)

    targets = cell.locator(".widget-select-multiple select")
    targets.select_option([])  # nothing selected: LoRA would attach nowhere
    expect(status_line(cell).or_(cell.locator(".widget-html", has_text="target_modules is empty")).first) \
        .to_contain_text("target_modules is empty")
    expect(cell.locator(".widget-html", has_text="no prediction")).to_contain_text("target_modules is empty")
    carried = json.loads((project / "runs" / "ci" / "course-config.json").read_text())
    assert carried["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]  # refused: the file kept them
    targets.select_option(["q_proj", "k_proj", "v_proj", "o_proj"])
    expect(cell.locator(".widget-html", has_text="predicted peak")).to_contain_text(f"{after:.2f} GiB")

    family = nb.index_of("family_plan_widget(")  # which other models fit: a model choice with its breakdown
    nb.run_all_from(panel + 1, family + 1)
    family_cell = nb.cell(family)
    assert_controls_render(nb, family_cell, ["model", "predicted peak"])
    from nb_helpers.config import RunConfig
    from nb_helpers.plan.catalog import known_shapes, plan_for_family

    family_cell.locator(".widget-dropdown select").select_option(label=f"qwen3-4b: {known_shapes()['qwen3-4b']}")
    # the GPU recipe, r=16 chosen, on the notebook's card: the widget plans for that card's budget
    recipe = RunConfig(lora_r=16, lora_alpha=32, lora_dropout=ci_config().lora_dropout, card="gtx1650")
    expected = plan_for_family(recipe, "qwen3-4b").peak_gib
    expect(family_cell.locator(".widget-html", has_text="predicted peak")).to_contain_text(
        f"predicted peak {expected:.2f} GiB")
    expect(family_cell.locator(".widget-html", has_text="predicted peak")).to_contain_text("of qwen3-4b")

    nb.run_all_from(family + 1)
    assert nb.errors() == []

    # The LoRA cell re-runs after a slider move: the old adapter comes off, the new rank attaches to the base layers
    lora = nb.index_of("model = get_peft_model(model, lora_config)")
    shown_rank = ('print(model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")'
                  '.lora_A["default"].weight.shape[0])')
    move(page, rank, -1)  # 16 -> 8
    expect(status_line(cell)).to_contain_text("alpha/r = 16/8")
    nb.run(lora)
    assert nb.errors() == [] and nb.ask(shown_rank).strip() == "8"
    move(page, rank, +1)  # back to 16, the choice the next notebooks expect
    expect(status_line(cell)).to_contain_text("alpha/r = 32/16")
    nb.run(lora)
    assert nb.errors() == [] and nb.ask(shown_rank).strip() == "16"
    nb.save()
    nb.screenshot(panel, screenshots / "02_attach_lora.png")
    nb.close()


# The trainer's settings that come from the sliders (SFTConfig name -> RunConfig field)
TRAINER_KNOBS = {"per_device_train_batch_size": "micro_batch_size", "gradient_accumulation_steps": "grad_accum",
                 "learning_rate": "learning_rate", "max_steps": "max_steps", "num_train_epochs": "num_train_epochs",
                 "max_length": "max_length", "gradient_checkpointing": "gradient_checkpointing", "optim": "optim",
                 "max_grad_norm": "max_grad_norm", "warmup_steps": "warmup_steps",
                 "lr_scheduler_type": "lr_scheduler_type", "seed": "seed"}
ASK_TRAINER = ("print(__import__('json').dumps({k: getattr(v, 'value', v) for k, v in vars(trainer.args).items() "
               f"if k in {sorted(TRAINER_KNOBS)!r}}}))")


def outputs_text(nb, index) -> str:
    return "\n".join(o.get("text", "") for o in nb.state(index)["outputs"])


def shown_text(state) -> str:
    """What a cell's outputs say: printed text, and displayed Markdown or plain text."""
    def text(value) -> str:
        return "".join(value) if isinstance(value, list) else value or ""

    return "\n".join(text(o.get("text")) + "".join(text(o.get("data", {}).get(kind)) for kind in
                                                    ("text/markdown", "text/plain")) for o in state["outputs"])


def live_figure(nb):
    """The live plot: LivePlot shows one figure at the first training step, in the training cell (the eval loss
    measured before training waits for it), and redraws that same output in place at every step."""
    return nb.panel().locator("figure.nb-figure")


def test_03_sliders_reach_the_trainer_and_the_run_folder(page, lab, project, screenshots):
    nb = Notebook(page, lab, "03_train.ipynb").open()
    panel = nb.index_of("config_widgets(")
    nb.run_all_from(0, panel + 1)
    setup = outputs_text(nb, nb.index_of("course_config()"))
    assert "carried from earlier notebooks" in setup and "lora_r=16" in setup  # notebook 02's choice arrived

    cell = nb.cell(panel)
    assert_controls_render(nb, cell, ["LoRA rank r", "LoRA alpha", "grad accum", "micro-batch", "max length",
                                      "gradient checkpointing", "learning rate", "max steps", "epochs",
                                      "predicted peak"])
    assert_readable_layout(cell)
    rank, alpha, accum = slider(cell, "LoRA rank r"), slider(cell, "LoRA alpha"), slider(cell, "grad accum")
    assert (readout(rank), readout(alpha), readout(accum)) == ("16", "32", "2")
    move(page, rank, +1)  # 16 -> 32, alpha follows to 64
    expect(status_line(cell)).to_contain_text("alpha/r = 64/32 = 2")
    move(page, alpha, -1)  # 64 -> 32: moved by hand, so it stops following r
    expect(status_line(cell)).to_contain_text("alpha/r = 32/32 = 1")
    move(page, accum, +1)  # 2 -> 4
    expect(status_line(cell)).to_contain_text("batch 2 x accum 4")
    expected = ci_config(lora_r=32, lora_alpha=32, grad_accum=4)

    prepare, trainer_cell = nb.index_of("RESUME = None"), nb.index_of("trainer = SFTTrainer(")
    nb.run_all_from(panel + 1, trainer_cell + 1)  # the data section, prepare + load, SFTConfig, SFTTrainer
    loaded = outputs_text(nb, prepare)
    assert "r=32 alpha=32" in loaded and "batch 2 x accum 4" in loaded, loaded
    held = json.loads(nb.ask(ASK_TRAINER))  # what the trainer holds, asked as from a console on this kernel
    assert held == {k: getattr(expected, field) for k, field in TRAINER_KNOBS.items()}  # exact: no widget rounded
    assert (held["gradient_accumulation_steps"], held["per_device_train_batch_size"]) == (4, 2)

    def watcher(index, seen):
        def watch(state):  # while the cell runs: is a progress bar on the page?
            seen.extend(bar_texts(nb.cell(index)))
        return watch

    before, training, finish = (nb.index_of("evaluate_before("), nb.index_of("trainer.train("),
                                nb.index_of("finish_run("))
    seen = []
    nb.run(before, timeout=TRAINING_TIMEOUT, watch=watcher(before, seen))
    assert any("scoring the base model: 4 prompts" in s for s in seen), seen[-5:]
    captions = []
    nb.run(training, timeout=TRAINING_TIMEOUT, watch=lambda state: captions.extend(
        live_figure(nb).locator("figcaption").all_inner_texts()))
    assert "Paged optimizers are not supported" not in "\n".join(  # said once, in our words, or not at all on a CPU
        outputs_text(nb, i) for i in range(prepare, training + 1))

    figure = live_figure(nb)
    expect(figure).to_have_count(1)  # one live plot, redrawn in place, not one figure per step
    steps = expected.max_steps
    expect(figure.locator("figcaption")).to_contain_text(f"step {steps},")
    assert any(f"step {s}," in c for c in captions for s in range(1, steps)), captions  # it moved while training
    alt = figure.locator("img").get_attribute("alt")
    assert f"{steps} (steps {', '.join(str(s) for s in range(1, steps + 1))})" in alt  # a point per step

    seen = []
    nb.run(finish, timeout=TRAINING_TIMEOUT, watch=watcher(finish, seen))
    bars = seen + bar_texts(nb.cell(finish))
    assert any("scoring the tuned model" in b and "100%" in b for b in bars), bars[-5:]

    run_dir = project / "runs" / "ci" / "latest"
    saved = json.loads((run_dir / "config.json").read_text())
    differ = {k: (v, saved.get(k)) for k, v in expected.to_dict().items() if saved.get(k) != v}
    assert differ == {}, f"the run's config.json differs from the sliders' settings: {differ}"
    assert (saved["lora_r"], saved["lora_alpha"], saved["grad_accum"]) == (32, 32, 4)

    nb.run_all_from(finish + 1)
    assert nb.errors() == []
    final = outputs_text(nb, nb.index_of('saved.summary["status"]'))
    assert "completed" in final
    nb.screenshot(before, screenshots / "03_train.png")
    STATE["first_run"] = run_dir.resolve().name

    # A slider moved after the run loaded: the panel says the loaded run does not train it, the run's config.json
    # keeps what trained, and running the training cell again refuses instead of appending to the finished run.
    metrics = (run_dir / "metrics.jsonl").read_text()
    move(page, rank, -1)  # 32 -> 16 (alpha, moved by hand before, stays 32)
    expect(status_line(cell)).to_contain_text("moved after loading (lora_r 32 \u2192 16)")
    expect(status_line(cell)).to_contain_text('Re-run section 4 ("Check first, then load") to start a new run')
    again = "\n".join(o.get("text", "") + o.get("evalue", "") for o in nb.run(training)["outputs"])
    assert "this run is finished" in again and "re-run the notebook from" in again, again
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # nothing appended
    assert json.loads((run_dir / "config.json").read_text())["lora_r"] == 32  # what trained, not the slider
    carried = json.loads((project / "runs" / "ci" / "course-config.json").read_text())
    assert carried["lora_r"] == 16  # the choice is kept for the next run, as a choice
    nb.clear_outputs(training)
    nb.save()
    nb.close()


def figures_in(nb, index):
    return nb.cell(index).locator(".jp-OutputArea-output img")


def test_04_each_figure_once_and_the_legend_names_every_run(page, lab, project, screenshots):
    from nb_helpers.ui.benchmarks import load_benchmark
    from nb_helpers.runs import list_runs, load_run

    nb = Notebook(page, lab, "04_metrics_analysis.ipynb").open()
    nb.run_all_from(0)
    assert nb.errors() == []
    latest, compare = nb.index_of("plot_training({run.name"), nb.index_of("plot_training({r.label")
    for index in (latest, compare):
        expect(figures_in(nb, index)).to_have_count(1)  # shown once, not by the backend and again as the value
    assert f"run: {STATE['first_run']}" in figures_in(nb, latest).get_attribute("alt")
    benchmark = figures_in(nb, nb.index_of("plot_benchmark(bench)"))  # section 8: the committed GPU benchmark
    expect(benchmark).to_have_count(1)
    alt = benchmark.get_attribute("alt")
    ours = [r for r in load_benchmark().rows if r.recipe == "ours"]
    assert ours and "our speed over the reference:" in alt
    assert all(f"{r.workload} {r.ratio:.1f}x" in alt for r in ours), (alt, ours)
    runs = [load_run(p) for p in list_runs(project / "runs" / "ci")[-4:]]
    legend_or_run = figures_in(nb, compare).get_attribute("alt")
    assert all(r.label in legend_or_run for r in runs), (legend_or_run, [r.label for r in runs])
    for text in ("loss_figure((x, loss)", 'title="overfitting'):  # section 4's figures: images, not "<Figure ...>"
        expect(figures_in(nb, nb.index_of(text))).to_have_count(1)
    assert "<Figure size" not in nb.panel().inner_text()

    # The r comparison trains from the latest run's own config.json with only the rank (and alpha, keeping alpha/r)
    # changed, and its legend names both runs with their knobs
    first = load_run(project / "runs" / "ci" / STATE["first_run"])
    source = nb.sources()[compare]
    nb.edit(compare, source.replace("TRAIN_COMPARISON = False", "TRAIN_COMPARISON = True"))
    nb.run(compare, timeout=TRAINING_TIMEOUT)
    nb.edit(compare, source)
    newest = load_run(list_runs(project / "runs" / "ci")[-1])
    assert newest.name != first.name
    differ = {k for k in set(first.config) | set(newest.config) if first.config.get(k) != newest.config.get(k)}
    assert differ == {"lora_r", "lora_alpha"}, (differ, first.config, newest.config)
    assert newest.config["lora_alpha"] / newest.config["lora_r"] == first.config["lora_alpha"] / first.config["lora_r"]
    alt = figures_in(nb, compare).get_attribute("alt")
    assert first.label in alt and newest.label in alt and "alpha=" in newest.label, alt
    assert nb.errors() == []
    nb.save()
    STATE["runs_before"] = len(runs)


def test_03_interrupt_says_how_to_resume_here(page, lab, project):
    """Stop the kernel mid-training: the run keeps its steps, and the notebook says to set RESUME (no bare
    AssertionError, no CLI-only advice)."""
    nb = Notebook(page, lab, "03_train.ipynb").open()
    panel = nb.index_of("config_widgets(")
    nb.run_all_from(0, panel + 1)
    steps = nb.cell(panel).locator(".widget-inline-hbox", has_text="max steps").locator("input")
    steps.fill("200")
    steps.press("Enter")
    expect(status_line(nb.cell(panel))).to_contain_text("max_steps=200")
    training = nb.index_of("trainer.train(")
    nb.run_all_from(nb.index_of("RESUME = None"), training)  # prepare, settings, trainer, the base model's scores
    interrupted = []

    def watch(state):
        caption = live_figure(nb).locator("figcaption")
        if not interrupted and caption.count() and re.search(r"step \d+,", caption.inner_text()):
            nb.panel().locator(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']").click()
            interrupted.append(True)

    done = nb.run(training, timeout=TRAINING_TIMEOUT, watch=watch)
    assert interrupted, "training finished before it could be interrupted"
    text = "\n".join(o.get("text", "") for o in done["outputs"])
    assert "interrupted at step" in text and "set RESUME = " in text, text[-2000:]
    nb.run_all_from(training + 1)
    assert nb.errors() == []
    final = outputs_text(nb, nb.index_of('saved.summary["status"]'))
    assert "interrupted" in final and "set RESUME = " in final, final
    new_run = (project / "runs" / "ci" / "latest").resolve()

    # The training cell run again, after the interrupt and the cells below it: the run continues from the interrupt's
    # checkpoint (it once restarted at step 1 on the trained weights, or called the run finished), each step once
    def trained_steps() -> list[int]:
        steps = []
        for line in (new_run / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # the line being written as we read
                record = json.loads(line)
                steps += [record["step"]] if "loss" in record else []
        return steps

    stopped_at, again = max(trained_steps()), []

    def watch_again(state):  # the metrics file, not the live plot: the plot's figure belongs to the cell's first run
        if not again and max(trained_steps(), default=0) > stopped_at:
            nb.panel().locator(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']").click()
            again.append(True)

    text = "\n".join(o.get("text", "") for o in nb.run(training, timeout=TRAINING_TIMEOUT, watch=watch_again)["outputs"])
    assert f"continuing this run from checkpoint-{stopped_at}" in text and "step 1/" not in text, text[-2000:]
    steps = trained_steps()
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] > stopped_at, steps
    assert (project / "runs" / "ci" / "latest").resolve() == new_run  # the same run folder, no new one
    assert new_run.name != STATE["first_run"]  # re-running from section 4 started a new run folder
    assert json.loads((new_run / "config.json").read_text())["lora_r"] == 16  # with the slider moved after the first

    # RESUME saved pointing at a completed run (a notebook reopened later): refused, nothing rewritten
    prepare = nb.index_of("RESUME = None")
    source = nb.sources()[prepare]
    first = project / "runs" / "ci" / STATE["first_run"]
    summary = (first / "summary.json").read_text()
    nb.edit(prepare, source.replace("RESUME = None", f"RESUME = {str(first)!r}"))
    refused = "\n".join(o.get("text", "") + o.get("evalue", "") for o in nb.run(prepare)["outputs"])
    assert "completed its training: there is nothing to resume" in refused, refused
    assert (first / "summary.json").read_text() == summary
    nb.edit(prepare, source)
    nb.clear_outputs(prepare)
    nb.save()
    STATE["new_run"] = new_run.name
    nb.close()


def test_04_rerun_shows_the_new_run(page, lab, project, screenshots):
    from nb_helpers.ui.benchmarks import load_benchmark
    from nb_helpers.runs import list_runs, load_run

    nb = Notebook(page, lab, "04_metrics_analysis.ipynb").open()  # still open in its kernel: no setup re-run
    latest, compare = nb.index_of("plot_training({run.name"), nb.index_of("plot_training({r.label")
    nb.run(latest)
    nb.run(compare)
    expect(figures_in(nb, latest)).to_have_count(1)
    expect(figures_in(nb, compare)).to_have_count(1)
    assert f"run: {STATE['new_run']}" in figures_in(nb, latest).get_attribute("alt")
    runs = [load_run(p) for p in list_runs(project / "runs" / "ci")[-4:]]
    alt = figures_in(nb, compare).get_attribute("alt")
    assert "legend: " in alt and all(r.label in alt for r in runs), (alt, [r.label for r in runs])
    assert STATE["new_run"] in alt
    assert nb.errors() == []
    nb.save()
    nb.screenshot(compare, screenshots / "04_metrics_analysis.png")
    nb.close()


def test_04_names_a_run_whose_steps_slowed_down(page, lab, project):
    """A run whose step time rose 34% (350 -> 469 s) was once called "steady". Its numbers are written here as a
    run folder, as train() writes them, and notebook 04 reads them from disk like any other run."""
    from nb_helpers.runs import mark_latest

    run = project / "runs" / "ci" / "20990101-000000_slowing-laptop_r8"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(ci_config().to_dict()))
    times = [350.0] * 6 + [400.0] * 3 + [469.0] * 6
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "epoch": i / 15, "loss": 1.0 - 0.01 * i, "step_s": t}) + "\n"
        for i, t in enumerate(times)))
    mark_latest(run)
    nb = Notebook(page, lab, "04_metrics_analysis.ipynb").open()
    nb.run(nb.index_of("list_runs(root)\nassert"))
    flags = "\n".join(o.get("text", "") for o in nb.run(nb.index_of("flag_problems("))["outputs"])
    assert "step time rose 34%" in flags and "No problems flagged" not in flags, flags
    assert "still training" in shown_text(nb.run(nb.index_of("predicted_vs_measured_report(run.summary)")))

    # A run whose steps swung with the machine's load (5.2-58.4 s, as a busy laptop measured): 04 says its times
    # measure the load, in the flags and beside the runs' comparison
    busy = project / "runs" / "ci" / "20990101-000100_busy-laptop_r8"
    busy.mkdir()
    (busy / "config.json").write_text(json.dumps(ci_config().to_dict()))
    times = [5.2, 5.4, 58.4, 5.3, 41.0, 5.2, 30.5, 5.6, 52.0, 5.3]
    (busy / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "epoch": i / 10, "loss": 1.0 - 0.01 * i, "step_s": t}) + "\n"
        for i, t in enumerate(times)))
    mark_latest(busy)
    flags = "\n".join(o.get("text", "") for o in nb.run(nb.index_of("flag_problems("))["outputs"])
    assert "step times ranged 5.20-58.40 s" in flags and "No problems flagged" not in flags, flags
    assert "ranged 5.20-58.40 s" in shown_text(nb.run(nb.index_of("uneven_steps(steps_of(r))")))
    assert nb.errors() == []
    nb.save()
    nb.close()


@pytest.mark.parametrize("name", ["02_attach_lora.ipynb", "03_train.ipynb"])
def test_reopened_notebook_shows_its_widgets_without_their_kernel(page, lab, screenshots, name):
    """JupyterLab saved the notebook with its outputs; the kernel that held the widgets is gone."""
    lab.shutdown_kernels()
    nb = Notebook(page, lab, name).open()
    panel = nb.index_of("config_widgets(")
    cell = nb.cell(panel)
    expect(cell.locator(".widget-html", has_text="predicted peak")).to_be_visible()
    expect(slider(cell, "LoRA rank r")).to_be_visible()
    assert nb.errors() == []
    assert "Error displaying widget" not in page.locator(".jp-Notebook").inner_text()
    nb.screenshot(panel, screenshots / f"reopened_{name.replace('.ipynb', '.png')}")
    nb.save()  # restoring the saved widget state marks it changed; saving keeps the close quiet
    nb.close()
