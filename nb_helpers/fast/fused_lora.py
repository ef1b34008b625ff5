"""QLoRA's linear layers as one autograd function each: fewer Python calls and kernel launches per step.

On a fast GPU the training step is bound by the host, not the GPU (an H200, 2026-11-30: 0.7 ms of Python per LoRA layer
call, most of it in peft's and bitsandbytes' wrappers). The math stays the recipe's:

    y = x W^T + b + s * (dropout(x) A^T) B^T        W: the NF4 weight, dequantized on the fly (never stored)

  * LoRA layers (peft's 4-bit `lora.Linear4bit`): one function dequantizes W, runs the base matmul, the dropout
    (`native_dropout`, the kernel nn.Dropout uses: the same seed draws the same mask where peft's dropout sees the
    same dtype; peft casts x to lora_A's dtype first), A, and adds s * (xA^T)B^T
    into the output inside one GEMM (`addmm_`), where peft clones the output and adds it in two more kernels. The
    backward dequantizes W again instead of keeping it, as bitsandbytes does, and computes dA, dB, dx directly.
  * Frozen 4-bit layers (the MLP's gate, up, down): dequantize + matmul in one function, without
    bitsandbytes' per-call bookkeeping.
  * Dequantization (`_dequantize`): bitsandbytes' own CUDA kernels, called directly; where they are not reachable,
    its public dequantize_4bit (the same bits, more host time).

In a checkpointed layer's recompute, the layer whose product nothing reads (fast.recompute: the MLP's down projection
in Llama-style layers) skips its matmul and hands on zeros; a LoRA layer there still computes what its backward reads.

Each patched layer falls back to its own forward whenever it is in a state this does not cover (adapters disabled or
merged, several adapters, DoRA or another variant, mixed-adapter batches).
"""

from __future__ import annotations

import types

import torch

from nb_helpers.fast import lora_dropout, recompute
from nb_helpers.fast.options import DECODED_ABSMAX, NF4_KERNEL
from nb_helpers.frontend import say_once


def _dequantize(weight, direct: bool = False):
    """W in its compute dtype. `direct`: through bitsandbytes' own CUDA kernels, called as bitsandbytes' CUDA backend
    calls them, without the per-call wrapper (argument checks, two custom-op dispatches, a fresh QuantState walk)
    that costs more host time than the kernels take on a fast GPU. Same kernels, so the same bits."""
    state, data = weight.quant_state, weight.data
    kernels = _direct_kernels() if direct and data.is_cuda else None
    if kernels is None or (state.dtype, state.quant_type) not in kernels[1] \
            or data.device.index != torch.cuda.current_device():
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(data, state)
    absmax_kernel, weight_kernels, stream_of = kernels
    stream = stream_of(data.device.index)
    absmax = state.absmax
    if state.nested:  # double quantization: kept decoded where keep_decoded_absmax ran, else decoded per call
        absmax = getattr(state, DECODED_ABSMAX, None)
        if absmax is None or absmax.device != data.device:  # none kept, or the weight moved since
            absmax = _decoded_absmax(state, absmax_kernel, stream)
    out = torch.empty(state.shape, dtype=state.dtype, device=data.device)
    if (ours := getattr(state, NF4_KERNEL, None)) is not None:  # lever nf4_kernel (use_nf4_kernel): the same bits
        return ours(data, absmax, state.code, out, state.blocksize)
    weight_kernels[state.dtype, state.quant_type](None, data.data_ptr(), absmax.data_ptr(), out.data_ptr(),
                                                  state.blocksize, out.numel(), stream)
    return out


def _decoded_absmax(state, absmax_kernel, stream):
    """Double quantization's absmax in fp32: 8-bit codes blockwise over their own fp32 absmax, plus the offset."""
    nested, codes = state.state2, state.absmax
    scales = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    absmax_kernel(nested.code.data_ptr(), codes.data_ptr(), nested.absmax.data_ptr(), scales.data_ptr(),
                  nested.blocksize, codes.numel(), stream)
    return scales.add_(state.offset)


def keep_decoded_absmax(model, budget_gib: float | None = None) -> int:
    """Decode each double-quantized weight's absmax once and keep it in fp32 beside the 8-bit codes: the base is
    frozen, so every dequantize would decode the same values again (two kernels each, 440 times a step on TinyLlama).
    Costs 4 bytes per 64 weights (58 MiB on TinyLlama-1.1B; the planner counts it), kept only where that is a small
    share of the budget (plan.architecture.keeps_decoded_absmax). Done here, before any CUDA graph is captured, never
    lazily: a value first written inside a capture would not exist outside it. Returns how many weights keep one (0
    without bitsandbytes' kernels reachable directly, or over the share)."""
    from nb_helpers.plan.architecture import ABSMAX_KEPT_SHARE, absmax_kept_bytes, keeps_decoded_absmax

    kernels, states = _direct_kernels(), _double_quantized_on_gpu(model)
    if kernels is None or not states:
        return 0
    weights = sum(state.shape.numel() for state in states)
    if not keeps_decoded_absmax(weights, budget_gib):
        say_once("absmax-once", f"[fast] absmax_once off: its {absmax_kept_bytes(weights) / 2**20:.0f} MiB would be "
                                f"over {ABSMAX_KEPT_SHARE:.0%} of the {budget_gib:.2f} GiB budget (each dequantize "
                                "decodes it instead)")
        return 0
    for state in states:
        with torch.cuda.device(state.absmax.device):
            setattr(state, DECODED_ABSMAX, _decoded_absmax(state, kernels[0], kernels[2](state.absmax.device.index)))
    return len(states)


def use_nf4_kernel(model) -> int:
    """Lever nf4_kernel: each 4-bit weight on the GPU that fast.nf4_kernel covers is dequantized by that Triton kernel
    rather than bitsandbytes' CUDA kernel (same bits, about half the GPU time). Needs the direct path (the kernel reads
    the fp32 absmax it decodes or keeps). Returns how many weights use it; 0, said once, without Triton or where
    nb_helpers.compat finds bitsandbytes' NF4 layout changed."""
    from nb_helpers import compat

    if _direct_kernels() is None:
        return 0
    if why := compat.failed(["nf4_kernel"]):
        say_once("nf4-kernel", compat.fallback_note("nf4_kernel", why["nf4_kernel"]))
        return 0
    try:
        from nb_helpers.fast import nf4_kernel
    except Exception as e:  # noqa: BLE001 - Triton missing or broken: bitsandbytes' kernel dequantizes
        say_once("nf4-kernel", f"[fast] nf4_kernel off: Triton is not importable ({type(e).__name__}); "
                               "bitsandbytes' own kernel dequantizes (the same bits)")
        return 0
    states = [(m.weight.quant_state, m.weight.data) for m in _linear4bit(model)
              if getattr(m.weight, "quant_state", None) is not None and m.weight.data.is_cuda]
    taken = [state for state, data in states if nf4_kernel.takes(state, data)]
    for state in taken:
        setattr(state, NF4_KERNEL, nf4_kernel.dequantize_into)
    return len(taken)


def _linear4bit(model) -> list:
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _double_quantized_on_gpu(model) -> list:
    states = [getattr(m.weight, "quant_state", None) for m in _linear4bit(model)]
    return [state for state in states if state is not None and state.nested and state.absmax.is_cuda]


def frozen_linear(x, weight, bias=None, direct: bool = False):
    """x W^T + b with W the NF4 weight dequantized on the fly, in x's dtype."""
    return torch.nn.functional.linear(x, _dequantize(weight, direct).to(x.dtype), None if bias is None else
                                      bias.to(x.dtype))


_KERNELS: list = []  # probed once: [(None, why)] or [((absmax kernel, {(dtype, quant): weight kernel}, stream), None)]


def _direct_kernels():
    if not _KERNELS:
        _KERNELS.append(_probe_kernels())
    return _KERNELS[0][0]


def direct_kernels_unavailable_reason() -> str | None:
    """Why bitsandbytes' dequantize kernels cannot be called directly here (then its public dequantize_4bit runs),
    or None when they can."""
    _direct_kernels()
    return _KERNELS[0][1]


def _probe_kernels():
    """bitsandbytes' dequantize kernels with the argument types its CUDA backend declares, and None; or None and why
    not (a CPU-only build, or internals that nb_helpers.compat finds changed)."""
    from nb_helpers import compat

    try:
        return compat.dequantize_kernels(), None
    except Exception as e:  # noqa: BLE001 - any import or attribute change in bitsandbytes' internals
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def _lora_linear(x, weight, bias, lora_a, lora_b, scaling: float, dropout_p: float, direct: bool, dead: bool = False,
                 dropout_kernels: bool = False, down=None):
    """The forward's math, and what its backward needs. Called directly under no_grad (a checkpoint's first forward,
    evaluation): no autograd Function to set up around it, the same kernels and the same dropout draws. `dead`: the
    output is read by nothing (fast.recompute), so the base product is skipped and zeros stand for it.
    `dropout_kernels`: the dropout is drawn inside the rank-r products (fast.lora_dropout), from a seed the backward
    keeps instead of a dropped copy and a mask. `down`: the rank-r product this call's checkpointed forward made
    (fast.recompute.stashed), reused, not remade."""
    flat = x.reshape(-1, x.shape[-1])
    a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
    base = None if dead else _dequantize(weight, direct).to(x.dtype)
    if dropout_p > 0 and dropout_kernels and lora_dropout.usable(flat, a, b.shape[0]):
        seed = lora_dropout.draw_seed(flat.device)  # drawn even when reused: the generator moves as in the forward
        if down is not None and down.shape == (flat.shape[0], a.shape[0]) and down.dtype == flat.dtype:
            out = None if dead else lora_dropout.out_from_down(down, b, scaling)
        else:
            down, out = lora_dropout.dropped_down(flat, a, b, seed, dropout_p, scaling, write_out=not dead)
        if not dead:  # LoRA's share first: the base GEMM adds into it (beta=1), no separate pass over the output
            out.addmm_(flat, base.t())
            if bias is not None:
                out.add_(bias.to(x.dtype))
        saved = (flat, down, None, a, b, seed)  # the input itself, no copy: the backward redraws the mask
    else:
        dropped, mask = torch.native_dropout(flat, dropout_p, True) if dropout_p > 0 else (flat, None)
        down = dropped @ a.t()
        if not dead:
            out = torch.nn.functional.linear(flat, base, None if bias is None else bias.to(x.dtype))
            out.addmm_(down, b.t(), alpha=scaling)
        saved = (dropped, down, mask, a, b, None)
    if dead:
        out = down.new_zeros(flat.shape[0], b.shape[0])
    return out.view(*x.shape[:-1], out.shape[-1]), saved


class LoRA4bitLinear(torch.autograd.Function):
    """y = x W^T + b + s * dropout(x) A^T B^T, with W in NF4; gradients for x, A and B only (the base is frozen)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, dropout_p: float, direct: bool = False,
                dead: bool = False, dropout_kernels: bool = False, down=None):
        out, saved = _lora_linear(x, weight, bias, lora_a, lora_b, scaling, dropout_p, direct, dead, dropout_kernels,
                                  down=down)
        ctx.save_for_backward(*saved)
        ctx.weight, ctx.scaling, ctx.dropout_p, ctx.direct = weight, scaling, dropout_p, direct
        ctx.dtypes = (lora_a.dtype, lora_b.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        dropped, down, mask, a, b, seed = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1]).to(dropped.dtype)
        grad_down, grad_b = rank_grads(grad, b, down, ctx.scaling)
        if seed is not None:  # `dropped` is the input itself: the kernels redraw the forward's mask from the seed
            grad_a, grad_x = lora_dropout.grads(grad_down, dropped, a, seed, ctx.dropout_p)
        else:
            grad_a = grad_down.t() @ dropped  # (r, in)
            grad_x = grad_down @ a  # LoRA's share first: the base's GEMM then adds into it (beta=1), no separate add
            if mask is not None:
                grad_x = torch.ops.aten.native_dropout_backward(grad_x, mask, 1.0 / (1.0 - ctx.dropout_p))
        grad_x.addmm_(grad, _dequantize(ctx.weight, ctx.direct).to(grad.dtype))
        return (grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1]), None, None,
                grad_a.to(ctx.dtypes[0]), grad_b.to(ctx.dtypes[1]), None, None, None, None, None, None)


def rank_grads(grad, b, down, scaling: float):
    """(grad_down, grad_B) = (s grad B, s grad^T down): tokens x r and outputs x r. s is applied in each GEMM's epilogue
    (beta=0: the uninitialised first argument is not read), not in a pass of its own."""
    grad_down = torch.addmm(grad.new_empty(grad.shape[0], b.shape[1]), grad, b, beta=0, alpha=scaling)
    return grad_down, torch.addmm(grad.new_empty(grad.shape[1], down.shape[1]), grad.t(), down, beta=0, alpha=scaling)


class Frozen4bitLinear(torch.autograd.Function):
    """y = x W^T + b with W in NF4; the backward dequantizes W again (nothing but x's gradient is needed). `dead`: the
    output is read by nothing (fast.recompute): zeros stand for it, and the backward is the same."""

    @staticmethod
    def forward(ctx, x, weight, bias, direct: bool = False, dead: bool = False):
        ctx.weight, ctx.direct = weight, direct
        if dead:
            kind = x.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
            return x.new_zeros(*x.shape[:-1], weight.quant_state.shape[0], dtype=dtype)
        return torch.nn.functional.linear(x, _dequantize(weight, direct).to(x.dtype), None if bias is None else
                                          bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out @ _dequantize(ctx.weight, ctx.direct).to(grad_out.dtype), None, None, None, None


def plain_adapter(layer) -> str | None:
    """The one active adapter of a patched LoRA layer in the state the fused function covers, else None (adapters
    disabled or merged, several adapters, DoRA or another variant: the layer's own forward runs)."""
    adapters = [name for name in layer.active_adapters if name in layer.lora_A]
    if layer.disable_adapters or layer.merged or len(adapters) != 1 or adapters[0] in layer.lora_variant:
        return None
    return adapters[0]


def lora_args(layer, x, name: str) -> tuple:
    """LoRA4bitLinear's arguments for `layer` (a patched LoRA layer) and adapter `name`, up to `direct`."""
    base = layer.get_base_layer()
    p = float(getattr(layer.lora_dropout[name], "p", 0.0)) if layer.training else 0.0
    return (x, base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight,
            float(layer.scaling[name]), p, layer._nb_direct)


def _lora_forward(self, x, *args, **kwargs):
    name = plain_adapter(self)
    if args or kwargs or name is None:
        return type(self).forward(self, x, *args, **kwargs)
    args = lora_args(self, x, name)
    if not torch.is_grad_enabled():
        out, saved = _lora_linear(*args, False, self._nb_dropout_kernels)
        stash = recompute.stash_of_forward()
        if stash is not None and saved[5] is not None:  # the kernels' rank-r product, for this checkpoint's recompute
            stash[self] = saved[1]
        return out
    out = LoRA4bitLinear.apply(*args, recompute.is_dead(self), self._nb_dropout_kernels, recompute.stashed(self))
    recompute.returned(self)
    return out


def _frozen_forward(self, x):
    if getattr(self.weight, "quant_state", None) is None or getattr(self.weight.quant_state, "packing_format_for_cpu",
                                                                     False):
        return type(self).forward(self, x)
    if not torch.is_grad_enabled():  # no autograd Function to set up: the same dequantize and matmul
        return frozen_linear(x, self.weight, self.bias, self._nb_direct)
    out = Frozen4bitLinear.apply(x, self.weight, self.bias, self._nb_direct, recompute.is_dead(self))
    recompute.returned(self)
    return out


def install(model, direct_dequant: bool = True, dropout_kernels: bool = False) -> int:
    """Route every 4-bit linear layer of a peft-wrapped model through the fused functions. Returns how many layers
    were patched (0 where bitsandbytes' 4-bit layers are absent). The fast path calls it on CUDA only: on a CPU,
    bitsandbytes repacks weights for its own inference kernels, and the CPU path keeps the code its results were
    measured with. `direct_dequant`: bitsandbytes' dequantize kernels without their Python wrapper (see _dequantize)."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    # a LoRA layer calls its base layer itself, and the fused LoRA function replaces that call: leave those alone
    wrapped = {id(m.get_base_layer()) for m in model.modules() if isinstance(m, LoraLayer)}
    patched = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and isinstance(module.get_base_layer(), bnb.nn.Linear4bit):
            module.forward, module._nb_direct = types.MethodType(_lora_forward, module), direct_dequant
            module._nb_dropout_kernels = dropout_kernels
            patched += 1
        elif isinstance(module, bnb.nn.Linear4bit) and id(module) not in wrapped:
            module.forward, module._nb_direct = types.MethodType(_frozen_forward, module), direct_dequant
            patched += 1
    return patched


def apply_fused_lora(model, verbose: bool = True, direct_dequant: bool = True, dropout_kernels: bool = False) -> bool:
    """Route the 4-bit layers through the fused functions (same math, fewer host calls). CUDA only.
    `dropout_kernels`: LoRA's dropout inside the rank-r products (fast.lora_dropout) where Triton imports."""
    if not torch.cuda.is_available():
        if verbose:
            say_once("fused-lora", "[fast] fused QLoRA layers off: no CUDA GPU; peft's and bitsandbytes' layers run")
        return False
    count = install(model, direct_dequant=direct_dequant and direct_dequant_available(verbose),
                    dropout_kernels=dropout_kernels and lora_dropout.kernels() is not None)
    if verbose:
        say_once("fused-lora-on", f"[fast] {count} 4-bit layers run as fused QLoRA functions (one call each)")
    return count > 0


def direct_dequant_available(verbose: bool = True) -> bool:
    """Whether the fused layers can call bitsandbytes' dequantize kernels directly; if not, says once why."""
    reason = direct_kernels_unavailable_reason()
    if reason is not None and verbose:
        say_once("direct-dequant", f"[fast] bitsandbytes' dequantize kernels are not reachable directly ({reason}); "
                                   "using its public dequantize_4bit (same result, more host time per call)")
    return reason is None
