"""The task metric: generate answers for held-out prompts and score them against the reference answers.

For JSON answers (the shipped dataset) the score is per field: the share of the reference's keys whose
value the model reproduced exactly, in a JSON object it actually emitted. Unparseable output scores 0.
For other answers it is exact match after whitespace normalisation. Higher is better, 1.0 is perfect.
"""

from __future__ import annotations

import json
import re

from nb_helpers.data import answer_text, prompt_messages

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

    On a CPU every decoding step dequantizes every 4-bit weight, whatever the batch, so one batch of 64 costs
    little more than one of 16: 60 prompts took 38 s instead of 75 s on 2 AVX2 cores. A GPU keeps batches of 16,
    whose key/value cache stays small next to a 4 GB card's training memory."""
    import torch

    if batch_size is None:
        batch_size = 64 if model.device.type == "cpu" else 16

    from transformers import LogitsProcessorList

    from nb_helpers.frontend import progress_bar

    batches = range(0, len(conversations), batch_size)
    bar = progress_bar(len(batches) * max_new_tokens,
                       f"{label or 'generating'}: {len(conversations)} prompt{'s' * (len(conversations) != 1)}")
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only models must see their prompt end right before generation
    was_training = model.training
    model.eval()
    answers = []
    try:
        for start in batches:
            tick = _TickEachToken(bar) if bar is not None else None
            texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                     for c in conversations[start:start + batch_size]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id,
                                     logits_processor=LogitsProcessorList([tick] if tick else []))
            if tick is not None:
                bar.update(max_new_tokens - tick.count)  # every answer ended early: the batch is done all the same
            new_tokens = out[:, batch["input_ids"].shape[1]:]
            answers += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
        if bar is not None:
            bar.close()
    return answers


def evaluate_task(model, tokenizer, rows: list[dict], max_new_tokens: int = 64,
                  label: str = "scoring held-out prompts") -> dict:
    """Mean task score on `rows`, with every prediction kept for inspection. `label` names the progress bar."""
    if not rows or "prompt" not in rows[0]:
        return {"metric": None, "score": None, "predictions": []}
    references = [answer_text(r) for r in rows]
    predictions = generate(model, tokenizer, [prompt_messages(r) for r in rows], max_new_tokens, label=label)
    scores = [score(p, r) for p, r in zip(predictions, references)]
    return {
        "metric": metric_name(references[0]),
        "score": sum(scores) / len(scores),
        "predictions": [{"prompt": prompt_messages(r)[-1]["content"], "reference": ref, "prediction": p, "score": s}
                        for r, ref, p, s in zip(rows, references, predictions, scores)],
    }
