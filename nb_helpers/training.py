"""Training as named steps. Notebook 03 calls them one by one and writes the trainer out between them;
train(cfg) composes the same steps for `python -m nb_helpers train`, the tests and `make run`:

    run = prepare_run(cfg)                 # settings, data, budget, memory plan: before any weights load
    load_for_training(run)                 # the 4-bit base + LoRA of notebooks 01-02; auto-fit on a GPU
    open_run_folder(run)                   # runs/<name>/ with config.json; metrics.jsonl fills as it trains
    trainer = build_trainer(run)           # SFTTrainer(model, sft_config(run), data, tokenizer, callbacks)
    evaluate_before(run, trainer)          # the base model's task score and eval loss
    with guard_training(run, trainer):     # Ctrl-C, out of memory, full disk: a message, nothing lost
        trainer.train(resume_from_checkpoint=run.checkpoint)
    finish_run(run, trainer)               # NaN restore, adapter/, second eval, summary.json, training.png

The run folder ends with config.json, before_training.json, metrics.jsonl, checkpoints/, adapter/, predictions.jsonl,
training.png and summary.json; run.lock keeps a second process out while one trains it (nb_helpers.faults).

Under `accelerate launch` (several processes, nb_helpers.distributed) every process runs every step on its own GPU;
rank 0 alone names the run folder and writes into it, and alone scores the task (generation); the others wait.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nb_helpers import distributed, fast
from nb_helpers.autofit import fit_to_budget, keep_graphs_within_budget
from nb_helpers.config import ConfigError, RunConfig, check_environment
from nb_helpers.data import load_task_rows, load_train_eval, to_dataset
from nb_helpers.distributed import resume_note, split_over_processes
from nb_helpers.plan.dtypes import resolve_compute_dtype
from nb_helpers.plan.step_time import predicted_time
from nb_helpers.lora import attach_lora, parameter_counts
from nb_helpers.plan.memory import record_nvml_baseline
from nb_helpers.metrics import MetricsCallback, read_metrics
from nb_helpers.models import ModelChoice, load_4bit, load_tokenizer, resolve_model
from nb_helpers.recovery import (LastGoodAdapter, checkpoint_on_interrupt, keep_before_training, keep_good_adapter,
                                 last_checkpoint, restore_before_training, split_metrics_at, stop_after_oom,
                                 stopped_outside_training)
from nb_helpers.runs import (check_run_name, latest_target, mark_latest, new_run_dir, read_json, resolve_run,
                             runs_root, write_jsonl)
from nb_helpers.faults.checkpoints import checkpoint_to_resume, staged_checkpoints
from nb_helpers.faults.resume import (StopIfTrained, TrainingDone, evaluation_missed, keep_adapter_dtypes,
                                      training_finished)
from nb_helpers.faults.run_lock import release_run_lock, take_run_lock
from nb_helpers.faults.signals import EXIT_CODE, Terminated, sigterm_as_interrupt
from nb_helpers.faults.write_errors import check_writable, stop_cleanly
from nb_helpers.summary import BEFORE_TRAINING_KEYS, package_versions, print_summary, write_summary
from nb_helpers.task_metric import base_answers_dir, evaluate_task
from nb_helpers.trainer_setup import adapt_trainer, progress_printer, sft_config


@dataclass
class TrainingRun:
    """What the steps hand each other. Notebook 03 holds one as `run`; `run.cfg` is the config that trains (a
    resume loads the run's own, preflight may switch bf16 to fp16, auto-fit picks the batch)."""

    cfg: RunConfig
    choice: ModelChoice | None = None
    tokenizer: object = None
    train_rows: list = field(default_factory=list)
    eval_rows: list = field(default_factory=list)  # the eval loss's rows (max_eval_samples)
    task_rows: list = field(default_factory=list)  # the task metric's prompts (task_eval_samples)
    summary: dict = field(default_factory=dict)  # what summary.json adds to the measured keys (nb_helpers.summary)
    resume_dir: Path | None = None
    checkpoint: str | None = None  # the checkpoint a resumed run continues from
    training_done: bool = False  # that checkpoint is at the last step: only the final scoring and summary are missing
    shape: object = None  # the planner's view of config.json (None for models it cannot read)
    prediction: object = None
    model: object = None
    run_dir: Path | None = None
    metrics: MetricsCallback | None = None
    last_good: LastGoodAdapter | None = None
    base_answers: dict | None = None
    oom_step: int | None = None
    finished: bool = False  # finish_run ran: training this run again would append to a finished run folder
    previous_latest: Path | None = None  # where runs/latest pointed before this run's folder was made
    trained_here: bool = False  # guard_training was entered: a second entry is the training cell run again
    world_size: int = 1  # processes training together (accelerate launch); cfg's batch is each one's share
    exit_code: int | None = None  # SIGTERM: finish_run saves what Ctrl-C would, then the process exits with this

    @property
    def global_batch(self) -> int:
        return self.cfg.effective_batch * self.world_size

    @property
    def text_rows(self) -> bool:
        return bool(self.train_rows) and "text" in self.train_rows[0]

    @property
    def callbacks(self) -> list:
        return [self.metrics] if self.metrics is not None else []


# --- the steps, in order ----------------------------------------------------------------------------------------

def prepare_run(cfg: RunConfig, resume_from: str | Path | None = None, verbose: bool = True) -> TrainingRun:
    """Everything that can be wrong with the settings or the data, found before the weights load. `resume_from`
    continues an interrupted run folder from its last checkpoint, with the config it was started with."""
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"prepare_run/train({type(cfg).__name__}): give a RunConfig, e.g. default_config() or "
                          "RunConfig.load('config.json')")
    resume_dir = resolve_run(resume_from) if resume_from else None
    try:
        return prepare_checked(cfg, resume_dir, verbose)
    except BaseException:  # a bad setting, a stop: a resumed run's folder is not left locked (a notebook kernel lives on)
        if resume_dir is not None:
            release_run_lock(resume_dir)
        raise


def resumed_config(resume_dir: Path) -> RunConfig:
    """The config a run folder was started with, once its summary says there is something left to resume."""
    if not resume_dir.is_dir():
        raise ConfigError(f"--resume {resume_dir}: no such run folder; give a folder under runs/ (runs/latest is the "
                          "newest)")
    cfg = RunConfig.load(resume_dir / "config.json")
    try:
        status = read_json(resume_dir / "summary.json")
    except (ValueError, OSError) as e:
        raise ConfigError(f"{resume_dir / 'summary.json'} cannot be read as JSON ({str(e)[:80]}): it was edited or "
                          "damaged. Delete it (a resume writes it again) and resume again") from None
    if isinstance(status, dict) and status.get("status") == "completed":
        raise ConfigError(f"{resume_dir} completed its training: there is nothing to resume (its adapter and "
                          "summary would be rewritten). Set RESUME = None (or leave out --resume) to start a "
                          "new run")
    return cfg


def prepare_checked(cfg: RunConfig, resume_dir: Path | None, verbose: bool) -> TrainingRun:
    import torch

    from nb_helpers.preflight import preflight

    check_environment()
    checkpoint = None
    if resume_dir is not None:
        cfg = resumed_config(resume_dir)
        check_writable(cfg, resume_dir)  # before the lock: a read-only run folder cannot hold run.lock either
        take_run_lock(resume_dir)  # before anything loads: a second process resuming this run stops here
        checkpoint = checkpoint_to_resume(resume_dir, set_aside=distributed.is_main())
    cfg = RunConfig.from_dict(cfg.to_dict()).validate()  # the run's own copy: a slider moved later is not trained
    check_run_name(cfg.run_name if resume_dir is None else None)  # a resumed run keeps the folder it has
    check_writable(cfg, resume_dir)
    world = distributed.world_size()
    done = training_finished(checkpoint)
    if done and verbose:
        print(f"[run] {checkpoint.name} is this run's last step: training had finished before the stop, so no step "
              "is trained again; only what is missing runs (the final scoring and the summary)")
    elif checkpoint is not None and verbose:
        print(resume_note(checkpoint, world))
    cfg = split_over_processes(cfg, world, verbose)  # before anything is sized: auto-fit and the plan are per GPU
    summary: dict = {}  # apply_budget adds the budget, from budget_gib or the card
    if torch.cuda.is_available():
        record_nvml_baseline(distributed.local_rank())  # before this process creates a context
        expandable = fast.use_expandable_segments(fast.FastOptions.for_run(cfg))  # before the allocator starts
        if expandable is not None:
            summary["expandable_segments"] = expandable
    distributed.init()  # several processes: the process group, and this process's GPU made current
    with distributed.main_first():  # rank 0 fetches or converts the model into the cache alone
        choice = resolve_model(cfg, verbose=verbose)
    tokenizer = load_tokenizer(choice.path, cfg.trust_remote_code)
    cfg = preflight(cfg, choice, verbose)
    train_rows, eval_rows = load_train_eval(cfg, tokenizer)
    summary.update(compute_dtype=resolve_compute_dtype(cfg.compute_dtype), versions=package_versions())
    run = TrainingRun(cfg, choice, tokenizer, train_rows, eval_rows, load_task_rows(cfg, tokenizer), summary,
                      resume_dir, str(checkpoint) if checkpoint else None, training_done=done, world_size=world)
    apply_budget(run)
    predict_memory(run, verbose)
    return run


def apply_budget(run: TrainingRun) -> None:
    """Cap this process at its budget on its own GPU, CUDA context included (budget_gib, else the card's: then the
    allocator gets what it would on that card), and check the 4-bit weights fit under it. Per GPU."""
    import torch

    from nb_helpers.plan.cards import budget_of, run_card
    from nb_helpers.preflight import check_budget_fits

    budget_gib, card = budget_of(run.cfg), run_card(run.cfg)
    run.summary.update(budget_gib=budget_gib, card=run.cfg.card)
    if torch.cuda.is_available() and budget_gib:
        from nb_helpers.plan.budget import enforce_budget

        budget = enforce_budget(budget_gib, distributed.local_rank(), card.context_gib if card else None)
        run.summary["cuda_context_gib"] = budget.context_gib
        print(f"[budget] {card.describe(run.cfg.desktop_on_card) + ': ' if card else ''}{budget.describe()}")
        check_budget_fits(run.cfg, run.choice, budget.allocator_cap_gib)
    elif budget_gib:
        print("[budget] budget_gib and card cap nothing on the CPU (no device memory); plans still use them")


def predict_memory(run: TrainingRun, verbose: bool = True) -> None:
    """The planner's peak for this config, from config.json alone; a model it cannot read still trains."""
    import torch

    from nb_helpers.plan.cards import planning_context_gib
    from nb_helpers.plan.planner import load_shape, plan_for_config

    try:
        run.shape = load_shape(run.choice.path)
        run.prediction = plan_for_config(run.cfg, run.shape,
                                         context_gib=planning_context_gib(run.cfg, run.summary.get("cuda_context_gib")))
    except Exception as e:  # noqa: BLE001 - a non-Llama model the planner cannot read still trains
        if verbose:
            print(f"[plan] no prediction for this model ({e})")
        return
    if torch.cuda.is_available():
        keep_graphs_within_budget(run, verbose)
    if verbose:
        where = f"for the {run.cfg.card} card: " if run.cfg.card else "" if torch.cuda.is_available() else \
            "no GPU here; for a GTX 1650-class card (compute capability 7.5): "
        print(f"[plan] {where}{run.prediction.verdict()}, in {run.prediction.peak_phase}; "
              "`python -m nb_helpers plan` shows the breakdown")


def load_for_training(run: TrainingRun, verbose: bool = True):
    """The 4-bit base with LoRA attached (notebooks 01-02), and with auto_fit the batch that fits the budget."""
    import torch

    cfg, cuda = run.cfg, torch.cuda.is_available()
    fitting = cfg.auto_fit and run.resume_dir is None and cuda  # a resumed run keeps what was chosen for it
    if cfg.auto_fit and not cuda and verbose:
        print("[auto-fit] needs a CUDA GPU; keeping micro_batch_size and grad_accum as set")
    run.model = attach_lora(load_4bit(cfg, run.choice), cfg.replace(gradient_checkpointing=True) if fitting else cfg)
    if fitting:
        fit_to_budget(run, verbose)
    if run.prediction is not None:
        run.summary.update(predicted_peak_gib=run.prediction.peak_gib, predicted_phase=run.prediction.peak_phase,
                           predicted_components_gib={k: v / 2**30 for k, v in run.prediction.components.items()},
                           **predicted_time(run.prediction, run.cfg, verbose))
    trainable, total = parameter_counts(run.model)
    run.summary["trainable_params"] = trainable
    run.summary["fast_levers"] = fast.levers_ran(run.model, run.cfg, run.summary.get("expandable_segments"))
    if verbose:
        print(f"[lora] {run.cfg.summary_line()}")
        print(f"[lora] trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%)")
        print(fast.levers_line(run.model, run.cfg, run.summary["fast_levers"]))
    return run.model


def open_run_folder(run: TrainingRun, listeners=(), verbose: bool = True) -> Path:
    """A new runs/<name>/ with config.json (or the resumed one, its metrics cut back to the checkpoint), and the
    callback that writes metrics.jsonl; `listeners` get each record too (the live plot). With several processes
    rank 0 names and writes the folder and the others are told its path."""
    main = distributed.is_main()
    if run.resume_dir is not None:
        run.run_dir = run.resume_dir
        if main:
            split_metrics_at(run.run_dir, int(run.checkpoint.rsplit("-", 1)[1]))
        print(f"[run] resuming {run.run_dir} from {Path(run.checkpoint).name}")
    else:
        run_dir = None
        if main:
            run.previous_latest = latest_target(runs_root(run.cfg))
            run_dir = new_run_dir(run.cfg, run.choice.name)
            take_run_lock(run_dir)
            saved_config(run).save(run_dir / "config.json", record={"fast_levers": run.summary.get("fast_levers")})
        run.run_dir = distributed.broadcast(run_dir)
    if main:
        mark_latest(run.run_dir)
    run.last_good = LastGoodAdapter(run.model)
    listeners = [*listeners, run.last_good]
    if verbose:
        print(f"[run] {run.run_dir}")
        total = run.cfg.max_steps if run.cfg.max_steps > 0 else \
            int(run.cfg.num_train_epochs * -(-len(run.train_rows) // run.global_batch))
        listeners.append(progress_printer(total, every=max(1, total // 20)))
    run.metrics = MetricsCallback(run.run_dir / "metrics.jsonl", listeners=listeners, write=main,
                                  fields={"world_size": run.world_size, "global_batch": run.global_batch})
    if run.checkpoint is not None:  # what the first start measured up to the checkpoint: its evaluations included
        step = int(run.checkpoint.rsplit("-", 1)[1])
        run.metrics.records.extend(r for r in read_metrics(run.run_dir / "metrics.jsonl") if r["step"] <= step)
    return run.run_dir


def saved_config(run: TrainingRun) -> RunConfig:
    """What config.json keeps: the one-process equivalent of what each process runs (same global batch), so the
    file trains the same global batch however many processes load it (a resume, a rerun on one GPU)."""
    micro, accum = distributed.one_process_equivalent(run.cfg.micro_batch_size, run.cfg.grad_accum, run.world_size)
    return run.cfg.replace(micro_batch_size=micro, grad_accum=accum)


def build_trainer(run: TrainingRun):
    """SFTTrainer over the run's model and data, as notebook 03 writes it out, then adapt_trainer."""
    from trl import SFTTrainer

    trainer = SFTTrainer(
        model=run.model,
        args=sft_config(run),
        train_dataset=to_dataset(run.train_rows),
        eval_dataset=to_dataset(run.eval_rows) if run.eval_rows else None,
        processing_class=run.tokenizer,
        callbacks=run.callbacks,
    )
    adapt_trainer(run, trainer)
    return trainer


def evaluate_before(run: TrainingRun, trainer, verbose: bool = True) -> dict:
    """The base model's task score and eval loss: the adapter starts with B = 0, so the model right now answers
    exactly like the base model; the numbers go to before_training.json at once. A resumed run takes its first start's
    (a run from before that file measures them again: until trainer.train() loads the checkpoint, this is still the
    base model). With several processes rank 0 alone scores the task; the eval loss is computed by all of them, each
    on its share of the rows."""
    if run.checkpoint is None or not restore_before_training(run):
        if run.task_rows and distributed.is_main():
            cache = base_answers_dir(run.cfg, run.choice, run.model, run.tokenizer, run.cfg.max_new_tokens)
            run.base_answers = evaluate_task(run.model, run.tokenizer, run.task_rows, run.cfg.max_new_tokens,
                                             label="scoring the base model", cache=cache)
            run.summary.update(task_metric=run.base_answers["metric"], task_base=run.base_answers["score"])
        distributed.wait()
        if run.eval_rows:
            if verbose:
                print(f"[eval] measuring the base model's eval loss on {len(run.eval_rows)} held-out rows", flush=True)
            run.summary["eval_loss_before"] = trainer.evaluate()["eval_loss"]
        if distributed.is_main():
            keep_before_training(run)
    return {k: run.summary.get(k) for k in BEFORE_TRAINING_KEYS}


@contextmanager
def guard_training(run: TrainingRun, trainer):
    """Around trainer.train(): Ctrl-C or SIGTERM writes a checkpoint at the last finished step and says how to
    resume; an out-of-memory error is noted for finish_run, which reports it once the error's traceback (which holds
    the activations) is gone; a failed write (full disk, read-only, permission) marks the summary "save failed" and
    says what to do. A checkpoint counts only once complete (nb_helpers.faults.checkpoints). Other errors pass."""
    import torch

    train_again(run)
    run.trained_here = True
    resuming = resume_exactly(run, trainer)
    with staged_checkpoints(trainer, run.run_dir):
        try:
            with sigterm_as_interrupt(), stop_cleanly(run, "a checkpoint or a metrics line"):
                yield
        except TrainingDone as done:
            print(f"[run] {done}: no step trained again", flush=True)
        except KeyboardInterrupt as stop:
            run.summary["status"] = "interrupted"
            run.exit_code = EXIT_CODE if isinstance(stop, Terminated) else None
            checkpoint_on_interrupt(trainer, run.run_dir)
        except torch.OutOfMemoryError:
            run.oom_step = trainer.state.global_step
        finally:
            for callback in resuming:
                trainer.remove_callback(callback)
            trainer.args.eval_on_start = False


def train_again(run: TrainingRun) -> None:
    """The training cell run again on the same `run` (a notebook). After an interrupt, with or without the later cells
    run, it continues from the interrupt's checkpoint, exactly (it restarted at step 1 from the trained weights and
    metrics.jsonl held steps 1, 2, 3, 1, 2, 3 ...); a finished run, or one whose training ran to its end, is refused."""
    status = run.summary.get("status")
    if run.finished and status != "interrupted":
        raise RuntimeError(f"this run is finished ({run.run_dir}): training it again would append to it. To train "
                           "with the sliders' current settings, re-run the notebook from \"Check first, then load\" "
                           "(section 4): that starts a new run folder")
    if not run.trained_here:
        return
    if status != "interrupted":
        raise RuntimeError(f"this run's training already ran ({run.run_dir}): training it again would repeat its "
                           "steps. Run the next cell (finish_run), or re-run the notebook from \"Check first, then "
                           "load\" (section 4) to start a new run")
    checkpoint = last_checkpoint(run.run_dir)
    if checkpoint is None:
        raise RuntimeError(f"{run.run_dir} was interrupted before any checkpoint was complete: there is nothing to "
                           "continue from. Re-run the notebook from \"Check first, then load\" (section 4) to start "
                           "a new run")
    if run.finished:  # the later cells ran: finish_run let go of the folder
        take_run_lock(run.run_dir)
        run.finished = False
    step = int(checkpoint.name.rsplit("-", 1)[1])
    run.metrics.close()
    split_metrics_at(run.run_dir, step)
    run.metrics.records[:] = [r for r in run.metrics.records if r["step"] <= step]
    run.checkpoint, run.exit_code = str(checkpoint), None
    run.summary.pop("status", None)
    print(f"[run] continuing this run from {checkpoint.name}, where it was interrupted: the steps an uninterrupted run "
          "would have trained, each once. Run the cells after this one again when it ends", flush=True)


def resume_exactly(run: TrainingRun, trainer) -> list:
    """A resumed run continues as the uninterrupted one would have (nb_helpers.faults.resume): the adapter loaded in
    the dtypes it trains in, no step past the last, and an evaluation a stop cut short done first. Returns the
    callbacks it added, for guard_training to take off again."""
    if run.checkpoint is None:
        return []
    keep_adapter_dtypes(trainer.model)
    callbacks = [StopIfTrained()]
    for callback in callbacks:
        trainer.add_callback(callback)
    if evaluation_missed(run):
        print(f"[run] the evaluation at step {run.checkpoint.rsplit('-', 1)[1]} was cut short by the stop: it runs "
              "first", flush=True)
        trainer.args.eval_on_start = True
    return callbacks


def finish_run(run: TrainingRun, trainer, verbose: bool = True) -> Path:
    """After trainer.train(): report an out-of-memory stop, keep the last good adapter after a NaN, save adapter/,
    measure the tuned model, and write summary.json and training.png, then let go of the run folder's lock. Returns
    the run folder. With several processes rank 0 writes; every process returns once the folder is complete. After
    a SIGTERM the process exits (143) once all is saved."""
    if run.finished:
        return run.run_dir  # already finished (a re-run cell): nothing to save again
    run.finished = True
    try:
        if run.oom_step is not None:
            stop_after_oom(run, trainer)
        with stop_cleanly(run, "the adapter, predictions.jsonl, summary.json or training.png"):
            keep_good_adapter(run)
            if run.summary.get("status", "completed") == "completed":
                evaluate_after(run, trainer)
            run.metrics.close()
            record_processes(run)
            if distributed.is_main():
                summary = write_summary(run.run_dir, run.choice.name, run.summary)
                save_plots(run.run_dir)
                if verbose:
                    print_summary(summary)
    finally:
        release_run_lock(run.run_dir)
    distributed.wait()
    if run.exit_code is not None:
        raise SystemExit(run.exit_code)
    return run.run_dir


# --- what finish_run does --------------------------------------------------------------------------------------

def record_processes(run: TrainingRun) -> None:
    """world_size and the global batch for summary.json; with several processes, each one's peak device memory
    (every process takes part: the peaks are gathered to rank 0)."""
    run.summary.update(world_size=run.world_size, global_batch=run.global_batch,
                       per_process_batch=[run.cfg.micro_batch_size, run.cfg.grad_accum])
    if run.world_size > 1:
        peak = max((r["device_used_gib"] for r in run.metrics.records if r.get("device_used_gib") is not None),
                   default=None)
        run.summary["peak_vram_gib_per_process"] = distributed.gather(peak)


def evaluate_after(run: TrainingRun, trainer) -> None:
    """The tuned model's eval loss and task score; predictions.jsonl puts base and tuned answers side by side."""
    if run.eval_rows:
        evals = [r for r in run.metrics.records if "eval_loss" in r]
        already = evals and evals[-1]["step"] == trainer.state.global_step  # eval_steps hit the last step
        run.summary["eval_loss_after"] = evals[-1]["eval_loss"] if already else trainer.evaluate()["eval_loss"]
    if run.task_rows and distributed.is_main():
        tuned = evaluate_task(run.model, run.tokenizer, run.task_rows, run.cfg.max_new_tokens,
                              label="scoring the tuned model")
        run.summary["task_tuned"] = tuned["score"]
        if run.base_answers is not None:
            write_jsonl(run.run_dir / "predictions.jsonl",
                        [{"base": b["prediction"], "base_score": b["score"], **t}
                         for b, t in zip(run.base_answers["predictions"], tuned["predictions"])])


def save_plots(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from nb_helpers.ui.plots import plot_training

    fig = plot_training({run_dir.name: read_metrics(run_dir / "metrics.jsonl")})  # not held by pyplot: no close
    fig.savefig(run_dir / "training.png", dpi=110, bbox_inches="tight")


def train(cfg: RunConfig, listeners=(), verbose: bool = True, resume_from: str | Path | None = None) -> Path:
    """Run one QLoRA fine-tune and return its run folder: the steps above, in order, as notebook 03 calls them.
    `resume_from` continues an interrupted run folder from its last checkpoint: same data order, optimizer and
    scheduler state, RNG state. One SIGTERM handler covers the whole run, as Ctrl-C does: a stop outside
    trainer.train() (loading, scoring) leaves the folder marked "interrupted" (or removed, before its first step) and
    unlocked; then Ctrl-C raises KeyboardInterrupt again and SIGTERM exits with 143."""
    steps: list[TrainingRun] = []
    with sigterm_as_interrupt():
        try:
            return train_steps(cfg, listeners, verbose, resume_from, steps)
        except KeyboardInterrupt as stop:
            print(f"\n{stopped_outside_training(steps[0] if steps else None)}", flush=True)
            if isinstance(stop, Terminated):
                raise SystemExit(EXIT_CODE) from None
            raise


def train_steps(cfg: RunConfig, listeners, verbose: bool, resume_from, steps: list) -> Path:
    """train()'s steps; `steps` gets the TrainingRun as soon as there is one (for a stop outside training)."""
    run = prepare_run(cfg, resume_from, verbose)
    steps.append(run)
    load_for_training(run, verbose)
    open_run_folder(run, listeners, verbose)
    trainer = build_trainer(run)
    evaluate_before(run, trainer, verbose)
    with guard_training(run, trainer):
        trainer.train(resume_from_checkpoint=run.checkpoint)
    return finish_run(run, trainer, verbose)
