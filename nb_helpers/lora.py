"""LoRA: which layers exist, the LoraConfig from the config, and what the adapter costs in bytes."""

from __future__ import annotations

from collections import Counter

from .config import ConfigError, RunConfig


def linear_layer_names(model) -> dict[str, int]:
    """Short names of the linear layers (q_proj, up_proj, ...) and how many of each: the valid LoRA targets."""
    import torch

    counts = Counter()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            counts[name.rsplit(".", 1)[-1]] += 1
    return dict(counts)


def check_targets(model, targets: list[str]) -> None:
    available = linear_layer_names(model)
    if targets == ["all-linear"] or targets == "all-linear":
        return
    missing = [t for t in targets if t not in available]
    if missing:
        raise ConfigError(f"target_modules {missing} do not exist in this model; its linear layers are "
                          f"{sorted(available)} — pick from those (lm_head is best left out)")


def lora_config(cfg: RunConfig):
    """The LoRA settings as a peft.LoraConfig (notebook 02 builds the same one inline)."""
    from peft import LoraConfig

    targets = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")


def trainable_table(model) -> list[dict]:
    """Per target layer type: adapter count and parameters; plus the totals against the whole model."""
    rows: dict[str, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        parts = name.split(".")
        layer = parts[parts.index("lora_A") - 1] if "lora_A" in parts else (
            parts[parts.index("lora_B") - 1] if "lora_B" in parts else parts[-2])
        row = rows.setdefault(layer, {"layer": layer, "tensors": 0, "params": 0})
        row["tensors"] += 1
        row["params"] += param.numel()
    return sorted(rows.values(), key=lambda r: r["layer"])


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) where a 4-bit weight counts its real parameters, not its packed bytes."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if getattr(param, "quant_state", None) is not None:
            n = param.quant_state.shape.numel() if hasattr(param.quant_state, "shape") else n * 2
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


def adapter_training_bytes(trainable_params: int, optim: str) -> dict:
    """Bytes the adapter costs during training: fp32 weights + fp32 grads + optimizer state
    (AdamW keeps two moments: 8 bytes/param in fp32, 2 bytes/param in the 8-bit optimizers)."""
    state = {"paged_adamw_8bit": 2, "adamw_8bit": 2}.get(optim, 0 if optim == "sgd" else 8)
    return {"weights": 4 * trainable_params, "gradients": 4 * trainable_params, "optimizer_state": state * trainable_params,
            "total": (8 + state) * trainable_params}
