"""A checkpointed layer's recompute reusing the attention its offloaded forward kept (nb_helpers.fast.saved_attention):
cuDNN's own output and gradients through the CPU RAM round trip, and training that skips the recompute's attention
with the stock recompute's loss and gradients. GPU only (marked); the CPU halves (which layers it runs for, the
fallback off CUDA, the planner's terms) are in tests/test_fused_block.py and tests/test_step_time.py."""

import pytest
import torch

from fused_models import fused_model, train_step, use_checkpoints
from nb_helpers.fast import checkpoints, fused_block, saved_attention, state
from nb_helpers.fast.mask import decoder_of


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kept_attention_gives_cudnns_own_output_and_gradients(dtype):
    """Grouped-query causal attention laid out as Llama's (tokens-major views): the output kept in CPU RAM and brought
    back, and cuDNN's backward called on it, give the bits of torch's SDPA on cuDNN, forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator("cuda").manual_seed(0)

    def heads(count):
        return torch.randn(2, 256, count, 64, device="cuda", generator=g, dtype=dtype).transpose(1, 2)
    query, key, value, grad = heads(8), heads(2), heads(2), heads(8)
    inputs = [t.detach().requires_grad_() for t in (query, key, value)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        expected = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=True, scale=0.125,
                                                                    enable_gqa=True)
    expected.backward(grad)
    with torch.no_grad():
        first, kept = saved_attention._forward_kept(query, key, value, 0.125)
    assert torch.equal(first, expected.detach())
    again = [t.detach().requires_grad_() for t in (query, key, value)]
    out = saved_attention.SavedAttention.apply(*again, kept, 0.125)
    assert torch.equal(out, expected.detach())
    out.backward(grad)
    for ours, theirs in zip(again, inputs):
        assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.gpu
def test_offloaded_training_skips_the_recompute_s_attention_with_the_same_gradients(tiny_cfg, monkeypatch):
    """The fused blocks with offloaded checkpoints in bf16: each recomputed layer takes its kept attention (no cuDNN
    forward in its recompute), and the loss and gradients are those of the same run recomputing it."""
    model = fused_model(tiny_cfg, dtype="bfloat16", kernels=True, fused_block=False)
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    counts = fused_block.install(model, liger=True, frozen=True, saved=True)
    layers = len(decoder_of(model).layers)
    assert counts["saved_attention"] == layers
    use_checkpoints(model, dead_tail=True, offload=True, no_recompute=1)
    reused = []
    real = saved_attention.SavedAttention.apply
    monkeypatch.setattr(saved_attention.SavedAttention, "apply", lambda *a: reused.append(1) or real(*a))
    kept = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    assert len(reused) == 3 * (layers - 1)
    state.options_of(model).saved_attention = False
    checkpoints.set_checkpoint_offload(model, True)
    again = [train_step(model, ids, torch.bfloat16) for _ in range(3)]
    assert len(reused) == 3 * (layers - 1)  # none more: the recompute attended again
    for (loss_a, grads_a), (loss_b, grads_b) in zip(kept, again, strict=True):
        assert torch.isfinite(loss_a) and torch.allclose(loss_a, loss_b, rtol=1e-2)
        for a, b in zip(grads_a, grads_b, strict=True):
            assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-3 * max(1.0, b.abs().max().item()))
