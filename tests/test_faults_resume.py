"""A resume continues the run it resumes, exactly, whatever stopped it and wherever: a checkpoint damaged inside a
whole file, a stop after the last step, a stop during an evaluation or outside training (loading, scoring). Each
interrupted-and-resumed run is compared with one uninterrupted run of the same config on the tiny model of
conftest.py (16 rows at 4 a step: 4 steps an epoch, so a resume from step 3 crosses an epoch boundary)."""

import json
import os
import random
import shutil
import signal

import pytest

from nb_helpers.config import RunConfig


class Killed(Exception):
    """Stands in for kill -9: training stops at once and finish_run never runs."""


def raise_at(step, error):
    def listener(record):
        if record.get("step") == step and "loss" in record:
            raise error
    return listener


def exact_config(make_tiny_config, model_dir, runs_dir, **changes):
    """6 steps over 16 rows (two epochs: the second ends early), checkpoints every 3, dropout on (RNG matters)."""
    knobs = dict(max_steps=6, save_steps=3, task_eval_samples=0, eval_steps=0, lora_dropout=0.1)
    return make_tiny_config(model_dir, runs_dir).replace(**{**knobs, **changes})


def trained(run_dir):
    """Every training line's (step, loss, grad_norm, lr), in file order."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in lines if "loss" in r]


def adapter_tensors(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def newest_run(cfg):
    return (cfg.resolve_path(cfg.runs_dir) / "latest").resolve()


def copy_run(run_dir, tmp_path):
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


@pytest.fixture
def sigterm_unhandled_fails():
    """Without the run's handler SIGTERM would end pytest itself: make that a failure instead."""
    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the previous handler: the run did not handle it")

    before = signal.signal(signal.SIGTERM, unhandled)
    yield unhandled
    signal.signal(signal.SIGTERM, before)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory, make_tiny_config):
    from nb_helpers.training import train

    return train(exact_config(make_tiny_config, tiny_model_dir, tmp_path_factory.mktemp("whole") / "runs"),
                 verbose=False)


@pytest.fixture(scope="module")
def ctrl_c_at_4(tiny_model_dir, tmp_path_factory, make_tiny_config):
    """Ctrl-C at step 4: checkpoint-3 (periodic) and checkpoint-4 (written on the interrupt)."""
    from nb_helpers.training import train

    cfg = exact_config(make_tiny_config, tiny_model_dir, tmp_path_factory.mktemp("ctrl-c") / "runs")
    run_dir = train(cfg, listeners=[raise_at(4, KeyboardInterrupt())], verbose=False)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-3", "checkpoint-4"]
    return run_dir


# --- 5. resume is bit-exact on the CPU ---------------------------------------------------------------------------

def test_a_resumed_run_matches_the_uninterrupted_one_bit_for_bit(uninterrupted, ctrl_c_at_4, tmp_path, capsys):
    """peft's load_adapter cast the bf16 adapter to fp32 on resume: every resumed loss differed from the first
    resumed step on. Losses, gradient norms, learning rates and the final adapter are now identical."""
    import torch

    from nb_helpers.training import train

    run_dir = copy_run(ctrl_c_at_4, tmp_path)
    train(RunConfig(), resume_from=run_dir, verbose=False)
    assert "from checkpoint-4" in capsys.readouterr().out
    assert [s for s, *_ in trained(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert trained(run_dir) == trained(uninterrupted)
    whole, resumed = adapter_tensors(uninterrupted), adapter_tensors(run_dir)
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) and whole[k].dtype == resumed[k].dtype for k in whole)


def test_a_killed_run_resumed_across_an_epoch_boundary_is_exact(uninterrupted, tiny_model_dir, tmp_path,
                                                                make_tiny_config):
    from nb_helpers.training import train

    cfg = exact_config(make_tiny_config, tiny_model_dir, tmp_path / "runs")
    with pytest.raises(Killed):
        train(cfg, listeners=[raise_at(5, Killed())], verbose=False)  # after checkpoint-3, before finish_run
    run_dir = newest_run(cfg)
    train(RunConfig(), resume_from=run_dir, verbose=False)
    assert trained(run_dir) == trained(uninterrupted)


# --- 1. a checkpoint damaged inside a whole file -----------------------------------------------------------------

def test_a_checkpoint_damaged_inside_a_whole_file_is_skipped_and_the_one_before_resumes(uninterrupted, ctrl_c_at_4,
                                                                                       tmp_path, capsys):
    """4 KiB of garbage in the middle of the newest optimizer.pt: the zip directory is intact, so only reading every
    record finds it. The resume names it and continues from checkpoint-3; every step is in metrics.jsonl once."""
    from nb_helpers.faults.checkpoints import checkpoint_problem
    from nb_helpers.training import train

    run_dir = copy_run(ctrl_c_at_4, tmp_path)
    damaged = run_dir / "checkpoints" / "checkpoint-4"
    data = bytearray((damaged / "optimizer.pt").read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = random.Random(0).randbytes(4096)
    (damaged / "optimizer.pt").write_bytes(bytes(data[:len(data)]))
    problem = checkpoint_problem(damaged)
    assert problem is not None and problem.startswith("optimizer.pt is damaged: its record ")
    assert problem.endswith("fails its CRC check")

    train(RunConfig(), resume_from=run_dir, verbose=False)
    out = capsys.readouterr().out
    assert f"skipping checkpoint-4: {problem}; moved to checkpoints/incomplete/" in out and "from checkpoint-3" in out
    assert [s for s, *_ in trained(run_dir)] == [1, 2, 3, 4, 5, 6]  # step 4 again, once: the old line set aside
    assert trained(run_dir) == trained(uninterrupted)


@pytest.mark.parametrize("name, garbage", [("adapter_model.safetensors", b"\x00" * 8),
                                           ("scheduler.pt", b"PK\x03\x04 not an archive")])
def test_every_file_a_resume_reads_is_checked_whole(ctrl_c_at_4, tmp_path, name, garbage):
    from nb_helpers.faults.checkpoints import checkpoint_problem

    folder = copy_run(ctrl_c_at_4, tmp_path) / "checkpoints" / "checkpoint-4"
    (folder / name).write_bytes(garbage)
    assert checkpoint_problem(folder).startswith(f"{name} is cut short or damaged (")
    (folder / name).unlink()
    assert checkpoint_problem(folder) == f"{name} is missing"


# --- 2. a run whose training finished resumes as finished ---------------------------------------------------------

def test_a_stop_during_the_final_scoring_resumes_as_finished(tiny_model_dir, tmp_path, make_tiny_config, monkeypatch,
                                                             capsys, sigterm_unhandled_fails):
    """SIGTERM while the tuned model is scored: the summary says interrupted, the lock is let go, the process exits
    143. The resume trains no step (the Trainer went on to step 6 of 5), scores and writes the summary."""
    from nb_helpers import training

    real = training.evaluate_task

    def sigterm_when_scoring_the_tuned_model(*args, label="", **kwargs):
        if "tuned" in label:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, label=label, **kwargs)

    cfg = exact_config(make_tiny_config, tiny_model_dir, tmp_path / "runs", max_steps=5, task_eval_samples=2)
    monkeypatch.setattr(training, "evaluate_task", sigterm_when_scoring_the_tuned_model)
    with pytest.raises(SystemExit) as stopped:
        training.train(cfg, verbose=False)
    assert stopped.value.code == 143
    run_dir = newest_run(cfg)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 5 and not (run_dir / "run.lock").exists()
    assert "stopped outside training" in capsys.readouterr().out

    monkeypatch.setattr(training, "evaluate_task", real)
    training.train(RunConfig(), resume_from=run_dir, verbose=True)
    out = capsys.readouterr().out
    assert "checkpoint-5 is this run's last step: training had finished before the stop" in out
    assert "step 6" not in out and not (run_dir / "checkpoints" / "checkpoint-6").exists()
    assert [s for s, *_ in trained(run_dir)] == [1, 2, 3, 4, 5]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 5 and summary["task_tuned"] is not None
    evals = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line]
    assert evals == sorted(set(evals)), evals  # the final evaluation once


# --- 3. one signal handler for the whole run ---------------------------------------------------------------------

def test_sigterm_while_scoring_the_base_model_leaves_no_empty_run_behind(tiny_model_dir, tmp_path, make_tiny_config,
                                                                        monkeypatch, capsys,
                                                                        sigterm_unhandled_fails):
    from nb_helpers import training
    from nb_helpers.runs import mark_latest

    cfg = exact_config(make_tiny_config, tiny_model_dir, tmp_path / "runs", task_eval_samples=2)
    older = tmp_path / "runs" / "older"
    older.mkdir(parents=True)
    (older / "config.json").write_text("{}")
    mark_latest(older)
    monkeypatch.setattr(training, "evaluate_task", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit) as stopped:
        training.train(cfg, verbose=False)
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is sigterm_unhandled_fails  # put back
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["latest", "older"]  # no folder of config.json only
    assert (tmp_path / "runs" / "latest").resolve() == older.resolve()
    out = capsys.readouterr().out
    assert "stopped before the first step: nothing was trained" in out and "runs/latest names older again" in out


def test_ctrl_c_while_resuming_lets_go_of_the_lock(ctrl_c_at_4, tmp_path, monkeypatch, capsys):
    from nb_helpers import training

    run_dir = copy_run(ctrl_c_at_4, tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "load_4bit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        training.train(RunConfig(), resume_from=run_dir, verbose=False)
    assert not (run_dir / "run.lock").exists()
    assert "stopped before the run folder was opened" in capsys.readouterr().out


# --- 4. an evaluation cut short is run again ---------------------------------------------------------------------

def test_an_evaluation_cut_short_by_a_stop_runs_first_on_resume(tiny_model_dir, tmp_path, make_tiny_config,
                                                                monkeypatch, capsys):
    from trl import SFTTrainer

    from nb_helpers.training import train

    real = SFTTrainer.evaluate
    stops = []

    def ctrl_c_in_the_evaluation_at_4(self, *args, **kwargs):
        if self.state.global_step == 4 and not stops:
            stops.append(4)
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SFTTrainer, "evaluate", ctrl_c_in_the_evaluation_at_4)
    cfg = exact_config(make_tiny_config, tiny_model_dir, tmp_path / "runs", eval_steps=2)
    run_dir = train(cfg, verbose=False)
    assert stops == [4] and json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    train(RunConfig(), resume_from=run_dir, verbose=False)
    assert "the evaluation at step 4 was cut short by the stop: it runs first" in capsys.readouterr().out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 2, 4, 6]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]


# --- 8, 9. notebook 03's training cell run again after Kernel -> Interrupt -----------------------------------------

def notebook_run(cfg, listeners=()):
    """Notebook 03's cells up to the training cell, as it calls them (build_trainer is its SFTTrainer(...) cell)."""
    from nb_helpers.training import build_trainer, evaluate_before, load_for_training, open_run_folder, prepare_run

    run = prepare_run(cfg, verbose=False)
    load_for_training(run, verbose=False)
    open_run_folder(run, listeners=listeners, verbose=False)
    trainer = build_trainer(run)
    evaluate_before(run, trainer, verbose=False)
    return run, trainer


def training_cell(run, trainer):
    from nb_helpers.training import guard_training

    with guard_training(run, trainer):
        trainer.train(resume_from_checkpoint=run.checkpoint)


def interrupt_once_at(step):
    def listener(record):
        if record.get("step") == step and "loss" in record and not listener.done:
            listener.done = True
            raise KeyboardInterrupt  # what Kernel -> Interrupt raises in the cell
    listener.done = False
    return listener


@pytest.mark.parametrize("later_cells_ran", [False, True], ids=["cell-again", "after-later-cells"])
def test_the_training_cell_run_again_after_an_interrupt_continues_the_run(uninterrupted, tiny_model_dir, tmp_path,
                                                                          make_tiny_config, capsys, later_cells_ran):
    """It restarted at step 1 from the trained weights and metrics.jsonl held 1, 2, 3, 4, 1, 2, ...; after the later
    cells it called the run finished. Now it continues from the interrupt's checkpoint: every step once, and the same
    losses as an uninterrupted run."""
    from nb_helpers.training import finish_run

    cfg = exact_config(make_tiny_config, tiny_model_dir, tmp_path / "runs")
    run, trainer = notebook_run(cfg, listeners=[interrupt_once_at(4)])
    training_cell(run, trainer)
    assert run.summary["status"] == "interrupted"
    if later_cells_ran:
        finish_run(run, trainer, verbose=False)
        assert not (run.run_dir / "run.lock").exists()
    capsys.readouterr()
    training_cell(run, trainer)
    out = capsys.readouterr().out
    assert "continuing this run from checkpoint-4, where it was interrupted" in out and "is finished" not in out
    finish_run(run, trainer, verbose=False)
    assert json.loads((run.run_dir / "summary.json").read_text())["status"] == "completed"
    assert [s for s, *_ in trained(run.run_dir)] == [1, 2, 3, 4, 5, 6]
    assert trained(run.run_dir) == trained(uninterrupted)


def test_the_training_cell_run_again_after_training_ended_is_refused(tiny_model_dir, tmp_path, make_tiny_config):
    cfg = exact_config(make_tiny_config, tiny_model_dir, tmp_path / "runs", max_steps=2)
    run, trainer = notebook_run(cfg)
    training_cell(run, trainer)
    with pytest.raises(RuntimeError, match="this run's training already ran .* Run the next cell"):
        training_cell(run, trainer)
    assert [s for s, *_ in trained(run.run_dir)] == [1, 2]
