"""Will it fit? Peak GPU memory of a QLoRA run, predicted from config.json and the settings, before anything loads.

The prediction is what `nvidia-smi` would show at the worst moment of training (NVML "used" for this process):

    peak = CUDA context + runtime overhead + paged optimizer state + PyTorch reserved memory
    PyTorch reserved = peak allocated + allocator overhead (cached, fragmented blocks)

Every allocated byte below is traced to the code that allocates it in the stack this project pins (torch 2.11-2.13,
transformers 5.17, peft 0.21, trl 1.16, bitsandbytes 0.50), for a Llama-family decoder. Symbols: h hidden size,
i MLP size, L layers, V vocabulary, nh/nkv query/key-value heads of size hd, r LoRA rank, T = micro-batch x seq
tokens per forward pass, N tokens that carry a label (worst case: all of them, T).

Weights (static)
  * NF4 linear weights (bitsandbytes Params4bit): 0.5 byte per weight, packed two per byte.
  * Quantization constants, one absmax per 64-weight block: fp32 (4/64 byte per weight); with double quant the
    absmax is itself 8-bit (1/64) plus one fp32 per 256 absmax (4/16384).
  * Embeddings, untied LM head, norms: 16-bit on the lean GPU path (nb_helpers.fastpath, the default since issue 8).
    The older path's prepare_model_for_kbit_training cast every non-4-bit parameter to fp32 (4 bytes each), which
    also made the residual stream fp32: `lean=False` models it, and the 4-byte terms below are its terms; on the lean
    path each "fp32" activation of the residual stream (norm inputs, checkpoints, final hidden states and their
    gradients) is 2 bytes. liger's SwiGLU (fused_kernels) keeps 2 of the MLP's 3 tensors; without a mask (nomask) a
    padded micro-batch costs what an unpadded one does.
  * LoRA A (r x in) and B (out x r) per target layer: TRL 1.16 casts them to bf16 for quantized models (2 bytes);
    nb_helpers keeps them fp32 (4 bytes) when training in fp16/fp32 (see training.build_trainer).
  * Their gradients, same dtype, alive across micro-batches when grad_accum > 1. With accumulation 1 the peak
    comes early in the backward pass, before the adapter gradients exist (zero_grad sets them to None).
  * Optimizer state: bitsandbytes 8-bit AdamW keeps two uint8 moments plus an fp32 absmax per 256 values
    (2 + 8/256 bytes per parameter); tensors under 4096 values keep fp32 moments (8 bytes). The paged variants
    allocate it as CUDA managed memory, outside PyTorch's allocator (but inside nvidia-smi's number). torch AdamW:
    two moments in the parameter's dtype.

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
    lora_A), its bool mask (1 byte, none when dropout is 0), and lora_A's output (2r), which lora_B saves.
    MatMul4Bit saves no input (it never computes a weight gradient), so frozen layers add nothing.
  * With gradient checkpointing only each layer's fp32 input is kept (4h per token per layer); one layer's full
    activations are rebuilt during its backward pass.
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

Fixed costs: the CUDA context, and torch's cuBLAS workspace (32 MiB on Hopper, 8.125 MiB before) for each of the
two threads that run matmuls (forward, autograd).

Measured, not derivable from the code (H200, CUDA 13, torch 2.11; bench/results/planner_validation.json)
  * Runtime overhead outside PyTorch's allocator once training runs (kernels loaded lazily by torch,
    bitsandbytes and Triton, the paged optimizer's bookkeeping): RUNTIME_OVERHEAD_GIB.
  * Allocator overhead: memory PyTorch reserves beyond the peak it has allocated, because freed blocks of other
    sizes stay cached. It grows with the activations, and gradient checkpointing, which frees and re-allocates a
    layer's activations for every layer, fragments more: ALLOCATOR_OVERHEAD_GC / _GC_LEAN / _NO_GC of the peak
    activations. With expandable segments (the GPU path's default on Linux, nb_helpers.fastpath) freed pages are
    reused for any size and the overhead measured 0.02-0.27 GiB on 11 points of 3 shapes: EXPANDABLE_OVERHEAD_GIB.
  * CUDA context: measured on this GPU when there is one (memory.measure_context_bytes), else
    CONSUMER_CONTEXT_GIB, the usual size on consumer cards.
  * CUDA-graphed layers (the GPU default; nb_helpers.graphed_layers): one memory pool holds a layer's recompute and
    backward for every graph, at all times, measured at GRAPH_POOL_FACTOR x what that work needs eagerly, plus two
    hidden states of shared buffers and GRAPH_OVERHEAD_GIB outside the pool. The layer's eager transients leave the
    last layer's backward phase, so the peak usually moves to the loss.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

from .lora import adapter_param_bytes, optimizer_bytes
from .architecture import (ALL_LINEAR, QKVO, Shape, UnsupportedModel, known_families, load_shape,  # noqa: F401
                           nf4_bytes, resolve_targets)

GIB = 2**30
CONSUMER_CONTEXT_GIB = 0.30  # CUDA 12/13 context on GTX 1650 / RTX 3050-class cards (H200: ~0.60, measured)
RUNTIME_OVERHEAD_GIB = 0.145  # outside the allocator after the first steps; H200 measurement, planner grid
ALLOCATOR_OVERHEAD_GC = 0.22  # reserved - allocated, as a share of the peak's activation bytes, GC on (fp32 path)
ALLOCATOR_OVERHEAD_GC_LEAN = 0.35  # the same on the lean path (half the activation bytes, the same transients)
ALLOCATOR_OVERHEAD_NO_GC = 0.05  # the same without checkpointing
EXPANDABLE_OVERHEAD_GIB = 0.15  # reserved - allocated with expandable segments (the GPU default on Linux): flat
LOGPROB_TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
LOGPROB_VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
# torch's default cuBLAS workspace per handle (CUBLAS_WORKSPACE_CONFIG unset): 32 MiB on Hopper and newer, else
# 4096 KiB x 2 + 16 KiB x 8. The forward (main thread) and the autograd thread each hold one handle.
CUBLAS_WORKSPACE_MIB = {"hopper": 32.0, "older": 8.125}
# CUDA-graphed layers (nb_helpers.graphed_layers), fitted on five TinyLlama runs of bench/throughput.py (H200, call
# 11; bench/NOTES.md): their memory pool holds GRAPH_POOL_FACTOR x one layer's recompute-and-backward working memory
# (the graphs' allocations cannot be packed as tightly as eager ones, which reuse freed blocks of any stream), and
# GRAPH_OVERHEAD_GIB sits outside it (the capture stream's cuBLAS workspace, the graphs themselves)
GRAPH_POOL_FACTOR = 2.4
GRAPH_OVERHEAD_GIB = 0.07
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Families the GPU path runs with liger's fused RMSNorm and SwiGLU (nb_helpers.fastpath wires Llama only); the others
# run the stock layers whatever PlanInput.fused_kernels says.
FUSED_KERNEL_FAMILIES = ("llama",)


@dataclass
class PlanInput:
    seq: int = 512  # tokens per sequence (max_length)
    batch: int = 1  # micro-batch: sequences per forward pass
    accum: int = 8
    rank: int = 8
    targets: tuple[str, ...] = QKVO
    gradient_checkpointing: bool = True
    optim: str = "paged_adamw_8bit"
    compute_dtype: str = "bfloat16"
    double_quant: bool = True
    lora_dropout: float = 0.05
    padded: bool | None = None  # None: assume padding whenever batch > 1 (real data has uneven lengths)
    labelled_fraction: float = 1.0  # share of tokens with a label; 1.0 is the worst case (text, long answers)
    loss: str = "trl-fused"  # TRL 1.16's chunked log-prob loss, the only one SFTTrainer uses for these models
    context_gib: float = CONSUMER_CONTEXT_GIB
    gpu_capability: tuple[int, int] = (7, 5)  # compute capability: sizes the cuBLAS workspaces (GTX 1650: 7.5)
    # The GPU training path (nb_helpers.fastpath); False models the older path that called prepare_model_for_kbit_training
    lean: bool = True  # embeddings, head and norms stay 16-bit: 16-bit residual stream and checkpoints
    fused_kernels: bool = True  # liger SwiGLU saves its two inputs only (the stock MLP also keeps SiLU's output)
    nomask: bool = True  # right-padded batches run without a mask: flash SDPA, native GQA, no bias tensor
    expandable: bool = True  # expandable allocator segments (Linux): a flat allocator overhead instead of a share
    adapters_fp32: bool = False  # fastpath's adapters_fp32: fp32 LoRA weights in bf16 runs (lora.adapter_param_bytes)
    offload: bool = False  # with GC: each layer's checkpoint lives in pinned CPU RAM (nb_helpers.fastpath)
    offload_overlap: bool = True  # the copies overlap the compute: one more layer input on the card (fastpath)
    graphs: bool = False  # checkpointed layers as CUDA graphs (nb_helpers.graphed_layers): their memory pool

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass
class Plan:
    inputs: PlanInput
    shape: Shape
    components: dict[str, float]  # bytes
    peak_phase: str
    budget_gib: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> float:
        return sum(self.components.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def fits(self) -> bool | None:
        return None if self.budget_gib is None else self.peak_gib <= self.budget_gib

    def verdict(self) -> str:
        line = f"predicted peak: {self.peak_gib:.2f} GiB"
        if self.budget_gib is not None:
            line += f" (budget {self.budget_gib:.2f} GiB: {'fits' if self.fits else 'does not fit'})"
        return line

    def table(self) -> str:
        total = f"total (peak in {self.peak_phase})"
        width = max([len(k) for k in COMPONENT_LABELS.values()] + [len(total)]) + 2
        rows = [f"{'component':<{width}}{'GiB':>8}"]
        for key, value in self.components.items():
            rows.append(f"{COMPONENT_LABELS[key]:<{width}}{value / GIB:>8.3f}")
        rows.append(f"{'':<{width}}{'-' * 8}")
        rows.append(f"{total:<{width}}{self.peak_gib:>8.3f}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {"inputs": asdict(self.inputs), "shape": asdict(self.shape), "peak_phase": self.peak_phase,
                "components_gib": {k: v / GIB for k, v in self.components.items()}, "peak_gib": self.peak_gib,
                "budget_gib": self.budget_gib, "fits": self.fits, "notes": self.notes}


COMPONENT_LABELS = {
    "context": "CUDA context",
    "runtime": "runtime overhead (kernels)",
    "weights_4bit": "4-bit linear weights",
    "quant_constants": "quantization constants",
    "embeddings_head": "embeddings + head",
    "norms": "norms, biases",
    "cublas": "cuBLAS workspaces",
    "lora_weights": "LoRA weights",
    "lora_grads": "LoRA gradients",
    "optimizer_paged": "optimizer state (paged)",
    "optimizer": "optimizer state",
    "upcast": "fp32 upcast while loading",
    "activations_kept": "activations kept across layers",
    "layer_recompute": "one layer's activations",
    "logits_loss": "LM head + loss (fused)",
    "backward_transient": "backward temporaries",
    "allocator": "allocator overhead",
    "graphs": "CUDA graphs (pool, buffers)",
}


def plan_targets(shape: Shape, targets) -> tuple[str, ...]:
    """The targets under the model's own names (Phi: q,k,v -> qkv_proj); all-linear -> every linear layer."""
    resolved = resolve_targets(targets, shape.all_linear())
    return shape.all_linear() if resolved == ("all-linear",) else resolved


def lora_tensors(shape: Shape, inp: PlanInput) -> list[int]:
    """Sizes of every LoRA tensor (A and B of each target in each layer)."""
    dims = shape.linear_dims()
    sizes = []
    for target in plan_targets(shape, inp.targets):
        d_in, d_out = dims[target]
        sizes += [inp.rank * d_in, d_out * inp.rank]
    return sizes * shape.layers


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
    dims = shape.linear_dims()
    mask = 1 if inp.lora_dropout > 0 else 0
    lora = sum((2 + mask) * dims[t][0] + 2 * inp.rank for t in plan_targets(shape, inp.targets))
    return norms + attention + mlp + lora


def sliding_layers_masked(shape: Shape, inp: PlanInput) -> int:
    """Layers whose window is shorter than the sequence: they run with a mask (a window as long as the sequence
    changes nothing, and transformers skips the mask then)."""
    return shape.sliding_layers if shape.sliding_window and inp.seq > shape.sliding_window else 0


def unmodelled_notes(shape: Shape) -> list[str]:
    notes = []
    if shape.attn_softcap:
        notes.append(f"attention soft-capping ({shape.attn_softcap}) is not modelled: SDPA cannot apply it, so "
                     "transformers needs eager attention, which keeps each layer's (heads x seq x seq) scores; "
                     "the prediction assumes SDPA and is low at long sequences")
    return notes


def plan(shape: Shape, inp: PlanInput, budget_gib: float | None = None) -> Plan:
    if inp.loss != "trl-fused":
        raise ValueError(f"loss={inp.loss!r}: only 'trl-fused' (TRL 1.16's chunked log-prob loss) is modelled")
    inp = PlanInput(**{**asdict(inp), "targets": plan_targets(shape, inp.targets)})
    h, i, L, T = shape.hidden, shape.intermediate, shape.layers, inp.tokens
    N = max(1, round(inp.batch * (inp.seq - 1) * inp.labelled_fraction))
    padded = inp.batch > 1 if inp.padded is None else inp.padded
    adapter_bytes = adapter_param_bytes(inp.compute_dtype, adapters_fp32=inp.adapters_fp32)
    compute = 2 if inp.compute_dtype in ("bfloat16", "float16") else 4

    c: dict[str, float] = {}
    c["context"] = inp.context_gib * GIB
    c["runtime"] = RUNTIME_OVERHEAD_GIB * GIB
    c["weights_4bit"], c["quant_constants"] = nf4_bytes(shape.linear_params, inp.double_quant)
    rb = residual_bytes(inp)  # embeddings, head and norms: compute dtype (lean) or fp32 (prepare_model_for_kbit)
    c["embeddings_head"] = float(rb * shape.embedding_params)
    c["norms"] = float(rb * (shape.norm_params + shape.bias_params))
    per_handle = CUBLAS_WORKSPACE_MIB["hopper" if tuple(inp.gpu_capability) >= (9, 0) else "older"]
    c["cublas"] = 2 * per_handle * 2**20
    sizes = lora_tensors(shape, inp)
    c["lora_weights"] = float(adapter_bytes * sum(sizes))
    c["lora_grads"] = float(adapter_bytes * sum(sizes)) if inp.accum > 1 else 0.0
    state = optimizer_bytes(sizes, inp.optim, adapter_bytes)
    paged = inp.optim.startswith("paged_")
    c["optimizer_paged"] = state if paged else 0.0
    c["optimizer"] = 0.0 if paged else state

    per_layer = layer_activation_bytes_per_token(shape, inp, padded)
    sliding = sliding_layers_masked(shape, inp)
    per_sliding = layer_activation_bytes_per_token(shape, inp, padded, sliding=True) if sliding else per_layer
    masked = padded and not inp.nomask
    # cos/sin (fp32, per rotated head dim; Gemma 3 keeps one table for its sliding layers and one for the others),
    # the padding mask and the sliding-window mask (bool, shared by every layer)
    tables = 2 if shape.family == "gemma3_text" and 0 < shape.sliding_layers < L else 1
    shared = tables * 2 * T * (shape.rotary_dim or shape.head_dim) * 4 \
        + inp.batch * inp.seq * inp.seq * (int(masked) + int(sliding > 0))
    if inp.gradient_checkpointing:
        # offloaded: the first layer's input (the embedding output, a leaf autograd keeps) stays on the card and, when
        # the copies overlap the compute, one more layer input: being copied out in the forward, fetched back early
        # in the backward
        kept = ((1 + int(inp.offload_overlap)) if inp.offload else L) * rb * h * T
    else:
        kept = ((L - sliding) * per_layer + sliding * per_sliding) * T
    kept += shared + rb * h * T  # + the final norm's input
    per_layer = max(per_layer, per_sliding)  # the layer being recomputed: the larger kind, to be safe
    head_saved = rb * h * N
    tile_tokens = min(N, LOGPROB_TOKEN_TILE)
    head_tiles = tile_tokens * min(LOGPROB_VOCAB_TILE, shape.vocab) * compute
    if shape.final_softcap:  # TRL's fused head applies softcap * tanh(logits / softcap): one more tile
        head_tiles *= 2
    if not inp.lean:  # the fp32 head's slice and the fp32 hidden states are cast to the compute dtype per tile
        head_tiles += min(LOGPROB_VOCAB_TILE, shape.vocab) * h * compute + tile_tokens * h * compute
    graphed = inp.graphs and inp.gradient_checkpointing
    c["graphs"] = 0.0
    layer_backward = {"layer_recompute": per_layer * T if inp.gradient_checkpointing else 0.0,
                      "backward_transient": 2 * rb * i * T + 2 * rb * h * T
                      + 2 * max(a * b for a, b in shape.linear_dims().values())}
    if graphed:
        # One memory pool holds a layer's recompute and backward for every graph, all the time; the layers share
        # buffers for their inputs and outputs (two hidden states). Only the gradients copied out of the pool are
        # left to the allocator during the backward.
        c["graphs"] = GRAPH_POOL_FACTOR * sum(layer_backward.values()) + 2 * rb * h * T + GRAPH_OVERHEAD_GIB * GIB
        layer_backward = {"layer_recompute": 0.0, "backward_transient": 2 * rb * h * T}
    # The phases where the peak can fall; the largest wins.
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
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    c.update({k: float(v) for k, v in phases[phase].items()})
    dynamic = sum(phases[phase].values())
    if inp.expandable:
        c["allocator"] = EXPANDABLE_OVERHEAD_GIB * GIB
    else:
        share = (ALLOCATOR_OVERHEAD_GC_LEAN if inp.lean else ALLOCATOR_OVERHEAD_GC) if inp.gradient_checkpointing \
            else ALLOCATOR_OVERHEAD_NO_GC
        c["allocator"] = dynamic * share
    order = list(COMPONENT_LABELS)
    result = Plan(inp, shape, {k: c[k] for k in order}, phase, budget_gib)
    if shape.max_positions and inp.seq > shape.max_positions:
        result.notes.append(f"seq {inp.seq} is above the model's {shape.max_positions} positions")
    if inp.compute_dtype == "float32":
        result.notes.append("float32 compute is not modelled in detail (activations assume 16-bit autocast)")
    result.notes += unmodelled_notes(shape)
    if inp.offload and inp.gradient_checkpointing:
        result.notes.append(f"checkpoints offloaded: {L * rb * h * T / GIB:.2f} GiB of pinned CPU RAM")
    return result


# --- auto-fit ------------------------------------------------------------------------------------------------
# Ranking: a step costs accum x (fixed launch/Python overhead) + tokens x (compute, x4/3 with checkpointing, which
# recomputes the forward pass). On 4 GB cards and small models the fixed part dominates (the reference recipe keeps
# an H200 about 5% busy), so fewer, larger micro-batches win first; checkpointing is dropped when it still fits.
OVERHEAD_TOKENS = 1024  # a micro-step's fixed cost, in tokens of compute (heuristic; the trial run confirms fit)
GC_COMPUTE_FACTOR = 4 / 3
OFFLOAD_FACTOR = 1.02  # the copies to and from CPU RAM: a little dearer than keeping checkpoints on the card
FIT_MARGIN = 0.05  # keep the prediction 5% under the budget: the planner's measured error is within +-8%


@dataclass
class Candidate:
    batch: int
    accum: int
    gradient_checkpointing: bool
    predicted_gib: float
    relative_step_cost: float
    offload: bool = False
    graphs: bool = False

    def describe(self) -> str:
        gc = ("on, checkpoints in CPU RAM" if self.offload else "on") if self.gradient_checkpointing else "off"
        graphs = ", layers as CUDA graphs" if self.graphs and self.gradient_checkpointing else ""
        return (f"micro-batch {self.batch} x accumulation {self.accum}, gradient checkpointing {gc}{graphs} "
                f"(predicted {self.predicted_gib:.2f} GiB)")


def candidates(shape: Shape, base: PlanInput, effective_batch: int, budget_gib: float,
               margin: float = FIT_MARGIN, offload_allowed: bool = True) -> list[Candidate]:
    """Every micro-batch x accumulation with the same effective batch, GC off, on, and on with checkpoints in CPU
    RAM (where `offload_allowed`), each checkpointed one also as CUDA graphs (with `base.graphs`), predicted to fit
    the budget (less the margin), best expected throughput first: fewer micro-steps first (each costs the host a
    fixed overhead), then graphed before eager (a graphed layer costs the host one launch where an eager one costs
    hundreds: 2x at 8 x 512 on an H200, bench/NOTES.md), then the compute each needs."""
    modes = [(False, False), (True, False)] + ([(True, True)] if offload_allowed else [])
    modes = [(gc, offload, False) for gc, offload in modes] + \
        ([(True, offload, True) for gc, offload in modes if gc] if base.graphs else [])
    out = []
    for batch in [b for b in range(1, effective_batch + 1) if effective_batch % b == 0]:
        for gc, offload, graphs in modes:
            inp = PlanInput(**{**asdict(base), "batch": batch, "accum": effective_batch // batch,
                               "gradient_checkpointing": gc, "offload": offload, "graphs": graphs})
            predicted = plan(shape, inp).peak_gib
            if predicted > budget_gib * (1 - margin):
                continue
            factor = (GC_COMPUTE_FACTOR if gc else 1.0) * (OFFLOAD_FACTOR if offload else 1.0)
            cost = inp.accum * (OVERHEAD_TOKENS + batch * inp.seq * factor)
            out.append(Candidate(batch, inp.accum, gc, predicted, cost, offload, graphs))
    return sorted(out, key=lambda c: (c.accum, not c.graphs, c.relative_step_cost, c.predicted_gib))


def auto_fit(shape: Shape, base: PlanInput, effective_batch: int, budget_gib: float, trial=None, log=print,
             margin: float = FIT_MARGIN, offload_allowed: bool = True) -> Candidate:
    """Pick the fastest micro-batch x accumulation (and GC on/off) that fits, keeping the effective batch.

    `trial(candidate)` runs one forward and backward at full length and returns the peak GiB it measured, or
    raises torch.OutOfMemoryError (any exception named *OutOfMemoryError); then the next candidate is tried and
    the step down is reported. Without a trial the prediction alone decides."""
    options = candidates(shape, base, effective_batch, budget_gib, margin, offload_allowed)
    if not options:
        smallest = plan(shape, PlanInput(**{**asdict(base), "batch": 1, "accum": effective_batch,
                                            "gradient_checkpointing": True, "offload": offload_allowed,
                                            "graphs": False}))
        raise MemoryError(f"nothing fits {budget_gib:.2f} GiB: even micro-batch 1 with gradient checkpointing is "
                          f"predicted at {smallest.peak_gib:.2f} GiB ({smallest.peak_phase}). Lower max_length "
                          f"(now {base.seq}), the LoRA rank or targets, or pick a smaller model")
    for number, option in enumerate(options):
        if trial is None:
            log(f"[auto-fit] chose {option.describe()} for effective batch {effective_batch} in {budget_gib:.2f} GiB")
            return option
        try:
            measured = trial(option)
        except Exception as e:  # noqa: BLE001 - only out-of-memory errors step down
            if "OutOfMemoryError" not in type(e).__name__:
                raise
            following = options[number + 1].describe() if number + 1 < len(options) else "nothing left"
            log(f"[auto-fit] {option.describe()} ran out of memory in the trial step; stepping down to {following}")
            continue
        if measured is not None and measured > budget_gib:
            log(f"[auto-fit] {option.describe()} measured {measured:.2f} GiB in the trial step, over the budget; "
                "stepping down")
            continue
        log(f"[auto-fit] chose {option.describe()}" + (f", trial step measured {measured:.2f} GiB" if measured else "")
            + f"; effective batch stays {effective_batch}")
        return option
    raise MemoryError(f"every candidate ran out of memory in its trial step within {budget_gib:.2f} GiB; lower "
                      f"max_length (now {base.seq}) or the LoRA rank")


def graphs_dropped_unless_they_fit(planned: Plan, budget_gib: float, margin: float = FIT_MARGIN) -> Plan:
    """What a run with hand-set knobs uses: its graphed plan where that fits the budget (less the margin), else the
    same run with eager layers (graphs hold a memory pool; training.keep_graphs_within_budget switches them off)."""
    if planned.components.get("graphs") and planned.peak_gib > budget_gib * (1 - margin):
        return plan(planned.shape, PlanInput(**{**asdict(planned.inputs), "graphs": False}), budget_gib=planned.budget_gib)
    return planned


def plan_for_config(cfg, shape: Shape | None = None, context_gib: float | None = None,
                    gpu_capability: tuple[int, int] | None = None, labelled_fraction: float = 1.0) -> Plan:
    """The planner's view of a RunConfig (nb_helpers.config): same knobs, same names."""
    from .dtypes import cuda_capability, gpu_compute_dtype

    if shape is None:
        from .models import resolve_model

        shape = load_shape(resolve_model(cfg, verbose=False).path)
    capability = gpu_capability or cuda_capability() or (7, 5)
    # "auto" means what the planned GPU would pick, not this machine (a CPU may pick fp32)
    dtype = gpu_compute_dtype(cfg.compute_dtype, capability)
    from .fastpath import gpu_options, kernels_installed

    fast = gpu_options()  # the GPU path's levers, as NB_FASTPATH leaves them
    inp = PlanInput(seq=cfg.max_length, batch=cfg.micro_batch_size, accum=cfg.grad_accum, rank=cfg.lora_r,
                    targets=tuple(cfg.target_modules), gradient_checkpointing=cfg.gradient_checkpointing,
                    optim=cfg.optim, compute_dtype=dtype, double_quant=cfg.double_quant,
                    lora_dropout=cfg.lora_dropout, labelled_fraction=labelled_fraction,
                    context_gib=default_context_gib() if context_gib is None else context_gib,
                    gpu_capability=capability, lean=fast.lean, nomask=fast.nomask,
                    fused_kernels=fast.kernels and kernels_installed(), adapters_fp32=fast.adapters_fp32,
                    expandable=fast.expandable and platform.system() == "Linux",
                    offload=bool(cfg.offload_checkpoints or fast.offload) and cfg.gradient_checkpointing,
                    offload_overlap=fast.offload_overlap,
                    graphs=cfg.graphs_wanted and fast.graphs and fast.reentrant and not fast.selective_gc)
    return plan(shape, inp, budget_gib=cfg.budget_gib)


_CONTEXT_CACHE: dict[int, float] = {}


def default_context_gib(device: int = 0) -> float:
    """The CUDA context of this GPU (measured once, in a throwaway process), else the consumer-card value."""
    try:
        import torch

        if not torch.cuda.is_available():
            return CONSUMER_CONTEXT_GIB
        if device not in _CONTEXT_CACHE:
            from .memory import measure_context_bytes

            _CONTEXT_CACHE[device] = measure_context_bytes(device) / GIB
        return _CONTEXT_CACHE[device]
    except Exception:  # noqa: BLE001 - a planner must answer even where NVML is missing
        return CONSUMER_CONTEXT_GIB


# --- model shapes a widget can offer -----------------------------------------------------------------------------
def shapes_dir():
    from .config import PROJECT_ROOT

    return PROJECT_ROOT / "bench" / "shapes"


def known_shapes() -> dict[str, str]:
    """name -> one line about it, for every public model whose config.json ships in bench/shapes/ (Qwen3, Gemma 3,
    Llama-3.2, Phi-4-mini, ...): the choices of a model-family widget. No download, no weights."""
    paths = sorted(shapes_dir().glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no model shapes in {shapes_dir()}: they ship with the course (git checkout of "
                                "bench/shapes/); a copy of nb_helpers alone lacks them")
    return {path.stem: load_shape(str(path)).describe() for path in paths}


def known_shape(name: str) -> Shape:
    """One of known_shapes() by name (e.g. "qwen3-1.7b"), read from its config.json in bench/shapes/."""
    path = shapes_dir() / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no shape {name!r}; known: {', '.join(known_shapes())}")
    return load_shape(str(path))


def plan_for_family(cfg, name: str, context_gib: float | None = None,
                    gpu_capability: tuple[int, int] | None = None) -> Plan:
    """plan_for_config for one of known_shapes(), with the config's other knobs as they are."""
    return plan_for_config(cfg, known_shape(name), context_gib=context_gib, gpu_capability=gpu_capability)
