"""Several processes, one run: `accelerate launch -m nb_helpers train` starts one process per GPU (DDP). This module
says who this process is, which one writes, how the processes agree on a value, and how the batch is split.

Everything here is a no-op in one process (the notebooks, `python -m nb_helpers train`): no process group is
created, broadcast returns its argument, wait returns at once.

    global batch = micro_batch_size x grad_accum x world size

A run's config.json holds the one-process equivalent (micro-batch m, accumulation a x world), so the same file gives
the same global batch on any number of processes; per_process_batch splits it again for the processes at hand.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from nb_helpers import compat
from nb_helpers.config import ConfigError


def world_size() -> int:
    """Processes in this run, as the launcher (accelerate launch, torchrun) says; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's GPU on its machine (the launcher numbers them 0..N-1 per machine)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one process that writes the run folder and prints."""
    return rank() == 0


# NCCL sizes its buffers for bandwidth: on two NVLink-connected H200s a 2-GPU job held 0.82 GiB more of each GPU
# than one process alone, outside PyTorch's allocator, a fifth of a 4 GB card (2 x H200, 2026-11-30).
# QLoRA all-reduces only the LoRA gradients (9 MB a step for TinyLlama at r=8). With two channels the extra fell to
# 0.39 GiB and the step got faster, not slower (bench/RESULTS.md). A user's own setting wins.
NCCL_LEAN = {"NCCL_MAX_NCHANNELS": "2"}


def lean_nccl() -> dict[str, str]:
    """Set NCCL_LEAN where the user has not set those variables; returns what was set."""
    chosen = {key: value for key, value in NCCL_LEAN.items() if key not in os.environ}
    os.environ.update(chosen)
    return chosen


def init() -> None:
    """Create the process group the way the Trainer will (accelerate's PartialState: NCCL on GPUs, gloo on CPUs),
    early, so the processes can agree on the run folder and auto-fit's choice before the Trainer exists. Also makes
    this process's GPU the current one. Nothing happens in one process."""
    if world_size() <= 1:
        return
    import torch
    from accelerate import PartialState

    if torch.cuda.is_available():
        check_one_gpu_each(world_size(), torch.cuda.device_count())
        chosen = lean_nccl()  # before the first collective: NCCL reads them when it creates its communicator
        if chosen and is_main():
            print(f"[multi] NCCL kept small for a small card: {', '.join(f'{k}={v}' for k, v in chosen.items())} "
                  "(set it yourself to override)", flush=True)
    PartialState(cpu=not torch.cuda.is_available())  # the same cpu flag SFTConfig's use_cpu gives the Trainer


def check_one_gpu_each(processes: int, gpus: int) -> None:
    """Each process trains on a GPU of its own: two on one GPU stop NCCL at its first collective ("Duplicate GPU
    detected"), after the model has loaded. Said before anything loads, with the fixes."""
    if processes > gpus:
        raise ConfigError(f"{processes} processes need {processes} GPUs, and this machine shows {gpus}: launch with "
                          f"--num_processes {gpus} (or train in one process without `accelerate launch`), or hide "
                          "the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU through gloo")


def _group_ready() -> bool:
    if world_size() <= 1:
        return False
    import torch.distributed as dist

    if not dist.is_initialized():
        init()
    return True


def broadcast(value):
    """Rank 0's `value` on every process (any picklable object)."""
    if not _group_ready():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value) -> list:
    """Every process's `value`, in rank order, on every process."""
    if not _group_ready():
        return [value]
    import torch.distributed as dist

    out = [None] * world_size()
    dist.all_gather_object(out, value)
    return out


def wait() -> None:
    """Every process waits here until all have arrived (rank 0 writing files, the others reading them after)."""
    if _group_ready():
        import torch.distributed as dist

        dist.barrier()


@contextmanager
def main_first():
    """Rank 0 runs the block first (fetching or converting a model into the cache), then the others."""
    if not is_main():
        wait()
    try:
        yield
    finally:
        if is_main():
            wait()


@contextmanager
def quiet_unless_main():
    """Only rank 0 prints: the other processes' stdout goes nowhere (their errors still reach stderr)."""
    if is_main():
        yield
        return
    from contextlib import redirect_stdout

    with open(os.devnull, "w", encoding="utf-8") as sink, redirect_stdout(sink):
        yield


def finish() -> None:
    """Tear the process group down at the end of a run (torch warns when a program exits without it)."""
    if world_size() > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


# --- the batch over several processes ------------------------------------------------------------------------------

def per_process_batch(micro: int, accum: int, world: int) -> tuple[int, int]:
    """Split the global batch micro x accum (one process) over `world` processes: each process takes
    global / world sequences per optimizer step, as micro' x accum'. Accumulation shrinks first; the micro-batch
    shrinks (to the largest divisor of the per-process batch not above it) only where accumulation cannot absorb
    the split, so no process needs more memory than one process did. ValueError when it cannot divide."""
    total = micro * accum
    if world < 1:
        raise ValueError(f"world size {world}: must be >= 1")
    if total % world:
        accum_ok = next(a for a in range(accum, accum + world + 1) if micro * a % world == 0)
        raise ValueError(
            f"the global batch {total} (micro_batch_size {micro} x grad_accum {accum}) cannot be split evenly over "
            f"{world} processes: make micro_batch_size x grad_accum a multiple of {world} (e.g. --set "
            f"grad_accum={accum_ok}, a global batch of {micro * accum_ok}), or launch a number of processes that "
            f"divides {total}")
    share = total // world
    new_micro = max(d for d in range(1, min(micro, share) + 1) if share % d == 0)
    return new_micro, share // new_micro


def describe_split(micro: int, accum: int, world: int) -> str:
    """The one line a multi-process run prints about its batch."""
    new_micro, new_accum = per_process_batch(micro, accum, world)
    changed = []
    if new_accum != accum:
        changed.append(f"grad_accum {accum} -> {new_accum}")
    if new_micro != micro:
        changed.append(f"micro_batch_size {micro} -> {new_micro}")
    what = (", ".join(changed) + " per process") if changed else "micro-batch and accumulation unchanged"
    return (f"[multi] {world} processes: {what}; global batch {micro * accum} = {new_micro} x {new_accum} x {world} "
            f"kept (micro-batch x accumulation x processes)")


def one_process_equivalent(micro: int, accum: int, world: int) -> tuple[int, int]:
    """What config.json keeps for a run that trained micro x accum on each of `world` processes."""
    return micro, accum * world


def one_gpu_per_process(args) -> bool:
    """A single process that sees several GPUs trains on one. Left alone, the Trainer would wrap the model in
    nn.DataParallel over every visible GPU, which SFTTrainer refuses at construction (measured on 2 x H200);
    `accelerate launch` is how to use several. Call it on the SFTConfig before building the trainer. Returns whether
    it changed anything."""
    if world_size() > 1 or args.n_gpu <= 1:
        return False
    print(f"[gpus] this process sees {args.n_gpu} GPUs and trains on cuda:0; to train on all of them: "
          "accelerate launch --multi_gpu --num_processes N -m nb_helpers train ...", flush=True)
    compat.set_gpu_count(args, 1)  # what TrainingArguments itself sets for a model split over devices
    return True


def split_over_processes(cfg, world: int, verbose: bool = True):
    """Each process's share of the global batch (per_process_batch); one process: cfg."""
    if world <= 1:
        return cfg
    try:
        micro, accum = per_process_batch(cfg.micro_batch_size, cfg.grad_accum, world)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if verbose:
        print(describe_split(cfg.micro_batch_size, cfg.grad_accum, world))
    return cfg.replace(micro_batch_size=micro, grad_accum=accum)

def checkpoint_world_size(checkpoint: str | Path) -> int:
    """How many processes wrote a checkpoint: the Trainer saves one RNG state per process (rng_state_<rank>.pth),
    or rng_state.pth alone for one process."""
    ranks = list(Path(checkpoint).glob("rng_state_*.pth"))
    return len(ranks) or 1

def resume_note(checkpoint: str | Path, world: int) -> str:
    """What resuming on `world` processes keeps, and what it cannot keep when the checkpoint had another count."""
    before = checkpoint_world_size(checkpoint)
    if before == world:
        return (f"[run] resuming on {world} process{'es' if world > 1 else ''}, as the checkpoint was trained: the "
                "same global batch, data order and RNG state as an uninterrupted run")
    return (f"[run] the checkpoint was trained on {before} process{'es' if before > 1 else ''} and resumes on {world}: "
            "the global batch stays as config.json gives it (each process's accumulation is adjusted), and the "
            "optimizer and scheduler continue, but the rows are dealt to processes differently, so the data "
            "order from here can differ from an uninterrupted run, and processes with no RNG state of their own in "
            "the checkpoint start their dropout from the seed: the loss curve will not match one run step for step")


def free_port() -> int:
    """A free TCP port on this machine for accelerate's rendezvous (tests and bench start several launches)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
