"""q, k and v of an attention layer as one autograd function: their input's gradient written once (lever qkv_once).

The three projections read the same normed hidden states. As three fused LoRA layers (fast.fused_lora), each backward
reads that input again to redraw its dropout mask, writes its own share of the input's gradient, and autograd then
adds the three in two more passes over hidden-state-sized tensors. Here one kernel (fast.lora_dropout.shared_grads)
reads the input once, draws each projection's own mask, and writes the sum of the three shares, into which the three
base GEMMs then add (beta=1). The forward is the three fused layers' forward in the same order: the same seeds drawn,
the same outputs. Where the three do not all take the dropout kernels alike (no Triton, dropout off in evaluation,
other ranks or dropout rates, another adapter state), they run one by one as before.
"""

from __future__ import annotations

import torch

from nb_helpers.fast import fused_lora, lora_dropout, recompute


def takes(attention) -> bool:
    """Whether this attention module's q, k and v are fused LoRA layers with the dropout kernels (fast.fused_lora)."""
    layers = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    return all(getattr(layer, "_nb_dropout_kernels", False) and hasattr(layer, "lora_A") for layer in layers)


def _shared_call(layers, x):
    """Each layer's LoRA4bitLinear arguments, where all three take the kernels with one dropout rate and rank; else
    None."""
    names = [fused_lora.plain_adapter(layer) for layer in layers]
    if None in names or not torch.is_grad_enabled():
        return None
    calls = [fused_lora.lora_args(layer, x, name) for layer, name in zip(layers, names)]
    flat = x.reshape(-1, x.shape[-1])
    p, rank = calls[0][6], calls[0][3].shape[0]
    alike = all(call[6] == p and call[3].shape[0] == rank for call in calls)
    if not (alike and p > 0 and all(lora_dropout.usable(flat, call[3], call[4].shape[0]) for call in calls)):
        return None
    return calls


def project(attention, x):
    """(q, k, v) = the attention's three projections of x: one function where they take it, else one call each."""
    layers = attention.q_proj, attention.k_proj, attention.v_proj
    calls = _shared_call(layers, x) if getattr(attention, "_nb_qkv_once", False) else None
    if calls is None:
        return tuple(layer(x) for layer in layers)
    specs = tuple((call[1], call[2], call[5]) for call in calls)  # (weight, bias, scaling)
    adapters = [t for call in calls for t in (call[3], call[4])]
    downs = tuple(recompute.stashed(layer) for layer in layers)
    outs = LoRA4bitQKV.apply(x, specs, calls[0][6], calls[0][7], downs, *adapters)
    for layer in layers:
        recompute.returned(layer)
    return outs


class LoRA4bitQKV(torch.autograd.Function):
    """Three LoRA4bitLinear layers on one input x, each with the dropout kernels: gradients for x and each A and B."""

    @staticmethod
    def forward(ctx, x, specs, dropout_p: float, direct: bool, downs, *adapters):
        keep = recompute.keeps_weights()
        outs, saved = [], []
        for (weight, bias, scaling), down, a, b in zip(specs, downs, adapters[0::2], adapters[1::2]):
            out, kept = fused_lora._lora_linear(x, weight, bias, a, b, scaling, dropout_p, direct, False, True,
                                                keep=keep, down=down)
            outs.append(out)
            saved.extend(kept[1:2] + kept[3:])  # down, a, b, seed, the kept weight: flat is x itself, no mask
        ctx.save_for_backward(x.reshape(-1, x.shape[-1]), *saved)
        ctx.specs, ctx.dropout_p, ctx.direct = specs, dropout_p, direct
        ctx.dtypes = tuple(t.dtype for t in adapters)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        flat, *saved = ctx.saved_tensors
        layers = [saved[i:i + 5] for i in range(0, len(saved), 5)]  # (down, a, b, seed, kept) each
        grads = [g.reshape(-1, g.shape[-1]).to(flat.dtype) for g in grad_outs]
        ranked = [fused_lora.rank_grads(g, b, down, scaling)
                  for g, (down, _, b, _, _), (_, _, scaling) in zip(grads, layers, ctx.specs)]
        grad_as, grad_x = lora_dropout.shared_grads([gd for gd, _ in ranked], flat, [layer[1] for layer in layers],
                                                    [layer[3] for layer in layers], ctx.dropout_p)
        for g, (_, _, _, _, kept), (weight, _, _) in zip(grads, layers, ctx.specs):  # each base GEMM adds into it
            grad_x.addmm_(g, fused_lora._weight_for_backward(kept, weight, ctx.direct, g.dtype))
        adapter_grads = [t for grad_a, (_, grad_b) in zip(grad_as, ranked) for t in (grad_a, grad_b)]
        return (grad_x.view(*grad_outs[0].shape[:-1], -1), None, None, None, None,
                *(g.to(dtype) for g, dtype in zip(adapter_grads, ctx.dtypes)))
