import json

from nb_helpers.ui.analysis import flag_problems, reference_table, to_markdown
from nb_helpers.metrics import median, read_metrics


def step(i, loss=1.0, step_s=1.0, vram=2.0):
    return {"step": i, "epoch": i / 10, "loss": loss, "step_s": step_s, "device_used_gib": vram, "tokens": 100}


def test_a_line_that_is_not_a_record_is_skipped_with_where_it_is(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(step(1)) + "\n" + json.dumps(step(2)) + "\n" + '{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert f"{path}:3: skipped, the last line, cut short" in capsys.readouterr().out
    path.write_text(json.dumps(step(1)) + "\n" + '{"step": 2, "lo' + "\n" + json.dumps(step(3)) + "\n")
    assert [r["step"] for r in read_metrics(path)] == [1, 3]
    assert f"{path}:2: skipped, not a metrics record" in capsys.readouterr().out
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_median():
    assert median([3, None, 1, 2]) == 2 and median([1, 2, 3, 4]) == 2.5 and median([None]) is None


def test_reference_table_columns_and_cpu_blanks():
    rows = reference_table([step(1, vram=None), {"step": 1, "epoch": 0.1, "eval_loss": 0.5}])
    assert list(rows[0]) == ["Epoch", "Step", "Train Loss", "VRAM Usage (GB)", "Time/Step (s)"]
    assert len(rows) == 1 and rows[0]["VRAM Usage (GB)"] is None
    md = to_markdown(rows)
    assert md.splitlines()[0].startswith("| Epoch | Step") and "—" in md


def test_flags_vram_spikes_and_rising_loss():
    calm = [step(i, loss=2.0 - i * 0.1) for i in range(1, 13)]
    assert flag_problems(calm) == []
    hot = calm[:5] + [step(6, vram=3.6)] + calm[6:]  # under a GTX 1650's 3.81 GiB, over its 3.46 GiB budget
    assert any("VRAM above 3.46 GiB on 1 step" in f and "step 6" in f for f in flag_problems(hot))
    assert flag_problems(hot, vram_warn_gib=3.7) == []
    spiky = calm[:7] + [step(8, step_s=5.0)] + calm[8:]
    assert any("over 2x the median" in f and "steps 8" in f for f in flag_problems(spiky))
    rising = [step(i, loss=1.0 + i * 0.1) for i in range(1, 10)]
    assert any("lower learning_rate" in f for f in flag_problems(rising))


def test_plots_are_shown_once_and_list_every_run():
    """Figures stay out of pyplot (a notebook showed each one twice: by the backend and as the cell's value); the
    legend names runs that only have eval or memory points; steps get whole-number ticks."""
    import matplotlib.pyplot as plt

    from nb_helpers.ui.plots import plot_training

    before = plt.get_fignums()
    runs = {"trained": [{"step": s, "loss": 1.0 / s, "step_s": 1.0} for s in (1, 2, 3)],
            "eval only": [{"step": 0, "eval_loss": 0.9}, {"step": 3, "eval_loss": 0.5}]}
    fig = plot_training(runs)
    assert plt.get_fignums() == before
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["trained", "eval only"]
    ticks = fig.axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)


def test_step_time_drift_is_flagged_and_steady_runs_are_not():
    """A run whose steps slowed from 350 s to 469 s (+34%) was called "steady"; now it is named."""
    from nb_helpers.ui.analysis import flag_problems

    def run(times):
        return [{"step": i + 1, "loss": 1.0 - 0.01 * i, "step_s": t} for i, t in enumerate(times)]

    rising = flag_problems(run([350.0] * 6 + [400.0] * 3 + [469.0] * 6))
    assert any("step time rose 34%" in f for f in rising), rising
    assert not any("rose" in f for f in flag_problems(run([350.0, 352.0, 349.0] * 5)))


def test_a_run_slow_for_most_of_its_steps_is_flagged_as_uneven():
    """Seen in the browser: an r=8 run on a busy machine ran 5.2-58.4 s a step (median 42.5 s), an r=16 run 5.3 s;
    spikes (against the median) and drift (first third against last) both missed it, and 04 compared the two."""
    from nb_helpers.ui.analysis import step_time_range, uneven_steps

    times = [9.0, 5.2, 5.3, 41.0, 42.5, 44.0, 58.4, 42.0, 43.0, 42.5, 41.5, 43.5]
    busy = [{"step": i + 1, "loss": 1.0 - 0.01 * i, "step_s": t} for i, t in enumerate(times)]
    flags = flag_problems(busy)
    assert any("step times ranged 5.20-58.40 s" in f and "busy" in f for f in flags), flags
    assert step_time_range(busy)[0] == 5.2  # the table's fastest step: the first step (allocation) is not counted
    idle = [{**r, "step_s": 5.3 + 0.1 * (i % 3)} for i, r in enumerate(busy)]
    assert uneven_steps(idle) is None and flag_problems(idle) == []


def test_a_run_still_training_is_not_called_older_than_the_planner():
    from nb_helpers.ui.analysis import predicted_vs_measured_report

    assert "still training" in predicted_vs_measured_report({})
    assert "before the planner existed" not in predicted_vs_measured_report({})
    assert "could not read" in predicted_vs_measured_report({"status": "completed"})


def test_a_plot_of_one_step_has_whole_number_ticks_and_a_slow_run_redraws_between_every_steps(monkeypatch):
    """After an interrupt at step 1 the live plot showed fractional step ticks, and with `every=5` it stayed at
    step 1 while slow CPU steps went on."""
    import time

    from nb_helpers.ui import plots

    fig = plots.plot_training({"one step": [{"step": 1, "loss": 0.9, "step_s": 6.0}]})
    ticks = [t for t in fig.axes[0].get_xticks() if fig.axes[0].get_xlim()[0] <= t <= fig.axes[0].get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda fig, display_id=None: shown.append(fig) or
                        type("Handle", (), {"update": lambda self, f: shown.append(f)})())
    live = plots.LivePlot(every=5)
    clock = iter(range(0, 1000, 30))  # each step 30 s apart: past REDRAW_S
    monkeypatch.setattr(time, "monotonic", lambda: float(next(clock)))
    for step_number in (1, 2, 3):
        live({"step": step_number, "loss": 1.0 / step_number, "step_s": 30.0})
    assert len(shown) == 3  # every slow step redrawn, though `every` is 5
