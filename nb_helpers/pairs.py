"""Preference pairs and DPO (notebook 07): pairs made from the shipped task, checked line by line before anything
loads, and what the course adds around TRL's DPOTrainer (its settings, the run folder, the reward metrics).

A pair is one JSONL line (TRL's conversational preference format, plus the kind of error the rejected answer makes):

    {"prompt": [{"role": "system", ...}, {"role": "user", ...}],
     "chosen": [{"role": "assistant", "content": "<the correct JSON>"}],
     "rejected": [{"role": "assistant", "content": "<the same JSON with one realistic mistake>"}],
     "error": "swapped_field"}

`prompt`, `chosen` and `rejected` may also be plain strings (a user turn, an assistant turn). `make_pairs` builds the
pairs from SFT rows with a fixed seed (data/make_pairs.py writes data/pairs_train.jsonl and data/pairs_eval.jsonl);
`check_pairs_jsonl` collects every problem as FILE:LINE: problem — fix, the way nb_helpers.data checks SFT rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from nb_helpers.config import ConfigError, RunConfig
from nb_helpers.data import (DataError, DataReport, RowProblem, _check_messages, _check_text, parse_line,
                             split_lines)

PAIR_FIELDS = ("prompt", "chosen", "rejected")
# The mistakes a rejected answer makes, each one the tuned 135M model or the base model was seen to make on the
# shipped task (notebook 05's table): a value copied into the wrong field ("customer": "Krakow"), a value misspelt
# ("scafre", "Tunisia"), a wrong number, a value the order never named, a key dropped or invented, prose around the
# JSON. Each kind is a near miss: one field, or the wrapping, differs from the correct answer.
ERROR_KINDS = ("swapped_field", "misspelt_value", "wrong_quantity", "wrong_value", "missing_key", "extra_key",
               "extra_prose")
TEXT_FIELDS = ("customer", "item", "color", "city", "day")
PAIRS_SEED = 20261205
PROSE = ("Here is the order as JSON:\n{json}", "{json}\n\nLet me know if you need anything else!",
         "Sure! The extracted order is:\n\n{json}")
INVENTED = {"price": 19.99, "status": "pending", "order_id": 1042, "currency": "EUR"}


# --- making pairs -------------------------------------------------------------------------------------------------

def misspell(value: str, rng: random.Random) -> str:
    """A near miss of a word: two inner letters swapped, one dropped, or a suffix added (Tunis -> Tunisia)."""
    how = rng.choice(("swap", "drop", "suffix")) if len(value) >= 4 else "suffix"
    if how == "swap":
        i = rng.randrange(1, len(value) - 2)
        changed = value[:i] + value[i + 1] + value[i] + value[i + 2:]
    elif how == "drop":
        i = rng.randrange(1, len(value) - 1)
        changed = value[:i] + value[i + 1:]
    else:
        changed = value + rng.choice(("ia", "s", "e", "o"))
    return changed if changed != value else value + "s"


def corrupt(answer: dict, kind: str, rng: random.Random, vocabulary: dict[str, list]) -> str:
    """The correct answer (a dict) with one mistake of `kind`, as the text a model would write."""
    wrong = dict(answer)
    if kind == "swapped_field":  # a value of the order copied into another field
        target, source = rng.sample([k for k in TEXT_FIELDS if k in wrong], 2)
        wrong[target] = answer[source]
    elif kind == "misspelt_value":
        key = rng.choice([k for k in TEXT_FIELDS if k in wrong])
        wrong[key] = misspell(str(answer[key]), rng)
    elif kind == "wrong_quantity":
        q = int(answer["quantity"])
        wrong["quantity"] = q + rng.choice([d for d in (-2, -1, 1, 2) if q + d >= 1])
    elif kind == "wrong_value":  # a value the order never named, from another order
        key = rng.choice([k for k in TEXT_FIELDS if k in wrong])
        wrong[key] = rng.choice([v for v in vocabulary[key] if v != answer[key]])
    elif kind == "missing_key":
        del wrong[rng.choice(list(wrong))]
    elif kind == "extra_key":
        name = rng.choice(list(INVENTED))
        wrong[name] = INVENTED[name]
    elif kind == "extra_prose":
        return rng.choice(PROSE).format(json=json.dumps(answer))
    else:
        raise ValueError(f"unknown error kind {kind!r}; choose one of {', '.join(ERROR_KINDS)}")
    return json.dumps(wrong)


def make_pairs(rows: list[dict], seed: int = PAIRS_SEED) -> list[dict]:
    """One pair per SFT row (`messages` rows of the shipped task: the last message is the JSON answer). The kinds
    of error go round in a shuffled order, so each appears as often as the others; the same rows and seed give the
    same pairs."""
    rng = random.Random(seed)
    answers = [json.loads(row["messages"][-1]["content"]) for row in rows]
    vocabulary = {k: sorted({a[k] for a in answers if k in a}) for k in TEXT_FIELDS}
    kinds = [ERROR_KINDS[i % len(ERROR_KINDS)] for i in range(len(rows))]
    rng.shuffle(kinds)
    pairs = []
    for row, answer, kind in zip(rows, answers, kinds):
        chosen = row["messages"][-1]["content"]
        pairs.append({"prompt": row["messages"][:-1],
                      "chosen": [{"role": "assistant", "content": chosen}],
                      "rejected": [{"role": "assistant", "content": corrupt(answer, kind, rng, vocabulary)}],
                      "error": kind})
    return pairs


def write_pairs(source: str | Path, target: str | Path, seed: int = PAIRS_SEED) -> int:
    """The pairs of an SFT JSONL file (messages rows), written as JSONL; returns how many."""
    rows = [json.loads(line) for line in Path(source).read_text(encoding="utf-8").splitlines() if line.strip()]
    pairs = make_pairs(rows, seed)
    with open(target, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    return len(pairs)


# --- checking pairs: FILE:LINE: problem — fix ----------------------------------------------------------------------

def pair_messages(value, name: str, role: str) -> list[dict]:
    """A pair's field as messages: a list is checked as messages, a string becomes one `role` turn."""
    if isinstance(value, list):
        return _check_messages(value, f"'{name}'")
    return [{"role": role, "content": _check_text(value, f"'{name}'")}]


def normalize_pair(row) -> dict:
    """One raw line -> {"prompt": [...], "chosen": [...], "rejected": [...]}; raises RowProblem."""
    if not isinstance(row, dict):
        raise RowProblem(f"row is a JSON {type(row).__name__}, not an object",
                         'write each line as {"prompt": ..., "chosen": ..., "rejected": ...}')
    if missing := [name for name in PAIR_FIELDS if name not in row]:
        raise RowProblem(f"missing field {missing[0]!r} (a pair needs prompt, chosen and rejected)",
                         f"add {missing[0]!r} to the row")
    pair = {"prompt": pair_messages(row["prompt"], "prompt", "user")}
    if pair["prompt"][-1]["role"] != "user":
        raise RowProblem("the prompt does not end with a user turn", "end 'prompt' with the user's message")
    for name in ("chosen", "rejected"):
        pair[name] = pair_messages(row[name], name, "assistant")
        if [m["role"] for m in pair[name]] != ["assistant"]:
            raise RowProblem(f"'{name}' must be one assistant message", f'write it as [{{"role": "assistant", '
                             f'"content": "..."}}] or a plain string')
    if pair["chosen"][0]["content"].strip() == pair["rejected"][0]["content"].strip():
        raise RowProblem("chosen and rejected are the same answer, so the pair teaches nothing",
                         "make 'rejected' a worse answer than 'chosen', or remove the line")
    return pair


def pair_tokens(pair: dict, tokenizer) -> dict:
    """Token counts as DPOTrainer (TRL 1.16) makes them: the chat-templated prompt with the assistant's opening, each
    answer after it, and where the two answers first differ (the tokens they share are the same for both)."""
    ids = lambda messages, **kw: list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                                     **kw)["input_ids"])
    prompt = ids(pair["prompt"], add_generation_prompt=True)
    chosen, rejected = ids(pair["prompt"] + pair["chosen"]), ids(pair["prompt"] + pair["rejected"])
    differ = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    return {"prompt": len(prompt), "chosen": len(chosen), "rejected": len(rejected), "first_difference": differ}


def pair_length_problem(counts: dict, max_length: int):
    """(severity, problem, fix) for a pair longer than max_length, else None. TRL keeps the start: a prompt that fills
    max_length leaves no answer (the pair is dropped), and a cut before the answers differ leaves two equal answers."""
    longest = max(counts["chosen"], counts["rejected"])
    if longest <= max_length:
        return None
    fix = f"raise max_length to {longest} or shorten the prompt"
    if counts["prompt"] >= max_length:
        return ("error", f"{longest} tokens; the prompt alone ({counts['prompt']}) fills max_length {max_length}, so "
                         "no answer token is left and the pair is dropped", fix)
    if counts["first_difference"] >= max_length:
        return ("error", f"{longest} tokens; chosen and rejected first differ at token {counts['first_difference']}, "
                         f"after max_length {max_length}: cut there, the two answers are the same", fix)
    return ("warning", f"{longest} tokens, {longest - max_length} over max_length {max_length}: the end of the longer "
                       "answer would be cut", fix)


def check_pairs_jsonl(path: str | Path, tokenizer=None, max_length: int | None = None) -> DataReport:
    """Check every line of a preference JSONL file. Never raises for bad content: problems go into the report, whose
    `rows` are the good pairs and `lengths` (with a tokenizer) their (prompt, longer answer) token counts."""
    path = Path(path)
    report = DataReport(str(path))
    try:
        raw = path.read_bytes()
    except OSError as e:
        report.unreadable = f"{type(e).__name__}: {e.strerror or e} — check the path (pairs_train_file/pairs_eval_file)"
        return report
    seen: dict[str, int] = {}
    for number, raw_line in enumerate(split_lines(raw), start=1):
        if not raw_line.strip():
            continue
        try:
            pair = normalize_pair(parse_line(raw_line))
        except RowProblem as p:
            report.add(number, "error", p.problem, p.fix)
            continue
        if tokenizer is not None and max_length:
            counts = pair_tokens(pair, tokenizer)
            problem = pair_length_problem(counts, max_length)
            if problem:
                report.add(number, *problem)
                if problem[0] == "error":
                    continue
            report.lengths.append((counts["prompt"], max(counts["chosen"], counts["rejected"])))
        key = json.dumps(pair, sort_keys=True)
        if key in seen:
            report.add(number, "warning", f"duplicate of line {seen[key]}", "remove it unless you mean to weight it twice")
        seen.setdefault(key, number)
        report.rows.append(pair)
        report.lines.append(number)
    if not report.rows and not report.errors:
        report.add(None, "error", "no pairs (the file is empty)", "add at least one JSON line")
    return report


def load_pairs(source: str, cfg: RunConfig, limit: int | None = None, tokenizer=None) -> list[dict]:
    """The pairs of a JSONL file (relative to the project root), checked, the first `limit` (None or 0: all). Errors
    stop here, before any model loads; cfg.skip_invalid drops the bad lines instead (their numbers are printed)."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ConfigError(f"load_pairs(limit={limit!r}): give a whole number of pairs, 0 or more, or None for all")
    report = check_pairs_jsonl(cfg.resolve_path(source), tokenizer, cfg.max_length)
    if report.unreadable:
        raise DataError(report.text())
    if (report.errors and not cfg.skip_invalid) or not report.rows:
        raise DataError(report.text(limit=20) + f"\nFix these lines (`python data/make_pairs.py` rebuilds the shipped "
                        "pairs), or set skip_invalid=True to drop them.")
    if report.errors:
        lines = [str(p.line) for p in report.errors if p.line is not None]
        print(f"[pairs] {source}: skipped {len(lines)} invalid pair(s) (skip_invalid=True), lines {', '.join(lines[:30])}")
    for problem in report.warnings[:5]:
        print(f"[pairs] {problem.format(source)}")
    return report.rows[:limit] if limit else report.rows


def pair_dataset(pairs: list[dict]):
    """The pairs as a datasets.Dataset with TRL's three columns (conversational: TRL applies the chat template)."""
    from datasets import Dataset

    return Dataset.from_list([{k: p[k] for k in PAIR_FIELDS} for p in pairs])
