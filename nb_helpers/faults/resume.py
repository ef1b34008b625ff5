"""What a resume continues, and what it must not repeat or skip.

- A checkpoint at the run's last step (a stop during the final scoring: the Trainer saves at max_steps before that)
  means training finished: the Trainer, resumed from it, trained a step past max_steps whenever the steps did not fill
  the last epoch ("step 5/4"). TrainingDone stops trainer.train() once it has loaded the checkpoint (weights, state),
  before any step, and finish_run then runs only what is missing: the final scoring and the summary.
- A stop during a periodic evaluation left that point out of metrics.jsonl for good: the resumed Trainer evaluates
  first (its own eval_on_start, after the checkpoint's weights load), at the checkpoint's step.
- The Trainer resumes a LoRA model through peft's load_adapter, which casts a bf16 or fp16 adapter to fp32 unless told
  not to: the resumed run trained fp32 weights with fp32 optimizer moments where the uninterrupted one trained bf16,
  and its losses drifted from the first resumed step on (measured on the CPU: 2e-5 relative at the first step, more
  after). keep_adapter_dtypes loads the checkpoint into the adapter as it was; with it a resume on the CPU matches an
  uninterrupted run bit for bit (tests/test_faults_resume.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback


class TrainingDone(Exception):
    """Raised by StopIfTrained inside trainer.train(): the checkpoint it loaded is at the last step."""


def checkpoint_progress(checkpoint: str | Path) -> tuple[int, int]:
    """(the checkpoint's step, the run's last step) from its trainer_state.json (0 when the Trainer did not say)."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
    return int(state.get("global_step") or 0), int(state.get("max_steps") or 0)


def training_finished(checkpoint: str | Path | None) -> bool:
    if checkpoint is None:
        return False
    step, last = checkpoint_progress(checkpoint)
    return 0 < last <= step


class StopIfTrained(TrainerCallback):
    """At on_train_begin the Trainer has loaded the checkpoint's weights and state and not yet trained a step."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            raise TrainingDone(f"step {state.global_step} of {state.max_steps}")


def evaluation_missed(run) -> bool:
    """The resumed checkpoint's step is a periodic evaluation's (eval_steps) and metrics.jsonl holds none there: a
    stop during that evaluation. (At the last step finish_run evaluates anyway.)"""
    if run.checkpoint is None or not (run.cfg.eval_steps and run.eval_rows):
        return False
    step, last = checkpoint_progress(run.checkpoint)
    if step == 0 or step % run.cfg.eval_steps or (last and step >= last):
        return False
    return not any(r.get("step") == step and "eval_loss" in r for r in run.metrics.records)


def keep_adapter_dtypes(model) -> None:
    """Make the Trainer's resume load the checkpoint into the adapter in the dtypes it trains in (peft's
    load_adapter with autocast_adapter_dtype=False, its public argument), on this model object only."""
    load = getattr(model, "load_adapter", None)
    if load is None or getattr(load, "keeps_dtypes", False):
        return

    def load_as_trained(*args, **kwargs):
        kwargs.setdefault("autocast_adapter_dtype", False)
        return load(*args, **kwargs)

    load_as_trained.keeps_dtypes = True
    model.load_adapter = load_as_trained
