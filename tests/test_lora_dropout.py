"""LoRA's dropout inside the rank-r products (nb_helpers.fast.lora_dropout): each Triton kernel against the same math
in torch with the mask the kernels draw, the keep rate, the seed's reproducibility, and the fused layer's gradients.
On CUDA (marked gpu); on a CPU with Triton installed, TRITON_INTERPRET=1 runs the same kernels in Triton's
interpreter (how they were first checked; CI has no Triton on its CPU)."""

import os

import pytest
import torch

from nb_helpers.fast import lora_dropout


def _device():
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1" and lora_dropout.kernels() is not None:
        return "cpu"
    pytest.skip("needs a CUDA GPU (or Triton's interpreter: TRITON_INTERPRET=1 with Triton installed)")


def _inputs(device, dtype, tokens=200, features=96, rank=8, seed=0):
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, features, generator=generator, device=device).to(dtype)
    a = (torch.randn(rank, features, generator=generator, device=device) / features ** 0.5).to(dtype)
    gd = torch.randn(tokens, rank, generator=generator, device=device).to(dtype)
    return x, a, gd


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,features,rank", [(200, 96, 8), (1024, 256, 16), (64, 2048, 4)])
def test_each_kernel_is_the_dropout_math_with_its_own_mask(dtype, tokens, features, rank):
    device, p = _device(), 0.1
    x, a, gd = _inputs(device, dtype, tokens, features, rank)
    seed = torch.tensor([1234], dtype=torch.int32, device=device)
    keep = lora_dropout.drawn_mask(seed, tokens, features, p, device)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02  # the keep probability
    dropped = x.double() * keep / (1 - p)
    down = lora_dropout.dropped_down(x, a, seed, p)
    assert down.dtype == dtype and down.shape == (tokens, rank)
    torch.testing.assert_close(down.double(), dropped @ a.double().t(), rtol=2e-2, atol=2e-2)
    grad_a = lora_dropout.grad_a(gd, x, seed, p)
    torch.testing.assert_close(grad_a.double(), gd.double().t() @ dropped, rtol=2e-2, atol=5e-2)
    grad_x = lora_dropout.grad_x(gd, a, seed, p, features)
    torch.testing.assert_close(grad_x.double(), (gd.double() @ a.double()) * keep / (1 - p), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_the_seed_comes_from_torchs_generator_and_decides_the_mask():
    device = _device()
    torch.manual_seed(3)
    first = lora_dropout.draw_seed(device)
    torch.manual_seed(3)
    again = lora_dropout.draw_seed(device)
    other = lora_dropout.draw_seed(device)
    assert torch.equal(first, again) and not torch.equal(first, other)
    masks = [lora_dropout.drawn_mask(s, 64, 64, 0.5, device) for s in (first, again, other)]
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_layer_with_the_kernels_gives_the_gradients_of_its_mask(dtype):
    """LoRA4bitLinear with the kernels against the same layer written out in float64 with the kernels' mask."""
    from types import SimpleNamespace

    from nb_helpers.fast import fused_lora

    device, p, s = _device(), 0.1, 2.0
    x, a, _ = _inputs(device, dtype, 128, 64, 8, seed=1)
    b = torch.randn(32, 8, device=device, dtype=dtype)
    w = torch.randn(32, 64, device=device, dtype=dtype)
    monkey = SimpleNamespace(quant_state=None)
    real = fused_lora._dequantize
    fused_lora._dequantize = lambda weight, direct=False: w
    try:
        xs, As, Bs = (t.clone().requires_grad_() for t in (x, a, b))
        torch.manual_seed(9)
        out = fused_lora.LoRA4bitLinear.apply(xs, monkey, None, As, Bs, s, p, False, False, True)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    finally:
        fused_lora._dequantize = real
    torch.manual_seed(9)
    keep = lora_dropout.drawn_mask(lora_dropout.draw_seed(device), 128, 64, p, device)
    xd, ad, bd = (t.double().requires_grad_() for t in (x, a, b))
    ref = xd @ w.double().t() + s * ((xd * keep / (1 - p)) @ ad.t()) @ bd.t()
    ref.backward(grad_out.double())
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-1)
    for got, want in ((xs.grad, xd.grad), (As.grad, ad.grad), (Bs.grad, bd.grad)):
        cos = torch.nn.functional.cosine_similarity(got.double().flatten(), want.flatten(), dim=0)
        assert cos > 0.999, cos
