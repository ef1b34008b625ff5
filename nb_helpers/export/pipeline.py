"""The whole export, as `python -m nb_helpers export` and notebook 05 run it: GGUF files of the merged folder, each
loaded in llama.cpp and checked against transformers on held-out prompts; the adapter as a GGUF adapter over the
base's F16 file, checked the same way; an Ollama Modelfile for each."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from nb_helpers.export.check import FIRST_TOKENS, Agreement, check_file, reference_tokens
from nb_helpers.export.convert import CONVERTED, GGUF_KINDS, quantize_gguf, write_adapter_gguf, write_gguf
from nb_helpers.export.ollama import ollama_modelfile
from nb_helpers.export.runtime import llama_cpp_missing


@dataclass
class ExportResult:
    kind: str  # f16, q8_0, q4_k_m, or "adapter" (the adapter GGUF over the base's F16)
    path: Path
    bytes: int
    write_s: float
    agreement: Agreement | None = None

    @property
    def passed(self) -> bool | None:
        return None if self.agreement is None else self.agreement.passed(self.kind)

    def line(self) -> str:
        check = "" if self.agreement is None else f"; in llama.cpp: {self.agreement.line()}"
        verdict = {True: " (passes)", False: " (FAILS the bar for this kind)", None: ""}[self.passed]
        return f"{self.path.name}: {self.bytes / 2**20:.0f} MiB, written in {self.write_s:.1f} s{check}{verdict}"


def trained_system_prompt(conversations: list[list[dict]] | None) -> str | None:
    """The system message the prompts share (the one the model was trained with), else None."""
    systems = {c[0]["content"] for c in conversations or [] if c and c[0]["role"] == "system"}
    return systems.pop() if len(systems) == 1 and all(c and c[0]["role"] == "system" for c in conversations) else None


def _reference(model_dir: Path, conversations, max_new_tokens: int, log):
    """transformers' prompt and answer tokens for the merged folder (fp32 on the CPU), or None with the reason."""
    if not conversations:
        return None
    if missing := llama_cpp_missing():
        log(f"[export] not checked: {missing}")
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from nb_helpers.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True)
    try:
        return reference_tokens(model, load_tokenizer(str(model_dir)), conversations, max_new_tokens)
    finally:
        del model


def _timed(kind: str, write, reference, conversations, log, lora_of: Path | None = None) -> ExportResult:
    start = time.perf_counter()
    path = write()
    result = ExportResult(kind, path, path.stat().st_size, time.perf_counter() - start)
    if reference is not None:
        model, lora = (lora_of, path) if lora_of else (path, None)
        result.agreement = check_file(reference, model, conversations, lora)
    log(f"[export] {result.line()}")
    return result


def export_gguf(model_dir: str | Path, kinds=GGUF_KINDS, conversations: list[list[dict]] | None = None,
                max_new_tokens: int = 32, out_dir: str | Path | None = None, log=print,
                adapter_dir: str | Path | None = None, base_dir: str | Path | None = None) -> list[ExportResult]:
    """One GGUF per kind of the merged folder `model_dir`, in out_dir (default: gguf/ beside it), each checked in
    llama.cpp against transformers on `conversations` when given (the first min(max_new_tokens, 32) tokens); with adapter_dir and base_dir, also the base's
    F16 file and the adapter GGUF over it, checked against the same merged answers. Writes `Modelfile` (the last
    file written of the merged model) and, with the adapter, `Modelfile.adapter`."""
    from nb_helpers.models import load_tokenizer

    model_dir = Path(model_dir)
    out_dir = Path(out_dir or model_dir.parent / "gguf")
    name = model_dir.parent.name or "model"
    reference = _reference(model_dir, conversations, min(max_new_tokens, FIRST_TOKENS), log)
    results: list[ExportResult] = []
    for kind in kinds:
        path = out_dir / f"{name}-{kind}.gguf"
        f16 = next((r.path for r in results if r.kind == "f16"), None)
        write = ((lambda: quantize_gguf(f16, path, kind)) if f16 and kind not in CONVERTED
                 else (lambda: write_gguf(model_dir, path, kind, log)))
        results.append(_timed(kind, write, reference, conversations, log))
    tokenizer = load_tokenizer(str(model_dir))
    system = trained_system_prompt(conversations)
    (out_dir / "Modelfile").write_text(ollama_modelfile(tokenizer, results[-1].path.name, system), encoding="utf-8")
    if adapter_dir and base_dir:
        base = out_dir / f"base-{Path(base_dir).name}-f16.gguf"
        if not base.exists():
            write_gguf(base_dir, base, "f16", log)
        adapter = out_dir / f"{name}-adapter-f16.gguf"
        results.append(_timed("adapter", lambda: write_adapter_gguf(adapter_dir, base_dir, adapter, log), reference,
                              conversations, log, lora_of=base))
        (out_dir / "Modelfile.adapter").write_text(
            ollama_modelfile(tokenizer, base.name, system, adapter_name=adapter.name), encoding="utf-8")
    log(f"[export] Ollama: `ollama create NAME -f {out_dir / 'Modelfile'}` (FROM the last file written)"
        + (f"; the adapter over the base: `ollama create NAME -f {out_dir / 'Modelfile.adapter'}`"
           if adapter_dir and base_dir else ""))
    return results
