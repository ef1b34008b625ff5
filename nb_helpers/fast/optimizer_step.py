"""The recipe's optimizer (bitsandbytes' 8-bit AdamW, paged or not) with its CUDA kernels called directly.

bitsandbytes (0.50) updates one parameter at a time: a config dict, argument checks, two custom-op dispatches, and then
a synchronize of the whole device (`sync_gpu`) after every parameter, which paged state needs and device state does
not. QLoRA's adapters are many small tensors (176 for TinyLlama at r=8 on q,k,v,o), so a step spent 23 ms there
with the GPU idle (an H200's trace at 8 x 2048, 2026-12-01); the direct calls took 5 ms.

`install(optimizer)` gives the optimizer a step that makes the same kernel calls, with the same arguments, in the same
order, on the same stream, without that per-call machinery: the same bits (tests/test_optimizer_step.py, on the GPU).
bitsandbytes' own step runs instead, for that whole step, wherever this does not apply (`why_not_direct`): state not
made yet (the first step makes it), state in paged (managed) memory, per-parameter overrides, update-norm clipping,
a closure, a tensor not on the current CUDA device, or a bitsandbytes whose kernels are not where this looks.
"""

from __future__ import annotations

import ctypes as ct
import types

import torch

_KERNELS: list = []  # probed once: [((8-bit kernels by grad dtype, 32-bit kernels by grad dtype), None or why not)]
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # bitsandbytes' kernel tables are in this order


def _kernels():
    if not _KERNELS:
        try:
            from nb_helpers import compat

            _KERNELS.append((compat.adam_kernels(), None))
        except Exception as error:  # noqa: BLE001 - a CPU-only build, or bitsandbytes moved its kernel tables
            _KERNELS.append((None, f"{type(error).__name__}: {str(error)[:100]}"))
    return _KERNELS[0][0]


def why_not_direct(optimizer, group: dict, param) -> str | None:
    """Why this parameter's update must go through bitsandbytes' own step, or None when the direct call is exact."""
    state = optimizer.state.get(param, {})
    if "state1" not in state:
        return "no state yet"
    if getattr(state["state1"], "is_paged", False):
        return "paged state"
    if id(param) in optimizer.mng.pid2config or optimizer.mng.index2config:
        return "per-parameter overrides"
    if optimizer.args.max_unorm > 0.0:
        return "update-norm clipping (max_unorm)"
    if len(group["betas"]) != 2 or group.get("alpha", 0.0):
        return "not plain AdamW betas"
    if state["state1"].dtype == torch.uint8 and "absmax1" not in state:
        return "8-bit state that is not blockwise"
    grad = param.grad
    if grad.dtype not in _DTYPES or grad.dtype != param.dtype or not (grad.is_contiguous()
                                                                       and param.is_contiguous()):
        return "gradient dtype or layout"
    if not param.is_cuda or param.device.index != torch.cuda.current_device():
        return "not on the current CUDA device"
    return None


def _ptr(tensor):
    return ct.c_void_p(tensor.data_ptr())


def _update(kernels, group: dict, param, state: dict, skip_zeros: bool) -> None:
    """One parameter's update, as bitsandbytes' Optimizer2State.update_step calls its kernel (0.50.2)."""
    grad, (beta1, beta2) = param.grad, group["betas"]
    state["step"] += 1
    step, lr, eps, decay = ct.c_int32(state["step"]), ct.c_float(group["lr"]), ct.c_float(group["eps"]), \
        ct.c_float(group["weight_decay"])
    zero, one, skip, n = ct.c_float(0.0), ct.c_float(1.0), ct.c_bool(skip_zeros), ct.c_int32(grad.numel())
    if state["state1"].dtype == torch.uint8:
        kernels[0][grad.dtype](_ptr(param), _ptr(grad), _ptr(state["state1"]), _ptr(state["state2"]),
                               ct.c_float(beta1), ct.c_float(beta2), zero, zero, eps, step, lr,
                               _ptr(state["qmap1"]), _ptr(state["qmap2"]), _ptr(state["absmax1"]),
                               _ptr(state["absmax2"]), decay, one, skip, n)
    else:  # tensors under min_8bit_size keep 32-bit state; no update-norm vector (max_unorm is 0 here)
        kernels[1][grad.dtype](_ptr(grad), _ptr(param), _ptr(state["state1"]), _ptr(state["state2"]), None,
                               zero, zero, ct.c_float(beta1), ct.c_float(beta2), zero, zero, eps, decay, step,
                               lr, one, skip, n)


@torch.no_grad()
def direct_step(optimizer, closure=None, _own_step=None):
    """bitsandbytes' step, without its per-parameter machinery where that is exact (see the module's docstring)."""
    kernels = _kernels()
    work = [(group, p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if closure is not None or kernels is None or not optimizer.initialized \
            or any(why_not_direct(optimizer, g, p) for g, p in work):
        return _own_step(closure)
    for group, param in work:
        _update(kernels, group, param, optimizer.state[param], optimizer.args.skip_zeros)
    return None


def applies_to(optimizer) -> bool:
    """bitsandbytes' two-state AdamW family (adamw_8bit, paged_adamw_8bit, their 32-bit forms) on CUDA."""
    try:
        from bitsandbytes.optim.optimizer import Optimizer2State
    except ImportError:
        return False
    return isinstance(optimizer, Optimizer2State) and optimizer.optimizer_name == "adam" and torch.cuda.is_available()


def install(optimizer) -> bool:
    """Give a bitsandbytes AdamW the direct step (its own step stays the fallback). True if installed."""
    if not applies_to(optimizer) or _kernels() is None:
        return False
    own_step = optimizer.step
    optimizer.step = types.MethodType(lambda self, closure=None: direct_step(self, closure, own_step), optimizer)
    return True


def install_on_trainer(trainer) -> None:
    """The optimizer the Trainer makes (the recipe's paged_adamw_8bit, in trainer.train()) steps through
    bitsandbytes' kernels directly: the same updates without a device synchronize per parameter."""
    make = trainer.create_optimizer

    def create_optimizer(*args, **kwargs):
        optimizer = make(*args, **kwargs)
        install(optimizer)
        return optimizer

    trainer.create_optimizer = create_optimizer
