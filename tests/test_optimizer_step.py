"""nb_helpers.fast.optimizer_step: bitsandbytes' AdamW kernels called directly give bitsandbytes' own updates, and its own
step runs wherever the direct call would not be exact."""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from nb_helpers.fast import optimizer_step  # noqa: E402


def adapters(device="cpu", dtype=torch.float32, seed=0):
    """Tensors shaped like TinyLlama's LoRA weights: A (8 x 2048, 8-bit state), B of k/v (256 x 8: under
    bitsandbytes' 4,096-value minimum, so 32-bit state), B of q (2048 x 8)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 2048), (256, 8), (2048, 8), (8, 256)]
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device, dtype)) for s in shapes]


def give_grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)


def paged_adamw(params):
    """As transformers builds optim="paged_adamw_8bit": two groups, decay on the first."""
    groups = [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "weight_decay": 0.0}]
    return bnb.optim.AdamW(groups, lr=2e-4, betas=(0.9, 0.999), eps=1e-8, optim_bits=8, is_paged=True)


def test_each_reason_to_keep_bitsandbytes_step_is_named():
    params = adapters()
    opt = paged_adamw(params)
    group = opt.param_groups[0]
    give_grads(params, 0)
    assert optimizer_step.why_not_direct(opt, group, params[0]) == "no state yet"
    opt.step()  # bitsandbytes' own step makes the state (on the CPU too)
    assert opt.state[params[0]]["state1"].dtype == torch.uint8 and opt.state[params[1]]["state1"].dtype == torch.float32
    assert optimizer_step.why_not_direct(opt, group, params[0]) == "not on the current CUDA device"
    opt.state[params[0]]["state1"].is_paged = True
    assert optimizer_step.why_not_direct(opt, group, params[0]) == "paged state"
    del opt.state[params[0]]["state1"].is_paged
    opt.mng.pid2config[id(params[0])] = {"optim_bits": 32}
    assert optimizer_step.why_not_direct(opt, group, params[0]) == "per-parameter overrides"
    opt.mng.pid2config.clear()
    params[0].grad = params[0].grad.t().contiguous().t()
    assert optimizer_step.why_not_direct(opt, group, params[0]) == "gradient dtype or layout"
    params[0].grad = params[0].grad.contiguous()
    opt.args.max_unorm = 1.0  # bitsandbytes' LAMB/LARS-style clipping (AdamW's subclasses can set it)
    assert optimizer_step.why_not_direct(opt, group, params[0]) == "update-norm clipping (max_unorm)"


def test_where_it_does_not_apply_bitsandbytes_own_step_runs_and_gives_its_updates(no_gpu):
    mine, theirs = adapters(), adapters()
    opt_mine, opt_theirs = paged_adamw(mine), paged_adamw(theirs)
    calls = []

    def own_step(closure=None):
        calls.append(closure)
        return type(opt_mine).step(opt_mine, closure)

    for step in range(3):
        give_grads(mine, step)
        give_grads(theirs, step)
        optimizer_step.direct_step(opt_mine, None, own_step)  # on the CPU: never direct
        opt_theirs.step()
    assert len(calls) == 3
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert not optimizer_step.install(opt_mine)  # no CUDA here: the optimizer keeps its own step
    assert "step" not in vars(opt_mine)


def test_only_bitsandbytes_adamw_gets_the_direct_step():
    params = adapters()
    assert not optimizer_step.applies_to(torch.optim.AdamW(params))
    assert not optimizer_step.applies_to(bnb.optim.Lion(params, optim_bits=8))
    assert optimizer_step.applies_to(paged_adamw(params)) == torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_direct_step_gives_bitsandbytes_bits_on_the_gpu(dtype):
    """Five steps with the learning rate changing, both groups, 8-bit and 32-bit state: every weight and every state
    tensor equal to bitsandbytes' own step, bit for bit; only the first step (which makes the state) is its own."""
    mine, theirs = adapters("cuda", dtype), adapters("cuda", dtype)
    opt_mine, opt_theirs = paged_adamw(mine), paged_adamw(theirs)
    own = opt_mine.step
    own_calls = []
    opt_mine.step = lambda closure=None: (own_calls.append(1), own(closure))[1]
    assert optimizer_step.install(opt_mine)
    for step in range(5):
        for opt in (opt_mine, opt_theirs):
            for group in opt.param_groups:
                group["lr"] = 2e-4 * (1 - step / 5)
        give_grads(mine, step)
        give_grads(theirs, step)
        opt_mine.step()
        opt_theirs.step()
    torch.cuda.synchronize()
    assert own_calls == [1]
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
        for key, value in opt_theirs.state[b].items():
            other = opt_mine.state[a][key]
            assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value, key


def test_the_trainer_optimizer_gets_the_direct_step_when_made(monkeypatch):
    """optimizer_step.install_on_trainer: the optimizer the Trainer makes in train() goes through install()."""
    from types import SimpleNamespace

    made, installed = paged_adamw(adapters()), []
    monkeypatch.setattr(optimizer_step, "install", installed.append)
    trainer = SimpleNamespace(create_optimizer=lambda: made)
    optimizer_step.install_on_trainer(trainer)
    assert installed == []  # nothing before the Trainer makes its optimizer
    assert trainer.create_optimizer() is made and installed == [made]
