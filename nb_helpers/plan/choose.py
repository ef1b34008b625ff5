"""Auto-fit: the fastest micro-batch x accumulation (gradient checkpointing on or off, checkpoints on the card or in
CPU RAM, layers eager or as CUDA graphs) that the planner (nb_helpers.plan.planner) predicts to fit a budget, with the
same effective batch; and the graphs a hand-set run drops when they do not fit."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nb_helpers.plan.architecture import Shape, recomputed_layers
from nb_helpers.plan.planner import FIT_MARGIN, Plan, PlanInput, plan, plan_for_config

# Ranking: a step costs accum x (fixed launch/Python overhead) + tokens x (compute, x GC_COMPUTE_FACTOR with
# checkpointing). On 4 GB cards and small models the fixed part dominates (the reference recipe keeps an H200 about 5%
# busy), so fewer, larger micro-batches win first; checkpointing is dropped when it still fits.
OVERHEAD_TOKENS = 1024  # a micro-step's fixed cost, in tokens of compute (heuristic; the trial run confirms fit)
# The course's one figure for what gradient checkpointing costs: up to 50% more compute per step. Checkpointing runs
# each layer's forward a second time in the backward. With the base frozen, the backward computes the gradients of the
# activations (one matmul per linear layer, as many FLOPs as the forward's) but none for the base's weights (LoRA's
# cost about 2r/hidden of that), so a step is about 2 forwards without checkpointing and 3 with it. (4/3 is the rule for full
# fine-tuning, whose backward is 2 forwards.) An upper bound: the step's other work (optimizer, host overhead, the LM
# head, which is not recomputed) dilutes it; the 2-core CPU measured 12-22% (bench/RESULTS.md).
GC_COMPUTE_FACTOR = 3 / 2
OFFLOAD_FACTOR = 1.02  # the copies to and from CPU RAM: a little dearer than keeping checkpoints on the card (and
# they hold pinned CPU RAM), so a candidate that offloads must be 2% faster to be chosen
KEPT_FACTOR = 1.02  # layers kept unrecomputed hold their activations up to the budget's edge: a candidate that keeps
# any must be 2% faster to be chosen (the GTX 1650 at 8 x 512: 20 layers kept at 4 x 2 were predicted 0.5% faster
# than 2 x 4 without checkpointing, for 0.86 GiB more)


@dataclass
class Candidate:
    batch: int
    accum: int
    gradient_checkpointing: bool
    predicted_gib: float
    relative_step_cost: float
    offload: bool = False
    graphs: bool = False
    predicted_step_s: float | None = None  # on the GPU ranked for (nb_helpers.plan.step_time), where one was
    gpu_name: str | None = None
    no_recompute_layers: int = 0  # with GC: the last layers that keep their activations (RunConfig)

    def describe(self) -> str:
        gc = ("on, checkpoints in CPU RAM" if self.offload else "on") if self.gradient_checkpointing else "off"
        if self.gradient_checkpointing and self.no_recompute_layers:
            gc += f", the last {self.no_recompute_layers} layers not recomputed"
        graphs = ", layers as CUDA graphs" if self.graphs and self.gradient_checkpointing else ""
        time = f", ~{self.predicted_step_s:.2f} s/step on the {self.gpu_name}" if self.predicted_step_s else ""
        return (f"micro-batch {self.batch} x accumulation {self.accum}, gradient checkpointing {gc}{graphs} "
                f"(predicted {self.predicted_gib:.2f} GiB{time})")


def most_layers_kept(shape: Shape, inp: PlanInput, limit_gib: float) -> int:
    """The most of the last layers that may keep their activations (no_recompute_layers) with the plan within
    `limit_gib`: at most all but one (all of them is checkpointing off, a candidate of its own)."""
    def fits(kept: int) -> bool:
        return plan(shape, PlanInput(**{**asdict(inp), "no_recompute_layers": kept})).peak_gib <= limit_gib

    low, high = 0, shape.layers - 1
    while low < high:  # the memory grows with every layer kept
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def candidates(shape: Shape, base: PlanInput, effective_batch: int, budget_gib: float,
               margin: float = FIT_MARGIN, offload_allowed: bool = True, gpu: dict | None = None,
               fewer_recomputes: bool = False) -> list[Candidate]:
    """Every micro-batch x accumulation with the same effective batch, GC off, on, and on with checkpoints in CPU
    RAM (where `offload_allowed`), each checkpointed one also as CUDA graphs (with `base.graphs`), predicted to fit
    the budget (less the margin), fastest first. With `gpu` (nb_helpers.plan.step_time.timing_gpu) by the predicted
    step time there: on a compute-bound card, no recompute beats graphs; on the H200, host-bound, graphs and fewer
    micro-steps win. Without one (a GPU the time model does not know), by the older rule: fewer micro-steps first
    (each costs the host a fixed overhead), then graphed before eager, then the compute each needs. With
    `fewer_recomputes`, each checkpointed candidate also comes with as many of its last layers unrecomputed as the
    budget holds, and half as many (a step down if the trial step finds the most too many)."""
    modes = [(False, False), (True, False)] + ([(True, True)] if offload_allowed else [])
    modes = [(gc, offload, False) for gc, offload in modes] + \
        ([(True, offload, True) for gc, offload in modes if gc] if base.graphs else [])
    out, limit = [], budget_gib * (1 - margin)
    for batch in [b for b in range(1, effective_batch + 1) if effective_batch % b == 0]:
        for gc, offload, graphs in modes:
            inp = PlanInput(**{**asdict(base), "batch": batch, "accum": effective_batch // batch,
                               "gradient_checkpointing": gc, "offload": offload, "graphs": graphs,
                               "no_recompute_layers": 0})
            if plan(shape, inp).peak_gib > limit:
                continue
            most = most_layers_kept(shape, inp, limit) if gc and fewer_recomputes else 0
            for kept in sorted({most, most // 2, 0}, reverse=True):
                out.append(_candidate(shape, PlanInput(**{**asdict(inp), "no_recompute_layers": kept}), gpu))
    if gpu is not None:
        return sorted(out, key=lambda c: (c.relative_step_cost, c.predicted_gib))
    return sorted(out, key=lambda c: (c.accum, not c.graphs, c.relative_step_cost, c.predicted_gib))


def fewer_recomputes_on(cfg, shape: Shape) -> bool:
    """Whether auto-fit may keep the last layers unrecomputed for this run's config (the engine's choice, plan.engine):
    what the planner and the widgets say auto-fit will train, as training decides it."""
    from nb_helpers.plan.cards import budget_of
    from nb_helpers.plan.engine import engine_view

    return engine_view(cfg, shape, budget_of(cfg)).fewer_recomputes


def _candidate(shape: Shape, inp: PlanInput, gpu: dict | None) -> Candidate:
    """One candidate, with its predicted peak and its cost: the predicted step on `gpu`, else the older rule's."""
    from nb_helpers.plan.step_time import predict_step_time

    predicted, gc, kept = plan(shape, inp).peak_gib, inp.gradient_checkpointing, inp.no_recompute_layers
    margins = (OFFLOAD_FACTOR if inp.offload else 1.0) * (KEPT_FACTOR if gc and kept else 1.0)
    if gpu is not None:
        seconds = predict_step_time(shape, inp, gpu).step_s  # offload: pinned CPU RAM, so only if faster
        return Candidate(inp.batch, inp.accum, gc, predicted, seconds * margins, inp.offload, inp.graphs, seconds,
                         gpu["name"], kept)
    recomputed = recomputed_layers(shape, inp) / shape.layers
    factor = (1 + (GC_COMPUTE_FACTOR - 1) * recomputed) * margins
    cost = inp.accum * (OVERHEAD_TOKENS + inp.batch * inp.seq * factor)
    return Candidate(inp.batch, inp.accum, gc, predicted, cost, inp.offload, inp.graphs, no_recompute_layers=kept)


def auto_fit(shape: Shape, base: PlanInput, effective_batch: int, budget_gib: float, trial=None, log=print,
             margin: float = FIT_MARGIN, offload_allowed: bool = True, gpu: dict | None = None,
             fewer_recomputes: bool = False) -> Candidate:
    """Pick the fastest micro-batch x accumulation (and GC on/off) that fits, keeping the effective batch; fastest
    on `gpu` by the time model where one is given (see candidates).

    `trial(candidate)` runs one forward and backward at full length and returns the peak GiB it measured, or
    raises torch.OutOfMemoryError (any exception named *OutOfMemoryError); then the next candidate is tried and
    the step down is reported. Without a trial the prediction alone decides."""
    options = candidates(shape, base, effective_batch, budget_gib, margin, offload_allowed, gpu, fewer_recomputes)
    if not options:
        smallest = plan(shape, PlanInput(**{**asdict(base), "batch": 1, "accum": effective_batch,
                                            "gradient_checkpointing": True, "offload": offload_allowed,
                                            "graphs": False}))
        raise MemoryError(f"nothing fits {budget_gib:.2f} GiB: even micro-batch 1 with gradient checkpointing is "
                          f"predicted at {smallest.peak_gib:.2f} GiB ({smallest.peak_phase}). Lower max_length "
                          f"(now {base.seq}), the LoRA rank or targets, or pick a smaller model")
    for number, option in enumerate(options):
        if trial is None:
            log(f"[auto-fit] chose {option.describe()} for effective batch {effective_batch} in {budget_gib:.2f} GiB")
            return option
        try:
            measured = trial(option)
        except Exception as e:  # noqa: BLE001 - only out-of-memory errors step down
            if "OutOfMemoryError" not in type(e).__name__:
                raise
            following = options[number + 1].describe() if number + 1 < len(options) else "nothing left"
            log(f"[auto-fit] {option.describe()} ran out of memory in the trial step; stepping down to {following}")
            continue
        if measured is not None and measured > budget_gib:
            log(f"[auto-fit] {option.describe()} measured {measured:.2f} GiB in the trial step, over the budget; "
                "stepping down")
            continue
        log(f"[auto-fit] chose {option.describe()}" + (f", trial step measured {measured:.2f} GiB" if measured else "")
            + f"; effective batch stays {effective_batch}")
        return option
    raise MemoryError(f"every candidate ran out of memory in its trial step within {budget_gib:.2f} GiB; lower "
                      f"max_length (now {base.seq}) or the LoRA rank")


def graphs_dropped_unless_they_fit(planned: Plan, budget_gib: float, margin: float = FIT_MARGIN) -> Plan:
    """What a run with hand-set knobs uses: its graphed plan where that fits the budget (less the margin), else the
    same run with eager layers (graphs hold a memory pool; training.keep_graphs_within_budget switches them off)."""
    if planned.components.get("graphs") and planned.peak_gib > budget_gib * (1 - margin):
        eager = PlanInput(**{**asdict(planned.inputs), "graphs": False})
        return plan(planned.shape, eager, budget_gib=planned.budget_gib)
    return planned


def oom_advice(cfg, step: int | None, shape=None) -> str:
    """Which knob to turn, and by how much; with the model's shape, each change comes with the planner's peak."""
    changes = []
    if cfg.micro_batch_size > 1:
        changes.append((f"micro_batch_size {cfg.micro_batch_size} -> {cfg.micro_batch_size // 2} with grad_accum "
                        f"{cfg.grad_accum} -> {cfg.grad_accum * 2} (same effective batch)",
                        dict(micro_batch_size=cfg.micro_batch_size // 2, grad_accum=cfg.grad_accum * 2)))
    if not cfg.gradient_checkpointing:
        changes.append(("gradient_checkpointing=True (activations recomputed instead of stored)",
                        dict(gradient_checkpointing=True)))
    changes.append((f"max_length {cfg.max_length} -> {max(64, cfg.max_length // 2)}",
                    dict(max_length=max(64, cfg.max_length // 2))))
    tips = []
    now = None
    for text, change in changes:
        if shape is not None:
            try:
                now = now or plan_for_config(cfg, shape)
                after = plan_for_config(cfg.replace(**change), shape)
                text += f" [planner: {now.peak_gib:.2f} -> {after.peak_gib:.2f} GiB]"
            except Exception:  # noqa: BLE001 - advice without numbers beats no advice
                pass
        tips.append(text)
    fit = " `python -m nb_helpers plan` checks a config before loading anything; auto_fit=True picks one that fits." \
        if shape is not None else ""
    return (f"CUDA ran out of memory at step {step}. Nothing is lost: metrics.jsonl and the last checkpoint are in "
            f"the run folder, and GPU memory has been freed. Try, in this order: " + "; ".join(tips) + "." + fit)
