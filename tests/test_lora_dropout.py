"""LoRA's dropout inside the rank-r products (nb_helpers.fast.lora_dropout): each Triton kernel against the same math
in torch with the mask the kernels draw, the mask's keep rate and tiling, the seed, and the fused layer's outputs and
gradients. Each kernel test runs on CUDA (marked gpu), and where there is none but Triton is (CI's CPU:
requirements-test.txt installs it) on CPU tensors in Triton's interpreter, in a child pytest with TRITON_INTERPRET=1
(fp16 only: the interpreter's bf16 is wrong). Without CUDA or the interpreter the fused layer falls back to torch's
dropout (tested here on every machine)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nb_helpers.fast import fused_lora, lora_dropout


# Read as Triton is imported (triton.jit reads it as it decorates, Triton's own tl.randint4x too), so it is set only in
# the child run of test_the_kernel_tests_pass_on_the_cpu_in_tritons_interpreter: this process keeps compiled kernels
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu)] + (["interpreter"] if INTERPRETER else []))
def device(request):
    """"cuda": the compiled kernels on the GPU. "interpreter": the same kernels on CPU tensors in Triton's
    interpreter (the child run only)."""
    if request.param == "cuda" and not torch.cuda.is_available():  # conftest skips gpu-marked tests before this
        pytest.skip("needs a CUDA GPU")
    if request.param == "interpreter" and lora_dropout.kernels() is None:
        pytest.skip("Triton is not importable: its interpreter runs these kernels on the CPU")
    return "cuda" if request.param == "cuda" else "cpu"


def _inputs(device, dtype, tokens, features, rank, outputs=96, seed=0):
    generator = torch.Generator(device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)
    return (rand(tokens, features), rand(rank, features, scale=features ** -0.5), rand(outputs, rank),
            rand(tokens, rank))


def _assert_same_bits(got, want, device):
    """Two launches of the same rank-r dots: on CUDA the same bits, the kernels' claim. In Triton's interpreter a tl.dot
    is NumPy's float32 matmul, whose sums run in an order OpenBLAS picks by CPU (its kernel is chosen at run time) and
    by the tile's shape, so there (an AVX2 CPU: 14 of 309,000 outputs) one launch may round one fp16 step apart."""
    if device == "cuda":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=torch.finfo(got.dtype).eps, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,features,rank,outputs", [(200, 128, 8, 96), (1030, 256, 16, 300), (64, 2048, 64, 256)])
def test_each_kernel_is_the_dropout_math_with_its_own_mask(device, dtype, tokens, features, rank, outputs):
    p, s = 0.1, 2.0
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 wrongly")
    x, a, b, gd = _inputs(device, dtype, tokens, features, rank, outputs)
    seed = torch.tensor([1234], dtype=torch.int32, device=device)
    keep = lora_dropout.drawn_mask(seed, tokens, features, p, device)
    dropped = x.double() * keep * lora_dropout.keep_scale(p)
    down, out = lora_dropout.dropped_down(x, a, b, seed, p, s)
    assert down.dtype == out.dtype == dtype and down.shape == (tokens, rank) and out.shape == (tokens, outputs)
    torch.testing.assert_close(down.double(), dropped @ a.double().t(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), s * down.double() @ b.double().t(), rtol=2e-2, atol=2e-2)
    assert lora_dropout.dropped_down(x, a, b, seed, p, s, write_out=False)[1] is None
    _assert_same_bits(lora_dropout.out_from_down(down, b, s), out, device)  # a recompute reusing `down`
    grad_a, grad_x = lora_dropout.grads(gd, x, a, seed, p)
    torch.testing.assert_close(grad_a.double(), gd.double().t() @ dropped, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(grad_x.double(), (gd.double() @ a.double()) * keep * lora_dropout.keep_scale(p),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_launch_settings_change_the_time_not_the_bits(device, dtype):
    """The forward split in two kernels (down, then out_kernel) writes the fused kernel's bits; the backward's row
    tiles and splits give the same input gradient, and grad_A up to the order of its fp32 sums (the bits on CUDA; in
    Triton's interpreter within one fp16 rounding, see _assert_same_bits)."""
    p, s = 0.05, 2.0
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 wrongly")
    x, a, b, gd = _inputs(device, dtype, 1030, 256, 8, 300)
    seed = torch.tensor([99], dtype=torch.int32, device=device)
    shipped = lora_dropout.tiles("forward", 1030, 256)
    fused = lora_dropout.dropped_down(x, a, b, seed, p, s, settings={**shipped, "split": False})
    split = lora_dropout.dropped_down(x, a, b, seed, p, s, settings={**shipped, "split": True})
    assert torch.equal(fused[0], split[0])
    _assert_same_bits(fused[1], split[1], device)
    grad_a, grad_x = lora_dropout.grads(gd, x, a, seed, p)
    for rows, per_sm in ((16, 8), (32, 2)):
        other = dict(BT=rows, BK=64, num_warps=4, num_stages=2, per_sm=per_sm)
        other_a, other_x = lora_dropout.grads(gd, x, a, seed, p, settings=other)
        _assert_same_bits(other_x, grad_x, device)
        torch.testing.assert_close(other_a, grad_a, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):  # the check can fail: another seed draws another mask
        torch.testing.assert_close(lora_dropout.grads(gd, x, a, seed + 1, p)[1], grad_x)


@pytest.mark.parametrize("tokens,rows,per_sm", [(32, 32, 4), (64, 32, 4), (1030, 16, 8)])
def test_grad_a_is_the_sum_of_every_split_whichever_split_finishes_last(device, tokens, rows, per_sm):
    """The backward's last split on each column tile adds up every split's partial grad_A (one split: none to add;
    65 splits: the count per tile must reach each of them), in split order: each launch the same bits."""
    p = 0.05
    x, a, _, gd = _inputs(device, torch.float16, tokens, 256, 8)
    seed = torch.tensor([5], dtype=torch.int32, device=device)
    settings = dict(BT=rows, BK=64, num_warps=4, num_stages=2, per_sm=per_sm)
    splits = lora_dropout.row_splits(tokens, 256, rows, 64, per_sm, lora_dropout.sm_count(x.device))[0]
    assert splits == {32: 1, 64: 2}.get(tokens, splits) and (tokens < 1030 or splits > 32)
    dropped = x.double() * lora_dropout.drawn_mask(seed, tokens, 256, p, device) * lora_dropout.keep_scale(p)
    grad_a = lora_dropout.grads(gd, x, a, seed, p, settings=settings)[0]
    assert grad_a.shape == (8, 256) and grad_a.dtype == torch.float32
    torch.testing.assert_close(grad_a.double(), gd.double().t() @ dropped, rtol=1e-3, atol=1e-3)
    for _ in range(3):
        _assert_same_bits(lora_dropout.grads(gd, x, a, seed, p, settings=settings)[0], grad_a, device)
    counts = lora_dropout.arrival_counts(x.device, 256 // 64)  # the kept counts, left at zero for the next call
    assert counts.numel() >= 4 and not counts.any()


def test_the_mask_keeps_one_minus_p_everywhere_whatever_the_tiles(device):
    p = 0.05
    seed = torch.tensor([77], dtype=torch.int32, device=device)
    keep = lora_dropout.drawn_mask(seed, 512, 2048, p, device)
    assert torch.equal(keep, lora_dropout.drawn_mask(seed, 512, 2048, p, device, rows=16, cols=128))
    expected = 1 - lora_dropout.threshold(p) / 65536
    assert abs(keep.float().mean().item() - expected) < 0.002  # 1M draws: the standard error is 0.0002
    for axis in (0, 1):  # no column or row kept far more often than the rest (a broken counter repeats draws)
        rates = keep.float().mean(axis)
        assert rates.std().item() < 3 * (expected * (1 - expected) / keep.shape[axis]) ** 0.5
    assert not torch.equal(keep[:, :1024], keep[:, 1024:]) and not torch.equal(keep[::2], keep[1::2])


def test_seeds_drawn_together_are_one_draw_rewound_with_the_generator():
    """A layer's LoRA layers take their seeds from one draw: distinct seeds, the same again after the generator is
    rewound (a checkpoint's recompute), each layer pass its own; past the count and outside, one draw each."""
    def layer_pass(count, calls):
        with lora_dropout.drawn_together(count):
            return [lora_dropout.draw_seed("cpu") for _ in range(calls)]

    torch.manual_seed(3)
    state = torch.get_rng_state()
    first = layer_pass(4, 5)
    assert len({int(seed) for seed in first}) == 5 and all(seed.shape == (1,) for seed in first)
    assert first[0].untyped_storage().data_ptr() == first[3].untyped_storage().data_ptr()  # one tensor, one draw
    assert first[4].untyped_storage().data_ptr() != first[0].untyped_storage().data_ptr()  # past the count: its own
    second = layer_pass(4, 5)
    assert not any(torch.equal(a, b) for a, b in zip(first, second))
    torch.set_rng_state(state)
    assert all(torch.equal(a, b) for a, b in zip(first, layer_pass(4, 5)))
    assert lora_dropout._TOGETHER == []  # nothing left behind: outside a layer, one draw a seed
    torch.set_rng_state(state)
    with lora_dropout.drawn_together(4):  # a layer pass with no dropout draws nothing: the generator does not move
        pass
    after = torch.randint(0, 2**20, (3,))
    torch.set_rng_state(state)
    assert torch.equal(after, torch.randint(0, 2**20, (3,)))


def test_the_seed_comes_from_torchs_generator_and_decides_the_mask(device):
    torch.manual_seed(3)
    first = lora_dropout.draw_seed(device)
    torch.manual_seed(3)
    again, other = lora_dropout.draw_seed(device), lora_dropout.draw_seed(device)
    assert torch.equal(first, again) and not torch.equal(first, other)
    masks = [lora_dropout.drawn_mask(s, 64, 64, 0.5, device) for s in (first, again, other)]
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


def _fused_layer(x, a, b, w, p, s, kernels=True, dead=False, monkeypatch=None):
    """LoRA4bitLinear with W given directly (no 4-bit weight): its output and the gradients of x, A and B."""
    monkeypatch.setattr(fused_lora, "_dequantize", lambda weight, direct=False: w)
    xs, As, Bs = (t.clone().requires_grad_() for t in (x, a, b))
    torch.manual_seed(9)
    out = fused_lora.LoRA4bitLinear.apply(xs, None, None, As, Bs, s, p, False, dead, kernels)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return out.detach(), xs.grad, As.grad, Bs.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_layer_with_the_kernels_gives_the_gradients_of_its_mask(device, dtype, monkeypatch):
    """LoRA4bitLinear with the kernels against the same layer in float64 with the kernels' mask; a dead layer (its
    output read by nothing) gives zeros and the same gradients; no_grad gives the same output."""
    p, s = 0.1, 2.0
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 wrongly")
    x, a, b, _ = _inputs(device, dtype, 128, 64, 8, outputs=32, seed=1)
    w = _inputs(device, dtype, 32, 64, 1, seed=2)[0] / 8
    out, *grads = _fused_layer(x, a, b, w, p, s, monkeypatch=monkeypatch)
    torch.manual_seed(9)
    keep = lora_dropout.drawn_mask(lora_dropout.draw_seed(device), 128, 64, p, device)
    xd, ad, bd = (t.double().requires_grad_() for t in (x, a, b))
    ref = xd @ w.double().t() + s * ((xd * keep * lora_dropout.keep_scale(p)) @ ad.t()) @ bd.t()
    ref.backward(torch.ones_like(ref) / ref.numel() ** 0.5)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=3e-2, atol=5e-2)
    for got, want in zip(grads, (xd.grad, ad.grad, bd.grad)):
        cos = torch.nn.functional.cosine_similarity(got.double().flatten(), want.flatten(), dim=0)
        assert cos > 0.999, cos
    dead_out, *dead_grads = _fused_layer(x, a, b, w, p, s, dead=True, monkeypatch=monkeypatch)
    assert not dead_out.any()
    for got, want in zip(dead_grads, grads):
        assert torch.equal(got, want)
    torch.manual_seed(9)
    with torch.no_grad():  # a checkpoint's first forward: no autograd Function, the same draws
        assert torch.equal(fused_lora._lora_linear(x, None, None, a, b, s, p, False, False, True)[0], out)


def test_the_kernel_tests_pass_on_the_cpu_in_tritons_interpreter():
    """Each test above taking `device`, on CPU tensors in Triton's interpreter: a child pytest of this file with
    TRITON_INTERPRET=1 set from its start (see INTERPRETER). About 35 s on CI's 2 cores. Not where CUDA runs the
    kernels themselves (the gpu-marked cases): there torch 2.11 brings Triton 3.6.0, whose interpreter fails under NumPy
    2.4 (int() of a one-element array, fixed in 3.7)."""
    if INTERPRETER:
        pytest.skip("this is the child run")
    if torch.cuda.is_available():
        pytest.skip("CUDA runs these kernels themselves (the tests' cuda cases)")
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing or broken alike
        pytest.skip(f"Triton is not importable ({type(e).__name__}): requirements-test.txt installs it for its "
                    f"interpreter")
    run = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-rfEs",
                          "-k", "interpreter"], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=1200)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines and " passed" in lines[-1], run.stdout[-8000:] + run.stderr[-4000:]


def test_without_cuda_the_fused_layer_falls_back_to_torchs_dropout(monkeypatch):
    """On a CPU (no interpreter) the lever changes nothing: the same output and gradients as torch's dropout."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the fallback is for machines where the kernels cannot run")
    x, a, b, _ = _inputs("cpu", torch.float32, 40, 64, 8, outputs=16)
    w = _inputs("cpu", torch.float32, 16, 64, 1, seed=3)[0]
    assert not lora_dropout.usable(x, a)
    with_lever = _fused_layer(x, a, b, w, 0.2, 2.0, kernels=True, monkeypatch=monkeypatch)
    without = _fused_layer(x, a, b, w, 0.2, 2.0, kernels=False, monkeypatch=monkeypatch)
    for got, want in zip(with_lever, without):
        assert torch.equal(got, want)
    no_dropout = _fused_layer(x, a, b, w, 0.0, 2.0, kernels=False, monkeypatch=monkeypatch)
    assert not torch.equal(without[0], no_dropout[0])  # the dropout did act


def test_the_planner_counts_the_input_once_instead_of_copies_and_masks():
    from dataclasses import replace

    from nb_helpers.plan.activations import lora_bytes_per_token
    from nb_helpers.plan.catalog import known_shape
    from nb_helpers.plan.planner import PlanInput

    shape = known_shape("tinyllama-1.1b")
    torch_dropout = PlanInput(seq=2048, batch=8, dropout_kernels=False)
    kernels = replace(torch_dropout, dropout_kernels=True)
    h, r = shape.hidden, torch_dropout.rank
    # q, k, v, o each keep a 16-bit dropped copy and a bool mask of their h inputs; with the kernels q, k and v keep
    # their one input and o_proj's input is the attention output, kept by the attention anyway
    assert lora_bytes_per_token(shape, torch_dropout) - lora_bytes_per_token(shape, kernels) == 4 * 3 * h - 2 * h
    assert lora_bytes_per_token(shape, kernels) == 2 * h + 4 * 2 * r
    no_dropout = replace(kernels, lora_dropout=0.0)
    assert lora_bytes_per_token(shape, no_dropout) == 4 * (2 * h + 2 * r)  # no dropout: the inputs themselves


def test_without_triton_the_kernels_are_off_and_say_so_once(monkeypatch, capsys):
    """Where Triton cannot be imported (a CPU-only torch, Windows' CUDA torch) the lever falls back, said once."""
    import builtins

    from nb_helpers import frontend

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(frontend, "_SAID", set())
    monkeypatch.setattr(builtins, "__import__", no_triton)
    monkeypatch.delitem(__import__("sys").modules, "nb_helpers.fast.lora_dropout_kernels", raising=False)
    # where a test before has imported it, the package holds it too, and `from nb_helpers.fast import ...` finds it there
    monkeypatch.delattr(__import__("nb_helpers.fast").fast, "lora_dropout_kernels", raising=False)
    lora_dropout.kernels.cache_clear()
    try:
        assert lora_dropout.kernels() is None and lora_dropout.kernels() is None
        x, a, _, _ = _inputs("cpu", torch.float16, 8, 64, 4)
        assert not lora_dropout.usable(x, a)
    finally:
        lora_dropout.kernels.cache_clear()
    said = capsys.readouterr().out
    assert said.count("LoRA dropout kernels off: Triton is not importable") == 1, said


@pytest.mark.parametrize("capability,dtype", [(90, "*bf16"), (75, "*fp16")])  # an H200; a GTX 1650 (no bf16)
def test_the_kernels_compile_for_the_gpus_they_serve(capability, dtype):
    """Compiled ahead of time, without a GPU, where Triton is installed (CI too: requirements-test.txt). Triton's
    interpreter accepts code its compiler refuses (call 38 lost a device call to a plain global in a kernel)."""
    triton = pytest.importorskip("triton")
    if INTERPRETER:
        pytest.skip("Triton was imported for its interpreter (TRITON_INTERPRET=1): nothing compiles in this process")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = lora_dropout.kernels()
    i32, f32 = "i32", "fp32"
    signatures = {
        k.down_kernel: ([dtype] * 5 + ["*i32"] + [i32] * 5 + [f32] * 2, dict(R=16, BT=64, BK=128, BN=128,
                                                                          WRITE_OUT=True)),
        k.out_kernel: ([dtype] * 3 + [i32] * 3 + [f32], dict(R=16, BT=64, BN=128)),
        k.backward_kernel: ([dtype] * 4 + ["*fp32", "*fp32", "*i32", "*i32"] + [i32] * 4 + [f32, i32, i32],
                            dict(R=16, BT=64, BK=128)),
        k.mask_kernel: (["*i8", "*i32"] + [i32] * 3, dict(BT=32, BK=64)),
    }
    for kernel, (types, constants) in signatures.items():
        names = kernel.arg_names
        signature = {**dict(zip(names, types)), **{c: "constexpr" for c in constants}}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(c),): v for c, v in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
        assert compiled.asm.get("ptx"), kernel.__name__


def test_the_backward_grid_follows_the_gpus_own_sm_count():
    """The grid was sized for an H200's 132 SMs on every GPU: on a GTX 1650's 14 it wrote ~9x the partial sums it
    needed. Splits now aim at per_sm programs per SM of the GPU that runs the kernel; every row is covered once."""
    tokens, features, rows, cols = 16384, 2048, 16, 128
    h200 = lora_dropout.row_splits(tokens, features, rows, cols, per_sm=4, sms=132)
    gtx1650 = lora_dropout.row_splits(tokens, features, rows, cols, per_sm=4, sms=14)
    assert gtx1650[0] < h200[0]
    assert gtx1650[0] * (features // cols) >= 4 * 14  # still enough programs to fill every SM
    for splits, per_split in (h200, gtx1650):
        assert splits * per_split >= tokens > (splits - 1) * per_split and per_split % rows == 0
    assert lora_dropout.sm_count(torch.device("cpu")) == lora_dropout.H200_SMS  # the interpreter keeps the tuned grid
