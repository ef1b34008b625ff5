"""RMSNorm's backward for a frozen weight on one CUDA GPU: liger-kernel's own backward (one program per SM, each
walking its rows) against fast.frozen_norms (liger's fused add + RMSNorm backward kernel over ROWS rows a program),
at the TinyLlama shape's hidden size. Times are CUDA-event medians of 10 calls back to back (ms a call); `bytes_ms`
is what the tensors each call reads and writes take at the GPU's measured copy speed.

    python bench/norm_bench.py --out-dir $OUT     # on the device: a run file (bench/run_file.py); a table last
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nb_helpers.fast import frozen_norms  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_dropout_bench import median_ms  # noqa: E402
from run_file import RunFile, add_out_dir  # noqa: E402


def copy_gbs() -> float:
    a = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (median_ms(lambda: b.copy_(a)) * 1e-3) / 1e9


def one_shape(rows: int, cols: int, dtype, gbs: float) -> dict:
    from liger_kernel.ops import LigerFusedAddRMSNormFunction, LigerRMSNormFunction

    norm = SimpleNamespace(weight=torch.nn.Parameter(torch.rand(cols, device="cuda", dtype=dtype) + 0.5,
                                                     requires_grad=False), variance_epsilon=1e-6)
    x, r, gy, gs = (torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(4))
    xs = [t.requires_grad_() for t in (x.clone(), r.clone())]
    y_l = LigerRMSNormFunction.apply(xs[0], norm.weight, 1e-6, 0.0, "llama", False, None)
    y_a, s_a = LigerFusedAddRMSNormFunction.apply(*xs, norm.weight, 1e-6, 0.0, "llama", False)
    y_o, p_o = frozen_norms.norm_keeping_input(xs[0], norm)
    y_f, s_f = frozen_norms.add_norm(*xs, norm)
    bytes_per = rows * cols * x.element_size()
    row = {"rows": rows, "cols": cols, "dtype": str(dtype).split(".")[-1],
           "liger_rms_backward_ms": median_ms(lambda: torch.autograd.grad(y_l, xs[0], gy, retain_graph=True)),
           "liger_add_backward_ms": median_ms(lambda: torch.autograd.grad((y_a, s_a), xs, (gy, gs), retain_graph=True)),
           "ours_input_backward_ms": median_ms(lambda: torch.autograd.grad((y_o, p_o), xs[0], (gy.clone(), gs),
                                                                           retain_graph=True)),
           "ours_add_backward_ms": median_ms(lambda: torch.autograd.grad((y_f, s_f), xs, (gy.clone(), gs),
                                                                         retain_graph=True)),
           "add_ms": median_ms(lambda: gy + gs), "clone_ms": median_ms(lambda: gy.clone()),
           "bytes_ms_input": 4 * bytes_per / gbs / 1e6, "bytes_ms_add": 4 * bytes_per / gbs / 1e6, "sweep": []}
    for rows_per, warps in itertools.product((1, 2, 4, 8), (4, 8, 16)):
        ctx = SimpleNamespace(saved_tensors=(x, norm.weight, torch.rand(rows, device="cuda")), block=2048 if cols > 1024
                              else 1024, warps=warps, mode=0)
        frozen_norms.ROWS = rows_per
        row["sweep"].append({"rows_per_program": rows_per, "warps": warps,
                             "ms": median_ms(lambda: frozen_norms._input_grad(ctx, gy.clone(), gs)) - row["clone_ms"]})
    frozen_norms.ROWS = 1
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    args = parser.parse_args()
    run_file = RunFile("norm", out_dir=args.out_dir, out=args.out)
    gbs = copy_gbs()
    rows = [one_shape(n, 2048, torch.bfloat16, gbs) for n in (16384, 4096)]
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": gbs, "results": rows}
    print(f"wrote {run_file.write(out)}")
    print(f"copy speed {gbs:.0f} GB/s")
    for r in rows:
        print(f"{r['rows']:6d} rows: liger rms bwd {r['liger_rms_backward_ms'] * 1e3:6.1f} us, liger add bwd "
              f"{r['liger_add_backward_ms'] * 1e3:6.1f}, ours input (+res) {r['ours_input_backward_ms'] * 1e3:6.1f}, "
              f"ours add {r['ours_add_backward_ms'] * 1e3:6.1f}, add {r['add_ms'] * 1e3:5.1f}, clone "
              f"{r['clone_ms'] * 1e3:5.1f}, bytes {r['bytes_ms_add'] * 1e3:5.1f}")
        best = min(r["sweep"], key=lambda s: s["ms"])
        print("   sweep:", " ".join(f"{s['rows_per_program']}/{s['warps']}:{s['ms'] * 1e3:.1f}" for s in r["sweep"]),
              f"| best {best['rows_per_program']}/{best['warps']}")


if __name__ == "__main__":
    main()
