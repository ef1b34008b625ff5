"""Rows against max_length, as SFTTrainer (TRL 1.16) treats them: a row longer than max_length loses its last tokens;
one whose prompt alone fills max_length keeps no answer token to learn from, and SFTTrainer drops it ("fully masked").
When every row went, training crashed after the weights had loaded and left a half run folder that runs/latest
pointed at; data loading now stops first, saying how long the rows are and what max_length would keep them.
"""

from __future__ import annotations


def dropped(prompt_tokens: int, max_length: int, completion_only_loss: bool) -> bool:
    """Loss on answers only, and the answer starts at or after max_length. (Text rows count no prompt: never.)"""
    return completion_only_loss and prompt_tokens >= max_length


def length_warning(prompt_tokens: int, total: int, max_length: int, completion_only_loss: bool):
    """(problem, fix) for a row longer than max_length, else None."""
    if total <= max_length:
        return None
    if dropped(prompt_tokens, max_length, completion_only_loss):
        return (f"{total} tokens; the prompt alone ({prompt_tokens}) fills max_length {max_length}, so the whole "
                "answer is cut and the row is dropped", f"raise max_length to {total} or shorten the prompt")
    cut = total - max_length
    return (f"{total} tokens, {cut} over max_length {max_length}: the last {cut} tokens would be cut",
            f"raise max_length to {total} or shorten the row")


def all_dropped_problem(source: str, lengths: list[tuple[int, int]], max_length: int,
                        completion_only_loss: bool) -> str | None:
    """The message when every row (`lengths`: (prompt, total) tokens of each) would be dropped, else None."""
    if not lengths or not all(dropped(prompt, max_length, completion_only_loss) for prompt, _ in lengths):
        return None
    longest = max(total for _, total in lengths)
    return (f"{source}: all {len(lengths)} rows would be dropped: each prompt alone fills max_length {max_length} "
            f"(the longest row has {longest} tokens), so no answer token is left to learn from. Raise max_length to "
            f"{longest} (it must stay within the model's positions), or shorten the prompts")
