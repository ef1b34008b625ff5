"""nb_helpers.step_overlap: the next batch collated by a worker process, and the token count kept on the device."""

import multiprocessing
from types import SimpleNamespace

import pytest

from nb_helpers import fastpath, step_overlap
from nb_helpers.fastpath import FastOptions


def _model(**levers):
    return SimpleNamespace(_nb_fast=FastOptions(**levers))


def test_one_persistent_worker_only_on_cuda_where_processes_fork(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(fastpath, "_SAID", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert step_overlap.loader_args(_model()) == {"dataloader_num_workers": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "fork")
    assert step_overlap.loader_args(_model()) == {"dataloader_num_workers": 1, "dataloader_persistent_workers": True,
                                                  "dataloader_prefetch_factor": 2}
    assert step_overlap.loader_args(_model(loader_worker=False)) == {"dataloader_num_workers": 0}
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    assert step_overlap.loader_args(_model()) == {"dataloader_num_workers": 0}
    step_overlap.loader_args(_model())
    assert capsys.readouterr().out.count("processes start by 'spawn' here") == 1


def test_a_forked_workers_verdict_on_padding_reaches_the_training_process(tiny_cfg, capsys, monkeypatch):
    """The collator's check (is this batch right-padded?) runs in the DataLoader's worker; the decoder that drops
    the mask lives here. The verdict travels through shared memory and arrives no later than the batch it judged
    (the worker collates ahead, so masks may be kept a batch sooner than needed: safe, same math)."""
    import torch
    from torch.utils.data import DataLoader

    from nb_helpers.models import ModelChoice, load_4bit
    from nb_helpers.training import attach_lora

    monkeypatch.setattr(fastpath, "_SAID", set())
    model = attach_lora(load_4bit(tiny_cfg, ModelChoice(tiny_cfg.model, "tiny", "test")), tiny_cfg,
                        fast=FastOptions(lean=False, kernels=False, nomask=True))
    ids = torch.randint(3, 200, (2, 6))
    right = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])}
    left = {"input_ids": ids, "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])}
    batches = [right, left]
    collate = fastpath.guard_collator(lambda indices: batches[indices[0]], model)
    loader = DataLoader(range(2), batch_size=1, collate_fn=collate, num_workers=1, multiprocessing_context="fork")
    decoder = fastpath._decoder(model)
    assert fastpath.mask_drop_on(decoder)
    firsts = []
    for batch in loader:
        firsts.append(int(batch["attention_mask"][0, 0]))
        if firsts[-1] == 0:  # the left-padded batch: its verdict came first
            assert not fastpath.mask_drop_on(decoder)
    assert firsts == [1, 0]
    assert fastpath.MASKS_KEPT not in capsys.readouterr().out  # the worker does not print it
    model.train()
    model(**left)
    model(**left)
    assert capsys.readouterr().out.count(fastpath.MASKS_KEPT) == 1  # this process says it, once


def _trainer(include="non_padding", world_size=1, pad_token_id=0):
    track = lambda inputs: None  # noqa: E731 - the Trainer's own per-micro-batch count, replaced
    return SimpleNamespace(args=SimpleNamespace(include_num_input_tokens_seen=include, world_size=world_size),
                           _track_num_input_tokens=track, processing_class=SimpleNamespace(pad_token_id=pad_token_id),
                           model=SimpleNamespace(main_input_name="input_ids"),
                           callback_handler=SimpleNamespace(callbacks=["flow", "metrics"]))


@pytest.mark.parametrize("batch", [
    {"input_ids": [[5, 6, 7, 0], [8, 0, 0, 0]], "attention_mask": [[1, 1, 1, 0], [1, 0, 0, 0]]},
    {"input_ids": [[5, 6, 7, 0], [8, 0, 0, 0]]},  # no mask: the pad token decides
])
def test_the_token_count_on_device_equals_the_trainers_own(batch):
    """Same numbers as transformers' Trainer._track_num_input_tokens (called here on the same stand-in trainer),
    added up over a step's micro-batches and folded in at the step's end."""
    import torch
    from transformers import Trainer

    inputs = {k: torch.tensor(v) for k, v in batch.items()}
    trainer = _trainer()
    trainer.state = SimpleNamespace(num_input_tokens_seen=0)
    trainer.accelerator = SimpleNamespace(gather=lambda t: t)
    trainer.args.device = torch.device("cpu")
    for _ in range(3):
        Trainer._track_num_input_tokens(trainer, inputs)
    counter = step_overlap.count_tokens_on_device(trainer)
    assert trainer.callback_handler.callbacks[0] is counter and trainer._track_num_input_tokens == counter.add
    state = SimpleNamespace(num_input_tokens_seen=0)
    for _ in range(3):
        trainer._track_num_input_tokens(inputs)
    assert state.num_input_tokens_seen == 0  # nothing read from the device before the step ends
    counter.on_step_end(None, state, None)
    counter.on_step_end(None, state, None)  # a step with nothing pending adds nothing
    assert state.num_input_tokens_seen == trainer.state.num_input_tokens_seen == 12


@pytest.mark.parametrize("changes", [{"include": "no"}, {"include": "all"}, {"world_size": 2}])
def test_the_trainers_own_count_stays_where_it_differs(changes):
    trainer = _trainer(**changes)
    own = trainer._track_num_input_tokens
    assert step_overlap.count_tokens_on_device(trainer) is None
    assert trainer._track_num_input_tokens is own and trainer.callback_handler.callbacks == ["flow", "metrics"]


def test_a_run_counts_the_same_tokens_with_the_count_on_the_device(shared_run, monkeypatch):
    """train() with the lever on (a GPU default; asked for here on the CPU) writes the same tokens per step into
    metrics.jsonl as the shared run, which used the Trainer's own count: the folded count arrives before the metrics
    callback reads it."""
    from nb_helpers.metrics import read_metrics
    from nb_helpers.training import train

    cfg, run_dir = shared_run
    monkeypatch.setenv(fastpath.ENV_VAR, "async_tokens=1")
    again = train(cfg.replace(runs_dir=str(run_dir.parent.parent / "runs-async")), verbose=False)
    tokens = lambda d: [r["tokens"] for r in read_metrics(d / "metrics.jsonl") if "tokens" in r]  # noqa: E731
    assert len(tokens(again)) == cfg.max_steps and all(t > 0 for t in tokens(again))
    assert tokens(again) == tokens(run_dir)


@pytest.mark.gpu
def test_the_gpu_defaults_train_as_the_plain_loader_and_count_do(tiny_cfg, monkeypatch):
    """On CUDA both levers are on by default: a worker process collates, the count stays on the device. The same
    run with both off gives the same losses and tokens, step for step."""
    from nb_helpers.metrics import read_metrics
    from nb_helpers.training import train

    def steps(levers: str, name: str):
        monkeypatch.setenv(fastpath.ENV_VAR, levers)
        run_dir = train(tiny_cfg.replace(run_name=name, task_eval_samples=0), verbose=False)
        return [(r["loss"], r["tokens"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]

    on = steps("", "overlap-on")
    assert on and on == steps("loader_worker=0,async_tokens=0", "overlap-off")
