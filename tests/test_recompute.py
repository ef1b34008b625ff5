"""The recompute skips the product its backward never reads (nb_helpers.fast.recompute): the same loss and gradients,
the down projection's matmul gone from every recompute after the probe, and a layer that saves a tensor after its last
linear (Gemma's norm after the MLP) keeps it. On the CPU with the real fused 4-bit layers in fp32; on the GPU (marked)
with CUDA graphs and offload."""

import pytest
import torch

from fused_models import fused_model, train_step, use_checkpoints
from nb_helpers.fast import checkpoints, fused_lora, recompute
from nb_helpers.fast.mask import decoder_of
from nb_helpers.fast.options import FastOptions
from nb_helpers.fast.state import FastPath


def _dequantized(monkeypatch, model):
    """Counts of fused_lora._dequantize calls per 4-bit layer name."""
    names = {id(m.weight): name.removesuffix(".base_layer") for name, m in model.named_modules()
             if hasattr(getattr(m, "weight", None), "quant_state")}  # a LoRA target's 4-bit weight: its base_layer
    counts: dict = {}
    real = fused_lora._dequantize

    def counting(weight, direct=False):
        counts[names.get(id(weight), "?")] = counts.get(names.get(id(weight), "?"), 0) + 1
        return real(weight, direct)

    monkeypatch.setattr(fused_lora, "_dequantize", counting)
    return counts


@pytest.mark.parametrize("targets", [None, ["all-linear"]])
def test_the_recompute_skips_the_down_projection_with_the_same_gradients(tiny_cfg, monkeypatch, targets):
    """With q,k,v,o targets the down projection is a frozen layer; with all-linear a LoRA layer, whose skipped
    recompute still computes what LoRA's backward reads."""
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    # the 4-bit layers' own skip, counted through fused_lora._dequantize: on a GPU the fused MLP block would take
    # over the frozen MLP (and dequantize through its own import); tests/test_fused_block.py counts that one
    model = fused_model(tiny_cfg, targets=targets, fused_block=False)
    use_checkpoints(model, dead_tail=False)
    runs_off = [train_step(model, ids) for _ in range(2)]
    use_checkpoints(model, dead_tail=True)
    counts = _dequantized(monkeypatch, model)
    runs_on = [train_step(model, ids)]  # the probe: each layer's first recompute runs whole
    layers = decoder_of(model).layers
    assert all(recompute.dead_module(layer) is layer.mlp.down_proj for layer in layers)
    counts.clear()
    runs_on.append(train_step(model, ids))
    downs = {name: n for name, n in counts.items() if name.endswith("down_proj")}
    gates = {name: n for name, n in counts.items() if name.endswith("gate_proj")}
    assert len(downs) == len(layers) and set(downs.values()) == {2}, downs  # forward and backward, no recompute
    assert set(gates.values()) == {3}, gates  # forward, recompute, backward
    for (loss_off, grads_off), (loss_on, grads_on) in zip(runs_off, runs_on):
        assert torch.equal(loss_off, loss_on)
        assert len(grads_on) == len(grads_off) > 0
        for a, b in zip(grads_off, grads_on):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)


def test_a_tensor_saved_after_the_last_linear_keeps_its_product(tiny_cfg):
    """Gemma-style: a norm after the MLP saves the down projection's output, so nothing is dead and the gradients are
    still the plain checkpoint's. (Such layers are not Llama's, so the fused block, which calls the MLP with the
    residual, never takes them.)"""
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    model = fused_model(tiny_cfg, fused_block=False)
    for layer in decoder_of(model).layers:
        mlp_forward = layer.mlp.forward
        layer.mlp.forward = lambda x, mlp_forward=mlp_forward: torch.nn.functional.rms_norm(
            mlp_forward(x), (x.shape[-1],))
    use_checkpoints(model, dead_tail=False)
    loss_off, grads_off = train_step(model, ids)
    use_checkpoints(model, dead_tail=True)
    loss_on, grads_on = train_step(model, ids)
    assert all(recompute.dead_module(layer) is False for layer in decoder_of(model).layers)
    assert torch.equal(loss_off, loss_on)
    for a, b in zip(grads_off, grads_on):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)


def test_the_lever_follows_the_options_and_marks_probe_again():
    from types import SimpleNamespace

    def model(fast):
        return SimpleNamespace(_nb_fast_path=FastPath(fast))

    assert checkpoints.tail_lever_on(model(FastOptions(dead_tail=True, reentrant=True, fused_lora=True)))
    for off in ({"dead_tail": False}, {"reentrant": False}, {"fused_lora": False}):
        fast = FastOptions(**{"dead_tail": True, "reentrant": True, "fused_lora": True, **off})
        assert not checkpoints.tail_lever_on(model(fast)), off
    layer = SimpleNamespace()
    recompute.mark(layer, True)
    with recompute.recomputing(layer):  # a recompute with no 4-bit layer in it: nothing to skip
        pass
    assert recompute.dead_module(layer) is False
    recompute.mark(layer, True)
    assert recompute.dead_module(layer) is None  # marked again: probed again
    recompute.mark(layer, False)
    with recompute.recomputing(layer):
        assert not recompute.is_dead(object())
    assert recompute.dead_module(layer) is None  # the lever off: no probe


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,offload", [(False, False), (False, True), (True, False), (True, True)])
def test_on_the_gpu_the_skip_keeps_the_gradients_eager_graphed_and_offloaded(tiny_cfg, graphs, offload):
    from nb_helpers.fast import graphed_layers

    graphed_layers.reset()
    model = fused_model(tiny_cfg, dtype="bfloat16", kernels=True)
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    use_checkpoints(model, dead_tail=False, offload=offload, graphs=graphs)
    off = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    graphed_layers.reset()
    use_checkpoints(model, dead_tail=True, offload=offload, graphs=graphs)
    on = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    assert all(recompute.dead_module(layer) is layer.mlp.down_proj for layer in decoder_of(model).layers)
    for (loss_off, grads_off), (loss_on, grads_on) in zip(off, on):
        assert torch.isfinite(loss_on) and torch.allclose(loss_off, loss_on, rtol=1e-3), (loss_off, loss_on)
        for a, b in zip(grads_off, grads_on):
            assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-3 * a.abs().max().item())
    graphed_layers.reset()


class _TorchKernels:
    """fast.lora_dropout's three calls in torch on the CPU, the mask drawn from the seed's value (the real kernels
    need a GPU or Triton's interpreter), counting how often the input is read for the rank-r product."""

    def __init__(self):
        self.products, self.reused, self.made = 0, 0, []

    @staticmethod
    def mask(seed, shape, p):
        return (torch.rand(shape, generator=torch.Generator().manual_seed(int(seed.item()))) >= p).to(seed.device)

    def out_from_down(self, down, b, scaling):
        self.reused += 1
        return scaling * (down @ b.t())

    def dropped_down(self, flat, a, b, seed, p, scaling, write_out=True):
        self.products += 1
        down = (flat * self.mask(seed, flat.shape, p) / (1 - p)) @ a.t()
        self.made.append(down)
        return down, (scaling * (down @ b.t()) if write_out else None)

    def grads(self, grad_down, flat, a, seed, p):
        keep = self.mask(seed, flat.shape, p) / (1 - p)
        return grad_down.t() @ (flat * keep), (grad_down @ a) * keep


def _with_torch_kernels(model, monkeypatch):
    from nb_helpers.fast import lora_dropout

    fake = _TorchKernels()
    monkeypatch.setattr(lora_dropout, "usable", lambda flat, a, outputs=0: True)
    for name in ("dropped_down", "out_from_down", "grads"):
        monkeypatch.setattr(lora_dropout, name, getattr(fake, name))
    for module in model.modules():
        if hasattr(module, "_nb_dropout_kernels"):
            module._nb_dropout_kernels = True
    return fake


@pytest.mark.parametrize("targets", [None, ["all-linear"]])
def test_the_recompute_reuses_its_forward_s_lora_products_with_the_same_gradients(tiny_cfg, monkeypatch, targets):
    """Lever down_once: each LoRA layer's rank-r product is made once, in the checkpoint's first forward, and the
    recompute writes its output from it; the loss and gradients are bit for bit those of making it again (with
    all-linear the dead down projection's LoRA reuses it too, and writes nothing)."""
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(4))
    model = fused_model(tiny_cfg, targets=targets, fused_block=False)
    fake = _with_torch_kernels(model, monkeypatch)
    loras = sum(hasattr(m, "_nb_dropout_kernels") for m in model.modules())
    use_checkpoints(model, dead_tail=True, down_once=False)
    runs_off = [train_step(model, ids) for _ in range(2)]  # the first probes the dead product
    use_checkpoints(model, dead_tail=True, down_once=True)
    train_step(model, ids)  # marking again probes again
    fake.products = fake.reused = 0
    run_on = train_step(model, ids)
    assert fake.products == loras  # the forward's only
    dead = len(decoder_of(model).layers) if targets else 0  # all-linear: down_proj's LoRA writes no output
    assert fake.reused == loras - dead
    assert torch.equal(runs_off[1][0], run_on[0])
    for a, b in zip(runs_off[1][1], run_on[1], strict=True):
        assert torch.equal(a, b)


def test_each_recompute_reads_its_own_forward_s_products_and_they_are_freed(tiny_cfg, monkeypatch):
    """Two forwards before one backward (two checkpoints per layer alive at once): each recompute reads its own
    forward's products, so the gradients are those of the lever off; after the backward nothing of them is left."""
    import gc
    import weakref

    model = fused_model(tiny_cfg, fused_block=False)
    first, second = (torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(s)).to(model.device)
                     for s in (5, 6))
    fake = _with_torch_kernels(model, monkeypatch)

    def two_forwards():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        (model(input_ids=first, labels=first).loss + model(input_ids=second, labels=second).loss).backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    use_checkpoints(model, dead_tail=True, down_once=False)
    two_forwards()  # the probe
    off = two_forwards()
    use_checkpoints(model, dead_tail=True, down_once=True)
    two_forwards()
    fake.made.clear()
    on = two_forwards()
    assert fake.reused > 0
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a, b)
    made = [weakref.ref(t) for t in fake.made]
    fake.made.clear()
    gc.collect()
    assert made and not any(ref() is not None for ref in made)
    assert recompute.stash_of_forward() is None and recompute.stashed(object()) is None


def test_outside_a_checkpointed_forward_nothing_is_stashed(tiny_cfg, monkeypatch):
    """Evaluation (no_grad, no checkpoint) and a layer not marked for the lever leave nothing for a recompute."""
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(7))
    model = fused_model(tiny_cfg, fused_block=False)
    fake = _with_torch_kernels(model, monkeypatch)
    use_checkpoints(model, dead_tail=True, down_once=False)
    train_step(model, ids)
    fake.reused = 0
    train_step(model, ids)
    assert fake.reused == 0 and not any(layer._nb_down_once for layer in decoder_of(model).layers)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids.to(model.device))
    assert recompute.stash_of_forward() is None


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,offload", [(False, False), (False, True), (True, False)])
def test_on_the_gpu_the_reused_lora_products_give_the_same_bits_eager_graphed_and_offloaded(tiny_cfg, graphs, offload,
                                                                                            monkeypatch):
    """Lever down_once with the real dropout kernels, the fused MLP block, liger's kernels and bf16, as W512
    (graphed) and W2048 (offloaded) run it: the recompute writes its LoRA outputs from the forward's products (the
    same kernel, reading them), so three steps match the lever off bit for bit."""
    from nb_helpers.fast import graphed_layers, lora_dropout

    reused = []
    real = lora_dropout.out_from_down
    monkeypatch.setattr(lora_dropout, "out_from_down", lambda *a: reused.append(1) or real(*a))
    graphed_layers.reset()
    model = fused_model(tiny_cfg, dtype="bfloat16", kernels=True)
    assert all(m._nb_dropout_kernels for m in model.modules() if hasattr(m, "_nb_dropout_kernels"))
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    use_checkpoints(model, dead_tail=True, offload=offload, graphs=graphs, down_once=False)
    off = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    graphed_layers.reset()
    use_checkpoints(model, dead_tail=True, offload=offload, graphs=graphs, down_once=True)
    on = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    assert reused
    for (loss_off, grads_off), (loss_on, grads_on) in zip(off, on, strict=True):
        assert torch.equal(loss_off, loss_on), (loss_off, loss_on)
        for a, b in zip(grads_off, grads_on, strict=True):
            assert torch.equal(a, b)
    graphed_layers.reset()
