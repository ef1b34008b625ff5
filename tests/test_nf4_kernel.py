"""The NF4 dequantize kernel (nb_helpers.fast.nf4): bit for bit bitsandbytes' own dequantize, for every shape and dtype
the course meets, through the fused layers' _dequantize; and off, with one line, where Triton cannot be imported."""

import pytest
import torch

from nb_helpers.fast import fused_lora, nf4


def _quantized(shape, dtype, nested: bool, seed: int = 0):
    import bitsandbytes.functional as F

    generator = torch.Generator("cuda").manual_seed(seed)
    weight = (torch.randn(*shape, generator=generator, device="cuda") * 0.02).to(dtype)
    weight[0, :7] = 0.0  # exact zeros and a whole block's largest value: the table's ends
    weight[1, 64:128] = weight[1, 64:128].abs().max()
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")
    return packed, state


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2048, 2048), (256, 2048), (5632, 2048), (2048, 5632), (3, 1000), (130, 64)])
def test_the_kernel_writes_bitsandbytes_bits(dtype, shape):
    import bitsandbytes.functional as F

    packed, state = _quantized(shape, dtype, nested=True)
    expected = F.dequantize_4bit(packed, state)
    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset  # double quantization decoded
    assert nf4.mark([state]) == 1
    got = nf4.dequantize(packed, absmax.float(), state)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), \
        f"{(got != expected).sum().item()} of {got.numel()} values differ"


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [True, False])
def test_the_fused_layers_dequantize_through_it_with_the_same_bits(nested, monkeypatch):
    import bitsandbytes.functional as F

    packed, state = _quantized((512, 1024), torch.bfloat16, nested=nested, seed=1)
    weight = torch.nn.Parameter(packed, requires_grad=False)
    weight.quant_state = state
    stock = fused_lora._dequantize(weight, direct=True)
    assert nf4.mark([state]) == 1
    calls, kernel = [], nf4.dequantize
    monkeypatch.setattr(nf4, "dequantize", lambda *args: calls.append(1) or kernel(*args))
    triton_out = fused_lora._dequantize(weight, direct=True)
    assert calls == [1]  # the kernel ran, not bitsandbytes'
    assert torch.equal(triton_out.view(torch.int16), stock.view(torch.int16))
    assert torch.equal(stock, F.dequantize_4bit(packed, state))


def test_without_triton_nothing_is_marked_and_one_line_says_so(monkeypatch, capsys):
    from nb_helpers import frontend

    monkeypatch.setattr(frontend, "_SAID", set(), raising=False)
    nf4.kernels.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "nb_helpers.fast.nf4_kernels", None)  # import fails

    class State:
        quant_type, blocksize, dtype = "nf4", 64, torch.bfloat16
        absmax = torch.zeros(2)

    try:
        assert nf4.mark([State()]) == 0
        assert not hasattr(State, nf4.TABLE)
    finally:
        nf4.kernels.cache_clear()
    assert "NF4 dequantize kernel off: Triton is not importable" in capsys.readouterr().out
