"""The Triton kernels of fast.lora_dropout (imported only where Triton is: a module of its own, because Triton's
JIT looks up the functions a kernel calls among its module's globals). fast.lora_dropout says what each computes."""

import triton
import triton.language as tl


@triton.jit
def keep_mask(seed, rows, cols, features, p):
    return tl.rand(seed, rows * features + cols) >= p

@triton.jit
def down_kernel(x_ptr, a_ptr, out_ptr, seed_ptr, tokens, features, rank, p, scale,
                R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ranks = tl.arange(0, R)
    seed = tl.load(seed_ptr)
    acc = tl.zeros((BT, R), dtype=tl.float32)
    for start in range(0, features, BK):
        cols = start + tl.arange(0, BK)
        inside = (rows[:, None] < tokens) & (cols[None, :] < features)
        x = tl.load(x_ptr + rows[:, None] * features + cols[None, :], mask=inside, other=0.0)
        x = tl.where(keep_mask(seed, rows[:, None], cols[None, :], features, p), x, 0.0).to(x.dtype)
        a = tl.load(a_ptr + ranks[None, :] * features + cols[:, None],
                    mask=(ranks[None, :] < rank) & (cols[:, None] < features), other=0.0)
        acc += tl.dot(x, a)
    tl.store(out_ptr + rows[:, None] * rank + ranks[None, :], (acc * scale).to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < tokens) & (ranks[None, :] < rank))

@triton.jit
def grad_a_kernel(gd_ptr, x_ptr, part_ptr, seed_ptr, tokens, features, rank, p, rows_per_split,
                  R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    cols = tl.program_id(0) * BK + tl.arange(0, BK)
    split = tl.program_id(1)
    ranks = tl.arange(0, R)
    seed = tl.load(seed_ptr)
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, tokens)
    acc = tl.zeros((R, BK), dtype=tl.float32)
    for start in range(first, last, BT):
        rows = start + tl.arange(0, BT)
        gd = tl.load(gd_ptr + rows[:, None] * rank + ranks[None, :],
                     mask=(rows[:, None] < last) & (ranks[None, :] < rank), other=0.0)
        inside = (rows[:, None] < last) & (cols[None, :] < features)
        x = tl.load(x_ptr + rows[:, None] * features + cols[None, :], mask=inside, other=0.0)
        x = tl.where(keep_mask(seed, rows[:, None], cols[None, :], features, p), x, 0.0).to(x.dtype)
        acc += tl.dot(tl.trans(gd), x)
    tl.store(part_ptr + split * R * features + ranks[:, None] * features + cols[None, :], acc,
             mask=cols[None, :] < features)

@triton.jit
def grad_x_kernel(gd_ptr, a_ptr, out_ptr, seed_ptr, tokens, features, rank, p, scale,
                  R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    ranks = tl.arange(0, R)
    seed = tl.load(seed_ptr)
    gd = tl.load(gd_ptr + rows[:, None] * rank + ranks[None, :],
                 mask=(rows[:, None] < tokens) & (ranks[None, :] < rank), other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * features + cols[None, :],
                mask=(ranks[:, None] < rank) & (cols[None, :] < features), other=0.0)
    product = tl.dot(gd, a) * scale
    product = tl.where(keep_mask(seed, rows[:, None], cols[None, :], features, p), product, 0.0)
    tl.store(out_ptr + rows[:, None] * features + cols[None, :], product.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < tokens) & (cols[None, :] < features))
