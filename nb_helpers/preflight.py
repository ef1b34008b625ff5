"""Settings checks that need the model's config.json but not its weights: they run before anything big loads."""

from __future__ import annotations

from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.plan.architecture import Shape, UnsupportedModel
from nb_helpers.plan.dtypes import cuda_capability, gpu_compute_dtype
from nb_helpers.lora import check_targets
from nb_helpers.models import ModelChoice


def model_config(cfg: RunConfig, choice: ModelChoice):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(choice.path, trust_remote_code=cfg.trust_remote_code)


def four_bit_weight_bytes(config, double_quant: bool = True) -> float:
    """NF4 weights as loaded on a GPU: the planner's weight terms (architecture.Shape.four_bit_bytes), the rest
    (embeddings, head, norms, biases) in 16-bit. Within a few percent of models.memory_breakdown on loaded models."""
    return Shape.from_config(config).four_bit_bytes(double_quant)


def preflight(cfg: RunConfig, choice: ModelChoice, verbose: bool = True) -> RunConfig:
    """Raise ConfigError for settings that cannot work with this model; return cfg with safe adjustments."""
    config = model_config(cfg, choice)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and cfg.max_length > limit:
        raise ConfigError(f"max_length={cfg.max_length} is above {choice.name}'s limit of {limit} positions; "
                          f"set max_length <= {limit}")
    targets = check_targets(skeleton(config), cfg.target_modules)
    if targets != list(cfg.target_modules):
        if verbose:
            print(f"[lora] {choice.name} names its layers differently: target_modules "
                  f"{','.join(cfg.target_modules)} -> {','.join(targets)} (its fused layers hold the same weights)")
        cfg = cfg.replace(target_modules=targets)
    capability = cuda_capability()
    if cfg.compute_dtype == "bfloat16" and gpu_compute_dtype("bfloat16", capability) != "bfloat16":
        if verbose:
            print(f"[config] compute_dtype='bfloat16' asked for, but this GPU (compute capability "
                  f"{capability[0]}.{capability[1]}) has no native bf16: using float16 instead, with "
                  f"loss scaling so that small gradients do not underflow to zero")
        cfg = cfg.replace(compute_dtype="float16")
    return cfg


def skeleton(config):
    """The model's modules with no memory behind them (meta device): enough to list layer names."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def check_budget_fits(cfg: RunConfig, choice: ModelChoice, allocator_cap_gib: float) -> None:
    try:
        weights = four_bit_weight_bytes(model_config(cfg, choice)) / 2**30
    except UnsupportedModel as e:  # a family the planner cannot count still trains; only this early check is lost
        print(f"[budget] cannot check the 4-bit weights against budget_gib before loading: {e}")
        return
    if weights >= allocator_cap_gib:
        raise ConfigError(f"budget_gib={cfg.budget_gib} leaves {allocator_cap_gib:.2f} GiB after the CUDA context, "
                          f"less than {choice.name}'s 4-bit weights alone ({weights:.2f} GiB); raise budget_gib "
                          f"above {weights + (cfg.budget_gib - allocator_cap_gib) + 0.5:.1f} or pick a smaller model")
