"""Folding a LoRA adapter into its base, one weight at a time: W' = W + scale · B @ A, scale = alpha / r.

The merged folder is a copy of the base's safetensors files in which each adapted weight is rewritten in place,
so host RAM holds one weight matrix (in fp32 while it is updated) and the adapter, never the model: PEFT's
merge_and_unload would hold the whole 16-bit model, and a check of it an fp32 copy more. The weights keep the
base's dtype (bf16 for the course's models), rounded once from the fp32 sum.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from nb_helpers.export.errors import ExportError

_PREFIX = "base_model.model."  # what PEFT puts before a module's name in adapter_model.safetensors
_DTYPES: dict = {}  # safetensors' dtype names -> torch's, filled when torch is imported
_BASE_FILES = (".json", ".txt")  # config.json, generation_config.json, the shards' index; not the tokenizer
_UNSUPPORTED = {"use_dora": "DoRA", "rank_pattern": "per-layer ranks", "alpha_pattern": "per-layer alphas",
                "modules_to_save": "fully trained modules", "fan_in_fan_out": "fan_in_fan_out weights",
                "trainable_token_indices": "trained token rows", "lora_bias": "LoRA biases"}


def lora_updates(adapter_dir: Path) -> tuple[float, dict]:
    """(scale, {base weight name: (A, B)}) of a plain LoRA adapter, read with safetensors (never a pickle)."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    used = [name for key, name in _UNSUPPORTED.items() if config.get(key)]
    if used:
        raise ExportError(f"{adapter_dir}: the adapter uses {', '.join(used)}, which this merge does not fold in; "
                          "merge it with PEFT (PeftModel.from_pretrained(base, adapter).merge_and_unload()) and "
                          "save_pretrained the result, then export that folder")
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    scale = alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    pairs = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix(_PREFIX).removesuffix(".lora_A.weight")
            pairs[f"{module}.weight"] = (a, tensors[key.replace(".lora_A.", ".lora_B.")])
    return scale, pairs


def _header(path: Path) -> tuple[int, dict]:
    """(where the tensor bytes start, the safetensors header: {name: {dtype, shape, data_offsets}})."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return 8 + size, json.loads(f.read(size))


def merge_lora(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The merged model in out_dir: base files copied (config, shards, index), each adapted weight rewritten in
    place, and the tokenizer saved from the adapter folder (the one training used, chat template included)."""
    import torch

    from nb_helpers.models import load_tokenizer

    _DTYPES.update({"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32})

    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    scale, pairs = lora_updates(adapter_dir)
    shards = sorted(base_dir.glob("*.safetensors"))
    if not shards:
        raise ExportError(f"{base_dir}: no *.safetensors files — the merge reads safetensors only")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in base_dir.iterdir():
        if f.suffix in _BASE_FILES and not f.name.startswith("tokenizer") and f.name != "special_tokens_map.json":
            shutil.copy2(f, out_dir / f.name)
    for shard in shards:
        target = out_dir / shard.name
        shutil.copyfile(shard, target)  # streamed by the OS: no weight passes through Python here
        start, header = _header(target)
        with open(target, "r+b") as out:  # plain reads, not a memory map: each weight's pages are freed after it
            for name in [n for n in header if n in pairs]:
                a, b = pairs.pop(name)
                if header[name]["dtype"] not in _DTYPES:
                    raise ExportError(f"{shard}: {name} is stored as {header[name]['dtype']}; the merge reads BF16, "
                                      "F16 and F32 weights — merge with PEFT's merge_and_unload instead")
                begin, end = header[name]["data_offsets"]
                out.seek(start + begin)
                raw = bytearray(end - begin)
                out.readinto(raw)
                weight = torch.frombuffer(raw, dtype=_DTYPES[header[name]["dtype"]]).reshape(header[name]["shape"])
                merged = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
                out.seek(start + begin)
                out.write(merged.contiguous().view(torch.uint8).numpy().tobytes())
    if pairs:
        raise ExportError(f"{adapter_dir}: {len(pairs)} adapted weights are not in {base_dir} (first: "
                          f"{next(iter(pairs))}): the adapter was made for another base model")
    load_tokenizer(str(adapter_dir)).save_pretrained(out_dir)
    return out_dir


def base_folder(path: str) -> Path:
    """A local folder of the base model: the path itself, or the Hub id's files in the local Hub cache (fetched
    there if the Hub answers and they are missing)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


def merge_adapter(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Merge a run's adapter into its base model (from the run's config), after checking the adapter: a damaged
    one is refused before anything is written. Returns out_dir."""
    from nb_helpers.config import RunConfig
    from nb_helpers.faults.adapter_check import check_run_adapter
    from nb_helpers.models import resolve_model
    from nb_helpers.runs import load_run

    run = load_run(run_dir)
    choice = resolve_model(RunConfig.from_dict(run.config), verbose=False)
    check_run_adapter(run.path, choice.path)  # before anything is loaded or written: NaN would merge silently
    return merge_lora(base_folder(choice.path), run.path / "adapter", out_dir)
