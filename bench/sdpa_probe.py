"""Device call 7: host and GPU time of one SDPA call per backend, at the fast path's shapes (TinyLlama: 32 heads,
4 KV heads, head dim 64), and which kernels the default picks. `python bench/sdpa_probe.py` on a CUDA GPU."""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"
out = {}
def timeit(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n
    return round(host * 1e6), round(wall * 1e6)
for B, S in [(8, 512), (8, 2048), (1, 512)]:
    q = torch.randn(B, 32, S, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, 4, S, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, 4, S, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for name, backends in [("default", None), ("flash", [SDPBackend.FLASH_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("cudnn", [SDPBackend.CUDNN_ATTENTION])]:
        def fwd():
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        g = torch.randn(B, 32, S, 64, device=dev, dtype=torch.bfloat16)
        def fb():
            fwd().backward(g)
        try:
            out[f"{B}x{S} {name}"] = {"fwd_host_us, fwd_wall_us": timeit(fwd), "fwdbwd_host_us, wall_us": timeit(fb)}
        except Exception as e:
            out[f"{B}x{S} {name}"] = f"{type(e).__name__}: {str(e)[:150]}"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g); torch.cuda.synchronize()
    out[f"{B}x{S} default kernels"] = sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
for k_, v_ in out.items(): print(k_, v_)
