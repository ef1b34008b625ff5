"""Lever nf4_kernel (nb_helpers.fast.nf4_kernel): the Triton kernel gives bitsandbytes' own dequantized bits, for
every output dtype, with and without double quantization, for weights of a few blocks up to a TinyLlama MLP weight. On
CUDA (marked gpu) against bitsandbytes' CUDA kernel; where there is none but Triton is (CI's CPU: requirements-test.txt
installs it), on CPU tensors in Triton's interpreter, in a child pytest with TRITON_INTERPRET=1, against bitsandbytes'
CPU kernel (fp16 and fp32 only: the interpreter's bf16 is wrong). Also: the lever's wiring in fast.fused_lora, its
fallbacks, and the kernel inside a CUDA graph."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nb_helpers import frontend
from nb_helpers.fast import fused_lora

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # see tests/test_lora_dropout.py: read as Triton is imported
ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(3, 64), (40, 192), (256, 2048)]  # 3 blocks (one program, mostly masked), 120 (a partial last tile), 8,192


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu)] + (["interpreter"] if INTERPRETER else []))
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return "cuda" if request.param == "cuda" else "cpu"


@pytest.fixture
def tiny_4bit_layers():
    import bitsandbytes as bnb

    return torch.nn.Sequential(bnb.nn.Linear4bit(64, 32, bias=False, quant_type="nf4"))


def _quantized(shape, dtype, nested, device, seed=0):
    from bitsandbytes.functional import dequantize_blockwise, quantize_4bit

    weight = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype).to(device)
    packed, state = quantize_4bit(weight, quant_type="nf4", compress_statistics=nested)
    absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset if nested else state.absmax
    return packed, state, absmax.float()


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_gives_bitsandbytes_bits(device, dtype, shape, nested):
    from bitsandbytes.functional import dequantize_4bit

    from nb_helpers.fast import nf4_kernel

    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter gets bf16 wrong")
    packed, state, absmax = _quantized(shape, dtype, nested, device)
    assert nf4_kernel.takes(state, packed)
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)  # every element must be written
    got = nf4_kernel.dequantize_into(packed, absmax, state.code, out, state.blocksize)
    want = dequantize_4bit(packed, state)
    assert got is out and got.dtype == want.dtype == dtype
    assert torch.equal(got, want), (got != want).sum()
    assert got.abs().sum() > 0


def test_the_kernel_takes_only_whole_power_of_two_nf4_blocks():
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from nb_helpers.fast import nf4_kernel

    code = torch.zeros(16)
    data = torch.zeros(64, dtype=torch.uint8)

    def state(**changes):
        fields = dict(quant_type="nf4", blocksize=64, shape=torch.Size([2, 64]), code=code) | changes
        return SimpleNamespace(**fields)

    assert nf4_kernel.takes(state(), data)
    assert not nf4_kernel.takes(state(quant_type="fp4"), data)
    assert not nf4_kernel.takes(state(blocksize=48, shape=torch.Size([2, 48])), torch.zeros(48, dtype=torch.uint8))
    assert not nf4_kernel.takes(state(shape=torch.Size([2, 60])), torch.zeros(60, dtype=torch.uint8))  # a part block
    assert not nf4_kernel.takes(state(code=torch.zeros(256)), data)  # an 8-bit code table
    assert not nf4_kernel.takes(state(code=code.half()), data)


def test_the_kernel_tests_pass_on_the_cpu_in_tritons_interpreter():
    """Each test above taking `device`, on CPU tensors in Triton's interpreter (a child pytest of this file with
    TRITON_INTERPRET=1). Not where CUDA runs the kernel itself: see tests/test_lora_dropout.py's twin."""
    if INTERPRETER:
        pytest.skip("this is the child run")
    if torch.cuda.is_available():
        pytest.skip("CUDA runs the kernel itself (the tests' cuda cases)")
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing or broken alike
        pytest.skip(f"Triton is not importable ({type(e).__name__}): requirements-test.txt installs it")
    run = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-rfEs",
                          "-k", "interpreter"], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=1200)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines and " passed" in lines[-1], run.stdout[-8000:] + run.stderr[-4000:]


def test_without_cuda_the_lever_marks_nothing(tiny_4bit_layers):
    """On a CPU bitsandbytes' kernels are not reachable directly: no weight is handed to the kernel."""
    if torch.cuda.is_available():
        pytest.skip("the CPU half")
    assert fused_lora.use_nf4_kernel(tiny_4bit_layers) == 0


def test_without_triton_the_lever_says_so_once_and_marks_nothing(tiny_4bit_layers, monkeypatch, capsys):
    monkeypatch.setattr(fused_lora, "_direct_kernels", lambda: ("absmax kernel", {}, "stream"))
    import nb_helpers.fast

    monkeypatch.setitem(sys.modules, "nb_helpers.fast.nf4_kernel", None)  # importing it raises ImportError
    monkeypatch.delattr(nb_helpers.fast, "nf4_kernel", raising=False)  # as it would, had it never been imported
    monkeypatch.setattr(frontend, "_SAID", set())
    assert fused_lora.use_nf4_kernel(tiny_4bit_layers) == 0
    assert fused_lora.use_nf4_kernel(tiny_4bit_layers) == 0
    assert capsys.readouterr().out.count("nf4_kernel off: Triton is not importable") == 1


def test_a_changed_nf4_layout_turns_the_lever_off_with_one_line(tiny_4bit_layers, monkeypatch, capsys):
    from nb_helpers import compat

    monkeypatch.setattr(fused_lora, "_direct_kernels", lambda: ("absmax kernel", {}, "stream"))
    monkeypatch.setattr(frontend, "_SAID", set())
    monkeypatch.setattr(compat, "_nf4_layout", lambda: "NF4 is no longer code[nibble] x absmax")
    monkeypatch.setattr(compat, "CHECKS", tuple(
        compat.Check(c.api, c.library, c.levers, compat._nf4_layout if "nf4_kernel" in c.levers else c.probe)
        for c in compat.CHECKS))
    assert fused_lora.use_nf4_kernel(tiny_4bit_layers) == 0
    assert "nf4_kernel off: bitsandbytes.functional.dequantize_4bit" in capsys.readouterr().out


@pytest.mark.gpu
def test_the_lever_gives_the_same_bits_eagerly_and_inside_a_cuda_graph():
    """fast.fused_lora's dequantize with the lever on: the weight is marked, and its dequantize, eager or replayed from
    a CUDA graph (where checkpointed layers run), gives the bits bitsandbytes' kernel gave before."""
    import bitsandbytes as bnb

    layers = torch.nn.Sequential(*(bnb.nn.Linear4bit(2048, out, bias=False, compute_dtype=torch.bfloat16,
                                                     quant_type="nf4", compress_statistics=True) for out in (5632, 256)))
    for layer in layers:
        layer.weight.data.normal_(0, 0.02)
    layers.to(torch.bfloat16).cuda()
    weights = [layer.weight for layer in layers]
    before = [fused_lora._dequantize(weight, direct=True).clone() for weight in weights]
    assert fused_lora.use_nf4_kernel(layers) == 2
    eager = [fused_lora._dequantize(weight, direct=True) for weight in weights]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = [fused_lora._dequantize(weight, direct=True) for weight in weights]
    for out in replayed:
        out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for want, *got in zip(before, eager, replayed):
        assert all(torch.equal(g, want) for g in got)
