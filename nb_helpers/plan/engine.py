"""What the planner needs from a training engine: what it runs that changes memory or time, in the planner's own
words (PlanInput's fields), and which of auto-fit's choices it can carry out.

The plain stack (transformers + peft + TRL, the reference recipe, `fast_path=False`) is `PLAIN`, defined here. A
plugin engine registers a function that describes itself for a config (`register`); the package registers the GPU
fast path (nb_helpers.fast.plan_terms) when it is imported, so the planner asks for it by the config's `fast_path`
and never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# PlanInput's fields that depend on the engine, as the plain stack leaves them: the base frozen and 16-bit (the recipe
# never calls prepare_model_for_kbit_training), the stock layers, the attention mask, PyTorch's default allocator,
# checkpoints on the card and recomputed in full.
PLAIN_TERMS = dict(lean=True, fused_kernels=False, nomask=False, expandable=False, offload=False, graphs=False,
                   dead_tail=False, dropout_kernels=False, absmax_once=False, down_once=False, no_recompute_layers=0,
                   one_token_count=False, frozen_norms=False, saved_attention=False, dequant_time_share=1.0)


@dataclass(frozen=True)
class EngineView:
    terms: dict = field(default_factory=lambda: dict(PLAIN_TERMS))  # PlanInput fields, for this config
    can_offload: bool = False  # auto-fit may put checkpoints in CPU RAM
    fewer_recomputes: bool = False  # auto-fit may leave the last layers unrecomputed (no_recompute_layers)


PLAIN = EngineView()
_ENGINES: dict[str, Callable[..., EngineView]] = {}


def register(name: str, describe: Callable[..., EngineView]) -> None:
    """`describe(cfg, shape, budget_gib, gpu_capability, gpu_extras) -> EngineView` for runs with `fast_path`."""
    _ENGINES[name] = describe


def engine_view(cfg, shape, budget_gib: float | None, gpu_capability: tuple[int, int] | None = None,
                gpu_extras: bool | None = None) -> EngineView:
    """What the run of `cfg` trains with, as the planner models it: the registered fast path where `cfg.fast_path`,
    else the plain stack. `gpu_capability`: a GPU other than this machine's (None: this one, or a named card)."""
    if not getattr(cfg, "fast_path", False) or "fast" not in _ENGINES:
        return PLAIN
    return _ENGINES["fast"](cfg, shape, budget_gib, gpu_capability, gpu_extras)
