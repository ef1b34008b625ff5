"""Training as named steps. Notebook 03 calls them one by one and writes the trainer out between them;
train(cfg) composes the same steps for `python -m nb_helpers train`, the tests and `make run`:

    run = prepare_run(cfg)                 # settings, data, budget, memory plan: before any weights load
    load_for_training(run)                 # the 4-bit base + LoRA of notebooks 01-02; auto-fit on a GPU
    open_run_folder(run)                   # runs/<name>/ with config.json; metrics.jsonl fills as it trains
    trainer = build_trainer(run)           # SFTTrainer(model, sft_config(run), data, tokenizer, callbacks)
    evaluate_before(run, trainer)          # the base model's task score and eval loss
    with guard_training(run, trainer):     # Ctrl-C, out of memory, full disk: a message, nothing lost
        trainer.train(resume_from_checkpoint=run.checkpoint)
    finish_run(run, trainer)               # NaN restore, adapter/, second eval, summary.json, training.png

The run folder ends with config.json, metrics.jsonl, adapter/, predictions.jsonl, training.png and summary.json.

Under `accelerate launch` (several processes, nb_helpers.distributed) every process runs every step on its own GPU;
rank 0 alone names the run folder and writes into it, and alone scores the task (generation); the others wait.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import distributed
from .config import ConfigError, RunConfig
from .data import load_train_eval, longest_row_tokens, to_dataset
from .dtypes import resolve_compute_dtype
from .fastpath import checkpoint_kwargs, graphs_on, options_of
from .lora import check_targets, lora_config, parameter_counts
from .memory import record_nvml_baseline
from .metrics import MetricsCallback, read_metrics
from .models import ModelChoice, load_4bit, load_tokenizer, resolve_model
from .recovery import (LastGoodAdapter, checkpoint_on_interrupt, disk_advice, is_disk_full, last_checkpoint,
                       oom_advice, release_trainer, save_adapter, split_metrics_at)
from .runs import mark_latest, new_run_dir, resolve_run, write_jsonl
from .summary import BEFORE_TRAINING_KEYS, package_versions, print_summary, write_summary
from .task_metric import evaluate_task


@dataclass
class TrainingRun:
    """What the steps hand each other. Notebook 03 holds one as `run`; `run.cfg` is the config that trains (a
    resume loads the run's own, preflight may switch bf16 to fp16, auto-fit picks the batch)."""

    cfg: RunConfig
    choice: ModelChoice | None = None
    tokenizer: object = None
    train_rows: list = field(default_factory=list)
    eval_rows: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # what summary.json adds to the measured keys (nb_helpers.summary)
    resume_dir: Path | None = None
    checkpoint: str | None = None  # the checkpoint a resumed run continues from
    shape: object = None  # the planner's view of config.json (None for models it cannot read)
    prediction: object = None
    model: object = None
    run_dir: Path | None = None
    metrics: MetricsCallback | None = None
    last_good: LastGoodAdapter | None = None
    base_answers: dict | None = None
    oom_step: int | None = None
    world_size: int = 1  # processes training together (accelerate launch); cfg's batch is each one's share

    @property
    def global_batch(self) -> int:
        return self.cfg.effective_batch * self.world_size

    @property
    def text_rows(self) -> bool:
        return bool(self.train_rows) and "text" in self.train_rows[0]

    @property
    def task_rows(self) -> list:
        return self.eval_rows[: self.cfg.task_eval_samples] if self.cfg.task_eval_samples else []

    @property
    def callbacks(self) -> list:
        return [self.metrics] if self.metrics is not None else []


# --- the steps, in order ----------------------------------------------------------------------------------------

def prepare_run(cfg: RunConfig, resume_from: str | Path | None = None, verbose: bool = True) -> TrainingRun:
    """Everything that can be wrong with the settings or the data, found before the weights load. `resume_from`
    continues an interrupted run folder from its last checkpoint, with the config it was started with."""
    import torch

    from .preflight import preflight

    resume_dir = resolve_run(resume_from) if resume_from else None
    checkpoint = None
    if resume_dir is not None:
        cfg = RunConfig.load(resume_dir / "config.json")
        checkpoint = last_checkpoint(resume_dir)
        if checkpoint is None:
            raise RuntimeError(f"{resume_dir} has no checkpoint to resume from (checkpoints/ is empty); "
                               "start a new run instead")
    cfg.validate()
    world = distributed.world_size()
    if checkpoint is not None and verbose:
        print(resume_note(checkpoint, world))
    cfg = split_over_processes(cfg, world, verbose)  # before anything is sized: auto-fit and the plan are per GPU
    summary: dict = {"budget_gib": cfg.budget_gib}
    if torch.cuda.is_available():
        record_nvml_baseline(distributed.local_rank())  # before this process creates a context
        from .fastpath import FastOptions, use_expandable_segments

        if FastOptions.from_env().expandable:
            summary["expandable_segments"] = use_expandable_segments()
    distributed.init()  # several processes: the process group, and this process's GPU made current
    with distributed.main_first():  # rank 0 fetches or converts the model into the cache alone
        choice = resolve_model(cfg, verbose=verbose)
    tokenizer = load_tokenizer(choice.path, cfg.trust_remote_code)
    cfg = preflight(cfg, choice, verbose)
    train_rows, eval_rows = load_train_eval(cfg, tokenizer)
    summary.update(compute_dtype=resolve_compute_dtype(cfg.compute_dtype), versions=package_versions())
    run = TrainingRun(cfg, choice, tokenizer, train_rows, eval_rows, summary, resume_dir,
                      str(checkpoint) if checkpoint else None, world_size=world)
    apply_budget(run)
    predict_memory(run, verbose)
    return run


def split_over_processes(cfg: RunConfig, world: int, verbose: bool = True) -> RunConfig:
    """Each process's share of the global batch (nb_helpers.distributed.per_process_batch); one process: cfg."""
    if world <= 1:
        return cfg
    try:
        micro, accum = distributed.per_process_batch(cfg.micro_batch_size, cfg.grad_accum, world)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if verbose:
        print(distributed.describe_split(cfg.micro_batch_size, cfg.grad_accum, world))
    return cfg.replace(micro_batch_size=micro, grad_accum=accum)


def checkpoint_world_size(checkpoint: str | Path) -> int:
    """How many processes wrote a checkpoint: the Trainer saves one RNG state per process (rng_state_<rank>.pth),
    or rng_state.pth alone for one process."""
    ranks = list(Path(checkpoint).glob("rng_state_*.pth"))
    return len(ranks) or 1


def resume_note(checkpoint: str | Path, world: int) -> str:
    """What resuming on `world` processes keeps, and what it cannot keep when the checkpoint had another count."""
    before = checkpoint_world_size(checkpoint)
    if before == world:
        return (f"[run] resuming on {world} process{'es' if world > 1 else ''}, as the checkpoint was trained: the "
                "same global batch, data order and RNG state as an uninterrupted run")
    return (f"[run] the checkpoint was trained on {before} process{'es' if before > 1 else ''} and resumes on {world}: "
            "the global batch stays as config.json gives it (each process's accumulation is adjusted), and the "
            "optimizer and scheduler continue, but the rows are dealt to processes differently, so the data "
            "order from here can differ from an uninterrupted run, and processes with no RNG state of their own in "
            "the checkpoint start their dropout from the seed: the loss curve will not match one run step for step")


def apply_budget(run: TrainingRun) -> None:
    """Cap this process at cfg.budget_gib on its own GPU, CUDA context included, and check the 4-bit weights fit
    under it. With several processes the budget is per GPU."""
    import torch

    from .preflight import check_budget_fits

    if torch.cuda.is_available() and run.cfg.budget_gib:
        from .memory import enforce_budget

        budget = enforce_budget(run.cfg.budget_gib, device=distributed.local_rank())
        run.summary["cuda_context_gib"] = budget.context_gib
        print(f"[budget] {budget.describe()}")
        check_budget_fits(run.cfg, run.choice, budget.allocator_cap_gib)
    elif run.cfg.budget_gib:
        print("[budget] budget_gib is ignored on the CPU (no device memory to cap)")


def predict_memory(run: TrainingRun, verbose: bool = True) -> None:
    """The planner's peak for this config, from config.json alone; a model it cannot read still trains."""
    import torch

    from .planner import load_shape, plan_for_config

    try:
        run.shape = load_shape(run.choice.path)
        run.prediction = plan_for_config(run.cfg, run.shape, context_gib=run.summary.get("cuda_context_gib"))
    except Exception as e:  # noqa: BLE001 - a non-Llama model the planner cannot read still trains
        if verbose:
            print(f"[plan] no prediction for this model ({e})")
        return
    if torch.cuda.is_available():
        keep_graphs_within_budget(run, verbose)
    if verbose:
        where = "" if torch.cuda.is_available() else "no GPU here; for a GTX 1650-class card (compute capability 7.5): "
        print(f"[plan] {where}{run.prediction.verdict()}, in {run.prediction.peak_phase}; "
              "`python -m nb_helpers plan` shows the breakdown")


def keep_graphs_within_budget(run: TrainingRun, verbose: bool = True) -> None:
    """Settings chosen by hand (auto-fit weighs graphs itself): CUDA-graphed layers hold a memory pool, so where the
    planner puts the graphed run over the budget (or the card) and the eager one under it, this run goes eager.
    A hand-set run that left cuda_graphs unset runs eagerly (the lean path) and hears once what graphs would cost."""
    import torch

    from .planner import graphs_dropped_unless_they_fit

    cfg = run.cfg
    if cfg.auto_fit or not cfg.gradient_checkpointing:
        return
    if cfg.cuda_graphs is None:
        if verbose:
            say_graphs_cost(run)
        return
    if not cfg.cuda_graphs:
        return
    budget = cfg.budget_gib or torch.cuda.get_device_properties(distributed.local_rank()).total_memory / 2**30
    chosen = graphs_dropped_unless_they_fit(run.prediction, budget)
    if chosen is not run.prediction:
        if verbose:
            print(f"[plan] CUDA graphs off for this run: predicted {run.prediction.peak_gib:.2f} GiB with them, over "
                  f"{budget:.2f} GiB less the planner's margin; {chosen.peak_gib:.2f} GiB with eager layers (slower; "
                  "auto_fit weighs both)")
        run.cfg, run.prediction = cfg.replace(cuda_graphs=False), chosen


def say_graphs_cost(run: TrainingRun) -> None:
    """One line for a hand-set run on the lean path: what CUDA-graphed layers would cost it, and how to ask."""
    from .planner import plan_for_config

    graphed = plan_for_config(run.cfg.replace(cuda_graphs=True), run.shape,
                              context_gib=run.summary.get("cuda_context_gib"))
    if not graphed.components.get("graphs"):  # NB_FASTPATH turned them off, or checkpoints they cannot replay
        return
    extra = graphed.peak_gib - run.prediction.peak_gib
    print(f"[plan] layers run eagerly (the lean path: settings set by hand use no more memory than the recipe); "
          f"cuda_graphs=True replays them as CUDA graphs, several times faster for {extra:.2f} GiB more "
          f"(predicted {graphed.peak_gib:.2f} GiB), and auto_fit=True weighs both")


def load_for_training(run: TrainingRun, verbose: bool = True):
    """The 4-bit base with LoRA attached (notebooks 01-02), and with auto_fit the batch that fits the budget."""
    import torch

    cfg, cuda = run.cfg, torch.cuda.is_available()
    fitting = cfg.auto_fit and run.resume_dir is None and cuda  # a resumed run keeps what was chosen for it
    if cfg.auto_fit and not cuda and verbose:
        print("[auto-fit] needs a CUDA GPU; keeping micro_batch_size and grad_accum as set")
    run.model = attach_lora(load_4bit(cfg, run.choice), cfg.replace(gradient_checkpointing=True) if fitting else cfg)
    if fitting:
        fit_to_budget(run, verbose)
    if run.prediction is not None:
        run.summary.update(predicted_peak_gib=run.prediction.peak_gib, predicted_phase=run.prediction.peak_phase,
                           predicted_components_gib={k: v / 2**30 for k, v in run.prediction.components.items()})
    trainable, total = parameter_counts(run.model)
    run.summary["trainable_params"] = trainable
    if verbose:
        print(f"[lora] {run.cfg.summary_line()}")
        print(f"[lora] trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%)")
    return run.model


def fit_to_budget(run: TrainingRun, verbose: bool = True) -> None:
    """Auto-fit for this process's share of the global batch. With several processes rank 0 alone tries the
    candidates on its GPU and every process takes its choice, so all run the same micro-batch x accumulation."""
    from .planner import plan_for_config

    # Short rows (the shipped data: ~110 tokens) never fill max_length: fit for what training will really run
    seq = min(run.cfg.max_length, longest_row_tokens(run.train_rows, run.tokenizer))
    if verbose and seq < run.cfg.max_length:
        print(f"[auto-fit] the longest training row has {seq} tokens (max_length {run.cfg.max_length}): fitting for {seq}")
    if pad_multiple(run.model):  # batches are padded to a multiple of 64 tokens: fit for that length
        from .graphed_layers import padded_length

        seq = padded_length(seq)
    context = run.summary.get("cuda_context_gib")
    fitted = error = None
    if distributed.is_main():
        try:
            fitted = run_auto_fit(run.cfg, run.model, run.tokenizer, run.shape, context, verbose, seq=seq)
        except Exception as e:  # noqa: BLE001 - the other processes must hear of it, not wait for a choice
            error, fitted = e, f"{type(e).__name__}: {e}"
    fitted = distributed.broadcast(fitted)
    if error is not None:
        raise error
    if isinstance(fitted, str):
        raise RuntimeError(f"auto-fit failed on rank 0 ({fitted})")
    if not fitted.gradient_checkpointing:
        run.model.gradient_checkpointing_disable()
    run.cfg = fitted
    run.prediction = plan_for_config(run.cfg.replace(max_length=seq), run.shape, context_gib=context)


def open_run_folder(run: TrainingRun, listeners=(), verbose: bool = True) -> Path:
    """A new runs/<name>/ with config.json (or the resumed one, its metrics cut back to the checkpoint), and the
    callback that writes metrics.jsonl; `listeners` get each record too (the live plot). With several processes
    rank 0 names and writes the folder and the others are told its path."""
    main = distributed.is_main()
    if run.resume_dir is not None:
        run.run_dir = run.resume_dir
        if main:
            split_metrics_at(run.run_dir, int(run.checkpoint.rsplit("-", 1)[1]))
        previous = read_json(run.run_dir / "summary.json")
        run.summary.update({k: previous.get(k) for k in BEFORE_TRAINING_KEYS})
        print(f"[run] resuming {run.run_dir} from {Path(run.checkpoint).name}")
    else:
        run_dir = None
        if main:
            run_dir = new_run_dir(run.cfg, run.choice.name)
            saved_config(run).save(run_dir / "config.json")
        run.run_dir = distributed.broadcast(run_dir)
    if main:
        mark_latest(run.run_dir)
    run.last_good = LastGoodAdapter(run.model)
    listeners = [*listeners, run.last_good]
    if verbose:
        print(f"[run] {run.run_dir}")
        total = run.cfg.max_steps if run.cfg.max_steps > 0 else \
            int(run.cfg.num_train_epochs * -(-len(run.train_rows) // run.global_batch))
        listeners.append(progress_printer(total, every=max(1, total // 20)))
    run.metrics = MetricsCallback(run.run_dir / "metrics.jsonl", listeners=listeners, write=main,
                                  fields={"world_size": run.world_size, "global_batch": run.global_batch})
    return run.run_dir


def saved_config(run: TrainingRun) -> RunConfig:
    """What config.json keeps: the one-process equivalent of what each process runs (same global batch), so the
    file trains the same global batch however many processes load it (a resume, a rerun on one GPU)."""
    micro, accum = distributed.one_process_equivalent(run.cfg.micro_batch_size, run.cfg.grad_accum, run.world_size)
    return run.cfg.replace(micro_batch_size=micro, grad_accum=accum)


def sft_config(run: TrainingRun):
    """Every training knob of the config as TRL's SFTConfig. Notebook 03 writes this call out, with what to try
    for each knob; tests/test_training.py checks that the two agree."""
    from trl import SFTConfig

    cfg, dtype = run.cfg, resolve_compute_dtype(run.cfg.compute_dtype)
    args = SFTConfig(
        per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        optim=cfg.optim,
        gradient_checkpointing=cfg.gradient_checkpointing,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps,
        max_length=cfg.max_length,
        packing=False,
        completion_only_loss=cfg.completion_only_loss and not run.text_rows,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        seed=cfg.seed,
        **bookkeeping_args(run),
    )
    distributed.one_gpu_per_process(args)  # one process, several GPUs visible: train on one (SFTTrainer refuses more)
    return args


def bookkeeping_args(run: TrainingRun) -> dict:
    """SFTConfig's arguments that are not the recipe: where checkpoints go, logging, when to evaluate, CPU or GPU."""
    import torch

    cfg, cuda = run.cfg, torch.cuda.is_available()
    return dict(
        output_dir=str(Path(run.run_dir or ".") / "checkpoints"),
        per_device_eval_batch_size=cfg.micro_batch_size,
        gradient_checkpointing_kwargs=checkpoint_kwargs(run.model),
        logging_steps=cfg.logging_steps,
        logging_nan_inf_filter=False,  # the default hides a NaN loss behind the running mean; we must see it
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        eval_strategy="steps" if cfg.eval_steps and run.eval_rows else "no",
        eval_steps=cfg.eval_steps or None,
        include_num_input_tokens_seen="non_padding",
        # lengths padded to a multiple of 64 make a few shapes: CUDA-graphed layers replay one graph per shape, and
        # cuDNN's attention builds its plans once per shape (eager layers on CUDA)
        pad_to_multiple_of=pad_multiple(run.model),
        report_to="none",
        data_seed=cfg.seed,
        use_cpu=not cuda,
        dataloader_pin_memory=cuda,
        disable_tqdm=True,
        # DDP (several processes): every LoRA parameter gets a gradient each step, so DDP need not search the graph
        # for unused ones; that search also breaks with gradient checkpointing. None: one process, no DDP.
        ddp_find_unused_parameters=False if run.world_size > 1 else None,
        # nor broadcast the model's buffers from rank 0 before every forward: each process computes them from the
        # config and its own batch (RoPE's inv_freq, Gemma's embed_scale), nothing is learned
        ddp_broadcast_buffers=False if run.world_size > 1 else None,
    )


def pad_multiple(model) -> int | None:
    """The collator's length step, or None: where the layers run as CUDA graphs (one graph per shape), and on CUDA
    with the `pad_lengths` lever (cuDNN's attention builds an execution plan for every new length)."""
    import torch

    if not (graphs_on(model) or (options_of(model).pad_lengths and torch.cuda.is_available())):
        return None
    from .graphed_layers import PAD_MULTIPLE

    return PAD_MULTIPLE


def build_trainer(run: TrainingRun):
    """SFTTrainer over the run's model and data, as notebook 03 writes it out, then adapt_trainer."""
    from trl import SFTTrainer

    trainer = SFTTrainer(
        model=run.model,
        args=sft_config(run),
        train_dataset=to_dataset(run.train_rows),
        eval_dataset=to_dataset(run.eval_rows) if run.eval_rows else None,
        processing_class=run.tokenizer,
        callbacks=run.callbacks,
    )
    adapt_trainer(run, trainer)
    return trainer


def adapt_trainer(run: TrainingRun, trainer) -> None:
    """What the course changes on a built trainer: one progress line instead of raw log dicts, the fast path's
    collator check and optimizer step, and fp32 adapters where the precision needs them."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # raw log dicts; our one-line progress and metrics.jsonl replace them
    device = trainer.args.device
    if run.world_size > 1 and device.type == "cpu" and device.index is not None:
        # Several CPU processes (gloo) get the device "cpu:0" (accelerate 1.15), which torch.load refuses as the
        # map_location of a resumed run's optimizer state; "cpu" is the same memory.
        trainer.args.__dict__["_setup_devices"] = type(device)("cpu")
    trainer.floating_point_ops = flops_counter(run.model)
    fast = getattr(run.model, "_nb_fast", None)
    if fast is not None and fast.nomask:
        from .fastpath import guard_collator

        trainer.data_collator = guard_collator(trainer.data_collator, run.model)
    if fast is not None and fast.direct_optim:
        direct_optimizer_step(trainer)
    if resolve_compute_dtype(run.cfg.compute_dtype) != "bfloat16" or (fast is not None and fast.adapters_fp32):
        # TRL (1.16) casts the LoRA weights of quantized models to bf16. fp16 mixed precision cannot unscale bf16
        # gradients, so fp16 runs (Turing: GTX 1650, T4) crashed at the first step; they need fp32 master weights.
        # The optimizer is created in trainer.train(), so it sees the fp32 parameters.
        for param in run.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()


def direct_optimizer_step(trainer) -> None:
    """The optimizer the Trainer makes (the recipe's paged_adamw_8bit) steps through bitsandbytes' kernels directly
    (nb_helpers.optimizer_step): the same updates without a device synchronize per parameter."""
    from . import optimizer_step

    make = trainer.create_optimizer

    def create_optimizer(*args, **kwargs):
        optimizer = make(*args, **kwargs)
        optimizer_step.install(optimizer)
        return optimizer

    trainer.create_optimizer = create_optimizer


def flops_counter(model):
    """Trainer.floating_point_ops (6 x input tokens x parameters without embeddings, transformers 5's estimate) with
    the parameters counted once: the Trainer counts them again at every step, a walk over every module (host time on
    a fast GPU)."""
    if not hasattr(model, "num_parameters"):
        return lambda inputs: 0
    main_input, params = getattr(model, "main_input_name", "input_ids"), model.num_parameters(exclude_embeddings=True)
    return lambda inputs: 6 * inputs[main_input].numel() * params if main_input in inputs else 0


def evaluate_before(run: TrainingRun, trainer) -> dict:
    """The base model's task score and eval loss: the adapter starts with B = 0, so the model right now answers
    exactly like the base model. A resumed run keeps the numbers its first start measured. With several processes
    rank 0 alone scores the task; the eval loss is computed by all of them, each on its share of the rows."""
    if run.checkpoint is None:
        if run.task_rows and distributed.is_main():
            run.base_answers = evaluate_task(run.model, run.tokenizer, run.task_rows, run.cfg.max_new_tokens,
                                             label="scoring the base model")
            run.summary.update(task_metric=run.base_answers["metric"], task_base=run.base_answers["score"])
        distributed.wait()
        if run.eval_rows:
            run.summary["eval_loss_before"] = trainer.evaluate()["eval_loss"]
    return {k: run.summary.get(k) for k in BEFORE_TRAINING_KEYS}


@contextmanager
def guard_training(run: TrainingRun, trainer):
    """Around trainer.train(): Ctrl-C writes a checkpoint at the last finished step and says how to resume; an
    out-of-memory error is noted for finish_run, which reports it once the error's traceback (which holds the
    activations) is gone; a full disk writes the summary and says what to free. Other errors pass through."""
    import torch

    try:
        yield
    except KeyboardInterrupt:
        run.summary["status"] = "interrupted"
        checkpoint_on_interrupt(trainer, run.run_dir)
    except torch.OutOfMemoryError:
        run.oom_step = trainer.state.global_step
    except OSError as e:
        if not is_disk_full(e):
            raise
        run.metrics.close()
        if distributed.is_main():
            write_summary(run.run_dir, run.choice.name, {**run.summary, "status": "save failed"})
        raise RuntimeError(disk_advice(run.run_dir, e, "a checkpoint")) from e


def finish_run(run: TrainingRun, trainer, verbose: bool = True) -> Path:
    """After trainer.train(): report an out-of-memory stop, keep the last good adapter after a NaN, save adapter/,
    measure the tuned model, and write summary.json and training.png. Returns the run folder. With several
    processes rank 0 writes; every process returns once the folder is complete."""
    if run.oom_step is not None:
        stop_after_oom(run, trainer)
    keep_good_adapter(run)
    if run.summary.get("status", "completed") == "completed":
        evaluate_after(run, trainer)
    run.metrics.close()
    record_processes(run)
    if distributed.is_main():
        summary = write_summary(run.run_dir, run.choice.name, run.summary)
        save_plots(run.run_dir)
        if verbose:
            print_summary(summary)
    distributed.wait()
    return run.run_dir


# --- what finish_run does --------------------------------------------------------------------------------------

def record_processes(run: TrainingRun) -> None:
    """world_size and the global batch for summary.json; with several processes, each one's peak device memory
    (every process takes part: the peaks are gathered to rank 0)."""
    run.summary.update(world_size=run.world_size, global_batch=run.global_batch,
                       per_process_batch=[run.cfg.micro_batch_size, run.cfg.grad_accum])
    if run.world_size > 1:
        peak = max((r["device_used_gib"] for r in run.metrics.records if r.get("device_used_gib") is not None),
                   default=None)
        run.summary["peak_vram_gib_per_process"] = distributed.gather(peak)

def stop_after_oom(run: TrainingRun, trainer) -> None:
    """Hand the memory back (the notebook kernel keeps running), record the stop, and say which knob to turn."""
    run.metrics.close()
    release_trainer(trainer)
    run.model = run.last_good.model = run.last_good.state = run.last_good.params = None
    run.last_good.flat = {}
    gc.collect()
    if distributed.is_main():
        write_summary(run.run_dir, run.choice.name, {**run.summary, "status": "oom"})
    raise RuntimeError(oom_advice(run.cfg, run.oom_step, run.shape))


def keep_good_adapter(run: TrainingRun) -> None:
    """Save adapter/; after a NaN or inf step, the last finite step's weights, or none if no step was finite."""
    bad_step = run.metrics.non_finite_step
    if bad_step is not None:
        restored = run.last_good.restore()
        run.summary["status"] = f"stopped: non-finite loss or gradient at step {bad_step}"
        run.summary["adapter_step"] = run.last_good.step if restored else None
        print(f"[run] {run.summary['status']}. With fp16 (Turing cards) this is usually overflow: lower learning_rate "
              "(try half), keep max_grad_norm, or use bf16 where the GPU supports it. "
              + (f"adapter/ holds the last good weights, from step {run.last_good.step}." if restored else
                 "No finite step was completed, so no adapter was saved."))
    if (bad_step is None or run.summary.get("adapter_step")) and distributed.is_main():
        save_adapter(run.model, run.tokenizer, run.run_dir)


def evaluate_after(run: TrainingRun, trainer) -> None:
    """The tuned model's eval loss and task score; predictions.jsonl puts base and tuned answers side by side."""
    if run.eval_rows:
        evals = [r for r in run.metrics.records if "eval_loss" in r]
        already = evals and evals[-1]["step"] == trainer.state.global_step  # eval_steps hit the last step
        run.summary["eval_loss_after"] = evals[-1]["eval_loss"] if already else trainer.evaluate()["eval_loss"]
    if run.task_rows and distributed.is_main():
        tuned = evaluate_task(run.model, run.tokenizer, run.task_rows, run.cfg.max_new_tokens,
                              label="scoring the tuned model")
        run.summary["task_tuned"] = tuned["score"]
        if run.base_answers is not None:
            write_jsonl(run.run_dir / "predictions.jsonl",
                        [{"base": b["prediction"], "base_score": b["score"], **t}
                         for b, t in zip(run.base_answers["predictions"], tuned["predictions"])])


def save_plots(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from .plots import plot_training

    fig = plot_training({run_dir.name: read_metrics(run_dir / "metrics.jsonl")})  # not held by pyplot: no close
    fig.savefig(run_dir / "training.png", dpi=110, bbox_inches="tight")


def read_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


# --- all the steps in one call ------------------------------------------------------------------------------------

def train(cfg: RunConfig, listeners=(), verbose: bool = True, resume_from: str | Path | None = None) -> Path:
    """Run one QLoRA fine-tune and return its run folder: the steps above, in order, as notebook 03 calls them.
    `resume_from` continues an interrupted run folder from its last checkpoint: same data order, optimizer and
    scheduler state, RNG state."""
    run = prepare_run(cfg, resume_from, verbose)
    load_for_training(run, verbose)
    open_run_folder(run, listeners, verbose)
    trainer = build_trainer(run)
    evaluate_before(run, trainer)
    with guard_training(run, trainer):
        trainer.train(resume_from_checkpoint=run.checkpoint)
    return finish_run(run, trainer, verbose)


# --- pieces the steps use ----------------------------------------------------------------------------------------

def attach_lora(model, cfg: RunConfig, fast=None):
    """The lean prepare + get_peft_model (+ the fast path's kernels and mask drop on a GPU), as notebook 02 shows.

    On a GPU the default is the lean prepare (nb_helpers.fastpath): the base frozen and 16-bit, as the recipe
    runs on the plain stack. peft's prepare_model_for_kbit_training upcast embeddings, head and norms to
    fp32, which made the residual stream and every checkpoint fp32: 1.03 GiB more at 8 x 512 tokens on the H200, at
    the same speed and losses (bench/NOTES.md). NB_FASTPATH=lean=0 brings it back; the CPU path keeps it."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    from .fastpath import (FastOptions, apply_fused_kernels, apply_fused_lora, compile_layers, install_mask_drop,
                           install_offload, lean_prepare)

    fast = fast or FastOptions.from_env()
    check_targets(model, cfg.target_modules)
    if cfg.load_in_4bit and not fast.lean:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.load_in_4bit:
        model = lean_prepare(model)
    if fast.kernels:
        apply_fused_kernels(model)
    model = get_peft_model(model, lora_config(cfg, model))  # targets under the model's names (Phi: qkv_proj)
    if fast.nomask:
        install_mask_drop(model)
    if fast.fused_lora:
        apply_fused_lora(model, direct_dequant=fast.direct_dequant)
    if fast.compile:
        compile_layers(model)
    install_offload(model, bool(cfg.offload_checkpoints or fast.offload or fast.offload_sync)
                    and cfg.gradient_checkpointing)
    model._nb_fast, model._nb_use_graphs = fast, cfg.graphs_wanted
    return model


def progress_printer(total_steps: int, every: int):
    """One readable line every `every` steps (and eval results) for terminals and notebook logs."""

    def show(record: dict) -> None:
        if "eval_loss" in record:
            print(f"[eval] step {record['step']}: eval loss {record['eval_loss']:.4f}", flush=True)
        elif record["step"] % every == 0 or record["step"] in (1, total_steps):
            memory = record.get("device_used_gib") or record.get("host_rss_gib")
            where = "device" if record.get("device_used_gib") is not None else "host RSS"
            print(f"[train] step {record['step']}/{total_steps} | loss {record['loss']:.4f} | "
                  f"{record['step_s']:.2f} s/step | {record['tokens_per_s'] or 0:.0f} tok/s | "
                  f"{where} {memory:.2f} GiB", flush=True)

    return show


def trial_step(model, batch: int, length: int, checkpointing: bool, dtype, vocab: int, offload: bool = False,
               graphs: bool = False) -> None:
    """One forward and backward at full length through the loss SFTTrainer uses (TRL's fused LM head), with a
    padded last row as real batches have; the gradients are dropped afterwards. With `graphs` the layers are
    captured as CUDA graphs, so the measured peak includes their memory pool."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    model._nb_use_graphs = graphs
    if checkpointing:
        from .fastpath import set_checkpoint_offload

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(model))
        set_checkpoint_offload(model, offload)
    else:
        model.gradient_checkpointing_disable()
    model.train()
    device = next(p.device for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, vocab, (batch, length), device=device)
    mask = torch.ones_like(ids)
    if batch > 1:  # real micro-batches are padded, which costs an attention mask: the trial pays it too
        mask[-1, -min(16, length // 2):] = 0
    if not getattr(model, "_nb_fused_head", False):
        add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
        model._nb_fused_head = True
    from .graphed_layers import out_of_memory_raises

    try:
        with out_of_memory_raises():  # a graphed candidate that does not fit must fail its trial, not run eagerly
            with torch.autocast(device.type, dtype=dtype):
                out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                            fused_lm_head=True)
            out.loss.backward()
    finally:
        model.zero_grad(set_to_none=True)


def run_auto_fit(cfg: RunConfig, model, tokenizer, shape, context_gib: float | None, verbose: bool = True,
                 seq: int | None = None) -> RunConfig:
    """Choose micro-batch x accumulation and GC for cfg.budget_gib (or the whole GPU), keeping the effective batch;
    each choice is confirmed by one forward and backward at `seq` tokens (the longest training row, at most
    max_length), stepping down on OOM. CUDA only."""
    import torch

    from .memory import memory_snapshot
    from .planner import auto_fit, plan_for_config

    if shape is None:
        raise RuntimeError("auto_fit needs a Llama-family config.json the planner can read; set micro_batch_size "
                           "and grad_accum by hand instead")
    budget = cfg.budget_gib or torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    seq = min(seq or cfg.max_length, cfg.max_length)
    base = plan_for_config(cfg.replace(max_length=seq), shape, context_gib=context_gib).inputs
    dtype = getattr(torch, base.compute_dtype)
    vocab_top = min(tokenizer.vocab_size, shape.vocab)

    def trial(option) -> float | None:
        try:
            trial_step(model, option.batch, seq, option.gradient_checkpointing, dtype, vocab_top, option.offload,
                       option.graphs)
            torch.cuda.synchronize()
            return memory_snapshot()["device_used_gib"]
        finally:
            from .graphed_layers import reset

            reset()  # the trial's graphs (and their memory pool): training captures its own
            gc.collect()
            torch.cuda.empty_cache()

    choice = auto_fit(shape, base, cfg.effective_batch, budget, trial=trial,
                      log=print if verbose else (lambda *_: None), offload_allowed=hasattr(model, "_nb_offload"))
    if not choice.gradient_checkpointing:
        model.gradient_checkpointing_disable()
    model._nb_offload, model._nb_use_graphs = choice.offload, choice.graphs
    torch.cuda.reset_peak_memory_stats()
    return cfg.replace(micro_batch_size=choice.batch, grad_accum=choice.accum,
                       gradient_checkpointing=choice.gradient_checkpointing, offload_checkpoints=choice.offload,
                       cuda_graphs=choice.graphs)
