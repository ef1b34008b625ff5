"""Tiny random configs of each model family the planner models (small for testing speed: hidden 64, 2 layers),
built with transformers from a config dict, no hub. Each carries its family's distinctive parts: Qwen2's q/k/v
biases, Qwen3's q/k norms and a head_dim that is not hidden/heads, Gemma 3's sliding-window layer and four norms,
Phi's fused projections and partial rotary embeddings, SmolLM3's RoPE-free layers."""

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)
TINY = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, tie_word_embeddings=False),
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, tie_word_embeddings=True),
}


def tiny_config(family: str, vocab: int = 1000, **changes) -> dict:
    """config.json of a tiny random model of this family."""
    return {**COMMON, "vocab_size": vocab, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            **TINY[family], **changes}


def build(config: dict, device: str = "meta"):
    """The model transformers builds from this config.json (meta device: shapes only, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nb_helpers.plan.architecture import config_object

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config_object(config))


# --- real tokenizers a package ships -----------------------------------------------------------------------------
# The Hub is out of reach, but llama-cpp-python's source archive (the pinned version, which the export already
# downloads for llama.cpp's scripts) vendors llama.cpp's vocabulary-only GGUF files, its tokenizer test fixtures.
# One of them is Qwen2's tokenizer (151,936 entries), which Qwen2.5 and Qwen3 use; transformers' GGUF reader turns it
# into a tokenizer folder. Gemma 3's and Phi-4-mini's are not among them (llama.cpp ships Gemma 4's and Phi-3's).
REAL_TOKENIZERS = {"qwen2": "ggml-vocab-qwen2.gguf", "qwen3": "ggml-vocab-qwen2.gguf"}


def real_tokenizer_dir(family: str):
    """A tokenizer folder of the family's real tokenizer (REAL_TOKENIZERS), made once into the cache (~20 s: the
    GGUF holds 151,936 tokens and 151,387 merges)."""
    import tarfile
    import tempfile

    from transformers import AutoTokenizer

    from nb_helpers.export.llama_cpp_code import LLAMA_CPP_PYTHON, runtime_version, source_archive
    from nb_helpers.models import cache_dir, cache_entry

    name = REAL_TOKENIZERS[family]
    version = runtime_version() or LLAMA_CPP_PYTHON
    folder = cache_dir() / "tokenizers" / f"{name.removesuffix('.gguf')}-{version}"
    if (folder / "tokenizer.json").is_file():
        return folder
    with source_archive(version) as archive, tarfile.open(archive) as tar, tempfile.TemporaryDirectory() as tmp:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"/vendor/llama.cpp/models/{name}"))
        member.name = name
        tar.extractall(tmp, members=[member], filter="data")
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=name)
        with cache_entry(folder) as partial:
            tokenizer.save_pretrained(partial)
    return folder
