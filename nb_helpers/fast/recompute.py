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
"""

from __future__ import annotations

from contextlib import contextmanager

_ACTIVE: list = []  # the recomputes running now, innermost last (the autograd thread that runs the backward)


class _Recompute:
    def __init__(self, layer):
        self.skip = getattr(layer, "_nb_dead_tail", None)  # the dead module; False: none; None: not probed yet
        self.keep_weights = getattr(layer, "_nb_keep_weights", False)
        self.probing = self.skip is None
        self.last = None  # the last 4-bit linear layer that returned
        self.saved_after_last = False


def is_dead(module) -> bool:
    """Whether a fused 4-bit layer may skip its product: this is the recompute of its decoder layer, and the probe
    found its output read by nothing."""
    return bool(_ACTIVE) and _ACTIVE[-1].skip is module


def keeps_weights() -> bool:
    """Whether a fused 4-bit layer keeps the weight it dequantized for its backward (lever keep_dequantized): this is
    a recompute, whose backward runs right after it, so one layer's weights are held at a time, where without the
    lever the backward dequantizes each again. Never in a forward without checkpointing: that would hold every layer's."""
    return bool(_ACTIVE) and _ACTIVE[-1].keep_weights


def returned(module) -> None:
    """A fused 4-bit layer's forward returned (what the probe needs to know which layer came last)."""
    if _ACTIVE and _ACTIVE[-1].probing:
        _ACTIVE[-1].last, _ACTIVE[-1].saved_after_last = module, False


@contextmanager
def recomputing(layer):
    """Around a decoder layer's recompute. The layer's first one is the probe; later ones skip its dead product.
    A no-op unless the layer was marked for the lever (mark)."""
    if not getattr(layer, "_nb_tail_lever", False):
        yield
        return
    import torch

    state = _Recompute(layer)
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


def mark(layer, on: bool, keep_weights: bool = False) -> None:
    """Switch the lever for one decoder layer; switching it (back) on probes again at the next recompute.
    `keep_weights`: its recompute also keeps the dequantized weights for the backward (keeps_weights)."""
    layer._nb_tail_lever, layer._nb_keep_weights = bool(on), bool(on and keep_weights)
    layer._nb_dead_tail = None


def dead_module(layer):
    """The module whose product this layer's recompute skips, False where none is dead, None before the probe."""
    return getattr(layer, "_nb_dead_tail", None)


def tail_aware_checkpoint(function, *args, layer, checkpoint, **kwargs):
    """A reentrant `checkpoint` of `function` whose recompute (the call with gradients on: a reentrant checkpoint runs
    its first forward under no_grad) runs inside recomputing(layer)."""
    import torch

    def run(*inner_args, **inner_kwargs):
        if not torch.is_grad_enabled():
            return function(*inner_args, **inner_kwargs)
        with recomputing(layer):
            return function(*inner_args, **inner_kwargs)

    return checkpoint(run, *args, **kwargs)
