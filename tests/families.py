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
