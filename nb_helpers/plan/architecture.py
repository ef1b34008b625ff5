"""What a decoder model is made of, read from config.json alone: the one source of truth for parameter counts,
4-bit weight bytes and the LoRA target names of each model family.

transformers builds the config object from config.json (`AutoConfig.for_model`), so a missing key takes the
family's own default (Gemma 3 ties its head, Qwen3's head_dim is 128) and nothing is read as a Llama by accident.
A family the planner does not model raises UnsupportedModel, which names what is missing.

Families and what differs from a Llama decoder layer (2 RMSNorms, q/k/v/o, gate/up/down, SiLU):
  * Qwen2/2.5: biases on q, k and v.
  * Qwen3: an RMSNorm on each query and key head (q_norm, k_norm); head_dim may differ from hidden/heads.
  * Gemma 2/3: four norms per layer, computed in fp32; GELU-tanh MLP; embeddings scaled by sqrt(hidden); sliding-
    window layers (5 in 6 on Gemma 3); Gemma 3 adds q/k norms; Gemma 2 soft-caps attention and final logits.
  * Phi-3/Phi-4-mini: fused projections (qkv_proj, gate_up_proj); partial rotary embeddings (Phi-4-mini: 3/4).
  * SmolLM3: a Llama layer that skips RoPE in every 4th layer (no memory effect).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_NAMES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj"}  # Phi-3/4: the recipe's names -> the module that holds them
BLOCK = 64  # bitsandbytes NF4: one absmax per 64 weights
DOUBLE_QUANT_BLOCK = 256  # double quant: the absmax are 8-bit, one fp32 scale per 256 of them


class UnsupportedModel(ValueError):
    """A model family (or a feature of one) the planner cannot count. The message says what is missing."""


@dataclass(frozen=True)
class Family:
    label: str  # what people call it
    examples: str
    fused: bool = False  # qkv_proj and gate_up_proj instead of q/k/v and gate/up
    qk_norm: bool = False
    norms_per_layer: int = 2
    qkv_bias: bool = False  # q, k, v always carry a bias (Qwen2)
    config_biases: bool = True  # attention_bias / mlp_bias in the config switch biases on
    scaled_embeddings: bool = False


FAMILIES = {
    "llama": Family("Llama", "TinyLlama-1.1B, Llama-3.2-1B/3B, SmolLM2"),
    "mistral": Family("Mistral", "Mistral-7B", config_biases=False),
    "qwen2": Family("Qwen2/2.5", "Qwen2.5-0.5B/1.5B/3B", qkv_bias=True, config_biases=False),
    "qwen3": Family("Qwen3", "Qwen3-0.6B/1.7B/4B", qk_norm=True),
    "gemma2": Family("Gemma 2", "gemma-2-2b", norms_per_layer=4, scaled_embeddings=True),
    "gemma3_text": Family("Gemma 3 (text)", "gemma-3-270m, gemma-3-1b", qk_norm=True, norms_per_layer=4,
                          scaled_embeddings=True),
    "phi3": Family("Phi-3/Phi-4-mini", "Phi-3-mini, Phi-4-mini-instruct", fused=True, config_biases=False),
    "smollm3": Family("SmolLM3", "SmolLM3-3B"),
}
NOT_MODELLED = {
    "gemma3": "Gemma 3 4B and larger are image-text models (a vision tower and a projector beside the text "
              "decoder); only the text-only gemma3_text checkpoints (gemma-3-270m, gemma-3-1b) are modelled",
}


@dataclass
class Shape:
    """The numbers of a decoder's config.json that memory depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_positions: int | None = None
    name: str = ""
    family: str = "llama"  # transformers' model_type
    fused: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    bias_layers: tuple[str, ...] = ()  # linear layers that carry a bias
    rotary_dim: int | None = None  # None: the whole head (partial rotary: Phi-4-mini rotates 3/4 of it)
    sliding_window: int | None = None
    sliding_layers: int = 0  # layers that attend within the window only
    attn_softcap: float | None = None
    final_softcap: float | None = None
    scaled_embeddings: bool = False
    activation: str = "silu"

    @classmethod
    def from_config(cls, config, name: str = "") -> "Shape":
        """A config.json dict or a transformers config. A dict without model_type is read as a Llama."""
        if isinstance(config, dict):
            config = config_object(config)
        model_type = getattr(config, "model_type", "llama")
        if model_type in NOT_MODELLED:
            raise UnsupportedModel(f"model_type {model_type!r} is not modelled: {NOT_MODELLED[model_type]}")
        if model_type not in FAMILIES:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not modelled by the planner; it knows "
                f"{', '.join(f'{k} ({v.label})' for k, v in FAMILIES.items())}. Modelling it needs its decoder "
                "layer's linear layers (names, sizes, biases), its norms, and what its attention and MLP save for "
                "backward (nb_helpers/plan/architecture.py and activations.layer_activation_bytes_per_token). "
                "Training may still work: only the prediction is missing")
        family = FAMILIES[model_type]
        get = lambda key, default=None: getattr(config, key, default)  # noqa: E731
        heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // heads
        types = get("layer_types") or []
        sliding = sum(t == "sliding_attention" for t in types) if types else \
            (get("num_hidden_layers") if get("sliding_window") else 0)
        return cls(hidden=get("hidden_size"), intermediate=get("intermediate_size"),
                   layers=get("num_hidden_layers"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   head_dim=head_dim, vocab=get("vocab_size"), tied=bool(get("tie_word_embeddings", False)),
                   max_positions=get("max_position_embeddings"), name=name, family=model_type, fused=family.fused,
                   qk_norm=family.qk_norm, norms_per_layer=family.norms_per_layer,
                   bias_layers=_bias_layers(family, config),
                   rotary_dim=int(head_dim * get("partial_rotary_factor")) if get("partial_rotary_factor") else None,
                   sliding_window=get("sliding_window") if sliding else None, sliding_layers=sliding,
                   attn_softcap=get("attn_logit_softcapping"), final_softcap=get("final_logit_softcapping"),
                   scaled_embeddings=family.scaled_embeddings,
                   activation=get("hidden_activation") or get("hidden_act") or "silu")

    # --- the layers ----------------------------------------------------------------------------------------
    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, under the model's own module names."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.fused:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def all_linear(self) -> tuple[str, ...]:
        return tuple(self.linear_dims())

    def attention_targets(self) -> tuple[str, ...]:
        """The recipe's "q,k,v,o" under this model's names (Phi: qkv_proj, o_proj)."""
        return resolve_targets(QKVO, self.all_linear())

    # --- parameter counts: the one place they are computed -------------------------------------------------
    @property
    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linear_dims().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def norm_params(self) -> int:
        qk = 2 * self.head_dim if self.qk_norm else 0
        return self.layers * (self.norms_per_layer * self.hidden + qk) + self.hidden

    @property
    def bias_params(self) -> int:
        dims = self.linear_dims()
        return self.layers * sum(dims[name][1] for name in self.bias_layers)

    @property
    def total_params(self) -> int:
        return self.linear_params + self.embedding_params + self.norm_params + self.bias_params

    @property
    def sixteen_bit_params(self) -> int:
        """What bitsandbytes leaves unquantized: embeddings, head, norms, biases."""
        return self.embedding_params + self.norm_params + self.bias_params

    def four_bit_bytes(self, double_quant: bool = True, other_bytes: int = 2) -> float:
        """The loaded model: NF4 linear weights and their constants, the rest in `other_bytes` per parameter."""
        packed, constants = nf4_bytes(self.linear_params, double_quant)
        return packed + constants + other_bytes * self.sixteen_bit_params

    def describe(self) -> str:
        family = FAMILIES[self.family]
        parts = [f"{family.label}: {self.layers} layers, hidden {self.hidden}, MLP {self.intermediate}, "
                 f"{self.heads} heads ({self.kv_heads} KV) of {self.head_dim}, vocab {self.vocab}"
                 + (" (tied head)" if self.tied else "")]
        if self.fused:
            parts.append("fused qkv_proj and gate_up_proj")
        if self.qk_norm:
            parts.append("q/k norms")
        if self.bias_layers:
            parts.append(f"biases on {','.join(self.bias_layers)}")
        if self.rotary_dim:
            parts.append(f"rotary on {self.rotary_dim} of {self.head_dim} head dims")
        if self.sliding_layers and (self.max_positions is None or self.sliding_window < self.max_positions):
            parts.append(f"{self.sliding_layers} of {self.layers} layers slide over {self.sliding_window} tokens")
        if self.scaled_embeddings:
            parts.append("scaled embeddings")
        return "; ".join(parts)


def _bias_layers(family: Family, config) -> tuple[str, ...]:
    names: list[str] = ["q_proj", "k_proj", "v_proj"] if family.qkv_bias else []
    if family.config_biases and getattr(config, "attention_bias", False):
        names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if family.config_biases and getattr(config, "mlp_bias", False):
        names += ["gate_proj", "up_proj", "down_proj"]
    return tuple(names)


# The fast path keeps double quantization's absmax decoded in fp32 (4 bytes per 64 weights) only where that costs at
# most this share of the run's budget: TinyLlama's 58 MiB is 1.4% of 4 GiB; a 4B model's 0.21 GiB would be 5%, memory
# a 4 GB card needs more than the 2-3% of GPU time it buys.
ABSMAX_KEPT_SHARE = 0.02


def recomputed_params(shape: Shape, inp) -> tuple[int, int]:
    """4-bit weights and GEMMs per decoder layer that the recompute multiplies by. With the dead_tail lever the MLP's
    down projection is left out where the layer saves nothing after it: two norms per layer (Llama, Mistral, Qwen,
    Phi, SmolLM3); Gemma's norm after the MLP reads it. fast.recompute finds this on the model itself."""
    dims = shape.linear_dims()
    per_layer = shape.linear_params // shape.layers
    if getattr(inp, "dead_tail", False) and shape.norms_per_layer == 2:
        skipped_in, skipped_out = dims["down_proj"]
        return per_layer - skipped_in * skipped_out, len(dims) - 1
    return per_layer, len(dims)


def recomputed_layers(shape: Shape, inp) -> int:
    """Decoder layers whose backward recomputes their forward: every layer with gradient checkpointing, less the last
    `no_recompute_layers`, which keep their activations instead (fast.checkpoints, RunConfig.no_recompute_layers)."""
    if not inp.gradient_checkpointing:
        return 0
    return shape.layers - min(shape.layers, max(0, int(getattr(inp, "no_recompute_layers", 0))))


def absmax_kept_bytes(linear_params: int) -> float:
    return 4 * linear_params / BLOCK


def keeps_decoded_absmax(linear_params: int, budget_gib: float | None) -> bool:
    """Whether the fast path keeps the decoded absmax (fast.fused_lora.keep_decoded_absmax) under this budget (None:
    the whole GPU, no cap)."""
    return budget_gib is None or absmax_kept_bytes(linear_params) <= ABSMAX_KEPT_SHARE * budget_gib * 2**30


def nf4_bytes(linear_params: int, double_quant: bool = True) -> tuple[float, float]:
    """(packed weights, quantization constants) of NF4 weights: half a byte per weight, plus one absmax per 64
    weights: fp32 (4/64 byte per weight), or with double quant 8-bit (1/64) plus one fp32 per 256 of them."""
    constants = linear_params / BLOCK + 4 * linear_params / (BLOCK * DOUBLE_QUANT_BLOCK) if double_quant \
        else 4 * linear_params / BLOCK
    return linear_params / 2, constants


def config_object(data: dict):
    """config.json as transformers reads it: the family's defaults fill what the file leaves out."""
    from transformers import AutoConfig, LlamaConfig

    data = {k: v for k, v in data.items() if k not in ("architectures", "transformers_version", "auto_map")}
    model_type = data.pop("model_type", None)
    if model_type is None:
        return LlamaConfig(**data)
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as e:
        if model_type in FAMILIES:
            raise UnsupportedModel(f"config.json of model_type {model_type!r} does not parse: {e}") from None
        return _Unknown(model_type)


@dataclass
class _Unknown:
    model_type: str


def load_shape(model: str) -> Shape:
    """Read config.json only: a local folder, a path to the file, or a hub id (downloads config.json, ~1 KB)."""
    path = Path(model).expanduser()
    if path.is_file():
        return Shape.from_config(json.loads(path.read_text()),
                                 name=path.parent.name if path.name == "config.json" else path.stem)
    if (path / "config.json").exists():
        return Shape.from_config(json.loads((path / "config.json").read_text()), name=path.name)
    from transformers import AutoConfig

    return Shape.from_config(AutoConfig.from_pretrained(model), name=model)


def resolve_targets(targets, available) -> tuple[str, ...]:
    """The config's LoRA targets under this model's module names.

    "all-linear" stays as it is (peft expands it). A name the model has stays. A name the model fuses into a
    bigger layer (Phi: q_proj, k_proj, v_proj -> qkv_proj; gate_proj, up_proj -> gate_up_proj) becomes that
    layer, once. Anything else raises ValueError naming the model's linear layers."""
    if targets == "all-linear" or list(targets) == ["all-linear"]:
        return ("all-linear",)
    available = list(available)
    out: list[str] = []
    missing = []
    for target in targets:
        name = target if target in available else FUSED_NAMES.get(target)
        if name not in available:
            missing.append(target)
        elif name not in out:
            out.append(name)
    if missing:
        raise ValueError(f"target_modules {missing} do not exist in this model (they are not linear layers of it); "
                         f"its linear layers are {sorted(set(available))}: pick from those (lm_head is best left "
                         "out), or all-linear")
    return tuple(out)


def plan_targets(shape: Shape, targets) -> tuple[str, ...]:
    """The targets under the model's own names (Phi: q,k,v -> qkv_proj); all-linear -> every linear layer."""
    resolved = resolve_targets(targets, shape.all_linear())
    return shape.all_linear() if resolved == ("all-linear",) else resolved


def known_families() -> dict[str, str]:
    """model_type -> "label (examples)", for messages and widgets."""
    return {k: f"{v.label} ({v.examples})" for k, v in FAMILIES.items()}
