"""How long will a step take? Seconds per optimizer step, predicted from config.json and the settings, for a named card.

A step's GPU time is the work it does, counted from the model's shape (nb_helpers.plan.architecture), times what each
unit of work cost on the H200 where it was measured (kernel time by kind, torch.profiler), scaled to the card:

    matmuls      2 x tokens x weights for each pass over the 4-bit base (forward, backward to the activations, and
                 the recompute with checkpointing), the LM head twice; a fixed cost per GEMM launch; LoRA's skinny
                 GEMMs as the bytes they read
    attention    the causal score and value products (half a square per layer; window layers a full band), with a
                 flash backward of 2.5 forwards
    dequantize   NF4 -> 16-bit weights once per pass: 2.5 bytes per weight, and two launches per GEMM (one where the
                 double-quantized absmax is kept decoded: fast.fused_lora.keep_decoded_absmax)
    (the recompute leaves out the product nothing reads where nb_helpers.fast.recompute finds one: recomputed_params;
    the last no_recompute_layers layers are not recomputed at all: recomputed_layers; it reuses its forward's LoRA
    products where lever down_once stashes them)
    other        norms, activations, RoPE, dropout, residual adds, the loss over the vocabulary: elements touched
                 (liger's fused kernels touch fewer, and fewer again where fast.frozen_norms runs the norms'
                 backward), and a fixed cost per layer pass

Compute units scale with the card's 16-bit matmul peak, bytes with its memory bandwidth, launches not at all. The
host (Python, peft, autograd launching kernels) costs a fixed time per layer and micro-step; an eager micro-step
takes the longer of the GPU's time and the host's, a CUDA-graphed one the GPU's plus a little host time. On a
consumer card the GPU's time dominates; on the H200 the host's often does.

Measured on one H200 only (bench/step_time.py; fitted and validated by bench/step_time_report.py, results in
bench/RESULTS.md). Every other card's time is this model applied to its spec-sheet peaks, not a
measurement: laptops run below their boost clocks, and a GTX 1650 has no tensor cores (its fp16 peak is its CUDA
cores' double-rate half2).
"""

from __future__ import annotations

from dataclasses import dataclass

from nb_helpers.plan.activations import (copied_layers, fused_kernels_apply, saved_attention_bytes,
                                         saved_attention_runs)
from nb_helpers.plan.architecture import Shape, plan_targets, recomputed_layers, recomputed_params

# The measurement GPU's peaks (NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16, 4.8 TB/s; PCIe 5.0 x16 copies to
# pinned memory measured 57 GB/s on the H200 in bench/throughput.py's runs)
H200 = dict(name="NVIDIA H200", tflops16=989.0, bandwidth_gbs=4800.0, pcie_gbs=57.0, device_names=("H200",))

# Seconds per unit of work on the H200, fitted by bench/step_time_report.py on the FIT points of bench/step_time.py
# (2026-12-02) and validated on 14 points it did not see (bench/RESULTS.md).
GPU_SECONDS = {  # unit: (seconds per unit on the H200, what it scales with on another card)
    "matmul_flops": (1.10970e-15, "compute"),
    "gemm_launches": (8.23407e-06, "launch"),
    "lora_bytes": (4.06044e-13, "bandwidth"),
    "attention_flops": (2.66114e-15, "compute"),
    "window_attention_flops": (4.44488e-15, "compute"),
    "attention_launches": (1.62171e-05, "launch"),
    "dequant_bytes": (4.18129e-13, "bandwidth"),
    "dequant_launches": (2.10246e-06, "launch"),
    "fused_norm_elements": (1.08462e-11, "bandwidth"),
    "stock_norm_elements": (3.79560e-11, "bandwidth"),
    "loss_elements": (6.95546e-12, "bandwidth"),
    "layer_passes": (3.84199e-05, "launch"),
}
CATEGORY = {"matmul_flops": "matmul", "gemm_launches": "matmul", "lora_bytes": "matmul",
            "attention_flops": "attention", "window_attention_flops": "attention", "attention_launches": "attention",
            "dequant_bytes": "dequantize", "dequant_launches": "dequantize"}
# Host seconds per micro-step on the H200's host (16 cores; bench/step_time_report.py), per decoder layer run eagerly:
HOST_LAYER_S = 6.84e-3  # forward and backward
HOST_GC_LAYER_S = 2.91e-3  # the recompute, with checkpointing
HOST_GC_STOCK_LAYER_S = 2.59e-3  # more, with checkpointing, where the stock (unfused) layers run
HOST_EXTRA_NORM_LAYER_S = 2.79e-3  # per norm beyond two in a layer (Gemma's four)
GRAPHED_MICRO_S = 1.41e-2  # a CUDA-graphed micro-step's host time the GPU waits for (loss, head, embeddings)
STEP_S = 1.90e-2  # per optimizer step: the optimizer, clipping, logging; not added where lever one_token_count
#                   lets the host queue them before the backward ends (H200, 2026-12-03: 8 x 2048 and 8 x 512
#                   within 9%)
# lever frozen_norms: the fused-norm elements each norm's backward no longer costs, per hidden element of a token and
# layer (H200, 2026-12-03: the norms' backward and the input's gradient sums took 5.4 ms less of an 8 x 2048 step)
FROZEN_NORMS_SAVED = 0.34
OFFLOAD_EXPOSED = 0.37  # share of the checkpoint copies (to CPU RAM and back) the compute does not hide
BACKWARD_OVER_FORWARD = 2.5  # a flash-attention backward costs about 2.5 forwards (its five products against two)


@dataclass
class StepTime:
    """Predicted seconds per optimizer step: the GPU's busy time, the host's, and their combination (`step_s`)."""

    gpu_name: str
    step_s: float
    gpu_busy_s: float
    host_s: float
    gpu_by_kind_s: dict[str, float]
    tokens: int  # per optimizer step (padded, as planned)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    def describe(self) -> str:
        return (f"~{self.step_s:.2f} s per optimizer step on the {self.gpu_name} (~{self.tokens_per_s:,.0f} tokens/s; "
                f"GPU busy {self.gpu_busy_s:.2f} s, host {self.host_s:.2f} s)")


def work_per_micro_step(shape: Shape, inp) -> dict[str, float]:
    """The units of GPU_SECONDS one micro-step of this plan does."""
    batch, seq, layers = inp.batch, inp.seq, shape.layers
    gc = recomputed_layers(shape, inp) / layers  # the share of layers recomputed: 1 with checkpointing, 0 without
    tokens, passes, dims = batch * seq, 2 + gc, shape.linear_dims()
    recomputed, recomputed_gemms = recomputed_params(shape, inp)
    weights_per_pass = shape.linear_params * 2 + gc * recomputed * layers  # forward, backward, the recompute
    gemms = layers * (len(dims) * 2 + gc * recomputed_gemms)
    targets = plan_targets(shape, inp.targets)
    lora_passes = 2 * (1 + gc) + 4  # two skinny GEMMs per forward, four in the backward
    # the recompute reusing its forward's rank-r products (lever down_once) writes its outputs and reads no input
    reused = gc * bool(getattr(inp, "down_once", False) and getattr(inp, "dropout_kernels", False)
                       and inp.lora_dropout > 0)
    forward_attention = 2 * 2 * batch * shape.heads * shape.head_dim * seq  # times the keys each query sees
    # the recompute attends again, unless its forward kept the output (lever saved_attention)
    attention_passes = 1 + gc * (not saved_attention_runs(shape, inp)) + BACKWARD_OVER_FORWARD
    full_layers = layers - shape.sliding_layers
    fused = fused_kernels_apply(shape, inp)
    q_and_k = (shape.heads + shape.kv_heads) * shape.head_dim * (2 if shape.qk_norm else 1)
    norm_elements = tokens * layers * (shape.norms_per_layer * shape.hidden + q_and_k) * (1 + gc)
    if fused and getattr(inp, "frozen_norms", False) and shape.family == "llama":  # fast.fused_block's layers
        norm_elements -= FROZEN_NORMS_SAVED * tokens * layers * 2 * shape.hidden
    return {
        "matmul_flops": 2 * tokens * weights_per_pass + 4 * tokens * shape.hidden * shape.vocab,
        "gemm_launches": gemms + 2,
        "lora_bytes": layers * sum(2 * tokens * ((lora_passes - 2 * reused) * (dims[t][0] + dims[t][1])
                                                 + reused * dims[t][1]) for t in targets),
        "attention_flops": forward_attention * seq / 2 * full_layers * attention_passes,
        "window_attention_flops": forward_attention * seq * shape.sliding_layers * attention_passes,
        "attention_launches": layers * passes,
        "dequant_bytes": 2.5 * weights_per_pass * getattr(inp, "dequant_time_share", 1.0),
        "dequant_launches": (1 if getattr(inp, "absmax_once", False) else 2) * gemms,  # absmax per call or kept
        "fused_norm_elements": norm_elements if fused else 0.0,
        "stock_norm_elements": 0.0 if fused else norm_elements,
        "loss_elements": tokens * shape.vocab,
        "layer_passes": layers * passes,
    }


def gpu_seconds_by_kind(work: dict[str, float], gpu: dict) -> dict[str, float]:
    """GPU seconds of one micro-step's work on `gpu` (H200's keys: tflops16, bandwidth_gbs), by kernel kind."""
    scale = {"compute": H200["tflops16"] / gpu["tflops16"], "bandwidth": H200["bandwidth_gbs"] / gpu["bandwidth_gbs"],
             "launch": 1.0}
    out: dict[str, float] = {}
    for unit, amount in work.items():
        seconds, kind = GPU_SECONDS[unit]
        category = CATEGORY.get(unit, "other")
        out[category] = out.get(category, 0.0) + amount * seconds * scale[kind]
    return out


def host_seconds_per_micro_step(shape: Shape, inp) -> float:
    """The host's time for one eager micro-step (graphed layers: GRAPHED_MICRO_S, added to the GPU's)."""
    if inp.graphs and inp.gradient_checkpointing:
        return GRAPHED_MICRO_S
    stock = not fused_kernels_apply(shape, inp)
    per_layer = HOST_LAYER_S + max(0, shape.norms_per_layer - 2) * HOST_EXTRA_NORM_LAYER_S
    return shape.layers * per_layer + recomputed_layers(shape, inp) * (HOST_GC_LAYER_S + stock * HOST_GC_STOCK_LAYER_S)


def offload_seconds(shape: Shape, inp, gpu: dict, busy_s: float) -> float:
    """GPU time the checkpoint copies add per micro-step: a share of them, or all the compute cannot hide. The kept
    attention's copies (lever saved_attention) ride behind the layer inputs' on the same side stream: they count only
    where the compute cannot hide them (H200, 2026-12-03: 0.220-0.223 s a step with them, 0.222 without)."""
    if not (inp.offload and recomputed_layers(shape, inp)):
        return 0.0
    pcie, (inputs, attentions) = gpu["pcie_gbs"] * 1e9, copied_layers(shape, inp)
    inputs_s = 2 * inputs * inp.batch * inp.seq * shape.hidden * 2 / pcie
    copy_s = inputs_s + 2 * attentions * saved_attention_bytes(shape, inp) / pcie
    return max(OFFLOAD_EXPOSED * inputs_s, copy_s - busy_s)


def predict_step_time(shape: Shape, inp, gpu: dict) -> StepTime:
    """Seconds per optimizer step of a plan's inputs (nb_helpers.plan.planner.PlanInput) on `gpu`."""
    by_kind = gpu_seconds_by_kind(work_per_micro_step(shape, inp), gpu)
    busy = sum(by_kind.values())
    busy += offload_seconds(shape, inp, gpu, busy)
    host = host_seconds_per_micro_step(shape, inp)
    graphed = inp.graphs and inp.gradient_checkpointing
    micro = busy + host if graphed else max(busy, host)
    step = 0.0 if getattr(inp, "one_token_count", False) else STEP_S  # overlapped with the GPU's backward
    return StepTime(gpu["name"], inp.accum * micro + step, inp.accum * busy, inp.accum * host,
                    {k: inp.accum * v for k, v in by_kind.items()}, inp.accum * inp.batch * inp.seq)


# --- which GPU a run's time is for --------------------------------------------------------------------------------
def timing_gpu(cfg) -> dict | None:
    """The GPU a run's time is predicted for: its card (cfg.card), whatever GPU emulates it; without a card, this
    machine's GPU where the model knows it (the H200 it was measured on); on a machine without a GPU, the course's
    card (a GTX 1650). None for a GPU the model does not know."""
    from nb_helpers.plan.cards import COURSE_CARD, find_card, run_card

    card = run_card(cfg)
    if card is not None:
        return card.compute()
    name = this_gpu_name()
    if name is None:
        return find_card(COURSE_CARD).compute()
    return H200 if "H200" in name else None


def this_gpu_name() -> str | None:
    """This machine's GPU, None without one, "" for one whose name cannot be read (then the model does not know it)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a planner must answer where CUDA cannot initialise
        return ""


def optimizer_steps(cfg) -> int | None:
    """The run's optimizer steps: max_steps, else epochs over the training rows (non-empty lines of train_file, at
    most max_train_samples); None when the file cannot be read."""
    import math

    if cfg.max_steps > 0:
        return cfg.max_steps
    try:
        with open(cfg.resolve_path(cfg.train_file), encoding="utf-8", errors="replace") as f:
            rows = sum(1 for line in f if line.strip())
    except (OSError, TypeError):
        return None
    rows = min(rows, cfg.max_train_samples) if cfg.max_train_samples else rows
    return math.ceil(rows / cfg.effective_batch) * math.ceil(cfg.num_train_epochs) if rows else None


def time_line(planned, cfg) -> str | None:
    """One line for a plan: its predicted step time on the run's GPU (timing_gpu), and the whole run's."""
    gpu = timing_gpu(cfg)
    return None if gpu is None else line_for(predict_step_time(planned.shape, planned.inputs, gpu), gpu, cfg)


def line_for(predicted: StepTime, gpu: dict, cfg) -> str:
    steps = optimizer_steps(cfg)
    whole = f"; {steps} steps: ~{duration(predicted.step_s * steps)}" if steps else ""
    where = "measured there within 15% at 12 of 14 points" if gpu is H200 else \
        "a model from H200 measurements and this card's spec sheet, not a measurement"
    return f"time: {predicted.describe()}{whole} ({where})"


def duration(seconds: float) -> str:
    """'45 s', '12 min', '3.5 h': a whole run's time at the precision a prediction has."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 90 * 60 else f"{seconds / 3600:.1f} h"


def predicted_time(planned, cfg, verbose: bool = True) -> dict:
    """summary.json's predicted_step_s and predicted_step_gpu for what will train; says the time line once."""
    gpu = timing_gpu(cfg)
    if gpu is None:
        return {"predicted_step_s": None, "predicted_step_gpu": None, "predicted_for_this_gpu": False}
    predicted = predict_step_time(planned.shape, planned.inputs, gpu)
    if verbose:
        print(f"[plan] {line_for(predicted, gpu, cfg)}")
    here = this_gpu_name() or ""
    return {"predicted_step_s": predicted.step_s,
            "predicted_step_gpu": gpu["name"],
            "predicted_for_this_gpu": any(name in here for name in gpu.get("device_names", ()))}


def time_note(summary: dict) -> str:
    """The time model's seconds per step beside the run's measured median, compared only where both are one GPU."""
    predicted, gpu = summary.get("predicted_step_s"), summary.get("predicted_step_gpu")
    measured, device = summary.get("median_step_s"), str(summary.get("device") or "this machine")
    if predicted is None:
        return "No step-time prediction in this run (trained before the time model, or on a GPU it does not model)."
    said = f"Step time: predicted ~{predicted:.2f} s on the {gpu}"
    if measured is None:
        return said + "; the run measured none (too few steps)."
    if summary.get("predicted_for_this_gpu"):
        return said + f", measured {measured:.2f} s ({100 * (predicted / measured - 1):+.1f}%)."
    return (said + f" (the card this run planned for: a model, not a measurement); this run took {measured:.2f} s "
            f"per step on {device}, which is not that card.")
