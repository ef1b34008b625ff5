"""The lean, fast GPU training path: the reference recipe's math with less memory and less time per token.

Ten changes, each measured on its own against the plain transformers + peft + TRL recipe in the same device
call (bench/throughput.py; results and what did not pay in bench/results/throughput.json and bench/NOTES.md):

  * lean prepare (instead of peft's prepare_model_for_kbit_training): the base stays frozen and 16-bit. peft's
    helper casts the embeddings, the head and every norm to fp32, and an fp32 embedding makes the whole residual
    stream fp32, so every checkpointed activation doubles. The recipe as written (the plain stack) never calls
    it; TRL enables the input gradients that checkpointing needs.
  * fused kernels (liger-kernel, Triton): RMSNorm, SwiGLU and RoPE as one kernel each instead of several
    elementwise launches; fewer saved tensors too. Not its fused cross-entropy: TRL's own chunked log-prob loss
    already never builds the logits, and TRL refuses liger's. Where Triton cannot run (CPU, no triton, a
    kernel that fails its smoke test), the stock layers stay and one line says so.
  * no attention mask for right-padded batches: TRL's collator pads on the right, and a causal model's real
    tokens never attend to later positions, so the mask changes nothing for them (pad positions carry no label).
    Without a mask, SDPA runs a fused flash-style kernel (cuDNN's on an H200) with native grouped-query attention
    instead of the memory-efficient kernel over keys and values repeated to every head plus a (batch, 1, seq, seq)
    bias.

  * fused QLoRA layers (nb_helpers.fused_lora): each 4-bit linear layer, with its LoRA branch, as one autograd
    function: the step is bound by the host on a fast GPU, and peft's and bitsandbytes' wrappers cost 0.7 ms of
    Python per call.
  * activation checkpoints in CPU RAM (RunConfig.offload_checkpoints, chosen by auto-fit): each layer's checkpoint
    goes to pinned host memory on a side stream that overlaps the compute, so long rows and bigger micro-batches fit.
  * reentrant checkpoints: the forward of a checkpointed layer runs under no_grad, with no saved-tensor hooks.
  * bitsandbytes' dequantize kernels called directly, without their per-call Python wrapper.
  * checkpointed layers replayed as CUDA graphs (nb_helpers.graphed_layers; RunConfig.cuda_graphs): one launch per
    layer instead of a few hundred, 2x at 8 x 512 on an H200; its memory pool is what it costs (the planner counts
    it; auto-fit takes them where they fit, a run set by hand only with cuda_graphs=True).
  * bitsandbytes' AdamW kernels called directly (nb_helpers.optimizer_step), without a device synchronize after
    each of the adapter tensors.
  * batches padded to a multiple of 64 tokens with eager layers too, as graphed ones are (`pad_lengths`): cuDNN's
    attention builds new execution plans for every new length, 0.15 s a step at 8 x 2048 whenever one came.

Measured and not kept: torch.compile of each decoder layer (`compile`), TRL's selective checkpointing, fp32
adapters in bf16 runs, transformers' own synchronous offload, gc.freeze() before training, a DataLoader worker
process collating the next batch, the Trainer's token count kept on the device (both removed; commit 341eb83).

`NB_FASTPATH` switches levers for benchmarks without touching the config: "lean=0,kernels=0,nomask=0".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ENV_VAR = "NB_FASTPATH"
_SAID: set[str] = set()


def say_once(key: str, message: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        print(message, flush=True)


@dataclass
class FastOptions:
    lean: bool = True  # no fp32 upcast of embeddings, head and norms (prepare_model_for_kbit_training); GPU only
    kernels: bool = True  # liger-kernel RMSNorm, SwiGLU, RoPE on CUDA with Triton; stock layers elsewhere
    nomask: bool = True  # right-padded training batches run without an attention mask (flash SDPA, native GQA); GPU
    adapters_fp32: bool = False  # bf16 adapters (TRL's QLoRA choice) in bf16 runs; fp16 runs always keep fp32
    selective_gc: bool = False  # TRL's selective checkpointing (keeps attention outputs): measured, not kept
    expandable: bool = True  # PyTorch's expandable allocator segments: less cached-but-free memory (Linux CUDA)
    fused_lora: bool = True  # each 4-bit linear (with its LoRA) as one autograd function (nb_helpers.fused_lora); CUDA
    compile: bool = False  # torch.compile each decoder layer (Inductor): measured slower or equal, so off
    offload: bool = False  # activation checkpoints in pinned CPU RAM, copied asynchronously (CUDA); frees
    #                        layers x tokens x hidden x 2 bytes of device memory for longer rows or bigger batches
    offload_sync: bool = False  # the same through transformers' own offload (synchronous copies): measured against it
    offload_overlap: bool = True  # offload copies on a side stream, overlapping compute (else on the compute stream)
    reentrant: bool = True  # reentrant checkpoints: the forward runs under no_grad, with no saved-tensor hooks; GPU
    direct_dequant: bool = True  # bitsandbytes' dequantize kernels called directly (no per-call wrapper); CUDA
    graphs: bool = True  # checkpointed layers replayed as CUDA graphs (nb_helpers.graphed_layers); CUDA, reentrant
    direct_optim: bool = True  # bitsandbytes' AdamW kernels called directly (nb_helpers.optimizer_step); CUDA
    pad_lengths: bool = True  # eager layers' batches padded to a multiple of 64 tokens too, as graphs' are: cuDNN's
    #                           attention builds plans for each new length (0.15 s a new length, device call 21); CUDA

    @classmethod
    def from_env(cls, **overrides) -> "FastOptions":
        """Defaults, then NB_FASTPATH ("kernels=0,nomask=1"), then keyword overrides. Without a GPU the lean
        prepare and the mask drop are off by default: the CPU path keeps the code its measured results were made with."""
        import torch

        gpu = torch.cuda.is_available()
        values = {"lean": gpu, "nomask": gpu, "expandable": gpu, "fused_lora": gpu, "reentrant": gpu,
                  "direct_dequant": gpu, "graphs": gpu, "direct_optim": gpu, "pad_lengths": gpu}
        for item in filter(None, (s.strip() for s in os.environ.get(ENV_VAR, "").split(","))):
            key, _, value = item.partition("=")
            if key not in {f.name for f in fields(cls)}:
                raise ValueError(f"{ENV_VAR}: unknown lever {key!r}; known: {', '.join(f.name for f in fields(cls))}")
            values[key] = value.strip().lower() in {"1", "true", "yes", "on", ""}
        values.update(overrides)
        return cls(**values)


def options_of(model) -> FastOptions:
    """The levers this model was prepared with (attach_lora records them), else the environment's."""
    return getattr(model, "_nb_fast", None) or FastOptions.from_env()


def gpu_options() -> FastOptions:
    """The levers a GPU run uses (the planner plans for a GPU even on a machine without one)."""
    return FastOptions.from_env(**{k: v for k, v in vars(FastOptions()).items() if k not in _env_keys()})


def _env_keys() -> set[str]:
    return {item.partition("=")[0].strip() for item in os.environ.get(ENV_VAR, "").split(",") if item.strip()}


def kernels_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def lean_prepare(model):
    """What QLoRA training needs from the base model and nothing more: every base weight frozen, nothing
    upcast. Embeddings, head and norms keep the compute dtype the model was loaded in, so the residual stream
    (and every activation checkpoint) is 16-bit, as in the plain recipe."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def use_expandable_segments() -> bool:
    """Let PyTorch's caching allocator grow segments in place (`expandable_segments:True`) instead of caching blocks
    of every size it has seen. Micro-batches whose length changes from step to step otherwise leave freed blocks
    that fit nothing (measured: reserved - allocated was 0.48 GiB at 8 x 512 tokens). Linux + CUDA only; the
    per-process memory cap (the emulated budget) still applies. Returns whether it is on."""
    import platform

    import torch

    if not torch.cuda.is_available() or platform.system() != "Linux":
        return False
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in setting:  # the user chose; respect it
        return "expandable_segments:true" in setting.replace(" ", "").lower()
    try:
        import warnings

        with warnings.catch_warnings():  # torch 2.11 names a newer private spelling; this one is the one we measured
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except Exception as e:  # noqa: BLE001 - a private API: if it moves, train as before
        say_once("expandable", f"[fast] expandable allocator segments unavailable ({e}); using the default allocator")
        return False
    return True


# --- fused kernels ---------------------------------------------------------------------------------------------
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

    from .dtypes import resolve_compute_dtype

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
    # the attention layer looks up at call time, so it stays patched (it computes the same rotation).
    classes = modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False, model=model)
    modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP = classes
    if verbose:
        say_once("kernels-on", "[fast] fused Triton kernels (liger-kernel) for RMSNorm, SwiGLU and RoPE")
    return True


# --- activation checkpoints offloaded to CPU RAM ---------------------------------------------------------------
class _Offloaded:
    """One layer's checkpoint in pinned CPU RAM. `previous` (a weak reference) is the checkpoint packed just before it:
    the layer whose backward comes next, so its copy back can start while this layer's backward runs."""

    __slots__ = ("host", "shape", "dtype", "device", "on_device", "ready", "previous", "__weakref__")

    def __init__(self, host, like, previous):
        self.host, self.shape, self.dtype, self.device = host, like.shape, like.dtype, like.device
        self.on_device, self.ready, self.previous = None, None, previous

    def fetch(self, stream) -> None:
        """Copy back on the side stream into memory of the compute stream, so that freeing it later is ordered on
        the compute stream like any activation (no record_stream, no block held back from the allocator). The side
        stream first waits for the compute queued so far, which may still use the memory handed out here."""
        import torch

        if self.on_device is not None:
            return
        self.on_device = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.on_device.copy_(self.host, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)


_COPY_STREAMS: dict = {}
_IN_FLIGHT: dict = {}  # device -> (the last layer input being copied out, the event that ends its copy)
_LAST_PACKED: list = [None]  # weak reference to the checkpoint packed last


def _copy_stream(device):
    import torch

    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def _release_in_flight(device) -> None:
    """The compute stream waits for the previous layer input's copy to end, then lets that input go: freed in
    compute-stream order, so the allocator can reuse it at once. The copy had a whole layer's compute to finish."""
    import torch

    if device in _IN_FLIGHT:
        _, done = _IN_FLIGHT.pop(device)
        torch.cuda.current_stream(device).wait_event(done)


def _offload_hooks(overlap: bool = True):
    """Saved-tensor hooks that move each checkpointed layer input to pinned host memory and bring it back in the
    backward. transformers' own `offload=True` (torch's save_on_cpu) copies synchronously, which stalls the host at
    every layer: on a host-bound step that is the whole gain.

    `overlap` (the default): the copies run on a side stream, so they overlap the layers' compute instead of queueing
    behind it (at 8 x 2048 on TinyLlama each layer's input is 64 MiB each way). The side stream waits for the compute
    that produced an input; the input stays alive until the next layer's input is packed, when the compute stream
    waits for its copy; and the backward, on reaching a layer, starts fetching the one below it. So one more layer
    input sits on the card than without overlap (the planner counts it). Without `overlap`: non-blocking copies on
    the compute stream, ordered, never overlapped."""
    import weakref

    import torch

    def pack(tensor):
        if tensor.device.type != "cuda" or tensor.numel() < 1 << 16:
            return tensor  # small or host tensors: not worth a copy
        if tensor.is_leaf and tensor.requires_grad:
            return tensor  # the embedding output: autograd keeps this leaf anyway, a copy would free nothing
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
        if not overlap:
            host.copy_(tensor, non_blocking=True)
            return tensor.device, host
        _release_in_flight(tensor.device)
        stream = _copy_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        _IN_FLIGHT[tensor.device] = (tensor, done)
        last = _LAST_PACKED[0]() if _LAST_PACKED[0] is not None else None
        packed = _Offloaded(host, tensor, weakref.ref(last) if last is not None else None)
        _LAST_PACKED[0] = weakref.ref(packed)
        return packed

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=True)
        _release_in_flight(packed.device)
        stream = _copy_stream(packed.device)
        packed.fetch(stream)
        below = packed.previous() if packed.previous is not None else None
        if below is not None:
            below.fetch(stream)  # the next layer's backward needs it: start its copy now
        torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        tensor, packed.on_device = packed.on_device, None
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def offloaded_checkpoint(function, *args, overlap: bool = True, **kwargs):
    """torch's checkpoint, whose saved inputs (one hidden state per layer) live in CPU RAM. Both variants save the
    layer's inputs through the hooks; the recompute in the backward runs outside them, on the device."""
    from torch.utils.checkpoint import checkpoint

    with _offload_hooks(overlap=overlap):
        return checkpoint(function, *args, **kwargs)


def checkpoint_kwargs(model=None) -> dict:
    """torch checkpoint's keyword arguments for this model's run: the one source for the Trainer, auto-fit's trial
    step and the offload switch. Reentrant checkpoints (the GPU default) run the forward under no_grad: no autograd
    graph and no saved-tensor hook per saved tensor, which is host time on a host-bound step (measured in
    bench/NOTES.md). They need an input that requires grad: transformers' gradient_checkpointing_enable makes the
    embeddings' output require it."""
    fast = options_of(model)
    if fast.selective_gc:  # TRL's selective checkpointing works through the non-reentrant variant only
        return {"use_reentrant": False, "selective": True}
    return {"use_reentrant": bool(fast.reentrant)}


def graphs_on(model=None) -> bool:
    """Whether this model's checkpointed layers run as CUDA graphs: the lever, a GPU, reentrant checkpoints (the
    graphs are the reentrant checkpoint's two halves), not TRL's selective variant, and the run's choice
    (RunConfig.cuda_graphs, which attach_lora and auto-fit record as `model._nb_use_graphs`)."""
    import torch

    fast = options_of(model)
    return bool(fast.graphs and fast.reentrant and not fast.selective_gc and torch.cuda.is_available()
                and getattr(model, "_nb_use_graphs", True))


def set_checkpoint_offload(model, offload: bool) -> None:
    """Point every checkpointed layer at its checkpoint function, with this run's checkpoint_kwargs: offloaded to
    CPU RAM, replayed as CUDA graphs (graphs_on), or torch's plain checkpoint."""
    import functools

    from torch.utils.checkpoint import checkpoint

    kwargs = {k: v for k, v in checkpoint_kwargs(model).items() if k == "use_reentrant"}
    graphs, overlap = graphs_on(model), options_of(model).offload_overlap
    if offload:
        function = functools.partial(offloaded_checkpoint, overlap=overlap, **kwargs)
    else:
        function = functools.partial(checkpoint, **kwargs)
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = (_graphed_function(module, overlap if offload else None) if graphs
                                                   else function)


def _graphed_function(layer, offload_overlap: bool | None = None):
    """The layer's graphed checkpoint, its saved input offloaded to CPU RAM unless `offload_overlap` is None (the
    same saved-tensor hooks as offloaded_checkpoint). Its graphs live as long as the layer (graphed_layers.reset
    drops them)."""
    import functools

    from .graphed_layers import LayerGraphs, graphed_checkpoint

    if getattr(layer, "_nb_graphs", None) is None:
        layer._nb_graphs = LayerGraphs(layer)
    if offload_overlap is None:
        return functools.partial(graphed_checkpoint, graphs=layer._nb_graphs)
    return functools.partial(_offloaded_graphed_checkpoint, graphs=layer._nb_graphs, overlap=offload_overlap)


def _offloaded_graphed_checkpoint(function, *args, graphs, overlap: bool, **kwargs):
    from .graphed_layers import graphed_checkpoint

    with _offload_hooks(overlap=overlap):
        return graphed_checkpoint(function, *args, graphs=graphs, **kwargs)


def install_offload(model, offload: bool) -> bool:
    """Whenever checkpointing is turned on (the Trainer does it in train(), after this), offload its saved inputs
    if `model._nb_offload` says so; auto-fit may change that flag after this. CUDA only; says once why not elsewhere.
    Returns whether the switch is installed."""
    import functools

    import torch

    if not torch.cuda.is_available():
        if offload:
            say_once("offload", "[fast] checkpoint offload off: no CUDA GPU (the activations already live in RAM)")
        return False
    model._nb_offload = offload
    enable = model.gradient_checkpointing_enable
    if getattr(getattr(model, "_nb_fast", None), "offload_sync", False) or FastOptions.from_env().offload_sync:
        model.gradient_checkpointing_enable = functools.partial(enable, offload=True)  # transformers' save_on_cpu
        say_once("offload-on", "[fast] activation checkpoints offloaded to pinned CPU RAM (transformers, synchronous)")
        return True

    def enable_with_offload(gradient_checkpointing_kwargs=None, **kwargs):
        kwargs.pop("offload", None)
        enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)
        if model._nb_offload or graphs_on(model):
            set_checkpoint_offload(model, model._nb_offload)
        if model._nb_offload:
            say_once("offload-on", "[fast] activation checkpoints offloaded to pinned CPU RAM (asynchronous copies)")
        if graphs_on(model):
            say_once("graphs-on", "[fast] checkpointed layers replayed as CUDA graphs (captured once per shape)")

    model.gradient_checkpointing_enable = enable_with_offload
    return True


# --- fused QLoRA layers -----------------------------------------------------------------------------------------
def apply_fused_lora(model, verbose: bool = True, direct_dequant: bool = True) -> bool:
    """Route the 4-bit layers through nb_helpers.fused_lora (same math, fewer host calls). CUDA only."""
    import torch

    if not torch.cuda.is_available():
        if verbose:
            say_once("fused-lora", "[fast] fused QLoRA layers off: no CUDA GPU; peft's and bitsandbytes' layers run")
        return False
    from . import fused_lora

    count = fused_lora.install(model, direct_dequant=direct_dequant and direct_dequant_available(verbose))
    if verbose:
        say_once("fused-lora-on", f"[fast] {count} 4-bit layers run as fused QLoRA functions (one call each)")
    return count > 0


def direct_dequant_available(verbose: bool = True) -> bool:
    """Whether the fused layers can call bitsandbytes' dequantize kernels directly; if not, says once why."""
    from . import fused_lora

    reason = fused_lora.direct_kernels_unavailable_reason()
    if reason is not None and verbose:
        say_once("direct-dequant", f"[fast] bitsandbytes' dequantize kernels are not reachable directly ({reason}); "
                                   "using its public dequantize_4bit (same result, more host time per call)")
    return reason is None


# --- compiled decoder layers ------------------------------------------------------------------------------------
def compile_unavailable_reason(model) -> str | None:
    """Why the decoder layers cannot be compiled here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU (Inductor's CPU code needs a C++ toolchain and pays little at 2-8 threads)"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - no Triton wheel for this platform (native Windows)
        return f"Triton is not importable ({type(e).__name__}: {e})"
    if not hasattr(_decoder(model), "layers"):
        return "the model has no `layers` list to compile"
    return None


def compile_layers(model, verbose: bool = True) -> bool:
    """torch.compile every decoder layer in place (regional compilation: the layers share one compiled graph, so the
    cost is one layer's compile, not the model's). The 4-bit matmuls stay bitsandbytes' kernels (registered as
    custom ops); Inductor fuses what sits between them: norms, RoPE, SwiGLU, LoRA's dropout and scaling, the residual
    adds. Gradient checkpointing wraps the compiled layer, so the recompute runs compiled code too."""
    reason = compile_unavailable_reason(model)
    if reason is not None:
        if verbose:
            say_once("compile", f"[fast] decoder layers not compiled: {reason}; running eagerly (same math)")
        return False
    import torch

    layers = _decoder(model).layers
    # one graph serves every layer, but automatic dynamic shapes recompile once for a new length; keep headroom
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(layers))
    for layer in layers:
        layer.compile(dynamic=None)
    if verbose:
        say_once("compile-on", f"[fast] {len(layers)} decoder layers compiled (torch.compile, Inductor); the first "
                               "steps include the compile")
    return True


# --- no mask for right-padded batches ---------------------------------------------------------------------------
def _decoder(model):
    """The LlamaModel-like decoder inside a (peft-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, getattr(base, "base_model_prefix", "model"), base)


def install_mask_drop(model) -> None:
    """In training mode, the decoder ignores a 2-D attention mask that only marks right padding. build_trainer
    checks every training batch on the CPU (no device sync) and turns this off for good if one is not
    right-padded. Evaluation and generation (left-padded prompts) never enter it: model.training is False."""
    decoder = _decoder(model)
    if getattr(decoder, "_nb_mask_drop", None) is not None:
        return
    decoder._nb_mask_drop = True

    def drop(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if module.training and module._nb_mask_drop and mask is not None and mask.dim() == 2 \
                and kwargs.get("past_key_values") is None:
            kwargs["attention_mask"] = None
            return args, kwargs
        return None

    decoder.register_forward_pre_hook(drop, with_kwargs=True)


def is_right_padded(mask) -> bool:
    """Each row is ones then zeros (CPU tensor)."""
    import torch

    lengths = mask.sum(-1, keepdim=True)
    return bool(torch.equal(mask.bool(), torch.arange(mask.shape[-1]) < lengths))


def guard_collator(collator, model):
    """Wrap the training collator: a batch that is not right-padded switches the mask drop off (said once)."""
    decoder = _decoder(model)

    def collate(examples):
        batch = collator(examples)
        mask = batch.get("attention_mask") if hasattr(batch, "get") else None
        if getattr(decoder, "_nb_mask_drop", False) and mask is not None and mask.dim() == 2 \
                and mask.device.type == "cpu" and not is_right_padded(mask):
            decoder._nb_mask_drop = False
            say_once("mask", "[fast] a training batch is not right-padded: attention masks are kept from now on")
        return batch

    return collate
