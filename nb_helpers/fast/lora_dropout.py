"""LoRA's dropout drawn inside its rank-r products (Triton): neither the dropped input nor its mask is written.

peft computes s * lora_B(lora_A(dropout(x))). With torch's kernels that is a dropout kernel that reads x and writes a
dropped copy and a bool mask (the backward keeps both), a GEMM that reads the copy, and a GEMM that adds the rank-r
product into the output (a read and a write of it); the backward reads the copy again and scales through the mask.
On the TinyLlama shape at 8 x 2048 tokens that is about 1.4 ms a layer of an H200's step (2026-12-02), and
320 MiB of copies and masks alive in each layer's backward (the planner's count). Here each kernel redraws the mask where it needs it:

    down = dropout(x) A^T,  out = s * down B^T       forward: reads x once; the base GEMM then adds into `out`
    grad_A = grad_down^T dropout(x)                  backward, one kernel: reads x once more, draws the mask once,
    grad_x = (grad_down A) * mask / (1 - p)            writes x's share; the base GEMM adds into it

The mask (fast.lora_dropout_kernels): 16-bit draws from Philox, seeded from torch's CUDA generator into a device
tensor, so a checkpoint's recompute (which rewinds the generator) draws the same masks and CUDA graphs draw afresh
each step. The keep probability is 1 - round(p * 65536) / 65536 (p = 0.05: 0.000003 off), and the outputs are
scaled by its inverse. The masks are not the ones torch.nn.Dropout draws: the same distribution, other draws.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from nb_helpers.frontend import say_once

MAX_RANK = 64  # the rank-r side of every product lives in registers; larger ranks keep torch's dropout
FEATURE_STEP = 64  # the kernels tile the input's features by 64 (every shape the course plans has it)


@functools.lru_cache(maxsize=1)
def kernels():
    """fast.lora_dropout_kernels, or None (the reason said once) where Triton cannot be imported."""
    try:
        from nb_helpers.fast import lora_dropout_kernels
    except Exception as e:  # noqa: BLE001 - Triton missing or broken: torch's dropout runs instead
        say_once("dropout-kernels", f"[fast] LoRA dropout kernels off: Triton is not importable "
                                    f"({type(e).__name__}); torch's dropout runs (the same keep probability)")
        return None
    return lora_dropout_kernels


def usable(flat, lora_a, outputs: int = 0) -> bool:
    """Whether the kernels take this call: CUDA (or Triton's interpreter), a 16-bit contiguous 2-D input whose
    features the tiles divide, a rank that fits, offsets that fit 31 bits (the kernels index in int32), and Triton
    importable."""
    return ((flat.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and flat.dtype in (torch.float16, torch.bfloat16) and flat.is_contiguous() and flat.dim() == 2
            and flat.shape[1] % FEATURE_STEP == 0 and lora_a.shape[0] <= MAX_RANK and flat.shape[0] > 0
            and max(flat.numel(), flat.shape[0] * outputs) < 2**31 and kernels() is not None)


def draw_seed(device) -> torch.Tensor:
    """One seed from torch's generator for `device`, kept on the device: rewound with the generator, graph-safe.
    Inside drawn_together(), the next of the seeds drawn there."""
    if _TOGETHER and (batch := _TOGETHER[-1]).count > batch.taken:
        if batch.seeds is None:
            batch.seeds = torch.randint(0, 2**31 - 1, (batch.count,), device=device, dtype=torch.int32)
        batch.taken += 1
        return batch.seeds[batch.taken - 1:batch.taken]
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int32)


class _Batch:
    def __init__(self, count: int):
        self.count, self.taken, self.seeds = count, 0, None


_TOGETHER: list[_Batch] = []


@contextlib.contextmanager
def drawn_together(count: int):
    """The first `count` seeds draw_seed() gives inside are drawn in one kernel, at the first of them: a decoder
    layer's LoRA layers take theirs from one draw (fast.fused_block), where each drew its own (a kernel of about 2 us
    each). A checkpoint's recompute rewinds the generator to the layer's start, so it draws the same seeds again, in
    the same order; past `count`, each seed is drawn on its own as outside."""
    _TOGETHER.append(_Batch(count))
    try:
        yield
    finally:
        _TOGETHER.pop()


def threshold(p: float) -> int:
    return round(p * 65536)


def keep_scale(p: float) -> float:
    """1 / the exact keep probability of the 16-bit draws."""
    return 65536.0 / (65536 - threshold(p))


def _rank_tile(rank: int) -> int:
    return max(16, 1 << (rank - 1).bit_length())


def _row_tile(tokens: int) -> int:
    """The tiles before the H200 sweep (NB_LORA_TILES=before, for a benchmark beside today's): 64 rows a program,
    fewer where that would leave an H200's SMs without two programs each."""
    return 64 if tokens >= 64 * 2 * H200_SMS else 32 if tokens >= 32 * H200_SMS else 16


def _col_tile(features: int) -> int:
    return 128 if features % 128 == 0 else 64  # 128: 79 against 94 us for the forward (H200 sweep, 2026-12-02)


def tiles(kernel: str, tokens: int, features: int) -> dict:
    """Each kernel's launch settings: its tiles (rows BT, input columns BK, outputs BN), warps and pipeline stages;
    for "forward", whether `out` is written by the down kernel itself (split=False) or by out_kernel after it; for
    "backward", how many programs per SM its row splits aim at. `features` is the input's for "forward" and
    "backward", the outputs' for "out". From bench/lora_kernel_sweep.py on an H200 (2026-12-03): the
    backward with four programs an SM took 70.8 against 79.9 us at 16,384 tokens and 21.3 against 22.7 at 4,096; the
    forward writing 256 outputs a step 49.5 against 52.1 (q and o); each other kernel was within 5% of its best.
    NB_LORA_TILES=before gives the settings these replaced, for a benchmark's run beside these."""
    if os.environ.get("NB_LORA_TILES") == "before":
        rows, cols = _row_tile(tokens), _col_tile(features)
        return {"forward": dict(BT=rows, BK=cols, BN=128, num_warps=4, num_stages=3, split=False),
                "out": dict(BT=64, BN=128, num_warps=4, num_stages=1),
                "backward": dict(BT=rows, BK=cols, num_warps=4, num_stages=3, per_sm=2)}[kernel]
    many = tokens >= 8192
    return {"forward": dict(BT=32 if many else 16, BK=_col_tile(features), BN=256, num_warps=4, num_stages=3,
                            split=False),
            "out": dict(BT=64, BN=128 if features >= 1024 else 64, num_warps=4, num_stages=1),
            "backward": dict(BT=16 if many else 32, BK=_col_tile(features) if many else 64, num_warps=4, num_stages=3,
                             per_sm=4)}[kernel]


def _launch(settings: dict) -> dict:
    return {key: settings[key] for key in ("num_warps", "num_stages")}


H200_SMS = 132  # the GPU the tiles were tuned on; where no GPU answers (Triton's interpreter on a CPU)


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU a kernel runs on (a GTX 1650 has 14, an H200 132)."""
    if device.type != "cuda":
        return H200_SMS
    return _sms_of(torch.cuda.current_device() if device.index is None else device.index)


def row_splits(tokens: int, features: int, rows: int, cols: int, per_sm: int = 2,
               sms: int = H200_SMS) -> tuple[int, int]:
    """(splits, rows per split) of the backward kernel's grid: about `per_sm` programs per SM of the GPU (`sms` of
    them), whole tiles. Fewer SMs, fewer splits: fewer partial sums to write and add."""
    splits = max(1, min(-(-tokens // rows), -(-sms * per_sm // (features // cols))))
    rows_per_split = -(-(-(-tokens // splits)) // rows) * rows
    return -(-tokens // rows_per_split), rows_per_split


def dropped_down(flat, a, b, seed, p: float, scaling: float, write_out: bool = True, settings: dict | None = None):
    """(down, out): down = dropout(flat) A^T (tokens x rank, flat's dtype); out = scaling * down B^T (tokens x
    outputs), or None without `write_out` (a product nothing reads: fast.recompute). `settings`: tiles()'s, for
    benchmarks."""
    tokens, features = flat.shape
    rank, outputs = a.shape[0], b.shape[0]
    settings = settings or tiles("forward", tokens, features)
    fused = write_out and not settings["split"]
    down = torch.empty(tokens, rank, dtype=flat.dtype, device=flat.device)
    out = torch.empty(tokens, outputs, dtype=flat.dtype, device=flat.device) if fused else down
    kernels().down_kernel[(-(-tokens // settings["BT"]),)](
        flat, a.contiguous(), b.contiguous(), down, out, seed, tokens, features, rank, outputs, threshold(p),
        keep_scale(p), scaling, R=_rank_tile(rank), BT=settings["BT"], BK=settings["BK"], BN=settings["BN"],
        WRITE_OUT=fused, **_launch(settings))
    if write_out and not fused:
        out = out_from_down(down, b, scaling)
    return down, (out if write_out else None)


def out_from_down(down, b, scaling: float, settings: dict | None = None):
    """scaling * down B^T: the bits dropped_down writes for `down` (each element is the same rank-r dot), from a
    `down` made before (a recompute reusing its forward's, lever down_once) or just now (split forward)."""
    tokens, rank = down.shape
    outputs = b.shape[0]
    settings = settings or tiles("out", tokens, outputs)
    out = torch.empty(tokens, outputs, dtype=down.dtype, device=down.device)
    grid = (-(-tokens // settings["BT"]), -(-outputs // settings["BN"]))
    kernels().out_kernel[grid](down, b.contiguous(), out, tokens, rank, outputs, scaling, R=_rank_tile(rank),
                               BT=settings["BT"], BN=settings["BN"], **_launch(settings))
    return out


def grads(grad_down, flat, a, seed, p: float, settings: dict | None = None):
    """(grad_A, grad_x) through the same mask as dropped_down's, drawn once for both: grad_down^T dropout(flat) (rank
    x features, fp32) and (grad_down A) * mask / (1 - p) (tokens x features, LoRA's share of the input's gradient,
    into which the base GEMM then adds)."""
    tokens, features = flat.shape
    rank, padded = grad_down.shape[1], _rank_tile(grad_down.shape[1])
    settings = settings or tiles("backward", tokens, features)
    rows, cols = settings["BT"], settings["BK"]
    splits, rows_per_split = row_splits(tokens, features, rows, cols, settings["per_sm"], sm_count(flat.device))
    grad_a = torch.empty(rank, features, dtype=torch.float32, device=flat.device)
    # each split's partial grad_A (one split writes grad_A itself), and how many splits have stored theirs, per tile
    parts = torch.empty(splits, padded, features, dtype=torch.float32, device=flat.device) if splits > 1 else grad_a
    arrived = arrival_counts(flat.device, features // cols)
    grad_x = torch.empty(tokens, features, dtype=grad_down.dtype, device=flat.device)
    kernels().backward_kernel[(features // cols, splits)](
        grad_down.contiguous(), flat, a.contiguous(), grad_x, parts, grad_a, arrived, seed, tokens, features, rank,
        threshold(p), keep_scale(p), rows_per_split, splits, R=padded, BT=rows, BK=cols, **_launch(settings))
    return grad_a, grad_x


_COUNTS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counts(device, tiles: int) -> torch.Tensor:
    """`tiles` zeros for backward_kernel's counts, kept per device: the kernel leaves them at zero (each tile's last
    split resets its count), so no fill kernel runs per call. Calls on one device run in stream order (graphed layers
    replay on a side stream the current one waits for), so they never share a count at once. A buffer, once made, is
    never freed: a CUDA graph may have captured its address. A capture that needs more than any holds makes its own
    (its fill is captured with it)."""
    kept = _COUNTS.setdefault(torch.device(device), [])
    for counts in kept:
        if counts.numel() >= tiles:
            return counts
    if _capturing(device):
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    kept.append(torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device))
    return kept[-1]


def _capturing(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def drawn_mask(seed, tokens: int, features: int, p: float, device, rows: int = 32, cols: int = 64) -> torch.Tensor:
    """The bool mask the kernels draw for `seed` (for the tests)."""
    out = torch.empty(tokens, features, dtype=torch.int8, device=device)
    kernels().mask_kernel[(-(-tokens // rows), features // cols)](out, seed, tokens, features, threshold(p),
                                                                 BT=rows, BK=cols)
    return out.bool()
