"""DPO on the SFT adapter (notebook 07): which SFT run it starts from, DPOConfig's arguments from the config, the
reward metrics in metrics.jsonl, and a DPO run folder that reads back like any run (notebook 04).

Notebook 07 writes `DPOConfig(...)` and `DPOTrainer(...)` out; `dpo_arguments` is the same call for the tests and
bench/dpo.py (tests/test_preference.py checks the two agree, argument by argument).

The reference model costs no second copy of the base. Given a PeftModel that already holds an adapter and no
`ref_model`, TRL 1.16's DPOTrainer adds a frozen copy of that adapter named "ref" and, for the reference forward,
switches to it under torch.no_grad(): the reference is the SFT model, on the same 4-bit base in memory. (A fresh
adapter, B = 0, would be the base itself: TRL then disables the adapter instead.)
"""

from __future__ import annotations

import json
from pathlib import Path

from nb_helpers.config import RunConfig
from nb_helpers.metrics import MetricsCallback
from nb_helpers.plan.dtypes import resolve_compute_dtype
from nb_helpers.runs import list_runs, mark_latest, new_run_dir, read_json, runs_root

PREFERENCE_RECORD = "preference_from"  # config.json of a DPO run: the SFT run it started from
# TRL's logged keys -> metrics.jsonl's (train steps; "eval_" + the same for held-out pairs)
REWARD_KEYS = {"rewards/accuracies": "reward_accuracy", "rewards/margins": "reward_margin",
               "rewards/chosen": "reward_chosen", "rewards/rejected": "reward_rejected"}


# --- where DPO starts ---------------------------------------------------------------------------------------------

def is_preference_run(run_dir: Path) -> bool:
    return PREFERENCE_RECORD in read_json(Path(run_dir) / "config.json")


def sft_runs(cfg: RunConfig, rank: int | None = None) -> list[Path]:
    """Completed SFT runs under cfg's runs folder with a saved adapter (of LoRA rank `rank`, if given), oldest first;
    DPO runs are left out: DPO starts from supervised tuning."""
    found = []
    for path in list_runs(runs_root(cfg)):
        config, summary = read_json(path / "config.json"), read_json(path / "summary.json")
        if (PREFERENCE_RECORD not in config and summary.get("status") == "completed"
                and (path / "adapter" / "adapter_model.safetensors").exists()
                and (rank is None or config.get("lora_r") == rank)):
            found.append(path)
    return found


def sft_config_for(cfg: RunConfig, sft_run: Path) -> RunConfig:
    """The SFT run's own model and LoRA settings (its adapter decides them), with cfg's DPO, batch and run knobs."""
    trained = RunConfig.load(Path(sft_run) / "config.json")
    keep = ("model", "load_in_4bit", "quant_type", "double_quant", "compute_dtype", "lora_r", "lora_alpha",
            "lora_dropout", "target_modules", "trust_remote_code")
    return cfg.replace(**{k: getattr(trained, k) for k in keep})


# --- DPOConfig from the config -------------------------------------------------------------------------------------

def dpo_arguments(cfg: RunConfig, output_dir: str | Path, has_eval: bool) -> dict:
    """Every argument DPOConfig gets: what notebook 07 writes out, with what to try for each knob there."""
    import torch

    dtype, cuda = resolve_compute_dtype(cfg.compute_dtype), torch.cuda.is_available()
    return dict(
        beta=cfg.dpo_beta,
        loss_type=["sigmoid"],
        per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.dpo_learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        optim=cfg.optim,
        gradient_checkpointing=cfg.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_steps=cfg.dpo_max_steps,
        max_length=cfg.max_length,
        truncation_mode="keep_start",
        precompute_ref_log_probs=False,
        disable_dropout=True,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        seed=cfg.seed,
        data_seed=cfg.seed,
        output_dir=str(output_dir),
        save_strategy="no",
        logging_steps=1,
        logging_nan_inf_filter=False,
        report_to="none",
        disable_tqdm=True,
        eval_strategy="steps" if cfg.eval_steps and has_eval else "no",
        eval_steps=cfg.eval_steps or None,
        per_device_eval_batch_size=cfg.micro_batch_size,
        use_cpu=not cuda,
        dataloader_pin_memory=cuda,
        pad_to_multiple_of=None,
    )


def adapt_dpo_trainer(trainer, cfg: RunConfig) -> None:
    """What the course changes on a built DPOTrainer: TRL's raw log dicts off (one progress line instead), and fp32
    trainable adapter weights unless training runs in bf16 (TRL casts them to bf16 for a 4-bit model, which fp16's
    loss scaling cannot unscale, and which a CPU computing in fp32 would mix with fp32 activations)."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    if resolve_compute_dtype(cfg.compute_dtype) != "bfloat16":
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()


def adapter_bytes(model, name: str) -> int:
    """Bytes of one named adapter's weights (the trained "default", or TRL's frozen "ref" copy)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if f".{name}." in n)


# --- the run folder ------------------------------------------------------------------------------------------------

class PreferenceMetrics(MetricsCallback):
    """metrics.jsonl as for any run (loss, time, memory, tokens), plus DPO's reward accuracy and margin: on each
    training line from the step's pairs, on each eval line from the held-out pairs."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._logs = dict(logs or {})
        super().on_log(args, state, control, logs=logs, **kwargs)

    def _write(self, record: dict) -> None:
        logs, prefix = getattr(self, "_logs", {}), "eval_" if "eval_loss" in record else ""
        record.update({prefix + ours: logs[prefix + theirs] for theirs, ours in REWARD_KEYS.items()
                       if prefix + theirs in logs})
        super()._write(record)


def open_preference_run(cfg: RunConfig, model_name: str, sft_run: Path, listeners=()) -> tuple[Path, PreferenceMetrics]:
    """runs/<name>/ with config.json (recording the SFT run it starts from), runs/latest pointing at it, and the
    callback that writes its metrics.jsonl."""
    run_dir = new_run_dir(cfg, f"{model_name}-dpo")
    cfg.save(run_dir / "config.json", record={PREFERENCE_RECORD: Path(sft_run).name})
    mark_latest(run_dir)
    return run_dir, PreferenceMetrics(run_dir / "metrics.jsonl", listeners=listeners)


def pair_scores(metrics: dict, prefix: str = "eval_") -> dict:
    """Reward accuracy, margin and loss on the held-out pairs, from trainer.evaluate()'s answer."""
    return {"accuracy": metrics.get(f"{prefix}rewards/accuracies"), "margin": metrics.get(f"{prefix}rewards/margins"),
            "loss": metrics.get(f"{prefix}loss")}


def held_out_scores(trainer, metrics: PreferenceMetrics) -> dict:
    """pair_scores of the held-out pairs after training: the eval at the last step when eval_steps landed there (no
    second pass over the pairs), else a new trainer.evaluate()."""
    last = [r for r in metrics.records if "eval_loss" in r]
    if last and last[-1]["step"] == trainer.state.global_step:
        r = last[-1]
        return {"accuracy": r.get("eval_reward_accuracy"), "margin": r.get("eval_reward_margin"), "loss": r["eval_loss"]}
    return pair_scores(trainer.evaluate())


def finish_preference_run(run_dir: Path, model, model_name: str, extra: dict, metrics: PreferenceMetrics,
                          tokenizer=None) -> dict:
    """adapter/ (the trained adapter only, not TRL's "ref" copy, with the tokenizer beside it: notebook 05 and export
    load it like any run's), summary.json and training.png."""
    from nb_helpers.summary import write_summary
    from nb_helpers.training import save_plots

    metrics.close()
    model.save_pretrained(run_dir / "adapter", selected_adapters=["default"])
    if tokenizer is not None:  # as an SFT run's adapter/ holds it: export and notebook 05 read it from there
        tokenizer.save_pretrained(run_dir / "adapter")
    summary = write_summary(run_dir, model_name, extra)
    save_plots(run_dir)
    return summary


def sft_run_scores(sft_run: Path, rows: list[dict], max_new_tokens: int) -> dict | None:
    """The SFT run's own task scores of `rows` (as evaluate_task returns them), from its predictions.jsonl: notebook
    03 scored the tuned model greedily on the same held-out prompts, so scoring it again would repeat that work
    answer for answer. None when that run scored other prompts, fewer of them, or with another answer length."""
    path = Path(sft_run) / "predictions.jsonl"
    if not path.exists() or read_json(Path(sft_run) / "config.json").get("max_new_tokens") != max_new_tokens:
        return None
    from nb_helpers.data import answer_text, prompt_messages
    from nb_helpers.task_metric import metric_name

    saved = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    wanted = [(prompt_messages(r)[-1]["content"], answer_text(r)) for r in rows]
    if not rows or [(p["prompt"], p["reference"]) for p in saved[:len(rows)]] != wanted:
        return None
    predictions = [{k: p[k] for k in ("prompt", "reference", "prediction", "score")} for p in saved[:len(rows)]]
    return {"metric": metric_name(answer_text(rows[0])), "score": sum(p["score"] for p in predictions) / len(rows),
            "predictions": predictions}


def predictions_file(run_dir: Path, before: dict, after: dict) -> None:
    """predictions.jsonl as an SFT run writes it: the SFT model's answer as `base`, DPO's as the tuned one."""
    with open(Path(run_dir) / "predictions.jsonl", "w", encoding="utf-8") as f:
        for b, t in zip(before["predictions"], after["predictions"]):
            f.write(json.dumps({"base": b["prediction"], "base_score": b["score"], **t}) + "\n")
