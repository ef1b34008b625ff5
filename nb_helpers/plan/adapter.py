"""What a LoRA adapter and its optimizer state take, per parameter and per tensor: the one source of these numbers for
the planner (plan.planner) and for the adapter a notebook has attached (nb_helpers.lora)."""

from __future__ import annotations

import math

BNB_8BIT_MIN_SIZE = 4096  # bitsandbytes optimizers keep 32-bit state for smaller tensors
BNB_BLOCK = 256  # blockwise 8-bit optimizer state: one fp32 absmax per 256 values
# paged_* optimizers page a tensor's two moments (CUDA managed memory) only from this size: smaller ones, every r=8
# adapter's, are torch.zeros in the allocator (bitsandbytes 0.50.2 optim/optimizer.py:383 `p.numel() < 1e5`)
BNB_PAGE_MIN_ELEMENTS = 100_000


def adapter_param_bytes(compute_dtype: str, load_in_4bit: bool = True, adapters_fp32: bool = False) -> int:
    """Bytes per LoRA parameter as training holds it. TRL 1.16 casts the adapters of a quantized model to bf16;
    trainer_setup.adapt_trainer casts them back to fp32 when the run is not bf16 (fp16 mixed precision cannot unscale
    bf16 gradients; fp32 runs compute in fp32); `adapters_fp32` models fp32 adapters in a bf16 run (measured once on
    an H200, 2026-11-30, not kept). Unquantized models keep peft's fp32 adapters. `compute_dtype` is the resolved dtype, not "auto"."""
    return 2 if load_in_4bit and compute_dtype == "bfloat16" and not adapters_fp32 else 4


def optimizer_bytes(sizes, optim: str, param_bytes: int) -> float:
    """Optimizer state for trainable tensors of these sizes. bitsandbytes' 8-bit AdamW: two uint8 moments plus an
    fp32 absmax per 256 values, fp32 moments for tensors under 4096 values; torch AdamW: two moments like the
    parameter; paged_adamw_32bit: two fp32 moments; SGD (no momentum): nothing."""
    if optim in ("paged_adamw_8bit", "adamw_8bit"):
        return float(sum(2 * n + 8 * math.ceil(n / BNB_BLOCK) if n >= BNB_8BIT_MIN_SIZE else 8 * n for n in sizes))
    if optim == "paged_adamw_32bit":
        return 8.0 * sum(sizes)
    if optim == "sgd":
        return 0.0
    return 2.0 * param_bytes * sum(sizes)
