"""The Triton kernel of fast.nf4 (imported only where Triton is; fast.nf4 says what it computes)."""

import triton
import triton.language as tl


@triton.jit
def dequantize_kernel(packed_ptr, absmax_ptr, table_ptr, out_ptr, values, BLOCKSIZE: tl.constexpr,
                      BYTES: tl.constexpr):
    """BYTES packed bytes a program: each holds two 4-bit codes, the high nibble first; value = table[code] * absmax of
    its block, in fp32, rounded once to the output's dtype (bitsandbytes' kDequantizeBlockwise does the same)."""
    first = tl.program_id(0).to(tl.int64) * BYTES
    index = first + tl.arange(0, BYTES)
    inside = index * 2 < values
    byte = tl.load(packed_ptr + index, mask=inside, other=0).to(tl.int32)
    scale = tl.load(absmax_ptr + index * 2 // BLOCKSIZE, mask=inside, other=0.0)
    high = tl.load(table_ptr + (byte >> 4)) * scale
    low = tl.load(table_ptr + (byte & 15)) * scale
    pairs = tl.reshape(tl.join(high, low), (2 * BYTES,))
    out = first * 2 + tl.arange(0, 2 * BYTES)
    tl.store(out_ptr + out, pairs.to(out_ptr.dtype.element_ty), mask=out < values)
