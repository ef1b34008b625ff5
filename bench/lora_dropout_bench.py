"""LoRA's dropout and rank-r products on one CUDA GPU: torch's kernels (what fast.fused_lora runs without the
`dropout_kernels` lever) against fast.lora_dropout's Triton kernels, per projection of the TinyLlama shape, with the
base GEMM that adds into the output in both. Also checks the kernels against torch on the mask they draw (bf16).

    python bench/lora_dropout_bench.py --out-dir $OUT     # on the device: a run file (bench/run_file.py); a table last

Times are CUDA-event medians (median_ms), per call of one projection. The kernels' own launch settings are
swept by bench/lora_kernel_sweep.py.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_file import RunFile, add_out_dir  # noqa: E402

from nb_helpers.fast import lora_dropout as ld  # noqa: E402


def median_ms(fn, repeat: int = 21, warmup: int = 5, inner: int = 10) -> float:
    """GPU time of one call: `inner` calls back to back between two events, so that the host's launch time (Triton's
    launcher takes tens of microseconds) hides behind the queued work; the median over `repeat` samples. (Call 39
    timed one call per sample, which counted the host's launch time too.)"""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return sorted(times)[len(times) // 2]


def tensors(tokens, features, outputs, rank=8, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)
    return dict(x=rand(tokens, features), w=rand(outputs, features, scale=0.02), a=rand(rank, features, scale=0.02),
                b=rand(outputs, rank, scale=0.02), g=rand(tokens, outputs, scale=0.01))


def torch_path(t, p, s):
    def forward():
        dropped, mask = torch.native_dropout(t["x"], p, True)
        down = dropped @ t["a"].t()
        out = t["x"] @ t["w"].t()
        out.addmm_(down, t["b"].t(), alpha=s)
        return dropped, mask, down
    dropped, mask, _ = forward()
    grad_down = (t["g"] @ t["b"]).mul_(s)

    def backward():
        grad_a = grad_down.t() @ dropped
        grad_x = torch.ops.aten.native_dropout_backward(grad_down @ t["a"], mask, 1.0 / (1.0 - p))
        grad_x.addmm_(t["g"], t["w"])
        return grad_a, grad_x
    return forward, backward


def kernel_path(t, p, s):
    seed = ld.draw_seed("cuda")

    def forward():
        down, out = ld.dropped_down(t["x"], t["a"], t["b"], seed, p, s)
        out.addmm_(t["x"], t["w"].t())
        return down
    grad_down = (t["g"] @ t["b"]).mul_(s)

    def backward():
        grad_a, grad_x = ld.grads(grad_down, t["x"], t["a"], seed, p)
        grad_x.addmm_(t["g"], t["w"])
        return grad_a, grad_x
    return forward, backward, seed, grad_down


def check(t, p, s) -> dict:
    """The kernels' outputs against torch's math on the kernels' own mask (max abs error / max abs value)."""
    forward, backward, seed, grad_down = kernel_path(t, p, s)
    tokens, features = t["x"].shape
    mask = ld.drawn_mask(seed, tokens, features, p, "cuda")
    dropped = (t["x"].float() * mask * ld.keep_scale(p)).to(t["x"].dtype)
    down, out = ld.dropped_down(t["x"], t["a"], t["b"], seed, p, s)
    ref_down = dropped.float() @ t["a"].float().t()
    ref_out = s * (down.float() @ t["b"].float().t())
    grad_a, grad_x = ld.grads(grad_down, t["x"], t["a"], seed, p)
    ref_a = grad_down.float().t() @ (t["x"].float() * mask) * ld.keep_scale(p)
    ref_x = (grad_down.float() @ t["a"].float()) * mask * ld.keep_scale(p)

    def rel(got, ref):
        return float((got.float() - ref).abs().max() / ref.abs().max())
    return {"keep_rate": float(mask.float().mean()), "down": rel(down, ref_down), "out": rel(out, ref_out),
            "grad_a": rel(grad_a, ref_a), "grad_x": rel(grad_x, ref_x)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    args = parser.parse_args()
    run_file = RunFile("lora-dropout", out_dir=args.out_dir, out=args.out)
    p, s, results = 0.05, 2.0, []
    for tokens, (name, outputs) in itertools.product((16384, 4096), (("q/o", 2048), ("k/v", 256))):
        t = tensors(tokens, 2048, outputs)
        tf, tb = torch_path(t, p, s)
        kf, kb, _, _ = kernel_path(t, p, s)
        row = {"tokens": tokens, "projection": name, "outputs": outputs,
               "torch_forward_ms": median_ms(tf), "kernels_forward_ms": median_ms(kf),
               "torch_backward_ms": median_ms(tb), "kernels_backward_ms": median_ms(kb),
               "base_gemm_ms": median_ms(lambda: t["x"] @ t["w"].t()),
               "base_grad_gemm_ms": median_ms(lambda: t["g"] @ t["w"]), "check": check(t, p, s)}
        results.append(row)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    print(f"wrote {run_file.write(out)}")
    print(f"{'tokens':>6} {'proj':>4} {'torch fwd':>9} {'kern fwd':>9} {'torch bwd':>9} {'kern bwd':>9} "
          f"{'base':>6} {'worst rel err':>13}")
    for r in results:
        print(f"{r['tokens']:6d} {r['projection']:>4} {r['torch_forward_ms'] * 1e3:9.1f} {r['kernels_forward_ms'] * 1e3:9.1f}"
              f" {r['torch_backward_ms'] * 1e3:9.1f} {r['kernels_backward_ms'] * 1e3:9.1f} {r['base_gemm_ms'] * 1e3:6.1f}"
              f" {max(v for k, v in r['check'].items() if k != 'keep_rate'):13.2e}  keep {r['check']['keep_rate']:.5f}")


if __name__ == "__main__":
    main()
