"""NF4 weights dequantized by one Triton kernel inside CUDA graphs (lever `nf4_in_graphs`), with the bits
bitsandbytes' own kernel writes.

Every step dequantizes each 4-bit weight once per pass (forward, recompute, backward): 428 calls a step on
TinyLlama-1.1B. bitsandbytes' kDequantizeBlockwise took 3.7 ms of an H200's step for them, about half the memory's
speed; at 8 x 512 tokens that is 0.9 us of GPU time per token, the largest kernel kind after the GEMMs. This kernel
reads each packed byte once, looks its two codes up in the NF4 table and scales them by their block's fp32 absmax, in
fp32, rounded once: bitsandbytes' arithmetic, so the same bits (the GPU tests compare them). Device call 65, 8 x 512
graphed: 2.79 ms a step instead of 3.75.

Only inside a CUDA graph's capture (fast.graphed_layers): a graph replays its kernels without the host launching
them, while in eager steps each Triton launch costs the host about 8 us more than bitsandbytes' (device call 58: the
host-bound 8 x 2048 step ran 11% slower with the kernel in every pass). Weights whose size is not a multiple of a
program's 2,048 values, FP4, and weights whose absmax is not kept in fp32 stay on bitsandbytes' kernels.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from nb_helpers.frontend import say_once

TABLE = "_nb_nf4_table"  # a QuantState's NF4 table on its device, set by mark(): the kernel may run for it
# bitsandbytes' dDequantizeNF4 (csrc/kernels.cu), code 0 to 15, as fp32 literals
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
BYTES = 1024  # packed bytes a program: 2,048 values, 4 KiB of bf16 written


@functools.lru_cache(maxsize=1)
def kernels():
    """fast.nf4_kernels, or None (the reason said once) where Triton cannot be imported."""
    try:
        from nb_helpers.fast import nf4_kernels
    except Exception as e:  # noqa: BLE001 - Triton missing or broken: bitsandbytes' kernels run instead
        say_once("nf4-kernel", f"[fast] NF4 dequantize kernel off: Triton is not importable ({type(e).__name__}); "
                               "bitsandbytes' kernels run (the same bits)")
        return None
    return nf4_kernels


def takes(state) -> bool:
    """Whether the kernel can take this weight: NF4 on CUDA, 16-bit output, blocks of an even size that divide a
    program's values, a whole number of programs."""
    return (state.quant_type == "nf4" and state.absmax.is_cuda and state.dtype in (torch.bfloat16, torch.float16)
            and (2 * BYTES) % state.blocksize == 0 and state.shape.numel() % (2 * BYTES) == 0)


def mark(states) -> int:
    """Give each QuantState the kernel takes its table on its device, made here, before any CUDA graph is captured
    (a tensor first made inside a capture would not exist outside it), and compile the kernel for each output dtype
    and block size now (a capture is no place to load a module). Returns how many were marked."""
    if kernels() is None:
        return 0
    tables: dict = {}
    marked = [state for state in states if takes(state)]
    for state in marked:
        device = state.absmax.device
        tables.setdefault(device, torch.tensor(NF4, dtype=torch.float32, device=device))
        setattr(state, TABLE, tables[device])
    try:
        for device, dtype, blocksize in {(s.absmax.device, s.dtype, s.blocksize) for s in marked}:
            warm = SimpleNamespace(shape=torch.Size([2 * BYTES]), dtype=dtype, blocksize=blocksize,
                                   **{TABLE: tables[device]})  # one program's worth of zeros, to compile
            dequantize(torch.zeros(BYTES, dtype=torch.uint8, device=device),
                       torch.ones(2 * BYTES // blocksize, device=device), warm)
    except Exception as e:  # noqa: BLE001 - a GPU Triton cannot compile for: bitsandbytes' kernels everywhere
        for state in marked:
            delattr(state, TABLE)
        say_once("nf4-kernel-compile", f"[fast] NF4 dequantize kernel off: it did not compile or run on this GPU "
                                       f"({type(e).__name__}: {str(e)[:120]}); bitsandbytes' kernels run (same bits)")
        return 0
    return len(marked)


def in_capture(state, absmax) -> bool:
    """Whether this dequantize should run the kernel: a marked weight, its absmax in fp32, a graph being captured."""
    return (getattr(state, TABLE, None) is not None and absmax.dtype == torch.float32 and absmax.is_cuda
            and torch.cuda.is_current_stream_capturing())


def dequantize(packed, absmax, state) -> torch.Tensor:
    """The weight in state.dtype from its packed bytes and its blocks' fp32 absmax."""
    out = torch.empty(state.shape, dtype=state.dtype, device=packed.device)
    values = out.numel()
    kernels().dequantize_kernel[(values // (2 * BYTES),)](
        packed, absmax, getattr(state, TABLE), out, values, BLOCKSIZE=state.blocksize, BYTES=BYTES, num_warps=4)
    return out
