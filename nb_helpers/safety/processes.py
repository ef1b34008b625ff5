"""Several processes on the GPUs a machine has: each process trains on a GPU of its own (accelerate's DDP)."""

from __future__ import annotations

from nb_helpers.config import ConfigError


def check_one_gpu_each(processes: int, gpus: int) -> None:
    """Each process trains on a GPU of its own: two on one GPU stop NCCL at its first collective ("Duplicate GPU
    detected"), after the model has loaded. Said before anything loads, with the fixes."""
    if processes > gpus:
        raise ConfigError(f"{processes} processes need {processes} GPUs, and this machine shows {gpus}: launch with "
                          f"--num_processes {gpus} (or train in one process without `accelerate launch`), or hide "
                          "the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU through gloo")
