"""llama.cpp as the runtime: a GGUF, alone or with a GGUF adapter over it, loaded by llama.cpp's own loader (the
one Ollama and LM Studio use, through llama-cpp-python) and asked for greedy answers through the chat template
stored in the file, rendered the way llama-cpp-python's chat completions render it."""

from __future__ import annotations

import os
from pathlib import Path

from nb_helpers.export.errors import ExportError
from nb_helpers.export.llama_cpp_code import LLAMA_CPP_PYTHON

INSTALL = f"pip install llama-cpp-python=={LLAMA_CPP_PYTHON}"  # builds llama.cpp from source once (minutes)


def llama_cpp_missing() -> str | None:
    """None when llama-cpp-python imports, else one line saying how to install it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return (f"llama-cpp-python is not installed, so llama.cpp cannot load the files here: `{INSTALL}` (make test "
                "installs it)")
    return None


def require_llama_cpp():
    import sys

    if "llama_cpp" not in sys.modules:
        # llama.cpp's OpenMP threads spin while they wait by default: on a busy 2-core machine (a notebook kernel
        # beside other work) that made a 135M model decode at 1 token a second instead of 16. Read when llama.cpp's
        # OpenMP library loads, so set before the first import; torch, imported earlier, keeps its own setting.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    missing = llama_cpp_missing()
    if missing:
        raise ExportError(missing)
    import llama_cpp

    return llama_cpp


_LOG: list[str] = []  # llama.cpp's log lines since the last quiet_llama_cpp(): read only when something fails


def quiet_llama_cpp():
    """llama_cpp, with its log kept in _LOG instead of written to stderr (where a notebook shows it as an error,
    even with verbose=False)."""
    llama_cpp = require_llama_cpp()
    _LOG.clear()
    if getattr(quiet_llama_cpp, "callback", None) is None:
        @llama_cpp.llama_log_callback
        def keep(level, text, user_data):
            _LOG.append(text.decode("utf-8", "replace"))

        quiet_llama_cpp.callback = keep  # ctypes must keep the callback alive as long as llama.cpp may call it
    llama_cpp.llama_log_set(quiet_llama_cpp.callback, None)
    return llama_cpp


def open_gguf(path: str | Path, lora_path: str | Path | None = None, n_ctx: int = 2048, logits_all: bool = False):
    """llama_cpp.Llama on the file (and the adapter over it), quiet. Raises ExportError with
    llama.cpp's reason when it refuses the file."""
    llama_cpp = quiet_llama_cpp()
    try:
        # Every core, for prompts and decoding alike. With llama.cpp's OpenMP waits passive (require_llama_cpp),
        # two threads answered 12 prompts in a notebook kernel on the course's 2-core machine in 7.8 s against 12.6 s
        # for one (Q8_0, after torch had generated in that kernel); with spinning waits, all cores were 10x slower
        threads = os.cpu_count() or 1
        return llama_cpp.Llama(model_path=str(path), lora_path=str(lora_path) if lora_path else None, n_ctx=n_ctx,
                               n_threads=threads, n_threads_batch=threads, logits_all=logits_all, seed=0,
                               verbose=False)
    except (ValueError, RuntimeError) as e:
        reason = "".join(line for line in _LOG if "error" in line.lower() or "failed" in line.lower()).strip()
        raise ExportError(f"llama.cpp could not load {Path(path).name}"
                          f"{' with ' + Path(lora_path).name if lora_path else ''}: {reason or e}") from None


def chat_tokens(llm, messages: list[dict]) -> list[int]:
    """The prompt tokens for a conversation: the file's own chat template, with its generation prompt, tokenized
    with special tokens read as such (what create_chat_completion does)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise ExportError("the GGUF holds no chat template (tokenizer.chat_template): export from a folder whose "
                          "tokenizer has one")
    def special(token: int) -> str:  # a special token's text, through the public API (not the private _model)
        return llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    formatter = Jinja2ChatFormatter(template, eos_token=special(llm.token_eos()), bos_token=special(llm.token_bos()))
    prompt = formatter(messages=messages).prompt
    return llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)


def greedy_tokens(llm, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt`, up to and including an end-of-generation token."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if llama_cpp.llama_vocab_is_eog(vocab, token) or len(out) >= max_new_tokens:
            break
    return out


def answer(llm, tokens: list[int]) -> str:
    """The text of generated tokens, end-of-generation tokens left out (skip_special_tokens, as the course decodes)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    kept = [t for t in tokens if not llama_cpp.llama_vocab_is_eog(vocab, t)]
    return llm.detokenize(kept, special=False).decode("utf-8", "replace")


def llama_cpp_answers(path: str | Path, conversations: list[list[dict]], max_new_tokens: int = 64,
                      lora_path: str | Path | None = None) -> list[str]:
    """llama.cpp's greedy answers to chat prompts, from the file (and adapter) as Ollama would run them."""
    llm = open_gguf(path, lora_path)
    try:
        return [answer(llm, greedy_tokens(llm, chat_tokens(llm, c), max_new_tokens)) for c in conversations]
    finally:
        llm.close()


def prompt_logits(llm, tokens: list[int]):
    """llama.cpp's logits at every position of `tokens` (the Llama must be opened with logits_all=True)."""
    llm.reset()
    llm.eval(tokens)
    return llm.scores[: len(tokens)].copy()
