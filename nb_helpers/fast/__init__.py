"""The fast path, a plugin: off by default (notebooks 00-05 train the plain stack); `RunConfig(fast_path=True)`, which
notebook 06 sets, turns it on.

On a CUDA GPU it trains the reference recipe's math with less memory and less time per token than the plain
transformers + peft + TRL stack (bench/RESULTS.md, which also tables what each lever gains alone). Off, or on a CPU,
the course runs the stock layers of notebooks 01-03 and nothing in this folder touches the model. Its state for a
model is one object on it (fast.state.FastPath), written by this folder alone. The course reaches it through this
module, and only through these calls:

    fast = options_for(cfg)               # which levers this run may use (fast.options; NB_FASTPATH for benchmarks)
    before_lora(model, fast)              # fused kernels on the base model                    (fast.kernels)
    after_lora(model, fast, cfg)          # no mask, fused QLoRA layers and blocks, checkpoints (fast.mask,
                                          #   fast.fused_lora, fast.fused_block, fast.frozen_norms,
                                          #   fast.saved_attention, fast.checkpoints, fast.offload, fast.graphed_layers)
    SFTConfig(..., **trainer_arguments(model))  # reentrant checkpoints, the token count, batch padding
    adapt_trainer(trainer, model)         # rows read as arrays and a step ahead, the mode switched on a change,
                                          #   gradients zeroed and clipped over the trainable parameters, the
                                          #   collator's padding check, bitsandbytes' AdamW kernels called
                                          #   directly (fast.host_step, fast.optimizer_step)
    fit_length, prepare_trial, trial_guard, end_trial, use_checkpoint_choice, can_offload   # auto-fit's trial
    planned_fit_length                    # the length auto-fit fits for, before the model loads (the panel)
    levers_ran, levers_line, lever_table  # what config.json, summary.json, the log and notebook 03 say ran

The planner learns what the fast path runs from fast.plan_terms, which the package registers with plan.engine: the
planner never imports this folder. A lever is one FastOptions field, its own module, its lines in after_lora or
adapt_trainer, its terms in fast.plan_terms and its tests; NB_FASTPATH="lever=0" turns one off. Every private API of
another library that it uses is checked in nb_helpers.compat: a failed check turns its lever off with one line naming
the API, and `make test` fails on it.
"""

from __future__ import annotations

from nb_helpers.fast.options import DECODED_ABSMAX, ENV_VAR, FastOptions, gpu_options, kernels_installed
from nb_helpers.fast.state import FastPath, attach, options_of, path_of, record
from nb_helpers.frontend import say_once

__all__ = ["ENV_VAR", "FastOptions", "FastPath", "gpu_options", "options_for", "before_lora", "after_lora",
           "trainer_arguments", "adapt_trainer", "fit_length", "planned_fit_length", "prepare_trial", "trial_guard", "end_trial",
           "use_checkpoint_choice", "can_offload", "levers_ran", "levers_line", "lever_table", "use_expandable_segments",
           "kept_quant_state_bytes"]


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

    state = attach(model, fast, use_graphs=cfg.graphs_wanted,
                   no_recompute=cfg.no_recompute_layers if cfg.gradient_checkpointing else 0)
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

            record(model, "absmax_once", state.ran.get("fused_lora", False) and fast.direct_dequant
                   and keep_decoded_absmax(model, budget_of(cfg)) > 0)
        if fast.nf4_kernel:
            from nb_helpers.fast.fused_lora import use_nf4_kernel

            record(model, "nf4_kernel", state.ran.get("fused_lora", False) and fast.direct_dequant
                   and use_nf4_kernel(model) > 0)
    if fast.fused_block and state.ran.get("fused_lora"):
        from nb_helpers.fast.fused_block import apply_fused_block

        counts = apply_fused_block(model, liger=bool(state.ran.get("kernels")), frozen=fast.frozen_norms,
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
    """On a built trainer: the training rows read as arrays and a step ahead, model.train() walks the modules only on
    a change, the gradients are zeroed and clipped over the trainable parameters; a batch that is not right-padded
    turns the mask drop off; the optimizer steps through bitsandbytes' kernels directly."""
    state = path_of(model)
    if state is None or not any(state.options.speed_levers().values()):  # the plain stack: the Trainer as TRL built it
        return
    fast = state.options
    from nb_helpers.fast.host_step import flops_counter

    trainer.floating_point_ops = flops_counter(model)  # the parameters counted once, not at every step
    if fast.array_rows:
        from nb_helpers.fast.host_step import read_rows_as_arrays

        record(model, "array_rows", read_rows_as_arrays(trainer))
    if fast.mode_on_change:
        from nb_helpers.fast.host_step import walk_modes_on_change

        walk_modes_on_change(model)
    if fast.trainable_grads:
        from nb_helpers.fast.host_step import walk_trainable_grads

        walk_trainable_grads(trainer, model)
    if fast.rows_ahead:
        from nb_helpers.fast.host_step import read_rows_ahead

        record(model, "rows_ahead", read_rows_ahead(trainer))
    if fast.nomask:
        from nb_helpers.fast.mask import guard_collator

        trainer.data_collator = guard_collator(trainer.data_collator, model)
    if fast.direct_optim:
        from nb_helpers.fast.optimizer_step import install_on_trainer

        install_on_trainer(trainer)


def use_checkpoint_choice(model, offload: bool | None = None, graphs: bool | None = None,
                          no_recompute_layers: int | None = None) -> None:
    """Auto-fit's choice (or its trial's) for this model's checkpoints: in CPU RAM where the fast path installed the
    offload, replayed as CUDA graphs, and how many of the last layers keep their activations; None leaves one as it
    is. fast.checkpoints reads them when it points each layer at its checkpoint function."""
    state = path_of(model)
    if state is None:
        raise ValueError("use_checkpoint_choice: this model was not prepared by attach_lora")
    if offload is not None and state.offload is not None:
        state.offload = bool(offload)
    if graphs is not None:
        state.use_graphs = bool(graphs)
    if no_recompute_layers is not None:
        state.no_recompute = max(0, int(no_recompute_layers))


def can_offload(model) -> bool:
    """Whether this model's checkpoints can go to CPU RAM: the fast path installed the offload on it."""
    state = path_of(model)
    return state is not None and state.offload is not None


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
    state = path_of(model) or FastPath(options_of(model))
    fast = state.options
    ran = fast.speed_levers()
    ran.update(state.ran)
    checkpointing = bool(cfg.gradient_checkpointing)
    ran.update(graphs=graphs_on(model) and checkpointing, pad_lengths=pad_multiple(model) is not None,
               offload=bool(state.offload) and checkpointing,
               reentrant=fast.reentrant and checkpointing)
    ran["dead_tail"] = tail_lever_on(model) and checkpointing
    ran["fewer_recomputes"] = no_recompute_layers(model) > 0 and checkpointing  # chosen or set by hand
    ran["down_once"] = ran["dead_tail"] and ran.get("dropout_kernels", False) and ran.get("down_once", False)
    ran["frozen_norms"] = bool(ran.get("fused_block") and state.ran.get("frozen_norms"))
    ran["saved_attention"] = bool(ran.get("fused_block") and state.ran.get("saved_attention")
                                  and ran["offload"] and not ran["graphs"] and ran["down_once"])
    if not ran.get("fused_lora"):
        # the fused layers are what call these kernels
        for lever in ("direct_dequant", "dead_tail", "fused_block", "dropout_kernels", "absmax_once", "nf4_kernel",
                      "down_once", "frozen_norms", "saved_attention"):
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
    (fast.options.LEVERS), and how to turn it off. Notebook 06 shows it where it switches the fast path on."""
    import torch

    from nb_helpers.fast.options import LEVERS

    fast = options_for(cfg)
    where = "no CUDA GPU here" if not torch.cuda.is_available() else "fast_path=False" if not cfg.fast_path else ""
    rows = ["| lever | runs here | what it changes | measured alone (an H200 unless it says, 4 GiB budget, "
            "TinyLlama-1.1B shape) |",
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


def trainer_arguments(model) -> dict:
    """SFTConfig's arguments the fast path decides for this model: reentrant checkpoints, who counts the tokens
    (fast.host_step says why the Trainer's own count waits on the GPU), and batch lengths padded to a multiple of 64
    (CUDA-graphed layers replay one graph per shape; cuDNN's attention builds its plans once per shape). On the plain
    stack they are notebook 03's: non-reentrant checkpoints, the Trainer counting non-padding tokens, no padding."""
    from nb_helpers.fast.checkpoints import checkpoint_kwargs, pad_multiple
    from nb_helpers.fast.host_step import trainer_token_count

    return {"gradient_checkpointing_kwargs": checkpoint_kwargs(model),
            "include_num_input_tokens_seen": trainer_token_count(model), "pad_to_multiple_of": pad_multiple(model)}


# Auto-fit's trial step (nb_helpers.autofit) on a model attach_lora prepared: the length it fits for, the checkpoint
# functions of a candidate, a capture that must fail rather than fall back, and every graph dropped afterwards.
def fit_length(model, seq: int) -> int:
    """The length a batch of `seq`-token rows trains at: padded to a multiple of 64 where batches are padded."""
    from nb_helpers.fast.checkpoints import pad_multiple
    from nb_helpers.fast.graphed_layers import padded_length

    return padded_length(seq) if pad_multiple(model) else seq


def planned_fit_length(cfg, seq: int) -> int:
    """fit_length before the model loads, from the run's options (as checkpoints.pad_multiple decides after)."""
    import torch

    from nb_helpers.fast.graphed_layers import padded_length

    fast = options_for(cfg)
    graphs = fast.graphs and fast.reentrant and cfg.graphs_wanted
    pads = torch.cuda.is_available() and (graphs or fast.pad_lengths)
    return padded_length(seq) if pads else seq


def prepare_trial(model, checkpointing: bool, offload: bool = False, graphs: bool = False,
                  no_recompute_layers: int = 0) -> None:
    """A candidate's checkpoints on the model: on or off, in CPU RAM, as CUDA graphs, the last layers kept."""
    from nb_helpers.fast.checkpoints import checkpoint_kwargs, set_checkpoint_offload

    use_checkpoint_choice(model, graphs=graphs, no_recompute_layers=no_recompute_layers if checkpointing else 0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(model))
        set_checkpoint_offload(model, offload)
    else:
        model.gradient_checkpointing_disable()


def trial_guard():
    """A context in which a CUDA-graph capture that runs out of memory raises instead of running eagerly."""
    from nb_helpers.fast.graphed_layers import out_of_memory_raises

    return out_of_memory_raises()


def end_trial() -> None:
    """Every graph and its memory pool dropped: training captures its own."""
    from nb_helpers.fast.graphed_layers import reset

    reset()
