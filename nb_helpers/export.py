"""Taking the trained model out of Python: merged 16-bit folder -> GGUF (F16, Q8_0) -> Ollama Modelfile.

GGUF is llama.cpp's one-file format; Ollama, LM Studio and llama.cpp itself read it. The `gguf` package, llama.cpp's
own Python library on PyPI, writes it. This module adds what llama.cpp's convert script would: the Hugging Face
tensor names mapped to GGUF's (the table comes from `gguf` itself), the row order llama.cpp's rotary embedding
expects in q/k, the hyperparameters, and the tokenizer. It covers the llama architecture (TinyLlama, SmolLM2,
Llama 3); other families need llama.cpp's convert_hf_to_gguf.py.

Each export is checked, not trusted: transformers reads the GGUF back (`gguf_file=`) and must give the same greedy
answers as the merged model.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from nb_helpers.config import ConfigError

GGUF_KINDS = ("f16", "q8_0")  # F16: lossless for bf16 weights in f16's range; Q8_0: 8.5 bits per weight
LLAMA_ARCHITECTURES = {"LlamaForCausalLM"}


class ExportError(ConfigError):
    """A model or tokenizer this exporter cannot write; the message names the alternative."""


# ---------------------------------------------------------------------------------------------------------------
# Merging the adapter


def merge_adapter(run_dir: str | Path, out_dir: str | Path | None = None):
    """Fold the run's adapter into a 16-bit copy of its base: W' = W + (alpha/r) * B @ A on every adapted layer.

    A 4-bit base would round the update away, so the base is reloaded in bf16 on the CPU (host RAM, not VRAM:
    2.2 GB for TinyLlama). Returns (merged model, folder it was saved to, or None when out_dir is None)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nb_helpers.config import RunConfig
    from nb_helpers.models import load_tokenizer, resolve_model
    from nb_helpers.runs import load_run
    from nb_helpers.faults.adapter_check import check_run_adapter

    run = load_run(run_dir)
    choice = resolve_model(RunConfig.from_dict(run.config), verbose=False)
    check_run_adapter(run.path, choice.path)  # before anything is loaded or written: NaN would merge silently
    base16 = AutoModelForCausalLM.from_pretrained(choice.path, dtype=torch.bfloat16, device_map={"": "cpu"},
                                                  use_safetensors=True)
    merged = PeftModel.from_pretrained(base16, run.path / "adapter").merge_and_unload()
    if out_dir is None:
        return merged, None
    out_dir = Path(out_dir)
    merged.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(str(run.path / "adapter")).save_pretrained(out_dir)
    return merged, out_dir


# ---------------------------------------------------------------------------------------------------------------
# Writing GGUF


def _llama_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    architectures = set(config.get("architectures") or [])
    if not architectures & LLAMA_ARCHITECTURES:
        raise ExportError(f"{model_dir}: architecture {sorted(architectures) or '?'} is not Llama; this exporter "
                          "writes the llama architecture only — use llama.cpp's convert_hf_to_gguf.py for others")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") not in ("default", None):
        raise ExportError(f"{model_dir}: rope scaling {rope.get('rope_type')!r} is not written by this exporter — "
                          "use llama.cpp's convert_hf_to_gguf.py")
    return config


def permute_for_rope(weight, n_head: int):
    """Reorder q/k rows from Hugging Face's rotary layout (two halves) to llama.cpp's (interleaved pairs).
    transformers undoes exactly this when it reads a llama GGUF."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _tensors(model_dir: Path, config: dict):
    """(GGUF name, float32 numpy array) for every weight, q/k permuted."""
    import gguf
    from safetensors import safe_open

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{model_dir}: no *.safetensors files — save the merged model with safe_serialization=True")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
                    continue  # tied: llama.cpp reuses token_embd for the output
                name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ExportError(f"{file.name}: tensor {hf_name!r} has no GGUF name in the llama architecture")
                data = f.get_tensor(hf_name).float().numpy()
                if hf_name.endswith("q_proj.weight"):
                    data = permute_for_rope(data, heads)
                elif hf_name.endswith("k_proj.weight"):
                    data = permute_for_rope(data, kv_heads)
                yield name, data


def _tokenizer_kind(tokenizer_json: dict) -> tuple[str, str]:
    """(tokenizer.ggml.model, tokenizer.ggml.pre): byte-level BPE is llama.cpp's "gpt2" model, SentencePiece-style
    BPE (byte fallback, "▁" for spaces: TinyLlama, Llama 2) its "llama" model. `pre` names how llama.cpp splits
    text before BPE; it must match the tokenizer's own pre-tokenizer or llama.cpp tokenizes differently."""
    pre = json.dumps(tokenizer_json.get("pre_tokenizer") or {})
    if tokenizer_json["model"]["type"] != "BPE":
        raise ExportError(f"tokenizer type {tokenizer_json['model']['type']!r} is not BPE — use llama.cpp's "
                          "convert_hf_to_gguf.py")
    if '"ByteLevel"' not in pre:
        return "llama", "default"
    byte_level_only = (tokenizer_json.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
    if byte_level_only:
        return "gpt2", "gpt2"  # GPT-2's split: the regex ByteLevel(use_regex=True) applies
    if "(?i:'s|'t|'re|'ve|'m|'ll|'d)" in pre:
        return "gpt2", "llama-bpe"  # Llama 3's split
    raise ExportError("this byte-level tokenizer splits text in a way the exporter does not know (tokenizer.json "
                      "pre_tokenizer) — use llama.cpp's convert_hf_to_gguf.py, which identifies it by hash")


def _add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    import gguf

    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    kind, pre = _tokenizer_kind(tokenizer_json)
    vocab: dict[str, int] = dict(tokenizer_json["model"]["vocab"])
    added = {t["id"]: t for t in tokenizer_json.get("added_tokens", [])}
    size = max([*vocab.values(), *added]) + 1
    size = max(size, config.get("vocab_size", 0))  # the embedding may have padding rows
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, index in vocab.items():
        tokens[index], types[index] = text, gguf.TokenType.NORMAL
    for index, token in added.items():
        tokens[index] = token["content"]
        types[index] = gguf.TokenType.CONTROL if token.get("special") else gguf.TokenType.USER_DEFINED
    if kind == "llama":
        for index, text in enumerate(tokens):
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
                types[index] = gguf.TokenType.BYTE
        # llama.cpp's SentencePiece tokenizer merges the pair with the highest score first: rank order, as the merges
        merged = {"".join(pair.split(" ") if isinstance(pair, str) else pair): rank
                  for rank, pair in enumerate(tokenizer_json["model"].get("merges", []))}
        writer.add_token_scores([-float(merged.get(text, 0)) for text in tokens])
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # merges, bos/eos/unk/pad ids, add_bos and the chat template, read from the folder by gguf's own helper
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=size).add_to_gguf(writer, quiet=True)


def write_gguf(model_dir: str | Path, out_path: str | Path, kind: str = "f16") -> Path:
    """Write a GGUF of a 16-bit Llama folder. `kind`: "f16" (2 bytes a weight) or "q8_0" (blocks of 32 int8 values
    with one fp16 scale: 8.5 bits a weight). Norms stay F32, as llama.cpp keeps them."""
    import gguf
    import numpy as np

    kind = kind.lower()
    if kind not in GGUF_KINDS:
        raise ExportError(f"GGUF kind {kind!r}: choose one of {', '.join(GGUF_KINDS)}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = _llama_config(model_dir)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    heads = config["num_attention_heads"]
    out_path.parent.mkdir(parents=True, exist_ok=True)  # runs/<run>/gguf/ does not exist before the first export
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_name(model_dir.name)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(float((config.get("rope_parameters") or {}).get("rope_theta")
                                    or config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_file_type(file_type)
    _add_tokenizer(writer, model_dir, config)
    for name, data in _tensors(model_dir, config):
        if data.ndim == 1:
            writer.add_tensor(name, data.astype(np.float32))
        elif kind == "q8_0" and data.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:  # rows not a multiple of Q8_0's block of 32 stay F16, as llama.cpp does
            writer.add_tensor(name, data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def load_gguf(path: str | Path, dtype=None):
    """(model, tokenizer) read back from the GGUF by transformers alone, dequantized to `dtype` (fp32 default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gguf

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers 5.17 builds a llama-architecture GGUF tokenizer with bos and eos swapped and no pad token
    # (integrations/ggml.py); take them from the file's own metadata, which is what llama.cpp and Ollama read.
    fields = gguf.GGUFReader(path).fields
    for role, key in (("eos", "eos_token_id"), ("pad", "padding_token_id"), ("bos", "bos_token_id")):
        if f"tokenizer.ggml.{key}" in fields:
            token_id = int(fields[f"tokenizer.ggml.{key}"].contents())
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------------
# Checking the export


def greedy_agreement(reference_answers: list[str], candidate, conversations: list[list[dict]],
                     max_new_tokens: int = 48) -> dict:
    """The greedy answers of a (model, tokenizer) pair, through its own tokenizer and chat template, against the
    reference's answers to the same chat prompts (task_metric.generate, computed once for every file checked):
    {"agree": n, "total": n, "rate": share, "pairs": [(reference, candidate), ...]}."""
    from nb_helpers.task_metric import generate

    theirs = generate(*candidate, conversations, max_new_tokens)
    agree = sum(a == b for a, b in zip(reference_answers, theirs))
    total = len(reference_answers)
    return {"agree": agree, "total": total, "rate": agree / max(total, 1),
            "pairs": list(zip(reference_answers, theirs))}


# ---------------------------------------------------------------------------------------------------------------
# Ollama


_PROBE = "\x00{}\x00"  # contents no template would write itself


@dataclass
class ChatFormat:
    """A chat template reduced to what Ollama's Go template needs: per-role text around each message's content,
    the text that opens the assistant's answer, and the system message inserted when none is given."""
    prefix: dict[str, str]
    suffix: str
    generation_prompt: str
    default_system: str | None = None
    stops: list[str] = field(default_factory=list)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """What the Go template produces, written in Python so it can be compared with the tokenizer's."""
        if self.default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}, *messages]
        text = "".join(self.prefix[m["role"]] + m["content"] + self.suffix for m in messages)
        return text + (self.generation_prompt if add_generation_prompt else "")


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_format(tokenizer) -> ChatFormat:
    """Read the per-message wrapping off the tokenizer's own chat template by rendering probe conversations, then
    check that wrapping reproduces the template on other conversations. Raises ExportError for templates that are
    not one fixed wrapping per message (those need a hand-written TEMPLATE)."""
    probe = {role: _PROBE.format(role) for role in ("system", "user", "assistant")}
    convo = [{"role": r, "content": probe[r]} for r in ("system", "user", "assistant")]
    try:
        text = _render(tokenizer, convo)
        with_prompt = _render(tokenizer, convo[:2], add_generation_prompt=True)
        without_system = _render(tokenizer, convo[1:])
    except Exception as e:  # noqa: BLE001 - a template that refuses the probe (e.g. no system role)
        raise ExportError(f"the chat template did not render a system/user/assistant conversation ({e}); write "
                          "the Modelfile's TEMPLATE by hand") from None
    by_hand = ("the chat template is not one fixed wrapping per message (it depends on position, role or content); "
               "write the Modelfile's TEMPLATE by hand")
    pieces = re.split("|".join(map(re.escape, probe.values())), text)
    if len(pieces) != 4 or [p for p in probe.values() if p in text] != list(probe.values()):
        raise ExportError(by_hand)
    head, after_system, after_user, suffix = pieces
    if not (after_system.startswith(suffix) and after_user.startswith(suffix)):
        raise ExportError(by_hand)
    prefix = {"system": head, "user": after_system[len(suffix):], "assistant": after_user[len(suffix):]}
    generation_prompt = with_prompt[len(_render(tokenizer, convo[:2])):]
    default_system = None
    if not without_system.startswith(prefix["user"]):  # the template inserts its own system message
        inserted = without_system[:without_system.index(prefix["user"] + probe["user"])]
        if inserted.startswith(prefix["system"]) and inserted.endswith(suffix):
            default_system = inserted[len(prefix["system"]):len(inserted) - len(suffix)]
    special = {t for t in tokenizer.all_special_tokens if t}
    stops = [t for t in special if t in suffix or prefix["user"].startswith(t)]
    fmt = ChatFormat(prefix, suffix, generation_prompt, default_system, sorted(stops))
    checks = [[{"role": "user", "content": "Hi"}],
              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]]
    for messages in checks:
        if fmt.render(messages) != _render(tokenizer, messages, add_generation_prompt=True):
            raise ExportError(by_hand)
    return fmt


def _go_string(text: str) -> str:
    """Literal text inside a Go template: only "{{" would be read as an action."""
    return text.replace("{{", '{{ "{{" }}')


def ollama_modelfile(tokenizer, gguf_name: str, temperature: float = 0.0) -> str:
    """An Ollama Modelfile whose TEMPLATE is the tokenizer's chat template in Go template syntax."""
    fmt = chat_format(tokenizer)
    roles = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{_go_string(fmt.prefix[role])}'
                    for i, role in enumerate(("system", "user", "assistant")))
    template = ("{{- range .Messages }}" + roles + "{{ end }}{{ .Content }}" + _go_string(fmt.suffix)
                + "{{ end }}" + _go_string(fmt.generation_prompt))
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    if fmt.default_system is not None:
        lines.append(f'SYSTEM """{fmt.default_system}"""')
    lines += [f'PARAMETER stop "{stop}"' for stop in fmt.stops]
    lines += ["# 0 is greedy, as the course scores answers; raise it for varied answers",  # Modelfile comments: own line
              f"PARAMETER temperature {temperature:g}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# The whole export, as the CLI runs it


@dataclass
class ExportResult:
    kind: str
    path: Path
    bytes: int
    write_s: float
    agree: int | None = None
    total: int | None = None

    def line(self) -> str:
        check = "" if self.total is None else f"; greedy answers agree with the merged model on {self.agree}/{self.total}"
        return f"{self.path.name}: {self.bytes / 2**20:.0f} MiB, written in {self.write_s:.1f} s{check}"


def export_gguf(model_dir: str | Path, kinds=GGUF_KINDS, conversations: list[list[dict]] | None = None,
                max_new_tokens: int = 48, out_dir: str | Path | None = None, log=print) -> list[ExportResult]:
    """Write one GGUF per kind next to (or in out_dir) a merged 16-bit folder, read each back with transformers and
    compare its greedy answers with the merged model's on `conversations`; write the Ollama Modelfile for the last."""
    import torch
    from transformers import AutoModelForCausalLM

    from nb_helpers.models import load_tokenizer
    from nb_helpers.task_metric import generate

    model_dir = Path(model_dir)
    out_dir = Path(out_dir or model_dir.parent / "gguf")
    tokenizer = load_tokenizer(str(model_dir))
    reference_answers = None
    if conversations:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True)
        reference_answers = generate(model, tokenizer, conversations, max_new_tokens)
        del model
    results = []
    for kind in kinds:
        path = out_dir / f"{model_dir.parent.name or 'model'}-{kind}.gguf"
        start = time.perf_counter()
        write_gguf(model_dir, path, kind)
        result = ExportResult(kind, path, path.stat().st_size, time.perf_counter() - start)
        if reference_answers is not None:
            agreement = greedy_agreement(reference_answers, load_gguf(path), conversations, max_new_tokens)
            result.agree, result.total = agreement["agree"], agreement["total"]
        log(f"[export] {result.line()}")
        results.append(result)
    modelfile = out_dir / "Modelfile"
    modelfile.write_text(ollama_modelfile(tokenizer, results[-1].path.name), encoding="utf-8")
    log(f"[export] Ollama: `ollama create NAME -f {modelfile}` (its FROM line names the Q8_0 or last file written)")
    return results
