"""Is this adapter folder complete, finite and made for this base? Asked before export merges anything.

Unchecked, a damaged adapter either ships or crashes late: NaN values merge into NaN weights that every GGUF and the
Modelfile then carry, with the command reporting success; a truncated file, or one whose rank or layer sizes differ
from adapter_config.json or from the base model, fails deep inside safetensors or peft with a traceback; an adapter
whose file lacks layers its config targets merges without them, silently.
Here each of those is one message naming the file, what is wrong and how to recover, before anything is written.
The base model is built on the meta device from its config.json alone, so no weight is read to learn its sizes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from nb_helpers.config import ConfigError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# peft saves "base_model.model.<module of the base>.lora_A.weight" (the adapter's own name left out)
LORA_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])\.weight")
RETRAIN = "retrain (notebook 03, or `python -m nb_helpers train`)"


class AdapterError(ConfigError):
    """An adapter folder that must not be merged; the message names the file, the problem and the fix."""


def check_run_adapter(run_dir: str | Path, base: str) -> None:
    """Raise AdapterError unless the run's adapter/ fits `base` (what from_pretrained receives). The message ends
    with the way back: the newest checkpoint of the run whose adapter passes the same check, else retraining."""
    run_dir = Path(run_dir)
    base_layers = linear_layers(base)
    try:
        check_adapter(run_dir / "adapter", base_layers, base)
    except AdapterError as e:
        raise AdapterError(f"{e}\n{recovery(run_dir, base_layers, base)}") from None


def recovery(run_dir: Path, base_layers: dict, base: str) -> str:
    """The fix for a run whose adapter/ is bad: copy a good checkpoint's adapter files over it, or retrain."""
    from nb_helpers.faults.checkpoints import PREFIX, checkpoint_folders

    checkpoints = checkpoint_folders(run_dir / "checkpoints")
    for checkpoint in checkpoints:
        try:
            check_adapter(checkpoint, base_layers, base)
        except AdapterError:
            continue
        return (f"Fix: {checkpoint} holds a good adapter (the weights of step {checkpoint.name[len(PREFIX):]}): "
                f"copy its {CONFIG_FILE} and {WEIGHTS_FILE} into {run_dir / 'adapter'} and export again, or "
                f"{RETRAIN}.")
    looked = f"none of the {len(checkpoints)} checkpoints in {run_dir / 'checkpoints'} holds a good adapter either"
    return f"Fix: {RETRAIN}; {looked if checkpoints else f'{run_dir} has no checkpoints to export instead'}."


def check_adapter(adapter_dir: str | Path, base_layers: dict[str, tuple[int, int]], base: str = "the base model"):
    """Raise AdapterError for the first problem of an adapter folder: config missing or unreadable, weights missing,
    empty, unreadable by safetensors or not finite, or shapes that disagree with the config or with `base_layers`
    ({module: (in_features, out_features)} of the base, from linear_layers)."""
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    shapes = read_finite_tensors(adapter_dir / WEIGHTS_FILE)
    check_shapes(adapter_dir / WEIGHTS_FILE, shapes, config, base_layers, base)


def read_adapter_config(adapter_dir: Path):
    """adapter_config.json as peft reads it (a LoraConfig), after the checks peft would fail on with a traceback."""
    from peft import LoraConfig

    path = adapter_dir / CONFIG_FILE
    if not adapter_dir.is_dir():
        raise AdapterError(f"{adapter_dir}: no such folder — the run saves its adapter there when training ends, "
                           "so it is still training or stopped early.")
    if not path.is_file():
        raise AdapterError(f"{path}: missing — the adapter folder is incomplete (peft writes this file beside "
                           f"{WEIGHTS_FILE} when it saves an adapter).")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e}) — the file is damaged.") from None
    rank = data.get("r") if isinstance(data, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: 'r' is {rank!r}, not a positive whole number — the file is damaged or is not "
                           "a LoRA adapter's config.")
    if data.get("peft_type", "LORA") != "LORA" or not data.get("target_modules"):
        raise AdapterError(f"{path}: peft_type {data.get('peft_type')!r} with target_modules "
                           f"{data.get('target_modules')!r} — this course merges LoRA adapters only.")
    try:
        return LoraConfig.from_peft_type(**data)
    except (TypeError, ValueError) as e:
        raise AdapterError(f"{path}: peft refuses this config ({e}).") from None


def read_finite_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a safetensors file whose every value is finite."""
    import torch
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        pickled = path.with_suffix(".bin")
        extra = f" ({pickled.name} is there, but pickled weights are never loaded here)" if pickled.exists() else ""
        raise AdapterError(f"{path}: missing{extra} — the adapter folder holds no safetensors weights.")
    if path.stat().st_size == 0:
        raise AdapterError(f"{path}: empty (0 bytes) — the save was cut off before any weight was written.")
    shapes, bad = {}, []
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                shapes[name] = tuple(tensor.shape)
                if not torch.isfinite(tensor).all():
                    bad.append((name, int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum()), tensor.numel()))
    except SafetensorError as e:
        raise AdapterError(f"{path}: safetensors cannot read it ({e}) — the file is truncated or damaged "
                           f"({path.stat().st_size:,} bytes).") from None
    if not shapes:
        raise AdapterError(f"{path}: holds no tensors — the adapter was saved without its weights.")
    if bad:
        name, nans, infs, total = bad[0]
        raise AdapterError(f"{path}: tensor {name} has {nans:,} NaN and {infs:,} infinite values out of {total:,}"
                           f" (tensors with such values: {len(bad)} of {len(shapes)}) — merged, they would make the "
                           "exported model's weights NaN.")
    return shapes


def check_shapes(path: Path, shapes: dict, config, base_layers: dict, base: str) -> None:
    """Every lora_A is (r, in_features) and every lora_B (out_features, r) of a module adapter_config.json targets
    and the base has; every such module has both. Other tensors (DoRA magnitudes, saved modules) are not sized here."""
    from nb_helpers.compat.adapter_keys import key_matchers

    targeted, rank_of = key_matchers(config)  # peft's matchers, checked in nb_helpers.compat
    found = set()
    for name, shape in shapes.items():
        match = LORA_KEY.fullmatch(name)
        if not match:
            continue
        module, side = match["module"], match["side"]
        if not targeted(module):
            targets = config.target_modules if isinstance(config.target_modules, str) else sorted(config.target_modules)
            raise AdapterError(f"{path}: holds {name}, but {CONFIG_FILE} targets {targets} — the two files come "
                               "from different adapters.")
        if module not in base_layers:
            raise AdapterError(f"{path}: holds {name}, but {base} has no linear layer {module} — the adapter was "
                               "made for another base model.")
        rank = rank_of(module)
        fan_in, fan_out = base_layers[module]
        expected = (rank, fan_in) if side == "A" else (fan_out, rank)
        if shape != expected:
            raise AdapterError(f"{path}: {name} is {list(shape)}, expected {list(expected)} — "
                               + shape_mismatch(shape, side, rank, base, module, fan_in, fan_out))
        found.add((module, side))
    wanted = [m for m in base_layers if targeted(m)]
    missing = [f"{m}.lora_{side}" for m in wanted for side in "AB" if (m, side) not in found]
    if missing:
        raise AdapterError(f"{path}: no weights for {len(missing)} of the {2 * len(wanted)} LoRA matrices "
                           f"{CONFIG_FILE} puts on {base} (first: {missing[0]}) — the file is incomplete or the "
                           "adapter was made for another base model.")


def shape_mismatch(shape, side, rank, base, module, fan_in, fan_out) -> str:
    """Why a LoRA matrix has the wrong shape: its rank axis says which file disagrees with which."""
    rank_axis = 0 if side == "A" else 1
    if shape[rank_axis] != rank:
        return (f"its rank is {shape[rank_axis]} where {CONFIG_FILE} says r={rank}: the two files come from "
                "different adapters.")
    return (f"{base}'s {module} maps {fan_in} to {fan_out} features: the adapter was made for another base model "
            "(a different hidden size).")


def linear_layers(base: str) -> dict[str, tuple[int, int]]:
    """{module name: (in_features, out_features)} of every linear layer of `base`, built on the meta device from
    its config.json: sizes without reading a weight (0.1 s for TinyLlama, whose weights are 2.2 GB)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as e:
        raise AdapterError(f"base model {base}: its config.json cannot be read ({e}).") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: (layer.in_features, layer.out_features) for name, layer in model.named_modules()
            if isinstance(layer, torch.nn.Linear)}
