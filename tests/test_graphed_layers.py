"""CUDA-graphed layers (nb_helpers.fast.graphed_layers), checkpointed or keeping their activations: the eager half runs
anywhere and must give torch's reentrant checkpoint's gradients (a kept layer's, its plain call's); the graphs
themselves (GPU, marked) must give the eager gradients and losses."""

import pytest

from nb_helpers import fast as fastpath
from nb_helpers import frontend
from nb_helpers.fast import checkpoints
from nb_helpers.fast.checkpoints import graphed_function
from nb_helpers.fast.mask import decoder_of
from nb_helpers.fast.options import FastOptions


def _tiny(tiny_cfg, fast):
    from nb_helpers.models import ModelChoice, load_4bit
    from nb_helpers.lora import attach_lora

    return attach_lora(load_4bit(tiny_cfg, ModelChoice(tiny_cfg.model, "tiny", "test")), tiny_cfg, fast=fast)


def _grads(model, ids, use_function=None):
    """LoRA gradients of one forward and backward (same seed), through torch's reentrant checkpoint or, given
    `use_function(layer)`, each layer's own checkpoint function."""
    import torch

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if use_function is not None:
        for layer in decoder_of(model).layers:
            layer._gradient_checkpointing_func = use_function(layer)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_graphed_checkpoint_without_graphs_gives_torchs_reentrant_gradients(tiny_cfg, monkeypatch, no_gpu):
    """On a CPU no graph is captured: the function is a reentrant checkpoint of its own (the forward without
    autograd, the recompute with the forward's dropout masks), and its LoRA gradients equal torch's."""
    import torch

    from nb_helpers.fast.graphed_layers import graph_count

    model = _tiny(tiny_cfg.replace(lora_dropout=0.1), FastOptions(lean=True, kernels=False, nomask=False))
    model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    loss, torch_grads = _grads(model, ids)
    graphed_loss, graphed_grads = _grads(model, ids, lambda layer: graphed_function(layer, False))
    assert graph_count() == 0  # no GPU: nothing captured
    assert torch.equal(loss, graphed_loss) and len(torch_grads) == len(graphed_grads) > 0
    assert any(g.abs().sum() > 0 for g in torch_grads)
    for a, b in zip(torch_grads, graphed_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # the dropout draws: rewinding a generator that dropout does not use gives the recompute other masks
    from nb_helpers.fast import graphed_layers

    monkeypatch.setattr(graphed_layers, "_generator", lambda tensors: torch.Generator())
    _, unrewound = _grads(model, ids, lambda layer: graphed_function(layer, False))
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(torch_grads, unrewound))


def test_graphs_follow_the_levers(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.delenv(fastpath.ENV_VAR, raising=False)
    assert checkpoints.graphs_on()  # the GPU default
    for levers in ("graphs=0", "reentrant=0"):
        monkeypatch.setenv(fastpath.ENV_VAR, levers)
        assert not checkpoints.graphs_on(), levers


def test_a_layer_called_with_an_object_runs_eagerly_and_says_so(capsys, monkeypatch):
    import torch

    from nb_helpers.fast import graphed_layers

    monkeypatch.setattr(frontend, "_SAID", set())
    layer = torch.nn.Linear(4, 4)
    graphs = graphed_layers.LayerGraphs(layer)

    def call(x, cache=None):
        return layer(x)

    x = torch.randn(2, 4, requires_grad=True)
    out = graphed_layers.graphed_checkpoint(call, x, cache=object(), graphs=graphs)
    out.sum().backward()
    assert x.grad is not None and graphs.entries == {}
    assert "called with a value a CUDA graph cannot take" in capsys.readouterr().out


def test_a_kept_layer_off_the_gpu_runs_its_plain_call():
    """graphed_kept (a layer that keeps its activations, no recompute) off a GPU takes no graph entry: the layer's
    own call, recorded by autograd as usual."""
    import torch

    from nb_helpers.fast import graphed_layers

    layer = torch.nn.Linear(4, 4)
    graphs = graphed_layers.LayerGraphs(layer)
    x = torch.randn(2, 4, requires_grad=True)
    out = graphed_layers.graphed_kept(layer.forward, x, graphs=graphs)
    assert torch.equal(out, layer(x)) and out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and graphs.entries == {}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,offload", [("bfloat16", False), ("float16", False), ("bfloat16", True)])
def test_graphed_layers_give_the_eager_gradients_over_several_steps(tiny_cfg, dtype, offload):
    """Captured at the first call of a shape, replayed after: losses and LoRA gradients equal the eager reentrant
    checkpoint's over three steps and two shapes (the same kernels and dropout masks; allclose for cuBLAS's choice
    of algorithm on the capture stream). With offload, each layer's saved input goes through CPU RAM first. A second
    model after reset() (a notebook cell run twice) captures again and leaves no memory behind once it is gone."""
    import gc

    import torch

    from nb_helpers.fast import graphed_layers

    held = []
    for _ in range(2):
        graphed_layers.reset()
        _graphed_matches_eager(tiny_cfg, dtype, offload)
        gc.collect()
        held.append(torch.cuda.memory_allocated())
    # the first model may leave the capture stream's cuBLAS workspace (made once per process); the second nothing
    # more: a new stream per reset() had kept 64 MiB after every run (device call 14's GPU suite)
    assert held[1] - held[0] <= 8 * 2**20, held


def _graphed_matches_eager(tiny_cfg, dtype, offload):
    import torch

    from nb_helpers.fast import graphed_layers

    model = _tiny(tiny_cfg.replace(lora_dropout=0.1, compute_dtype=dtype),
                  FastOptions(lean=True, kernels=True, nomask=True))
    model.enable_input_require_grads()
    model.train()
    for length in (64, 128, 64):
        ids = torch.randint(0, 1000, (4, length), device="cuda", generator=torch.Generator("cuda").manual_seed(length))
        with torch.autocast("cuda", dtype=getattr(torch, dtype)):
            loss, eager = _grads(model, ids)
            graphed_loss, graphed = _grads(model, ids, lambda layer: graphed_function(layer, offload))
        assert torch.allclose(loss, graphed_loss, rtol=1e-3), (loss, graphed_loss)
        for a, b in zip(eager, graphed):
            assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-3 * a.abs().max().item())
    layers = len(decoder_of(model).layers)
    assert graphed_layers.graph_count() == 2 * 2 * layers  # forward and backward, two shapes
    graphed_layers.reset()
    assert graphed_layers.graph_count() == 0


def test_a_fresh_memory_pool_once_every_graph_is_gone(monkeypatch):
    """The graphs share one pool, but the allocator forgets a pool once its last graph is gone: capturing into it
    again (a second model trained in the same process: a notebook cell run twice) failed an internal assert on
    the GPU, and the failed capture left dropout's generator unusable (seen on an H200, 2026-12-01). A new capture
    takes a fresh pool whenever no graph is alive, the shared one otherwise."""
    import itertools

    import torch

    from nb_helpers.fast import graphed_layers

    handles = itertools.count()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(graphed_layers, "_STREAMS", {})
    graphed_layers.reset()
    shared = graphed_layers._Shared(torch.device("cuda", 0))
    first = shared.pool_for_capture()
    layer = graphed_layers.LayerGraphs(torch.nn.Linear(2, 2))
    layer.entry("shape").forward = object()  # a captured graph, alive
    assert shared.pool_for_capture() == first
    del layer  # the model and its graphs are gone
    import gc

    gc.collect()
    assert graphed_layers.graph_count() == 0 and shared.pool_for_capture() != first


def test_one_capture_stream_for_the_process_across_resets(monkeypatch):
    """reset() drops graphs, buffers and the pool, not the capture stream: every new stream costs a cuBLAS workspace
    that stays for the process (32 MiB on Hopper); one per reset filled a 0.25 GiB test budget in device call 14."""
    import torch

    from nb_helpers.fast import graphed_layers

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    monkeypatch.setattr(graphed_layers, "_STREAMS", {})
    device = torch.device("cuda", 0)
    first = graphed_layers._shared(device).stream
    graphed_layers._SHARED.clear()  # what reset() does, without a GPU to synchronize
    assert graphed_layers._shared(device).stream is first and len(made) == 1
    graphed_layers._SHARED.clear()


def test_a_capture_out_of_memory_fails_the_trial_step_but_not_a_run(capsys, monkeypatch):
    """In auto-fit's trial step a capture that runs out of memory must raise, so the graphed candidate steps down
    (call 11: a trial fell back to eager layers and measured a candidate that then ran over the budget); in a run,
    the layer falls back to eager and says so."""
    import torch

    from nb_helpers.fast import graphed_layers

    monkeypatch.setattr(frontend, "_SAID", set())

    class Plan:
        graphs = graphed_layers.LayerGraphs(torch.nn.Linear(2, 2))

    error = torch.OutOfMemoryError("CUDA out of memory (injected)")
    with graphed_layers.out_of_memory_raises(), pytest.raises(torch.OutOfMemoryError):
        graphed_layers._fail(graphed_layers._Entry(), Plan, error)
    entry = graphed_layers._Entry()
    graphed_layers._fail(entry, Plan, error)
    assert entry.failed and "could not be captured as a CUDA graph (OutOfMemoryError" in capsys.readouterr().out
