"""GGUF files written by llama.cpp's own tools: a 16-bit folder to F16 (convert_hf_to_gguf.py), F16 to Q8_0 and
Q4_K_M (llama.cpp's quantizer, through llama-cpp-python), and a LoRA adapter to a GGUF adapter
(convert_lora_to_gguf.py). Whatever the architecture, llama.cpp decides the tensor names, the hyperparameters and
the tokenizer's metadata, so every family it supports exports, and the file says what llama.cpp itself would say.

The scripts only ever see safetensors: they run on a folder of links to the model's files, never its pickles.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from nb_helpers.export.errors import ExportError
from nb_helpers.export.llama_cpp_code import run_script

CONVERTED = ("f16",)  # convert_hf_to_gguf.py writes it: 16 bits a weight (bf16 weights of ordinary size exactly)
# Made from the F16 file by llama.cpp's quantizer: Q8_0 8.5 bits a weight, Q4_K_M ~4.9. The converter can write Q8_0
# too, in Python: for the 135M model 6.7 s against about 1 s here, from an F16 that holds the bf16 weights exactly.
QUANTIZED = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
GGUF_KINDS = (*CONVERTED, *QUANTIZED)
_SAFE_FILES = (".json", ".safetensors", ".jinja", ".txt", ".model", ".tiktoken")  # never .bin/.pt/.pth: pickles


def check_kind(kind: str) -> str:
    kind = str(kind).strip().lower()
    if kind not in GGUF_KINDS:
        raise ExportError(f"GGUF kind {kind!r}: choose one of {', '.join(GGUF_KINDS)}")
    return kind


def plain_byte_level(tokenizer_json: dict) -> dict | None:
    """The same tokenizer written as the byte-level BPE it is, or None when there is nothing to change.

    transformers' GGUF reader (which made the embedded SmolLM2's tokenizer.json) switches SentencePiece's byte
    fallback and its decoders on for a byte-level tokenizer. They never act (after the byte-level split every byte
    has a token), but llama.cpp's converter reads the flag as "SentencePiece tokenizer" and writes a file llama.cpp
    cannot tokenize with. tests/test_export.py checks that both versions encode and decode the same."""
    model = tokenizer_json.get("model") or {}
    decoders = (tokenizer_json.get("decoder") or {}).get("decoders") or []
    byte_level = [d for d in decoders if d.get("type") == "ByteLevel"]
    splits_bytes = '"ByteLevel"' in json.dumps(tokenizer_json.get("pre_tokenizer") or {})
    if model.get("type") != "BPE" or not model.get("byte_fallback") or not splits_bytes or not byte_level:
        return None
    return {**tokenizer_json, "model": {**model, "byte_fallback": False}, "decoder": byte_level[0]}


@contextmanager
def staged(model_dir: Path):
    """A temporary folder of links to the model's safe files (copies where links are refused), its tokenizer.json
    rewritten by plain_byte_level when that changes it. The model's own folder is never changed."""
    files = [f for f in sorted(model_dir.iterdir()) if f.is_file() and f.suffix in _SAFE_FILES]
    if not any(f.suffix == ".safetensors" for f in files):
        raise ExportError(f"{model_dir}: no *.safetensors files — save the model with safe_serialization=True "
                          "(pickled .bin weights are never converted)")
    with tempfile.TemporaryDirectory(prefix="gguf-source-") as tmp:
        for f in files:
            try:
                (Path(tmp) / f.name).symlink_to(f.resolve())
            except OSError:  # Windows without developer mode
                shutil.copy2(f, Path(tmp) / f.name)
        tokenizer_file = model_dir / "tokenizer.json"
        if tokenizer_file.is_file():
            plain = plain_byte_level(json.loads(tokenizer_file.read_text(encoding="utf-8")))
            if plain is not None:
                (Path(tmp) / "tokenizer.json").unlink()
                (Path(tmp) / "tokenizer.json").write_text(json.dumps(plain, ensure_ascii=False), encoding="utf-8")
        yield Path(tmp)


def write_gguf(model_dir: str | Path, out_path: str | Path, kind: str = "f16", log=print) -> Path:
    """A GGUF of a 16-bit Hugging Face folder, of any architecture llama.cpp supports. `kind`: "f16" (2 bytes a
    weight; bf16 weights of ordinary size convert exactly), "q8_0" (blocks of 32 int8 values with one fp16 scale:
    8.5 bits a weight) or "q4_k_m" (llama.cpp's 4-bit K-quant mix: about 4.9 bits), the last two made from an F16
    file by llama.cpp's quantizer (quantize_gguf: give it the F16 when you have one)."""
    kind = check_kind(kind)
    model_dir, out_path = Path(model_dir), Path(out_path)
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir}: no config.json — give the folder a merged model was saved to")
    out_path.parent.mkdir(parents=True, exist_ok=True)  # runs/<run>/gguf/ does not exist before the first export
    if kind in QUANTIZED:
        with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".f16-") as tmp:
            return quantize_gguf(write_gguf(model_dir, Path(tmp) / "f16.gguf", "f16", log), out_path, kind)
    with staged(model_dir) as folder:
        run_script("convert_hf_to_gguf.py", [folder, "--outtype", kind, "--outfile", out_path.resolve()], log)
    return out_path


def quantize_gguf(source: str | Path, out_path: str | Path, kind: str = "q4_k_m") -> Path:
    """llama.cpp's quantizer (llama_model_quantize, what `llama-quantize` runs) on an F16 GGUF. Tensors whose rows
    do not fit the 4-bit blocks (256 values) get the fallback type llama.cpp picks for them."""
    from nb_helpers.export.runtime import quiet_llama_cpp

    llama_cpp = quiet_llama_cpp()
    kind = check_kind(kind)
    if kind not in QUANTIZED:
        raise ExportError(f"{kind} is written by the converter, not the quantizer: use write_gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZED[kind])
    params.nthread = os.cpu_count() or 1
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out_path).encode(), ctypes.byref(params)) != 0:
        raise ExportError(f"llama.cpp's quantizer could not make {kind} from {source}: is it an F16 GGUF?")
    return Path(out_path)


def write_adapter_gguf(adapter_dir: str | Path, base_dir: str | Path, out_path: str | Path, log=print) -> Path:
    """The LoRA adapter as a GGUF adapter (F16), for llama.cpp's --lora and Ollama's ADAPTER, over the GGUF of its
    base model. llama.cpp's convert_lora_to_gguf.py reads the base folder for the architecture only."""
    adapter_dir, out_path = Path(adapter_dir), Path(out_path)
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise ExportError(f"{adapter_dir}: no adapter_model.safetensors — give a PEFT adapter folder "
                          "(save_pretrained writes it)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with staged(Path(base_dir)) as base, staged(adapter_dir) as adapter:
        run_script("convert_lora_to_gguf.py", ["--base", base, "--outtype", "f16", "--outfile", out_path.resolve(),
                                               adapter], log)
    return out_path
