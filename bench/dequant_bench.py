"""NF4 dequantization on one CUDA GPU, per weight of the TinyLlama shape, from the kept fp32 absmax:
  cuda      bitsandbytes' CUDA kernel, as fast.fused_lora calls it directly (what the fast path runs);
  triton-*  bitsandbytes' own Triton kernel (`backends.triton.kernels_4bit.dequant_nf4_kernel`) at several launch
            settings (bytes a program x warps);
  own-*     a candidate of ours (rows_kernel): rows of whole quantization blocks, the absmax read once a row
            (blocks a program x warps).
Each output is checked bitwise against the CUDA kernel's, and against the same math in torch.

    python bench/dequant_bench.py --out-dir $OUT     # on the device: a run file (bench/run_file.py); a table last

gpu_us: the GPU time of one call (20 calls in one CUDA graph, median of 21 replays; lora_kernel_sweep.gpu_us).
host_us: the host's time to launch one call (300 calls queued without a sync, over a long kernel so the queue never
fills).

On an H100 (2026-12-06) a layer's seven weights took 58.2 us with bitsandbytes' CUDA kernel, 73.8-94.8 with its
Triton kernel and 38.6-46.6 with ours, every output bitwise the CUDA kernel's. The candidate ran as a lever
(nf4_kernel) in one GPU suite, where its tests passed, but was taken out again before a same-call measurement of the
whole step with and without it: git history keeps it, for the next device session to measure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_kernel_sweep import gpu_us  # noqa: E402 - the CUDA-graph timing the LoRA kernels' sweep uses
from run_file import RunFile, add_out_dir  # noqa: E402

SHAPES = {"q/o": (2048, 2048), "k/v": (256, 2048), "gate/up": (5632, 2048), "down": (2048, 5632)}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
REPEAT = 21  # graph replays timed per kernel and weight
SETTINGS = [(256, 4), (1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)]  # (bytes a program, warps)


def agreement(got, expected, weight, absmax) -> dict:
    """How far an output is from the CUDA kernel's, and from the same math in torch (code[nibble] x absmax in fp32,
    rounded once to bf16)."""
    state = weight.quant_state
    packed = weight.data.view(-1)
    nibbles = torch.stack([packed >> 4, packed & 15], dim=1).view(-1).long()
    torch_math = (state.code.to("cuda", torch.float32)[nibbles].view(-1, state.blocksize)
                  * absmax.view(-1, 1)).view(state.shape).to(torch.bfloat16)
    return {"bitwise": bool(torch.equal(got, expected)), "differ_share": (got != expected).float().mean().item(),
            "max_abs_diff": (got.float() - expected.float()).abs().max().item(),
            "cuda_equals_torch_math": bool(torch.equal(expected, torch_math)),
            "equals_torch_math": bool(torch.equal(got, torch_math))}


def host_us(fn, calls: int = 300) -> float:
    torch.cuda._sleep(300_000_000)  # keeps the GPU busy, so launches never wait for room in the queue
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def quantized(shape):
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(shape[1], shape[0], bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True)
    layer.weight.data.normal_(0, 0.02)
    layer.to(torch.bfloat16).cuda()  # quantized from bf16, as a model loaded in bf16 is: dequantizes to bf16
    assert layer.weight.quant_state.dtype == torch.bfloat16, layer.weight.quant_state.dtype
    from nb_helpers.fast import fused_lora
    from nb_helpers.fast.options import DECODED_ABSMAX

    kernels = fused_lora._direct_kernels()
    state = layer.weight.quant_state
    setattr(state, DECODED_ABSMAX, fused_lora._decoded_absmax(state, kernels[0], kernels[2](0)))
    return layer.weight, getattr(state, DECODED_ABSMAX)


def triton_call(weight, absmax, split: int, warps: int):
    from bitsandbytes.backends.triton import kernels_4bit

    data, state = weight.data, weight.quant_state
    out = torch.empty(state.shape, dtype=torch.bfloat16, device="cuda")
    paired = data.numel()
    grid = ((paired + split - 1) // split,)

    def call():
        kernels_4bit.dequant_nf4_kernel[grid](data, out, absmax, paired, out.numel(), state.blocksize, split,
                                              num_warps=warps)
        return out
    return call


def rows_kernel():
    """Our candidate (own-*): the packed bytes as rows of one quantization block each, ROWS rows a program, the absmax
    read once a row; the same math as bitsandbytes (code[nibble] x absmax in fp32, rounded once, high nibble first)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(data, absmax, code, out, rows, ROWS: tl.constexpr, HALF: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, HALF)
        keep = row[:, None] < rows
        packed = tl.load(data + row[:, None] * HALF + col[None, :], mask=keep, other=0)
        scale = tl.load(absmax + row, mask=row < rows, other=0.0)[:, None]
        high = tl.load(code + (packed >> 4).to(tl.int32)) * scale
        low = tl.load(code + (packed & 15).to(tl.int32)) * scale
        both = tl.interleave(high, low)
        tl.store(out + row[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :], both.to(tl.bfloat16), mask=keep)
    return kernel


OWN: list = []  # rows_kernel's kernel, made once (Triton compiles it per launch setting)


def own_call(weight, absmax, rows_a_program: int, warps: int):
    data, state = weight.data, weight.quant_state
    out = torch.empty(state.shape, dtype=torch.bfloat16, device="cuda")
    code = state.code.to("cuda", torch.float32)
    rows = absmax.numel()
    grid = ((rows + rows_a_program - 1) // rows_a_program,)
    kernel = OWN[0]

    def call():
        kernel[grid](data, absmax, code, out, rows, rows_a_program, state.blocksize // 2, num_warps=warps)
        return out
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_dir(parser)
    parser.add_argument("--out", help="an explicit run-file path")
    args = parser.parse_args()
    run = RunFile("dequant", out_dir=args.out_dir, out=args.out)
    from nb_helpers.fast import fused_lora

    rows, table = {}, []
    for name, shape in SHAPES.items():
        weight, absmax = quantized(shape)
        expected = fused_lora._dequantize(weight, direct=True).clone()
        direct = lambda: fused_lora._dequantize(weight, True)  # noqa: E731 - what the fast path runs
        row = {"shape": list(shape), "cuda": {"gpu_us": gpu_us(direct, REPEAT), "host_us": host_us(direct)}}
        for split, warps in SETTINGS:
            call = triton_call(weight, absmax, split, warps)
            row[f"triton-{split}x{warps}"] = {"gpu_us": gpu_us(call, REPEAT), "host_us": host_us(call),
                                              **agreement(call().clone(), expected, weight, absmax)}
        for rows_a_program, warps in ((32, 4), (64, 4), (128, 8), (256, 8)):
            OWN[:] = OWN or [rows_kernel()]
            call = own_call(weight, absmax, rows_a_program, warps)
            row[f"own-{rows_a_program}x{warps}"] = {"gpu_us": gpu_us(call, REPEAT), "host_us": host_us(call),
                                                    **agreement(call().clone(), expected, weight, absmax)}
        rows[name] = row
        run.write({"weights": rows})
    for key in rows["q/o"]:
        if key == "shape":
            continue
        layer = sum(rows[n][key]["gpu_us"] * PER_LAYER[n] for n in SHAPES)
        table.append((key, layer, *(rows[n][key]["gpu_us"] for n in SHAPES), rows["q/o"][key]["host_us"],
                      all(rows[n][key].get("bitwise", True) for n in SHAPES)))
    run.write({"weights": rows, "per_layer_us": {t[0]: t[1] for t in table}})
    print(f"{'kernel':18} {'layer us':>9} " + " ".join(f"{n:>9}" for n in SHAPES) + "   host us  bitwise")
    for key, layer, *rest in table:
        *times, host, same = rest
        print(f"{key:18} {layer:9.1f} " + " ".join(f"{t:9.2f}" for t in times) + f" {host:9.1f}  {same}")
    for key, value in rows["q/o"].items():
        if isinstance(value, dict) and "differ_share" in value:
            print(key, {k: value[k] for k in ("differ_share", "max_abs_diff", "cuda_equals_torch_math",
                                               "equals_torch_math")})


if __name__ == "__main__":
    main()
