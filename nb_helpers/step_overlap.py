"""Host work between optimizer steps, kept off the GPU's critical path.

On a fast GPU a step of the fast path is a few tenths of a second, and the host's own work around it showed up as
idle GPU time in a profiled step (device call 21, 8 x 2048 tokens on an H200):

  * the next batch: TRL's collator builds tensors from Python lists, about 7 ms for 8 x 2048 tokens, with the GPU
    idle. `loader_args` gives the DataLoader one worker process that collates it during the step before;
  * the Trainer's count of tokens seen: a `.item()` right after each backward, so the host waited 14.6 ms for the GPU
    and only then queued the clipping and the optimizer, with the GPU idle again. `count_tokens_on_device` keeps the
    count on the device and folds it in at the step's end, where the metrics callback synchronizes anyway.

Both are fast-path levers (`loader_worker`, `async_tokens`), on for CUDA; on a CPU they would save nothing.
"""

from __future__ import annotations

from transformers import TrainerCallback

from .fastpath import options_of, say_once


def loader_args(model) -> dict:
    """SFTConfig's DataLoader arguments: one persistent worker where the `loader_worker` lever is on, CUDA runs and
    processes fork (Linux, WSL). A spawned worker would import torch afresh and pickle the collator; there (Windows,
    macOS, Python 3.14's forkserver default) the collator stays in this process, said once."""
    import multiprocessing

    import torch

    if not (options_of(model).loader_worker and torch.cuda.is_available()):
        return {"dataloader_num_workers": 0}
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_context().get_start_method()
    if method != "fork":
        say_once("loader", f"[fast] batches are collated between steps: processes start by {method!r} here, "
                           "and a DataLoader worker would import torch again")
        return {"dataloader_num_workers": 0}
    return {"dataloader_num_workers": 1, "dataloader_persistent_workers": True, "dataloader_prefetch_factor": 2}


class TokenCount(TrainerCallback):
    """The Trainer's non-padding token count (`include_num_input_tokens_seen="non_padding"`), added up on the device
    and folded into `state.num_input_tokens_seen` at each step's end. Same numbers, no synchronize per micro-batch."""

    def __init__(self, trainer):
        self.pad_token_id = getattr(trainer.processing_class, "pad_token_id", None)
        self.main_input = getattr(trainer.model, "main_input_name", "input_ids")
        self.pending = None

    def add(self, inputs) -> None:
        if "attention_mask" in inputs:
            tokens = inputs["attention_mask"].sum()
        elif self.pad_token_id is not None and self.main_input in inputs:
            tokens = (inputs[self.main_input] != self.pad_token_id).sum()
        elif self.main_input in inputs:
            tokens = inputs[self.main_input].numel()
        else:
            return
        self.pending = tokens if self.pending is None else self.pending + tokens

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending is not None:
            state.num_input_tokens_seen += int(self.pending)
            self.pending = None


def count_tokens_on_device(trainer) -> TokenCount | None:
    """Replace the Trainer's per-micro-batch count with TokenCount, placed first among the callbacks so that every
    other one (the metrics' tokens/s) reads the folded count. Several processes keep the Trainer's own count (it
    gathers across them), and so does a Trainer without the hook this relies on."""
    if trainer.args.include_num_input_tokens_seen != "non_padding" or trainer.args.world_size > 1 \
            or not callable(getattr(trainer, "_track_num_input_tokens", None)):
        return None
    counter = TokenCount(trainer)
    trainer._track_num_input_tokens = counter.add
    trainer.callback_handler.callbacks.insert(0, counter)
    return counter
