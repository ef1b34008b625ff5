"""Layers that keep their activations (RunConfig.no_recompute_layers; fast.checkpoints) replayed as CUDA graphs.

A checkpointed layer's graphs (fast.graphed_layers) are its no_grad forward and its recompute-and-backward. A layer
that keeps its activations has no recompute: its forward runs with autograd recording, and its backward differentiates
what that forward saved. So its forward is captured with autograd on (the saved tensors live in the graphs' memory
pool, at fixed addresses each replay refills), and its backward is captured from the record that capture left. What
it shares with the checkpointed layers: the pool, the capture stream, the entries per input signature, and the
eager fallback for whatever a graph cannot take (the same math).

A shape's first call runs eagerly, forward and backward, as the warm-up: the backward cannot warm up on the captured
forward's saved tensors, because some kernels overwrite what they read (liger's SwiGLU backward writes its gradients
into its saved inputs). Its second call is captured, and replays from then on.
"""

from __future__ import annotations

import torch

from nb_helpers.fast.graphed_layers import (LayerGraphs, _aliased_weights, _autocast, _differentiate, _fail,
                                            _generator, _on_side_stream, _plan_call)


class _Kept:
    """One kept layer's graphs, for one shape: its own input buffers (its saved tensors may be views of them), the
    forward's autograd record from the capture (until the backward is captured from it), the static outputs, and
    the backward's static gradients."""

    def __init__(self, inputs, leaves, weights, outputs):
        self.inputs, self.leaves, self.weights, self.outputs = inputs, leaves, weights, outputs
        self.grad_outputs: list = []
        self.input_grads: list = []
        self.param_grads: list = []


def graphed_kept(function, *args, graphs: LayerGraphs, **kwargs):
    """A layer that keeps its activations (no checkpoint, so no recompute), its forward with autograd and its
    backward replayed as CUDA graphs. A shape's first call runs eagerly, forward and backward, as the warm-up (the
    backward cannot warm up on the captured forward's saved tensors: some kernels overwrite them, liger's SwiGLU
    among them); its second is captured. Whatever a graph cannot take runs eagerly (the same math)."""
    plan, params = _plan_call(function, args, kwargs, graphs)
    entry = plan.entry
    if entry is None or entry.failed or not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if not entry.warmed:
        entry.warmed = True
        return function(*args, **kwargs)
    if entry.forward is None:
        _capture_kept_forward(plan, entry)
        if entry.forward is None:
            return function(*args, **kwargs)
    return plan.unflatten(_GraphedKept.apply(plan, *plan.tensors, *params))


def _capture_kept_forward(plan, entry) -> None:
    """Capture the layer's forward with autograd recording: the saved tensors live in the graphs' pool, the record of
    what to differentiate stays on the entry until the backward is captured from it."""
    tensors, device = plan.tensors, plan.tensors[0].device
    generator, autocast = _generator(tensors), (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    rng = generator.get_state()
    needs = [t.requires_grad for t in tensors]
    inputs = [torch.empty_like(t) for t in tensors]
    # the warm-up's activations, freed into the allocator's cache, would sit beside the pool's copy of them (call
    # 52: 0.27 GiB over the plan at 8 x 512 with three layers kept): given back before the pool takes its own
    torch.cuda.empty_cache()

    def run():
        leaves = [buffer.detach().requires_grad_(need) for buffer, need in zip(inputs, needs)]
        with _aliased_weights(plan.owners) as weights, torch.enable_grad(), _autocast(autocast):
            outputs = plan.call(leaves)
        entry.kept = _Kept(inputs, leaves, weights, outputs)

    try:
        graph = torch.cuda.CUDAGraph()
        _on_side_stream(run, device, graph)
        entry.forward, entry.out_spec = graph, plan.out_spec
    except Exception as error:  # noqa: BLE001 - whatever cannot be captured runs eagerly
        entry.kept = None
        _fail(entry, plan, error)
    finally:
        generator.set_state(rng)  # the replay draws this call's dropout masks


def _capture_kept_backward(entry, grad_outputs, device) -> None:
    """Capture the gradients of the captured forward's record: for the inputs that need them and the LoRA weights."""
    kept = entry.kept
    kept.grad_outputs = [torch.empty_like(g) for g in grad_outputs]

    def run():
        pairs = [(o, g) for o, g in zip(kept.outputs, kept.grad_outputs) if o.requires_grad]
        wrt = [t for t in kept.leaves if t.requires_grad] + kept.weights
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        kept.input_grads = [next(grads) if t.requires_grad else None for t in kept.leaves]
        kept.param_grads = [torch.zeros_like(w) if g is None else g for w, g in zip(kept.weights, grads)]

    graph = torch.cuda.CUDAGraph()
    _on_side_stream(run, device, graph)
    entry.backward = graph
    kept.outputs, kept.leaves = [o.detach() for o in kept.outputs], None  # the record is spent; the memory stays


class _GraphedKept(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, *tensors_and_params):
        entry = plan.entry
        tensors = tensors_and_params[:len(plan.tensors)]
        ctx.plan, ctx.entry = plan, entry
        ctx.generator = _generator(tensors)
        ctx.rng = ctx.generator.get_state()
        ctx.autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        ctx.needs = [t.requires_grad for t in tensors]
        ctx.save_for_backward(*tensors)  # only for a backward capture that fails: it recomputes, as a checkpoint
        for buffer, tensor in zip(entry.kept.inputs, tensors):
            # through .data: a copy that leaves the version counter alone, which the capture's saved views of the
            # buffer share (RoPE saves cos and sin): autograd would otherwise refuse to capture the backward
            buffer.data.copy_(tensor)
        entry.forward.replay()
        plan.out_spec = entry.out_spec
        return tuple(out.detach().clone() for out in entry.kept.outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        entry = ctx.entry
        if entry.backward is None and not entry.failed:
            try:
                _capture_kept_backward(entry, grad_outputs, grad_outputs[0].device)
            except Exception as error:  # noqa: BLE001 - recompute instead, as a checkpoint would, and run eagerly
                _fail(entry, ctx.plan, error)
                entry.kept = None  # the capture's record and its saved tensors go
        if entry.backward is None:
            now = ctx.generator.get_state()
            ctx.generator.set_state(ctx.rng)
            try:
                inputs, params = _differentiate(ctx.plan, ctx.saved_tensors, ctx.needs, grad_outputs, ctx.autocast)
            finally:
                ctx.generator.set_state(now)
            return (None, *inputs, *params)
        kept = entry.kept
        for buffer, grad in zip(kept.grad_outputs, grad_outputs):
            buffer.copy_(grad)
        entry.backward.replay()
        return (None, *[None if g is None else g.clone() for g in kept.input_grads], *kept.param_grads)
