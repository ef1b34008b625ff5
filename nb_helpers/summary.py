"""summary.json, the one list of its keys: what a run folder says about its run in one file.

SUMMARY_KEYS are in every summary (None where they do not apply), in this order; DETAIL_KEYS are added when they
apply. summarize() refuses any other key, so a new one is added here, once, with what it means.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from nb_helpers.metrics import median, read_metrics
from nb_helpers.runs import write_json

SUMMARY_KEYS = {
    "model": "the model's name",
    "device": "the GPU's name, or the CPU and its threads",
    "steps": "optimizer steps finished",
    "train_loss_first": "train loss at the first step",
    "train_loss_last": "train loss at the last step",
    "eval_loss_before": "eval loss of the base model (the adapter starts at zero)",
    "eval_loss_after": "eval loss of the tuned model",
    "task_metric": "how answers are scored (task_metric.py)",
    "task_base": "the base model's score on held-out prompts",
    "task_tuned": "the tuned model's score on the same prompts",
    "peak_vram_gib": "peak device memory by NVML, CUDA context included (what must fit the card); None on the CPU",
    "peak_reserved_gib": "peak memory held by PyTorch's allocator; None on the CPU",
    "median_step_s": "median seconds per optimizer step, the first steps left out",
    "tokens_per_s": "median non-padding tokens per step over median seconds per step",
    "status": "completed, interrupted, oom, save failed, or stopped: non-finite loss or gradient at step N",
}
DETAIL_KEYS = {
    "budget_gib": "the emulated card's size, CUDA context included (None: no cap)",
    "card": "the card preset the run planned for and emulated (nb_helpers.plan.cards; None: budget_gib as set)",
    "cuda_context_gib": "the CUDA context measured under a budget",
    "expandable_segments": "whether PyTorch's allocator grew its segments in place (the GPU fast path)",
    "compute_dtype": "the dtype the model computed in",
    "versions": "Python and the library versions",
    "trainable_params": "LoRA parameters trained",
    "predicted_peak_gib": "the planner's predicted peak for this config",
    "predicted_phase": "where the planner predicts that peak",
    "predicted_components_gib": "the planner's breakdown of the peak",
    "predicted_step_s": "the time model's seconds per optimizer step (nb_helpers.plan.step_time), for predicted_step_gpu",
    "predicted_step_gpu": "the GPU predicted_step_s is for: the run's card, else this GPU (None: not one it models)",
    "predicted_for_this_gpu": "whether predicted_step_gpu is the GPU the run trained on (else the time is not comparable)",
    "adapter_step": "after a NaN or inf: the step whose adapter was kept (None: none was finite)",
    "world_size": "processes that trained (one per GPU under accelerate launch; 1 without a launcher)",
    "global_batch": "sequences per optimizer step over all processes: micro-batch x accumulation x world_size",
    "per_process_batch": "[micro-batch, accumulation] each process ran (config.json keeps the one-process equivalent)",
    "peak_vram_gib_per_process": "with several processes: each one's peak device memory by NVML, in rank order",
    "fast_levers": "GPU: each lever of the fast path (nb_helpers.fast) and whether this run used it ({} on the CPU)",
    # a DPO run (notebook 07): task_base is the SFT model's score, eval_loss_* DPO's loss on the held-out pairs
    "preference_from": "DPO: the SFT run whose adapter it started from",
    "pairs_reward_accuracy": "DPO: share of held-out pairs whose chosen answer got the higher implicit reward",
    "pairs_reward_margin": "DPO: mean implicit reward of chosen minus rejected on the held-out pairs",
}
BEFORE_TRAINING_KEYS = ("task_metric", "task_base", "eval_loss_before")  # a resumed run keeps its first measures

WARMUP_STEPS_EXCLUDED = 3  # first steps pay for allocation and kernel selection; timing ignores them


def device_label() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"


def package_versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets", "liger-kernel",
                 "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def summarize(run_dir: Path, model_name: str, extra: dict) -> dict:
    """The summary of a run folder: measured from its metrics.jsonl, plus what the trainer recorded (`extra`)."""
    if unknown := set(extra) - set(SUMMARY_KEYS) - set(DETAIL_KEYS):
        raise KeyError(f"summary keys {sorted(unknown)} are not in nb_helpers.summary; add them there with their meaning")
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    timed = records[WARMUP_STEPS_EXCLUDED:] if len(records) > 2 * WARMUP_STEPS_EXCLUDED else records
    step_s, tokens = (median(r[key] for r in timed) for key in ("step_s", "tokens"))
    peak = lambda key: max((r[key] for r in records if r.get(key) is not None), default=None)
    summary = dict.fromkeys(SUMMARY_KEYS)
    summary.update(
        model=model_name, device=device_label(), steps=records[-1]["step"] if records else 0,
        train_loss_first=records[0]["loss"] if records else None,
        train_loss_last=records[-1]["loss"] if records else None,
        peak_vram_gib=peak("device_used_gib"), peak_reserved_gib=peak("torch_peak_gib"), median_step_s=step_s,
        tokens_per_s=tokens / step_s if step_s and tokens else None, status="completed")
    summary.update(extra)
    return summary


def write_summary(run_dir: Path, model_name: str, extra: dict) -> dict:
    summary = summarize(run_dir, model_name, extra)
    write_json(run_dir / "summary.json", summary)
    return summary


def print_summary(summary: dict) -> None:
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)
    print("[summary] " + " | ".join(f"{k}={fmt(summary.get(k))}" for k in SUMMARY_KEYS))
