"""The Triton kernels of fast.lora_dropout (imported only where Triton is: a module of its own, because Triton's JIT
looks up the functions a kernel calls among its module's globals). fast.lora_dropout says what each computes.

The mask: element (row, col) of a tokens x features input belongs to group (row * features + col) // 8; one Philox
call (7 rounds, Triton's randint4x) per group gives 128 bits, eight 16-bit draws, one per element of the group. An
element is kept where its draw is at least `threshold` (round(p * 65536)). Every kernel draws it the same way for
any block size whose columns start at a multiple of 8, so the backward redraws the forward's mask.
"""

import triton
import triton.language as tl

# Philox-4x32 with 7 rounds passes BigCrush (Salmon et al., 2011); Triton's default of 10 is 30% more integer work
ROUNDS = tl.constexpr(7)


@triton.jit
def keep_mask(seed, rows, col0, features, threshold, BT: tl.constexpr, BK: tl.constexpr):
    """(BT, BK) bool: which of the input's elements at `rows` and columns col0 .. col0 + BK are kept."""
    groups = rows[:, None] * (features // 8) + (col0 // 8 + tl.arange(0, BK // 8))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, groups, ROUNDS)
    low = tl.join(tl.join(r0 & 0xFFFF, r1 & 0xFFFF), tl.join(r2 & 0xFFFF, r3 & 0xFFFF))
    high = tl.join(tl.join(r0 >> 16, r1 >> 16), tl.join(r2 >> 16, r3 >> 16))
    draws = tl.reshape(tl.join(low, high), (BT, BK))
    return draws.to(tl.int32) >= threshold


@triton.jit
def down_kernel(x_ptr, a_ptr, b_ptr, down_ptr, out_ptr, seed_ptr, tokens, features, rank, outputs, threshold,
                inv_keep, scaling, R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                WRITE_OUT: tl.constexpr):
    """down = dropout(x) A^T (tokens x rank); with WRITE_OUT also out = scaling * down B^T (tokens x outputs), into
    which the base GEMM then adds. x is read once; neither the dropped copy nor the mask is written."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ranks = tl.arange(0, R)
    inside = (rows[:, None] < tokens) & (ranks[None, :] < rank)
    seed = tl.load(seed_ptr)
    acc = tl.zeros((BT, R), dtype=tl.float32)
    for col0 in range(0, features, BK):
        cols = col0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * features + cols[None, :], mask=rows[:, None] < tokens, other=0.0)
        x = tl.where(keep_mask(seed, rows, col0, features, threshold, BT, BK), x, 0.0).to(x.dtype)
        a = tl.load(a_ptr + ranks[None, :] * features + cols[:, None], mask=ranks[None, :] < rank, other=0.0)
        acc += tl.dot(x, a.to(x.dtype))
    down = (acc * inv_keep).to(down_ptr.dtype.element_ty)  # rounded as torch's (dropped @ A^T) is
    tl.store(down_ptr + rows[:, None] * rank + ranks[None, :], down, mask=inside)
    if WRITE_OUT:
        for n0 in range(0, outputs, BN):
            ns = n0 + tl.arange(0, BN)
            b = tl.load(b_ptr + ns[None, :] * rank + ranks[:, None], mask=(ranks[:, None] < rank)
                        & (ns[None, :] < outputs), other=0.0)
            out = tl.dot(down, b.to(down.dtype)) * scaling
            tl.store(out_ptr + rows[:, None] * outputs + ns[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=(rows[:, None] < tokens) & (ns[None, :] < outputs))


@triton.jit
def out_kernel(down_ptr, b_ptr, out_ptr, tokens, rank, outputs, scaling, R: tl.constexpr, BT: tl.constexpr,
               BN: tl.constexpr):
    """out = scaling * down B^T over a grid of (BT rows, BN outputs) tiles: each element is the one rank-R dot that
    down_kernel's WRITE_OUT computes for it, so the same bits, with the rows and outputs spread over many programs."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ns = tl.program_id(1) * BN + tl.arange(0, BN)
    ranks = tl.arange(0, R)
    down = tl.load(down_ptr + rows[:, None] * rank + ranks[None, :],
                   mask=(rows[:, None] < tokens) & (ranks[None, :] < rank), other=0.0)
    b = tl.load(b_ptr + ns[None, :] * rank + ranks[:, None], mask=(ranks[:, None] < rank) & (ns[None, :] < outputs),
                other=0.0)
    out = tl.dot(down, b.to(down.dtype)) * scaling
    tl.store(out_ptr + rows[:, None] * outputs + ns[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < tokens) & (ns[None, :] < outputs))


@triton.jit
def backward_kernel(gd_ptr, x_ptr, a_ptr, gx_ptr, part_ptr, ga_ptr, arrived_ptr, seed_ptr, tokens, features, rank,
                    threshold, inv_keep, rows_per_split, splits, R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """One split of the rows and BK columns, the mask drawn once for both: x's gradient share (grad_down A) * mask /
    (1 - p), written; and grad_down^T dropout(x) summed over the split (rank x BK, fp32, scaled by 1 / (1 - p)).

    grad_A is the sum of the splits' partial sums. The split that finishes last on its columns adds them up, in split
    order (the same bits whichever finishes last), and writes grad_A's columns: a count per column tile in
    `arrived_ptr` (zeros at launch, left at zero) says which split that is, so no second kernel runs for the sum."""
    col0 = tl.program_id(0) * BK
    cols = col0 + tl.arange(0, BK)
    split = tl.program_id(1)
    ranks = tl.arange(0, R)
    seed = tl.load(seed_ptr)
    a = tl.load(a_ptr + ranks[:, None] * features + cols[None, :], mask=ranks[:, None] < rank, other=0.0)
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, tokens)
    acc = tl.zeros((R, BK), dtype=tl.float32)
    for start in range(first, last, BT):
        rows = start + tl.arange(0, BT)
        inside = rows[:, None] < last
        gd = tl.load(gd_ptr + rows[:, None] * rank + ranks[None, :], mask=inside & (ranks[None, :] < rank),
                     other=0.0)
        x = tl.load(x_ptr + rows[:, None] * features + cols[None, :], mask=inside, other=0.0)
        keep = keep_mask(seed, rows, col0, features, threshold, BT, BK)
        acc += tl.dot(tl.trans(gd.to(x.dtype)), tl.where(keep, x, 0.0).to(x.dtype))
        share = tl.where(keep, tl.dot(gd, a.to(gd.dtype)) * inv_keep, 0.0)
        tl.store(gx_ptr + rows[:, None] * features + cols[None, :], share.to(gx_ptr.dtype.element_ty), mask=inside)
    acc = acc * inv_keep
    into = ranks[:, None] * features + cols[None, :]
    if splits == 1:
        tl.store(ga_ptr + into, acc, mask=ranks[:, None] < rank)
    else:
        tl.store(part_ptr + split * R * features + into, acc)
        tl.debug_barrier()  # every thread's partial sum stored before the count says so (the atomic releases them)
        if tl.atomic_add(arrived_ptr + tl.program_id(0), 1, sem="acq_rel") == splits - 1:
            total = tl.zeros((R, BK), dtype=tl.float32)
            for other in range(0, splits):  # from L2 (.cg): the other splits wrote them from other SMs
                total += tl.load(part_ptr + other * R * features + into, cache_modifier=".cg")
            tl.store(ga_ptr + into, total, mask=ranks[:, None] < rank)
            tl.store(arrived_ptr + tl.program_id(0), 0)  # zero again for the next call (fast.lora_dropout keeps it)


@triton.jit
def mask_kernel(out_ptr, seed_ptr, tokens, features, threshold, BT: tl.constexpr, BK: tl.constexpr):
    """The mask itself, as int8 (for the tests)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    col0 = tl.program_id(1) * BK
    cols = col0 + tl.arange(0, BK)
    keep = keep_mask(tl.load(seed_ptr), rows, col0, features, threshold, BT, BK)
    tl.store(out_ptr + rows[:, None] * features + cols[None, :], keep.to(tl.int8), mask=rows[:, None] < tokens)
