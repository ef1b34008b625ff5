"""Llama's layer with fewer kernels (nb_helpers.fast.fused_block): the same loss and gradients as the stock layer
with the fused 4-bit layers, with and without checkpoints; in a recompute whose down projection is dead, neither
SwiGLU's product nor the last add runs. On the CPU with the real fused 4-bit layers in fp32 (the stock add + norm
stands in for liger's fused kernel there); on the GPU (marked) in bf16 with liger's kernels, eager, graphed and
offloaded."""

import pytest
import torch

from fused_models import fused_model, train_step, use_checkpoints
from nb_helpers.fast import fused_block, lora_dropout, recompute
from nb_helpers.fast.mask import decoder_of
from nb_helpers.fast.options import FastOptions
from nb_helpers.fast.state import FastPath


def _model(tiny_cfg, **kwargs):
    return fused_model(tiny_cfg, fused_block=False, **kwargs)  # the stock layers first; the tests install the blocks


def _stock_forwards(model):
    """Each layer's and MLP's own forward back (fused_block.install replaces them per instance)."""
    for layer in decoder_of(model).layers:
        layer.__dict__.pop("forward", None)
        layer.mlp.__dict__.pop("forward", None)
        layer.self_attn.__dict__.pop("forward", None)


def _seeds_drawn_per_layer(model):
    """The stock layers draw their LoRA layers' dropout seeds as the fused block does, one draw a layer pass
    (fast.lora_dropout.drawn_together), so that both runs drop the same elements (fused_block.install then replaces
    these forwards with its own)."""
    for layer in decoder_of(model).layers:
        def forward(*args, stock=layer.forward, count=fused_block.lora_layer_count(layer), **kwargs):
            with lora_dropout.drawn_together(count):
                return stock(*args, **kwargs)
        layer.forward = forward


def _same(runs_a, runs_b, rtol=1e-5, atol=1e-7):
    for (loss_a, grads_a), (loss_b, grads_b) in zip(runs_a, runs_b, strict=True):
        assert torch.allclose(loss_a, loss_b, rtol=rtol), (loss_a, loss_b)
        assert len(grads_a) == len(grads_b) > 0
        for a, b in zip(grads_a, grads_b):
            assert torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol * max(1.0, a.abs().max().item()))


def _counting(monkeypatch, name):
    calls = []
    real = getattr(fused_block, name)
    monkeypatch.setattr(fused_block, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_the_swiglu_backward_without_liger_is_autograds():
    gate, up, grad = torch.randn(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).unbind(0)
    gate.requires_grad_(True), up.requires_grad_(True)
    (torch.nn.functional.silu(gate) * up).backward(grad)
    ours = fused_block._swiglu_backward(gate.detach(), up.detach(), grad, liger=False)
    assert torch.allclose(ours[0], gate.grad) and torch.allclose(ours[1], up.grad)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_fused_block_trains_as_the_stock_layer(tiny_cfg, checkpointing):
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    model = _model(tiny_cfg)
    if checkpointing:
        use_checkpoints(model, dead_tail=True)
    stock = [train_step(model, ids) for _ in range(2)]
    counts = fused_block.install(model, liger=False)
    layers = len(decoder_of(model).layers)
    assert counts == {"layers": layers, "mlps": layers, "norms": 0, "frozen_norms": 0,
                      "saved_attention": 0}  # no liger here
    _same(stock, [train_step(model, ids) for _ in range(2)])


def test_the_attention_copy_trains_as_the_stock_one(tiny_cfg):
    """Lever saved_attention installs a copy of Llama's attention forward; where it cannot act (this CPU, fp32) the
    copy hands on to transformers' attention: the stock attention's loss and gradients."""
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(4))
    model = _model(tiny_cfg)
    use_checkpoints(model, dead_tail=True)
    stock = [train_step(model, ids) for _ in range(2)]
    layers = decoder_of(model).layers
    assert fused_block.install(model, liger=False)["saved_attention"] == 0  # the lever off: the stock attention
    assert not any("forward" in vars(layer.self_attn) for layer in layers)
    assert fused_block.install(model, liger=False, saved=True)["saved_attention"] == len(layers)
    assert all("forward" in vars(layer.self_attn) for layer in layers)
    for layer in layers:  # switched on: off CUDA it still attends as transformers does
        layer.self_attn._nb_saved_attention = True
    _same(stock, [train_step(model, ids) for _ in range(2)])


def test_a_dead_recompute_runs_no_swiglu_and_no_last_add(tiny_cfg, monkeypatch):
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(2))
    model = _model(tiny_cfg)
    fused_block.install(model, liger=False)
    use_checkpoints(model, dead_tail=False)
    off = train_step(model, ids)
    use_checkpoints(model, dead_tail=True)
    train_step(model, ids)  # the probe: each layer's first recompute runs whole
    layers = decoder_of(model).layers
    assert all(recompute.dead_module(layer) is layer.mlp.down_proj for layer in layers)
    swiglus, empties = _counting(monkeypatch, "_swiglu"), []
    real_add = fused_block._ThrownAwayAdd.forward
    monkeypatch.setattr(fused_block._ThrownAwayAdd, "forward", staticmethod(
        lambda ctx, a, b: empties.append(1) or real_add(ctx, a, b)))
    on = train_step(model, ids)
    assert len(swiglus) == len(layers)  # the first forward's only, none in the recompute
    assert len(empties) == len(layers)
    _same([off], [on])


def test_without_gradients_the_last_add_runs_inside_down_s_gemm(tiny_cfg, monkeypatch):
    """Under no_grad (a checkpoint's first forward, evaluation) each layer's last residual add is the beta of down's
    GEMM, written over the residual (no copy of it first): no separate add, the stock layer's logits."""
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    model = _model(tiny_cfg)
    model.eval()
    ids = ids.to(model.device)
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    fused_block.install(model, liger=False)
    with_residual = []
    real = fused_block._mlp

    def mlp(*args, residual=None, **kwargs):
        result = real(*args, residual=residual, **kwargs)
        with_residual.append(residual is not None and result[0].data_ptr() == residual.data_ptr())
        return result

    monkeypatch.setattr(fused_block, "_mlp", mlp)
    with torch.no_grad():
        fused = model(input_ids=ids).logits
    assert with_residual == [True] * len(decoder_of(model).layers)
    assert torch.allclose(stock, fused, rtol=1e-5, atol=1e-5)


def test_lora_on_the_mlp_keeps_its_layers_and_the_same_gradients(tiny_cfg):
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _model(tiny_cfg, targets=["all-linear"])
    use_checkpoints(model, dead_tail=True)
    stock = [train_step(model, ids) for _ in range(2)]
    counts = fused_block.install(model, liger=False)
    assert counts["layers"] == len(decoder_of(model).layers) and counts["mlps"] == 0
    _same(stock, [train_step(model, ids) for _ in range(2)])


def test_the_lever_installs_only_with_the_fused_layers(tiny_cfg, monkeypatch):
    """after_lora installs the blocks, keeps the decoded absmax (lever absmax_once) and hands the dequantize to the
    Triton kernel (lever nf4_kernel) only where the fused 4-bit layers ran, and records each."""
    from types import SimpleNamespace

    import nb_helpers.fast as fast

    calls, kept, taken = [], [], []
    monkeypatch.setattr(fused_block, "apply_fused_block", lambda model, liger, frozen, saved: calls.append(
        (liger, frozen)) or {"layers": 2, "frozen_norms": 2 * frozen, "saved_attention": 2 * saved})
    monkeypatch.setattr("nb_helpers.fast.fused_lora.keep_decoded_absmax",
                        lambda model, budget: kept.append((model, budget)) or 154)
    # use_nf4_kernel reads real 4-bit layers where CUDA is visible: the stand-in model has none
    monkeypatch.setattr("nb_helpers.fast.fused_lora.use_nf4_kernel", lambda model: taken.append(model) or 154)
    model = SimpleNamespace(_nb_fast_path=FastPath(FastOptions(), ran={"kernels": True, "fused_lora": False}))
    cfg = SimpleNamespace(graphs_wanted=None, fast_path=False, offload_checkpoints=False, budget_gib=4.0,
                          gradient_checkpointing=True, no_recompute_layers=0)
    fast.after_lora(model, FastOptions(nomask=False, fused_lora=False, fused_block=True), cfg)
    assert calls == [] and kept == [] and taken == []
    monkeypatch.setattr("nb_helpers.fast.fused_lora.apply_fused_lora", lambda *a, **k: True)
    fast.after_lora(model, FastOptions(nomask=False, fused_lora=True, fused_block=True, frozen_norms=False), cfg)
    ran = model._nb_fast_path.ran
    assert calls == [(True, False)] and ran["fused_block"] is True
    assert ran["frozen_norms"] is False
    assert kept == [(model, 4.0)] and ran["absmax_once"] is True
    assert taken == [model] and ran["nf4_kernel"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,offload,frozen", [(False, False, False), (False, True, False), (True, False, False),
                                                   (False, False, True), (False, True, True), (True, False, True)])
def test_on_the_gpu_the_fused_block_trains_as_the_stock_layer_in_bf16(tiny_cfg, graphs, offload, frozen):
    """With liger's kernels: the fused add + RMSNorm and SwiGLU, the dead recompute, CUDA graphs and offload; `frozen`:
    the norms' backward of lever frozen_norms (fast.frozen_norms)."""
    from nb_helpers.fast import graphed_layers

    graphed_layers.reset()
    model = _model(tiny_cfg, dtype="bfloat16", kernels=True)
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    use_checkpoints(model, dead_tail=True, offload=offload, graphs=graphs)
    _seeds_drawn_per_layer(model)
    stock = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    graphed_layers.reset()
    counts = fused_block.install(model, liger=True, frozen=frozen)
    layers = len(decoder_of(model).layers)
    assert counts == {"layers": layers, "mlps": layers, "norms": layers, "frozen_norms": layers * frozen,
                      "saved_attention": 0}
    use_checkpoints(model, dead_tail=True, offload=offload, graphs=graphs)
    ours = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    assert all(torch.isfinite(loss) for loss, _ in ours)
    _same(stock, ours, rtol=2e-2, atol=1e-3)
    graphed_layers.reset()
    _stock_forwards(model)


def test_only_the_last_recomputed_layer_keeps_its_offloaded_checkpoint_on_the_card(tiny_cfg):
    """fast.offload's `on_card`: with checkpoints in CPU RAM, the last layer that recomputes (its backward comes first)
    keeps its checkpoint on the card, whether or not layers after it keep their activations; without offload, none."""
    import functools

    def on_card(layer) -> bool:
        function = layer._gradient_checkpointing_func
        inner = function.keywords.get("checkpoint", function) if isinstance(function, functools.partial) else None
        return bool(isinstance(inner, functools.partial) and inner.keywords.get("on_card"))

    model = _model(tiny_cfg)
    layers = decoder_of(model).layers
    for no_recompute in (0, 1):
        for dead_tail in (True, False):
            use_checkpoints(model, dead_tail=dead_tail, offload=True, no_recompute=no_recompute)
            last = len(layers) - 1 - no_recompute
            assert [on_card(layer) for layer in layers] == [index == last for index in range(len(layers))]
    use_checkpoints(model, dead_tail=True, offload=False)
    assert not any(on_card(layer) for layer in layers)


def test_only_offloaded_eager_recomputes_keep_their_attention(tiny_cfg):
    """Lever saved_attention: fast.checkpoints switches it on for the recomputed layers whose checkpoints go to CPU
    RAM with the recompute's stash; the layers that keep their activations, checkpoints on the card, or no stash
    (down_once off) leave it off. Off CUDA the attention is transformers' own even where it is on."""
    from nb_helpers.fast import saved_attention

    model = _model(tiny_cfg)
    layers = decoder_of(model).layers
    use_checkpoints(model, dead_tail=True, offload=True, no_recompute=1)
    assert [layer.self_attn._nb_saved_attention for layer in layers] == [True] * (len(layers) - 1) + [False]
    for settings in (dict(offload=False), dict(offload=True, down_once=False), dict(offload=True, dead_tail=False)):
        use_checkpoints(model, **{"dead_tail": True, **settings})
        assert not any(layer.self_attn._nb_saved_attention for layer in layers), settings
    layers[0].self_attn._nb_saved_attention, calls = True, []
    query = torch.randn(1, 2, 8, 4)
    out = saved_attention.attend(layers[0].self_attn, query, query, query, None,
                                 lambda *a, **k: calls.append(k) or ("stock", None), dropout=0.0, scaling=0.5)
    assert out == ("stock", None) and calls == [{"dropout": 0.0, "scaling": 0.5}]
