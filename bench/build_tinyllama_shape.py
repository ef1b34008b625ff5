"""Build a random-weight model of a real model's shape (TinyLlama-1.1B by default; --shape for the others), for GPU
speed and memory runs without the Hub.

Each shape is the public model's config.json as published (nb_helpers/plan/shapes/<name>.json: TinyLlama-1.1B, SmolLM2-135M,
Llama-3.2-1B/3B, Qwen2.5-0.5B, Qwen3-0.6B/1.7B/4B, Gemma-3-270M/1B, Phi-4-mini, SmolLM3-3B), so the same bytes and
FLOPs per token; the loss is meaningless, the cost is real. transformers builds the model from that config alone
(any family nb_helpers.plan.architecture models), on the GPU when there is one. The tokenizer is a byte-level BPE
trained on the shipped data with room for 32000 entries (the real tokenizers need the Hub); it only has to produce
ids inside every shape's embedding (all have >= 32000 rows).

    python bench/build_tinyllama_shape.py --out /tmp/tinyllama-shape
    python bench/build_tinyllama_shape.py --shape qwen3-1.7b --out /tmp/shape-qwen3-1.7b
    python bench/build_tinyllama_shape.py --list

--max-positions raises the position limit for long sequence runs; it changes no tensor sizes (rotary embeddings
are computed, not stored).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHAPES_DIR = ROOT / "nb_helpers" / "plan" / "shapes"
TOKENIZER_VOCAB = 32000


def shape_config(name: str) -> dict:
    """config.json of a known shape (nb_helpers/plan/shapes/<name>.json)."""
    path = SHAPES_DIR / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    return json.loads(path.read_text())


SHAPES = {p.stem: json.loads(p.read_text()) for p in sorted(SHAPES_DIR.glob("*.json"))}
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
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(data_dir), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--max-positions", type=int, default=None)
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--list", action="store_true", help="print each shape with its parameter count and exit")
    args = parser.parse_args()
    if args.list:
        from nb_helpers.plan.architecture import Shape

        for name, config in SHAPES.items():
            shape = Shape.from_config(config, name=name)
            print(f"{name:<16} {shape.total_params / 1e9:6.3f} B  {shape.describe()}")
        return
    if not args.out:
        parser.error("--out is required (or --list)")
    build(args.shape, args.out, Path(args.data), args.max_positions)


def build(shape: str, out: str, data_dir: Path, max_positions: int | None = None) -> None:
    """A random-weight bf16 model of this shape, saved with the tokenizer (on the GPU when there is one)."""
    from nb_helpers.plan.architecture import config_object

    tokenizer = build_tokenizer(data_dir)  # ids < 32000 fit every shape's embedding
    dims = dict(SHAPES[shape])
    if max_positions:
        dims["max_position_embeddings"] = max(max_positions, dims["max_position_embeddings"])
    dims.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    config = config_object(dims)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {out} ({shape}, {type(model).__name__}): {params / 1e9:.3f} B parameters, tokenizer with "
          f"{len(tokenizer)} entries (ids < {config.vocab_size})")


def shape_dir(shape: str) -> Path:
    """/tmp/shape-<name>, built on first use on this machine (4,096 positions: the grids' longest points)."""
    folder = Path(f"/tmp/shape-{shape}")
    if not (folder / "config.json").exists():
        build(shape, str(folder), Path(__file__).resolve().parent.parent / "data", max_positions=4096)
    return folder


if __name__ == "__main__":
    main()
