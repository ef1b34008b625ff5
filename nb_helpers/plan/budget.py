"""The emulated card: a budget that makes a big GPU behave like a small one. The process's PyTorch allocator is capped
at the budget less the CUDA context (set_per_process_memory_fraction), so an out-of-memory error comes where the card
would give one. The cap does not cover the context or memory allocated outside PyTorch (bitsandbytes' paged buffers):
training measures NVML's device-used beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nb_helpers.plan.memory import outside_allocator_gib, record_nvml_baseline


@dataclass
class Budget:
    budget_gib: float
    context_gib: float
    allocator_cap_gib: float
    total_gib: float

    def describe(self) -> str:
        return (f"budget {self.budget_gib:.2f} GiB = CUDA context {self.context_gib:.2f} GiB + "
                f"PyTorch allocator cap {self.allocator_cap_gib:.2f} GiB (card has {self.total_gib:.1f} GiB)")


def enforce_budget(budget_gib: float, device: int = 0, card_context_gib: float | None = None) -> Budget:
    """Cap PyTorch's allocator at the budget less the CUDA context: this GPU's context, or with `card_context_gib`
    the emulated card's (a GTX 1650's context is about half an H200's: the card's PyTorch gets what it would get)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("enforce_budget needs a CUDA GPU; on the CPU there is no device memory to cap")
    record_nvml_baseline(device)  # corrected for a context created earlier, if there is one
    torch.ones(1, device=f"cuda:{device}")  # make sure the context exists so it can be measured
    torch.cuda.synchronize(device)
    context = outside_allocator_gib(device)
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    cap = budget_gib - (context if card_context_gib is None else card_context_gib)
    if cap <= 0.1:
        raise RuntimeError(f"a {budget_gib} GiB budget leaves nothing after the {context:.2f} GiB CUDA context; "
                           "raise budget_gib")
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    return Budget(budget_gib, context, cap, total)
