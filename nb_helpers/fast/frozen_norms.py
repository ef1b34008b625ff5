"""RMSNorm's backward where the norm's weight is frozen (lever `frozen_norms`): liger-kernel's own kernel launched over
the rows, and a layer input's two gradients summed inside it.

QLoRA trains none of the norms' weights, so their backward needs only the input's gradient. liger's backward launches
one program per SM (132 on an H200), each walking its share of the rows in turn, because it sums a weight gradient per
SM; at 8 x 2048 tokens its two norm backward kernels ran at about a third of the memory's speed (7.4 ms of an H200's
step where their bytes take ~2.5; 2026-12-03). Here liger's fused add + RMSNorm backward kernel, weight gradient
off, runs ROWS rows a program: each row's arithmetic is liger's (H200, 2026-12-03: 2.9 ms a step instead of 7.2).

A Llama layer's input feeds its input norm and the residual add, so autograd sums two gradients for it in an add kernel
of its own, once per layer. norm_keeping_input returns (norm(x), x) from one function whose backward adds the
residual's gradient inside the norm's kernel, as liger's fused add + norm already does for the post-attention norm:
one pass fewer over the hidden states, rounded once instead of twice.

liger's forward functions and its backward kernel are not its public API: nb_helpers.compat checks their signatures.
"""

from __future__ import annotations

import contextlib

import torch

ROWS = 1  # rows a program (16,384 programs at 8 x 2048): the fastest of 1-8 in bench/norm_bench.py on an H200


def takes(norm) -> bool:
    """Whether this norm's backward can run here: liger's RMSNorm in Llama's form (fast.fused_block._liger_norm decides
    that) with a frozen weight on a GPU, liger's kernel importable."""
    weight = getattr(norm, "weight", None)
    return weight is not None and weight.is_cuda and not weight.requires_grad and _importable()


def _importable() -> bool:
    try:
        from liger_kernel.ops.fused_add_rms_norm import _fused_add_rms_norm_backward_kernel  # noqa: F401
    except Exception:  # noqa: BLE001 - liger or Triton missing or broken: liger's own functions run
        return False
    return True


def _device(x):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _input_grad(ctx, grad_y, grad_more):
    """The norm input's gradient from the output's, plus `grad_more` (the input's other use) where given, in one
    launch of liger's kernel; written over grad_y's memory, as liger's own backward does."""
    import triton.language as tl
    from liger_kernel.ops.fused_add_rms_norm import _fused_add_rms_norm_backward_kernel as kernel

    x, weight, rstd = ctx.saved_tensors
    rows, cols = x.shape
    grad = grad_y.reshape(rows, cols).contiguous()
    more = grad_more.reshape(rows, cols).contiguous() if grad_more is not None else None
    dtype = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[x.dtype]
    with _device(x):
        kernel[(-(-rows // ROWS),)](
            grad, grad.stride(0), more, cols, grad, grad.stride(0), x, x.stride(0), dtype, weight, weight.stride(0),
            rstd, rstd.stride(0), None, 0, rows, cols, 0.0, ROWS, ctx.mode, BLOCK_SIZE=ctx.block,
            has_dS_out=more is not None, COMPUTE_DW=False, num_warps=ctx.warps)
    return grad.view(grad_y.shape)


class _NormKeepingInput(torch.autograd.Function):
    """(rmsnorm(x) * weight, x); the backward: x's gradient from both outputs, one kernel."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from liger_kernel.ops.rms_norm import rms_norm_forward

        y, flat, rstd, ctx.block, ctx.warps, ctx.mode = rms_norm_forward(x.contiguous(), weight, eps, 0.0, "llama",
                                                                         None)
        ctx.save_for_backward(flat, weight, rstd)
        return y, x

    @staticmethod
    def backward(ctx, grad_y, grad_x):
        if grad_y is None:
            return grad_x, None, None
        return _input_grad(ctx, grad_y, grad_x), None, None


class _AddNorm(torch.autograd.Function):
    """(rmsnorm(x + residual) * weight, x + residual): liger's fused add + RMSNorm with the backward above."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward

        y, summed, rstd, ctx.block, ctx.warps, _, ctx.mode = fused_add_rms_norm_forward(
            x.contiguous(), residual.contiguous(), weight, eps, 0.0, "llama")
        ctx.save_for_backward(summed.view(-1, summed.shape[-1]), weight, rstd)
        return y, summed

    @staticmethod
    def backward(ctx, grad_y, grad_summed):
        grad = grad_summed if grad_y is None else _input_grad(ctx, grad_y, grad_summed)
        return grad, grad, None, None


def norm_keeping_input(x, norm):
    """(norm(x), x) for a norm that takes() (the layer's input norm and its residual)."""
    if not torch.is_grad_enabled():  # a checkpoint's first forward, evaluation: nothing to save
        from liger_kernel.ops.rms_norm import rms_norm_forward

        return rms_norm_forward(x, norm.weight, norm.variance_epsilon, 0.0, "llama", None)[0], x
    return _NormKeepingInput.apply(x, norm.weight, norm.variance_epsilon)


def add_norm(x, residual, norm):
    """(norm(residual + x), residual + x) for a norm that takes()."""
    if not torch.is_grad_enabled():
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward

        return fused_add_rms_norm_forward(x, residual, norm.weight, norm.variance_epsilon, 0.0, "llama")[:2]
    return _AddNorm.apply(x, residual, norm.weight, norm.variance_epsilon)
