"""Will it fit? Peak GPU memory of a QLoRA run, predicted from config.json and the settings, before anything loads.

The prediction is what `nvidia-smi` would show at the worst moment of training (NVML "used" for this process):

    peak = CUDA context + runtime overhead + paged optimizer state (if any) + PyTorch reserved memory
    PyTorch reserved = peak allocated + allocator overhead (cached, fragmented blocks)

Every allocated byte below is traced to the code that allocates it in the stack this project pins (torch 2.11-2.13,
transformers 5.17, peft 0.21, trl 1.16, bitsandbytes 0.50), for a Llama-family decoder. Symbols: h hidden size,
i MLP size, L layers, V vocabulary, nh/nkv query/key-value heads of size hd, r LoRA rank, T = micro-batch x seq
tokens per forward pass, N tokens that carry a label (worst case: all of them, T).

Weights (static)
  * NF4 linear weights (bitsandbytes Params4bit): 0.5 byte per weight, packed two per byte.
  * Quantization constants, one absmax per 64-weight block: fp32 (4/64 byte per weight); with double quant the
    absmax is itself 8-bit (1/64) plus one fp32 per 256 absmax (4/16384).
  * Embeddings, untied LM head, norms: 16-bit on a GPU, plain stack and fast path alike (the lean path).
    The older path's prepare_model_for_kbit_training cast every non-4-bit parameter to fp32 (4 bytes each), which
    also made the residual stream fp32: `lean=False` models it (the 4-byte terms of the activations); on the lean
    path each "fp32" activation of the residual stream (norm inputs, checkpoints, final hidden states and their
    gradients) is 2 bytes. liger's SwiGLU (fused_kernels) keeps 2 of the MLP's 3 tensors; without a mask (nomask) a
    padded micro-batch costs what an unpadded one does.
  * LoRA A (r x in) and B (out x r) per target layer: TRL 1.16 casts them to bf16 for quantized models (2 bytes);
    nb_helpers keeps them fp32 (4 bytes) when training in fp16/fp32 (see training.build_trainer).
  * Their gradients, same dtype, alive across micro-batches when grad_accum > 1. With accumulation 1 the peak
    comes early in the backward pass, before the adapter gradients exist (zero_grad sets them to None).
  * Optimizer state: bitsandbytes 8-bit AdamW keeps two uint8 moments plus an fp32 absmax per 256 values
    (2 + 8/256 bytes per parameter); tensors under 4096 values keep fp32 moments (8 bytes). The paged variants
    allocate the two moments of a tensor of BNB_PAGE_MIN_ELEMENTS (100,000) values or more as CUDA managed memory,
    outside PyTorch's allocator (but inside nvidia-smi's number), which moves to host RAM only when the card runs
    out; every smaller tensor's moments, and every absmax, are ordinary allocator memory (bitsandbytes 0.50.2
    optim/optimizer.py, get_state_buffer: `p.numel() < 1e5`). No r=8 adapter tensor of these models is that large
    (TinyLlama: 16,384 values on attention, 45,056 on the MLP), so the recipe pages nothing. torch AdamW: two
    moments in the parameter's dtype.

Activations, the loss and LM head, the fp32 upcast while loading and the transients at the peak: see
nb_helpers.plan.activations, which computes them.

Fixed costs: the CUDA context, and torch's cuBLAS workspace (32 MiB on Hopper, 8.125 MiB before) for each of the
two threads that run matmuls (forward, autograd).

Measured, not derivable from the code (H200, CUDA 13, torch 2.11; bench/RESULTS.md)
  * Runtime overhead outside PyTorch's allocator once training runs (kernels loaded lazily by torch,
    bitsandbytes and Triton): RUNTIME_OVERHEAD_GIB.
  * Allocator overhead: memory PyTorch reserves beyond the peak it has allocated, because freed blocks of other
    sizes stay cached. It grows with the activations, and gradient checkpointing, which frees and re-allocates a
    layer's activations for every layer, fragments more: ALLOCATOR_OVERHEAD_GC / _GC_LEAN / _NO_GC of the peak
    activations. With expandable segments (the fast path's on Linux, nb_helpers.fast) freed pages are
    reused for any size and the overhead measured 0.02-0.27 GiB on 11 points of 3 shapes: EXPANDABLE_OVERHEAD_GIB.
  * CUDA context: measured on this GPU when there is one (memory.measure_context_bytes), else
    CONSUMER_CONTEXT_GIB, the usual size on consumer cards.
  * CUDA-graphed layers: GRAPH_POOL_FACTOR and GRAPH_OVERHEAD_GIB (nb_helpers.plan.activations).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nb_helpers.plan.adapter import BNB_PAGE_MIN_ELEMENTS, adapter_param_bytes, optimizer_bytes
from nb_helpers.plan.activations import GIB, copied_layers, peak_phases, residual_bytes, saved_attention_bytes
from nb_helpers.plan.architecture import (ALL_LINEAR, QKVO, Shape, UnsupportedModel,  # noqa: F401
                                          absmax_kept_bytes, known_families, load_shape,
                                          nf4_bytes, plan_targets, recomputed_layers)

CONSUMER_CONTEXT_GIB = 0.30  # CUDA 12/13 context on GTX 1650 / RTX 3050-class cards (H200: ~0.60, measured)
RUNTIME_OVERHEAD_GIB = 0.145  # outside the allocator after the first steps; H200 measurement, planner grid
ALLOCATOR_OVERHEAD_GC = 0.22  # reserved - allocated, as a share of the peak's activation bytes, GC on (fp32 path)
ALLOCATOR_OVERHEAD_GC_LEAN = 0.35  # the same on the lean path (half the activation bytes, the same transients)
ALLOCATOR_OVERHEAD_NO_GC = 0.05  # the same without checkpointing
EXPANDABLE_OVERHEAD_GIB = 0.15  # reserved - allocated with expandable segments (the fast path on Linux): flat
# torch's default cuBLAS workspace per handle (CUBLAS_WORKSPACE_CONFIG unset): 32 MiB on Hopper and newer, else
# 4096 KiB x 2 + 16 KiB x 8. The forward (main thread) and the autograd thread each hold one handle.
CUBLAS_WORKSPACE_MIB = {"hopper": 32.0, "older": 8.125}


FIT_MARGIN = 0.05  # keep the prediction 5% under the budget: the planner's measured error is within +-8%


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
    # The GPU training path (nb_helpers.fast); False models the older path that called prepare_model_for_kbit_training
    lean: bool = True  # embeddings, head and norms stay 16-bit: 16-bit residual stream and checkpoints
    fused_kernels: bool = True  # liger SwiGLU saves its two inputs only (the stock MLP also keeps SiLU's output)
    nomask: bool = True  # right-padded batches run without a mask: flash SDPA, native GQA, no bias tensor
    expandable: bool = True  # expandable allocator segments (Linux): a flat allocator overhead instead of a share
    adapters_fp32: bool = False  # fp32 LoRA weights in bf16 runs: a lever measured, then removed (lora.py)
    offload: bool = False  # with GC: each layer's checkpoint lives in pinned CPU RAM (nb_helpers.fast.offload)
    offload_overlap: bool = True  # the copies overlap the compute: one more layer input on the card (fast.offload)
    graphs: bool = False  # checkpointed layers as CUDA graphs (nb_helpers.fast.graphed_layers): their memory pool
    dead_tail: bool = True  # the recompute skips the product nothing reads (nb_helpers.fast.recompute): time only
    dropout_kernels: bool = False  # LoRA's dropout inside its products (fast.lora_dropout): its input, no copy, saved
    absmax_once: bool = False  # double quant's absmax kept decoded in fp32 (fast.fused_lora.keep_decoded_absmax)
    down_once: bool = False  # with GC and dropout_kernels: the recompute reuses its forward's LoRA products (stashed)
    no_recompute_layers: int = 0  # with GC: the last N layers keep their activations, not recomputed
    one_token_count: bool = False  # no Trainer token count after the backward (fast.host_step): time only
    frozen_norms: bool = False  # the norms' backward over the rows, no weight gradient (fast.frozen_norms): time only
    saved_attention: bool = False  # offloaded eager checkpoints keep attention in CPU RAM too (fast.saved_attention)
    dequant_time_share: float = 1.0  # the NF4 dequantize's GPU time per byte against bitsandbytes' kernel: time only

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
    "absmax_decoded": "absmax kept decoded (fp32)",
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
    # DPO only (nb_helpers.plan.preference); an SFT plan has neither
    "reference_adapter": "reference adapter (frozen copy)",
    "reference_forward": "reference forward (no grad)",
}


def lora_tensors(shape: Shape, inp: PlanInput) -> list[int]:
    """Sizes of every LoRA tensor (A and B of each target in each layer)."""
    dims = shape.linear_dims()
    sizes = []
    for target in plan_targets(shape, inp.targets):
        d_in, d_out = dims[target]
        sizes += [inp.rank * d_in, d_out * inp.rank]
    return sizes * shape.layers


def unmodelled_notes(shape: Shape) -> list[str]:
    notes = []
    if shape.attn_softcap:
        notes.append(f"attention soft-capping ({shape.attn_softcap}) is not modelled: SDPA cannot apply it, so "
                     "transformers needs eager attention, which keeps each layer's (heads x seq x seq) scores; "
                     "the prediction assumes SDPA and is low at long sequences")
    return notes


def static_bytes(shape: Shape, inp: PlanInput) -> dict[str, float]:
    """What the card holds in every phase: fixed costs, the weights, the adapter, its gradients and optimizer state."""
    adapter_bytes = adapter_param_bytes(inp.compute_dtype, adapters_fp32=inp.adapters_fp32)
    c: dict[str, float] = {}
    c["context"] = inp.context_gib * GIB
    c["runtime"] = RUNTIME_OVERHEAD_GIB * GIB
    c["weights_4bit"], c["quant_constants"] = nf4_bytes(shape.linear_params, inp.double_quant)
    c["absmax_decoded"] = absmax_kept_bytes(shape.linear_params) if inp.absmax_once and inp.double_quant else 0.0
    rb = residual_bytes(inp)  # embeddings, head and norms: compute dtype (lean) or fp32 (prepare_model_for_kbit)
    c["embeddings_head"] = float(rb * shape.embedding_params)
    c["norms"] = float(rb * (shape.norm_params + shape.bias_params))
    per_handle = CUBLAS_WORKSPACE_MIB["hopper" if tuple(inp.gpu_capability) >= (9, 0) else "older"]
    c["cublas"] = 2 * per_handle * 2**20
    sizes = lora_tensors(shape, inp)
    c["lora_weights"] = float(adapter_bytes * sum(sizes))
    c["lora_grads"] = float(adapter_bytes * sum(sizes)) if inp.accum > 1 else 0.0
    c["optimizer_paged"] = paged_optimizer_bytes(sizes, inp.optim)
    c["optimizer"] = optimizer_bytes(sizes, inp.optim, adapter_bytes) - c["optimizer_paged"]
    return c


def paged_optimizer_bytes(sizes, optim: str) -> float:
    """The optimizer state a paged_* optimizer allocates outside PyTorch's allocator: the two moments (8-bit: 1
    byte each, 32-bit: 4) of each tensor of BNB_PAGE_MIN_ELEMENTS values or more. The rest is in the allocator."""
    if not optim.startswith("paged_"):
        return 0.0
    per_value = 2 if optim.endswith("_8bit") else 8
    return float(sum(per_value * n for n in sizes if n >= BNB_PAGE_MIN_ELEMENTS))


def allocator_bytes(inp: PlanInput, dynamic: float) -> float:
    """Reserved beyond the peak allocated: flat with expandable segments, else a share of the dynamic bytes."""
    if inp.expandable:
        return EXPANDABLE_OVERHEAD_GIB * GIB
    share = (ALLOCATOR_OVERHEAD_GC_LEAN if inp.lean else ALLOCATOR_OVERHEAD_GC) if inp.gradient_checkpointing \
        else ALLOCATOR_OVERHEAD_NO_GC
    return dynamic * share


def plan_notes(shape: Shape, inp: PlanInput) -> list[str]:
    """What a reader of the prediction should know: limits passed, parts not modelled, CPU RAM used."""
    notes = []
    if shape.max_positions and inp.seq > shape.max_positions:
        notes.append(f"seq {inp.seq} is above the model's {shape.max_positions} positions")
    if inp.compute_dtype == "float32":
        notes.append("float32 compute is not modelled in detail (activations assume 16-bit autocast)")
    notes += unmodelled_notes(shape)
    if inp.offload and recomputed_layers(shape, inp):
        inputs, attentions = copied_layers(shape, inp)
        checkpoints = inputs * residual_bytes(inp) * shape.hidden * inp.tokens + attentions * saved_attention_bytes(
            shape, inp)
        notes.append(f"checkpoints offloaded: {checkpoints / GIB:.2f} GiB of pinned CPU RAM")
    return notes


def plan(shape: Shape, inp: PlanInput, budget_gib: float | None = None) -> Plan:
    """The predicted peak: the static bytes, plus the dynamic bytes of the phase where they are largest, plus the
    allocator's overhead on those."""
    if inp.loss != "trl-fused":
        raise ValueError(f"loss={inp.loss!r}: only 'trl-fused' (TRL 1.16's chunked log-prob loss) is modelled")
    inp = PlanInput(**{**asdict(inp), "targets": plan_targets(shape, inp.targets)})
    padded = inp.batch > 1 if inp.padded is None else inp.padded
    c = static_bytes(shape, inp)
    phases, c["graphs"] = peak_phases(shape, inp, padded)
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    c.update({k: float(v) for k, v in phases[phase].items()})
    c["allocator"] = allocator_bytes(inp, sum(phases[phase].values()))
    return Plan(inp, shape, {k: c[k] for k in COMPONENT_LABELS if k in c}, phase, budget_gib,
                notes=plan_notes(shape, inp))


def plan_for_config(cfg, shape: Shape, context_gib: float | None = None,
                    gpu_capability: tuple[int, int] | None = None, labelled_fraction: float = 1.0,
                    gpu_extras: bool | None = None) -> Plan:
    """The planner's view of a RunConfig (nb_helpers.config): same knobs, same names, and what the engine that trains
    it runs (plan.engine: the plain stack, or the fast path where `cfg.fast_path`). `gpu_extras`: whether the planned
    GPU has the fast path's fused kernels (None: this machine's answer for its own GPU, else what `make` installs)."""
    from nb_helpers.plan.cards import budget_of, run_card
    from nb_helpers.plan.dtypes import cuda_capability, gpu_compute_dtype
    from nb_helpers.plan.engine import engine_view

    card = run_card(cfg)  # a named card: its capability and context, unless given here
    capability = gpu_capability or (card.capability if card else None) or cuda_capability() or (7, 5)
    if context_gib is None and card is not None:
        context_gib = card.context_gib
    # "auto" means what the planned GPU would pick, not this machine (a CPU may pick fp32)
    dtype = gpu_compute_dtype(cfg.compute_dtype, capability)
    budget = budget_of(cfg)
    engine = engine_view(cfg, shape, budget, gpu_capability, gpu_extras)
    inp = PlanInput(seq=cfg.max_length, batch=cfg.micro_batch_size, accum=cfg.grad_accum, rank=cfg.lora_r,
                    targets=tuple(cfg.target_modules), gradient_checkpointing=cfg.gradient_checkpointing,
                    optim=cfg.optim, compute_dtype=dtype, double_quant=cfg.double_quant,
                    lora_dropout=cfg.lora_dropout, labelled_fraction=labelled_fraction,
                    context_gib=default_context_gib() if context_gib is None else context_gib,
                    gpu_capability=capability, **engine.terms)
    return plan(shape, inp, budget_gib=budget)


_CONTEXT_CACHE: dict[int, float] = {}


def default_context_gib(device: int = 0) -> float:
    """The CUDA context of this GPU (measured once, in a throwaway process), else the consumer-card value."""
    try:
        import torch

        if not torch.cuda.is_available():
            return CONSUMER_CONTEXT_GIB
        if device not in _CONTEXT_CACHE:
            from nb_helpers.plan.memory import measure_context_bytes

            _CONTEXT_CACHE[device] = measure_context_bytes(device) / GIB
        return _CONTEXT_CACHE[device]
    except Exception:  # noqa: BLE001 - a planner must answer even where NVML is missing
        return CONSUMER_CONTEXT_GIB
