"""LoRA: which layers exist, the LoraConfig from the config, and what the adapter costs in bytes."""

from __future__ import annotations

from collections import Counter

from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.plan.adapter import adapter_param_bytes, optimizer_bytes


def linear_layer_names(model) -> dict[str, int]:
    """Short names of the linear layers (q_proj, up_proj, ...) and how many of each: the valid LoRA targets."""
    import torch

    counts = Counter()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            counts[name.rsplit(".", 1)[-1]] += 1
    return dict(counts)


def check_targets(model, targets: list[str]) -> list[str]:
    """The targets under this model's names (Phi fuses q/k/v into qkv_proj), or ConfigError naming the real ones."""
    from nb_helpers.plan.architecture import resolve_targets

    try:
        return list(resolve_targets(targets, linear_layer_names(model)))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def lora_config(cfg: RunConfig, model=None):
    """The LoRA settings as a peft.LoraConfig (notebook 02 builds the same one inline). With the model, the targets
    are first put under its names (check_targets)."""
    from peft import LoraConfig

    targets = check_targets(model, cfg.target_modules) if model is not None else list(cfg.target_modules)
    targets = "all-linear" if targets == ["all-linear"] else targets
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


def adapter_sizes(model) -> list[int]:
    """The size of every trainable tensor (each LoRA A and B)."""
    return [p.numel() for p in model.parameters() if p.requires_grad]


def adapter_training_bytes(trainable, optim: str, compute_dtype: str = "auto", load_in_4bit: bool = True) -> dict:
    """Bytes the adapter costs during training: weights + gradients (in the dtype training holds them,
    adapter_param_bytes) + optimizer state. `trainable` is the model (exact: one entry per tensor), a list of
    tensor sizes, or a parameter count (read as one tensor)."""
    from nb_helpers.plan.dtypes import resolve_compute_dtype

    sizes = adapter_sizes(trainable) if hasattr(trainable, "parameters") else \
        ([trainable] if isinstance(trainable, int) else list(trainable))
    per_param = adapter_param_bytes(resolve_compute_dtype(compute_dtype), load_in_4bit)
    weights = per_param * sum(sizes)
    state = optimizer_bytes(sizes, optim, per_param)
    return {"weights": weights, "gradients": weights, "optimizer_state": state, "total": 2 * weights + state}


def attach_lora(model, cfg: RunConfig, fast=None):
    """Freeze the 4-bit base, attach LoRA with get_peft_model, as notebook 02 shows: the plain stack by default;
    with `fast_path=True` on a GPU the fast path's levers go on around it (nb_helpers.fast, notebook 06).

    peft's prepare_model_for_kbit_training upcasts embeddings, head and norms to fp32, which makes the residual stream
    and every checkpoint fp32: 1.03 GiB more at 8 x 512 tokens on an H200, at the same speed and losses
    (measured 2026-11-30). The recipe as written never calls it, so a GPU run only freezes the base; the CPU path keeps it
    (its results were measured with it), and NB_FASTPATH=lean=0 brings it back on a GPU."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import set_seed

    from nb_helpers import fast as fastpath

    fast = fast or fastpath.options_for(cfg)
    check_targets(model, cfg.target_modules)
    if cfg.load_in_4bit and not fast.lean:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.load_in_4bit:
        for param in model.parameters():
            param.requires_grad_(False)  # the base stays frozen and 16-bit; LoRA adds the only trainable weights
    fastpath.before_lora(model, fast)
    # LoRA's A is drawn now, from a generator each process seeds at random; the Trainer seeds only later (3.4% apart
    # in loss over 16 steps with one seed, bit for bit the same once seeded here: bench/RESULTS.md)
    set_seed(cfg.seed)
    model = get_peft_model(model, lora_config(cfg, model))  # targets under the model's names (Phi: qkv_proj)
    fastpath.after_lora(model, fast, cfg)
    return model
