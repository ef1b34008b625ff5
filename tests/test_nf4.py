"""The NF4 dequantize kernel inside CUDA graphs (nb_helpers.fast.nf4, lever nf4_in_graphs): bit for bit
bitsandbytes' own dequantize for every weight shape of the course's GPU model, in bf16 and fp16; taken only while a
graph is captured (eager steps keep bitsandbytes' kernel, whose launch costs the host less); never for a weight it
cannot tile; off, with one line, where Triton cannot be imported."""

import pytest
import torch

from nb_helpers.fast import fused_lora, nf4


def _quantized(shape, dtype, nested: bool = True, seed: int = 0):
    import bitsandbytes.functional as F

    generator = torch.Generator("cuda").manual_seed(seed)
    weight = (torch.randn(*shape, generator=generator, device="cuda") * 0.02).to(dtype)
    weight[0, :7] = 0.0  # exact zeros and a whole block's largest value: the table's ends
    weight[1, 64:128] = weight[1, 64:128].abs().max()
    return F.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")


class _State:
    quant_type, blocksize, dtype = "nf4", 64, torch.bfloat16
    absmax = torch.zeros(2)

    def __init__(self, shape, quant_type="nf4", on_gpu=True):
        self.shape, self.quant_type = torch.Size(shape), quant_type
        self.absmax = type("A", (), {"is_cuda": on_gpu})()


def test_the_kernel_takes_only_what_it_tiles():
    assert nf4.takes(_State((2048, 2048))) and nf4.takes(_State((256, 2048)))
    assert not nf4.takes(_State((130, 64)))  # 8,320 values: not whole programs of 2,048
    assert not nf4.takes(_State((2048, 2048), quant_type="fp4"))
    assert not nf4.takes(_State((2048, 2048), on_gpu=False))


def test_without_triton_nothing_is_marked_and_one_line_says_so(monkeypatch, capsys):
    from nb_helpers import frontend

    monkeypatch.setattr(frontend, "_SAID", set(), raising=False)
    nf4.kernels.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "nb_helpers.fast.nf4_kernels", None)  # import fails
    state = _State((2048, 2048))
    try:
        assert nf4.mark([state]) == 0
        assert not hasattr(state, nf4.TABLE)
    finally:
        nf4.kernels.cache_clear()
    assert "NF4 dequantize kernel off: Triton is not importable" in capsys.readouterr().out


def test_a_kernel_that_cannot_compile_leaves_every_weight_to_bitsandbytes(monkeypatch, capsys):
    """An old GPU Triton cannot compile for: the warm-up fails before any capture, nothing stays marked, one line."""
    from nb_helpers import frontend

    class Refusing:
        class dequantize_kernel:
            def __class_getitem__(cls, grid):
                raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(frontend, "_SAID", set(), raising=False)
    monkeypatch.setattr(nf4, "kernels", lambda: Refusing)
    monkeypatch.setattr(nf4, "takes", lambda state: True)
    states = [_State((2048, 2048)), _State((256, 2048))]
    for state in states:
        state.absmax = torch.zeros(64)
    assert nf4.mark(states) == 0
    assert not any(hasattr(state, nf4.TABLE) for state in states)
    assert "NF4 dequantize kernel off: it did not compile or run on this GPU" in capsys.readouterr().out


def test_outside_a_capture_the_kernel_is_not_taken():
    state = _State((2048, 2048))
    setattr(state, nf4.TABLE, torch.zeros(16))
    assert not nf4.in_capture(state, torch.zeros(4))  # no graph is being captured here
    assert not nf4.in_capture(_State((2048, 2048)), torch.zeros(4))  # not marked


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2048, 2048), (256, 2048), (5632, 2048), (2048, 5632)])
def test_the_kernel_writes_bitsandbytes_bits(dtype, shape):
    import bitsandbytes.functional as F

    packed, state = _quantized(shape, dtype)
    expected = F.dequantize_4bit(packed, state)
    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset  # double quantization decoded
    assert nf4.mark([state]) == 1
    got = nf4.dequantize(packed, absmax.float(), state)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), \
        f"{(got != expected).sum().item()} of {got.numel()} values differ"


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [True, False])
def test_a_captured_graph_dequantizes_through_the_kernel_with_the_same_bits(nested, monkeypatch):
    packed, state = _quantized((512, 1024), torch.bfloat16, nested=nested, seed=1)
    weight = torch.nn.Parameter(packed, requires_grad=False)
    weight.quant_state = state
    assert nf4.mark([state]) == 1
    calls, kernel = [], nf4.dequantize
    monkeypatch.setattr(nf4, "dequantize", lambda *args: calls.append(1) or kernel(*args))
    eager = fused_lora._dequantize(weight, direct=True)
    assert calls == []  # eager: bitsandbytes' kernel
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        captured = fused_lora._dequantize(weight, direct=True)
    assert calls == [1]
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.int16), eager.view(torch.int16))
