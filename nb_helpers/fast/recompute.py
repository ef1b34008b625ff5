"""A checkpointed layer's recompute skips the one product its backward never reads.

With gradient checkpointing, each layer's backward first runs the layer's forward again, to rebuild the tensors its
backward reads. In a Llama-style layer the last product of that forward, the MLP's down projection (a quarter of the
layer's matmul FLOPs), is read by nothing: it only goes into the residual add, which saves no tensor, and the
layer's output value is thrown away (the backward needs its gradient, not its value). So in the recompute that
product is skipped and zeros of its shape go on. The gradients are the same: the backward of a linear layer reads its
weight and the output's gradient, never the output.

Which product is dead is found per layer, not assumed: the layer's first recompute runs whole, with saved-tensor
hooks noting whether any tensor is saved after its last 4-bit linear layer returns. If none is, that layer's product is
dead in every later recompute of that decoder layer. Gemma's norm after the MLP saves its input, so Gemma keeps it.

torch's non-reentrant checkpoint stops its recompute early in the same way; the reentrant checkpoints the fast path
runs (and their CUDA graphs, fast.graphed_layers) do not, hence this. Lever `dead_tail` (fast.options).

The recompute also reuses what its forward made and kept (lever `down_once`): each LoRA layer's rank-r product
dropout(x) A^T, tokens x r, which the dropout kernels (fast.lora_dropout) would otherwise make again by reading the
input and drawing the mask once more. The checkpoint's first forward leaves it in a stash that lives as long as that
one checkpoint (or, for a CUDA graph, as long as the graph), so a recompute only ever reads its own forward's.
"""

from __future__ import annotations

from contextlib import contextmanager

_ACTIVE: list = []  # the recomputes running now, innermost last (the autograd thread that runs the backward)
_FORWARDS: list = []  # the stashes of the checkpointed forwards running now (lever down_once)


class _Recompute:
    def __init__(self, layer, stash=None):
        self.skip = getattr(layer, "_nb_dead_tail", None)  # the dead module; False: none; None: not probed yet
        self.stash = stash if getattr(layer, "_nb_down_once", False) else None
        self.probing = self.skip is None
        self.last = None  # the last 4-bit linear layer that returned
        self.saved_after_last = False


def is_dead(module) -> bool:
    """Whether a fused 4-bit layer may skip its product: this is the recompute of its decoder layer, and the probe
    found its output read by nothing."""
    return bool(_ACTIVE) and _ACTIVE[-1].skip is module


def stash_of_forward():
    """The stash a fused LoRA layer leaves its rank-r product in: this is a checkpointed layer's first forward with
    lever down_once; else None."""
    return _FORWARDS[-1] if _FORWARDS else None


def stashed(module):
    """What `module` left in the stash in this recompute's forward, or None."""
    stash = _ACTIVE[-1].stash if _ACTIVE else None
    return None if stash is None else stash.get(module)


@contextmanager
def forwarding(layer, stash: dict):
    """Around a checkpointed decoder layer's first forward (no_grad): its LoRA layers leave their rank-r products in
    `stash`, which the same checkpoint's recompute then reads (recomputing(layer, stash)). A no-op unless the layer
    is marked for lever down_once."""
    if not getattr(layer, "_nb_down_once", False):
        yield
        return
    _FORWARDS.append(stash)
    try:
        yield
    finally:
        _FORWARDS.pop()


def returned(module) -> None:
    """A fused 4-bit layer's forward returned (what the probe needs to know which layer came last)."""
    if _ACTIVE and _ACTIVE[-1].probing:
        _ACTIVE[-1].last, _ACTIVE[-1].saved_after_last = module, False


@contextmanager
def recomputing(layer, stash: dict | None = None):
    """Around a decoder layer's recompute. The layer's first one is the probe; later ones skip its dead product.
    `stash`: what this checkpoint's forward left (forwarding). A no-op unless the layer was marked (mark)."""
    if not getattr(layer, "_nb_tail_lever", False):
        yield
        return
    import torch

    state = _Recompute(layer, stash)
    _ACTIVE.append(state)
    try:
        if not state.probing:
            yield
            return

        def pack(tensor):
            state.saved_after_last = True
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        layer._nb_dead_tail = state.last if state.last is not None and not state.saved_after_last else False
    finally:
        _ACTIVE.pop()


def mark(layer, on: bool, down_once: bool = False) -> None:
    """Switch the lever for one decoder layer; switching it (back) on probes again at the next recompute.
    `down_once`: its recompute reuses its forward's LoRA products (forwarding, stashed)."""
    layer._nb_tail_lever = bool(on)
    layer._nb_down_once = bool(on and down_once)
    layer._nb_dead_tail = None


def dead_module(layer):
    """The module whose product this layer's recompute skips, False where none is dead, None before the probe."""
    return getattr(layer, "_nb_dead_tail", None)


def tail_aware_checkpoint(function, *args, layer, checkpoint, **kwargs):
    """A reentrant `checkpoint` of `function` whose recompute (the call with gradients on: a reentrant checkpoint runs
    its first forward under no_grad) runs inside recomputing(layer), and its first forward inside forwarding(layer)."""
    import torch

    stash: dict = {}  # this checkpoint's own: the checkpoint keeps `run`, so it lives until its backward is done

    def run(*inner_args, **inner_kwargs):
        if not torch.is_grad_enabled():
            with forwarding(layer, stash):
                return function(*inner_args, **inner_kwargs)
        with recomputing(layer, stash):
            return function(*inner_args, **inner_kwargs)

    return checkpoint(run, *args, **kwargs)
