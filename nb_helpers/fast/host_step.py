"""The host's share of each training step: how and when the rows are read, who counts their tokens, the mode switch.

A CUDA step is host-bound at its edges: the GPU waits while the host collates the next batch, while it gets the
model ready for the forward, and while it waits on the GPU before the optimizer step. These levers shorten that
time, with the same batches and the same numbers:

* `array_rows`: TRL's collator makes each batch's tensors from its rows. A datasets.Dataset hands them over as Python
  lists, which torch.tensor converts one element at a time (4.2 ms for 8 x 2048 tokens on a 2-core EPYC); read as
  numpy arrays, each row is one copy (0.3 ms).
* `one_token_count`: SFTTrainer's loss counts each batch's tokens (its `num_tokens` metric), at the synchronize its
  metrics already make after the forward. The Trainer's own count (`include_num_input_tokens_seen`) adds an `.item()`
  after each backward: the host waits there for the whole backward before it queues the clipping and the optimizer,
  and the GPU then waits for the host. With the lever on, the Trainer does not count; metrics.jsonl takes TRL's count.
* `mode_on_change`: the Trainer calls `model.train()` before every micro-batch, and nn.Module.train sets the flag on
  every module (1,175 of them for TinyLlama with LoRA on q, k, v, o: 3.1 ms on that EPYC) although it has not
  changed. With the lever, a call that asks for the mode the model is in returns at once.
* `trainable_grads`: after each optimizer step the Trainer sets the gradients to None with `model.zero_grad()`, and
  before it clips them over `model.parameters()`: each a walk over every module for the 176 tensors that train (1,175
  modules and 377 parameters for TinyLlama with LoRA on q, k, v, o). With the lever, both go over the trainable
  parameters, listed once when the trainer is built; the frozen ones never have a gradient, so the numbers are the
  same. With several processes the Trainer zeroes through DDP's wrapper, which walks as before.

* `rows_ahead`: the Trainer reads a step's batches when that step begins, after the step before it has ended, and
  a step ends in a synchronize (the course's metrics time each step, as the benchmarks do): the GPU waits while the
  host reads the rows and collates them (3.6 ms of host time at 8 x 2048 on an H100's host, 2026-12-06). With the
  lever the next step's batches are read once this step's optimizer step is queued, while the GPU still works through
  the backward; the same batches, in the same order. It pays where steps are short (the shipped data's rows).

On the fast path the Trainer's FLOP estimate also counts the model's parameters once (`flops_counter`), not at every
step by walking every module.
"""

from __future__ import annotations

from nb_helpers.fast.state import options_of


def integer_list_columns(dataset) -> list[str]:
    """The columns of token ids (lists of integers): the ones TRL's collator turns into tensors."""
    from datasets import List, Sequence, Value

    def of_integers(feature) -> bool:
        inner = getattr(feature, "feature", None) if isinstance(feature, (List, Sequence)) else None
        return isinstance(inner, Value) and inner.dtype.startswith(("int", "uint"))

    return [name for name, feature in dataset.features.items() if of_integers(feature)]


def read_rows_as_arrays(trainer) -> bool:
    """Have the training rows' token columns read as numpy arrays (the other columns stay Python objects). A dataset
    that is not a datasets.Dataset, or whose format someone already chose, is left as it is."""
    from datasets import Dataset

    dataset = trainer.train_dataset
    if not isinstance(dataset, Dataset) or dataset.format["type"] is not None:
        return False
    columns = integer_list_columns(dataset)
    if not columns:
        return False
    trainer.train_dataset = dataset.with_format("numpy", columns=columns, output_all_columns=True)
    return True


def train_on_change(self, mode: bool = True):
    """nn.Module.train that walks the modules only when the mode changes: the model's last call through here set
    `mode`, and the first and last modules with trainable weights still hold it (a submodule switched on its own
    shows there), or the walk runs. model.eval() comes through here too."""
    sentinels = self.__dict__.get("_nb_mode_sentinels", ())
    if self.__dict__.get("_nb_mode") == mode and all(m.training == mode for m in sentinels):
        return self
    type(self).train(self, mode)
    self.__dict__["_nb_mode"] = mode
    return self


def walk_modes_on_change(model) -> None:
    """Install train_on_change on this model (a bound method: a deep copy of the model gets its own)."""
    import types

    holders = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    model.__dict__["_nb_mode_sentinels"] = holders[:1] + holders[-1:]
    model.__dict__.pop("_nb_mode", None)
    model.train = types.MethodType(train_on_change, model)


def zero_trainable_grads(self, set_to_none: bool = True) -> None:
    """nn.Module.zero_grad over the parameters that were trainable when the trainer was built (walk_trainable_grads),
    with nn.Module.zero_grad's own steps for each gradient."""
    for param in self.__dict__["_nb_trainable"]:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
            continue
        if param.grad.grad_fn is not None:
            param.grad.detach_()
        else:
            param.grad.requires_grad_(False)
        param.grad.zero_()


def walk_trainable_grads(trainer, model) -> None:
    """The Trainer's per-step gradient walks (model.zero_grad, the clipping's model.parameters()) over the model's
    trainable parameters, listed now. A bound method on this model, as walk_modes_on_change installs its own."""
    import types

    from nb_helpers import compat

    trainable = [param for param in model.parameters() if param.requires_grad]
    model.__dict__["_nb_trainable"] = trainable
    model.zero_grad = types.MethodType(zero_trainable_grads, model)
    compat.clip_these_grads(trainer, trainable)


def trainer_token_count(model) -> str:
    """TrainingArguments.include_num_input_tokens_seen for this run: "no" where TRL's count is the one kept."""
    return "no" if options_of(model).one_token_count else "non_padding"


def flops_counter(model):
    """Trainer.floating_point_ops (6 x input tokens x parameters without embeddings, transformers 5's estimate) with
    the parameters counted once: the Trainer counts them again at every step, a walk over every module (host time on
    a fast GPU)."""
    if not hasattr(model, "num_parameters"):
        return lambda inputs: 0
    main_input, params = getattr(model, "main_input_name", "input_ids"), model.num_parameters(exclude_embeddings=True)
    return lambda inputs: 6 * inputs[main_input].numel() * params if main_input in inputs else 0


class _ReadAhead:
    """One epoch's batches from the training DataLoader's own iterator, some of them read before they are asked for
    (`read`): handed out in the order read, then the iterator's end."""

    _END = object()

    def __init__(self, batches):
        import collections

        self.batches, self.ready = batches, collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.ready.popleft() if self.ready else next(self.batches)
        if batch is self._END:
            self.ready.appendleft(batch)
            raise StopIteration
        return batch

    def read(self, count: int) -> None:
        """Have `count` batches read and waiting (fewer at the epoch's end)."""
        while len(self.ready) < count and not (self.ready and self.ready[-1] is self._END):
            try:
                self.ready.append(next(self.batches))
            except StopIteration:
                self.ready.append(self._END)


class RowsAhead:
    """Lever `rows_ahead`: the epoch being read now (each epoch's iterator goes through `epoch`), and `read` for the
    next step's batches."""

    def __init__(self):
        self.current: _ReadAhead | None = None

    def epoch(self, batches) -> _ReadAhead:
        self.current = _ReadAhead(batches)
        return self.current

    def read(self, count: int) -> None:
        if self.current is not None:
            self.current.read(count)


def read_rows_ahead(trainer) -> bool:
    """Have the Trainer's training loader read the next step's batches when the optimizer step is queued (a callback
    at on_optimizer_step): the micro-batches of one step, gradient_accumulation_steps of them. Returns True once
    installed; a loader the Trainer then makes that nb_helpers.compat cannot read ahead (anything but accelerate's
    DataLoaderShard) is left as it is, and that is said once."""
    from transformers import TrainerCallback

    from nb_helpers import compat
    from nb_helpers.frontend import say_once

    rows, make = RowsAhead(), trainer.get_train_dataloader

    def get_train_dataloader(*args, **kwargs):
        loader = make(*args, **kwargs)
        if not compat.iterate_batches_through(loader, rows.epoch):
            say_once("rows-ahead", f"[fast] rows_ahead off: the training loader is a {type(loader).__name__}, not "
                                   "accelerate's DataLoaderShard; each step reads its batches when it begins")
        return loader

    class ReadNextStep(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            rows.read(args.gradient_accumulation_steps)

    trainer.get_train_dataloader = get_train_dataloader
    trainer.add_callback(ReadNextStep())
    return True
