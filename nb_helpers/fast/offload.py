"""Activation checkpoints in CPU RAM: each checkpointed layer's saved input goes to pinned host memory on a side
stream that overlaps the compute, and comes back, one layer ahead, in the backward. It frees layers x tokens x hidden
x 2 bytes of device memory, so long rows and bigger micro-batches fit (auto-fit chooses it; offload_checkpoints asks
for it by hand).

The last checkpointed layer keeps its checkpoint on the card (`on_card`). Its backward comes first, right after the
loss, so a copy out and back would only make the backward wait for it: at 8 x 2048 on TinyLlama an H100 sat idle
2.5 ms for that layer's input and attention to come back, and the loss's first synchronize queued 1.2 ms behind its
copy out (2026-12-06). Kept, its input costs no more of the card than the copy did: the input being copied out stays
on the card until the next layer's is packed, and the last layer has no next one. What its forward would have sent
along (fast.saved_attention) stays too, until its backward: the one layer's worth the planner already counts while
copies are in flight (the peak at 8 x 2048 measured 3.08 GiB with and without it, an H100, 2026-12-06).
"""

from __future__ import annotations

from contextlib import contextmanager


class _Offloaded:
    """One layer's checkpoint in pinned CPU RAM. `previous` (a weak reference) is the checkpoint packed just before it:
    the layer whose backward comes next, so its copy back can start while this layer's backward runs. `companions`:
    what that layer's forward sent to CPU RAM besides (fast.saved_attention), fetched back with it."""

    __slots__ = ("host", "shape", "dtype", "device", "on_device", "ready", "previous", "companions", "__weakref__")

    def __init__(self, host, like, previous):
        self.host, self.shape, self.dtype, self.device = host, like.shape, like.dtype, like.device
        self.on_device, self.ready, self.previous, self.companions = None, None, previous, ()

    def fetch(self, stream) -> None:
        """Copy back on the side stream into memory of the compute stream, so that freeing it later is ordered on
        the compute stream like any activation (no record_stream, no block held back from the allocator). The side
        stream first waits for the compute queued so far, which may still use the memory handed out here."""
        import torch

        for companion in self.companions:
            companion.fetch(stream)
        if self.on_device is not None or self.host is None:  # fetched already, or brought back and used
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
_SENT: list = []  # (device tensor, the event that ends its copy) sent by send_to_host, until the next pack or unpack
_COMPANIONS: list = []  # what send_to_host sent since the last pack: the next checkpoint packed fetches it back
_OFFLOADING: list = [0]  # offload_hooks' contexts open now
_ON_CARD: list = [0]  # of them, those of a checkpoint kept on the card (on_card)


class _OnCard:
    """The checkpoint of the layer whose backward comes first, kept on the card. `below`: a weak reference to the
    checkpoint packed before it, whose copy back starts when this one is unpacked."""

    __slots__ = ("tensor", "below")

    def __init__(self, tensor, below):
        self.tensor, self.below = tensor, below


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
    for _, done in [sent for sent in _SENT if sent[0].device == device]:
        torch.cuda.current_stream(device).wait_event(done)
    _SENT[:] = [sent for sent in _SENT if sent[0].device != device]


def offloading() -> bool:
    """Whether a checkpoint offloaded to CPU RAM is being made now (inside offload_hooks)."""
    return _OFFLOADING[0] > 0


def send_to_host(tensor):
    """A tensor a checkpointed layer's forward keeps for its own recompute (fast.saved_attention), sent to pinned CPU
    RAM on the checkpoints' side stream; the checkpoint packed next (that layer's input) fetches it back with itself.
    The device tensor lives until its copy ends, as a layer input does. Returns the handle for brought_back()."""
    import torch

    if _ON_CARD[0]:  # a checkpoint kept on the card keeps its companions there too: a handle that is fetched already
        kept = _Offloaded(None, tensor, None)
        kept.on_device = tensor
        return kept
    host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
    _SENT.append((tensor, _copy_out(tensor, host)))
    sent = _Offloaded(host, tensor, None)
    _COMPANIONS.append(sent)
    return sent


def _copy_out(tensor, host):
    """Start copying `tensor` into pinned `host` on the checkpoints' side stream, once the compute stream has made
    it; returns the event the copy ends on (the device tensor must live until then)."""
    import torch

    stream = _copy_stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def brought_back(sent):
    """The tensor send_to_host sent, on the device again (fetched now unless its checkpoint fetched it already); its
    host copy is let go: each is brought back once."""
    import torch

    sent.fetch(_copy_stream(sent.device))
    if sent.ready is not None:  # None: kept on the card (on_card), never copied
        torch.cuda.current_stream(sent.device).wait_event(sent.ready)
    tensor, sent.on_device, sent.host = sent.on_device, None, None
    return tensor


def _pack(tensor, on_card: bool):
    """offload_hooks' pack: a layer input copied out on the side stream (or kept, `on_card`); others as they are."""
    import weakref

    import torch

    if tensor.device.type != "cuda" or tensor.numel() < 1 << 16:
        return tensor  # small or host tensors: not worth a copy
    if tensor.is_leaf and tensor.requires_grad:
        return tensor  # the embedding output: autograd keeps this leaf anyway, a copy would free nothing
    last = _LAST_PACKED[0]() if _LAST_PACKED[0] is not None else None
    below = weakref.ref(last) if last is not None else None
    if on_card:
        _release_in_flight(tensor.device)
        return _OnCard(tensor, below)
    host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
    _release_in_flight(tensor.device)
    _IN_FLIGHT[tensor.device] = (tensor, _copy_out(tensor, host))
    packed = _Offloaded(host, tensor, below)
    packed.companions, _COMPANIONS[:] = tuple(_COMPANIONS), []
    _LAST_PACKED[0] = weakref.ref(packed)
    return packed


def _fetch_below(below, device) -> None:
    """Start copying back the checkpoint packed before this one (a weak reference, or None): the next layer's backward
    needs it."""
    packed = below() if below is not None else None
    if packed is not None:
        packed.fetch(_copy_stream(device))


def _unpack(packed):
    """offload_hooks' unpack: the tensor on the card, once its copy back has ended; the one below starts coming."""
    import torch

    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, _OnCard):
        _fetch_below(packed.below, packed.tensor.device)
        return packed.tensor
    _release_in_flight(packed.device)
    packed.fetch(_copy_stream(packed.device))
    _fetch_below(packed.previous, packed.device)
    torch.cuda.current_stream(packed.device).wait_event(packed.ready)
    tensor, packed.on_device = packed.on_device, None
    return tensor


@contextmanager
def offload_hooks(on_card: bool = False):
    """Saved-tensor hooks that move each checkpointed layer input to pinned host memory and bring it back in the
    backward. transformers' own `offload=True` (torch's save_on_cpu) copies synchronously, which stalls the host at
    every layer: on a host-bound step that is the whole gain.

    The copies run on a side stream, so they overlap the layers' compute instead of queueing behind it (at 8 x 2048 on
    TinyLlama each layer's input is 64 MiB each way; on the compute stream they gave 40,132 tokens/s against 53,428,
    an H200, 2026-12-01). The side stream waits for the compute
    that produced an input; the input stays alive until the next layer's input is packed, when the compute stream
    waits for its copy; and the backward, on reaching a layer, starts fetching the one below it. So one more layer
    input sits on the card than without overlap (the planner counts it).

    `on_card`: the checkpoint made inside stays on the card (the last checkpointed layer's: see the module's note);
    the input still being copied out is let go once its copy ends, and the backward, on reaching this checkpoint,
    starts fetching the one below it."""
    import functools

    import torch

    with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, on_card=on_card), _unpack):
        _OFFLOADING[0] += 1
        _ON_CARD[0] += int(on_card)
        try:
            yield
        finally:
            _OFFLOADING[0] -= 1
            _ON_CARD[0] -= int(on_card)


def offloaded_checkpoint(function, *args, on_card: bool = False, **kwargs):
    """torch's checkpoint, whose saved inputs (one hidden state per layer) live in CPU RAM, or with `on_card` (the
    last checkpointed layer) stay on the card. Both variants save the layer's inputs through the hooks; the recompute
    in the backward runs outside them, on the device."""
    from torch.utils.checkpoint import checkpoint

    with offload_hooks(on_card):
        return checkpoint(function, *args, **kwargs)
