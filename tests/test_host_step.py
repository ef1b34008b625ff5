"""The host's share of each batch (nb_helpers.fast.host_step): rows read as numpy arrays make the same batches, and
metrics.jsonl counts tokens from SFTTrainer's own count, whoever else counts."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from nb_helpers import fast as fastpath


def built(tiny_cfg, monkeypatch, levers: str, steps: int, runs: str | None = None):
    """(run, trainer) for `steps` steps on the tiny model with NB_FASTPATH=`levers` (it reaches the levers' CPU
    halves), in the runs folder `runs` below the tiny config's, if given."""
    from nb_helpers import training

    monkeypatch.setenv(fastpath.ENV_VAR, levers)
    cfg = tiny_cfg.replace(max_steps=steps, task_eval_samples=0, eval_steps=0)
    if runs is not None:
        cfg = cfg.replace(runs_dir=str(Path(tiny_cfg.runs_dir) / runs))
    run = training.prepare_run(cfg, None, False)
    training.load_for_training(run, False)
    training.open_run_folder(run, (), False)
    return run, training.build_trainer(run)


@pytest.fixture
def trained(tiny_cfg, monkeypatch):
    """Two steps on the tiny model with the rows read as arrays, the Trainer counting tokens too; the trainer and its
    run folder."""
    from nb_helpers import training

    run, trainer = built(tiny_cfg, monkeypatch, "array_rows=1,one_token_count=0", 2)
    with training.guard_training(run, trainer):
        trainer.train()
    training.finish_run(run, trainer, False)
    return trainer, run.run_dir


def test_rows_read_as_arrays_make_the_same_batches(trained):
    import torch

    trainer = trained[0]
    rows = trainer.train_dataset
    assert rows.format["type"] == "numpy" and set(rows.format["columns"]) == {"input_ids", "labels"}
    assert isinstance(rows[0]["prompt"], list)  # the chat columns stay Python objects
    as_lists = rows.with_format(None)
    indices = list(range(min(len(rows), 5)))
    arrays, lists = (trainer.data_collator(d.__getitems__(indices)) for d in (rows, as_lists))
    assert set(arrays) == set(lists) >= {"input_ids", "labels", "attention_mask"}
    for key, tensor in lists.items():
        assert arrays[key].dtype == tensor.dtype and torch.equal(arrays[key], tensor), key


def test_metrics_count_the_tokens_the_trainer_counts(trained):
    from nb_helpers.metrics import read_metrics

    trainer, run_dir = trained
    assert trainer.args.include_num_input_tokens_seen == "non_padding"
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(r["tokens"] > 0 for r in steps)
    assert sum(r["tokens"] for r in steps) == trainer.state.num_input_tokens_seen  # TRL's count is the Trainer's


def test_one_token_count_leaves_the_trainer_out(tiny_cfg, monkeypatch, tmp_path):
    from nb_helpers.lora import attach_lora
    from nb_helpers.models import ModelChoice, load_4bit
    from nb_helpers.trainer_setup import sft_config
    from nb_helpers.training import TrainingRun

    for lever, expected in (("1", "no"), ("0", "non_padding")):
        monkeypatch.setenv(fastpath.ENV_VAR, f"one_token_count={lever}")
        model = attach_lora(load_4bit(tiny_cfg, ModelChoice(tiny_cfg.model, "tiny", "test")), tiny_cfg)
        run = TrainingRun(tiny_cfg, model=model, run_dir=tmp_path)
        assert sft_config(run).include_num_input_tokens_seen == expected


def test_a_line_per_window_and_a_new_trainers_count(tmp_path):
    from nb_helpers.metrics import MetricsCallback

    callback = MetricsCallback(tmp_path / "metrics.jsonl", write=False)
    state, control = SimpleNamespace(global_step=0, epoch=0.0), SimpleNamespace(should_training_stop=False)
    callback.on_train_begin(None, state, control)

    def step(count, log=True):
        state.global_step += 1
        callback.on_step_end(None, state, control)
        if log:
            callback.on_log(None, state, control, logs={"loss": 1.0, "grad_norm": 0.1, "num_tokens": float(count)})

    step(300)
    step(700)
    step(0, log=False)
    step(1300)  # logging every 2 steps from here: the line stands for both
    step(50)  # a new trainer's count starts again at 0
    assert [r["tokens"] for r in callback.records] == [300, 400, 300, 50]
    assert all(r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
               for r in callback.records)


def test_the_mode_walk_runs_only_on_a_change(tiny_cfg, monkeypatch):
    import copy

    import torch

    from nb_helpers.fast.host_step import walk_modes_on_change
    from nb_helpers.lora import attach_lora
    from nb_helpers.models import ModelChoice, load_4bit

    model = attach_lora(load_4bit(tiny_cfg, ModelChoice(tiny_cfg.model, "tiny", "test")), tiny_cfg)
    walk_modes_on_change(model)
    walks = []
    module_train = torch.nn.Module.train
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: walks.append(self) or module_train(self, mode))
    modes = lambda m: {sub.training for sub in m.modules()}
    walked = lambda: sum(w is model for w in walks)  # walks started at the top
    model.train()
    assert walked() == 1 and len(walks) == len(list(model.modules())) and modes(model) == {True}
    model.train()
    assert walked() == 1  # nothing changed: no walk
    model.eval()
    assert walked() == 2 and modes(model) == {False}
    model.train()
    model.get_base_model().eval()  # a submodule switched on its own: the sentinels show it
    model.train()
    assert walked() == 4 and modes(model) == {True}
    twin = copy.deepcopy(model)
    twin.eval()
    assert modes(twin) == {False} and modes(model) == {True}  # the copy's method is bound to the copy


def test_trainable_grads_zero_and_clip_what_trains_with_the_same_numbers(tiny_cfg, monkeypatch):
    """Lever trainable_grads: two steps with it and without, from the same seed, log the same losses and gradient
    norms; with it the Trainer's zero_grad and clipping walk no module, and zero_grad keeps Module.zero_grad's
    in-place form."""
    import torch

    from nb_helpers import training
    from nb_helpers.metrics import read_metrics

    def two_steps(lever: str, runs: str):
        run, trainer = built(tiny_cfg, monkeypatch, f"trainable_grads={lever}", 2, runs)
        walks = []
        named_modules = torch.nn.Module.named_modules

        def counted(self, *args, **kwargs):
            if self is run.model:
                walks.append(self)
            return named_modules(self, *args, **kwargs)

        monkeypatch.setattr(torch.nn.Module, "named_modules", counted)
        with training.guard_training(run, trainer):
            trainer.train()
        monkeypatch.setattr(torch.nn.Module, "named_modules", named_modules)
        training.finish_run(run, trainer, False)
        steps = [(r["loss"], r["grad_norm"]) for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r]
        return steps, len(walks), run.model

    without, walks_without, _ = two_steps("0", "without")
    with_lever, walks_with, model = two_steps("1", "with")
    assert len(with_lever) == 2 and with_lever == without
    assert walks_with <= walks_without - 6  # zero_grad at the start and after each step, clipping at each step

    trainable = [p for p in model.parameters() if p.requires_grad]
    for param in trainable:
        param.grad = torch.ones_like(param)
    model.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in trainable)
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_rows_ahead_reads_the_next_step_before_this_one_ends(tiny_cfg, monkeypatch):
    """Lever rows_ahead: with it, the next step's micro-batches are collated by the time a step ends (before the
    metrics' synchronize), one step's worth more than without; the same batches train, so the same losses."""
    from transformers import TrainerCallback

    from nb_helpers import training
    from nb_helpers.metrics import read_metrics

    def three_steps(lever: str, runs: str):
        run, trainer = built(tiny_cfg, monkeypatch, f"rows_ahead={lever}", 3, runs)
        collated, at_step_end = [], []
        collate = trainer.data_collator

        def counted(rows):
            batch = collate(rows)
            collated.append(batch["input_ids"].clone())
            return batch

        class AtStepEnd(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                at_step_end.append(len(collated))

        trainer.data_collator = counted
        trainer.callback_handler.callbacks.insert(0, AtStepEnd())  # before the metrics' synchronize
        with training.guard_training(run, trainer):
            trainer.train()
        training.finish_run(run, trainer, False)
        losses = [r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r]
        return losses, collated, at_step_end, trainer.args.gradient_accumulation_steps

    losses_without, batches_without, ends_without, accum = three_steps("0", "without")
    losses_with, batches_with, ends_with, _ = three_steps("1", "with")
    assert len(losses_with) == 3 and losses_with == losses_without
    assert [e - w for e, w in zip(ends_with, ends_without)][:2] == [accum, accum]
    trained = 3 * accum  # the batches that reached a step, in order
    assert all(a.equal(b) for a, b in zip(batches_with[:trained], batches_without[:trained]))
