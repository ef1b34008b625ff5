"""The fast path described to the planner (nb_helpers.plan.engine): which of its levers run for a config, in the
planner's words. nb_helpers/__init__.py registers `describe`, so plan/ never imports fast/."""

from __future__ import annotations

import platform

from nb_helpers.fast.options import gpu_options, kernels_installed
from nb_helpers.plan.architecture import keeps_decoded_absmax
from nb_helpers.plan.engine import EngineView, register

# Lever nf4_kernel: fast.nf4_kernel's GPU time against bitsandbytes' kernel for a TinyLlama layer's seven weights,
# 38.6 against 58.2 us in bf16 on an H100 (bench/dequant_bench.py, 2026-12-06)
NF4_KERNEL_TIME_SHARE = 0.66


def fused_kernels_on(gpu_capability: tuple[int, int] | None, gpu_extras: bool | None = None) -> bool:
    """Whether the planned GPU runs liger-kernel's fused layers: for this machine's own GPU, whether they are
    installed here; for any other GPU (a CPU planning a GTX 1650, a named --gpu-capability), what `make` installs
    beside an NVIDIA driver (requirements-gpu.txt), unless `gpu_extras` says otherwise. Planned from a CPU without
    them, the stock MLP's extra saved tensor made plans up to 20% high."""
    from nb_helpers.plan.dtypes import cuda_capability

    if gpu_extras is not None:
        return gpu_extras
    try:
        here = cuda_capability()
    except (RuntimeError, AssertionError):  # a torch without CUDA support: no GPU here
        here = None
    return kernels_installed() if here is not None and gpu_capability in (None, here) else True


def describe(cfg, shape, budget_gib: float | None, gpu_capability: tuple[int, int] | None = None,
             gpu_extras: bool | None = None) -> EngineView:
    """What a GPU run of `cfg` trains with on the fast path, as NB_FASTPATH leaves the levers."""
    fast = gpu_options(cfg.fast_path)
    extras = fused_kernels_on(gpu_capability, gpu_extras)
    checkpointing = bool(cfg.gradient_checkpointing)
    terms = dict(lean=fast.lean, nomask=fast.nomask, fused_kernels=fast.kernels and extras,
                 expandable=fast.expandable and platform.system() == "Linux",
                 offload=bool(cfg.offload_checkpoints or fast.offload) and checkpointing,
                 graphs=cfg.graphs_wanted and fast.graphs and fast.reentrant, dead_tail=fast.skips_dead_tail(),
                 dropout_kernels=fast.dropout_kernels and fast.fused_lora and extras,
                 absmax_once=fast.absmax_once and fast.fused_lora and fast.direct_dequant
                 and keeps_decoded_absmax(shape.linear_params, budget_gib),
                 down_once=fast.down_once and fast.skips_dead_tail(), no_recompute_layers=cfg.no_recompute_layers,
                 one_token_count=fast.one_token_count,
                 frozen_norms=fast.frozen_norms and fast.fused_block and fast.fused_lora and fast.kernels,
                 saved_attention=fast.saved_attention and fast.fused_block and fast.fused_lora,
                 dequant_time_share=NF4_KERNEL_TIME_SHARE if fast.nf4_kernel and fast.fused_lora and fast.direct_dequant
                 and extras else 1.0)
    return EngineView(terms, can_offload=True, fewer_recomputes=fast.fewer_recomputes)


def register_with_planner() -> None:
    register("fast", describe)
