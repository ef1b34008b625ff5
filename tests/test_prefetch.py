"""Lever prefetch (nb_helpers.fast.prefetch): one DataLoader worker collates the next batches while the GPU trains. On
by default on a CUDA GPU under Linux; NB_FASTPATH=prefetch=1 turns it on here too, so its CPU half is tested on every
machine: the same steps as without it, SIGTERM still handled by the main process, and off elsewhere with one line."""

import json
import multiprocessing
import os
import signal
import time

import pytest


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_a_worker_collating_ahead_trains_the_same_steps(tiny_cfg, no_gpu, monkeypatch):
    from nb_helpers.training import train

    without = train(tiny_cfg.replace(task_eval_samples=0), verbose=False)
    monkeypatch.setenv("NB_FASTPATH", "prefetch=1")
    seen = []
    run_dir = train(tiny_cfg.replace(task_eval_samples=0),
                    listeners=[lambda r: seen.append(len(multiprocessing.active_children()))], verbose=False)
    assert max(seen) >= 1, "no DataLoader worker ran"
    assert losses(run_dir) == losses(without)  # the same batches in the same order: the same steps


def test_sigterm_to_the_worker_and_the_process_ends_the_run_as_ctrl_c_does(tiny_cfg, no_gpu, monkeypatch, capfd):
    """`kill -TERM -PGID` (systemd, a batch scheduler) reaches the worker too; it must leave the signal to the main
    process, which saves a checkpoint and the summary, and says so once."""
    from nb_helpers.recovery import last_checkpoint
    from nb_helpers.training import train

    monkeypatch.setenv("NB_FASTPATH", "prefetch=1")

    def sigterm_at_2(record):
        if record.get("step") == 2 and "loss" in record:
            workers = multiprocessing.active_children()
            assert workers, "no DataLoader worker to signal"
            for worker in workers:
                os.kill(worker.pid, signal.SIGTERM)
            time.sleep(0.5)  # a worker that dies of it has died by now, and torch has seen it
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as exit_:
        train(tiny_cfg.replace(max_steps=5, save_steps=50, task_eval_samples=0), listeners=[sigterm_at_2],
              verbose=False)
    assert exit_.value.code == 143
    run_dir = (tiny_cfg.resolve_path(tiny_cfg.runs_dir) / "latest").resolve()
    assert last_checkpoint(run_dir).name == "checkpoint-2"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert capfd.readouterr().out.count("SIGTERM received") == 1  # the main process's line; the worker's output too


def test_off_the_linux_it_needs_one_line_says_so(monkeypatch, capsys):
    from nb_helpers import frontend
    from nb_helpers.fast import prefetch
    from nb_helpers.fast.options import FastOptions

    class Model:
        _nb_fast = FastOptions.from_env(prefetch=True)

    assert prefetch.loader_args(Model()) == {"dataloader_num_workers": 1, "dataloader_prefetch_factor": 2}
    monkeypatch.setattr(frontend, "_SAID", set())
    monkeypatch.setattr(prefetch.sys, "platform", "win32")
    assert prefetch.loader_args(Model()) == {}
    assert prefetch.loader_args(Model()) == {}
    assert capsys.readouterr().out.count("prefetch off: DataLoader workers are forked on Linux only") == 1
    Model._nb_fast = FastOptions.from_env(prefetch=False)
    assert prefetch.loader_args(Model()) == {} and prefetch.loader_args(None) == {}


def test_on_a_gpu_only_graphed_layers_collate_in_a_worker(monkeypatch, capsys):
    """Graphed steps leave the GPU idle at their edges, which the worker fills; eager ones are bound by the training
    process's launches, where the worker measured no faster (call 59), so they collate in the training process."""
    import torch

    from nb_helpers import frontend
    from nb_helpers.fast import prefetch
    from nb_helpers.fast.options import FastOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(frontend, "_SAID", set())

    class Model:
        _nb_fast = FastOptions.from_env(prefetch=True, graphs=True, reentrant=True)
        _nb_use_graphs = True

    assert prefetch.loader_args(Model(), checkpointing=True)["dataloader_num_workers"] == 1
    assert prefetch.loader_args(Model(), checkpointing=False) == {}  # no checkpoints: nothing is graphed
    Model._nb_use_graphs = False  # auto-fit chose eager layers (8 x 2048 under 4 GiB)
    assert prefetch.loader_args(Model(), checkpointing=True) == {}
    assert capsys.readouterr().out.count("prefetch off: the layers run eagerly") == 1


def test_a_wrapped_worker_leaves_on_sigterm_with_status_0_and_ignores_ctrl_c():
    """torch reports a worker killed by a signal in the main process, at once, wherever that process is; one that
    leaves with status 0 it does not. With the collator as the Trainer has it, unwrapped, this worker dies of SIGTERM."""
    import torch
    from torch.utils.data import DataLoader

    from nb_helpers.fast.prefetch import signals_to_main

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a worker forked outside training has it
    try:
        loader = DataLoader(list(range(64)), batch_size=2, num_workers=1, collate_fn=signals_to_main(torch.tensor))
        batches = iter(loader)
        next(batches)
        worker = batches._workers[0]
        os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.3)
        assert worker.is_alive()  # Ctrl-C is the main process's to handle
        os.kill(worker.pid, signal.SIGTERM)
        worker.join(timeout=10)
        assert worker.exitcode == 0
        del batches
    finally:
        signal.signal(signal.SIGTERM, before)
