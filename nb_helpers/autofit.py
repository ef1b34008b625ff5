"""Auto-fit: the micro-batch x accumulation, checkpointing, offload and CUDA graphs that fit the budget, keeping the
effective batch. The planner ranks the candidates from config.json alone (nb_helpers.plan.choose); each choice is
then confirmed by one real forward and backward at full length on the GPU, stepping down on out-of-memory.
Settings set by hand skip it; keep_graphs_within_budget then only drops CUDA graphs a budget cannot hold.
"""

from __future__ import annotations

import gc
import weakref

from nb_helpers import compat, distributed, fast
from nb_helpers.config import RunConfig
from nb_helpers.data import longest_row_tokens
from nb_helpers.plan.cards import machine_budget_gib, planning_context_gib

_FUSED_HEADS: weakref.WeakSet = weakref.WeakSet()  # models given TRL's fused LM head for the trial step


def training_length(cfg: RunConfig, longest_row: int, model=None) -> int:
    """The length auto-fit fits for: the longest training row (short rows, such as the shipped data's ~110 tokens,
    never fill max_length), at most max_length, padded as batches will be (fast.fit_length; before loading, from
    the run's options). The one answer for the panel before loading and for the run."""
    seq = min(cfg.max_length, longest_row)
    return fast.fit_length(model, seq) if model is not None else fast.planned_fit_length(cfg, seq)


def longest_training_row(cfg: RunConfig) -> int:
    """Tokens in cfg.train_file's longest row, chat template applied, before any weights load (the panel's length;
    the run measures the same rows with the same tokenizer)."""
    from nb_helpers.data import load_train_eval
    from nb_helpers.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(cfg, verbose=False).path, cfg.trust_remote_code)
    train_rows, _ = load_train_eval(cfg, tokenizer)  # the rows the run trains on, split off as the run splits them
    return longest_row_tokens(train_rows, tokenizer)


def fit_to_budget(run, verbose: bool = True) -> None:
    """Auto-fit for this process's share of the global batch. With several processes rank 0 alone tries the
    candidates on its GPU and every process takes its choice, so all run the same micro-batch x accumulation."""
    from nb_helpers.plan.planner import plan_for_config

    longest = longest_row_tokens(run.train_rows, run.tokenizer)
    if verbose and longest < run.cfg.max_length:
        print(f"[auto-fit] the longest training row has {longest} tokens (max_length {run.cfg.max_length}): "
              f"fitting for {longest}")
    seq = training_length(run.cfg, longest, run.model)
    context = planning_context_gib(run.cfg, run.summary.get("cuda_context_gib"))
    fitted = error = None
    if distributed.is_main():
        try:
            fitted = run_auto_fit(run.cfg, run.model, run.tokenizer, run.shape, context, verbose, seq=seq)
        except Exception as e:  # noqa: BLE001 - the other processes must hear of it, not wait for a choice
            error, fitted = e, f"{type(e).__name__}: {e}"
    fitted = distributed.broadcast(fitted)
    if error is not None:
        raise error
    if isinstance(fitted, str):
        raise RuntimeError(f"auto-fit failed on rank 0 ({fitted})")
    if not fitted.gradient_checkpointing:
        run.model.gradient_checkpointing_disable()
    adopt_choice(run.model, fitted)
    run.cfg = fitted
    run.prediction = plan_for_config(run.cfg.replace(max_length=seq), run.shape, context_gib=context)

def adopt_choice(model, fitted: RunConfig) -> None:
    """The checkpoint settings auto-fit chose, on this process's model (rank 0's choice reaches the others as a
    config): offload where the fast path installed it, CUDA graphs, and the layers not recomputed."""
    fast.use_checkpoint_choice(model, offload=fitted.offload_checkpoints, graphs=fitted.graphs_wanted,
                               no_recompute_layers=fitted.no_recompute_layers if fitted.gradient_checkpointing else 0)


def planned_fit(cfg: RunConfig, shape, seq: int, context_gib: float | None, gpu_total_gib: float | None,
                offload_allowed: bool, trial=None, log=None):
    """Auto-fit's choice for `cfg` at `seq` tokens, against the machine's one budget (cards.machine_budget_gib): the
    planner ranks the candidates and `trial` confirms each (None: the plan alone, which is what the panel shows
    before loading). The run and the panel both come here, so the panel says what trains."""
    from nb_helpers.plan.choose import auto_fit, fewer_recomputes_on
    from nb_helpers.plan.planner import plan_for_config
    from nb_helpers.plan.step_time import timing_gpu

    budget = machine_budget_gib(cfg, gpu_total_gib)
    if budget is None:
        raise ValueError("auto-fit needs a budget: a CUDA GPU, cfg.card or cfg.budget_gib")
    base = plan_for_config(cfg.replace(max_length=seq, budget_gib=budget), shape, context_gib=context_gib).inputs
    return auto_fit(shape, base, cfg.effective_batch, budget, trial=trial, log=log or (lambda *_: None),
                    offload_allowed=offload_allowed, gpu=timing_gpu(cfg),  # fastest on the run's card, or this GPU
                    fewer_recomputes=fewer_recomputes_on(cfg, shape))


SLIDER_SETTINGS = ("micro_batch_size", "grad_accum", "gradient_checkpointing")  # what the panel's sliders show


def chosen_settings(choice) -> dict:
    """A choice as RunConfig settings: the three the sliders show first, then the checkpoint details."""
    return dict(micro_batch_size=choice.batch, grad_accum=choice.accum,
                gradient_checkpointing=choice.gradient_checkpointing, offload_checkpoints=choice.offload,
                cuda_graphs=choice.graphs, no_recompute_layers=choice.no_recompute_layers)


def gpu_total_gib() -> float | None:
    """This machine's GPU memory in GiB as PyTorch reports it, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def run_auto_fit(cfg: RunConfig, model, tokenizer, shape, context_gib: float | None, verbose: bool = True,
                 seq: int | None = None) -> RunConfig:
    """Choose micro-batch x accumulation and GC within the machine's budget, keeping the effective batch; each
    choice is confirmed by one forward and backward at `seq` tokens (the longest training row, at most
    max_length), stepping down on OOM. CUDA only."""
    import torch

    from nb_helpers.plan.memory import memory_snapshot
    from nb_helpers.plan.dtypes import resolve_compute_dtype

    if shape is None:
        raise RuntimeError("auto_fit needs a Llama-family config.json the planner can read; set micro_batch_size "
                           "and grad_accum by hand instead")
    seq = min(seq or cfg.max_length, cfg.max_length)
    # the dtype this GPU trains in: an emulated card's capability sizes the plan, not the autocast (a bf16 run under
    # the GTX 1650's budget on a bigger GPU is still bf16; the trial ran fp16 autocast over bf16 weights and failed)
    dtype = getattr(torch, resolve_compute_dtype(cfg.compute_dtype))
    vocab_top = min(tokenizer.vocab_size, shape.vocab)

    def trial(option) -> float | None:
        try:
            trial_step(model, option.batch, seq, option.gradient_checkpointing, dtype, vocab_top, option.offload,
                       option.graphs, option.no_recompute_layers)
            torch.cuda.synchronize()
            return memory_snapshot()["device_used_gib"]
        finally:
            fast.end_trial()  # the trial's graphs (and their memory pool): training captures its own
            gc.collect()
            torch.cuda.empty_cache()

    choice = planned_fit(cfg, shape, seq, context_gib, gpu_total_gib(), fast.can_offload(model), trial=trial,
                         log=print if verbose else None)
    if not choice.gradient_checkpointing:
        model.gradient_checkpointing_disable()
    torch.cuda.reset_peak_memory_stats()
    return cfg.replace(**chosen_settings(choice))


def trial_step(model, batch: int, length: int, checkpointing: bool, dtype, vocab: int, offload: bool = False,
               graphs: bool = False, no_recompute_layers: int = 0) -> None:
    """One forward and backward at full length through the loss SFTTrainer uses (TRL's fused LM head), with a
    padded last row as real batches have; the gradients are dropped afterwards. With `graphs` the layers are
    captured as CUDA graphs, so the measured peak includes their memory pool; layers that keep their activations are
    captured at their second call (fast.graphed_layers.graphed_kept), so then the trial runs twice."""
    import torch

    no_recompute_layers = no_recompute_layers if checkpointing else 0
    fast.prepare_trial(model, checkpointing, offload, graphs, no_recompute_layers)
    model.train()
    device = next(p.device for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, vocab, (batch, length), device=device)
    mask = torch.ones_like(ids)
    if batch > 1:  # real micro-batches are padded, which costs an attention mask: the trial pays it too
        mask[-1, -min(16, length // 2):] = 0
    if model not in _FUSED_HEADS:
        compat.add_fused_lm_head(model.get_base_model())
        _FUSED_HEADS.add(model)
    try:
        with fast.trial_guard():  # a graphed candidate that does not fit must fail its trial, not run eagerly
            for _ in range(2 if graphs and no_recompute_layers else 1):
                with torch.autocast(device.type, dtype=dtype):
                    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                                fused_lm_head=True)
                out.loss.backward()
    finally:
        model.zero_grad(set_to_none=True)

def keep_graphs_within_budget(run, verbose: bool = True) -> None:
    """Settings chosen by hand (auto-fit weighs graphs itself): CUDA-graphed layers hold a memory pool, so where the
    planner puts the graphed run over the budget (or the card) and the eager one under it, this run goes eager.
    A hand-set run that left cuda_graphs unset runs eagerly (the lean path) and hears once what graphs would cost."""
    from nb_helpers.plan.choose import graphs_dropped_unless_they_fit

    cfg = run.cfg
    if cfg.auto_fit or not cfg.gradient_checkpointing:
        return
    if cfg.cuda_graphs is None:
        if verbose:
            say_graphs_cost(run)
        return
    if not cfg.cuda_graphs:
        return
    budget = machine_budget_gib(cfg, gpu_total_gib())  # auto-fit's and the panel's budget
    chosen = graphs_dropped_unless_they_fit(run.prediction, budget)
    if chosen is not run.prediction:
        if verbose:
            print(f"[plan] CUDA graphs off for this run: predicted {run.prediction.peak_gib:.2f} GiB with them, over "
                  f"{budget:.2f} GiB less the planner's margin; {chosen.peak_gib:.2f} GiB with eager layers (slower; "
                  "auto_fit weighs both)")
        run.cfg, run.prediction = cfg.replace(cuda_graphs=False), chosen

def say_graphs_cost(run) -> None:
    """One line for a hand-set run on the lean path: what CUDA-graphed layers would cost it, and how to ask."""
    from nb_helpers.plan.planner import plan_for_config

    graphed = plan_for_config(run.cfg.replace(cuda_graphs=True), run.shape,
                              context_gib=planning_context_gib(run.cfg, run.summary.get("cuda_context_gib")))
    if not graphed.components.get("graphs"):  # NB_FASTPATH turned them off, or checkpoints they cannot replay
        return
    extra = graphed.peak_gib - run.prediction.peak_gib
    print(f"[plan] layers run eagerly (settings set by hand use no more memory than the recipe); "
          f"cuda_graphs=True replays them as CUDA graphs, several times faster for {extra:.2f} GiB more "
          f"(predicted {graphed.peak_gib:.2f} GiB), and auto_fit=True weighs both")
