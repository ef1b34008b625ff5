"""Headless training: the same steps as notebooks 01-03, in one function that `python -m nb_helpers train`
and, later, `accelerate launch -m nb_helpers train` call.

train(cfg) -> run folder with config.json, metrics.jsonl, adapter/, predictions.jsonl, plots and summary.json.
"""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import platform
import shutil
from pathlib import Path

from .config import RunConfig
from .data import load_train_eval, longest_row_tokens, to_dataset
from .dtypes import resolve_compute_dtype
from .lora import check_targets, lora_config, parameter_counts
from .metrics import MetricsCallback, median, read_metrics, record_nvml_baseline
from .models import load_4bit, load_tokenizer, resolve_model
from .runs import mark_latest, new_run_dir, resolve_run, write_json
from .frontend import resume_hint
from .task_metric import evaluate_task

WARMUP_STEPS_EXCLUDED = 3  # first steps pay for allocation and kernel selection; timing ignores them


def sft_config(cfg: RunConfig, run_dir: Path, text_rows: bool = False, has_eval: bool = True,
               selective_gc: bool = False):
    """Every training knob of the config as TRL's SFTConfig. Notebook 03 prints it."""
    import torch
    from trl import SFTConfig

    dtype = resolve_compute_dtype(cfg.compute_dtype)
    return SFTConfig(
        output_dir=str(run_dir / "checkpoints"),
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        optim=cfg.optim,
        gradient_checkpointing=cfg.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False, **({"selective": True} if selective_gc else {})},
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps,
        max_length=cfg.max_length,
        packing=False,
        completion_only_loss=None if text_rows else cfg.completion_only_loss,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        logging_steps=cfg.logging_steps,
        logging_nan_inf_filter=False,  # the default hides a NaN loss behind the running mean; we must see it
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        eval_strategy="steps" if cfg.eval_steps and has_eval else "no",
        eval_steps=cfg.eval_steps or None,
        include_num_input_tokens_seen="non_padding",
        report_to="none",
        seed=cfg.seed,
        data_seed=cfg.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=torch.cuda.is_available(),
        disable_tqdm=True,
    )


def attach_lora(model, cfg: RunConfig, fast=None):
    """The lean prepare + get_peft_model (+ the fast path's kernels and mask drop on a GPU), as notebook 02 shows.

    On a GPU the default is the lean prepare (nb_helpers.fastpath): the base frozen and 16-bit, as the recipe
    runs on the plain stack. peft's prepare_model_for_kbit_training upcast embeddings, head and norms to
    fp32, which made the residual stream and every checkpoint fp32: 1.03 GiB more at 8 x 512 tokens on the H200, at
    the same speed and losses (bench/NOTES.md). NB_FASTPATH=lean=0 brings it back; the CPU path keeps it."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    from .fastpath import FastOptions, apply_fused_kernels, install_mask_drop, lean_prepare

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
    model = get_peft_model(model, lora_config(cfg))
    if fast.nomask:
        install_mask_drop(model)
    model._nb_fast = fast
    return model


def device_label() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"


def summarize(run_dir: Path, model_name: str, extra: dict) -> dict:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    timed = records[WARMUP_STEPS_EXCLUDED:] if len(records) > 2 * WARMUP_STEPS_EXCLUDED else records
    step_s = median(r["step_s"] for r in timed)
    tokens = median(r["tokens"] for r in timed)
    device_peaks = [r.get("device_used_gib") for r in records if r.get("device_used_gib") is not None]
    reserved = [r.get("torch_peak_gib") for r in records if r.get("torch_peak_gib") is not None]
    summary = {
        "model": model_name,
        "device": device_label(),
        "steps": records[-1]["step"] if records else 0,
        "train_loss_first": records[0]["loss"] if records else None,
        "train_loss_last": records[-1]["loss"] if records else None,
        "eval_loss_before": None,
        "eval_loss_after": None,
        "task_metric": None,
        "task_base": None,
        "task_tuned": None,
        "peak_vram_gib": max(device_peaks) if device_peaks else None,
        "peak_reserved_gib": max(reserved) if reserved else None,
        "median_step_s": step_s,
        "tokens_per_s": tokens / step_s if step_s and tokens else None,
        "status": "completed",
    }
    summary.update(extra)
    return summary


def build_trainer(cfg: RunConfig, model, tokenizer, train_rows, eval_rows, run_dir: Path, listeners=()):
    from transformers import PrinterCallback
    from trl import SFTTrainer

    text_rows = "text" in train_rows[0]
    metrics_cb = MetricsCallback(run_dir / "metrics.jsonl", listeners=listeners)
    trainer = SFTTrainer(
        model=model,
        args=sft_config(cfg, run_dir, text_rows=text_rows, has_eval=bool(eval_rows),
                        selective_gc=bool(getattr(getattr(model, "_nb_fast", None), "selective_gc", False))),
        train_dataset=to_dataset(train_rows),
        eval_dataset=to_dataset(eval_rows) if eval_rows else None,
        processing_class=tokenizer,
        callbacks=[metrics_cb],
    )
    trainer.remove_callback(PrinterCallback)  # raw log dicts; our one-line progress and metrics.jsonl replace them
    fast = getattr(model, "_nb_fast", None)
    if fast is not None and fast.nomask:
        from .fastpath import guard_collator

        trainer.data_collator = guard_collator(trainer.data_collator, model)
    if resolve_compute_dtype(cfg.compute_dtype) != "bfloat16" or (fast is not None and fast.adapters_fp32):
        # TRL (1.16) casts the LoRA weights of quantized models to bf16. fp16 mixed precision cannot unscale bf16
        # gradients, so fp16 runs (Turing: GTX 1650, T4) crashed at the first step; they need fp32 master weights.
        # The optimizer is created in train(), so it sees the fp32 parameters.
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    return trainer, metrics_cb


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


def oom_advice(cfg: RunConfig, step: int | None, shape=None) -> str:
    """Which knob to turn, and by how much; with the model's shape, each change comes with the planner's peak."""
    changes = []
    if cfg.micro_batch_size > 1:
        changes.append((f"micro_batch_size {cfg.micro_batch_size} -> {cfg.micro_batch_size // 2} with grad_accum "
                        f"{cfg.grad_accum} -> {cfg.grad_accum * 2} (same effective batch)",
                        dict(micro_batch_size=cfg.micro_batch_size // 2, grad_accum=cfg.grad_accum * 2)))
    if not cfg.gradient_checkpointing:
        changes.append(("gradient_checkpointing=True (activations recomputed instead of stored)",
                        dict(gradient_checkpointing=True)))
    changes.append((f"max_length {cfg.max_length} -> {max(64, cfg.max_length // 2)}",
                    dict(max_length=max(64, cfg.max_length // 2))))
    tips = []
    now = None
    for text, change in changes:
        if shape is not None:
            try:
                from .planner import plan_for_config

                now = now or plan_for_config(cfg, shape)
                after = plan_for_config(cfg.replace(**change), shape)
                text += f" [planner: {now.peak_gib:.2f} -> {after.peak_gib:.2f} GiB]"
            except Exception:  # noqa: BLE001 - advice without numbers beats no advice
                pass
        tips.append(text)
    fit = " `python -m nb_helpers plan` checks a config before loading anything; auto_fit=True picks one that fits." \
        if shape is not None else ""
    return (f"CUDA ran out of memory at step {step}. Nothing is lost: metrics.jsonl and the last checkpoint are in "
            f"the run folder, and GPU memory has been freed. Try, in this order: " + "; ".join(tips) + "." + fit)


def trial_step(model, batch: int, length: int, checkpointing: bool, dtype, vocab: int) -> None:
    """One forward and backward at full length through the loss SFTTrainer uses (TRL's fused LM head), with a
    padded last row as real batches have; the gradients are dropped afterwards."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    try:
        with torch.autocast(device.type, dtype=dtype):
            out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), fused_lm_head=True)
        out.loss.backward()
    finally:
        model.zero_grad(set_to_none=True)


def run_auto_fit(cfg: RunConfig, model, tokenizer, shape, context_gib: float | None, verbose: bool = True,
                 seq: int | None = None) -> RunConfig:
    """Choose micro-batch x accumulation and GC for cfg.budget_gib (or the whole GPU), keeping the effective batch;
    each choice is confirmed by one forward and backward at `seq` tokens (the longest training row, at most
    max_length), stepping down on OOM. CUDA only."""
    import torch

    from .metrics import memory_snapshot
    from .planner import auto_fit, plan_for_config

    if shape is None:
        raise RuntimeError("auto_fit needs a Llama-family config.json the planner can read; set micro_batch_size "
                           "and grad_accum by hand instead")
    budget = cfg.budget_gib or torch.cuda.get_device_properties(0).total_memory / 2**30
    seq = min(seq or cfg.max_length, cfg.max_length)
    base = plan_for_config(cfg.replace(max_length=seq), shape, context_gib=context_gib).inputs
    dtype = getattr(torch, base.compute_dtype)
    vocab_top = min(tokenizer.vocab_size, shape.vocab)

    def trial(option) -> float | None:
        try:
            trial_step(model, option.batch, seq, option.gradient_checkpointing, dtype, vocab_top)
            torch.cuda.synchronize()
            return memory_snapshot()["device_used_gib"]
        finally:
            gc.collect()
            torch.cuda.empty_cache()

    choice = auto_fit(shape, base, cfg.effective_batch, budget, trial=trial,
                      log=print if verbose else (lambda *_: None))
    if not choice.gradient_checkpointing:
        model.gradient_checkpointing_disable()
    torch.cuda.reset_peak_memory_stats()
    return cfg.replace(micro_batch_size=choice.batch, grad_accum=choice.accum,
                       gradient_checkpointing=choice.gradient_checkpointing)


class LastGoodAdapter:
    """Keeps a CPU copy of the trainable (LoRA) weights after every finite step, so a NaN/inf step can be
    undone and the last good adapter saved. A few MB per copy at r=8; milliseconds per step."""

    def __init__(self, model):
        self.model, self.step, self.state = model, 0, None

    def __call__(self, record: dict) -> None:
        if "loss" not in record:
            return
        if math.isfinite(record["loss"]) and math.isfinite(record.get("grad_norm") or 0.0):
            self.step = record["step"]
            self.state = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters() if p.requires_grad}

    def restore(self) -> bool:
        import torch

        if self.state is None:
            return False
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
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(disk_advice(run_dir, e, "the adapter")) from e
    old = run_dir / "adapter.old"
    if target.exists():
        target.rename(old)
    partial.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def disk_advice(run_dir: Path, error: OSError, what: str) -> str:
    last = last_checkpoint(run_dir)
    kept = f"the last complete checkpoint ({last}) is intact" if last else "no complete checkpoint exists yet"
    reason = "the disk is full" if error.errno == errno.ENOSPC else f"{error.strerror or error}"
    return (f"could not save {what} in {run_dir}: {reason}. Nothing already saved was touched: {kept}, and "
            f"metrics.jsonl keeps every finished step. Free some space (`df -h`), then resume with "
            f"`python -m nb_helpers train --resume {run_dir}`.")


def last_checkpoint(run_dir: Path) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    folder = run_dir / "checkpoints"
    found = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    return Path(found) if found else None


def _split_metrics_at(run_dir: Path, step: int) -> None:
    """Resuming from checkpoint N: lines after step N move to metrics.after-checkpoint.jsonl (kept, not lost)."""
    path = run_dir / "metrics.jsonl"
    records = read_metrics(path)
    keep = [r for r in records if r["step"] <= step]
    later = [r for r in records if r not in keep]
    if later:
        write_jsonl(run_dir / "metrics.after-checkpoint.jsonl", later)
    write_jsonl(path, keep)


def train(cfg: RunConfig, listeners=(), verbose: bool = True, resume_from: str | Path | None = None) -> Path:
    """Run one QLoRA fine-tune and return its run folder. `resume_from` continues an interrupted run folder from
    its last checkpoint: same data order, optimizer and scheduler state, RNG state."""
    import torch

    from .preflight import check_budget_fits, preflight

    resume_dir = resolve_run(resume_from) if resume_from else None
    if resume_dir is not None:
        cfg = RunConfig.load(resume_dir / "config.json")
    cfg.validate()
    extra: dict = {"budget_gib": cfg.budget_gib}
    cuda = torch.cuda.is_available()
    if cuda:
        record_nvml_baseline(int(os.environ.get("LOCAL_RANK", "0")))  # before this process creates a context
        from .fastpath import FastOptions, use_expandable_segments

        if FastOptions.from_env().expandable:
            extra["expandable_segments"] = use_expandable_segments()

    # Everything that can be wrong with the settings or the data is found before the weights load.
    choice = resolve_model(cfg, verbose=verbose)
    tokenizer = load_tokenizer(choice.path, cfg.trust_remote_code)
    cfg = preflight(cfg, choice, verbose)
    train_rows, eval_rows = load_train_eval(cfg, tokenizer)
    if cuda and cfg.budget_gib:
        from .memory import enforce_budget

        budget = enforce_budget(cfg.budget_gib)
        extra["cuda_context_gib"] = budget.context_gib
        print(f"[budget] {budget.describe()}")
        check_budget_fits(cfg, choice, budget.allocator_cap_gib)
    elif cfg.budget_gib:
        print("[budget] budget_gib is ignored on the CPU (no device memory to cap)")

    shape, prediction = None, None
    try:
        from .planner import load_shape, plan_for_config

        shape = load_shape(choice.path)
        prediction = plan_for_config(cfg, shape, context_gib=extra.get("cuda_context_gib"))
        if verbose:
            where = "" if cuda else "no GPU here; for a GTX 1650-class card (compute capability 7.5): "
            print(f"[plan] {where}{prediction.verdict()}, in {prediction.peak_phase}; "
                  "`python -m nb_helpers plan` shows the breakdown")
    except Exception as e:  # noqa: BLE001 - a non-Llama model the planner cannot read still trains
        if verbose:
            print(f"[plan] no prediction for this model ({e})")

    fitting = cfg.auto_fit and resume_dir is None and cuda  # a resumed run keeps what was chosen for it
    if cfg.auto_fit and not cuda and verbose:
        print("[auto-fit] needs a CUDA GPU; keeping micro_batch_size and grad_accum as set")
    model = attach_lora(load_4bit(cfg, choice), cfg.replace(gradient_checkpointing=True) if fitting else cfg)
    if fitting:
        # Short rows (the shipped data: ~110 tokens) never fill max_length: fit for what training will really run
        seq = min(cfg.max_length, longest_row_tokens(train_rows, tokenizer))
        if verbose and seq < cfg.max_length:
            print(f"[auto-fit] the longest training row has {seq} tokens (max_length {cfg.max_length}): fitting for {seq}")
        cfg = run_auto_fit(cfg, model, tokenizer, shape, extra.get("cuda_context_gib"), verbose, seq=seq)
        prediction = plan_for_config(cfg.replace(max_length=seq), shape, context_gib=extra.get("cuda_context_gib"))
    if prediction is not None:
        extra.update(predicted_peak_gib=prediction.peak_gib, predicted_phase=prediction.peak_phase,
                     predicted_components_gib={k: v / 2**30 for k, v in prediction.components.items()})
    trainable, total = parameter_counts(model)
    if verbose:
        print(f"[lora] {cfg.summary_line()}")
        print(f"[lora] trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%)")

    checkpoint = None
    if resume_dir is not None:
        run_dir, checkpoint = resume_dir, last_checkpoint(resume_dir)
        if checkpoint is None:
            raise RuntimeError(f"{resume_dir} has no checkpoint to resume from (checkpoints/ is empty); "
                               "start a new run instead")
        _split_metrics_at(run_dir, int(checkpoint.name.rsplit("-", 1)[1]))
        previous = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        extra.update({k: previous.get(k) for k in ("task_metric", "task_base", "eval_loss_before")})
        print(f"[run] resuming {run_dir} from {checkpoint.name}")
    else:
        run_dir = new_run_dir(cfg, choice.name)
        cfg.save(run_dir / "config.json")
    mark_latest(run_dir)
    guard = LastGoodAdapter(model)
    listeners = [*listeners, guard]
    if verbose:
        print(f"[run] {run_dir}")
        total_steps = cfg.max_steps if cfg.max_steps > 0 else \
            int(cfg.num_train_epochs * -(-len(train_rows) // cfg.effective_batch))
        listeners.append(progress_printer(total_steps, every=max(1, total_steps // 20)))
    trainer, metrics_cb = build_trainer(cfg, model, tokenizer, train_rows, eval_rows, run_dir, listeners)

    extra.update(trainable_params=trainable, compute_dtype=resolve_compute_dtype(cfg.compute_dtype),
                 versions=package_versions())
    task_rows = eval_rows[: cfg.task_eval_samples] if cfg.task_eval_samples else []
    base = None
    if task_rows and checkpoint is None:
        # The adapter starts with B = 0, so the model right now answers exactly like the base model.
        base = evaluate_task(model, tokenizer, task_rows, cfg.max_new_tokens, label="scoring the base model")
        extra.update(task_metric=base["metric"], task_base=base["score"])
    if eval_rows and checkpoint is None:
        extra["eval_loss_before"] = trainer.evaluate()["eval_loss"]

    oom_step = None
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    except KeyboardInterrupt:
        extra["status"] = "interrupted"
        try:  # a checkpoint at the last finished step makes `--resume` continue exactly from here
            trainer._save_checkpoint(trainer.model, None)
        except Exception as e:  # never lose the run over a failed extra save
            print(f"[run] could not write a checkpoint on interrupt ({e}); the last periodic one is kept")
        print(f"[run] interrupted at step {trainer.state.global_step}: adapter saved as it is now; "
              f"{resume_hint(run_dir)}")
    except torch.OutOfMemoryError:
        oom_step = trainer.state.global_step
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        metrics_cb.close()
        write_json(run_dir / "summary.json", summarize(run_dir, choice.name, {**extra, "status": "save failed"}))
        raise RuntimeError(disk_advice(run_dir, e, "a checkpoint")) from e
    if oom_step is not None:
        # Outside the except block, so the OOM's traceback (which holds the activations) is already gone; the
        # notebook kernel keeps running with the memory handed back.
        metrics_cb.close()
        trainer.model = trainer.model_wrapped = trainer.optimizer = None
        del trainer, model
        guard.model = guard.state = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_json(run_dir / "summary.json", summarize(run_dir, choice.name, {**extra, "status": "oom"}))
        raise RuntimeError(oom_advice(cfg, oom_step, shape))

    if metrics_cb.non_finite_step is not None:
        restored = guard.restore()
        extra["status"] = f"stopped: non-finite loss or gradient at step {metrics_cb.non_finite_step}"
        extra["adapter_step"] = guard.step if restored else None
        print(f"[run] {extra['status']}. With fp16 (Turing cards) this is usually overflow: lower learning_rate "
              "(try half), keep max_grad_norm, or use bf16 where the GPU supports it. "
              + (f"adapter/ holds the last good weights, from step {guard.step}." if restored else
                 "No finite step was completed, so no adapter was saved."))
    if metrics_cb.non_finite_step is None or extra.get("adapter_step"):
        save_adapter(model, tokenizer, run_dir)

    if extra.get("status", "completed") == "completed":
        if eval_rows:
            evals = [r for r in metrics_cb.records if "eval_loss" in r]
            already = evals and evals[-1]["step"] == trainer.state.global_step  # eval_steps hit the last step
            extra["eval_loss_after"] = evals[-1]["eval_loss"] if already else trainer.evaluate()["eval_loss"]
        if task_rows:
            tuned = evaluate_task(model, tokenizer, task_rows, cfg.max_new_tokens, label="scoring the tuned model")
            extra["task_tuned"] = tuned["score"]
            if base is not None:
                write_jsonl(run_dir / "predictions.jsonl",
                            [{"base": b["prediction"], "base_score": b["score"], **t}
                             for b, t in zip(base["predictions"], tuned["predictions"])])

    metrics_cb.close()
    summary = summarize(run_dir, choice.name, extra)
    write_json(run_dir / "summary.json", summary)
    save_plots(run_dir)
    if verbose:
        print_summary(summary)
    return run_dir


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def save_plots(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from .plots import plot_training

    fig = plot_training({run_dir.name: read_metrics(run_dir / "metrics.jsonl")})  # not held by pyplot: no close
    fig.savefig(run_dir / "training.png", dpi=110, bbox_inches="tight")


def package_versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def print_summary(summary: dict) -> None:
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)
    print("[summary] " + " | ".join(f"{k}={fmt(summary.get(k))}" for k in (
        "model", "steps", "train_loss_first", "train_loss_last", "eval_loss_before", "eval_loss_after",
        "task_metric", "task_base", "task_tuned", "peak_vram_gib", "median_step_s", "tokens_per_s", "status")))
