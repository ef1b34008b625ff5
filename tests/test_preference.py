"""Preference pairs (nb_helpers.pairs) and DPO's settings (nb_helpers.dpo): the shipped pairs are what
data/make_pairs.py makes, every rejected answer is a near miss of its chosen one, bad pair files get FILE:LINE
messages, notebook 07 writes out the DPOConfig the package builds, and one tiny DPO run writes a run folder."""

import ast
import json
import random
import shutil
from pathlib import Path

import pytest

from nb_helpers.config import PROJECT_ROOT, ConfigError, RunConfig
from nb_helpers.data import DataError
from nb_helpers.plan.preference import REF_ADAPTER_BYTES
from nb_helpers.pairs import (ERROR_KINDS, check_pairs_jsonl, corrupt, load_pairs, make_pairs, normalize_pair,
                              pair_length_problem)

GOOD = {"prompt": [{"role": "user", "content": "Order: Ana bought 2 red mugs."}],
        "chosen": [{"role": "assistant", "content": '{"customer": "Ana"}'}],
        "rejected": [{"role": "assistant", "content": '{"customer": "Anna"}'}]}


def sft_rows(name="train.jsonl"):
    return [json.loads(line) for line in (PROJECT_ROOT / "data" / name).read_text(encoding="utf-8").splitlines()]


def shipped_pairs(name):
    return [json.loads(line) for line in (PROJECT_ROOT / "data" / name).read_text(encoding="utf-8").splitlines()]


# --- the pairs ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["train", "eval"])
def test_shipped_pairs_are_what_the_script_makes(split):
    """data/make_pairs.py is deterministic: its output is the committed file, line for line."""
    assert make_pairs(sft_rows(f"{split}.jsonl")) == shipped_pairs(f"pairs_{split}.jsonl")


def test_every_rejected_answer_is_one_near_miss_of_the_chosen_one():
    """The chosen answer is the SFT row's answer; the rejected one differs by one field or by its wrapping, and the
    task metric scores it lower (except prose around the JSON, which the metric reads through)."""
    from nb_helpers.task_metric import score

    pairs = shipped_pairs("pairs_train.jsonl")
    for row, pair in zip(sft_rows(), pairs):
        chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        assert chosen == row["messages"][-1]["content"] and pair["prompt"] == row["messages"][:-1]
        assert chosen != rejected
        if pair["error"] == "extra_prose":
            assert json.dumps(json.loads(chosen)) in rejected and score(rejected, chosen) == 1.0
            continue
        good, bad = json.loads(chosen), json.loads(rejected)
        assert len(set(good.items()) ^ set(bad.items())) <= 2, pair  # one key changed, dropped or added
        assert score(rejected, chosen) < 1.0 or pair["error"] == "extra_key"
    counts = {kind: sum(p["error"] == kind for p in pairs) for kind in ERROR_KINDS}
    assert max(counts.values()) - min(counts.values()) <= 1, counts  # every kind as often as the others


def test_pairs_change_with_the_seed_and_not_without_it():
    rows = sft_rows()[:50]
    assert make_pairs(rows, seed=1) == make_pairs(rows, seed=1) != make_pairs(rows, seed=2)


def test_an_unknown_error_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown error kind 'typo'"):
        corrupt({"customer": "Ana"}, "typo", random.Random(0), {})


# --- the validator: FILE:LINE: problem — fix -------------------------------------------------------------------------

def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n",
                    encoding="utf-8")
    return path


def test_bad_pairs_are_named_by_line_with_the_fix(tmp_path):
    same = {**GOOD, "rejected": GOOD["chosen"]}
    no_rejected = {k: v for k, v in GOOD.items() if k != "rejected"}
    path = write_lines(tmp_path / "pairs.jsonl", [GOOD, no_rejected, same, '{"prompt": "x", "chosen"',
                                                  {**GOOD, "chosen": [{"role": "user", "content": "hi"}]}])
    report = check_pairs_jsonl(path)
    text = report.text()
    assert len(report.rows) == 1 and report.exit_code == 1
    assert f"{path}:2: error: missing field 'rejected'" in text and "add 'rejected' to the row" in text
    assert f"{path}:3: error: chosen and rejected are the same answer" in text
    assert f"{path}:4: error: not valid JSON" in text
    assert f"{path}:5: error: 'chosen' must be one assistant message" in text


def test_plain_strings_are_a_user_prompt_and_assistant_answers():
    pair = normalize_pair({"prompt": "Capital of Peru?", "chosen": "Lima", "rejected": "Lisbon"})
    assert pair["prompt"] == [{"role": "user", "content": "Capital of Peru?"}]
    assert pair["rejected"] == [{"role": "assistant", "content": "Lisbon"}]


def test_pair_length_against_max_length():
    """Within max_length: fine. Longer: the end of the longer answer is cut (a warning), unless the prompt fills
    max_length (TRL drops the pair) or the answers only differ after the cut (both errors)."""
    counts = {"prompt": 40, "chosen": 60, "rejected": 62, "first_difference": 50}
    assert pair_length_problem(counts, 64) is None
    assert pair_length_problem(counts, 55)[0] == "warning"
    severity, problem, fix = pair_length_problem(counts, 48)
    assert severity == "error" and "first differ at token 50" in problem and fix == "raise max_length to 62 or shorten the prompt"
    assert "fills max_length 32" in pair_length_problem(counts, 32)[1]


def test_a_pair_longer_than_max_length_is_named_with_the_real_tokenizer(tmp_path, tokenizer_dir):
    from nb_helpers.models import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    long = {**GOOD, "chosen": [{"role": "assistant", "content": "word " * 300 + "yes"}],
            "rejected": [{"role": "assistant", "content": "word " * 300 + "no"}]}
    path = write_lines(tmp_path / "pairs.jsonl", [GOOD, long])
    report = check_pairs_jsonl(path, tokenizer, max_length=128)
    assert [p.line for p in report.errors] == [2] and "after max_length 128" in report.errors[0].problem
    with pytest.raises(DataError, match=rf"{tmp_path / 'pairs.jsonl'}:2: error"):
        load_pairs(str(path), RunConfig(max_length=128), tokenizer=tokenizer)
    assert len(load_pairs(str(path), RunConfig(max_length=128, skip_invalid=True), tokenizer=tokenizer)) == 1


def test_the_shipped_pairs_fit_the_cpu_length(tokenizer_dir):
    from nb_helpers.models import load_tokenizer

    report = check_pairs_jsonl(PROJECT_ROOT / "data" / "pairs_eval.jsonl", load_tokenizer(str(tokenizer_dir)), 192)
    assert not report.problems and len(report.rows) == 60
    assert max(total for _, total in report.lengths) < 192


def test_missing_file_and_bad_limit_are_one_line():
    report = check_pairs_jsonl(PROJECT_ROOT / "data" / "no_such_pairs.jsonl")
    assert report.exit_code == 2 and "check the path" in report.text()
    with pytest.raises(ConfigError, match="whole number of pairs"):
        load_pairs("data/pairs_eval.jsonl", RunConfig(), limit=-1)


def test_the_held_out_pairs_do_not_shrink_with_the_eval_loss_rows(no_gpu):
    """The CPU profile reads the SFT eval loss on 30 rows; notebook 07 still scores all 60 held-out pairs, whose
    reward accuracy is the DPO run's result (a subset can flatter it). 07 loads them with pair_eval_samples."""
    from nb_helpers.config import default_config

    cfg = default_config()
    assert cfg.max_eval_samples == 30 and cfg.pair_eval_samples is None
    assert len(load_pairs(cfg.pairs_eval_file, cfg, cfg.pair_eval_samples)) == 60
    nb = json.loads((PROJECT_ROOT / "notebooks" / "07_preference_tuning.ipynb").read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "load_pairs(trains.pairs_eval_file, trains, trains.pair_eval_samples, tokenizer)" in code
    with pytest.raises(ConfigError, match="pair_eval_samples=0"):
        RunConfig(pair_eval_samples=0).validate()


# --- the config and DPOConfig ------------------------------------------------------------------------------------------

def test_dpo_knobs_are_checked_like_every_knob():
    with pytest.raises(ConfigError) as e:
        RunConfig(dpo_beta=0.0, dpo_learning_rate=-1.0, dpo_max_steps=0).validate()
    assert all(k in str(e.value) for k in ("dpo_beta=0.0", "dpo_learning_rate=-1.0", "dpo_max_steps=0"))


def dpo_config_call(notebook: str) -> ast.Call:
    nb = json.loads((PROJECT_ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    return next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DPOConfig")


def test_notebook_07_writes_out_every_argument_dpo_arguments_gives(tmp_path):
    """The notebook's DPOConfig(...) and nb_helpers.dpo.dpo_arguments name the same arguments (bench/dpo.py and the
    tests build the trainer with the package's)."""
    from nb_helpers.dpo import dpo_arguments

    written = {kw.arg for kw in dpo_config_call("07_preference_tuning.ipynb").keywords}
    assert written == set(dpo_arguments(RunConfig(), tmp_path, has_eval=True))


def test_dpo_config_builds_from_the_arguments(tmp_path, no_gpu):
    from trl import DPOConfig

    from nb_helpers.dpo import dpo_arguments

    args = DPOConfig(**dpo_arguments(RunConfig(dpo_beta=0.2, compute_dtype="float32"), tmp_path, has_eval=False))
    assert (args.beta, args.loss_type, args.bf16, args.fp16, args.eval_strategy) == (0.2, ["sigmoid"], False, False,
                                                                                     "no")
    assert args.precompute_ref_log_probs is False and args.disable_dropout and args.max_steps == 40


def test_the_keyword_comparison_notices_a_missing_argument(tmp_path):
    from nb_helpers.dpo import dpo_arguments

    written = {kw.arg for kw in dpo_config_call("07_preference_tuning.ipynb").keywords} - {"beta"}
    assert written != set(dpo_arguments(RunConfig(), tmp_path, has_eval=True))


# --- one tiny DPO run on the CPU -------------------------------------------------------------------------------------

def test_a_tiny_dpo_run_starts_from_the_sft_adapter_and_writes_a_run_folder(shared_run, no_gpu, tmp_path):
    """On the suite's tiny SFT run: TRL adds the frozen "ref" copy of the SFT adapter (no second base), the reward
    metrics reach metrics.jsonl, only the trained adapter is saved, and the folder reads back as a DPO run."""
    from peft import PeftModel
    from trl import DPOConfig, DPOTrainer

    from nb_helpers.dpo import (adapt_dpo_trainer, adapter_bytes, dpo_arguments, finish_preference_run,
                                is_preference_run, open_preference_run, sft_config_for, sft_runs)
    from nb_helpers.models import load_4bit, load_tokenizer, resolve_model
    from nb_helpers.pairs import load_pairs, pair_dataset
    from nb_helpers.runs import load_run

    cfg, shared_sft = shared_run  # copied: a DPO run becomes runs/latest, and the shared folder's latest stays the SFT run
    sft_run = Path(shutil.copytree(shared_sft, tmp_path / "runs" / shared_sft.name))
    cfg = cfg.replace(runs_dir=str(sft_run.parent))
    assert sft_runs(cfg) == [sft_run]
    cfg = sft_config_for(cfg.replace(dpo_max_steps=2, micro_batch_size=2, eval_steps=1, max_length=192), sft_run)
    choice = resolve_model(cfg, verbose=False)
    tokenizer = load_tokenizer(choice.path)
    train_pairs = load_pairs(cfg.pairs_train_file, cfg, 4, tokenizer)
    eval_pairs = load_pairs(cfg.pairs_eval_file, cfg, 2, tokenizer)
    model = PeftModel.from_pretrained(load_4bit(cfg, choice), sft_run / "adapter", is_trainable=True)
    run_dir, metrics = open_preference_run(cfg, choice.name, sft_run)
    trainer = DPOTrainer(model=model, args=DPOConfig(**dpo_arguments(cfg, run_dir / "checkpoints", True)),
                         train_dataset=pair_dataset(train_pairs), eval_dataset=pair_dataset(eval_pairs),
                         processing_class=tokenizer, callbacks=[metrics])
    adapt_dpo_trainer(trainer, cfg)
    assert list(model.peft_config) == ["default", "ref"]
    count = lambda name: sum(p.numel() for n, p in model.named_parameters() if f".{name}." in n)  # noqa: E731
    assert count("ref") == count("default") > 0
    assert adapter_bytes(model, "ref") == REF_ADAPTER_BYTES * count("ref")  # fp32, as the planner counts it
    trainer.train()
    summary = finish_preference_run(run_dir, model, choice.name, {}, metrics, tokenizer=tokenizer)
    records = load_run(run_dir).metrics
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert all("reward_accuracy" in r and "reward_margin" in r for r in records if "loss" in r)
    assert any("eval_reward_accuracy" in r for r in records)
    saved = sorted(p.name for p in (run_dir / "adapter").iterdir())  # the trained adapter only, and its tokenizer:
    assert saved == sorted(p.name for p in (sft_run / "adapter").iterdir())  # what notebook 05 and export read
    assert is_preference_run(run_dir) and not is_preference_run(sft_run) and summary["steps"] == 2
    assert sft_runs(cfg) == [sft_run]  # a DPO run is never where the next DPO starts


def test_the_sft_models_task_score_is_read_from_its_run_not_measured_again(shared_run):
    """Notebook 07's "before": the SFT run scored the same held-out prompts greedily; its predictions.jsonl is reused
    only when it covers exactly these prompts (and references) at the same answer length."""
    from nb_helpers.data import load_rows
    from nb_helpers.dpo import sft_run_scores

    cfg, sft_run = shared_run
    summary = json.loads((sft_run / "summary.json").read_text())
    rows = load_rows(cfg.eval_file, cfg, cfg.task_eval_samples)
    scores = sft_run_scores(sft_run, rows, cfg.max_new_tokens)
    assert scores["score"] == pytest.approx(summary["task_tuned"]) and len(scores["predictions"]) == len(rows)
    assert scores["metric"] == summary["task_metric"]
    assert sft_run_scores(sft_run, rows[:1], cfg.max_new_tokens)["predictions"] == scores["predictions"][:1]
    assert sft_run_scores(sft_run, rows, cfg.max_new_tokens + 1) is None  # other answer length: measured again
    other = load_rows(cfg.eval_file, cfg, cfg.task_eval_samples + 1)[1:]
    assert sft_run_scores(sft_run, other, cfg.max_new_tokens) is None  # other prompts
    assert sft_run_scores(sft_run, load_rows(cfg.eval_file, cfg, 5), cfg.max_new_tokens) is None  # more than it scored
