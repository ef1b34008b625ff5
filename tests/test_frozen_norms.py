"""RMSNorm's backward for frozen weights (nb_helpers.fast.frozen_norms, lever frozen_norms): liger's own kernel over
the rows, no weight gradient, and the layer input's second gradient added inside it. On the GPU (marked): the same
bits as liger's fused add + RMSNorm, and the input norm's two gradients at least as close to float64 as liger's
backward followed by an add. Everywhere: where the lever cannot run, liger's or the stock norms stay. Training with
the lever, eager, offloaded and graphed, is tests/test_fused_block.py's GPU test."""

from types import SimpleNamespace

import pytest
import torch

from nb_helpers.fast import frozen_norms


def test_only_a_frozen_weight_on_a_gpu_takes_the_lever():
    frozen = torch.nn.Parameter(torch.ones(8), requires_grad=False)
    assert not frozen_norms.takes(SimpleNamespace(weight=frozen))  # on the CPU: liger's kernels need CUDA
    assert not frozen_norms.takes(SimpleNamespace(weight=None))
    if torch.cuda.is_available():
        assert frozen_norms.takes(SimpleNamespace(weight=frozen.cuda())) == frozen_norms._importable()
        assert not frozen_norms.takes(SimpleNamespace(weight=torch.nn.Parameter(torch.ones(8, device="cuda"))))


def test_without_liger_the_lever_does_not_take_a_norm(monkeypatch):
    """liger missing (a CPU machine, a broken Triton): _importable is False, so fused_block keeps its own norms."""
    import builtins

    real = builtins.__import__

    def no_liger(name, *args, **kwargs):
        if name.startswith("liger_kernel"):
            raise ImportError("no liger here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_liger)
    assert frozen_norms._importable() is False


def _norm(cols, dtype):
    weight = (torch.rand(cols, device="cuda") + 0.5).to(dtype)
    return SimpleNamespace(weight=torch.nn.Parameter(weight, requires_grad=False), variance_epsilon=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,dtype", [(4 * 512, 2048, torch.bfloat16), (37, 64, torch.float16),
                                             (300, 2048, torch.float16)])
def test_the_add_norm_backward_gives_ligers_bits(rows, cols, dtype):
    from liger_kernel.ops import LigerFusedAddRMSNormFunction

    torch.manual_seed(0)
    norm = _norm(cols, dtype)
    x, residual, grad_y, grad_sum = (torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(4))
    ours_in = [t.clone().requires_grad_() for t in (x, residual)]
    theirs_in = [t.clone().requires_grad_() for t in (x, residual)]
    y, summed = frozen_norms.add_norm(*ours_in, norm)
    y_ref, summed_ref = LigerFusedAddRMSNormFunction.apply(*theirs_in, norm.weight, 1e-6, 0.0, "llama", False)
    assert torch.equal(y, y_ref) and torch.equal(summed, summed_ref)
    torch.autograd.backward((y, summed), (grad_y.clone(), grad_sum.clone()))
    torch.autograd.backward((y_ref, summed_ref), (grad_y.clone(), grad_sum.clone()))
    for ours, theirs in zip(ours_in, theirs_in):
        assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,dtype", [(4 * 512, 2048, torch.bfloat16), (37, 64, torch.float16)])
def test_the_input_norm_sums_both_gradients_in_its_kernel(rows, cols, dtype):
    """(norm(x), x): the forward is liger's RMSNorm to the bit; x's gradient, the norm's plus the residual's, is at
    least as close to float64 as liger's backward then an add (which rounds twice), and fails without the residual."""
    from liger_kernel.ops import LigerRMSNormFunction

    torch.manual_seed(1)
    norm = _norm(cols, dtype)
    x, grad_y, grad_residual = (torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(3))
    ours = x.clone().requires_grad_()
    y, passed = frozen_norms.norm_keeping_input(ours, norm)
    theirs = x.clone().requires_grad_()
    y_ref = LigerRMSNormFunction.apply(theirs, norm.weight, 1e-6, 0.0, "llama", False, None)
    assert torch.equal(y, y_ref) and torch.equal(passed, x)
    torch.autograd.backward((y, passed), (grad_y.clone(), grad_residual.clone()))
    y_ref.backward(grad_y.clone())
    liger_then_add = theirs.grad + grad_residual

    x64, w64 = x.double().requires_grad_(), norm.weight.double()
    (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64).backward(grad_y.double())
    exact = x64.grad + grad_residual.double()
    ours_error, ref_error = ((g.double() - exact).abs().max().item() for g in (ours.grad, liger_then_add))
    assert ours_error <= ref_error * 1.01 + 1e-6, (ours_error, ref_error)
    assert (theirs.grad.double() - exact).abs().max().item() > 10 * max(ours_error, 1e-3)  # the residual counts
