"""Does llama.cpp run the file as transformers runs the merged model? Both get the same chat prompts, each through
its own tokenizer and chat template (transformers: the folder's; llama.cpp: the file's), and answer greedily; the
prompt tokens must match, and so must the answers' first tokens, as far as the file's precision allows:

  * F16 (and the adapter over the F16 base): the same first tokens on at least 80% of the prompts (4 of 5), the
    answers run freely. F16 is exact for the weights; what can differ is the arithmetic (llama.cpp multiplies in
    f16 and f32, transformers in fp32), which can flip a near tie between two tokens, and every token after it.
  * Q8_0: at least 90% of llama.cpp's next-token choices equal to transformers', given transformers' answer so far
    (teacher-forced: one flipped near tie counts once, not for every token after it).
  * Q4_K_M: reported, not required: 4-bit rounding changes answers; the task metric says by how much it matters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_TOKENS = 32  # the answer tokens compared: enough to cover a short JSON answer's keys
# kind: (what is counted, the share required)
REQUIRED = {"f16": ("answers", 0.8), "adapter": ("answers", 0.8), "q8_0": ("tokens", 0.9)}


@dataclass
class Agreement:
    prompts: int
    same_prompt_tokens: int  # prompts that both tokenized to the same ids: the tokenizer and template survived
    same_answers: int  # prompts whose answer tokens are identical
    same_tokens: int  # llama.cpp's next-token choice equal to transformers' token, given transformers' answer so far
    tokens: int  # answer tokens compared
    pairs: list = field(default_factory=list)  # (transformers' token ids, llama.cpp's), per prompt

    @property
    def token_rate(self) -> float:
        return self.same_tokens / max(self.tokens, 1)

    def passed(self, kind: str) -> bool | None:
        """True or False where REQUIRED names a bar for this kind; None where it is only reported."""
        if kind not in REQUIRED:
            return None
        what, share = REQUIRED[kind]
        rate = self.same_answers / max(self.prompts, 1) if what == "answers" else self.token_rate
        return self.same_prompt_tokens == self.prompts and rate >= share

    def line(self) -> str:
        return (f"same answer tokens as transformers on {self.same_answers}/{self.prompts} prompts, "
                f"{self.token_rate:.0%} of next-token choices; prompt tokens identical on {self.same_prompt_tokens}/{self.prompts}")


def reference_tokens(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int) -> list[tuple]:
    """(prompt ids, greedy answer ids) from transformers, one prompt at a time (no padding to differ)."""
    import torch

    out = []
    model.eval()
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
        out.append((ids[0].tolist(), generated[0, ids.shape[1]:].tolist()))
    return out


def compare(reference: list[tuple], llm, conversations: list[list[dict]]) -> Agreement:
    """llama.cpp's greedy answers (as many tokens as transformers was allowed) against transformers', and its
    next-token choices along transformers' answers (the Llama must be opened with logits_all=True)."""
    from nb_helpers.export.runtime import chat_tokens, greedy_tokens, prompt_logits

    result = Agreement(len(conversations), 0, 0, 0, 0)
    for (prompt, theirs), messages in zip(reference, conversations):
        ours = chat_tokens(llm, messages)
        result.same_prompt_tokens += ours == prompt
        answer = greedy_tokens(llm, ours, len(theirs)) if theirs else []
        result.same_answers += answer == theirs
        choices = prompt_logits(llm, ours + theirs)[len(ours) - 1:-1].argmax(-1) if theirs else []
        result.same_tokens += sum(int(a) == b for a, b in zip(choices, theirs))
        result.tokens += len(theirs)
        result.pairs.append((theirs, answer))
    return result


def check_file(reference: list[tuple], path, conversations: list[list[dict]], lora_path=None) -> Agreement:
    from nb_helpers.export.runtime import open_gguf

    longest = max((len(p) + len(a) for p, a in reference), default=0)
    llm = open_gguf(path, lora_path, n_ctx=longest + 64, logits_all=True)  # logits kept: n_ctx x vocabulary floats
    try:
        return compare(reference, llm, conversations)
    finally:
        llm.close()
