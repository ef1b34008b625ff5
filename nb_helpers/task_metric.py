"""The task metric: generate answers for held-out prompts and score them against the reference answers.

For JSON answers (the shipped dataset) the score is per field: the share of the reference's keys whose
value the model reproduced exactly, in a JSON object it actually emitted. Unparseable output scores 0.
For other answers it is exact match after whitespace normalisation. Higher is better, 1.0 is perfect.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from nb_helpers.config import RunConfig
from nb_helpers.data import answer_text, prompt_messages
from nb_helpers.frontend import say_once
from nb_helpers.models import ModelChoice, dequantized_on_cpu
from nb_helpers.plan.dtypes import resolve_compute_dtype
from nb_helpers.runs import runs_root, write_json

JSON_METRIC = "json_field_accuracy"
EXACT_METRIC = "exact_match"


def _first_json_object(text: str) -> dict | None:
    start = text.find("{")
    while start != -1:
        depth = 0
        for end in range(start, len(text)):
            if text[end] == "{":
                depth += 1
            elif text[end] == "}":
                depth -= 1
                if depth == 0:
                    try:
                        value = json.loads(text[start:end + 1])
                        return value if isinstance(value, dict) else None
                    except json.JSONDecodeError:
                        break
        start = text.find("{", start + 1)
    return None


def _normal(value) -> str:
    return re.sub(r"\s+", " ", str(value)).strip().lower()


def metric_name(reference: str) -> str:
    return JSON_METRIC if _first_json_object(reference) is not None else EXACT_METRIC


def score(prediction: str, reference: str) -> float:
    gold = _first_json_object(reference)
    if gold is None:
        return float(_normal(prediction) == _normal(reference))
    pred = _first_json_object(prediction)
    if pred is None or not gold:
        return 0.0
    # Exact values, but 3 and "3" count the same: the schema asks for a number and both are readable.
    hits = sum(1 for key, value in gold.items() if key in pred and _normal(pred[key]) == _normal(value))
    return hits / len(gold)


class _TickEachToken:
    """A logits processor that changes nothing: generate() calls it once per decoding step, which moves the bar."""

    def __init__(self, bar):
        self.bar, self.count = bar, 0

    def __call__(self, input_ids, scores):
        self.count += 1
        self.bar.update(1)
        return scores


def generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int = 64,
             batch_size: int | None = None, label: str | None = None) -> list[str]:
    """Greedy answers for a list of chat prompts, batched with left padding, with a progress bar per decoding
    step where someone watches (nb_helpers.frontend): one batch on a CPU can take minutes.

    On a CPU the 4-bit weights are dequantized once for the whole generation rather than at every decoding step
    (models.dequantized_on_cpu), and every step still reads every weight, whatever the batch: 60 prompts took 31 s
    in one batch of 64 and 48 s in batches of 16 (2 AVX2 cores, 64 new tokens). A GPU keeps batches of 16, whose
    key/value cache stays small next to a 4 GB card's training memory."""
    from nb_helpers.frontend import progress_bar

    if batch_size is None:
        batch_size = 64 if model.device.type == "cpu" else 16

    batches = range(0, len(conversations), batch_size)
    bar = progress_bar(len(batches) * max_new_tokens,
                       f"{label or 'generating'}: {len(conversations)} prompt{'s' * (len(conversations) != 1)}")
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only models must see their prompt end right before generation
    was_training = model.training
    model.eval()
    answers = []
    try:
        with dequantized_on_cpu(model):
            for start in batches:
                answers += _generate_batch(model, tokenizer, conversations[start:start + batch_size], max_new_tokens,
                                           _TickEachToken(bar) if bar is not None else None)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
        if bar is not None:
            bar.close()
    return answers


def _generate_batch(model, tokenizer, conversations, max_new_tokens: int, tick) -> list[str]:
    import torch
    from transformers import LogitsProcessorList

    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id,
                             logits_processor=LogitsProcessorList([tick] if tick else []))
    if tick is not None:
        tick.bar.update(max_new_tokens - tick.count)  # every answer ended early: the batch is done all the same
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def base_answers_dir(cfg: RunConfig, choice: ModelChoice, model, tokenizer, max_new_tokens: int) -> Path | None:
    """Where the base model's answers for these settings are kept, one file per prompt: greedy answers of the same
    weights, 4-bit settings, dtype, device, chat template and versions do not change from one run to the next, so a
    rerun of notebook 03 and notebook 05's side-by-side skip generating them (60 prompts: about 30 s on 2 CPU cores).
    The folder is under the runs folder (runs/base-answers/); deleting it only costs that time. None for a model that
    is not a local folder (its files could not be told apart)."""
    import bitsandbytes
    import torch
    import transformers

    folder = Path(choice.path)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json"))
    device = model.device.type
    key = {"model": str(folder.resolve()), "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
           "4bit": [cfg.load_in_4bit, cfg.quant_type, cfg.double_quant], "fast_path": cfg.fast_path,
           "dtype": resolve_compute_dtype(cfg.compute_dtype), "max_new_tokens": max_new_tokens,
           "device": torch.cuda.get_device_name(model.device) if device == "cuda" else device,
           "chat_template": tokenizer.chat_template,
           "versions": [torch.__version__, transformers.__version__, bitsandbytes.__version__]}
    return runs_root(cfg) / "base-answers" / _digest(key)


def _read_kept(file: Path) -> str | None:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, or damaged (not UTF-8, not JSON): generated again
        return None


def _keep(file: Path, answer: str) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_json(file, answer)
    except OSError as e:  # a full disk or a read-only runs folder costs the next run the time, never this answer
        say_once("base-answers-not-kept", f"[task] base model's answers not kept in {file.parent.parent} "
                 f"({e.strerror or e}): scoring is unchanged, the next run generates them again")


def _answers(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, label: str,
             cache: Path | None) -> list[str]:
    """generate(), taking the answers `cache` already holds and keeping the new ones there."""
    if cache is None:
        return generate(model, tokenizer, conversations, max_new_tokens, label=label)
    files = [cache / f"{_digest(c)}.json" for c in conversations]
    known = {f: answer for f in set(files) if (answer := _read_kept(f)) is not None}
    missing = [(c, f) for c, f in zip(conversations, files) if f not in known]
    if known:
        print(f"[task] {label}: {len(conversations) - len(missing)} of {len(conversations)} answers kept from an "
              f"earlier run of the same model and settings (in {cache.parent})", flush=True)
    if missing:
        answers = generate(model, tokenizer, [c for c, _ in missing], max_new_tokens, label=label)
        for (_, file), answer in zip(missing, answers):
            known[file] = answer
            _keep(file, answer)
    return [known[f] for f in files]


def evaluate_task(model, tokenizer, rows: list[dict], max_new_tokens: int = 64,
                  label: str = "scoring held-out prompts", cache: Path | None = None) -> dict:
    """Mean task score on `rows`, with every prediction kept for inspection. `label` names the progress bar;
    `cache` (base_answers_dir) keeps the base model's answers from one run to the next."""
    if not rows or "prompt" not in rows[0]:
        return {"metric": None, "score": None, "predictions": []}
    references = [answer_text(r) for r in rows]
    predictions = _answers(model, tokenizer, [prompt_messages(r) for r in rows], max_new_tokens, label, cache)
    scores = [score(p, r) for p, r in zip(predictions, references)]
    return {
        "metric": metric_name(references[0]),
        "score": sum(scores) / len(scores),
        "predictions": [{"prompt": prompt_messages(r)[-1]["content"], "reference": ref, "prediction": p, "score": s}
                        for r, ref, p, s in zip(rows, references, predictions, scores)],
    }
