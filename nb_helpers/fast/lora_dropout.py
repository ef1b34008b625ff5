"""LoRA's dropout drawn inside its rank-r products (Triton): the dropped input is never written out.

peft computes lora_B(lora_A(dropout(x))). With torch's kernels that is a dropout kernel that reads x and writes a
dropped copy and a bool mask (the backward needs both), then a GEMM that reads the copy again; the backward reads
the copy once more and scales through the mask. On the TinyLlama shape at 8 x 2048 tokens that was 22 ms of a 0.25 s
step on an H200 (bench/NOTES.md), and 0.4 GB of copies and masks alive in each layer's backward.

Here each kernel redraws the mask from a seed where it needs it (Philox, counter = row x features + column):

    down    = (x * keep) A^T / (1 - p)                   forward: reads x once
    grad_A  = grad_down^T (x * keep) / (1 - p)            backward: reads x once more
    grad_x += (grad_down A) * keep / (1 - p)              backward: writes its share, the base GEMM adds into it

The seed is drawn from torch's CUDA generator into a device tensor, so a checkpoint's recompute (which rewinds the
generator) draws the same masks, and CUDA graphs replay a fresh draw each step. The masks are not the ones
torch.nn.Dropout would draw for the same seed: same keep probability, other draws. Used by fast.fused_lora on CUDA
for 16-bit inputs when Triton is importable (lever `dropout_kernels`); otherwise torch's dropout runs, said once.
"""

from __future__ import annotations

import functools
import os

import torch

from nb_helpers.frontend import say_once

MAX_RANK = 64  # the rank-r side of the products lives in registers; larger ranks use torch's dropout
BLOCK_ROWS, BLOCK_COLS = 64, 64


@functools.lru_cache(maxsize=1)
def kernels():
    """The three Triton kernels (fast.lora_dropout_kernels), or None (with the reason said once) where Triton cannot
    be imported."""
    try:
        from nb_helpers.fast import lora_dropout_kernels as k
    except Exception as e:  # noqa: BLE001 - Triton missing or broken: torch's dropout runs instead
        say_once("dropout-kernels", f"[fast] LoRA dropout kernels off: Triton is not importable "
                                    f"({type(e).__name__}); torch's dropout runs (same keep probability)")
        return None
    return k.down_kernel, k.grad_a_kernel, k.grad_x_kernel


def usable(flat, lora_a) -> bool:
    """Whether the kernels take this call: CUDA (or Triton's interpreter), a 16-bit contiguous input, a rank that
    fits, a mask counter that fits 32 bits, and Triton importable."""
    return ((flat.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and flat.dtype in (torch.float16, torch.bfloat16) and flat.is_contiguous() and flat.dim() == 2
            and lora_a.shape[0] <= MAX_RANK and flat.numel() < 2**31 and flat.shape[0] > 0
            and kernels() is not None)


def draw_seed(device) -> torch.Tensor:
    """One seed from torch's generator for `device`, kept on the device: rewound with the generator, graph-safe."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int32)


def _padded_rank(rank: int) -> int:
    return max(16, 1 << (rank - 1).bit_length())


def dropped_down(flat, a, seed, p: float):
    """(dropout(flat) A^T): tokens x rank, in flat's dtype."""
    down_kernel = kernels()[0]
    tokens, features = flat.shape
    out = torch.empty(tokens, a.shape[0], dtype=flat.dtype, device=flat.device)
    grid = (-(-tokens // BLOCK_ROWS),)
    down_kernel[grid](flat, a.contiguous(), out, seed, tokens, features, a.shape[0], p, 1.0 / (1.0 - p),
                      R=_padded_rank(a.shape[0]), BT=BLOCK_ROWS, BK=BLOCK_COLS)
    return out


def grad_a(grad_down, flat, seed, p: float, splits: int | None = None):
    """grad_down^T dropout(flat): rank x features in fp32 (the same mask as dropped_down's)."""
    grad_a_kernel = kernels()[1]
    tokens, features = flat.shape
    rank, padded = grad_down.shape[1], _padded_rank(grad_down.shape[1])
    col_blocks = -(-features // BLOCK_COLS)
    splits = splits or max(1, min(-(-tokens // BLOCK_ROWS), -(-264 // col_blocks)))  # about two programs per SM
    rows_per_split = -(-tokens // splits)
    rows_per_split = -(-rows_per_split // BLOCK_ROWS) * BLOCK_ROWS
    splits = -(-tokens // rows_per_split)
    parts = torch.empty(splits, padded, features, dtype=torch.float32, device=flat.device)
    grad_a_kernel[(col_blocks, splits)](grad_down.contiguous(), flat, parts, seed, tokens, features, rank, p,
                                        rows_per_split, R=padded, BT=BLOCK_ROWS, BK=BLOCK_COLS)
    return parts.sum(0)[:rank].mul_(1.0 / (1.0 - p))


def grad_x(grad_down, a, seed, p: float, features: int):
    """(grad_down A) through the same mask, scaled: tokens x features, the LoRA share of the input's gradient."""
    grad_x_kernel = kernels()[2]
    tokens = grad_down.shape[0]
    out = torch.empty(tokens, features, dtype=grad_down.dtype, device=grad_down.device)
    grid = (-(-tokens // BLOCK_ROWS), -(-features // BLOCK_COLS))
    grad_x_kernel[grid](grad_down.contiguous(), a.contiguous(), out, seed, tokens, features, a.shape[0], p,
                        1.0 / (1.0 - p), R=_padded_rank(a.shape[0]), BT=BLOCK_ROWS, BK=BLOCK_COLS)
    return out


def drawn_mask(seed, tokens: int, features: int, p: float, device) -> torch.Tensor:
    """The bool mask the kernels draw for `seed` (for tests): dropped_down of an identity-like input would do the
    same, this reads it directly through grad_x with A = 1."""
    ones_down = torch.ones(tokens, 1, dtype=torch.float16, device=device)
    ones_a = torch.ones(1, features, dtype=torch.float16, device=device)
    return grad_x(ones_down, ones_a, seed, p, features) != 0
