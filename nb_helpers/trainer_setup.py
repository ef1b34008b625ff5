"""The trainer: TRL's SFTConfig from the run's config, and what the course changes on a built SFTTrainer.

Notebook 03 writes `SFTConfig(...)` and `SFTTrainer(...)` out, every argument with what it is for; sft_config is the
same call for the command line and the tests (tests/test_training.py checks that the two agree argument by argument).
"""

from __future__ import annotations

from nb_helpers import compat, distributed, fast
from nb_helpers.plan.dtypes import resolve_compute_dtype


def sft_config(run):
    """Every argument the trainer gets, as TRL's SFTConfig: the call notebook 03 writes out, with what to try for each
    knob (tests/test_training.py checks that the two agree). On the fast path (`fast_path=True`) the fast path sets
    its own checkpoints, token count and batch padding over the plain stack's three."""
    import torch
    from trl import SFTConfig

    cfg, dtype, cuda = run.cfg, resolve_compute_dtype(run.cfg.compute_dtype), torch.cuda.is_available()
    arguments = dict(
        # the recipe
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
        # checkpoints, logging, evaluation
        output_dir=str(run.run_dir / "checkpoints"),
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        logging_steps=cfg.logging_steps,
        logging_nan_inf_filter=False,  # the default hides a NaN loss behind the running mean; we must see it
        report_to="none",
        disable_tqdm=True,
        eval_strategy="steps" if cfg.eval_steps and run.eval_rows else "no",
        eval_steps=cfg.eval_steps or None,
        per_device_eval_batch_size=cfg.micro_batch_size,
        data_seed=cfg.seed,
        # the machine: CPU or GPU, and DDP (several processes, accelerate launch): every LoRA parameter gets a gradient
        # each step, so DDP need not search the graph for unused ones (a search that also breaks with gradient
        # checkpointing), nor broadcast the model's buffers from rank 0 before every forward (each process computes
        # them from the config and its own batch: RoPE's inv_freq, Gemma's embed_scale). None: one process, no DDP
        use_cpu=not cuda,
        dataloader_pin_memory=cuda,
        ddp_find_unused_parameters=False if run.world_size > 1 else None,
        ddp_broadcast_buffers=False if run.world_size > 1 else None,
        # the plain stack's checkpoints, token count and batch padding
        gradient_checkpointing_kwargs={"use_reentrant": False},
        include_num_input_tokens_seen="non_padding",
        pad_to_multiple_of=None,
    )
    if cfg.fast_path:
        # the fast path's own values of the last three for this model (reentrant checkpoints, TRL's token count alone,
        # batches padded to a multiple of 64 where it pays); notebook 06 shows these
        arguments.update(fast.trainer_arguments(run.model))
    args = SFTConfig(**arguments)
    distributed.one_gpu_per_process(args)  # one process, several GPUs visible: train on one (SFTTrainer refuses more)
    return args


def adapt_trainer(run, trainer) -> None:
    """What the course changes on a built trainer: TRL's raw log dicts off (the course prints one progress line), the
    device of several CPU processes, fp32 adapters where the precision needs them, and with `fast_path=True` the fast
    path's own changes (fast.adapt_trainer; on the plain stack it changes nothing)."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # raw log dicts; our one-line progress and metrics.jsonl replace them
    device = trainer.args.device
    if run.world_size > 1 and device.type == "cpu" and device.index is not None:
        # Several CPU processes (gloo) get the device "cpu:0" (accelerate 1.15), which torch.load refuses as the
        # map_location of a resumed run's optimizer state; "cpu" is the same memory.
        compat.set_trainer_device(trainer, type(device)("cpu"))
    fast.adapt_trainer(trainer, run.model)
    if resolve_compute_dtype(run.cfg.compute_dtype) != "bfloat16":
        # TRL (1.16) casts the LoRA weights of quantized models to bf16. fp16 mixed precision cannot unscale bf16
        # gradients, so fp16 runs (Turing: GTX 1650, T4) crashed at the first step; they need fp32 master weights.
        # The optimizer is created in trainer.train(), so it sees the fp32 parameters.
        for param in run.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()


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
