"""What the fast path keeps for one model, in one object on it: the levers the run may use, what each installer found
when it met the model, and the checkpoint choice (in CPU RAM, replayed as CUDA graphs, how many of the last layers
not recomputed). Only fast/ writes it; auto-fit changes the choice through nb_helpers.fast.use_checkpoint_choice.
(The per-layer marks its kernels read while they run stay on those layers: fast.recompute, fast.fused_lora, ...)"""

from __future__ import annotations

from dataclasses import dataclass, field

from nb_helpers.fast.options import FastOptions

ATTRIBUTE = "_nb_fast_path"  # the one attribute the fast path sets on a model


@dataclass
class FastPath:
    options: FastOptions
    ran: dict[str, bool] = field(default_factory=dict)  # lever -> whether its installer took this model
    offload: bool | None = None  # checkpoints in CPU RAM; None: the offload is not installed on this model
    use_graphs: bool = True  # the run's choice (RunConfig.cuda_graphs, or auto-fit's)
    no_recompute: int = 0  # the last layers that keep their activations (RunConfig.no_recompute_layers, or auto-fit's)


def path_of(model) -> FastPath | None:
    """The fast path's state on this model, or None where attach_lora never prepared it."""
    return getattr(model, ATTRIBUTE, None)


def options_of(model) -> FastOptions:
    """The levers this model was prepared with (attach_lora records them), else the environment's."""
    state = path_of(model)
    return state.options if state is not None else FastOptions.from_env()


def attach(model, options: FastOptions, use_graphs: bool, no_recompute: int) -> FastPath:
    """A fresh state on the model (keeping what installers found before it: fast.kernels runs before LoRA)."""
    found = path_of(model)
    state = FastPath(options, dict(found.ran) if found else {}, use_graphs=use_graphs, no_recompute=no_recompute)
    setattr(model, ATTRIBUTE, state)
    return state


def record(model, lever: str, ran: bool) -> None:
    """What an installer found: some levers can only fall back once they meet the model (no liger for this family)."""
    state = path_of(model)
    if state is None:  # before LoRA (fast.kernels): the options come with attach
        state = FastPath(FastOptions.from_env())
        setattr(model, ATTRIBUTE, state)
    state.ran[lever] = bool(ran)
