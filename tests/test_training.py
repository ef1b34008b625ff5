import json
import math
from pathlib import Path

import pytest
import torch

from nb_helpers.config import ConfigError
from nb_helpers.metrics import read_metrics
from nb_helpers.runs import load_run
from nb_helpers.summary import SUMMARY_KEYS
from nb_helpers.training import train


def test_run_folder_is_complete(shared_run):
    cfg, run_dir = shared_run
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.json", "metrics.jsonl", "adapter", "summary.json", "training.png", "predictions.jsonl"} <= names
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["task_metric"] == "json_field_accuracy"
    assert 0 <= summary["task_base"] <= 1 and 0 <= summary["task_tuned"] <= 1
    assert (summary["peak_vram_gib"] is None) == (not torch.cuda.is_available())  # NVML's figure, on a GPU only
    assert summary["median_step_s"] > 0 and summary["tokens_per_s"] > 0

    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("epoch", "loss", "lr", "grad_norm", "tokens", "step_s", "tokens_per_s", "torch_allocated_gib",
                "torch_reserved_gib", "torch_peak_gib", "device_used_gib", "host_rss_gib"):
        assert key in steps[0], key
    assert all(r["tokens"] > 0 and math.isfinite(r["loss"]) for r in steps)
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before and after training

    assert (run_dir.parent / "latest").resolve() == run_dir.resolve()
    assert load_run(run_dir.parent / "latest").config["lora_r"] == cfg.lora_r


def test_adapter_loads_back_with_peft(shared_run, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = shared_run[1]
    assert not list(run_dir.glob("adapter/*.bin"))  # safetensors only
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, run_dir / "adapter")
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and any(p.abs().sum() > 0 for p in trained)  # B started at zero: training moved it


def test_same_run_name_never_overwrites(tiny_cfg, capsys):
    cfg = tiny_cfg.replace(run_name="mine", task_eval_samples=0, max_steps=1)
    first, second = train(cfg, verbose=False), train(cfg, verbose=False)
    assert first.name == "mine" and second.name == "mine-2"
    assert "nothing is overwritten" in capsys.readouterr().out


def test_interrupt_keeps_metrics_and_adapter(tiny_cfg):
    def interrupt_at_step_2(record):
        if record.get("step") == 2 and "loss" in record:
            raise KeyboardInterrupt

    run_dir = train(tiny_cfg.replace(task_eval_samples=0), listeners=[interrupt_at_step_2], verbose=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()


def test_unknown_target_module_lists_the_real_ones(tiny_cfg):
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\] do not exist.*'q_proj'"):
        train(tiny_cfg.replace(target_modules=["qkv_proj"]), verbose=False)


@pytest.mark.slow
def test_embedded_model_learns_the_task(embedded_dir, tmp_path):
    """Behaviour on the real model: 8 steps of 4 rows of the shipped task must lower held-out loss clearly."""
    from nb_helpers.config import RunConfig

    cfg = RunConfig(micro_batch_size=4, grad_accum=1, max_steps=8, max_length=256, max_train_samples=64,
                    max_eval_samples=16, task_eval_samples=0, gradient_checkpointing=False, learning_rate=4e-4,
                    runs_dir=str(tmp_path / "runs"))  # the CPU profile's rate: 8 steps are enough to learn
    summary = json.loads((train(cfg, verbose=False) / "summary.json").read_text())
    assert summary["model"] == "SmolLM2-135M-Instruct"
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.1, summary


@pytest.mark.gpu
def test_reference_recipe_under_a_4gib_budget(tiny_cfg):
    """On a GPU: the reference recipe (1 x 8, GC, paged_adamw_8bit) under enforce_budget(4) stays under 4 GiB."""
    run_dir = train(tiny_cfg.replace(micro_batch_size=1, grad_accum=8, budget_gib=4.0), verbose=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert 0 < summary["peak_vram_gib"] < 4.0


def test_periodic_eval_is_logged_once_per_eval_step(tiny_cfg):
    run_dir = train(tiny_cfg.replace(eval_steps=1, task_eval_samples=0), verbose=False)
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]  # the last one doubles as eval_loss_after
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss_after"] == evals[-1]["eval_loss"]


@pytest.mark.parametrize("dtype, adapter_dtype", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_adapter_weights_match_the_precision_mode(tiny_cfg, tmp_path, dtype, adapter_dtype):
    """TRL casts QLoRA adapters to bf16; fp16/fp32 runs need fp32 adapters (fp16 AMP cannot unscale bf16 grads)."""
    import torch

    from nb_helpers.models import ModelChoice, load_4bit, load_tokenizer
    from nb_helpers.training import TrainingRun, build_trainer
    from nb_helpers.lora import attach_lora

    cfg = tiny_cfg.replace(compute_dtype=dtype)
    choice = ModelChoice(cfg.model, "tiny", "test")
    model = attach_lora(load_4bit(cfg, choice), cfg)
    rows = [{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}]
    build_trainer(TrainingRun(cfg, choice, load_tokenizer(cfg.model), rows, model=model, run_dir=tmp_path))
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert dtypes == {getattr(torch, adapter_dtype)}


@pytest.mark.gpu
def test_fp16_training_runs_on_gpu(tiny_cfg):
    """The Turing path: fp16 mixed precision with a 4-bit base must train (GradScaler needs fp32 adapters)."""
    run_dir = train(tiny_cfg.replace(compute_dtype="float16", max_steps=2, task_eval_samples=0), verbose=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["compute_dtype"] == "float16"


# --- notebook 03 writes the trainer out; the package builds the same one ----------------------------------------

def notebook_03_code(marker: str) -> str:
    import nbformat

    from nb_helpers.config import PROJECT_ROOT

    nb = nbformat.read(PROJECT_ROOT / "notebooks" / "03_train.ipynb", as_version=4)
    found = [c.source for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(found) == 1, f"notebook 03 should have one code cell with {marker!r}, found {len(found)}"
    return found[0]


def sft_arguments(run, monkeypatch, cell: str | None = None) -> tuple[dict, dict]:
    """The keyword arguments notebook 03's SFTConfig(...) cell (or `cell`, a changed copy) and trainer_setup.sft_config
    pass to SFTConfig for this run, as called."""
    import torch
    import trl

    from nb_helpers.distributed import one_gpu_per_process
    from nb_helpers.plan.dtypes import resolve_compute_dtype
    from nb_helpers.trainer_setup import sft_config

    built, calls = trl.SFTConfig, []

    def recording(*args, **kwargs):
        assert not args, "SFTConfig takes keyword arguments only here"
        calls.append(kwargs)
        return built(**kwargs)

    monkeypatch.setattr(trl, "SFTConfig", recording)  # sft_config imports it from trl when called
    names = {"SFTConfig": recording, "torch": torch, "resolve_compute_dtype": resolve_compute_dtype,
             "one_gpu_per_process": one_gpu_per_process, "run": run}
    exec(cell or notebook_03_code("SFTConfig("), names)
    sft_config(run)
    assert len(calls) == 2, "the notebook cell and sft_config should each build one SFTConfig"
    return calls[0], calls[1]


def differences(notebook: dict, package: dict) -> dict:
    """{argument: (notebook's value, package's value)} wherever the two calls differ: a keyword only one of them
    passes (the other's side reads as missing), or another value."""
    missing = "(not passed)"
    return {k: (notebook.get(k, missing), package.get(k, missing)) for k in sorted(set(notebook) | set(package))
            if k not in notebook or k not in package or notebook[k] != package[k]}


@pytest.mark.parametrize("changes, rows", [
    ({}, [{"prompt": "q", "completion": "a"}]),
    ({"compute_dtype": "float32", "eval_steps": 2, "micro_batch_size": 4, "grad_accum": 2, "max_steps": 7},
     [{"prompt": "q", "completion": "a"}]),
    ({"completion_only_loss": True, "gradient_checkpointing": False, "lr_scheduler_type": "cosine"}, [{"text": "t"}]),
    ({"eval_steps": 0, "save_steps": 3, "logging_steps": 2, "seed": 7, "optim": "adamw_torch"}, []),
])
@pytest.mark.parametrize("world_size", [1, 2])
def test_notebook_sft_config_matches_the_package(tmp_path, monkeypatch, changes, rows, world_size):
    """Notebook 03's SFTConfig(...) cell, run against a TrainingRun, passes exactly the keyword arguments
    trainer_setup.sft_config passes, with the same values: the CLI trains with exactly the settings the notebook
    teaches, every argument written out in both (none added, left out or set differently in one of them)."""
    from nb_helpers.config import RunConfig
    from nb_helpers.training import TrainingRun

    run = TrainingRun(RunConfig(**changes), train_rows=rows, eval_rows=rows, run_dir=tmp_path, world_size=world_size)
    notebook, package = sft_arguments(run, monkeypatch)
    assert differences(notebook, package) == {}
    text_rows = bool(rows) and "text" in rows[0]
    assert notebook["completion_only_loss"] is (changes.get("completion_only_loss", True) and not text_rows)


@pytest.mark.parametrize("line, change, differs", [
    ('    save_strategy="steps",', "", "save_strategy"),  # left out: TRL's default is "steps", so only the name tells
    ("    save_total_limit=2,", "    save_total_limit=3,", "save_total_limit"),
    ("    pad_to_multiple_of=None,", "    pad_to_multiple_of=None, dataloader_drop_last=False,",
     "dataloader_drop_last"),  # one more, at TRL's default value
])
def test_the_agreement_check_notices_one_argument_changed(tmp_path, monkeypatch, line, change, differs):
    """The check above is a real one: a copy of notebook 03's cell with one argument left out, set differently or
    added, even at TRL's default value, differs from sft_config in exactly that argument."""
    from nb_helpers.config import RunConfig
    from nb_helpers.training import TrainingRun

    cell = notebook_03_code("SFTConfig(")
    found = [l for l in cell.splitlines() if l.split("#")[0].rstrip() == line]
    assert len(found) == 1, f"notebook 03's SFTConfig cell should have the line {line!r}"
    run = TrainingRun(RunConfig(), train_rows=[{"prompt": "q", "completion": "a"}], run_dir=tmp_path)
    notebook, package = sft_arguments(run, monkeypatch, cell.replace(found[0], change))
    assert list(differences(notebook, package)) == [differs]


def test_the_fast_path_sets_its_three_arguments_over_the_plain_ones(tmp_path, monkeypatch):
    """Notebook 03 writes the plain stack's checkpoints, token count and batch padding; they are what the fast path's
    trainer_arguments gives a plain-stack model (every lever off, whatever NB_FASTPATH says), and with
    fast_path=True sft_config passes the fast path's own values instead, every other argument as the notebook's."""
    from types import SimpleNamespace

    from nb_helpers import fast
    from nb_helpers.config import RunConfig
    from nb_helpers.fast.state import attach
    from nb_helpers.training import TrainingRun

    monkeypatch.setenv(fast.ENV_VAR, "reentrant=1,one_token_count=1,pad_lengths=1,graphs=1")
    decided = ("gradient_checkpointing_kwargs", "include_num_input_tokens_seen", "pad_to_multiple_of")
    plain_model = SimpleNamespace()
    attach(plain_model, fast.FastOptions.for_run(RunConfig()), use_graphs=False, no_recompute=0)
    rows = [{"prompt": "q", "completion": "a"}]
    notebook, package = sft_arguments(TrainingRun(RunConfig(), train_rows=rows, run_dir=tmp_path,
                                                  model=plain_model), monkeypatch)
    assert {k: notebook[k] for k in decided} == fast.trainer_arguments(plain_model)
    assert differences(notebook, package) == {}

    fast_model = SimpleNamespace()  # on this machine's levers with NB_FASTPATH: CPU halves, where they have one
    attach(fast_model, fast.FastOptions.for_run(RunConfig(fast_path=True)), use_graphs=False, no_recompute=0)
    run = TrainingRun(RunConfig(fast_path=True), train_rows=rows, run_dir=tmp_path, model=fast_model)
    notebook, package = sft_arguments(run, monkeypatch)
    assert {k: package[k] for k in decided} == fast.trainer_arguments(fast_model)
    assert set(differences(notebook, package)) <= set(decided)
    assert differences(notebook, package)["include_num_input_tokens_seen"] == ("non_padding", "no")


def test_notebook_builds_the_trainer_as_build_trainer_does():
    import ast
    import inspect

    from nb_helpers import training

    def keywords(code: str) -> dict:
        calls = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "SFTTrainer"]
        assert len(calls) == 1
        return {k.arg: ast.unparse(k.value) for k in calls[0].keywords}

    notebook = keywords(notebook_03_code("SFTTrainer("))
    package = keywords(inspect.getsource(training.build_trainer))
    assert notebook.pop("args") == "args" and package.pop("args") == "sft_config(run)"
    assert notebook == package
    assert "adapt_trainer(run, trainer)" in notebook_03_code("SFTTrainer(")


def test_summary_keys_are_listed_once():
    from nb_helpers.summary import SUMMARY_KEYS, print_summary, summarize

    with pytest.raises(KeyError, match="not in nb_helpers.summary"):
        summarize(Path("."), "m", {"eval_los_after": 1.0})  # a typo is refused, not written
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as out:
        print_summary(dict.fromkeys(SUMMARY_KEYS))
    assert all(f"{k}=None" in out.getvalue() for k in SUMMARY_KEYS)


def test_the_same_seed_draws_the_same_lora_init_whatever_ran_before(tiny_cfg):
    """LoRA's A is drawn in attach_lora from torch's generator, which each process seeds at random: unseeded, two
    same-seed runs differed by 3.4% in loss over 16 steps (bench/RESULTS.md, "Same seed, same losses")."""
    import torch

    from nb_helpers.lora import attach_lora
    from nb_helpers.models import load_4bit, resolve_model

    choice = resolve_model(tiny_cfg, verbose=False)
    inits = []
    for noise in (1, 2):
        torch.manual_seed(noise)  # a different generator state before each attach, as two fresh processes have
        model = attach_lora(load_4bit(tiny_cfg, choice), tiny_cfg)
        inits.append({n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n})
    assert inits[0] and inits[0].keys() == inits[1].keys()
    assert all(torch.equal(inits[0][n], inits[1][n]) for n in inits[0])
