"""Lever loader_worker (nb_helpers.fast.loader_args): one DataLoader worker collates the next batch while the GPU
trains. It runs on CUDA under Linux only; here, on a CPU, a run is forced through a forked worker to check that the
course's data and collator survive it, that it trains the very same steps, and that an interrupted run still keeps
its checkpoint, adapter and summary."""

import json
import sys
from types import SimpleNamespace

import pytest

from nb_helpers import fast
from nb_helpers.fast.options import FastOptions
from nb_helpers.metrics import read_metrics
from nb_helpers.training import train


def test_one_worker_on_cuda_under_linux_and_none_elsewhere(monkeypatch):
    import torch

    model = SimpleNamespace(_nb_fast=FastOptions(loader_worker=True))
    assert fast.loader_args(model) == {"dataloader_num_workers": 0, "dataloader_persistent_workers": False}  # no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "platform", "linux")
    assert fast.loader_args(model) == {"dataloader_num_workers": 1, "dataloader_persistent_workers": True}
    assert fast.loader_args(SimpleNamespace(_nb_fast=FastOptions(loader_worker=False)))["dataloader_num_workers"] == 0
    monkeypatch.setattr(sys, "platform", "win32")  # spawned workers: a notebook's objects may not survive pickling
    assert fast.loader_args(model)["dataloader_num_workers"] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lever forks its worker: Linux only")
def test_a_run_through_a_forked_worker_trains_the_same_steps_and_keeps_an_interrupted_run(tiny_cfg, monkeypatch):
    def stop_at_step_3(record):
        if record.get("step") == 3 and "loss" in record:
            raise KeyboardInterrupt

    cfg = tiny_cfg.replace(task_eval_samples=0, max_steps=4)
    main = train(cfg.replace(run_name="main-process"), listeners=[stop_at_step_3], verbose=False)
    from torch.utils.data import dataloader

    started = []
    real_init = dataloader._MultiProcessingDataLoaderIter.__init__

    def counting_init(self, loader):
        started.append(loader.num_workers)
        real_init(self, loader)

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "__init__", counting_init)
    workers = {"dataloader_num_workers": 1, "dataloader_persistent_workers": True}
    monkeypatch.setattr(fast, "loader_args", lambda model: workers)
    worker = train(cfg.replace(run_name="worker"), listeners=[stop_at_step_3], verbose=False)
    losses = [[r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] for run in (main, worker)]
    assert started and set(started) == {1}  # the batches came from one worker process
    assert len(losses[1]) == 3 and losses[0] == losses[1]
    assert json.loads((worker / "summary.json").read_text())["status"] == "interrupted"
    assert (worker / "adapter" / "adapter_model.safetensors").exists()
    assert json.loads((worker / "config.json").read_text())["fast_levers"] == {}  # what ran on a CPU: no lever
