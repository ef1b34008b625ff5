"""Bad data, bad settings, interrupted runs, bad numerics, full disks: each gives a message that names the
problem and the fix, and nothing already written is lost."""

import errno
import json

import pytest

from nb_helpers.config import PROJECT_ROOT, ConfigError, RunConfig
from nb_helpers.data import DataError, check_jsonl

GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def jsonl(tmp_path, *rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def only_problem(report, severity="error"):
    found = [p for p in report.problems if p.severity == severity]
    assert len(found) == 1, report.text()
    return found[0]


@pytest.mark.parametrize("bad_row, message", [
    ('{"messages": [', "not valid JSON"),
    ({"question": "q", "answer": "a"}, "matches no accepted format"),
    ({"prompt": "q"}, "missing field 'completion'"),
    ({"prompt": "q", "completion": "  "}, "'completion' is empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}, "unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"},
                   {"role": "assistant", "content": "a"}]}, "message 2 is 'user' where 'assistant' was expected"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 42}]}, "is int, not a string"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}, "no assistant answer"),
    ({"instruction": "do", "output": ["a"]}, "'output' is list, not a string"),
    ([1, 2], "row is a JSON list"),
])
def test_each_bad_row_is_reported_with_its_line_and_fix(tmp_path, bad_row, message):
    report = check_jsonl(jsonl(tmp_path, GOOD, GOOD | {"id": 2}, bad_row))
    problem = only_problem(report)
    assert problem.line == 3 and message in problem.problem, problem
    assert problem.fix  # every problem says what to do
    assert report.exit_code == 1 and len(report.rows) == 2
    assert f"d.jsonl:3: error: {problem.problem} — " in report.text()


def test_not_utf8_empty_duplicates_and_mixed(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"text": "caf\u00e9"}'.encode("latin-1") + b"\n")
    problem = only_problem(check_jsonl(path))
    assert problem.line == 2 and "not UTF-8" in problem.problem and "re-save the file as UTF-8" in problem.fix

    empty = jsonl(tmp_path, "", name="empty.jsonl")
    assert "no rows" in only_problem(check_jsonl(empty)).problem

    dup = check_jsonl(jsonl(tmp_path, GOOD, GOOD, name="dup.jsonl"))
    warning = only_problem(dup, "warning")
    assert warning.line == 2 and "duplicate of line 1" in warning.problem and dup.exit_code == 0

    mixed = only_problem(check_jsonl(jsonl(tmp_path, GOOD, {"text": "t"}, name="m.jsonl")))
    assert mixed.line == 2 and "one format per file" in mixed.fix


def test_rows_longer_than_max_length_say_how_much_is_cut(tmp_path, tokenizer_dir):
    from nb_helpers.models import load_tokenizer

    long_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 100}]}
    long_prompt = {"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "a"}]}
    report = check_jsonl(jsonl(tmp_path, GOOD, long_answer, long_prompt), tokenizer=load_tokenizer(str(tokenizer_dir)),
                         max_length=64)
    warnings = {p.line: p.problem for p in report.warnings}
    assert "over max_length 64: the last" in warnings[2] and "tokens would be cut" in warnings[2]
    assert "the whole answer is cut and the row is dropped" in warnings[3]
    assert report.exit_code == 0  # warnings only


def test_validate_data_exit_codes_and_never_a_traceback(tmp_path, cli):
    clean = cli("validate-data", str(jsonl(tmp_path, GOOD, name="ok.jsonl")), "--max-length", "64")
    assert clean.returncode == 0 and "1 usable rows, 0 error(s)" in clean.stdout
    broken = cli("validate-data", str(jsonl(tmp_path, GOOD, "{oops", name="bad.jsonl")))
    assert broken.returncode == 1 and "bad.jsonl:2: error: not valid JSON" in broken.stdout
    missing = cli("validate-data", str(tmp_path / "missing.jsonl"))
    assert missing.returncode == 2 and "cannot read" in missing.stdout
    folder = cli("validate-data", str(tmp_path))
    assert folder.returncode == 2
    for run in (clean, broken, missing, folder):
        assert "Traceback" not in run.stdout + run.stderr


def test_the_shipped_data_is_clean():
    for name in ("train.jsonl", "eval.jsonl"):
        report = check_jsonl(PROJECT_ROOT / "data" / name)
        assert report.exit_code == 0 and not report.problems, report.text()


def test_training_stops_on_bad_data_before_loading_the_model(tiny_cfg, tmp_path, monkeypatch):
    from nb_helpers import training

    monkeypatch.setattr(training, "load_4bit", lambda *a, **k: pytest.fail("model loaded despite bad data"))
    bad = jsonl(tmp_path, GOOD, "{oops", {"prompt": "q"})
    with pytest.raises(DataError) as err:
        training.train(tiny_cfg.replace(train_file=str(bad)), verbose=False)
    text = str(err.value)
    assert ":2: error: not valid JSON" in text and ":3: error: missing field 'completion'" in text
    assert "skip_invalid=True" in text


def test_skip_invalid_drops_rows_and_lists_them(tiny_cfg, tmp_path, capsys):
    from nb_helpers.training import train

    rows = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(8)]
    bad = jsonl(tmp_path, *rows[:3], "{oops", *rows[3:], {"prompt": "q"})  # bad rows on lines 4 and 10
    run_dir = train(tiny_cfg.replace(train_file=str(bad), skip_invalid=True, max_steps=1, task_eval_samples=0),
                    verbose=False)
    out = capsys.readouterr().out
    assert "skipped 2 invalid row(s) (skip_invalid=True), lines 4, 10" in out and "warning" not in out
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


# --- settings -----------------------------------------------------------------------------------------------

def test_settings_that_need_the_model_are_checked_before_it_loads(tiny_cfg, monkeypatch):
    from nb_helpers import training

    monkeypatch.setattr(training, "load_4bit", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match="max_length=4096 is above tiny-llama.*limit of 512"):
        training.train(tiny_cfg.replace(max_length=4096), verbose=False)
    with pytest.raises(ConfigError, match=r"\['query'\] do not exist.*'k_proj'.*'o_proj'"):
        training.train(tiny_cfg.replace(target_modules=["query"]), verbose=False)


def test_bf16_on_a_turing_gpu_switches_to_fp16_and_says_so(tiny_cfg, monkeypatch, capsys):
    from nb_helpers import preflight
    from nb_helpers.models import ModelChoice

    monkeypatch.setattr(preflight, "cuda_capability", lambda: (7, 5))
    cfg = preflight.preflight(tiny_cfg.replace(compute_dtype="bfloat16"), ModelChoice(tiny_cfg.model, "tiny", "t"))
    assert cfg.compute_dtype == "float16"
    assert "no native bf16: using float16 instead" in capsys.readouterr().out


def test_budget_smaller_than_the_weights(tiny_cfg):
    from nb_helpers.models import ModelChoice
    from nb_helpers.preflight import check_budget_fits

    with pytest.raises(ConfigError, match="less than tiny's 4-bit weights alone.*raise budget_gib"):
        check_budget_fits(tiny_cfg.replace(budget_gib=0.6), ModelChoice(tiny_cfg.model, "tiny", "t"), 0.001)


def test_four_bit_estimate_matches_the_loaded_model(tiny_model_dir):
    from nb_helpers.models import ModelChoice, load_4bit, memory_breakdown
    from nb_helpers.preflight import four_bit_weight_bytes

    # the estimate is for GPUs, which keep embeddings in 16-bit (an AVX2-only CPU would load them in fp32)
    model = load_4bit(RunConfig(model=str(tiny_model_dir), compute_dtype="bfloat16"),
                      ModelChoice(str(tiny_model_dir), "tiny", "t"))
    loaded = memory_breakdown(model)["total"]
    assert abs(four_bit_weight_bytes(model.config) - loaded) / loaded < 0.05


def test_paths_in_configs_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="model='./no/such/model': no such folder"):
        RunConfig(model="./no/such/model").validate()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file; point it at a folder"):
        RunConfig(runs_dir=str(tmp_path / "afile")).validate()


# --- numerics, disk, security -------------------------------------------------------------------------------

def test_nan_keeps_the_last_good_adapter(tiny_cfg, capsys):
    import torch
    from safetensors.torch import load_file

    from nb_helpers.training import train

    def poison_step_2(record):
        if record.get("step") == 2 and "loss" in record:
            record["loss"] = float("nan")

    run_dir = train(tiny_cfg.replace(max_steps=5, task_eval_samples=0), listeners=[poison_step_2], verbose=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped: non-finite loss or gradient at step 2" and summary["adapter_step"] == 1
    assert summary["steps"] == 2  # stopped within the step, not at max_steps
    weights = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    out = capsys.readouterr().out
    assert "adapter/ holds the last good weights, from step 1" in out and "lower learning_rate" in out


def test_last_good_adapter_restores_the_last_finite_steps_weights():
    """One batched copy per finite step into reused buffers: a non-finite step takes no copy, and restore() puts
    back the weights of the last finite one, not those of the step that failed."""
    import torch

    from nb_helpers.recovery import LastGoodAdapter

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[1].weight.requires_grad_(False)
    model[0].bias.data = model[0].bias.data.bfloat16()  # fp32 adapters beside bf16 ones: one flat copy per dtype
    keeper = LastGoodAdapter(model)
    keeper({"loss": 1.0, "step": 1, "grad_norm": 0.5})
    good = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    keeper({"loss": float("nan"), "step": 2})
    assert keeper.step == 1 and set(keeper.state) == set(good)
    assert sorted(str(d) for d in keeper.flat) == ["torch.bfloat16", "torch.float32"]
    assert keeper.restore()
    assert "1.weight" not in keeper.state  # frozen: not an adapter weight
    for name, p in model.named_parameters():
        if name in good:
            assert torch.equal(p, good[name])


def test_the_flops_count_is_transformers_own_with_the_parameters_counted_once(tiny_cfg):
    import torch

    from nb_helpers.fast.options import FastOptions
    from nb_helpers.models import ModelChoice, load_4bit
    from nb_helpers.lora import attach_lora
    from nb_helpers.fast.host_step import flops_counter

    model = attach_lora(load_4bit(tiny_cfg, ModelChoice(tiny_cfg.model, "tiny", "test")), tiny_cfg,
                        fast=FastOptions(lean=True, kernels=False, nomask=False))
    from transformers import Trainer

    inputs = {"input_ids": torch.ones(2, 7, dtype=torch.long)}
    trainer = Trainer.__new__(Trainer)  # only its floating_point_ops, which reads self.model
    trainer.model = model
    count = flops_counter(model)
    assert count(inputs) == Trainer.floating_point_ops(trainer, inputs) > 0
    assert count({"labels": inputs["input_ids"]}) == 0


def test_a_full_disk_leaves_the_previous_adapter_intact(shared_run):
    from nb_helpers.recovery import last_checkpoint, save_adapter

    run_dir = shared_run[1]
    before = (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()

    class FullDisk:
        def save_pretrained(self, path):
            (path / "adapter_model.safetensors").parent.mkdir(parents=True, exist_ok=True)
            (path / "adapter_model.safetensors").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RuntimeError) as err:
        save_adapter(FullDisk(), None, run_dir)
    message = str(err.value)
    assert "the disk is full" in message and last_checkpoint(run_dir).name in message and "--resume" in message
    assert (run_dir / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert not (run_dir / "adapter.partial").exists()


def test_pickled_weights_are_refused(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from nb_helpers.models import ModelChoice, load_4bit

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        load_4bit(RunConfig(model=str(pickled)), ModelChoice(str(pickled), "pickled", "t"))


# --- interrupt and resume -----------------------------------------------------------------------------------

def test_interrupt_leaves_a_checkpoint_and_resume_needs_one(tiny_cfg, tmp_path, monkeypatch):
    from nb_helpers.recovery import last_checkpoint
    from nb_helpers.training import train

    def stop_at_3(record):
        if record.get("step") == 3 and "loss" in record:
            raise KeyboardInterrupt

    run_dir = train(tiny_cfg.replace(max_steps=5, save_steps=50, task_eval_samples=0), listeners=[stop_at_3],
                    verbose=False)
    assert last_checkpoint(run_dir).name == "checkpoint-3"  # written on interrupt, not by save_steps
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"

    fresh = train(tiny_cfg.replace(max_steps=1, save_steps=50, task_eval_samples=0), verbose=False)
    import shutil
    shutil.rmtree(fresh / "checkpoints", ignore_errors=True)
    (fresh / "summary.json").unlink()  # killed before its first checkpoint: not completed, nothing to resume from
    from nb_helpers import training

    monkeypatch.setattr(training, "load_4bit", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match="no checkpoint to resume from"):
        train(RunConfig(), resume_from=fresh, verbose=False)


def test_oom_stops_cleanly_and_names_the_knob(tiny_cfg, monkeypatch):
    import gc
    import weakref

    import torch

    from nb_helpers import training
    from nb_helpers.metrics import read_metrics

    models = []
    attach = training.attach_lora
    monkeypatch.setattr(training, "attach_lora", lambda *a, **k: models.append(attach(*a, **k)) or models[-1])

    def out_of_memory_at_2(record):
        if record.get("step") == 2 and "loss" in record:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    with pytest.raises(RuntimeError) as err:
        training.train(tiny_cfg.replace(max_steps=4, task_eval_samples=0), listeners=[out_of_memory_at_2],
                       verbose=False)
    model = weakref.ref(models.pop())
    gc.collect()
    # The error is still held (as a notebook holds its last error), and the trainer with it: the model must be gone
    # all the same, or its memory would stay on the GPU.
    assert model() is None, "after an out-of-memory stop something still holds the model"
    message = str(err.value)
    assert "out of memory at step 2" in message and "micro_batch_size 4 -> 2 with grad_accum 1 -> 2" in message
    run_dir = sorted((tiny_cfg.resolve_path(tiny_cfg.runs_dir)).glob("2*"))[-1]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "oom"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] == [1, 2]
