"""The next batches collated in a DataLoader worker process while the GPU trains on this one.

TRL's collator turns Python lists into padded tensors (5.8 ms for 8 x 2048 tokens on one core of our 2-core CI
machine). The Trainer asks for a step's batches right after the previous step's logging has waited for the GPU, so in
the training process that time is idle GPU at every step. One worker (torch's DataLoader, `dataloader_num_workers=1`)
collates them ahead instead; the batches and their order are the same.

Where it runs: CUDA-graphed layers, whose steps leave the host waiting and the GPU idle at their edges (8 x 512 on an
H200: 49,477 against 43,774 tokens/s, bench/NOTES.md, call 59). Layers run eagerly bind the step to the training
process's launches, and there the worker was not faster: at 8 x 2048 it measured 57,144 against 63,946 tokens/s in
the same call (and 54,997 against 53,889 in call 58), so eager runs collate in the training process, said once. On a
CPU the lever is off unless NB_FASTPATH=prefetch=1 asks for it (the tests). Linux only: there the worker is forked.
Elsewhere a worker starts a fresh interpreter that must import the notebook's own code, which Jupyter on Windows and
macOS cannot do, so the run collates in the training process and says so once.
"""

from __future__ import annotations

import os
import signal
import sys

from nb_helpers.frontend import say_once

WORKERS = 1  # one is enough: a batch collates in far less time than a step trains
AHEAD = 2  # batches each worker keeps ready (torch's default prefetch_factor)


def loader_args(model, checkpointing: bool = True) -> dict:
    """SFTConfig's DataLoader arguments for this model's levers and run: {} collates in the training process, as the
    Trainer does."""
    import torch

    from nb_helpers.fast.checkpoints import graphs_on
    from nb_helpers.fast.options import options_of

    if model is None or not options_of(model).prefetch:
        return {}
    if torch.cuda.is_available() and not (graphs_on(model) and checkpointing):
        say_once("prefetch-eager", "[fast] prefetch off: the layers run eagerly, where the training process's launches "
                                   "bind the step and a worker was not faster; batches are collated in this process")
        return {}
    if not sys.platform.startswith("linux"):
        say_once("prefetch", "[fast] prefetch off: DataLoader workers are forked on Linux only; batches are collated "
                             "in this process")
        return {}
    return dict(dataloader_num_workers=WORKERS, dataloader_prefetch_factor=AHEAD)


def _leave_quietly(signum, frame):
    raise SystemExit(0)  # multiprocessing ends the worker with status 0


def signals_to_main(collator):
    """Wrap the collator so that a worker leaves SIGTERM and Ctrl-C to the main process. A `kill` of the process group,
    systemd or a batch scheduler stopping the job, or Ctrl-C in a terminal reaches the worker too; one killed by the
    signal makes torch raise "worker killed by signal" in the main process at once, perhaps while it writes the
    checkpoint and summary that safety.signals promises, and one forked with that module's handler says its line too. Here the worker ignores Ctrl-C and leaves on SIGTERM with
    exit status 0, which torch does not report; nothing after an interrupt needs its batches (an interrupted run is
    not evaluated), and a later loop starts fresh workers (not persistent ones)."""
    quiet_in = set()  # the worker processes (by pid) that already handle them

    def collate(examples):
        if os.getpid() not in quiet_in:
            from torch.utils.data import get_worker_info

            if get_worker_info() is not None:
                signal.signal(signal.SIGTERM, _leave_quietly)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                quiet_in.add(os.getpid())
        return collator(examples)

    return collate
