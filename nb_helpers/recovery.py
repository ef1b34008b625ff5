"""When training goes wrong: an interrupt, an out-of-memory error, a NaN, a full disk, a kill. Each keeps what was
already written, hands back what it can, and says what to change; training.guard_training and finish_run use these,
and a resume continues from what they kept (the last complete checkpoint, the first start's measures)."""

from __future__ import annotations

import gc
import math
import shutil
from pathlib import Path

from nb_helpers import distributed
from nb_helpers.frontend import resume_hint
from nb_helpers.metrics import parse_metrics, set_aside
from nb_helpers.runs import point_latest_back, read_json, write_json, write_jsonl
from nb_helpers.faults.checkpoints import newest_complete, save_checkpoint_now
from nb_helpers.faults.run_lock import release_run_lock
from nb_helpers.faults.write_errors import as_write_failure
from nb_helpers.summary import BEFORE_TRAINING_KEYS, write_summary

BEFORE_TRAINING = "before_training.json"


class LastGoodAdapter:
    """Keeps a CPU copy of the trainable (LoRA) weights after every finite step, so a NaN/inf step can be
    undone and the last good adapter saved. A few MB per copy at r=8. On a GPU the weights are gathered into one
    flat tensor per dtype and copied into pinned memory without waiting for it: one copy a step instead of one per
    tensor (176 at r=8 on TinyLlama's q,k,v,o, which took 5 ms of host time a step in an H200 trace, 2026-12-01);
    restore() waits for it. `state` holds each weight's copy by name, views into the flat host tensors."""

    def __init__(self, model):
        self.model, self.step, self.state, self.params = model, 0, None, None
        self.flat: dict = {}  # dtype -> (pinned flat host copy, the weights gathered into it, in order)

    def __call__(self, record: dict) -> None:
        if "loss" not in record:
            return
        if math.isfinite(record["loss"]) and math.isfinite(record.get("grad_norm") or 0.0):
            self.step = record["step"]
            self._snapshot()

    def _layout(self) -> None:
        """Pinned flat host tensors, one per dtype, and each weight's view into them (made again if shapes change)."""
        import torch

        sources = {n: p.detach() for n, p in self.params.items()}
        pin = any(t.is_cuda for t in sources.values())
        self.flat, self.state = {}, {}
        for dtype in dict.fromkeys(t.dtype for t in sources.values()):
            names = [n for n, t in sources.items() if t.dtype == dtype]
            host = torch.empty(sum(sources[n].numel() for n in names), dtype=dtype, pin_memory=pin)
            self.flat[dtype] = (host, names)
            offset = 0
            for n in names:
                self.state[n] = host[offset:offset + sources[n].numel()].view(sources[n].shape)
                offset += sources[n].numel()

    def _snapshot(self) -> None:
        import torch

        if self.params is None:
            self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if self.state is None or any(self.state[n].shape != p.shape or self.state[n].dtype != p.dtype
                                     for n, p in self.params.items()):
            self._layout()
        for host, names in self.flat.values():
            # ordered on the stream before the next optimizer step changes the weights
            host.copy_(torch.cat([self.params[n].detach().reshape(-1) for n in names]), non_blocking=True)

    def restore(self) -> bool:
        import torch

        if self.state is None:
            return False
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the last snapshot's copy has landed
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in self.state.items():
                params[name].copy_(value.to(params[name].device))
        return True


def save_adapter(model, tokenizer, run_dir: Path) -> Path:
    """Write adapter/ so that a failure (a full disk) never leaves a half-written adapter where a good one was."""
    target, partial = run_dir / "adapter", run_dir / "adapter.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial)  # adapter weights only, as safetensors
        tokenizer.save_pretrained(partial)
    except Exception as e:  # noqa: BLE001 - safetensors reports a full disk as a bare Exception
        shutil.rmtree(partial, ignore_errors=True)
        raise as_write_failure(e, run_dir, "the adapter")
    old = run_dir / "adapter.old"
    if target.exists():
        target.rename(old)
    partial.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def last_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: one that a kill or a full disk cut short does not count."""
    return newest_complete(run_dir / "checkpoints")[0]


def split_metrics_at(run_dir: Path, step: int) -> None:
    """Resuming from checkpoint N: lines after step N move to metrics.after-checkpoint.jsonl (kept, not lost)."""
    path = run_dir / "metrics.jsonl"
    records, unreadable = parse_metrics(path)
    if later := [r for r in records if r["step"] > step]:
        write_jsonl(run_dir / "metrics.after-checkpoint.jsonl", later, mode="a")  # a second resume adds, never replaces
    set_aside(run_dir, path, unreadable)
    write_jsonl(path, [r for r in records if r["step"] <= step])


# The first start's measures, kept as soon as they are taken. The base model's eval loss, its task score and its
# answers used to reach disk only in summary.json, at the end: after a kill -9 a resume found none, and its summary
# said null and it wrote no predictions.jsonl. before_training.json holds them from the moment they are measured.

def keep_before_training(run) -> None:
    """Write the keys and the base model's answers (atomically: a kill leaves the old file or none)."""
    write_json(Path(run.run_dir) / BEFORE_TRAINING, {**{k: run.summary.get(k) for k in BEFORE_TRAINING_KEYS},
                                                     "base_answers": run.base_answers})


def restore_before_training(run) -> bool:
    """A resumed run takes its first start's measures; False when they were never kept (measure them again: until
    trainer.train() loads the checkpoint, the model is still the base model)."""
    try:
        kept = read_json(Path(run.run_dir) / BEFORE_TRAINING)
    except ValueError:  # edited by hand into something else than JSON: measure again
        kept = {}
    if not isinstance(kept, dict) or not kept:
        return False
    run.summary.update({k: kept.get(k) for k in BEFORE_TRAINING_KEYS})
    run.base_answers = kept.get("base_answers")
    return True


def checkpoint_on_interrupt(trainer, run_dir: Path) -> None:
    """A checkpoint at the last finished step makes `--resume` continue exactly from where Ctrl-C stopped."""
    try:
        save_checkpoint_now(trainer, run_dir)
    except Exception as e:  # never lose the run over a failed extra save
        print(f"[run] could not write a checkpoint on interrupt ({e}); the last periodic one is kept")
    print(f"[run] interrupted at step {trainer.state.global_step}: adapter saved as it is now; "
          f"{resume_hint(run_dir)}")


def release_trainer(trainer) -> None:
    """Drop the trainer's references to the model, optimizer, scheduler and data loaders, so that their memory goes
    back to the GPU even while a notebook still holds `trainer`."""
    import torch

    trainer.accelerator.free_memory()
    handler = trainer.callback_handler
    handler.model = handler.optimizer = handler.lr_scheduler = handler.train_dataloader = handler.eval_dataloader = None
    trainer.model = trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None
    trainer.data_collator = None  # the fast path's collator guard holds the model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- after trainer.train(): what training.finish_run keeps -------------------------------------------------------

def stop_after_oom(run, trainer) -> None:
    """Hand the memory back (the notebook kernel keeps running), record the stop, and say which knob to turn."""
    run.metrics.close()
    release_trainer(trainer)
    run.model = run.last_good.model = run.last_good.state = run.last_good.params = None
    run.last_good.flat = {}
    gc.collect()
    if distributed.is_main():
        write_summary(run.run_dir, run.choice.name, {**run.summary, "status": "oom"})
    from nb_helpers.plan.choose import oom_advice

    raise RuntimeError(oom_advice(run.cfg, run.oom_step, run.shape))


def keep_good_adapter(run) -> None:
    """Save adapter/; after a NaN or inf step, the last finite step's weights, or none if no step was finite."""
    bad_step = run.metrics.non_finite_step
    if bad_step is not None:
        restored = run.last_good.restore()
        run.summary["status"] = f"stopped: non-finite loss or gradient at step {bad_step}"
        run.summary["adapter_step"] = run.last_good.step if restored else None
        print(f"[run] {run.summary['status']}. Either the step diverged (a learning rate too high for this "
              "data: lower learning_rate, try half, and keep max_grad_norm) or, in fp16 (Turing cards), an "
              "activation passed fp16's largest value, 65,504 (loss scaling protects the gradients, not the "
              "forward): bf16 where the GPU has it. Check the rows of that step too (validate-data). "
              + (f"adapter/ holds the last good weights, from step {run.last_good.step}." if restored else
                 "No finite step was completed, so no adapter was saved."))
    if (bad_step is None or run.summary.get("adapter_step")) and distributed.is_main():
        save_adapter(run.model, run.tokenizer, run.run_dir)


# --- a stop outside trainer.train(): loading, scoring the base model, the final scoring ---------------------------

def stopped_outside_training(run) -> str:
    """Ctrl-C or SIGTERM anywhere but inside trainer.train() (guard_training handles that): the run folder is left
    as a run or not at all, and its lock is let go. A folder where no step was trained and no checkpoint written
    holds nothing to resume: it is removed and runs/latest names the run it named before. Otherwise summary.json says
    "interrupted", with the steps metrics.jsonl holds, and a resume runs only what is missing. Returns the line to
    print."""
    run_dir = getattr(run, "run_dir", None)
    if run is None or run_dir is None or not distributed.is_main():
        if run is not None and getattr(run, "resume_dir", None) is not None:
            release_run_lock(run.resume_dir)
        return "[run] stopped before the run folder was opened: nothing was written"
    run_dir = Path(run_dir)
    if run.metrics is not None:
        run.metrics.close()
    trained = any("loss" in r for r in parse_metrics(run_dir / "metrics.jsonl")[0])
    if run.resume_dir is None and not trained and newest_complete(run_dir / "checkpoints")[0] is None:
        release_run_lock(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        point_latest_back(run_dir, run.previous_latest)
        back = f"; runs/latest names {run.previous_latest.name} again" if run.previous_latest else ""
        return f"[run] stopped before the first step: nothing was trained, so {run_dir} is removed{back}"
    try:
        write_summary(run_dir, run.choice.name, {**run.summary, "status": "interrupted"})
    finally:
        release_run_lock(run_dir)
    return f"[run] stopped outside training; summary.json says \"interrupted\"; {resume_hint(run_dir)}"
