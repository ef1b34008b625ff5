"""Llama's decoder layer with fewer elementwise kernels, the same math (lever `fused_block`).

With the fused 4-bit layers (fast.fused_lora) and liger's kernels, a Llama layer still runs passes over its
activations whose work a neighbour can do. At 8 x 2048 tokens on an H200 one pass over the hidden states takes about
60 us and one over the MLP's intermediate about 130 us, 22 layers a step (2026-12-02):

  * The MLP (gate, up, SwiGLU, down) is one autograd function where its three projections are frozen 4-bit layers
    (LoRA on q,k,v,o). Its backward adds up's input gradient inside gate's GEMM (`addmm_`), not in a separate add.
    In a checkpointed recompute whose down projection is dead (fast.recompute), neither SwiGLU's product nor down
    runs: the backward reads only gate's and up's outputs.
  * The residual add before the MLP's norm and the norm itself are liger-kernel's fused add + RMSNorm: one kernel
    forward, one backward (which adds the residual's gradient too), where the stock layer runs two each way.
  * The layer's LoRA layers (q, k, v, o) draw their dropout seeds (fast.lora_dropout) in one kernel, where each drew
    its own: 4 small kernels a layer pass become 1.
  * The layer's last residual add, in such a recompute, is skipped: its value is thrown away (the checkpoint's
    backward needs only the gradient path), so an uninitialised tensor with the add's backward stands for it. Under
    no_grad (a checkpoint's first forward, evaluation) that add runs inside down's GEMM instead (beta=1).

Each piece runs only where it applies, and the stock code runs otherwise: LoRA or a bias on the MLP, an activation
other than SiLU, no liger (CPU) for the norm. nb_helpers.compat checks that Llama's layer still has the shape
copied here.
"""

from __future__ import annotations

import types

import torch

from nb_helpers.fast import frozen_norms, lora_dropout, recompute, saved_attention
from nb_helpers.fast.fused_lora import _dequantize, frozen_linear


def _swiglu(gate, up, liger: bool):
    if liger:
        from liger_kernel.ops.swiglu import swiglu_forward

        return swiglu_forward(gate, up, 1.0)[2]
    return torch.nn.functional.silu(gate) * up


def _swiglu_backward(gate, up, grad, liger: bool):
    """(gate's gradient, up's gradient). liger's kernel writes them over `gate` and `up`, which are not read again."""
    if liger:
        from liger_kernel.ops.swiglu import swiglu_backward

        return swiglu_backward(gate, up, grad, 1.0)
    wide = torch.promote_types(gate.dtype, torch.float32)  # bf16's products rounded once, at the end
    gate32, up32, grad32 = gate.to(wide), up.to(wide), grad.to(wide)
    sigmoid = torch.sigmoid(gate32)
    return ((grad32 * up32 * sigmoid * (1 + gate32 * (1 - sigmoid))).to(gate.dtype),
            (grad32 * gate32 * sigmoid).to(up.dtype))


def _mlp(x, gate, up, down, direct: bool, liger: bool, dead: bool = False, residual=None):
    """(the MLP's output, gate's output, up's output). Called directly under no_grad (a checkpoint's first forward,
    evaluation): the same kernels without an autograd function to set up. `residual`: added inside down's GEMM
    (beta=1), where the layer would add it in a pass of its own over the output (rounded once instead of twice). The
    GEMM writes over it: the norm before the MLP made it and nothing else reads it, and torch's out-of-place addmm
    would first copy it (a 64 MiB copy a layer at 8 x 2048 on TinyLlama, 47 us on an H100 with the GPU's compute
    waiting)."""
    # each dequantized weight is freed before the next one is made
    gate_out = torch.nn.functional.linear(x, _dequantize(gate, direct).to(x.dtype))
    up_out = torch.nn.functional.linear(x, _dequantize(up, direct).to(x.dtype))
    if dead:  # read by nothing (the layer's last add is thrown away too): no values written
        out = gate_out.new_empty(*x.shape[:-1], down.quant_state.shape[0])
    elif residual is not None:
        act = _swiglu(gate_out, up_out, liger)
        out = residual.reshape(-1, residual.shape[-1]).addmm_(act.reshape(-1, act.shape[-1]),
                                                              _dequantize(down, direct).to(x.dtype).t())
        out = out.view(residual.shape)
    else:
        out = frozen_linear(_swiglu(gate_out, up_out, liger), down, direct=direct)
    return out, gate_out, up_out


class FrozenMLP4bit(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)), the three weights NF4 and frozen: x's gradient only. `dead`: the output is read by
    nothing (fast.recompute): only what the backward reads (gate's and up's outputs) is computed. The backward
    dequantizes the three weights again, one at a time."""

    @staticmethod
    def forward(ctx, x, gate, up, down, direct: bool, liger: bool, dead: bool):
        out, gate_out, up_out = _mlp(x, gate, up, down, direct, liger, dead)
        ctx.save_for_backward(gate_out, up_out)
        ctx.weights, ctx.direct, ctx.liger = (gate, up, down), direct, liger
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate_out, up_out = ctx.saved_tensors
        gate, up, down = ctx.weights
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_act = grad @ _dequantize(down, ctx.direct).to(grad.dtype)  # one weight dequantized at a time
        grad_gate, grad_up = _swiglu_backward(gate_out.view(grad.shape[0], -1), up_out.view(grad.shape[0], -1),
                                              grad_act, ctx.liger)
        del grad_act
        grad_x = grad_gate @ _dequantize(gate, ctx.direct).to(grad.dtype)
        grad_x.addmm_(grad_up, _dequantize(up, ctx.direct).to(grad.dtype))  # up's share in the GEMM
        return grad_x.view(*grad_out.shape[:-1], -1), None, None, None, None, None, None


class _ThrownAwayAdd(torch.autograd.Function):
    """a + b where the value is read by nothing: the gradient of an add, no kernel forward."""

    @staticmethod
    def forward(ctx, a, b):
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def _mlp_forward(self, x, residual=None):
    """The MLP's output; under no_grad with `residual`, residual + that output, the add inside down's GEMM."""
    weights = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
    if not torch.is_grad_enabled():
        return _mlp(x, *weights, self._nb_direct, self._nb_liger, residual=residual)[0]
    out = FrozenMLP4bit.apply(x, *weights, self._nb_direct, self._nb_liger, recompute.is_dead(self.down_proj))
    recompute.returned(self.down_proj)
    return out


def _add_norm(hidden_states, residual, norm, liger: bool, frozen: bool = False):
    """(norm(residual + hidden_states), residual + hidden_states); `frozen`: lever frozen_norms' backward."""
    if frozen:
        return frozen_norms.add_norm(hidden_states, residual, norm)
    if liger:
        from liger_kernel.ops import LigerFusedAddRMSNormFunction

        return LigerFusedAddRMSNormFunction.apply(hidden_states, residual, norm.weight, norm.variance_epsilon,
                                                  norm.offset, norm.casting_mode, norm.in_place)
    summed = residual + hidden_states
    return norm(summed), summed


def _layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache=False, position_embeddings=None, **kwargs):
    """transformers' LlamaDecoderLayer.forward, with the post-attention add and norm fused and the last add skipped
    where its value is thrown away; its LoRA layers' dropout seeds drawn in one kernel."""
    with lora_dropout.drawn_together(self._nb_lora_layers):
        return _layer_body(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                           position_embeddings, **kwargs)


def _layer_body(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache, position_embeddings,
                **kwargs):
    if self._nb_frozen_norms:  # the input's two gradients summed inside the norm's backward kernel
        hidden_states, residual = frozen_norms.norm_keeping_input(hidden_states, self.input_layernorm)
    else:
        residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states, residual = _add_norm(hidden_states, residual, self.post_attention_layernorm, self._nb_liger_norm,
                                        self._nb_frozen_norms)
    if not torch.is_grad_enabled() and hasattr(self.mlp, "_nb_liger") and residual.dtype == hidden_states.dtype:
        return self.mlp(hidden_states, residual=residual)  # the fused MLP: the last add inside its down GEMM
    hidden_states = self.mlp(hidden_states)
    if recompute.is_dead(self.mlp.down_proj):
        return _ThrownAwayAdd.apply(residual, hidden_states)
    return residual + hidden_states


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                       **kwargs):
    """transformers' LlamaAttention.forward, with the attention a checkpoint's forward kept reused by its recompute
    (fast.saved_attention)."""
    from transformers.models.llama import modeling_llama as llama

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = llama.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    attend = llama.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, llama.eager_attention_forward)
    attn_output, attn_weights = saved_attention.attend(
        self, query_states, key_states, value_states, attention_mask, attend,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()), attn_weights


def _frozen_mlp(mlp, config) -> bool:
    """gate, up and down are frozen 4-bit layers the fused functions run (fast.fused_lora), without bias, under SiLU."""
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return getattr(config, "hidden_act", None) in ("silu", "swish") and all(
        hasattr(p, "_nb_direct") and getattr(p.weight, "quant_state", None) is not None and p.bias is None
        and not hasattr(p, "lora_A") for p in parts)


def _liger_norm(norm) -> bool:
    """liger-kernel's RMSNorm in Llama's form (fast.kernels patched it)."""
    return getattr(norm, "casting_mode", None) == "llama" and getattr(norm, "offset", None) == 0.0 \
        and getattr(norm, "row_mode", None) is None and getattr(norm, "weight", None) is not None


def lora_layer_count(layer) -> int:
    """How many LoRA layers a decoder layer holds: the seeds its pass draws together (lora_dropout.drawn_together)."""
    from peft.tuners.lora import LoraLayer

    return sum(isinstance(m, LoraLayer) for m in layer.modules())


def install(model, liger: bool, frozen: bool = False, saved: bool = False) -> dict[str, int]:
    """Route each Llama decoder layer through _layer_forward, and each MLP whose projections are frozen 4-bit layers
    through FrozenMLP4bit. `liger`: liger-kernel's kernels run here (fast.kernels); `frozen`: lever frozen_norms, where
    both of a layer's norms are liger's with frozen weights; `saved`: lever saved_attention may act in each attention
    (fast.saved_attention; fast.checkpoints switches it per layer), which then runs a copy of Llama's attention
    forward. Returns how many layers, MLPs, fused norms, layers with frozen_norms' backward and attentions with
    saved_attention were patched."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    from nb_helpers.fast.mask import decoder_of

    counts = {"layers": 0, "mlps": 0, "norms": 0, "frozen_norms": 0, "saved_attention": 0}
    decoder = decoder_of(model)
    for layer in getattr(decoder, "layers", []):
        if type(layer) is not LlamaDecoderLayer:
            continue
        layer._nb_liger_norm = liger and _liger_norm(layer.post_attention_layernorm)
        layer._nb_frozen_norms = frozen and layer._nb_liger_norm and _liger_norm(layer.input_layernorm) and all(
            frozen_norms.takes(n) for n in (layer.input_layernorm, layer.post_attention_layernorm))
        layer._nb_lora_layers = lora_layer_count(layer)
        layer.forward = types.MethodType(_layer_forward, layer)
        counts["layers"] += 1
        counts["norms"] += layer._nb_liger_norm
        counts["frozen_norms"] += layer._nb_frozen_norms
        attention = layer.self_attn
        if type(attention) is LlamaAttention and saved:
            attention.forward = types.MethodType(_attention_forward, attention)
            counts["saved_attention"] += 1
        if _frozen_mlp(layer.mlp, decoder.config):
            mlp = layer.mlp
            mlp._nb_direct, mlp._nb_liger = mlp.gate_proj._nb_direct, liger
            mlp.forward = types.MethodType(_mlp_forward, mlp)
            counts["mlps"] += 1
    return counts


def apply_fused_block(model, liger: bool, verbose: bool = True, frozen: bool = False,
                      saved: bool = False) -> dict[str, int]:
    """install(), and one line saying what it patched (counts["layers"] is 0 where the model has no Llama layers)."""
    from nb_helpers.frontend import say_once

    counts = install(model, liger, frozen, saved)
    if verbose and counts["layers"]:
        say_once("fused-block", f"[fast] {counts['layers']} Llama layers with {counts['mlps']} MLPs as one function "
                                f"each and {counts['norms']} fused add + RMSNorm ({counts['frozen_norms']} with the "
                                f"frozen norms' backward)")
    elif verbose:
        say_once("fused-block-off", "[fast] fused layer blocks off: not Llama decoder layers (the stock layers run)")
    return counts
