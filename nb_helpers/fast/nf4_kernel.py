"""NF4 weights dequantized by one Triton kernel (lever nf4_kernel), in place of bitsandbytes' CUDA kernel.

Every pass over the 4-bit base turns each NF4 weight back into a 16-bit one before its GEMM: 440 dequantizes a step
on TinyLlama, about 2.5 bytes of memory traffic per weight (half a byte read, two written). bitsandbytes' kernel
(`kDequantizeBlockwise`) runs blocks of 64 threads over tiles of 1,024 weights. This kernel does the same math over
rows of whole quantization blocks, each program a tile of 32 blocks (2,048 weights), so that its loads and stores are
wide and its absmax is read once a block. bench/dequant_bench.py times both on TinyLlama's weights.

The math is bitsandbytes': weight = code[nibble] x absmax in fp32, rounded once to the output dtype, the high nibble
of each byte first. So it gives the same bits as bitsandbytes' CUDA kernel (tests/test_nf4_kernel.py); the layout is
checked in nb_helpers.compat (the nf4_kernel lever's probe). This module imports Triton: only fast.fused_lora's
`use_nf4_kernel` imports it, where Triton is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCKS_PER_PROGRAM = 32  # quantization blocks a program dequantizes: 2,048 weights at bitsandbytes' blocksize 64
WARPS = 4  # 32 x 4 and 64 x 4 were the fastest of 4 tiles on an H100 (bench/dequant_bench.py, 2026-12-06)


@triton.jit
def nf4_blocks_kernel(packed_ptr, absmax_ptr, code_ptr, out_ptr, blocks, BLOCKS: tl.constexpr, HALF: tl.constexpr):
    """BLOCKS quantization blocks of HALF packed bytes (2 x HALF weights) each, one absmax per block."""
    block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    inside = block < blocks
    packed = tl.load(packed_ptr + block[:, None] * HALF + tl.arange(0, HALF)[None, :], mask=inside[:, None], other=0)
    scale = tl.load(absmax_ptr + block, mask=inside, other=0.0)[:, None]
    high = tl.load(code_ptr + (packed >> 4).to(tl.int32)) * scale  # the byte's first weight
    low = tl.load(code_ptr + (packed & 15).to(tl.int32)) * scale
    weights = tl.interleave(high, low)
    where = block[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    tl.store(out_ptr + where, weights.to(out_ptr.dtype.element_ty), mask=inside[:, None])


def takes(state, data) -> bool:
    """Whether the kernel covers this NF4 weight: whole blocks of a power-of-two size, offsets within int32, the
    16-entry fp32 code table beside the data."""
    blocksize, count = state.blocksize, state.shape.numel()
    return (state.quant_type == "nf4" and blocksize >= 16 and blocksize & (blocksize - 1) == 0
            and count % blocksize == 0 and count < 2**31 and data.numel() * 2 == count
            and state.code.numel() == 16 and state.code.dtype == torch.float32 and state.code.device == data.device)


def dequantize_into(data, absmax, code, out, blocksize: int):
    """`out` (the weight's shape, any float dtype) filled from the packed NF4 `data` and the fp32 `absmax` (one per
    block), on the current stream; returns `out`."""
    blocks = out.numel() // blocksize
    grid = (triton.cdiv(blocks, BLOCKS_PER_PROGRAM),)
    nf4_blocks_kernel[grid](data, absmax, code, out, blocks, BLOCKS_PER_PROGRAM, blocksize // 2, num_warps=WARPS)
    return out
