"""The launch settings of fast.lora_dropout's kernels, swept on one CUDA GPU at the TinyLlama shape (2,048 input
features, rank 8; outputs 2,048 for q and o, 256 for k and v) and the two token counts of issue 27 (8 x 512 and
8 x 2048). Each setting's outputs are checked against the shipped settings' (the largest relative difference is kept).

    python bench/lora_kernel_sweep.py --out-dir $OUT      # on the device: a run file; prints the best settings last

What it compares, per call of one projection (CUDA-event medians over replays of a graph of 20 calls):
  forward   down = dropout(x) A^T and out = s down B^T: one kernel (split=False), or the down kernel then out_kernel
  out       out_kernel alone (a recompute reusing its forward's down: lever down_once)
  backward  grad_A and LoRA's share of grad_x, one kernel, its row splits aiming at 2, 4 or 8 programs per SM
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_file import RunFile, add_out_dir  # noqa: E402

from nb_helpers.fast import lora_dropout as ld  # noqa: E402

FEATURES, RANK, P, SCALING = 2048, 8, 0.05, 2.0


def gpu_us(fn, repeat: int = 5, inner: int = 20) -> float:
    """GPU time of one call: `inner` calls captured in one CUDA graph, whose replays are timed by CUDA events (a
    Triton launch costs the host more than these kernels take, so eager calls back to back would time the host)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    return sorted(times)[len(times) // 2]


def rel(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def grid() -> dict[str, list[dict]]:
    def product(**axes):
        return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    return {
        "fused": product(BT=(16, 32, 64), BK=(128, 256), BN=(128, 256), num_warps=(4, 8), num_stages=(3,),
                         split=(False,)),
        "down": product(BT=(16, 32, 64, 128), BK=(128, 256), BN=(128,), num_warps=(4, 8), num_stages=(2, 4),
                        split=(True,)),
        "out": product(BT=(32, 64, 128), BN=(64, 128, 256), num_warps=(4, 8), num_stages=(1,)),
        "backward": product(BT=(16, 32, 64), BK=(64, 128, 256), num_warps=(4, 8), num_stages=(2, 3),
                            per_sm=(2, 4, 8)),
    }


def tensors(tokens: int, outputs: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)
    return dict(x=rand(tokens, FEATURES), a=rand(RANK, FEATURES, scale=FEATURES ** -0.5), b=rand(outputs, RANK),
                gd=rand(tokens, RANK), seed=torch.tensor([1234], dtype=torch.int32, device="cuda"))


def calls(kind: str, t: dict, settings: dict):
    """(the timed call, what it returns for the check)."""
    if kind in ("fused", "down"):
        def run():
            return ld.dropped_down(t["x"], t["a"], t["b"], t["seed"], P, SCALING, settings=settings)
    elif kind == "out":
        def run():
            return ld.out_from_down(t["down"], t["b"], SCALING, settings=settings)
    else:
        def run():
            return ld.grads(t["gd"], t["x"], t["a"], t["seed"], P, settings=settings)
    return run


def first_tensor(result):
    return result[0] if isinstance(result, tuple) else result


def sweep_kind(kind: str, configs: list[dict], shapes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for tokens, outputs in shapes:
        t = tensors(tokens, outputs)
        t["down"] = ld.dropped_down(t["x"], t["a"], t["b"], t["seed"], P, SCALING, write_out=False)[0]
        shipped = ld.tiles("out", tokens, outputs) if kind == "out" else \
            ld.tiles("backward" if kind == "backward" else "forward", tokens, FEATURES)
        reference = calls(kind, t, shipped)()
        shipped_us = gpu_us(calls(kind, t, shipped))
        for settings in configs:
            began = time.perf_counter()
            try:
                run = calls(kind, t, settings)
                got = run()
                checks = [rel(first_tensor(got), first_tensor(reference))]
                if isinstance(got, tuple) and got[1] is not None:
                    checks.append(rel(got[1], reference[1]))
                us = gpu_us(run)
            except Exception as error:  # noqa: BLE001 - a setting the compiler refuses (shared memory): recorded
                rows.append({"kind": kind, "tokens": tokens, "outputs": outputs, **settings,
                             "error": f"{type(error).__name__}: {str(error)[:120]}"})
                continue
            rows.append({"kind": kind, "tokens": tokens, "outputs": outputs, **settings, "us": us,
                         "shipped_us": shipped_us, "max_rel_diff": max(checks),
                         "wall_s": time.perf_counter() - began})
        del t
    return rows


def best(rows: list[dict]) -> dict:
    found = {}
    for r in rows:
        if "us" not in r or r["max_rel_diff"] > 2e-2:
            continue
        key = (r["kind"], r["tokens"], r["outputs"])
        if key not in found or r["us"] < found[key]["us"]:
            found[key] = r
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    parser.add_argument("--kinds", default="fused,down,out,backward")
    args = parser.parse_args()
    run_file = RunFile("lora-kernel-sweep", out_dir=args.out_dir, out=args.out)
    shapes = {"fused": [(4096, 2048), (4096, 256), (16384, 2048), (16384, 256)],
              "down": [(4096, 2048), (4096, 256), (16384, 2048), (16384, 256)],
              "out": [(4096, 2048), (4096, 256), (16384, 2048), (16384, 256)],
              "backward": [(4096, 2048), (16384, 2048)]}
    rows, began = [], time.perf_counter()
    for kind in args.kinds.split(","):
        rows += sweep_kind(kind, grid()[kind], shapes[kind])
        print(f"[sweep] {kind} done at {time.perf_counter() - began:.0f} s", flush=True)
    winners = best(rows)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "best": [dict(r) for r in winners.values()]}
    print(f"wrote {run_file.write(out)}")
    for (kind, tokens, outputs), r in sorted(winners.items()):
        settings = {k: v for k, v in r.items() if k not in ("kind", "tokens", "outputs", "us", "shipped_us",
                                                            "max_rel_diff", "wall_s")}
        print(f"[best] {kind:8s} {tokens:6d} x {outputs:5d}: {r['us']:6.1f} us (shipped {r['shipped_us']:6.1f}) "
              f"{settings}")


if __name__ == "__main__":
    main()
