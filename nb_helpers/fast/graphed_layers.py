"""Decoder layers replayed as CUDA graphs: one launch per layer instead of a few hundred.

At 8 x 512 tokens on an H200 the GPU was busy 29% of a training step (2026-12-01); the rest was the host
launching about 4,600 kernels through Python, autograd and bitsandbytes. Two kinds of layer are graphed.

A checkpointed layer is a pure function of its inputs: its forward runs without autograd, and its backward
recomputes the forward and differentiates it. So both halves are captured once per input shape and replayed from then
on (graphed_checkpoint):

  * forward graph: the layer under no_grad, from static input buffers into a static output buffer;
  * backward graph: the recompute and its gradients (for the layer's input and its LoRA weights).

The math is the reentrant checkpoint's: the same kernels, and the same dropout masks, because the CUDA generator is
rewound to its forward state before the recompute, as torch's checkpoint does (graph replays read the generator's
seed and offset when they run). The first call of a shape runs once eagerly, as warm-up (Triton autotuning, cuBLAS
and cuDNN set-up must not happen inside a capture), and is then captured.

A layer that keeps its activations (RunConfig.no_recompute_layers; fast.checkpoints) has no recompute: its forward
runs with autograd recording, and its backward differentiates what that forward saved (graphed_kept). So its forward
is captured with autograd on (the saved tensors live in the graphs' memory pool, at fixed addresses each replay
refills), and its backward is captured from the record that capture left. A shape's first call runs eagerly, forward
and backward, as the warm-up: the backward cannot warm up on the captured forward's saved tensors, because some
kernels overwrite what they read (liger's SwiGLU backward writes its gradients into its saved inputs). Its second call
is captured, and replays from then on.

Both kinds share the pool, the capture stream, the entries per input signature, and the eager fallback for whatever a
graph cannot take (the same math). What graphs need, and what happens otherwise:
  * static shapes: the training collator pads each batch to a multiple of PAD_MULTIPLE tokens (no attention mask:
    a causal model's real tokens never see the right padding), so a run meets a handful of shapes; past MAX_SHAPES
    per layer, new shapes run eagerly;
  * tensors and simple values as the layer's arguments; anything else (a cache object) runs eagerly;
  * a capture that fails (an operation that cannot be captured) leaves that layer eager, said once with the reason.
All graphs share one memory pool, and checkpointed layers of one shape share their input and output buffers. That is
what graphs cost: the pool, measured at 2.4 times a layer's eager recompute-and-backward working memory, and two
hidden states of buffers per shape (the planner's `graphs` term).
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from nb_helpers.fast import recompute
from nb_helpers.frontend import say_once

PAD_MULTIPLE = 64  # tokens: shapes a run meets (8 x 512 rows: one; the shipped data, 8 x ~110: 128 and rarely 64)
MAX_SHAPES = 8  # graphs kept per layer; a run with more shapes than this replays the first ones, the rest run eagerly
_SIMPLE = (type(None), bool, int, float, str)


def padded_length(tokens: int) -> int:
    """The length a batch whose longest row has `tokens` tokens is padded to (the collator's pad_to_multiple_of)."""
    return -(-tokens // PAD_MULTIPLE) * PAD_MULTIPLE


# --- what both kinds share: the capture stream, the pool, the entries, a call's plan, the eager fallback --------------
_STREAMS: dict = {}  # device index -> the capture stream, kept for the whole process (reset() keeps it)


def _capture_stream(device):
    """The side stream captures run on. One per device for the process: torch hands out its pooled streams in turn,
    and cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has run on, so a new stream after each
    reset() (auto-fit's trials, a second run in a notebook) added a workspace each time (the GPU suite on an H200,
    2026-12-01)."""
    if device.index not in _STREAMS:
        _STREAMS[device.index] = torch.cuda.Stream(device)
    return _STREAMS[device.index]


class _Shared:
    """Per device: the capture stream, the one memory pool, and the buffers per input signature."""

    def __init__(self, device):
        self.stream, self.pool, self.buffers = _capture_stream(device), None, {}

    def pool_for_capture(self):
        """The pool every live graph shares, or a fresh one when no graph is alive: a pool handle is only an id, and
        the allocator forgets the pool once the last graph captured into it is gone (an earlier model's graphs, after
        a second run in the same process); capturing into a forgotten id fails an internal assert."""
        if self.pool is None or graph_count() == 0:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool


_SHARED: dict = {}


def _shared(device) -> _Shared:
    return _SHARED[device.index] if device.index in _SHARED else _SHARED.setdefault(device.index, _Shared(device))


def reset() -> None:
    """Drop every graph and buffer (after auto-fit's trial steps, or weights that moved): their memory goes back."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for layer_graphs in list(LayerGraphs.live):
        layer_graphs.entries.clear()
    _SHARED.clear()


def graph_count() -> int:
    """Captured graphs alive (forward and backward counted apart)."""
    return sum((e.forward is not None) + (e.backward is not None)
               for g in LayerGraphs.live for e in g.entries.values() if e is not None)


class LayerGraphs:
    """One decoder layer's graphs, one entry per input signature; no entry (None) means: run eagerly."""

    live: "weakref.WeakSet[LayerGraphs]" = weakref.WeakSet()

    def __init__(self, layer):
        self.layer_name, self.entries = type(layer).__name__, {}
        LayerGraphs.live.add(self)

    def entry(self, key):
        if key not in self.entries:
            if len(self.entries) >= MAX_SHAPES:
                say_once("graph-shapes", f"[fast] a layer met more than {MAX_SHAPES} input shapes: new shapes run "
                                          "without CUDA graphs (pad batches to fewer lengths to keep them)")
                return None
            self.entries[key] = _Entry()
        return self.entries[key]


class _Entry:
    def __init__(self):
        self.forward = self.backward = None  # torch.cuda.CUDAGraph, once captured
        self.failed, self.buffers, self.out_spec, self.param_grads = False, None, None, []
        self.warmed = False  # a layer that keeps its activations: its first call of this shape ran eagerly
        self.kept = None  # and what its graphs read and write (_Kept)
        self.stash: dict = {}  # what the forward graph leaves for the backward graph's recompute (fast.recompute)


def _signature(leaves, params):
    """The graph key of one call: tensor shapes, dtypes, grad flags and devices, the other arguments' values, the
    autocast state, and where the trainable weights live. None when an argument is neither a tensor nor simple."""
    tensors, values = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append((tuple(leaf.shape), leaf.dtype, leaf.requires_grad, leaf.device.type, leaf.device.index))
        elif isinstance(leaf, _SIMPLE):
            values.append(leaf)
        else:
            return None
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return tuple(tensors), tuple(values), autocast, tuple(p.data_ptr() for p in params)


def _plan_call(function, args, kwargs, graphs: LayerGraphs):
    """The call's plan (its tensors, its graph entry) and the layer's trainable weights."""
    if isinstance(function, functools.partial):
        function, args, kwargs = function.func, function.args + args, {**function.keywords, **kwargs}
    layer = getattr(function, "__self__", None)
    owners = [(module, name) for module in (layer.modules() if layer is not None else ())
              for name, p in module._parameters.items() if p is not None and p.requires_grad]
    params = [module._parameters[name] for module, name in owners]
    leaves, spec = tree_flatten((args, kwargs))
    plan = _Plan(function, spec, leaves, graphs, _signature(leaves, params))
    plan.owners, plan.layer = owners, layer
    return plan, params


class _Plan:
    """One call: how to rebuild the layer's arguments from its tensors, and its graph entry (None: eager)."""

    def __init__(self, function, spec, leaves, graphs, signature):
        self.function, self.spec, self.graphs = function, spec, graphs
        self.mask = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        self.tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.others = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        self.stash: dict = {}  # an eager call's forward leaves this for its recompute (fast.recompute.forwarding)
        on_cuda = signature is not None and all(t[3] == "cuda" for t in signature[0]) and bool(signature[0])
        self.entry = graphs.entry(signature) if on_cuda else None
        self.out_spec = self.entry.out_spec if self.entry is not None else None
        if signature is None:
            say_once("graph-args", f"[fast] {graphs.layer_name} was called with a value a CUDA graph cannot take "
                                    "as an input: it runs without graphs (same math)")

    def call(self, tensors):
        tensor_it, other_it = iter(tensors), iter(self.others)
        leaves = [next(tensor_it) if is_tensor else next(other_it) for is_tensor in self.mask]
        args, kwargs = tree_unflatten(leaves, self.spec)
        flat, self.out_spec = tree_flatten(self.function(*args, **kwargs))
        return flat

    def unflatten(self, flat_out):  # the layer's output, rebuilt from the flat tensors a graphed call returns
        return tree_unflatten(list(flat_out), self.out_spec)


def _generator(tensors):
    """The generator dropout draws from: the device's CUDA generator, else the CPU's."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    return torch.cuda.default_generators[device.index] if device is not None else torch.default_generator


def _autocast(state):
    enabled, dtype = state
    return torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False)


@contextmanager
def _aliased_weights(owners):
    """The layer's trainable weights swapped for detached aliases (the same storage) while the recompute runs: its
    gradients are then taken for tensors born on the stream that runs it, not for the Parameters, whose gradient
    accumulators the outer autograd graph holds on the default stream (a cross-stream wait inside a capture)."""
    swapped = []
    try:
        for module, name in owners:
            param = module._parameters[name]
            module._parameters[name] = param.detach().requires_grad_()
            swapped.append((module, name, param))
        yield [module._parameters[name] for module, name, _ in swapped]
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def _differentiate(plan, tensors, needs, grad_outputs, autocast, stash=None):
    """The recompute (reading what its forward left in `stash`) and its gradients: for each input (None where it
    needs none), then for the trainable weights."""
    inputs = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]
    with _aliased_weights(plan.owners) as weights, torch.enable_grad(), _autocast(autocast):
        with recompute.recomputing(plan.layer, stash):
            outputs = plan.call(inputs)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        wrt = [t for t in inputs if t.requires_grad] + weights
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
    return [next(grads) if t.requires_grad else None for t in inputs], list(grads)


def _on_side_stream(run, device, graph=None) -> None:
    """Run `run` on the capture stream (capturing it into `graph` when given), ordered after the current stream's
    work and before what the current stream does next."""
    shared = _shared(device)
    current = torch.cuda.current_stream(device)
    shared.stream.wait_stream(current)
    with torch.cuda.stream(shared.stream):
        if graph is None:
            run()
        else:
            graph.capture_begin(pool=shared.pool_for_capture(), capture_error_mode="thread_local")
            try:
                run()
            finally:
                graph.capture_end()
    current.wait_stream(shared.stream)


_STRICT: list = [False]


@contextmanager
def out_of_memory_raises():
    """Inside: a capture that runs out of memory raises instead of falling back to eager layers, so that auto-fit's
    trial step sees that a graphed candidate does not fit (and steps down) rather than measuring an eager one."""
    _STRICT[0] = True
    try:
        yield
    finally:
        _STRICT[0] = False


def _fail(entry, plan, error) -> None:
    if _STRICT[0] and "OutOfMemoryError" in type(error).__name__:
        raise error
    entry.failed, entry.forward, entry.backward = True, None, None
    say_once("graph-fail", f"[fast] {plan.graphs.layer_name} could not be captured as a CUDA graph "
                            f"({type(error).__name__}: {str(error)[:160]}); it runs without graphs (same math)")


# --- checkpointed layers: the no_grad forward, and the recompute with its gradients -----------------------------------
class _Buffers:
    """Static inputs and outputs for one input signature, shared by every layer of that shape and class: each
    replay's results are copied out before the next layer replays. Two hidden states' worth: the backward graph
    reads the output gradients where the forward graph writes its outputs, and writes the input gradients where the
    inputs were, once the recompute has read them."""

    def __init__(self, tensors, outputs):
        self.inputs = [torch.empty_like(t) for t in tensors]
        self.outputs = [torch.empty_like(o) for o in outputs]
        self.grad_outputs = self.outputs
        self.grad_inputs = [buffer if t.requires_grad else None for t, buffer in zip(tensors, self.inputs)]


def graphed_checkpoint(function, *args, graphs: LayerGraphs, **kwargs):
    """A reentrant checkpoint of `function(*args, **kwargs)` (transformers passes the layer's call with its keyword
    arguments bound), replayed from CUDA graphs for input shapes it has met before."""
    plan, params = _plan_call(function, args, kwargs, graphs)
    return plan.unflatten(_GraphedCheckpoint.apply(plan, *plan.tensors, *params))


class _GraphedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, *tensors_and_params):
        tensors = tensors_and_params[:len(plan.tensors)]
        ctx.plan, ctx.params = plan, tensors_and_params[len(plan.tensors):]
        ctx.generator = _generator(tensors)
        ctx.rng = ctx.generator.get_state()
        ctx.autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        ctx.save_for_backward(*tensors)
        ctx.needs = [t.requires_grad for t in tensors]
        entry = plan.entry
        if entry is not None and not entry.failed and entry.forward is None:
            _capture_forward(plan, entry, tensors, ctx)
        if entry is not None and entry.forward is not None:
            for buffer, tensor in zip(entry.buffers.inputs, tensors):
                buffer.copy_(tensor)
            entry.forward.replay()
            plan.out_spec, ctx.stash = entry.out_spec, entry.stash
            return tuple(out.clone() for out in entry.buffers.outputs)
        ctx.stash = plan.stash
        with recompute.forwarding(plan.layer, plan.stash):
            return tuple(plan.call(tensors))

    @staticmethod
    def backward(ctx, *grad_outputs):
        plan, entry, tensors = ctx.plan, ctx.plan.entry, ctx.saved_tensors
        graphed = entry is not None and entry.forward is not None and not entry.failed
        if graphed and entry.backward is None:
            _capture_backward(plan, entry, tensors, grad_outputs, ctx)
        now = ctx.generator.get_state()
        ctx.generator.set_state(ctx.rng)  # the recompute draws the forward's dropout masks
        try:
            if entry is not None and entry.backward is not None:
                grads = _replay_backward(entry, tensors, grad_outputs)
            else:
                input_grads, param_grads = _differentiate(plan, tensors, ctx.needs, grad_outputs, ctx.autocast,
                                                          ctx.stash)
                grads = input_grads + param_grads
        finally:
            ctx.generator.set_state(now)
        return (None, *grads)


def _capture_forward(plan, entry, tensors, ctx) -> None:
    """Warm the layer up once (its outputs' shapes, autotuning), then capture it; the generator is rewound after."""
    device = tensors[0].device
    outputs: list = []

    def run():
        with torch.no_grad(), _autocast(ctx.autocast), recompute.forwarding(plan.layer, entry.stash):
            flat = plan.call(entry.buffers.inputs if entry.buffers else tensors)
        if entry.buffers is None:
            outputs.extend(flat)
        else:
            for buffer, out in zip(entry.buffers.outputs, flat):
                buffer.copy_(out)

    try:
        _on_side_stream(run, device)
        entry.out_spec = plan.out_spec
        key = (plan.graphs.layer_name, tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors))
        buffers = _shared(device).buffers
        entry.buffers = buffers.get(key) or buffers.setdefault(key, _Buffers(tensors, outputs))
        del outputs[:]
        ctx.generator.set_state(ctx.rng)
        graph = torch.cuda.CUDAGraph()
        _on_side_stream(run, device, graph)
        entry.forward = graph  # counted as live (graph_count) once captured
    except Exception as error:  # noqa: BLE001 - whatever cannot be captured runs eagerly
        _fail(entry, plan, error)
    finally:
        ctx.generator.set_state(ctx.rng)


def _capture_backward(plan, entry, tensors, grad_outputs, ctx) -> None:
    buffers, device = entry.buffers, tensors[0].device
    for buffer, tensor in zip(buffers.inputs, tensors):
        buffer.copy_(tensor)
    for buffer, grad in zip(buffers.grad_outputs, grad_outputs):
        buffer.copy_(grad)

    def run():
        input_grads, param_grads = _differentiate(plan, buffers.inputs, ctx.needs, buffers.grad_outputs,
                                                  ctx.autocast, entry.stash)
        for buffer, grad in zip(buffers.grad_inputs, input_grads):
            if buffer is not None:
                buffer.copy_(grad)
        entry.param_grads = param_grads  # once captured, the graph's own outputs: each replay rewrites them, no copy

    saved = ctx.generator.get_state()
    try:
        ctx.generator.set_state(ctx.rng)
        _on_side_stream(run, device)  # warm-up: the backward's kernels autotune outside the capture
        ctx.generator.set_state(ctx.rng)
        graph = torch.cuda.CUDAGraph()
        _on_side_stream(run, device, graph)
        entry.backward = graph
        entry.param_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(ctx.params, entry.param_grads)]
    except Exception as error:  # noqa: BLE001 - whatever cannot be captured runs eagerly
        _fail(entry, plan, error)
    finally:
        ctx.generator.set_state(saved)


def _replay_backward(entry, tensors, grad_outputs):
    buffers = entry.buffers
    for buffer, tensor in zip(buffers.inputs, tensors):
        buffer.copy_(tensor)
    for buffer, grad in zip(buffers.grad_outputs, grad_outputs):
        buffer.copy_(grad)
    entry.backward.replay()
    # input gradients live in buffers every layer of this shape shares: copied out before the next layer replays;
    # the params' gradients are this layer's own graph outputs, which autograd adds into .grad right away
    return [None if b is None else b.clone() for b in buffers.grad_inputs] + list(entry.param_grads)


# --- layers that keep their activations: the forward with autograd, and its gradients ---------------------------------
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
