"""Fused Triton kernels (liger-kernel) for RMSNorm, SwiGLU and RoPE: one kernel each instead of several elementwise
launches, and fewer saved tensors. Not liger's fused cross-entropy: TRL's own chunked log-prob loss already never
builds the logits, and TRL refuses liger's. Where Triton cannot run (CPU, no triton, a kernel that fails its smoke
test), the stock layers stay and one line says so. Measured on an H200: 0.15 GiB less at 8 x 512 tokens, the same
speed (2026-11-30; the run is in bench/results/runs/).
"""

from __future__ import annotations

from nb_helpers.frontend import say_once


def kernels_unavailable_reason(model) -> str | None:
    """Why liger's kernels cannot run here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if getattr(getattr(model, "config", None), "model_type", None) != "llama":
        return f"no fused kernels wired for model type {getattr(model.config, 'model_type', '?')!r}"
    try:
        import triton  # noqa: F401
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a Triton that fails to import on this platform
        return (f"liger-kernel is not importable ({type(e).__name__}: {e}); `pip install -r requirements-gpu.txt` "
                "adds it")
    try:
        return _smoke_test(next(p for p in model.parameters()).device)
    except Exception as e:  # noqa: BLE001 - an old GPU or a broken Triton: fall back, do not crash the lesson
        return f"the fused kernels failed their smoke test on this GPU ({type(e).__name__}: {str(e)[:120]})"


def _smoke_test(device) -> str | None:
    """One tiny forward and backward of each fused kernel against the stock formula."""
    import torch
    from liger_kernel.ops import LigerRMSNormFunction, LigerSiLUMulFunction

    from nb_helpers.plan.dtypes import resolve_compute_dtype

    dtype = getattr(torch, resolve_compute_dtype("auto"))
    x = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(64, device=device, dtype=dtype)
    y = LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True, None)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w
    a, b = torch.randn(2, 4, 64, device=device, dtype=dtype).unbind(0)
    z = LigerSiLUMulFunction.apply(a.clone(), b.clone(), 1.0, 1.0)
    z_ref = torch.nn.functional.silu(a.float()).to(dtype) * b
    y.sum().backward()
    torch.cuda.synchronize(device)
    bad = [n for n, got, want in (("RMSNorm", y, ref), ("SwiGLU", z, z_ref))
           if not torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2)]
    return f"fused {', '.join(bad)} disagreed with the stock layer" if bad else None


def apply_fused_kernels(model, verbose: bool = True) -> bool:
    """liger-kernel's RMSNorm, SwiGLU and RoPE on this model instance (not its fused loss). Returns whether they
    were applied; otherwise the stock layers stay and one line says why."""
    reason = kernels_unavailable_reason(model)
    if reason is not None:
        if verbose:
            say_once("kernels", f"[fast] fused kernels off: {reason}; using the stock PyTorch layers (same math)")
        return False
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    # With model=..., liger patches this instance's modules; it also swaps two module-level classes, which we put
    # back so models built later in this process are not changed behind the user's back. RoPE is a function that
    # the attention layer looks up at call time, so it stays patched for the process, on CUDA tensors only.
    classes = modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP
    stock_rope = getattr(modeling_llama.apply_rotary_pos_emb, "stock", modeling_llama.apply_rotary_pos_emb)
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False, model=model)
    modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP = classes
    modeling_llama.apply_rotary_pos_emb = rope_by_device(modeling_llama.apply_rotary_pos_emb, stock_rope)
    if verbose:
        say_once("kernels-on", "[fast] fused Triton kernels (liger-kernel) for RMSNorm, SwiGLU and RoPE")
    return True


def rope_by_device(liger_rope, stock_rope):
    """liger's RoPE where q is on a GPU, transformers' own elsewhere. liger's is a Triton kernel, and its patch is
    process-wide: without this, a model on the CPU later in the same process (the export's merged model, a CPU
    generation after training in one notebook) crashed in it ("cannot be accessed from Triton (cpu tensor?)")."""
    liger_rope = getattr(liger_rope, "liger", liger_rope)

    def rope(q, k, *args, **kwargs):
        return (liger_rope if q.is_cuda else stock_rope)(q, k, *args, **kwargs)

    rope.liger, rope.stock = liger_rope, stock_rope
    return rope
