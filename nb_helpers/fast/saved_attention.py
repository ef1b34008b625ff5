"""A checkpointed layer's recompute skips attention: its forward keeps the output in CPU RAM (lever saved_attention).

With gradient checkpointing each layer's backward first runs the layer's forward again. Attention is the part of that
recompute whose cost grows with the square of the row: at 8 x 2048 tokens on TinyLlama cuDNN's attention forward took
7.4 ms of a 0.2 s step on an H200 in the recompute alone (2026-12-03). Where the checkpoint's saved input goes to
pinned CPU RAM anyway (fast.offload), the first forward sends its attention output and log-sum-exp there too, on the
same side stream, and they come back with the layer's input; the recompute hands them on instead of attending again,
and the backward calls cuDNN's attention backward op with them, as torch's autograd does after a forward with
gradients. The same kernels and values: the first forward runs cuDNN's training forward (the one that writes the
log-sum-exp), which is what the recompute would run again.

It runs only where all of this holds; transformers' attention runs otherwise: a Llama attention patched by
fast.fused_block, an eager checkpoint offloaded to CPU RAM whose recompute reuses its forward's stash (fast.recompute),
no mask, no cache, no dropout, 16-bit on CUDA, and cuDNN's two ops as nb_helpers.compat checks them. It costs 2
bytes per token and head dimension and 4 per token and head of pinned RAM per layer, and one more layer's worth of
them on the card while they are copied (the planner counts both).
"""

from __future__ import annotations

import torch

from nb_helpers.fast import offload, recompute


def mark(layer, on: bool) -> None:
    """Switch the lever for one decoder layer's attention (fast.checkpoints, per the run's checkpoint function)."""
    attention = getattr(layer, "self_attn", None)
    if attention is not None:
        attention._nb_saved_attention = bool(on)


def _applies(module, query, key, attention_mask, dropout, kwargs) -> bool:
    return (getattr(module, "_nb_saved_attention", False) and attention_mask is None and not dropout
            and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[2] == key.shape[2] > 1
            and getattr(module, "is_causal", True) and kwargs.get("is_causal", True) is not False
            and not kwargs.get("output_attentions") and kwargs.get("position_bias") is None
            and not torch.cuda.is_current_stream_capturing())


def attend(module, query, key, value, attention_mask, stock, dropout: float, scaling: float, **kwargs):
    """(attention output as transformers' SDPA returns it, None): from what this checkpoint's forward kept (its
    recompute), kept now (its forward, offloaded), else through `stock` (transformers' attention function)."""
    if _applies(module, query, key, attention_mask, dropout, kwargs):
        kept = recompute.stashed(module)
        stash = None if torch.is_grad_enabled() else recompute.stash_of_forward()
        if torch.is_grad_enabled() and kept is not None:
            return SavedAttention.apply(query, key, value, kept, scaling).transpose(1, 2), None
        if stash is not None and offload.offloading():
            out, stash[module] = _forward_kept(query, key, value, scaling)
            return out.transpose(1, 2), None
    return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _forward_kept(query, key, value, scaling: float):
    """cuDNN's training forward: (its output, batch x heads x tokens x head_dim, and what the recompute needs: the
    output and log-sum-exp sent to CPU RAM, the op's other results)."""
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, True, False, scale=scaling)
    rows = out.transpose(1, 2)  # tokens-major, as cuDNN lays it out: a plain copy to the host and back
    rows = rows if rows.is_contiguous() else rows.contiguous()
    return out, (offload.send_to_host(rows), offload.send_to_host(lse), (seed, offset, cum_q, cum_k, max_q, max_k))


class SavedAttention(torch.autograd.Function):
    """Causal attention whose output and log-sum-exp the checkpoint's forward kept: the forward returns them, the
    backward is cuDNN's."""

    @staticmethod
    def forward(ctx, query, key, value, kept, scaling: float):
        rows, lse = offload.brought_back(kept[0]), offload.brought_back(kept[1])
        out = rows.transpose(1, 2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scaling, ctx.rest = scaling, kept[2]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        seed, offset, cum_q, cum_k, max_q, max_k = ctx.rest
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, query, key, value, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True,
            scale=ctx.scaling)
        return (*grads, None, None)
