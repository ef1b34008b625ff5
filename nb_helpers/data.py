"""Loading instruction data in the formats people actually have, into TRL's conversational prompt/completion form.

Accepted per JSONL row (one format per file):
  {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}   last message = the answer
  {"prompt": "...", "completion": "..."}                                           strings or message lists
  {"instruction": "...", "input": "...", "output": "..."}                          Alpaca style; input optional
  {"text": "..."}                                                                  plain text, no chat template
or a hub dataset name (needs the hub), whose rows use one of the same formats.

Everything except `text` becomes {"prompt": [messages], "completion": [assistant message]}: TRL then applies
the model's chat template and, with completion_only_loss, computes the loss on the answer tokens only.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import RunConfig

ROLES = {"system", "user", "assistant"}


class DataError(ValueError):
    """A dataset problem, reported as FILE:LINE: problem - fix."""


def _problem(source: str, line: int | None, problem: str, fix: str) -> DataError:
    where = f"{source}:{line}" if line is not None else source
    return DataError(f"{where}: {problem} — {fix}")


def detect_format(row: dict) -> str | None:
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "instruction" in row and "output" in row:
        return "instruction"
    if "text" in row:
        return "text"
    return None


def _as_messages(value, role: str) -> list[dict]:
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def normalize_row(row: dict, source: str = "<row>", line: int | None = None) -> dict:
    fmt = detect_format(row) if isinstance(row, dict) else None
    if fmt is None:
        raise _problem(source, line, f"row matches no accepted format (keys: {sorted(row) if isinstance(row, dict) else type(row).__name__})",
                       "use messages, prompt/completion, instruction/input/output or text")
    if fmt == "text":
        if not isinstance(row["text"], str) or not row["text"].strip():
            raise _problem(source, line, "empty or non-string 'text'", "give the row some text or remove it")
        return {"text": row["text"]}
    if fmt == "messages":
        messages = row["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise _problem(source, line, "'messages' needs at least a user and an assistant message",
                           "add the missing turn")
        prompt, completion = messages[:-1], [messages[-1]]
    elif fmt == "prompt_completion":
        prompt, completion = _as_messages(row["prompt"], "user"), _as_messages(row["completion"], "assistant")
    else:
        user = row["instruction"] if not row.get("input") else f"{row['instruction']}\n\n{row['input']}"
        prompt, completion = [{"role": "user", "content": user}], [{"role": "assistant", "content": row["output"]}]
    for message in prompt + completion:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _problem(source, line, f"bad message {message!r}", f"each message needs a role in {sorted(ROLES)}")
        if not isinstance(message.get("content"), str) or not message["content"].strip():
            raise _problem(source, line, f"empty or non-string content in a {message.get('role')} message",
                           "fill in the text or remove the row")
    if completion[-1]["role"] != "assistant":
        raise _problem(source, line, "the last message is not from the assistant, so there is no answer to learn",
                       "end each row with the assistant's answer")
    return {"prompt": prompt, "completion": completion}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise _problem(str(path), None, "file not found", "check train_file/eval_file in the config")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _problem(str(path), None, f"not UTF-8 ({e.reason} at byte {e.start})", "re-save the file as UTF-8") from e
    rows, formats = [], set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _problem(str(path), number, f"not valid JSON ({e.msg} at column {e.colno})",
                           "fix or remove this line") from e
        row = normalize_row(record, str(path), number)
        formats.add("text" if "text" in row else "chat")
        rows.append(row)
    if not rows:
        raise _problem(str(path), None, "no rows", "add at least one JSON line")
    if len(formats) > 1:
        raise _problem(str(path), None, "mixes plain 'text' rows with chat rows",
                       "use one format per file (text rows get no chat template and no answer-only loss)")
    return rows


def load_rows(source: str, cfg: RunConfig, limit: int | None = None) -> list[dict]:
    path = cfg.resolve_path(source)
    if path.suffix in {".jsonl", ".json"} or path.exists():
        rows = read_jsonl(path)
    else:  # a hub dataset name
        from datasets import load_dataset

        split = "train"
        name = source
        if ":" in source:
            name, split = source.split(":", 1)
        raw = load_dataset(name, split=split)
        rows = [normalize_row(dict(r), source, i) for i, r in enumerate(raw, start=1)]
    return rows[:limit] if limit else rows


def to_dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)


def load_train_eval(cfg: RunConfig):
    """Read and check both splits before any model loads, so data problems cost seconds, not minutes."""
    train_rows = load_rows(cfg.train_file, cfg, cfg.max_train_samples)
    eval_rows = load_rows(cfg.eval_file, cfg, cfg.max_eval_samples) if cfg.eval_file else []
    if "text" in train_rows[0] and cfg.completion_only_loss:
        print("[data] plain-text rows have no separate answer: training on all tokens (completion_only_loss ignored)")
    return train_rows, eval_rows


def prompt_messages(row: dict) -> list[dict]:
    return row["prompt"]


def answer_text(row: dict) -> str:
    return row["completion"][-1]["content"]
