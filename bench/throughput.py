"""Throughput and memory of the reference recipe (plain transformers + peft + TRL, verbatim) against our default GPU
path, on one CUDA GPU, under the same emulated card budget (CUDA context included). Each run is a fresh process.

Model: the TinyLlama-1.1B shape with random weights (bench/build_tinyllama_shape.py: same bytes and FLOPs per
token; the loss is meaningless as a score, but the same data and seed give the same loss curve to both recipes).
Workloads, all at effective batch 8 sequences:
  w512     8 x 512 tokens (rows 1-16 tokens shy of the length, so micro-batches above 1 carry padding)
  w2048    8 x 2048 tokens (the same)
  shipped  data/train.jsonl (about 110 tokens a row, loss on the answers only)

For each workload: the reference (1 x 8, GC, paged_adamw_8bit, r=8 on q,k,v,o, no prepare_model_for_kbit_training),
our path at the reference's own settings set by hand (1 x 8, GC: the lean path, the memory comparison; and the same
with cuda_graphs=True: what graphs cost and give there) and our default (auto-fit picks the micro-batch and CUDA
graphs for the budget, keeping the effective batch). --levers adds each lever taken out alone, the settings auto-fit
passes over, a candidate measured before it is built (forward_graphs_only) and host profiles; --gains LEVER,... is
the pruning measurement (our default, each lever out, ours again).
Reported: median step seconds over the steps after warm-up, non-padding tokens/s, the ratio to the reference,
peak NVML device-used GiB (context included, sampled every step), peak PyTorch reserved GiB, the first losses, and
for the reference and our default on every workload the GPU-busy microseconds per token of one profiled step
(torch.profiler: the union of kernel and copy intervals, over that step's non-padding tokens; the time a GPU that
is never idle would need). --turing adds the GTX 1650 card (cards.py) with auto-fit, bf16 against fp16.

    python bench/throughput.py                       # a run file in bench/results/runs/, prints a table
    python bench/throughput.py --workloads w512 --levers --out-dir $OUT     # on the lent device (copy back with cp)
    python bench/throughput.py --workloads w512 --levers --out /tmp/t.json  # that file exactly

The run file (bench/run_file.py) holds the command, versions, GPU and driver, commit and date, and under "results"
every run's figures; `make results` puts the newest beside the reference in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile, add_out_dir, host_load  # noqa: E402
from trace_gaps import analyze, is_copy, load  # noqa: E402

WARMUP = 3
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
WORKLOADS = {"w512": 512, "w2048": 2048, "shipped": 512}


def main_runs(workload: str, steps: int) -> list[dict]:
    """Reference, our default (auto-fit) and, for the memory comparison, our path at the reference's settings."""
    loss_steps = max(steps, 20 + WARMUP) if workload == "shipped" else steps  # 20 losses to compare
    ref = dict(workload=workload, recipe="reference", batch=1, accum=8, gc=True, steps=loss_steps)
    runs = [dict(ref, name="reference"), dict(ref, name="ours", recipe="ours", auto_fit=True)]
    for run in runs:  # GPU-busy time per token on every workload; the profiled last step is not timed: one more
        run.update(profile=True, steps=run["steps"] + 1)  # step keeps 10 timed
    # RunConfig(fast_path=False): our course's code on the plain stack, which must be the reference's run (same losses,
    # same memory); the reference's steps and profiling, so every loss and the same measurement are compared
    runs.append(dict(runs[0], name="ours-plain-1x8", recipe="ours", fast_path=False))
    if workload != "shipped":  # the reference's own settings set by hand: lean (memory), and with graphs asked for
        runs.append(dict(ref, name="ours-1x8", recipe="ours", steps=8))
        runs.append(dict(ref, name="ours-1x8-graphs", recipe="ours", steps=8, cuda_graphs=True))
    return runs


def turing_runs(workload: str, steps: int) -> list[dict]:
    """The GTX 1650 card emulated (nb_helpers.plan.cards: its total, context and desktop reserve), auto-fit, bf16
    against fp16 (what Turing computes in) in the same call: memory, speed, losses, busy time per token."""
    if workload == "shipped":
        return []
    return [dict(workload=workload, recipe="ours", name=f"ours-{dtype}-gtx1650", batch=1, accum=8, gc=True,
                 steps=steps + 1, auto_fit=True, card="gtx1650", dtype=dtype, profile=True)
            for dtype in ("bfloat16", "float16")]


# Where each lever can run: 8 x 512 trains graphed (auto-fit), 8 x 2048 eager with checkpoints in CPU RAM
ONLY_AT = {"graphs": ("w512", "shipped"), "saved_attention": ("w2048",), "offload": ("w2048",),
           "pad_lengths": ("w2048",)}


def off_runs(levers: list[str], workloads: list[str], steps: int) -> list[dict]:
    """Each named lever taken out alone at each workload where it runs, auto-fit choosing again (so a lever's memory
    counts through what auto-fit can choose); every run profiles one step (GPU compute per token)."""
    return [dict(workload=w, recipe="ours", name=f"no-{lever.replace('_', '-')}", batch=8, accum=1, gc=True,
                 auto_fit=True, profile=True, steps=steps + 1, fast=f"{lever}=0")
            for lever in levers for w in workloads if w in ONLY_AT.get(lever, (w,))]


def gain_runs(levers: list[str], workloads: list[str], steps: int) -> list[dict]:
    """The pruning measurement: our default (auto-fit) at each workload, each named lever taken out alone, then our
    default once more: the two `ours` runs bracket the host's drift over the call."""
    ours = dict(recipe="ours", batch=8, accum=1, gc=True, auto_fit=True, profile=True, steps=steps + 1)
    return ([dict(ours, workload=w, name="ours") for w in workloads] + off_runs(levers, workloads, steps)
            + [dict(ours, workload=w, name="ours-again", always=True) for w in workloads])


def lever_runs(workloads: list[str], steps: int) -> list[dict]:
    """--levers, beside the main runs: every lever of the fast path taken out alone, the settings auto-fit passes
    over (why it chooses as it does) and where the host's time goes."""
    from nb_helpers.fast.options import LEVERS

    def run(workload, name, batch, accum, **extra):
        return {**dict(workload=workload, recipe="ours", name=name, batch=batch, accum=accum, gc=True, steps=steps),
                **extra}

    passed_over = [
        # 8 x 2048: graphed layers fit 4 GiB only with the batch split (their pool alone takes 2.99 GiB at 8 x 1),
        # with checkpoints on the GPU or in CPU RAM; auto-fit takes eager 8 x 1 with checkpoints in CPU RAM
        run("w2048", "graphs-2x4", 2, 4, cuda_graphs=True),
        run("w2048", "graphs-offload-4x2", 4, 2, cuda_graphs=True, offload=True, profile=True, steps=steps + 1),
        run("w2048", "offload-4x2", 4, 2, fast="offload=1"),
        # a candidate, measured before it is built: only the no-grad forward replayed as CUDA graphs, the recompute
        # and backward eager, at auto-fit's 8 x 1 with checkpoints in CPU RAM (forward_graphs_only); the host's
        # phases and the GPU's lag say whether it took the host out of the forward
        run("w2048", "forward-graphs-offload-8x1", 8, 1, cuda_graphs=True, offload=True, forward_graphs_only=True,
            profile=True, phases=True, steps=steps + 1),
        # no checkpointing, where the shipped rows fit without it
        run("shipped", "all-8x1-no-gc", 8, 1, gc=False),
        # what LoRA's dropout costs, and peft's prepare_model_for_kbit_training with stock layers (the lean=0 path)
        run("w512", "all-8x1-dropout0", 8, 1, dropout=0.0),
        run("w512", "prepare-kbit-8x1", 8, 1, fast="lean=0,kernels=0,nomask=0"),
        # LoRA dropout kernels' launch settings from before their sweep on an H200 (fast.lora_dropout), beside today's
        *[run(w, "lora-tiles-before", 8, 1, env={"NB_LORA_TILES": "before"}, auto_fit=True, profile=True,
              steps=steps + 1) for w in ("w2048", "w512")],
    ]
    host = [spec for w in ("w512", "w2048") for spec in (
        run(w, "host-profile", 8, 1, auto_fit=True, cprofile=True),  # cProfile of our default's host over 3 steps
        run(w, "host-phases", 8, 1, auto_fit=True, phases=True))]  # the host's time between points of the step
    return [spec for spec in off_runs(list(LEVERS), workloads, steps) + passed_over + host
            if spec["workload"] in workloads]


# --- data -------------------------------------------------------------------------------------------------------
def prepare_data(workload: str, model_dir: Path, work: Path, rows: int) -> Path:
    path = work / f"{workload}.jsonl"
    if path.exists():
        return path
    if workload == "shipped":
        from nb_helpers.data import normalize_row

        with open(path, "w", encoding="utf-8") as f:
            for line in (ROOT / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines():
                f.write(json.dumps(normalize_row(json.loads(line))) + "\n")
        return path
    from planner_grid import write_rows
    from transformers import AutoTokenizer

    write_rows(AutoTokenizer.from_pretrained(model_dir), path, rows, WORKLOADS[workload], seed=WORKLOADS[workload])
    return path


# --- workers (each in its own process) --------------------------------------------------------------------------
class Recorder:
    """Per optimizer step: wall time (synchronized), non-padding tokens, NVML device used, reserved, loss."""

    def __init__(self, spec: dict):
        import gc

        self.spec, self.records, self.prof, self.prof_start = spec, [], None, None
        step = spec.get("profile_step", spec["steps"] - 1)  # 0-based; the last step unless one is asked for
        self.profile_from = step + 1 if spec.get("profile") else None
        self.gc_ms, self.gc_steps, self._gc_start = [0.0, 0.0, 0.0], [], None  # Python's collections, per generation
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_ms[info["generation"]] += (time.perf_counter() - self._gc_start) * 1e3

    def step_done(self, record: dict) -> None:
        import torch

        self.records.append(record)
        self.gc_steps.append([round(ms, 1) for ms in self.gc_ms])
        self.gc_ms = [0.0, 0.0, 0.0]
        if self.profile_from is None:
            return
        if len(self.records) == self.profile_from - 1 and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            host = [ProfilerActivity.CPU] if self.spec.get("trace") and not self.spec.get("gpu_only") else []
            self.prof = profile(activities=[*host, ProfilerActivity.CUDA], with_stack=bool(self.spec.get("trace_stack")))
            self.prof.start()
            self.prof_start = time.perf_counter()
        elif len(self.records) == self.profile_from and self.prof is not None and self.prof_start is not None:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.prof_start
            self.prof.stop()
            self.busy = busy_share(self.prof, wall)
            self.prof_start = None
            if self.spec.get("trace"):
                self.busy["gaps"] = save_trace(self.prof, Path(self.spec["trace"]), self.spec)


class HostProfile:
    """cProfile over three steps after warm-up: where the host's time goes (Python, peft, bitsandbytes, autograd)."""

    def __init__(self, enabled: bool, steps: int = 3):
        self.enabled, self.steps, self.profiler, self.report = enabled, steps, None, None

    def step_done(self, step: int) -> None:
        if not self.enabled:
            return
        import cProfile
        import io
        import pstats

        if step == WARMUP:
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        elif step == WARMUP + self.steps and self.profiler is not None:
            self.profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(self.profiler, stream=text)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(120)
            stats.print_callers("synchronize|method 'item'|method 'cpu'|method 'to' of|parameters|zero_grad")
            self.report = text.getvalue()[-60000:]
            self.profiler = None


class HostPhases:
    """The host's time between points of every step, untraced (time.perf_counter at callbacks and hooks): fetching
    the batch (the move to the device and the next batch's collation), up to the embedding, the forward, the backward
    until the first adapter's gradient, on to the optimizer, the optimizer, the step's end and the log line. Medians
    over the timed steps, in ms, and every step's ("per_step"). With the GPU's timeline of a step (--gpu-trace) it says
    what the GPU waits for.

    With `gpu` (a CUDA GPU), each point also records a CUDA event on the current stream, and the report adds
    "gpu_lag_ms": how far the GPU runs behind the host at each point, counted from the step's beginning (the
    previous step ended in a synchronize, so both start together). Near 0 at a point: the GPU had caught up and was
    waiting for the host to queue more (that stretch is host-bound); large: the host was ahead (GPU-bound)."""

    def __init__(self, gpu: bool = False):
        import torch

        self.marks: list[tuple[str, float]] = []
        self.events: list = []  # with gpu: one CUDA event per mark
        self._event = torch.cuda.Event if gpu else None

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))
        if self._event is not None:
            event = self._event(enable_timing=True)
            event.record()
            self.events.append(event)

    def install(self, trainer, model) -> None:
        import accelerate.data_loader as loaders
        from transformers import TrainerCallback

        phases, fetch = self, loaders.DataLoaderShard.__iter__

        class Marks(TrainerCallback):
            def on_step_begin(self, *a, **k): phases.mark("step_begin")
            def on_pre_optimizer_step(self, *a, **k): phases.mark("pre_optimizer")
            def on_optimizer_step(self, *a, **k): phases.mark("optimizer_done")
            def on_step_end(self, *a, **k): phases.mark("step_end")
            def on_log(self, *a, **k): phases.mark("logged")

        def marked_fetch(loader):
            batches = fetch(loader)
            while True:
                phases.mark("fetch")
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                phases.mark("fetched")
                yield batch

        loaders.DataLoaderShard.__iter__ = marked_fetch
        trainer.add_callback(Marks())
        model.get_input_embeddings().register_forward_pre_hook(lambda *a: self.mark("embedding"))
        model.register_forward_hook(lambda *a: self.mark("forward_done"))
        first = next(p for p in model.parameters() if p.requires_grad)  # its gradient comes last in the backward
        first.register_post_accumulate_grad_hook(lambda p: self.mark("backward_done"))

    def report(self, skip_steps: int) -> dict:
        intervals: dict[str, list[float]] = {}
        step = 0
        for (a, ta), (b, tb) in zip(self.marks, self.marks[1:]):
            step += a == "step_end"
            if step >= skip_steps:
                intervals.setdefault(f"{a} -> {b}", []).append((tb - ta) * 1e3)
        report = medians_and_steps(intervals)
        if self.events:  # recorded on a GPU
            import torch

            torch.cuda.synchronize()
            gpu_ms = [self.events[0].elapsed_time(event) for event in self.events]
            report["gpu_lag_ms"] = gpu_lags([(name, host_s * 1e3, gpu) for (name, host_s), gpu
                                             in zip(self.marks, gpu_ms)], skip_steps)
        return report


def gpu_lags(marks: list[tuple[str, float, float]], skip_steps: int) -> dict:
    """(point, host ms, GPU ms) in order, each clock from its own origin -> for each point, the median over the steps
    after `skip_steps` of how far the GPU ran behind the host there: its GPU time since the step's "step_begin" less
    its host time since then ("per_step": every step's). A step runs from its "step_begin" to the next; points before
    the first are left out."""
    lags: dict[str, list[float]] = {}
    step, anchor = -1, None  # a step runs from its "step_begin" to the next one
    for name, host_ms, gpu_ms in marks:
        if name == "step_begin":
            step, anchor = step + 1, (host_ms, gpu_ms)
        elif anchor is not None and step >= skip_steps:
            lags.setdefault(name, []).append((gpu_ms - anchor[1]) - (host_ms - anchor[0]))
    return medians_and_steps(lags)


def medians_and_steps(series: dict[str, list[float]]) -> dict:
    """Each series' median (ms, 2 decimals) and, under "per_step", every step's value (1 decimal)."""
    return {**{k: round(statistics.median(v), 2) for k, v in series.items()},
            "per_step": {k: [round(x, 1) for x in v] for k, v in series.items()}}


def save_trace(prof, folder: Path, spec: dict) -> dict:
    """The profiled step's Chrome trace, gzipped, and where its GPU gaps come from (bench/trace_gaps.py)."""
    import gzip
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / f"{spec['workload']}-{spec['name']}.json"
    prof.export_chrome_trace(str(raw))
    gaps = analyze(load(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return gaps


def busy_share(prof, wall_s: float) -> dict:
    """Union of GPU kernel and copy intervals over the wall time of the profiled step; `compute_busy_s` leaves the
    copies out (an offloaded checkpoint's copy running while the compute waits on the host counts as busy otherwise)."""
    intervals, by_name = [], {}
    try:
        for e in prof.profiler.kineto_results.events():
            if "cuda" in str(e.device_type()).lower() and e.duration_ns() > 0:
                intervals.append((e.start_ns(), e.start_ns() + e.duration_ns(), is_copy(e.name())))
                by_name[e.name()[:80]] = by_name.get(e.name()[:80], 0) + e.duration_ns()
    except Exception:  # noqa: BLE001 - older/newer profiler API
        from torch.autograd import DeviceType

        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                intervals.append((e.time_range.start * 1000, e.time_range.end * 1000, "memcpy" in e.name.lower()))
    busy, compute = union_ns(intervals), union_ns([i for i in intervals if not i[2]])
    copies = sum(t for name, t in by_name.items() if "memcpy" in name.lower())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    categories: dict[str, float] = {}
    for name, t in by_name.items():
        categories[kernel_category(name)] = categories.get(kernel_category(name), 0.0) + t / 1e9
    return {"busy_s": busy / 1e9, "compute_busy_s": compute / 1e9, "wall_s": wall_s,
            "busy_share": busy / 1e9 / wall_s if wall_s else None, "gpu_events": len(intervals), "copy_s": copies / 1e9,
            "categories_s": {k: round(v, 5) for k, v in sorted(categories.items())},
            "top_kernels_s": {name: round(t / 1e9, 4) for name, t in top}}


def union_ns(intervals) -> float:
    """Total length of the union of (start, end, ...) intervals."""
    busy, end = 0, None
    for a, b, *_ in sorted(intervals):
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return busy


def kernel_category(name: str) -> str:
    """Where a GPU kernel's time goes, by its name: matmul, attention, dequantize, copy, or other (elementwise,
    norms, dropout, the optimizer). Kernel time summed, so overlapping kernels (copies beside compute) both count."""
    if is_copy(name):
        return "copy"
    low = name.lower()
    if "dequant" in low:
        return "dequantize"
    if any(k in low for k in ("sdpa", "flash", "fmha", "attention")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "gemv", "splitk", "cublas", "sm90_", "sm80_")):
        return "matmul"
    return "other"


def reference_worker(spec: dict) -> dict:
    """The recipe as written, on the plain stack: nothing from nb_helpers touches the model or the trainer; only
    the budget cap and the measurement (the same as ours) come from it."""
    from nb_helpers.plan.memory import memory_snapshot, record_nvml_baseline

    record_nvml_baseline(0)
    from nb_helpers.plan.budget import enforce_budget

    budget = enforce_budget(spec["budget"])
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.bfloat16, device_map={"": 0},
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))
    peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=QKVO, task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=spec["batch"],
                     gradient_accumulation_steps=spec["accum"], gradient_checkpointing=spec["gc"],
                     optim="paged_adamw_8bit", learning_rate=2e-4, max_grad_norm=0.3, lr_scheduler_type="linear",
                     bf16=True, max_length=spec["seq"], max_steps=spec["steps"], logging_steps=1, seed=42,
                     save_strategy="no", report_to="none", disable_tqdm=True,
                     include_num_input_tokens_seen="non_padding")  # counting only, as our path counts
    recorder = Recorder(spec)

    class Measure(TrainerCallback):
        def __init__(self):
            self.t, self.tokens, self.pending = None, 0, None

        def on_train_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            now = time.perf_counter()
            tokens = state.num_input_tokens_seen - self.tokens
            self.tokens = state.num_input_tokens_seen
            self.pending = {"step": state.global_step, "step_s": now - self.t, "tokens": tokens, **memory_snapshot()}
            self.t = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs and self.pending:
                recorder.step_done({**self.pending, "loss": logs["loss"]})
                self.pending = None  # timed from step end to step end, logging included, as our MetricsCallback

    trainer = SFTTrainer(model=model, args=args, train_dataset=load_dataset("json", data_files=spec["data"],
                                                                            split="train"),
                         processing_class=tokenizer, peft_config=peft_config, callbacks=[Measure()])
    trainer.train()
    return {"records": recorder.records, "busy": getattr(recorder, "busy", None), "context_gib": budget.context_gib,
            "gc_ms_per_step": recorder.gc_steps,
            "settings": {"micro_batch": spec["batch"], "accum": spec["accum"], "gc": spec["gc"]}}


def ours_worker(spec: dict) -> dict:
    """Our default path: `nb_helpers.training.train`, exactly as `python -m nb_helpers train` runs it."""
    import torch

    from nb_helpers.config import RunConfig
    from nb_helpers.metrics import read_metrics
    from nb_helpers.training import train

    skipped = forward_graphs_only() if spec.get("forward_graphs_only") else None
    work = Path(tempfile.mkdtemp())
    cfg = RunConfig(model=spec["model"], train_file=spec["data"], eval_file=None, task_eval_samples=0,
                    max_length=spec["seq"], micro_batch_size=spec["batch"], grad_accum=spec["accum"],
                    gradient_checkpointing=spec["gc"], max_steps=spec["steps"], save_steps=10_000,
                    budget_gib=None if spec.get("card") else spec["budget"], card=spec.get("card"),
                    auto_fit=spec.get("auto_fit", False), compute_dtype=spec.get("dtype", "bfloat16"),
                    cuda_graphs=spec.get("cuda_graphs"), fast_path=spec.get("fast_path", True),
                    offload_checkpoints=spec.get("offload", False),
                    no_recompute_layers=spec.get("no_recompute_layers", 0),
                    lora_dropout=spec.get("dropout", 0.05), runs_dir=str(work), run_name="run")
    recorder = Recorder(spec)
    host = HostProfile(spec.get("cprofile", False))
    phases = HostPhases(gpu=torch.cuda.is_available()) if spec.get("phases") else None
    if phases is not None:
        from nb_helpers import training as steps

        build = steps.build_trainer

        def build_and_mark(run):
            trainer = build(run)
            phases.install(trainer, run.model)
            return trainer

        steps.build_trainer = build_and_mark

    def listen(record):
        if "loss" in record:
            recorder.step_done(record)
            host.step_done(record["step"])

    run = train(cfg, listeners=[listen], verbose=True)
    chosen = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    return {"records": [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r],
            "busy": getattr(recorder, "busy", None), "context_gib": summary.get("cuda_context_gib"),
            "gc_ms_per_step": recorder.gc_steps,
            "predicted_peak_gib": summary.get("predicted_peak_gib"), "host_profile": host.report,
            "host_phases_ms": phases.report(WARMUP) if phases else None,
            "settings": {"micro_batch": chosen["micro_batch_size"], "accum": chosen["grad_accum"],
                         "gc": chosen["gradient_checkpointing"],
                         "no_recompute_layers": chosen.get("no_recompute_layers", 0)},
            "fast_levers": summary.get("fast_levers"),
            "backward_captures_skipped": skipped[0] if skipped is not None else None}


def forward_graphs_only() -> list[int]:
    """Checkpointed layers replayed from CUDA graphs of their no-grad forward alone: the backward's capture is
    skipped, so fast.graphed_layers runs the recompute and the backward eagerly, reading what the forward graph left
    (its down_once products). Not a lever of the package: what one would give, measured first. Returns the count of
    captures skipped (0 after a run: the backward never met a forward graph, and the run measured nothing new)."""
    from nb_helpers.fast import graphed_layers

    skipped = [0]

    def skip_capture(*args) -> None:
        skipped[0] += 1

    graphed_layers._capture_backward = skip_capture
    return skipped


def worker_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("fast") is not None:
        os.environ["NB_FASTPATH"] = spec["fast"]
    result = (reference_worker if spec["recipe"] == "reference" else ours_worker)(spec)
    Path(out_path).write_text(json.dumps(result))


# --- driver -----------------------------------------------------------------------------------------------------
def summarize(spec: dict, result: dict) -> dict:
    records = result["records"]
    timed = records[WARMUP:spec["steps"] - (1 if spec.get("profile") else 0)]
    step_s = statistics.median(r["step_s"] for r in timed) if timed else None
    tokens = statistics.median(r["tokens"] for r in timed) if timed else None
    busy = result.get("busy")
    if busy and spec.get("profile") and records:  # the profiled step's own tokens (the last step unless asked)
        profiled = records[min(spec.get("profile_step", spec["steps"] - 1), len(records) - 1)]
        busy["us_per_token"] = busy["busy_s"] * 1e6 / profiled["tokens"] if profiled.get("tokens") else None
        busy["compute_us_per_token"] = busy["compute_busy_s"] * 1e6 / profiled["tokens"] if profiled.get("tokens") \
            else None
    device = [r["device_used_gib"] for r in records if r.get("device_used_gib") is not None]
    reserved = [r["torch_peak_gib"] for r in records if r.get("torch_peak_gib") is not None]
    allocated = [r["torch_peak_allocated_gib"] for r in records if r.get("torch_peak_allocated_gib") is not None]
    row = {"tokens_per_s": tokens / step_s if step_s and tokens else None, "median_step_s": step_s,
           "timed_steps": len(timed), "tokens_per_step": tokens,
           "peak_device_gib": max(device) if device else None, "peak_reserved_gib": max(reserved) if reserved else None,
           "peak_allocated_gib": max(allocated) if allocated else None, "losses": [round(r["loss"], 4) for r in records], **result.get("settings", {}),
           "busy": result.get("busy"), "context_gib": result.get("context_gib"),
           "predicted_peak_gib": result.get("predicted_peak_gib"), "fast": spec.get("fast"),
           "dropout": spec.get("dropout", 0.05), "warmup_step_s": [round(r["step_s"], 2) for r in records[:WARMUP]],
           "step_s_all": [round(r["step_s"], 3) for r in records], "gc_ms_per_step": result.get("gc_ms_per_step"),
           "host_profile": result.get("host_profile"), "host_phases_ms": result.get("host_phases_ms"),
           "fast_levers": result.get("fast_levers")}
    if result.get("backward_captures_skipped") is not None:  # the forward-graphs candidate's run alone
        row["backward_captures_skipped"] = result["backward_captures_skipped"]
    return row


def cpu_throttling() -> dict:
    """cgroup v2 CPU throttling counters (nr_periods, nr_throttled, throttled_usec), {} where there are none."""
    try:
        lines = Path("/sys/fs/cgroup/cpu.stat").read_text().split("\n")
    except OSError:
        return {}
    pairs = dict(line.split() for line in lines if line.strip())
    return {k: int(pairs[k]) for k in ("nr_periods", "nr_throttled", "throttled_usec") if k in pairs}


def versions() -> dict:
    from nb_helpers.summary import package_versions

    return package_versions()


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="w512,w2048,shipped")
    parser.add_argument("--levers", action="store_true", help="also each lever taken out alone, the settings "
                        "auto-fit passes over, and host profiles")
    parser.add_argument("--turing", action="store_true", help="also the GTX 1650 card, auto-fit, bf16 and fp16")
    parser.add_argument("--gains", default=None, help="comma list of levers: only our default and each of these "
                        "levers taken out alone, at each workload (the pruning measurement)")
    parser.add_argument("--with-reference", action="store_true", help="with --gains: the reference recipe too, "
                        "first at each workload (the headline and the levers' gains in one run)")
    parser.add_argument("--only", default=None, help="comma list of run names to keep (e.g. reference,ours)")
    parser.add_argument("--steps", type=int, default=WARMUP + 10)
    parser.add_argument("--budget", type=float, default=4.0, help="GiB, CUDA context included")
    parser.add_argument("--out", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    parser.add_argument("--model-dir", default="/tmp/shape-tinyllama-1.1b")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no new run after this many seconds")
    parser.add_argument("--profile-step", type=int, default=None, help="profile this step (0-based) instead of the "
                        "last; its time then counts among the timed steps")
    parser.add_argument("--trace", default=None, help="folder: profiled runs also record the host and save a trace")
    parser.add_argument("--trace-stack", action="store_true", help="with --trace: the host's Python calls too (slower "
                        "host in that step; for where the host's time goes, not for busy figures)")
    parser.add_argument("--gpu-trace", default=None, help="folder: profiled runs save their GPU-only timeline (no host "
                        "recording, so the step runs as untraced ones do)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def planned_runs(args: argparse.Namespace) -> list[dict]:
    """The runs the options ask for, in order: the main runs (or, with --gains, the pruning measurement, the
    reference first with --with-reference), then --turing's and --levers'."""
    workloads = args.workloads.split(",")
    plan = ([] if args.gains else [spec for workload in workloads for spec in main_runs(workload, args.steps)])
    if args.gains:
        if args.with_reference:  # the reference first, as main_runs has it: our default's runs then come beside it
            plan += [spec for w in workloads for spec in main_runs(w, args.steps) if spec["name"] == "reference"]
        plan += gain_runs(args.gains.split(","), workloads, args.steps)
    if args.turing:
        plan += [spec for workload in workloads for spec in turing_runs(workload, args.steps)]
    if args.levers:
        plan += lever_runs(workloads, args.steps)
    return plan


def measure(spec: dict, work: Path) -> dict:
    """One run in a fresh process (its spec and result as files in `work`): its row of the run file."""
    stem = f"{spec['workload']}-{spec['name']}"
    spec_path, result_path = work / f"{stem}.json", work / f"{stem}.out"
    spec_path.write_text(json.dumps(spec))
    before = host_load()
    if before["gpu_processes"]:
        print(f"[throughput] {stem}: {len(before['gpu_processes'])} other process(es) hold GPU memory as it starts "
              f"({sum(mib for _, mib in before['gpu_processes'])} MiB): its figures may not be this code's alone",
              flush=True)
    t0 = time.time()
    throttled = cpu_throttling()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path),
                           str(result_path)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **spec.get("env", {}), "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    row = {"recipe": spec["recipe"], "wall_s": round(time.time() - t0, 1), "returncode": proc.returncode,
           "host_before": before}
    if throttled:  # the container's CPU quota: periods in which the run was throttled, and for how long
        after = cpu_throttling()
        row["cpu_throttled"] = {k: after[k] - throttled[k] for k in throttled}
    if result_path.exists():
        row.update(summarize(spec, json.loads(result_path.read_text())))
    if proc.returncode != 0:
        row["error_tail"] = (proc.stderr or proc.stdout)[-2000:]
    fast_lines = [l for l in proc.stdout.splitlines() if l.startswith(("[fast]", "[auto-fit]"))]
    if fast_lines:
        row["log"] = fast_lines
    return row


def main() -> None:
    args = arguments()
    if args.worker:
        worker_main(*args.worker)
        return

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/throughput.py needs a CUDA GPU")
    start = time.time()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        from build_tinyllama_shape import build

        build("tinyllama-1.1b", str(model_dir), ROOT / "data", max_positions=4096)  # the grid's long points too
    work = Path(tempfile.mkdtemp(prefix="throughput-"))
    # a gains run measures levers; with the reference beside them it is also the headline's run
    kind = "lever-gains" if args.gains and not args.with_reference else "throughput"
    run_file = RunFile(kind, out_dir=args.out_dir, out=args.out)  # command, versions, GPU, driver, commit
    out = {"budget_gib": args.budget, "model": "TinyLlama-1.1B shape, random weights (bench/build_tinyllama_shape.py)",
           "warmup_steps": WARMUP, "workloads": {}}
    keep = set(args.only.split(",")) if args.only else None
    for spec in planned_runs(args):
        workload = spec["workload"]
        seq = WORKLOADS[workload]
        entry = out["workloads"].setdefault(workload, {"seq": seq, "effective_batch": 8, "runs": {}})
        if keep and spec["name"] not in keep:
            continue
        if time.time() - start > args.deadline_s and not spec.get("always"):
            print(f"[throughput] deadline: {workload}/{spec['name']} not run", flush=True)
            entry["runs"][spec["name"]] = {"recipe": spec["recipe"], "not_run": "device-call deadline"}
            continue
        if args.profile_step is not None and spec.get("profile"):
            spec["profile_step"] = args.profile_step
        if args.trace and spec.get("profile") and spec["recipe"] != "reference":  # its trace would be 100+ MB
            spec.update(trace=args.trace, trace_stack=args.trace_stack)
        elif args.gpu_trace and spec.get("profile"):
            spec.update(trace=args.gpu_trace, gpu_only=True)
        spec.update(seq=seq, budget=args.budget, model=str(model_dir),
                    data=str(prepare_data(workload, model_dir, work, rows=8 * max(args.steps, 23))))
        row = entry["runs"][spec["name"]] = measure(spec, work)
        ref = entry["runs"].get("reference", {}).get("tokens_per_s")
        if ref and row.get("tokens_per_s"):
            row["ratio_to_reference"] = row["tokens_per_s"] / ref
        print(f"[throughput] {workload:<8}{spec['name']:<24}{row.get('micro_batch', '?')}x{row.get('accum', '?')} "
              f"{row.get('median_step_s') or float('nan'):7.3f} s/step {row.get('tokens_per_s') or 0:8.0f} tok/s "
              f"x{row.get('ratio_to_reference') or float('nan'):5.2f} dev {row.get('peak_device_gib') or float('nan'):.2f}"
              f" GiB rc={row['returncode']} {row['wall_s']}s", flush=True)
        if row["returncode"] != 0:
            print("    " + row["error_tail"][-600:].replace("\n", "\n    "), flush=True)
        entry["reference"], entry["ours"] = entry["runs"].get("reference"), entry["runs"].get("ours")
        entry["plain_vs_reference"] = plain_vs_reference(entry["runs"])
        run_file.write(out)  # after every run: what a deadline or a kill leaves is kept
    path = run_file.write(out)
    print_table({**out, "gpu": run_file.header["machine"]["gpu"], "date": run_file.header["date"]})
    print(f"wrote {path}")


def plain_vs_reference(runs: dict) -> dict | None:
    """fast_path=False against the reference, same call: the largest relative loss difference over the steps both
    ran, and the peak memory ratios (NVML device-used, context included; PyTorch reserved)."""
    ref, plain = runs.get("reference") or {}, runs.get("ours-plain-1x8") or {}
    if not (ref.get("losses") and plain.get("losses")):
        return None
    pairs = list(zip(ref["losses"], plain["losses"]))
    ratio = lambda key: plain[key] / ref[key] if ref.get(key) and plain.get(key) else None  # noqa: E731
    return {"steps_compared": len(pairs), "max_loss_rel_diff": max(abs(b - a) / abs(a) for a, b in pairs),
            "device_gib_ratio": ratio("peak_device_gib"), "reserved_gib_ratio": ratio("peak_reserved_gib"),
            "speed_ratio": ratio("tokens_per_s")}


def print_table(out: dict) -> None:
    print(f"\n{out['gpu']} | budget {out['budget_gib']} GiB incl. context | {out['date']}")
    print(f"{'workload':<9}{'run':<28}{'mbxacc':>7}{'s/step':>8}{'tok/s':>8}{'x ref':>6}{'dev GiB':>8}{'res GiB':>8}"
          f"{'busy':>6}{'us/tok':>7}  losses")
    for workload, entry in out["workloads"].items():
        for name, r in entry["runs"].items():
            busy = (r.get("busy") or {}).get("busy_share")
            per_token = (r.get("busy") or {}).get("us_per_token")
            print(f"{workload:<9}{name:<28}{str(r.get('micro_batch', '?')) + 'x' + str(r.get('accum', '?')):>7}"
                  f"{r.get('median_step_s') or float('nan'):8.3f}{r.get('tokens_per_s') or 0:8.0f}"
                  f"{r.get('ratio_to_reference') or float('nan'):6.2f}{r.get('peak_device_gib') or float('nan'):8.2f}"
                  f"{r.get('peak_reserved_gib') or float('nan'):8.2f}{busy if busy is not None else float('nan'):6.2f}"
                  f"{per_token if per_token is not None else float('nan'):7.1f}"
                  f"  {' '.join(f'{x:.2f}' for x in (r.get('losses') or [])[:4])}")
        if entry.get("plain_vs_reference"):
            print(f"{workload:<9}fast_path=False against the reference: {entry['plain_vs_reference']}")


if __name__ == "__main__":
    main()
