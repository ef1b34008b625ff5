"""NF4 dequantize on one CUDA GPU: bitsandbytes' kernel, called as fast.fused_lora calls it (absmax kept in fp32),
against fast.nf4's Triton kernel, for each weight of the TinyLlama-1.1B shape; with the host time of one launch of
each (a step launches 440 of them) and a check that the bits are the same.

    python bench/nf4_bench.py --out results.json     # on the device; prints a table last
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_dropout_bench import median_ms  # noqa: E402

from nb_helpers.fast import DECODED_ABSMAX, fused_lora, nf4  # noqa: E402

SHAPES = {"q_proj, o_proj": (2048, 2048), "k_proj, v_proj": (256, 2048), "gate_proj, up_proj": (5632, 2048),
          "down_proj": (2048, 5632)}
PER_LAYER = {"q_proj, o_proj": 2, "k_proj, v_proj": 2, "gate_proj, up_proj": 2, "down_proj": 1}


def host_us(fn, calls: int = 200) -> float:
    """Host time of one launch: `calls` launches back to back, timed on the host (the GPU queue absorbs them)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took / calls * 1e6


def main() -> None:
    import bitsandbytes.functional as F

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows, layer = [], {"bitsandbytes_us": 0.0, "triton_us": 0.0}
    for name, shape in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float16):
            weight = (torch.randn(*shape, device="cuda") * 0.02).to(dtype)
            packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
            param = torch.nn.Parameter(packed, requires_grad=False)
            param.quant_state = state
            # decoded once, as the course's path keeps it (lever absmax_once)
            setattr(state, DECODED_ABSMAX, (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).float())
            stock = lambda: fused_lora._dequantize(param, direct=True)  # noqa: E731
            expected = stock()
            stock_ms, stock_host = median_ms(stock), host_us(stock)
            nf4.mark([state])
            ours = lambda: fused_lora._dequantize(param, direct=True)  # noqa: E731
            same = torch.equal(ours().view(torch.int16), expected.view(torch.int16))
            ours_ms, ours_host = median_ms(ours), host_us(ours)
            moved = weight.numel() * (0.5 + weight.element_size()) + weight.numel() / 64 * 4
            rows.append({"weight": name, "shape": list(shape), "dtype": str(dtype).split(".")[-1], "same_bits": same,
                         "bitsandbytes_us": round(stock_ms * 1e3, 2), "triton_us": round(ours_ms * 1e3, 2),
                         "bitsandbytes_tb_s": round(moved / stock_ms / 1e9, 2), "triton_tb_s": round(
                             moved / ours_ms / 1e9, 2), "host_us_bitsandbytes": round(stock_host, 1),
                         "host_us_triton": round(ours_host, 1)})
            if dtype == torch.bfloat16:
                layer["bitsandbytes_us"] += PER_LAYER[name] * rows[-1]["bitsandbytes_us"]
                layer["triton_us"] += PER_LAYER[name] * rows[-1]["triton_us"]
            delattr(state, nf4.TABLE)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "per_layer_pass_bf16_us": {k: round(v, 1) for k, v in layer.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(f"{r['weight']:<20} {r['dtype']:<9} bnb {r['bitsandbytes_us']:7.2f} us ({r['bitsandbytes_tb_s']:.2f} TB/s,"
              f" host {r['host_us_bitsandbytes']:.1f})  triton {r['triton_us']:7.2f} us ({r['triton_tb_s']:.2f} TB/s, "
              f"host {r['host_us_triton']:.1f})  same bits: {r['same_bits']}")
    print("per layer and pass (bf16):", result["per_layer_pass_bf16_us"])


if __name__ == "__main__":
    main()
