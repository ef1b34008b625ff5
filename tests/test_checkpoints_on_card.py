"""Offloaded checkpoints with the last recomputed layers' kept on the card (RunConfig.checkpoints_on_card,
nb_helpers.fast.checkpoints): which layers go to CPU RAM, the same loss and gradients, the knob checked and shown.
On the CPU with the real fused 4-bit layers in fp32 (the copies are no-ops there); on the GPU (marked) in bf16 with
the fused blocks and the attention kept in CPU RAM."""

import functools

import pytest
import torch

from fused_models import fused_model, train_step, use_checkpoints
from nb_helpers.config import ConfigError
from nb_helpers.fast import checkpoints, fused_block, saved_attention
from nb_helpers.fast.mask import decoder_of
from nb_helpers.fast.offload import offloaded_checkpoint


def _in_ram(layer) -> bool:
    """Whether the layer's checkpoint function sends its saved input to CPU RAM (through the recompute's wrapper)."""
    function = layer._gradient_checkpointing_func
    while isinstance(function, functools.partial):
        if function.func is offloaded_checkpoint:
            return True
        function = function.keywords.get("checkpoint", function.func)
    return function is offloaded_checkpoint


@pytest.mark.parametrize("on_card,no_recompute,expected", [(0, 0, [True, True]), (1, 0, [True, False]),
                                                           (2, 0, [False, False]), (5, 0, [False, False]),
                                                           (1, 1, [False, False])])
def test_the_last_recomputed_layers_keep_their_checkpoints_on_the_card(tiny_cfg, on_card, no_recompute, expected):
    model = fused_model(tiny_cfg)
    use_checkpoints(model, dead_tail=True, offload=True, on_card=on_card, no_recompute=no_recompute)
    layers = decoder_of(model).layers
    kept = [index >= len(layers) - no_recompute for index in range(len(layers))]
    assert [_in_ram(layer) for layer in layers] == expected
    assert not any(_in_ram(layer) for layer, k in zip(layers, kept) if k)  # kept layers are not checkpointed at all


def test_without_offload_the_count_changes_nothing(tiny_cfg):
    model = fused_model(tiny_cfg)
    use_checkpoints(model, dead_tail=True, offload=False, on_card=1)
    assert not any(_in_ram(layer) for layer in decoder_of(model).layers)


def test_the_same_steps_with_checkpoints_on_the_card_or_in_ram(tiny_cfg):
    model = fused_model(tiny_cfg)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    use_checkpoints(model, dead_tail=True, offload=True)
    in_ram = [train_step(model, ids) for _ in range(2)]
    use_checkpoints(model, dead_tail=True, offload=True, on_card=1)
    on_card = [train_step(model, ids) for _ in range(2)]
    for (loss_a, grads_a), (loss_b, grads_b) in zip(in_ram, on_card, strict=True):
        assert torch.isfinite(loss_a) and torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_the_knob_is_checked_and_shown(tiny_cfg):
    with pytest.raises(ConfigError, match="checkpoints_on_card=-2"):
        tiny_cfg.replace(checkpoints_on_card=-2).validate()
    line = tiny_cfg.replace(gradient_checkpointing=True, offload_checkpoints=True, checkpoints_on_card=6).summary_line()
    assert "checkpoints in CPU RAM, the last 6 on the card" in line
    assert "on the card" not in tiny_cfg.replace(offload_checkpoints=True).summary_line()


@pytest.mark.gpu
def test_on_the_gpu_the_layers_on_the_card_attend_again_with_the_same_gradients(tiny_cfg, monkeypatch):
    """bf16, fused blocks, attention kept in CPU RAM: the layer whose checkpoint stays on the card recomputes its
    attention (nothing of it went to CPU RAM); the loss and gradients are those of every checkpoint in CPU RAM, and
    the card holds that layer's checkpoint through the backward."""
    model = fused_model(tiny_cfg, dtype="bfloat16", kernels=True, fused_block=False)
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    fused_block.install(model, liger=True, frozen=True, saved=True)
    layers = len(decoder_of(model).layers)
    reused = []
    real = saved_attention.SavedAttention.apply
    monkeypatch.setattr(saved_attention.SavedAttention, "apply", lambda *a: reused.append(1) or real(*a))
    runs = {}
    for on_card in (0, 1):
        use_checkpoints(model, dead_tail=True, offload=True, on_card=on_card)
        before = len(reused)
        runs[on_card] = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
        assert len(reused) - before == 3 * (layers - on_card)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(runs[0], runs[1], strict=True):
        assert torch.isfinite(loss_a) and torch.allclose(loss_a, loss_b, rtol=1e-2)
        for a, b in zip(grads_a, grads_b, strict=True):
            assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-3 * max(1.0, b.abs().max().item()))
    checkpoints.set_checkpoint_offload(model, False)
