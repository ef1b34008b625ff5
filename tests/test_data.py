import json
import subprocess
import sys

import pytest

from nb_helpers.config import PROJECT_ROOT, RunConfig
from nb_helpers.data import DataError, RowProblem, load_rows, normalize_row


def write(tmp_path, lines, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_all_accepted_formats_become_prompt_completion():
    messages = normalize_row({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "a"}]})
    assert messages == {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                        "completion": [{"role": "assistant", "content": "a"}]}
    pc = normalize_row({"prompt": "q", "completion": "a"})
    assert pc["prompt"] == [{"role": "user", "content": "q"}] and pc["completion"][0]["content"] == "a"
    alpaca = normalize_row({"instruction": "Do it", "input": "x", "output": "y"})
    assert alpaca["prompt"][0]["content"] == "Do it\n\nx"
    assert normalize_row({"instruction": "Do it", "input": "", "output": "y"})["prompt"][0]["content"] == "Do it"
    assert normalize_row({"text": "hello"}) == {"text": "hello"}


@pytest.mark.parametrize("row, message", [
    ({"question": "q"}, "matches no accepted format"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant answer"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "is empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}, "not a string"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}, "where 'user' was expected"),
])
def test_bad_rows_are_explained(row, message):
    with pytest.raises(RowProblem, match=message) as err:
        normalize_row(row)
    assert err.value.fix


def test_loader_stops_with_file_and_line(tmp_path):
    good = json.dumps({"prompt": "q", "completion": "a"})
    path = write(tmp_path, [good, good, '{"prompt": "q", "completion": '])
    with pytest.raises(DataError) as err:
        load_rows(str(path), RunConfig())
    assert f"{path}:3: error: not valid JSON" in str(err.value) and "fix or remove this line" in str(err.value)
    with pytest.raises(DataError, match="cannot read"):
        load_rows(str(tmp_path / "missing.jsonl"), RunConfig())


def test_shipped_dataset_is_clean_and_disjoint():
    cfg = RunConfig()
    train, held_out = load_rows(cfg.train_file, cfg), load_rows(cfg.eval_file, cfg)
    assert (len(train), len(held_out)) == (600, 60)
    train_prompts = {r["prompt"][-1]["content"] for r in train}
    assert not train_prompts & {r["prompt"][-1]["content"] for r in held_out}
    answer = json.loads(held_out[0]["completion"][0]["content"])
    assert list(answer) == ["customer", "item", "quantity", "color", "city", "day"]


def test_dataset_script_reproduces_the_committed_files(tmp_path):
    code = ("import sys, pathlib; sys.path.insert(0, 'data'); import make_dataset; "
            f"make_dataset.main(pathlib.Path({str(tmp_path)!r}))")
    subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, check=True, capture_output=True)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (PROJECT_ROOT / "data" / name).read_bytes(), name


def test_longest_row_is_counted_as_the_trainer_sees_it(tokenizer_dir):
    """Auto-fit plans for the longest row, not max_length: the count must include the chat template."""
    from nb_helpers.data import longest_row_tokens
    from nb_helpers.models import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    short = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    long = {"prompt": [{"role": "user", "content": "hi " * 40}], "completion": [{"role": "assistant", "content": "yo"}]}
    full = tokenizer.apply_chat_template(long["prompt"] + long["completion"], tokenize=False)
    assert longest_row_tokens([short, long, short], tokenizer) == len(tokenizer(full, add_special_tokens=False)["input_ids"])
    assert longest_row_tokens([short], tokenizer) < longest_row_tokens([long], tokenizer)


def test_training_tokens_are_what_sfttrainer_trains_on(tiny_model_dir, tmp_path):
    """Notebook 03 shows the masked labels through training_tokens: they must be TRL's, token for token."""
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from nb_helpers.data import to_dataset, training_tokens
    from nb_helpers.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    cfg = RunConfig()
    rows = load_rows(cfg.train_file, cfg, 3) + [normalize_row({"instruction": "Say hi", "output": "hi"})]
    args = SFTConfig(output_dir=str(tmp_path), completion_only_loss=True, max_length=512, report_to=[], bf16=False,
                     use_cpu=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args,
                         train_dataset=to_dataset(rows), processing_class=tokenizer)
    for row, theirs in zip(rows, trainer.train_dataset):
        ours = training_tokens(row, tokenizer)
        assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]
        answer = tokenizer.decode([t for t in ours["labels"] if t != -100])
        assert answer == row["completion"][0]["content"] + tokenizer.eos_token + "\n"  # the answer and its end of turn


def test_the_task_metric_prompts_do_not_shrink_with_the_eval_loss_rows():
    """max_eval_samples bounds the eval loss's rows, task_eval_samples the task metric's prompts: one no longer caps
    the other (the task rows were the eval rows' head, so fewer eval rows silently meant fewer scored prompts)."""
    from nb_helpers.data import load_task_rows, load_train_eval

    cfg = RunConfig(max_eval_samples=3, task_eval_samples=5)
    task, (_, eval_rows) = load_task_rows(cfg), load_train_eval(cfg)
    assert len(eval_rows) == 3 and len(task) == 5
    assert task[:3] == eval_rows  # the same file's first rows: the prompts notebook 07 reuses the scores of
    assert load_task_rows(cfg.replace(task_eval_samples=0)) == []
    assert load_task_rows(cfg.replace(eval_file=None)) == []
