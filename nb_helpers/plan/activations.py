"""The dynamic part of the planner's prediction (nb_helpers.plan.planner.plan): the activations saved for backward,
the fused LM head and loss, the fp32 upcast while loading and the transients at the peak, per phase of a training
step. Symbols as in nb_helpers.plan.planner: h hidden size, i MLP size, L layers, V vocabulary, nh/nkv query/key-value
heads of size hd, r LoRA rank, T tokens per forward pass, N tokens that carry a label.

Activations, per token of one decoder layer, as saved for backward (bench/saved_tensors.py counts them with
saved-tensor hooks in a real training step; on the CPU the count matches this formula to the byte)
  * RMSNorm (fused rms_norm): its fp32 input (the residual stream is fp32 because the embedding is) and one fp32
    rstd per token, twice per layer: 2 * (4h + 4).
  * Attention (SDPA under bf16 autocast): q, k, v and the output in bf16, plus fp32 log-sum-exp per head:
    4*nh*hd + 4*nkv*hd + 4*nh without padding (flash kernel, native GQA). A padded micro-batch carries a mask, so
    transformers repeats k and v to all heads first (repeat_kv) and SDPA uses the memory-efficient kernel:
    8*nh*hd + 4*nh, plus one bool (b, 1, s, s) mask shared by all layers, which SDPA turns into an additive
    (b, 1, s, s) bias in the compute dtype that each layer keeps: 2*s more per token.
  * MLP: bitsandbytes returns fp32 for fp32 inputs, so gate and up outputs are fp32; SiLU saves its input and the
    product saves both factors: 3 * 4i.
  * LoRA, per target layer: dropout's output in the compute dtype (2 bytes per input feature; autocast's input to
    lora_A), its bool mask (1 byte, none when dropout is 0), and lora_A's output (2r), which lora_B saves. With the
    GPU path's dropout kernels (fast.lora_dropout), no copy and no mask: the input itself, once per tensor read.
    MatMul4Bit saves no input (it never computes a weight gradient), so frozen layers add nothing.
  * With gradient checkpointing only each layer's fp32 input is kept (4h per token per layer); one layer's full
    activations are rebuilt during its backward pass. The last `no_recompute_layers` layers (RunConfig) keep their
    full activations instead and are not rebuilt.
Loss and LM head (TRL 1.16's fused, chunked log-prob kernel, `trl.kernels.chunked_logprob`)
  * It never builds the (T, V) logits: it saves the fp32 final hidden states of the labelled tokens (4h*N) and
    projects them in tiles of up to 4096 tokens x 32768 vocabulary entries (compute dtype), with the tile's slice of
    the fp32 head cast to the compute dtype. Backward adds an fp32 gradient of the hidden states.
  * The final norm keeps its fp32 input (4h*T).
Loading
  * prepare_model_for_kbit_training casts the embedding and head to fp32 one tensor at a time, so for a moment the
    largest exists twice (16-bit and fp32): 2*V*h more. With a big tied vocabulary (Llama-3.2-3B) and short
    sequences, that moment is the peak of the whole run.
Transients at the peak
  * The backward of the MLP of the layer being processed: the fp32 gradients of the two factors of gate*up
    (2 * 4i per token: what the GPU grid shows; counting the product's own gradient too, 3 * 4i, overshot every
    point by a third of that term),
    two fp32 residual-stream gradients (2 * 4h) and one dequantized 16-bit weight (bitsandbytes dequantizes, then
    matmuls: 2*h*i bytes for the largest layer).

Measured (on an H200; the runs are in bench/results/runs/)
  * CUDA-graphed layers (the fast path's, where auto-fit or cuda_graphs asks; nb_helpers.fast.graphed_layers): one memory pool holds a layer's recompute and
    backward for every graph, at all times, measured at GRAPH_POOL_FACTOR x what that work needs eagerly, plus two
    hidden states of shared buffers and GRAPH_OVERHEAD_GIB outside the pool. The layer's eager transients leave the
    last layer's backward phase, so the peak usually moves to the loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nb_helpers.plan.architecture import Shape, plan_targets, recomputed_layers

if TYPE_CHECKING:
    from nb_helpers.plan.planner import PlanInput

GIB = 2**30
LOGPROB_TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
LOGPROB_VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
# CUDA-graphed layers (nb_helpers.fast.graphed_layers), fitted on five TinyLlama runs of bench/throughput.py (H200,
# 2026-12-01): their memory pool holds GRAPH_POOL_FACTOR x one layer's recompute-and-backward working memory
# (the graphs' allocations cannot be packed as tightly as eager ones, which reuse freed blocks of any stream), and
# GRAPH_OVERHEAD_GIB sits outside it (the capture stream's cuBLAS workspace, the graphs themselves)
GRAPH_POOL_FACTOR = 2.4
GRAPH_OVERHEAD_GIB = 0.07
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Families the GPU path runs with liger's fused RMSNorm and SwiGLU (nb_helpers.fast.kernels wires Llama only); the
# others run the stock layers whatever PlanInput.fused_kernels says.
FUSED_KERNEL_FAMILIES = ("llama",)


def residual_bytes(inp: PlanInput) -> int:
    """Bytes per element of the residual stream: the compute dtype on the lean path, fp32 after peft's upcast."""
    return DTYPE_BYTES[inp.compute_dtype] if inp.lean else 4


def fused_kernels_apply(shape: Shape, inp: PlanInput) -> bool:
    return inp.fused_kernels and shape.family in FUSED_KERNEL_FAMILIES


def layer_activation_bytes_per_token(shape: Shape, inp: PlanInput, padded: bool, sliding: bool = False) -> float:
    """Bytes one decoder layer saves for backward, per token (GC off), bf16/fp16 autocast. `sliding`: a layer that
    attends within a window shorter than the sequence (it needs a mask)."""
    h, i, nh, nkv, hd = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim
    rb = residual_bytes(inp)
    fused = fused_kernels_apply(shape, inp)
    # liger's RMSNorm saves its 16-bit input; the stock norms (and Gemma's always) save an fp32 copy of it
    norm_input = rb if fused else 4
    norms = shape.norms_per_layer * (norm_input * h + 4)
    if shape.qk_norm:  # stock RMSNorm on every query and key head: fp32 copy + one rstd per head
        norms += 4 * (nh + nkv) * hd + 4 * (nh + nkv)
    masked = (padded and not inp.nomask) or sliding
    attention = (8 * nh * hd if masked else 4 * nh * hd + 4 * nkv * hd) + 4 * nh
    if masked:  # the efficient kernel turns the bool mask into an additive bias in the compute dtype, kept per layer
        attention += 2 * inp.seq
    if shape.fused and (not masked or nkv == nh):  # v is a view of the fused qkv output, which stays alive whole
        attention += 2 * (nh + nkv) * hd
    mlp = (2 if fused else 3) * rb * i
    return norms + attention + mlp + lora_bytes_per_token(shape, inp)


# The tensor each LoRA target reads: targets that read one input save it once; o_proj's is the attention output,
# which the attention saves anyway (counted there)
LORA_INPUTS = {"q_proj": "attention input", "k_proj": "attention input", "v_proj": "attention input",
               "qkv_proj": "attention input", "o_proj": None, "gate_proj": "MLP input", "up_proj": "MLP input",
               "gate_up_proj": "MLP input", "down_proj": "MLP activation"}


def lora_bytes_per_token(shape: Shape, inp: PlanInput) -> float:
    """What the LoRA branches save, per token of one layer: with torch's dropout, each target's dropped copy and bool
    mask; with the dropout kernels (fast.lora_dropout), the input each group of targets reads, once; and lora_A's
    output (2r) for every target."""
    dims, targets = shape.linear_dims(), plan_targets(shape, inp.targets)
    down = 2 * inp.rank * len(targets)
    if inp.lora_dropout > 0 and inp.dropout_kernels:
        inputs = {LORA_INPUTS.get(t, t): 2 * dims[t][0] for t in targets if LORA_INPUTS.get(t, t) is not None}
        return down + sum(inputs.values())
    mask = 1 if inp.lora_dropout > 0 else 0
    return down + sum((2 + mask) * dims[t][0] for t in targets)


def stashed_down_bytes(shape: Shape, inp: PlanInput) -> float:
    """Each recomputed layer's LoRA products dropout(x) A^T (tokens x r, 16-bit, every target), which its checkpointed
    forward keeps for the recompute (lever down_once, fast.recompute): alive from the forward to that layer's
    backward."""
    if not (inp.down_once and inp.dropout_kernels and inp.lora_dropout > 0):
        return 0.0
    return recomputed_layers(shape, inp) * inp.tokens * 2 * inp.rank * len(plan_targets(shape, inp.targets))


def saved_attention_runs(shape: Shape, inp: PlanInput) -> bool:
    """Lever saved_attention (fast.saved_attention): Llama layers whose checkpoints go to CPU RAM, eagerly, with the
    recompute's stash (down_once)."""
    return bool(getattr(inp, "saved_attention", False) and shape.family == "llama" and inp.gradient_checkpointing
                and inp.offload and not inp.graphs and inp.down_once and inp.dead_tail)


def saved_attention_bytes(shape: Shape, inp: PlanInput) -> float:
    """One recomputed layer's attention output (compute dtype) and log-sum-exp (fp32, per head), which its offloaded
    forward sends to CPU RAM and its backward fetches back (0 where the lever does not run)."""
    if not saved_attention_runs(shape, inp):
        return 0.0
    return inp.tokens * shape.heads * (shape.head_dim * DTYPE_BYTES[inp.compute_dtype] + 4)


def copied_layers(shape: Shape, inp: PlanInput) -> tuple[int, int]:
    """(layer inputs, layer attentions) that checkpoints in CPU RAM copy out and back each micro-step: the recomputed
    layers' but the first layer's input (the embedding output, a leaf autograd keeps on the card) and, on the eager
    path, the last recomputed layer's, whose backward comes first (fast.offload keeps it on the card). Attentions
    only where lever saved_attention runs."""
    layers = recomputed_layers(shape, inp) if inp.offload else 0
    if not layers:
        return 0, 0
    on_card = 0 if inp.graphs else 1
    return max(0, layers - 1 - on_card), (layers - on_card if saved_attention_runs(shape, inp) else 0)


def sliding_layers_masked(shape: Shape, inp: PlanInput) -> int:
    """Layers whose window is shorter than the sequence: they run with a mask (a window as long as the sequence
    changes nothing, and transformers skips the mask then)."""
    return shape.sliding_layers if shape.sliding_window and inp.seq > shape.sliding_window else 0


def kept_activation_bytes(shape: Shape, inp: PlanInput, padded: bool) -> tuple[float, float]:
    """Activations kept across layers for the backward pass (every layer's, or its checkpoint with GC, plus what all
    layers share and the final norm's input), and the bytes per token of the layer being recomputed."""
    h, L, T = shape.hidden, shape.layers, inp.tokens
    rb = residual_bytes(inp)
    per_layer = layer_activation_bytes_per_token(shape, inp, padded)
    sliding = sliding_layers_masked(shape, inp)
    per_sliding = layer_activation_bytes_per_token(shape, inp, padded, sliding=True) if sliding else per_layer
    masked = padded and not inp.nomask
    # cos/sin (fp32, per rotated head dim; Gemma 3 keeps one table for its sliding layers and one for the others),
    # the padding mask and the sliding-window mask (bool, shared by every layer)
    tables = 2 if shape.family == "gemma3_text" and 0 < shape.sliding_layers < L else 1
    shared = tables * 2 * T * (shape.rotary_dim or shape.head_dim) * 4 \
        + inp.batch * inp.seq * inp.seq * (int(masked) + int(sliding > 0))
    recomputed = recomputed_layers(shape, inp)
    if recomputed:
        # offloaded: the first layer's input (the embedding output, a leaf autograd keeps) stays on the card and, when
        # the copies overlap the compute, one more layer input: being copied out in the forward, fetched back early
        # in the backward. The last L - recomputed layers keep all their activations (the larger kind, to be safe).
        kept = ((1 + int(inp.offload_overlap)) if inp.offload else recomputed) * rb * h * T
        kept += (1 + int(inp.offload_overlap)) * saved_attention_bytes(shape, inp)  # its attention, the same way
        kept += (L - recomputed) * max(per_layer, per_sliding) * T
    else:
        kept = ((L - sliding) * per_layer + sliding * per_sliding) * T
    kept += shared + rb * h * T + stashed_down_bytes(shape, inp)  # + the final norm's input
    return kept, max(per_layer, per_sliding)  # the layer being recomputed: the larger kind, to be safe


def head_bytes(shape: Shape, inp: PlanInput, labelled: int) -> tuple[float, float]:
    """The fused LM head and loss: the final hidden states it saves for the labelled tokens, and one tile of logits
    (with, on the fp32 path, the slices it casts to the compute dtype)."""
    h = shape.hidden
    compute = 2 if inp.compute_dtype in ("bfloat16", "float16") else 4
    head_saved = residual_bytes(inp) * h * labelled
    tile_tokens = min(labelled, LOGPROB_TOKEN_TILE)
    head_tiles = tile_tokens * min(LOGPROB_VOCAB_TILE, shape.vocab) * compute
    if shape.final_softcap:  # TRL's fused head applies softcap * tanh(logits / softcap): one more tile
        head_tiles *= 2
    if not inp.lean:  # the fp32 head's slice and the fp32 hidden states are cast to the compute dtype per tile
        head_tiles += min(LOGPROB_VOCAB_TILE, shape.vocab) * h * compute + tile_tokens * h * compute
    return head_saved, head_tiles


def layer_backward_bytes(shape: Shape, inp: PlanInput, per_layer: float) -> tuple[dict[str, float], float]:
    """The last layer's backward (its recomputed activations with GC, the backward's temporaries), and the bytes of
    the CUDA graphs' memory pool and buffers (0 without graphs)."""
    h, i, T = shape.hidden, shape.intermediate, inp.tokens
    rb = residual_bytes(inp)
    graphs = 0.0
    layer_backward = {"layer_recompute": per_layer * T if inp.gradient_checkpointing else 0.0,
                      "backward_transient": 2 * rb * i * T + 2 * rb * h * T
                      + 2 * max(a * b for a, b in shape.linear_dims().values())}  # one dequantized weight at a time
    # the last layers keep their activations (no_recompute_layers): the first backward is theirs, with no recompute;
    # by the first recomputed layer's backward they are freed, and they were at least one layer's worth
    not_recomputed = shape.layers - recomputed_layers(shape, inp) if inp.gradient_checkpointing else 0
    if inp.graphs and inp.gradient_checkpointing:
        # One memory pool holds a layer's recompute and backward for every graph, all the time; the layers share
        # buffers for their inputs and outputs (two hidden states), and each layer that keeps its activations has
        # its own input buffer. Only the gradients copied out of the pool are left to the allocator in the backward.
        graphs = GRAPH_POOL_FACTOR * sum(layer_backward.values()) + (2 + not_recomputed) * rb * h * T \
            + GRAPH_OVERHEAD_GIB * GIB
        layer_backward = {"layer_recompute": 0.0, "backward_transient": 2 * rb * h * T}
    elif not_recomputed:
        layer_backward["layer_recompute"] = 0.0
    return layer_backward, graphs


def peak_phases(shape: Shape, inp: PlanInput, padded: bool) -> tuple[dict[str, dict[str, float]], float]:
    """The phases where the peak can fall, each with its dynamic components (the largest wins), and the bytes of the
    CUDA graphs."""
    h, T = shape.hidden, inp.tokens
    N = max(1, round(inp.batch * (inp.seq - 1) * inp.labelled_fraction))
    rb = residual_bytes(inp)
    kept, per_layer = kept_activation_bytes(shape, inp, padded)
    head_saved, head_tiles = head_bytes(shape, inp, N)
    layer_backward, graphs = layer_backward_bytes(shape, inp, per_layer)
    zero = {"activations_kept": 0.0, "layer_recompute": 0.0, "logits_loss": 0.0, "backward_transient": 0.0,
            "upcast": 0.0}
    phases = {
        "the loss": {**zero, "activations_kept": kept, "logits_loss": head_saved + head_tiles + rb * h * T + 8 * 4 * N},
        "the loss backward": {**zero, "activations_kept": kept, "logits_loss": head_saved + head_tiles + rb * h * N,
                              "backward_transient": rb * h * T},
        "the last layer's backward": {**zero, "activations_kept": kept, **layer_backward},
    }
    if not inp.lean:
        # prepare_model_for_kbit_training casts the 16-bit embedding (and head) to fp32 one tensor at a time: for a
        # moment the largest exists in both dtypes. With a big tied vocabulary and short sequences this is the peak.
        phases["loading (fp32 upcast)"] = {**zero, "upcast": 2.0 * shape.vocab * h}
    return phases, graphs
