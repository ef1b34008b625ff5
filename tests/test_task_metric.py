import json
from pathlib import Path

from nb_helpers.task_metric import EXACT_METRIC, JSON_METRIC, metric_name, score

GOLD = json.dumps({"customer": "Ravi", "item": "jacket", "quantity": 9, "color": "yellow", "city": "Tunis",
                   "day": "Tuesday"})


def test_perfect_partial_and_broken_answers():
    assert score(GOLD, GOLD) == 1.0
    half = json.dumps({"customer": "Ravi", "item": "jackets", "quantity": "9", "color": "blue", "city": "Tunis"})
    assert score(half, GOLD) == 3 / 6  # customer, quantity ("9" == 9), city
    assert score("Sure! Here it is: " + GOLD + " Hope that helps.", GOLD) == 1.0  # prose around JSON is tolerated
    assert score('{"customer": "Ravi", ', GOLD) == 0.0  # unparseable
    assert score("no json at all", GOLD) == 0.0
    nested = json.dumps({"customer": {"item": {"quantity": 9}}})
    assert score(nested, GOLD) == 0.0


def test_non_json_references_use_exact_match():
    assert metric_name("Paris") == EXACT_METRIC and metric_name(GOLD) == JSON_METRIC
    assert score("  paris ", "Paris") == 1.0 and score("Lyon", "Paris") == 0.0


def test_base_answers_are_kept_per_prompt_and_generated_only_when_missing(tiny_cfg, no_gpu, monkeypatch, capsys):
    """The second scoring of the same prompts generates nothing and gives the same predictions; a new prompt alone
    is generated. The folder's key moves with what changes the answers: answer length, dtype, the model's files."""
    import os

    from nb_helpers import task_metric
    from nb_helpers.models import ModelChoice, load_4bit, load_tokenizer
    from nb_helpers.plan.dtypes import resolve_compute_dtype

    choice = ModelChoice(tiny_cfg.model, "tiny", "test")
    tokenizer, model = load_tokenizer(tiny_cfg.model), load_4bit(tiny_cfg, choice)
    kept = task_metric.base_answers_dir(tiny_cfg, choice, model, tokenizer, 8)
    rows = [{"prompt": [{"role": "user", "content": f"order {i}"}], "completion": [{"role": "assistant",
             "content": GOLD}]} for i in range(4)]
    asked = []
    real = task_metric.generate
    monkeypatch.setattr(task_metric, "generate", lambda m, t, c, *a, **k: asked.append(len(c)) or real(m, t, c, *a, **k))

    first = task_metric.evaluate_task(model, tokenizer, rows[:3], 8, cache=kept)
    again = task_metric.evaluate_task(model, tokenizer, rows, 8, cache=kept)
    assert asked == [3, 1] and again["predictions"][:3] == first["predictions"]
    assert "3 of 4 answers kept from an earlier run" in capsys.readouterr().out
    assert len(list(kept.glob("*.json"))) == 4 and not list(kept.glob("*.tmp"))

    other_dtype = "float32" if resolve_compute_dtype(tiny_cfg.compute_dtype) == "bfloat16" else "bfloat16"
    others = {task_metric.base_answers_dir(tiny_cfg, choice, model, tokenizer, 16),
              task_metric.base_answers_dir(tiny_cfg.replace(compute_dtype=other_dtype), choice, model, tokenizer, 8)}
    weights = next(Path(choice.path).glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the weights were written again
    others.add(task_metric.base_answers_dir(tiny_cfg, choice, model, tokenizer, 8))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert kept not in others and len(others) == 3
    assert task_metric.base_answers_dir(tiny_cfg, ModelChoice("org/not-a-folder", "hub", "test"), model, tokenizer,
                                        8) is None


def test_a_runs_folder_that_cannot_keep_answers_still_scores(tiny_cfg, no_gpu, monkeypatch, capsys, tmp_path):
    """A read-only or full runs folder: the answers are scored all the same and one line says they were not kept;
    a damaged kept answer is generated again."""
    from nb_helpers import frontend, task_metric
    from nb_helpers.models import ModelChoice, load_4bit, load_tokenizer

    monkeypatch.setattr(frontend, "_SAID", set())
    model, tokenizer = load_4bit(tiny_cfg, ModelChoice(tiny_cfg.model, "tiny", "test")), load_tokenizer(tiny_cfg.model)
    rows = [{"prompt": [{"role": "user", "content": f"order {i}"}], "completion": [{"role": "assistant",
             "content": GOLD}]} for i in range(2)]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    plain = task_metric.evaluate_task(model, tokenizer, rows, 6)
    assert task_metric.evaluate_task(model, tokenizer, rows, 6, cache=blocked / "kept") == plain
    assert capsys.readouterr().out.count("not kept in") == 1

    kept = tmp_path / "kept"
    task_metric.evaluate_task(model, tokenizer, rows, 6, cache=kept)
    next(kept.glob("*.json")).write_bytes(b"\xff\xfe broken")
    assert task_metric.evaluate_task(model, tokenizer, rows, 6, cache=kept) == plain
    assert "1 of 2 answers kept" in capsys.readouterr().out
