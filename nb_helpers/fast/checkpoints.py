"""Which function each checkpointed layer runs: torch's reentrant checkpoint, the same with its saved input in CPU RAM
(fast.offload), or its two halves replayed as CUDA graphs (fast.graphed_layers); for the last no_recompute_layers
layers no checkpoint at all (they keep their activations: no recompute in their backward); and the batch padding
graphs need.

Reentrant checkpoints (the fast path's, on a GPU) run the forward under no_grad: no autograd graph and no saved-tensor hook per
saved tensor, which is host time on a host-bound step (an H200, 2026-12-01). They need an input that requires grad:
transformers' gradient_checkpointing_enable makes the embeddings' output require it.
"""

from __future__ import annotations

import functools

from nb_helpers import compat
from nb_helpers.fast import recompute, saved_attention
from nb_helpers.fast.graphed_layers import PAD_MULTIPLE, LayerGraphs, graphed_checkpoint, graphed_kept
from nb_helpers.fast.offload import offload_hooks, offloaded_checkpoint
from nb_helpers.fast.state import options_of, path_of
from nb_helpers.frontend import say_once


def checkpoint_kwargs(model=None) -> dict:
    """torch checkpoint's keyword arguments for this model's run: the one source for the Trainer, auto-fit's trial
    step and the offload switch."""
    return {"use_reentrant": bool(options_of(model).reentrant)}


def graphs_on(model=None) -> bool:
    """Whether this model's checkpointed layers run as CUDA graphs: the lever, a GPU, reentrant checkpoints (the
    graphs are the reentrant checkpoint's two halves), and the run's choice (RunConfig.cuda_graphs, which
    attach_lora and auto-fit record on the model's FastPath)."""
    import torch

    fast = options_of(model)
    state = path_of(model)
    return bool(fast.graphs and fast.reentrant and torch.cuda.is_available() and (state is None or state.use_graphs))


def pad_multiple(model) -> int | None:
    """The collator's length step, or None: where the layers run as CUDA graphs (one graph per shape), and on CUDA
    with the `pad_lengths` lever (cuDNN's attention builds an execution plan for every new length)."""
    import torch

    if graphs_on(model) or (options_of(model).pad_lengths and torch.cuda.is_available()):
        return PAD_MULTIPLE
    return None


def tail_lever_on(model=None) -> bool:
    """Whether this model's checkpointed layers skip their dead product in the recompute (FastOptions.skips_dead_tail)."""
    return options_of(model).skips_dead_tail()


def set_checkpoint_offload(model, offload: bool) -> None:
    """Point every checkpointed layer at its checkpoint function: offloaded to CPU RAM, replayed as CUDA graphs
    (graphs_on), both, or torch's plain checkpoint; each recompute skipping its dead product (tail_lever_on) and, with
    it, reusing its forward's LoRA products (lever down_once)."""
    from torch.utils.checkpoint import checkpoint

    graphs, tail = graphs_on(model), tail_lever_on(model)
    down_once = options_of(model).down_once
    # the attention a checkpoint's forward sends to CPU RAM with it: offloaded eager checkpoints with down_once's stash
    saved = bool(options_of(model).saved_attention and offload and not graphs and tail and down_once)
    plain = functools.partial(offloaded_checkpoint if offload else checkpoint, **checkpoint_kwargs(model))
    layers = compat.checkpointed_layers(model)
    first_kept = len(layers) - min(len(layers), no_recompute_layers(model))  # the last layers keep activations
    for index, layer in enumerate(layers):
        if index >= first_kept:
            recompute.mark(layer, False)
            saved_attention.mark(layer, False)
            compat.set_checkpoint_function(layer, kept_function(layer, graphs))
            continue
        recompute.mark(layer, tail, down_once)
        saved_attention.mark(layer, saved)
        # the last checkpoint's backward comes first: offloaded, it stays on the card (fast.offload)
        own = functools.partial(plain, on_card=True) if offload and index == first_kept - 1 else plain
        function = own if not tail else functools.partial(recompute.tail_aware_checkpoint, layer=layer,
                                                          checkpoint=own)
        compat.set_checkpoint_function(layer, graphed_function(layer, offload) if graphs else function)


def no_recompute_layers(model) -> int:
    """How many of the last checkpointed layers keep their activations instead (RunConfig.no_recompute_layers, which
    after_lora and auto-fit record on the model)."""
    state = path_of(model)
    return max(0, int(state.no_recompute or 0)) if state is not None else 0


def called_directly(function, *args, **kwargs):
    """A layer that keeps its activations: called as without checkpointing (autograd saves what its backward reads)."""
    return function(*args, **kwargs)


def kept_function(layer, graphs: bool):
    """What a layer that keeps its activations runs: its forward and backward as CUDA graphs (graphs_on), or a plain
    call."""
    if not graphs:
        return called_directly
    if getattr(layer, "_nb_kept_graphs", None) is None:  # apart from its checkpoint's graphs: other captures
        layer._nb_kept_graphs = LayerGraphs(layer)
    return functools.partial(graphed_kept, graphs=layer._nb_kept_graphs)


def graphed_function(layer, offload: bool):
    """The layer's graphed checkpoint, its saved input in CPU RAM with `offload` (the same saved-tensor hooks as
    offloaded_checkpoint). Its graphs live as long as the layer (graphed_layers.reset drops them). Its recompute runs
    inside fast.recompute.recomputing (a no-op unless the layer is marked)."""
    if getattr(layer, "_nb_graphs", None) is None:
        layer._nb_graphs = LayerGraphs(layer)
    if not offload:
        return functools.partial(graphed_checkpoint, graphs=layer._nb_graphs)
    return functools.partial(offloaded_graphed_checkpoint, graphs=layer._nb_graphs)


def offloaded_graphed_checkpoint(function, *args, graphs, **kwargs):
    with offload_hooks():
        return graphed_checkpoint(function, *args, graphs=graphs, **kwargs)


def install_offload(model, offload: bool) -> bool:
    """Whenever checkpointing is turned on (the Trainer does it in train(), after this), point the layers at this
    run's checkpoint function: offloaded if the model's FastPath says so (auto-fit may change that after this),
    graphed where graphs_on. CUDA only. Returns whether the switch is installed."""
    import torch

    if not torch.cuda.is_available():
        if offload:
            say_once("offload", "[fast] checkpoint offload off: no CUDA GPU (the activations already live in RAM)")
        if no_recompute_layers(model):
            say_once("no-recompute-cpu", "[fast] no_recompute_layers applies on a CUDA GPU; here every checkpointed "
                                         "layer recomputes (the CPU profile turns checkpointing off instead)")
        return False
    state = path_of(model)
    state.offload = offload
    enable = model.gradient_checkpointing_enable

    def enable_with_offload(gradient_checkpointing_kwargs=None, **kwargs):
        enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)
        if state.offload or graphs_on(model) or tail_lever_on(model) or no_recompute_layers(model):
            set_checkpoint_offload(model, state.offload)
        if state.offload:
            say_once("offload-on", "[fast] activation checkpoints offloaded to pinned CPU RAM (asynchronous copies)")
        if graphs_on(model):
            say_once("graphs-on", "[fast] checkpointed layers replayed as CUDA graphs (captured once per shape)")

    model.gradient_checkpointing_enable = enable_with_offload
    return True
