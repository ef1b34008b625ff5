"""The VRAM planner: components against hand-computed bytes, `plan` exit codes, auto-fit's choice logic."""

import json
from dataclasses import asdict

import pytest

from nb_helpers.plan import activations, choose, planner
from nb_helpers.plan.choose import auto_fit, candidates
from nb_helpers.plan.planner import ALL_LINEAR, GIB, QKVO, PlanInput, Shape, plan

# A small Llama: h=64, i=128, 2 layers, 4 heads of 16, 2 KV heads, vocab 1000, untied.
SMALL = Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=1000, tied=False)
TINYLLAMA = Shape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, head_dim=64, vocab=32000,
                  tied=False, max_positions=2048)


def small_input(**changes):
    """The older path (peft's prepare_model_for_kbit_training: fp32 embeddings, head and norms; stock layers; masks)."""
    base = dict(seq=32, batch=1, accum=2, rank=4, targets=QKVO, gradient_checkpointing=True, context_gib=0.25,
                gpu_capability=(8, 6), lean=False, fused_kernels=False, nomask=False, expandable=False)
    return PlanInput(**{**base, **changes})


def lean_input(**changes):
    """The GPU path (nb_helpers.fast): 16-bit embeddings, head, norms and residual stream; fused SwiGLU; no mask."""
    return small_input(**{"lean": True, "fused_kernels": True, "nomask": True, "expandable": True, **changes})


def test_static_components_match_hand_computed_bytes():
    p = plan(SMALL, small_input())
    c = p.components
    # q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64 -> 36864 weights per layer, 2 layers
    linear = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert linear == SMALL.linear_params == 73728
    assert c["weights_4bit"] == linear / 2
    assert c["quant_constants"] == pytest.approx(linear / 64 + 4 * linear / 16384)
    assert c["embeddings_head"] == 4 * 2 * 1000 * 64  # fp32 after prepare_model_for_kbit_training, untied
    assert c["norms"] == 4 * (2 * 2 + 1) * 64
    # LoRA r=4 on q,k,v,o: A is r x in, B is out x r
    lora = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4 + 4 * 64 + 32 * 4 + 4 * 64 + 64 * 4)
    assert c["lora_weights"] == 2 * lora  # bf16 (TRL casts them)
    assert c["lora_grads"] == 2 * lora  # accumulation 2 keeps them between micro-batches
    # every LoRA tensor here is under 4096 values: bitsandbytes keeps fp32 moments (8 bytes per value), and under the
    # 100,000 values a paged optimizer needs before it pages: all of it is allocator memory
    assert c["optimizer"] == 8 * lora and c["optimizer_paged"] == 0
    assert c["context"] == 0.25 * GIB
    assert c["cublas"] == 2 * 8.125 * 2**20  # compute capability 8.6: two pre-Hopper workspaces


def test_activation_components_match_hand_computed_bytes():
    inp = small_input()
    per_token = activations.layer_activation_bytes_per_token(SMALL, inp, padded=False)
    norms = 2 * (4 * 64 + 4)
    attention = 4 * 4 * 16 + 4 * 2 * 16 + 4 * 4  # q,out bf16 + k,v bf16 + lse
    mlp = 12 * 128
    lora = 3 * 64 * 4 + 4 * 2 * 4  # dropout output (2) + mask (1) per input feature, + 2r for lora_A's output
    assert per_token == norms + attention + mlp + lora
    padded = activations.layer_activation_bytes_per_token(SMALL, inp, padded=True)
    assert padded - per_token == (8 * 64 - 4 * 64 - 4 * 32) + 2 * 32  # k, v repeated to all heads + mask bias
    no_dropout = activations.layer_activation_bytes_per_token(SMALL, small_input(lora_dropout=0.0), padded=False)
    assert per_token - no_dropout == 4 * 64  # one bool mask per target input feature

    c = plan(SMALL, inp).components
    T = 32
    kept = 2 * 4 * 64 * T + 2 * T * 16 * 4 + 4 * 64 * T  # fp32 layer inputs + cos/sin + final norm input
    assert c["activations_kept"] == kept
    no_gc = plan(SMALL, small_input(gradient_checkpointing=False)).components
    assert no_gc["activations_kept"] == 2 * per_token * T + 2 * T * 16 * 4 + 4 * 64 * T
    assert no_gc["layer_recompute"] == 0


def test_lean_path_components_match_hand_computed_bytes():
    c = plan(SMALL, lean_input()).components
    assert c["embeddings_head"] == 2 * 2 * 1000 * 64  # bf16, untied: nothing upcast
    assert c["norms"] == 2 * (2 * 2 + 1) * 64
    assert c["upcast"] == 0  # no fp32 copy while loading either
    assert c["allocator"] == planner.EXPANDABLE_OVERHEAD_GIB * GIB  # expandable segments: flat
    dynamic = sum(c[k] for k in ("activations_kept", "layer_recompute", "logits_loss", "backward_transient"))
    fixed = plan(SMALL, lean_input(expandable=False)).components["allocator"]
    assert fixed == pytest.approx(planner.ALLOCATOR_OVERHEAD_GC_LEAN * dynamic)
    per_token = activations.layer_activation_bytes_per_token(SMALL, lean_input(), padded=True)
    norms = 2 * (2 * 64 + 4)  # bf16 input + fp32 rstd, twice
    attention = 4 * 4 * 16 + 4 * 2 * 16 + 4 * 4  # padded, but without a mask: flash, k and v not repeated
    mlp = 2 * 2 * 128  # liger's SwiGLU keeps gate and up (bf16) only
    lora = 3 * 64 * 4 + 4 * 2 * 4
    assert per_token == norms + attention + mlp + lora
    T = 32
    assert c["activations_kept"] == 2 * 2 * 64 * T + 2 * T * 16 * 4 + 2 * 64 * T  # bf16 checkpoints
    assert c["layer_recompute"] == per_token * T
    N = 31
    tile = min(N, activations.LOGPROB_TOKEN_TILE) * 1000 * 2  # logits tile in bf16; the bf16 head is not copied
    loss_phase = plan(SMALL, lean_input(seq=4096, batch=1, rank=1, targets=("q_proj",)))
    assert loss_phase.peak_gib > 0 and tile == 62000
    stock = activations.layer_activation_bytes_per_token(SMALL, lean_input(fused_kernels=False), padded=False)
    # SiLU's output, kept by the stock MLP; the stock RMSNorm keeps an fp32 copy of its bf16 input (liger: bf16)
    assert stock - per_token == 2 * 128 + 2 * (4 - 2) * 64
    masked = activations.layer_activation_bytes_per_token(SMALL, lean_input(nomask=False), padded=True)
    assert masked - per_token == (8 * 64 - 4 * 64 - 4 * 32) + 2 * 32


def test_lean_path_needs_less_than_the_upcast_path():
    for seq, batch in ((512, 1), (512, 8), (2048, 4)):
        old = plan(TINYLLAMA, PlanInput(seq=seq, batch=batch, lean=False, fused_kernels=False, nomask=False))
        new = plan(TINYLLAMA, PlanInput(seq=seq, batch=batch))
        assert new.peak_gib < old.peak_gib - 0.3


def test_more_tokens_rank_and_targets_cost_more_and_gc_saves():
    base = plan(TINYLLAMA, PlanInput(seq=512, batch=1)).peak_gib
    assert plan(TINYLLAMA, PlanInput(seq=2048, batch=1)).peak_gib > base
    assert plan(TINYLLAMA, PlanInput(seq=512, batch=8)).peak_gib > base
    assert plan(TINYLLAMA, PlanInput(seq=512, rank=64, targets=ALL_LINEAR)).peak_gib > base
    assert plan(TINYLLAMA, PlanInput(seq=2048, gradient_checkpointing=False)).peak_gib > \
        plan(TINYLLAMA, PlanInput(seq=2048)).peak_gib + 2
    assert plan(TINYLLAMA, PlanInput(double_quant=False)).components["quant_constants"] > \
        3 * plan(TINYLLAMA, PlanInput()).components["quant_constants"]


def test_reference_recipe_fits_4gib_and_long_no_gc_does_not():
    assert plan(TINYLLAMA, PlanInput(), budget_gib=4.0).fits
    result = plan(TINYLLAMA, PlanInput(seq=2048, gradient_checkpointing=False), budget_gib=4.0)
    assert result.fits is False
    assert result.verdict().startswith(f"predicted peak: {result.peak_gib:.2f} GiB (budget 4.00 GiB: does not fit")


def test_unknown_target_and_loss_are_refused():
    with pytest.raises(ValueError, match="lm_head"):
        plan(SMALL, small_input(targets=("lm_head",)))
    with pytest.raises(ValueError, match="trl-fused"):
        plan(SMALL, small_input(loss="naive"))


def test_shape_reads_config_json(tmp_path):
    config = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
              "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False,
              "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = planner.load_shape(str(tmp_path))
    assert shape.linear_params == TINYLLAMA.linear_params and shape.head_dim == 64 and not shape.tied
    # the 4-bit part agrees with the older preflight estimate
    from nb_helpers.preflight import four_bit_weight_bytes
    from transformers import LlamaConfig

    c = plan(shape, PlanInput()).components
    ours = c["weights_4bit"] + c["quant_constants"] + c["embeddings_head"] + c["norms"]  # 16-bit on the lean path
    assert ours == pytest.approx(four_bit_weight_bytes(LlamaConfig(**config)), rel=0.01)


# --- plan CLI --------------------------------------------------------------------------------------------------
def run_plan(capsys, *args):
    from nb_helpers.cli import main

    code = main(["plan", *args])
    return code, capsys.readouterr().out


def test_plan_cli_exit_codes_and_last_line(tmp_path, capsys, tiny_model_dir):
    code, out = run_plan(capsys, "--model", str(tiny_model_dir), "--seq", "128", "--batch", "2", "--budget", "4",
                         "--context-gib", "0.3")
    assert code == 0
    last = out.strip().splitlines()[-1]
    assert last.startswith("predicted peak: ") and last.endswith("(budget 4.00 GiB: fits)")
    assert "activations kept across layers" in out and "LM head + loss (fused)" in out

    code, out = run_plan(capsys, "--model", str(tiny_model_dir), "--seq", "128", "--budget", "0.2",
                         "--context-gib", "0.3")
    assert code == 3 and out.strip().endswith("does not fit)")


def test_plan_cli_prints_auto_fit_and_json(capsys, tiny_model_dir):
    code, out = run_plan(capsys, "--model", str(tiny_model_dir), "--seq", "64", "--context-gib", "0.3",
                         "--auto-fit")
    assert code == 0 and "auto-fit for effective batch 8: micro-batch 8 x accumulation 1" in out
    code, out = run_plan(capsys, "--model", str(tiny_model_dir), "--json", "--no-gc", "--targets", "all-linear")
    data = json.loads(out)
    assert data["inputs"]["gradient_checkpointing"] is False and len(data["inputs"]["targets"]) == 7
    assert data["peak_gib"] == pytest.approx(sum(data["components_gib"].values()))


def test_plan_cli_bad_input_is_one_clear_line(capsys, tmp_path):
    from nb_helpers.cli import main

    assert main(["plan", "--model", str(tmp_path / "missing"), "--budget", "4"]) == 2
    assert "no such folder" in capsys.readouterr().err  # checked with the settings, before any hub lookup
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 100}))
    assert main(["plan", "--model", str(tmp_path), "--targets", "qproj"]) == 2
    assert "not linear layers" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path), "--rank", "0"]) == 2
    assert "--rank 0" in capsys.readouterr().err


# --- auto-fit ------------------------------------------------------------------------------------------------
def test_candidates_keep_the_effective_batch_and_prefer_fewer_micro_steps():
    options = candidates(TINYLLAMA, PlanInput(seq=512), effective_batch=8, budget_gib=4.0)
    assert options and all(o.batch * o.accum == 8 for o in options)
    assert all(o.predicted_gib <= 4.0 * (1 - choose.FIT_MARGIN) for o in options)
    accums = [o.accum for o in options]
    assert accums == sorted(accums)  # fewer micro-steps first, then the cheaper compute within each
    for accum in set(accums):
        costs = [o.relative_step_cost for o in options if o.accum == accum]
        assert costs == sorted(costs)


def test_graphed_candidates_come_first_and_eager_ones_remain_for_tight_budgets():
    """With CUDA graphs each checkpointed choice is also offered graphed, before the eager ones of the same
    micro-batch (the host-bound step is where the time goes); a graph's memory pool is counted, so a budget too
    tight for it leaves the eager ones."""
    base = PlanInput(seq=512, graphs=True, context_gib=0.6, gpu_capability=(9, 0))
    options = candidates(TINYLLAMA, base, effective_batch=8, budget_gib=4.0)
    assert options[0].graphs and options[0].batch == 8 and any(not o.graphs for o in options)
    for accum in {o.accum for o in options}:
        kinds = [o.graphs for o in options if o.accum == accum]
        assert kinds == sorted(kinds, reverse=True)
    assert [o.accum for o in options] == sorted(o.accum for o in options)
    assert all(o.gradient_checkpointing for o in options if o.graphs)
    assert "layers as CUDA graphs" in options[0].describe()
    graphed, eager = (planner.plan(TINYLLAMA, PlanInput(**{**vars(base), "batch": 8, "accum": 1, "graphs": g}))
                      for g in (True, False))
    assert graphed.components["graphs"] > 0 and eager.components["graphs"] == 0
    assert graphed.peak_gib > eager.peak_gib
    tight = eager.peak_gib / (1 - choose.FIT_MARGIN) + 0.01  # 8 x 1 fits eagerly only
    first = candidates(TINYLLAMA, base, effective_batch=8, budget_gib=tight)
    assert any((o.batch, o.graphs) == (8, False) for o in first)
    assert not any((o.batch, o.graphs, o.offload) == (8, True, False) for o in first)


def test_auto_fit_steps_down_on_oom_and_says_so():
    class FakeOutOfMemoryError(RuntimeError):
        pass

    tried, said = [], []

    def trial(option):
        tried.append((option.batch, option.gradient_checkpointing))
        if option.batch > 2:
            raise FakeOutOfMemoryError("CUDA out of memory (injected)")
        return 3.1

    choice = auto_fit(TINYLLAMA, PlanInput(seq=512), 8, 4.0, trial=trial, log=said.append)
    assert choice.batch <= 2 and choice.batch * choice.accum == 8
    assert tried[0][0] > 2 and len(tried) >= 2
    assert any("ran out of memory in the trial step; stepping down" in line for line in said)
    assert said[-1].startswith("[auto-fit] chose") and "effective batch stays 8" in said[-1]


def test_auto_fit_steps_down_when_the_trial_measures_over_budget():
    measured = {True: 3.5, False: 4.4}  # without GC the trial measures more than the budget
    choice = auto_fit(TINYLLAMA, PlanInput(seq=512), 8, 4.0, trial=lambda o: measured[o.gradient_checkpointing],
                      log=lambda *_: None)
    assert choice.gradient_checkpointing


def test_auto_fit_reraises_other_errors_and_explains_nothing_fits():
    def broken(option):
        raise ValueError("not an OOM")

    with pytest.raises(ValueError):
        auto_fit(TINYLLAMA, PlanInput(seq=512), 8, 4.0, trial=broken, log=lambda *_: None)
    with pytest.raises(MemoryError, match="nothing fits 1.00 GiB"):
        auto_fit(TINYLLAMA, PlanInput(seq=512), 8, 1.0, log=lambda *_: None)


def test_trial_step_runs_the_fused_loss_and_leaves_no_gradients(tiny_cfg):
    import torch

    from nb_helpers.models import ModelChoice, load_4bit
    from nb_helpers.lora import attach_lora
    from nb_helpers.autofit import _FUSED_HEADS, trial_step

    model = attach_lora(load_4bit(tiny_cfg, ModelChoice(tiny_cfg.model, "tiny", "test")), tiny_cfg)
    for checkpointing in (True, False):
        trial_step(model, 2, 64, checkpointing, torch.bfloat16, vocab=200)
        assert all(p.grad is None for p in model.parameters())
    assert model in _FUSED_HEADS


def test_plan_for_config_follows_the_run_config(tiny_cfg):
    from nb_helpers.plan.planner import load_shape, plan_for_config

    shape = load_shape(tiny_cfg.model)
    a = plan_for_config(tiny_cfg, shape, context_gib=0.3, gpu_capability=(8, 6))
    assert a.inputs.batch == tiny_cfg.micro_batch_size and a.inputs.seq == tiny_cfg.max_length
    b = plan_for_config(tiny_cfg.replace(lora_r=64, target_modules=["all-linear"]), shape, context_gib=0.3,
                        gpu_capability=(8, 6))
    assert b.components["lora_weights"] > a.components["lora_weights"]
    turing = plan_for_config(tiny_cfg, shape, context_gib=0.3, gpu_capability=(7, 5))
    assert turing.inputs.compute_dtype == "float16"  # no bf16 on Turing: fp32 adapters
    assert turing.components["lora_weights"] == 2 * a.components["lora_weights"]


# --- on the GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_oom_guard_frees_the_gpu_and_names_the_knob(tiny_cfg):
    """A real CUDA OOM (a 0.25 GiB allocator cap, 64 x 512-token sequences without GC) stops the run cleanly:
    advice with the planner's numbers, status oom, metrics kept, and the memory handed back to the process."""
    import torch

    from nb_helpers.training import train

    cfg = tiny_cfg.replace(micro_batch_size=64, max_length=512, gradient_checkpointing=False, max_train_samples=64,
                           task_eval_samples=0, eval_file=None)
    from nb_helpers import metrics
    from nb_helpers.plan import memory

    # What enforce_budget will count as the context in this process: a fresh process's context plus whatever earlier
    # tests left outside the allocator (loaded kernels, paged buffers); 0.76 GiB after the fast-path tests, where a
    # fresh process measures 0.60 (H200, 2026-11-30), which left this test no allocator at all.
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    memory.record_nvml_baseline(0)
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    context = memory.outside_allocator_gib(0)
    before = torch.cuda.memory_allocated()  # earlier tests' leftovers (cuBLAS workspaces: 2 x 32 MiB on Hopper)
    try:
        with pytest.raises(RuntimeError) as err:
            train(cfg.replace(budget_gib=round(context + 0.25, 2)), verbose=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    message = str(err.value)
    assert "ran out of memory" in message and "micro_batch_size 64 -> 32" in message and "[planner:" in message
    assert torch.cuda.memory_allocated() - before < 64 * 2**20  # the model, activations and optimizer are gone
    run_dir = sorted(cfg.resolve_path(cfg.runs_dir).glob("2*"))[-1]
    import json as _json

    assert _json.loads((run_dir / "summary.json").read_text())["status"] == "oom"
    steps = [r["step"] for r in metrics.read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # every finished step is kept, in order, up to the OOM


@pytest.mark.gpu
def test_auto_fit_keeps_the_effective_batch_on_gpu(tiny_cfg, capsys):
    import json as _json

    from nb_helpers.training import train

    run_dir = train(tiny_cfg.replace(micro_batch_size=1, grad_accum=8, auto_fit=True, budget_gib=4.0, max_steps=2,
                                     task_eval_samples=0))
    chosen = _json.loads((run_dir / "config.json").read_text())
    assert chosen["micro_batch_size"] * chosen["grad_accum"] == 8 and chosen["micro_batch_size"] > 1
    assert "[auto-fit] chose micro-batch" in capsys.readouterr().out
    summary = _json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["predicted_peak_gib"] < 4.0


def test_auto_fit_without_a_gpu_says_so_and_keeps_the_settings(tiny_cfg, capsys, no_gpu):
    import json as _json

    from nb_helpers.training import train

    run_dir = train(tiny_cfg.replace(auto_fit=True, max_steps=1, task_eval_samples=0, eval_file=None))
    out = capsys.readouterr().out
    assert "[auto-fit] needs a CUDA GPU; keeping micro_batch_size and grad_accum as set" in out
    assert "[plan] no GPU here; for a GTX 1650-class card" in out
    saved = _json.loads((run_dir / "config.json").read_text())
    assert (saved["micro_batch_size"], saved["grad_accum"]) == (tiny_cfg.micro_batch_size, tiny_cfg.grad_accum)
    assert _json.loads((run_dir / "summary.json").read_text())["predicted_peak_gib"] > 0


def test_short_rows_let_auto_fit_drop_checkpointing():
    """The shipped rows are ~120 tokens: fitted at that length, 8 x 1 fits 4 GiB without GC; at max_length it
    does not, which is why train() fits for the longest row rather than max_length."""
    from nb_helpers.config import PROJECT_ROOT
    from nb_helpers.plan.planner import load_shape

    shape = load_shape(str(PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "tinyllama-1.1b.json"))
    base = dict(batch=1, accum=8, rank=8, context_gib=0.6, gpu_capability=(9, 0))
    short = auto_fit(shape, PlanInput(seq=128, **base), 8, 4.0, log=lambda *_: None)
    full = auto_fit(shape, PlanInput(seq=512, **base), 8, 4.0, log=lambda *_: None)
    assert (short.batch, short.gradient_checkpointing) == (8, False)
    assert full.gradient_checkpointing or full.batch < 8


def test_validated_llama_predictions_are_unchanged():
    """Every point of the committed planner validation (bench/planner_report.py's run file, which bench/RESULTS.md
    cites; H200, Llama shapes) is predicted as it was validated.
    The three lever runs on the lean path without fused kernels are the exception, on purpose: the stock RMSNorm
    keeps an fp32 copy of its 16-bit input (counted with saved-tensor hooks), which those predictions missed, and
    counting it brings each closer to its measurement."""
    import sys

    from nb_helpers.config import PROJECT_ROOT

    sys.path.insert(0, str(PROJECT_ROOT / "bench"))
    from build_tinyllama_shape import shape_config

    latest = json.loads((PROJECT_ROOT / "bench" / "results" / "latest.json").read_text())
    rows = json.loads((PROJECT_ROOT / latest["planner"]["run_file"]).read_text())["results"]["points"]
    assert len(rows) == latest["planner"]["points"] >= 200
    for r in rows:
        shape = Shape.from_config(shape_config(r["shape"]), name=r["shape"])
        inp = PlanInput(seq=r["seq"], batch=r["batch"], accum=r["accum"], rank=r["rank"],
                        targets=ALL_LINEAR if r["targets"] == "all-linear" else QKVO, gradient_checkpointing=r["gc"],
                        context_gib=r["context_gib"], gpu_capability=(9, 0), **r["path"])
        now = plan(shape, inp).peak_gib
        if r["path"]["lean"] and not r["path"]["fused_kernels"]:
            assert abs(now - r["measured_gib"]) <= abs(r["predicted_gib"] - r["measured_gib"]) + 1e-3, r["id"]
        else:
            assert now == pytest.approx(r["predicted_gib"], abs=0.0015), r["id"]  # stored rounded to 3 decimals


def test_offloaded_checkpoints_leave_the_card_and_buy_a_bigger_micro_batch():
    """With GC, offload removes exactly (layers - 2) x tokens x hidden x 2 bytes from what the card keeps (the first
    layer's input is the embedding output, and one more input is always on the card, in flight to or from CPU RAM);
    at 8 x 2048 on TinyLlama in 4 GiB that is what lets auto-fit pick 8 x 1 (measured 3.18 GiB on the H200,
    bench/results/runs/) instead of 4 x 2; at 8 x 512, where 8 x 1 fits anyway, it keeps the checkpoints
    on the card (no copies)."""
    from nb_helpers.config import PROJECT_ROOT
    from nb_helpers.plan.planner import load_shape

    shape = load_shape(str(PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "tinyllama-1.1b.json"))
    base = dict(batch=8, accum=1, rank=8, context_gib=0.6, gpu_capability=(9, 0), seq=2048)
    on_card = plan(shape, PlanInput(**base))
    offloaded = plan(shape, PlanInput(**base, offload=True))
    kept = on_card.components["activations_kept"] - offloaded.components["activations_kept"]
    assert kept == (shape.layers - 2) * 2 * shape.hidden * 8 * 2048
    assert any("pinned CPU RAM" in note for note in offloaded.notes)
    fit = dict(batch=1, accum=8, rank=8, context_gib=0.6, gpu_capability=(9, 0))
    long = auto_fit(shape, PlanInput(seq=2048, **fit), 8, 4.0, log=lambda *_: None)
    assert (long.batch, long.gradient_checkpointing, long.offload) == (8, True, True)
    no_offload = auto_fit(shape, PlanInput(seq=2048, **fit), 8, 4.0, log=lambda *_: None, offload_allowed=False)
    assert (no_offload.batch, no_offload.offload) == (4, False)
    short = auto_fit(shape, PlanInput(seq=512, **fit), 8, 4.0, log=lambda *_: None)
    assert (short.batch, short.offload) == (8, False)


def test_hand_set_runs_drop_graphs_the_budget_cannot_hold(capsys, monkeypatch):
    """Without auto-fit, a run whose graphed layers the planner puts over the budget (and whose eager layers fit)
    trains eagerly and says why; with room for them it keeps them. (The levers whose memory depends on the budget are
    off, so that the plans at the two budgets differ by the graphs alone.)"""
    from types import SimpleNamespace

    monkeypatch.setenv("NB_FASTPATH", "absmax_once=0")
    from nb_helpers.config import PROJECT_ROOT, RunConfig
    from nb_helpers.plan.planner import load_shape, plan_for_config
    from nb_helpers.autofit import keep_graphs_within_budget

    shape = load_shape(str(PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "tinyllama-1.1b.json"))
    cfg = RunConfig(max_length=512, micro_batch_size=1, grad_accum=8, cuda_graphs=True, fast_path=True)
    graphed = plan_for_config(cfg, shape, context_gib=0.6)
    eager = plan_for_config(cfg.replace(cuda_graphs=False), shape, context_gib=0.6)
    assert graphed.peak_gib > eager.peak_gib
    between = (graphed.peak_gib + eager.peak_gib) / 2 / (1 - choose.FIT_MARGIN)
    for budget, keeps in ((between, False), (graphed.peak_gib / (1 - choose.FIT_MARGIN) + 0.01, True)):
        run = SimpleNamespace(cfg=cfg.replace(budget_gib=budget), shape=shape, summary={"cuda_context_gib": 0.6},
                              prediction=plan_for_config(cfg.replace(budget_gib=budget), shape, context_gib=0.6))
        keep_graphs_within_budget(run)
        assert run.cfg.cuda_graphs is keeps
        assert (run.prediction.components["graphs"] > 0) is keeps
    assert capsys.readouterr().out.count("CUDA graphs off for this run") == 1


def test_hand_set_runs_stay_lean_unless_graphs_are_asked_for(capsys):
    """cuda_graphs unset: a hand-set run (the reference's 1 x 8) plans and runs eager layers, as lean as the recipe,
    and says once what graphs would cost; auto-fit weighs graphed candidates; cuda_graphs=False keeps them out of
    auto-fit too."""
    from types import SimpleNamespace

    from nb_helpers.config import PROJECT_ROOT, RunConfig
    from nb_helpers.plan.choose import auto_fit
    from nb_helpers.plan.planner import load_shape, plan_for_config
    from nb_helpers.autofit import keep_graphs_within_budget

    shape = load_shape(str(PROJECT_ROOT / "nb_helpers" / "plan" / "shapes" / "tinyllama-1.1b.json"))
    cfg = RunConfig(max_length=512, micro_batch_size=1, grad_accum=8, budget_gib=4.0, fast_path=True)
    lean = plan_for_config(cfg, shape, context_gib=0.6)
    graphed = plan_for_config(cfg.replace(cuda_graphs=True), shape, context_gib=0.6)
    assert lean.components["graphs"] == 0 and graphed.components["graphs"] > 0
    run = SimpleNamespace(cfg=cfg, shape=shape, summary={"cuda_context_gib": 0.6}, prediction=lean)
    keep_graphs_within_budget(run)
    assert run.cfg.cuda_graphs is None and run.prediction is lean
    out = capsys.readouterr().out
    assert "cuda_graphs=True" in out and f"{graphed.peak_gib - lean.peak_gib:.2f} GiB more" in out

    fitting = plan_for_config(cfg.replace(auto_fit=True), shape, context_gib=0.6).inputs
    assert auto_fit(shape, fitting, 8, 4.0, log=lambda *_: None).graphs
    never = plan_for_config(cfg.replace(auto_fit=True, cuda_graphs=False), shape, context_gib=0.6).inputs
    assert not auto_fit(shape, never, 8, 4.0, log=lambda *_: None).graphs


def test_a_gpu_planned_from_a_machine_without_it_runs_the_gpu_extras(monkeypatch):
    """Planned from a CPU (or for another GPU), the plan is for what `make` installs beside an NVIDIA driver:
    liger's fused layers, whatever this machine has installed; `gpu_extras=False` plans a GPU without them. Planned
    from a CPU without liger, the stock MLP's extra saved tensor made plans up to 20% high (issue 26)."""
    from nb_helpers.config import RunConfig
    from nb_helpers.fast import plan_terms
    from nb_helpers.plan import dtypes
    from nb_helpers.plan.catalog import known_shape
    from nb_helpers.plan.planner import plan_for_config

    monkeypatch.setattr(plan_terms, "kernels_installed", lambda: False)
    monkeypatch.setattr(dtypes, "cuda_capability", lambda: None)
    shape, cfg = known_shape("tinyllama-1.1b"), RunConfig(max_length=2048, gradient_checkpointing=False,
                                                          fast_path=True)
    assumed = plan_for_config(cfg, shape, context_gib=0.6, gpu_capability=(9, 0))
    without = plan_for_config(cfg, shape, context_gib=0.6, gpu_capability=(9, 0), gpu_extras=False)
    assert assumed.inputs.fused_kernels and not without.inputs.fused_kernels
    assert assumed.peak_gib < without.peak_gib
    # planning this machine's own GPU follows what is installed here
    monkeypatch.setattr(dtypes, "cuda_capability", lambda: (9, 0))
    assert not plan_for_config(cfg, shape, context_gib=0.6).inputs.fused_kernels
    assert plan_for_config(cfg, shape, context_gib=0.6, gpu_capability=(7, 5)).inputs.fused_kernels


def test_the_absmax_kept_decoded_costs_four_bytes_per_block_and_only_with_double_quant(monkeypatch, tiny_cfg):
    """fast.fused_lora.keep_decoded_absmax keeps one fp32 per 64 weights beside the 8-bit codes: the planner counts it
    where the lever runs (the GPU path's default), and not where it is off or there is nothing to decode."""
    from nb_helpers.plan.planner import load_shape, plan_for_config

    linear = TINYLLAMA.linear_params
    assert plan(TINYLLAMA, PlanInput(absmax_once=True)).components["absmax_decoded"] == 4 * linear / 64
    assert plan(TINYLLAMA, PlanInput(absmax_once=True, double_quant=False)).components["absmax_decoded"] == 0
    assert plan(TINYLLAMA, PlanInput(absmax_once=False)).components["absmax_decoded"] == 0
    shape = load_shape(tiny_cfg.model)
    on = plan_for_config(tiny_cfg, shape, context_gib=0.3, gpu_capability=(8, 6))
    monkeypatch.setenv("NB_FASTPATH", "absmax_once=0")
    off = plan_for_config(tiny_cfg, shape, context_gib=0.3, gpu_capability=(8, 6))
    assert on.inputs.absmax_once and not off.inputs.absmax_once
    assert on.peak_bytes - off.peak_bytes == pytest.approx(4 * shape.linear_params / 64)


def test_the_absmax_is_kept_decoded_only_where_it_is_a_small_share_of_the_budget(tiny_cfg):
    """At most 2% of the budget (plan.architecture.keeps_decoded_absmax): TinyLlama's 58 MiB at 4 GiB is kept, a 4B
    model's 0.21 GiB is not; without a budget (the whole GPU) always; the planner plans what the run will keep."""
    from nb_helpers.plan.architecture import absmax_kept_bytes, keeps_decoded_absmax
    from nb_helpers.plan.catalog import known_shape
    from nb_helpers.plan.planner import plan_for_config

    tiny, big = known_shape("tinyllama-1.1b"), known_shape("qwen3-4b")
    assert absmax_kept_bytes(tiny.linear_params) / 2**30 < 0.02 * 4.0 < absmax_kept_bytes(big.linear_params) / 2**30
    assert keeps_decoded_absmax(tiny.linear_params, 4.0) and not keeps_decoded_absmax(big.linear_params, 4.0)
    assert keeps_decoded_absmax(big.linear_params, None) and keeps_decoded_absmax(big.linear_params, 16.0)
    cfg = tiny_cfg.replace(budget_gib=4.0)
    assert plan_for_config(cfg, tiny, context_gib=0.3, gpu_capability=(8, 6)).components["absmax_decoded"] > 0
    assert plan_for_config(cfg, big, context_gib=0.3, gpu_capability=(8, 6)).components["absmax_decoded"] == 0
