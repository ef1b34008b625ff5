"""The fast path: not needed to follow the course; `RunConfig(fast_path=False)` turns it off.

On a CUDA GPU it trains the reference recipe's math with less memory and less time per token than the plain
transformers + peft + TRL stack (bench/RESULTS.md; bench/results/runs/ has each lever measured alone). Off,
or on a CPU, the course runs the stock layers of notebooks 01-03 and nothing in this folder touches the model.
The course reaches it through this module alone, in four calls:

    fast = options_for(cfg)               # which levers this run may use (fast.options; NB_FASTPATH for benchmarks)
    before_lora(model, fast)              # fused kernels on the base model                    (fast.kernels)
    after_lora(model, fast, cfg)          # no mask, fused QLoRA layers and blocks, checkpoints (fast.mask,
                                          #   fast.fused_lora, fast.fused_block, fast.frozen_norms,
                                          #   fast.saved_attention, fast.checkpoints, fast.offload, fast.graphed_layers)
    adapt_trainer(trainer, model)         # rows read as arrays, the mode switched on a change, the collator's padding
                                          #   check, bitsandbytes' AdamW kernels called directly (fast.host_step,
                                          #   fast.optimizer_step)

One lever, one line, each switchable with NB_FASTPATH="lever=0" (fast.options.FastOptions lists them). Every private
API of another library that the package uses is checked in nb_helpers.compat, and the riskiest calls go through it:
a failed check turns its lever off with one line naming the API, and `make test` fails on it. `levers_ran(model,
cfg)` is what config.json, summary.json and the log say ran.
"""

from __future__ import annotations

from nb_helpers.fast.options import DECODED_ABSMAX, ENV_VAR, FastOptions, gpu_options, kernels_installed, options_of
from nb_helpers.frontend import say_once

__all__ = ["DECODED_ABSMAX", "ENV_VAR", "FastOptions", "gpu_options", "kernels_installed", "options_of", "options_for",
           "before_lora", "after_lora", "adapt_trainer", "levers_ran", "levers_line", "use_expandable_segments",
           "checkpoint_kwargs", "graphs_on", "pad_multiple", "padded_length", "set_checkpoint_offload",
           "out_of_memory_raises", "reset_graphs", "lever_table", "trainer_token_count"]


def options_for(cfg) -> FastOptions:
    """The run's levers: `cfg.fast_path`, the machine, NB_FASTPATH, then any lever whose private API failed its check
    (nb_helpers.compat) turned off with one line."""
    from nb_helpers import compat

    fast = FastOptions.for_run(cfg)
    for lever, why in compat.failed([name for name, on in fast.speed_levers().items() if on]).items():
        setattr(fast, lever, False)
        say_once(f"compat-{lever}", compat.fallback_note(lever, why))
    return fast


def before_lora(model, fast: FastOptions) -> None:
    """Before get_peft_model: the fused kernels patch the base model's norms, MLPs and RoPE."""
    if fast.kernels:
        from nb_helpers.fast.kernels import apply_fused_kernels

        record(model, "kernels", apply_fused_kernels(model))


def after_lora(model, fast: FastOptions, cfg) -> None:
    """After get_peft_model: no mask for right padding, fused QLoRA layers, this run's checkpoint functions."""
    from nb_helpers.fast.checkpoints import install_offload
    from nb_helpers.fast.mask import install_mask_drop

    model._nb_fast, model._nb_use_graphs, model._nb_levers = fast, cfg.graphs_wanted, getattr(model, "_nb_levers", {})
    model._nb_no_recompute = cfg.no_recompute_layers if cfg.gradient_checkpointing else 0
    if fast.nomask:
        install_mask_drop(model)
    if fast.fused_lora:
        from nb_helpers.fast.fused_lora import apply_fused_lora

        record(model, "fused_lora", apply_fused_lora(model, direct_dequant=fast.direct_dequant,
                                                     dropout_kernels=fast.dropout_kernels))
        if fast.dropout_kernels:
            from nb_helpers.fast.lora_dropout import kernels

            record(model, "dropout_kernels", kernels() is not None)
        if fast.absmax_once:
            from nb_helpers.fast.fused_lora import keep_decoded_absmax
            from nb_helpers.plan.cards import budget_of

            record(model, "absmax_once", model._nb_levers.get("fused_lora", False) and fast.direct_dequant
                   and keep_decoded_absmax(model, budget_of(cfg)) > 0)
    if fast.fused_block and model._nb_levers.get("fused_lora"):
        from nb_helpers.fast.fused_block import apply_fused_block

        counts = apply_fused_block(model, liger=bool(model._nb_levers.get("kernels")), frozen=fast.frozen_norms,
                                   saved=fast.saved_attention)
        record(model, "fused_block", counts["layers"] > 0)
        record(model, "frozen_norms", counts["frozen_norms"] > 0)
        record(model, "saved_attention", counts["saved_attention"] > 0)
    if cfg.fast_path:
        install_offload(model, bool(cfg.offload_checkpoints or fast.offload) and cfg.gradient_checkpointing)
    elif cfg.offload_checkpoints:
        say_once("offload-plain", "[fast] offload_checkpoints needs the fast path (fast_path=True); checkpoints stay "
                                  "on the GPU")
    if cfg.no_recompute_layers and cfg.gradient_checkpointing and not cfg.fast_path:
        say_once("no-recompute-plain", "[fast] no_recompute_layers needs the fast path (fast_path=True); every "
                                       "checkpointed layer recomputes")


def adapt_trainer(trainer, model) -> None:
    """On a built trainer: the training rows read as arrays, model.train() walks the modules only on a change; a batch
    that is not right-padded turns the mask drop off; the optimizer steps through bitsandbytes' kernels directly."""
    fast = getattr(model, "_nb_fast", None)
    if fast is None or not any(fast.speed_levers().values()):  # the plain stack: the Trainer as TRL builds it
        return
    from nb_helpers.fast.host_step import flops_counter

    trainer.floating_point_ops = flops_counter(model)  # the parameters counted once, not at every step
    if fast.array_rows:
        from nb_helpers.fast.host_step import read_rows_as_arrays

        record(model, "array_rows", read_rows_as_arrays(trainer))
    if fast.mode_on_change:
        from nb_helpers.fast.host_step import walk_modes_on_change

        walk_modes_on_change(model)
    if fast.nomask:
        from nb_helpers.fast.mask import guard_collator

        trainer.data_collator = guard_collator(trainer.data_collator, model)
    if fast.direct_optim:
        from nb_helpers.fast.optimizer_step import install_on_trainer

        install_on_trainer(trainer)


def record(model, lever: str, ran: bool) -> None:
    """What an installer found: some levers can only fall back once they meet the model (no liger for this family)."""
    model._nb_levers = {**getattr(model, "_nb_levers", {}), lever: bool(ran)}


def use_checkpoint_choice(model, offload: bool | None = None, graphs: bool | None = None,
                          no_recompute_layers: int | None = None) -> None:
    """Auto-fit's choice (or its trial's) for this model's checkpoints: in CPU RAM where the fast path installed the
    offload, replayed as CUDA graphs, and how many of the last layers keep their activations; None leaves one as it
    is. fast.checkpoints reads them when it points each layer at its checkpoint function."""
    if offload is not None and can_offload(model):
        model._nb_offload = bool(offload)
    if graphs is not None:
        model._nb_use_graphs = bool(graphs)
    if no_recompute_layers is not None:
        model._nb_no_recompute = max(0, int(no_recompute_layers))


def can_offload(model) -> bool:
    """Whether this model's checkpoints can go to CPU RAM: the fast path installed the offload on it."""
    return hasattr(model, "_nb_offload")


def kept_quant_state_bytes(state) -> int:
    """Bytes the fast path keeps beside a 4-bit weight's quantization state: its decoded absmax (lever absmax_once)."""
    kept = getattr(state, DECODED_ABSMAX, None)
    return 0 if kept is None else kept.numel() * kept.element_size()


def levers_ran(model, cfg, expandable: bool | None = None) -> dict[str, bool]:
    """{lever: ran} for this model's run, as config.json and summary.json record it ({} on a CPU). `expandable`: what
    the allocator really took (a user's own PYTORCH_CUDA_ALLOC_CONF wins), where the run set it."""
    import torch

    from nb_helpers.fast.checkpoints import graphs_on, no_recompute_layers, pad_multiple, tail_lever_on

    if not torch.cuda.is_available():
        return {}
    fast = options_of(model)
    ran = fast.speed_levers()
    ran.update(getattr(model, "_nb_levers", {}))
    checkpointing = bool(cfg.gradient_checkpointing)
    ran.update(graphs=graphs_on(model) and checkpointing, pad_lengths=pad_multiple(model) is not None,
               offload=bool(getattr(model, "_nb_offload", False)) and checkpointing,
               reentrant=fast.reentrant and checkpointing)
    ran["dead_tail"] = tail_lever_on(model) and checkpointing
    ran["fewer_recomputes"] = no_recompute_layers(model) > 0 and checkpointing  # chosen or set by hand
    ran["down_once"] = ran["dead_tail"] and ran.get("dropout_kernels", False) and ran.get("down_once", False)
    ran["frozen_norms"] = bool(ran.get("fused_block") and getattr(model, "_nb_levers", {}).get("frozen_norms"))
    ran["saved_attention"] = bool(ran.get("fused_block") and getattr(model, "_nb_levers", {}).get("saved_attention")
                                  and ran["offload"] and not ran["graphs"] and ran["down_once"])
    if not ran.get("fused_lora"):
        # the fused layers are what call these kernels
        for lever in ("direct_dequant", "dead_tail", "fused_block", "dropout_kernels", "absmax_once", "down_once",
                      "frozen_norms", "saved_attention"):
            ran[lever] = False
    if expandable is not None:
        ran["expandable"] = bool(expandable)
    return ran


def levers_line(model, cfg, ran: dict | None = None) -> str:
    """The log's one line: which levers run, which do not."""
    import torch

    if not torch.cuda.is_available():
        return "[fast] fast path: not used on the CPU (the stock layers of notebooks 01-03)"
    if not cfg.fast_path:
        return "[fast] fast_path=False: the plain transformers + peft + TRL stack, no lever runs"
    ran = ran if ran is not None else levers_ran(model, cfg)
    on = [k for k, v in ran.items() if v]
    off = [k for k, v in ran.items() if not v]
    return f"[fast] levers on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'} (NB_FASTPATH=lever=0|1)"


def lever_table(cfg) -> str:
    """Markdown: each lever, whether it runs on this machine with `cfg`, what it changes, what it gave where measured
    (fast.options.LEVERS), and how to turn it off. Notebook 03 shows it before anything loads."""
    import torch

    from nb_helpers.fast.options import LEVERS

    fast = options_for(cfg)
    where = "no CUDA GPU here" if not torch.cuda.is_available() else "fast_path=False" if not cfg.fast_path else ""
    rows = ["| lever | runs here | what it changes | measured alone (H200, 4 GiB budget, TinyLlama-1.1B shape) |",
            "|---|---|---|---|"]
    for name, (what, measured) in LEVERS.items():
        on = getattr(fast, name) and not where
        runs = "yes" if on else f"no ({where or 'off'})"
        if name in ("graphs", "offload") and on:
            runs = "where auto-fit or your settings choose it"
        rows.append(f"| `{name}` | {runs} | {what} | {measured} |")
    return "\n".join(rows) + ("\n\nTurn one off with `NB_FASTPATH=\"lever=0\"` before the kernel starts, or all of "
                              "them with `fast_path=False`.")


def use_expandable_segments(fast: FastOptions) -> bool | None:
    """Expandable allocator segments where the lever is on (nb_helpers.compat holds the private call); None if off."""
    if not fast.expandable:
        return None
    from nb_helpers.compat import use_expandable_segments as expandable

    return expandable()


# Reached as nb_helpers.fast.NAME, imported on first use: importing the fast path must not import torch (the planner
# and the CLI's `plan` read FastOptions on machines where training never starts).
LAZY = {
    "checkpoint_kwargs": ("checkpoints", "checkpoint_kwargs"),  # torch checkpoint's kwargs for this run
    "graphs_on": ("checkpoints", "graphs_on"),
    "pad_multiple": ("checkpoints", "pad_multiple"),  # the collator's length step, or None
    "set_checkpoint_offload": ("checkpoints", "set_checkpoint_offload"),
    "padded_length": ("graphed_layers", "padded_length"),
    "out_of_memory_raises": ("graphed_layers", "out_of_memory_raises"),  # a capture that runs out of memory raises
    "reset_graphs": ("graphed_layers", "reset"),  # every graph and its memory pool dropped (auto-fit's trials)
    "trainer_token_count": ("host_step", "trainer_token_count"),  # include_num_input_tokens_seen for this run
}


def __getattr__(name: str):
    if name not in LAZY:
        raise AttributeError(f"module 'nb_helpers.fast' has no attribute {name!r}")
    import importlib

    module, attr = LAZY[name]
    return getattr(importlib.import_module(f"nb_helpers.fast.{module}"), attr)
