"""Build a TinyLlama-1.1B-shaped Llama (or another shape: --shape) with random weights, for GPU speed and memory
runs without the Hub.

Same shapes as TinyLlama/TinyLlama-1.1B-Chat-v1.0 (hidden 2048, MLP 5632, 22 layers, 32 heads, 4 KV heads,
vocab 32000, untied head), so the same bytes and FLOPs per token; the loss is meaningless, the cost is real.
The tokenizer is a byte-level BPE trained on the shipped data with room for 32000 entries (TinyLlama's own
tokenizer needs the Hub); it only has to produce ids inside the 32000-row embedding.

    python bench/build_tinyllama_shape.py --out /tmp/tinyllama-shape
    python bench/build_tinyllama_shape.py --shape llama-3.2-3b --out /tmp/llama3b-shape

The other shapes are SmolLM2-135M (the embedded default) and Llama-3.2-3B (tied head, vocab 128256); the
planner validation (bench/planner_grid.py) uses all three. --max-positions raises the position limit for long
sequence runs; it changes no tensor sizes (rotary embeddings are computed, not stored).
"""

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINYLLAMA_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                       tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                     rms_norm_eps=1e-5, rope_theta=100000.0)
LLAMA32_3B_SHAPE = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0)
SHAPES = {"tinyllama-1.1b": TINYLLAMA_SHAPE, "smollm2-135m": SMOLLM2_SHAPE, "llama-3.2-3b": LLAMA32_3B_SHAPE}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(data_dir: Path):
    for name in ("train.jsonl", "eval.jsonl"):
        for line in (data_dir / name).read_text(encoding="utf-8").splitlines():
            for message in json.loads(line)["messages"]:
                yield message["content"]


def build_tokenizer(data_dir: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINYLLAMA_SHAPE["vocab_size"], special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(data_dir), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--max-positions", type=int, default=None)
    parser.add_argument("--data", default=str(Path(__file__).resolve().parent.parent / "data"))
    args = parser.parse_args()
    build(args.shape, args.out, Path(args.data), args.max_positions)


def build(shape: str, out: str, data_dir: Path, max_positions: int | None = None) -> None:
    tokenizer = build_tokenizer(data_dir)  # ids < 32000 fit every shape's embedding
    dims = dict(SHAPES[shape])
    if max_positions:
        dims["max_position_embeddings"] = max(max_positions, dims["max_position_embeddings"])
    config = LlamaConfig(**dims, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {out} ({shape}): {params / 1e9:.3f} B parameters, tokenizer with {len(tokenizer)} entries "
          f"(ids < {config.vocab_size})")


if __name__ == "__main__":
    main()
