"""The next batches collated in a DataLoader worker process while the GPU trains on this one.

TRL's collator turns Python lists into padded tensors: about 6-12 ms for 8 x 2048 tokens on an ordinary host core.
The Trainer asks for a step's batches right after the previous step's logging has waited for the GPU, so in the main
process that time is idle GPU at every step (12 ms of an 8 x 2048 step in the traces of bench/NOTES.md). One worker
(torch's DataLoader, `dataloader_num_workers=1`) collates them ahead instead; the batches and their order are the same.

Linux only: there the worker is forked. Elsewhere a worker starts a fresh interpreter that must import the notebook's
own code, which Jupyter on Windows and macOS cannot do, so the run collates in the main process and says so once.
"""

from __future__ import annotations

import os
import signal
import sys

from nb_helpers.frontend import say_once

WORKERS = 1  # one is enough: a batch collates in far less time than a step trains
AHEAD = 2  # batches each worker keeps ready (torch's default prefetch_factor)


def loader_args(model) -> dict:
    """SFTConfig's DataLoader arguments for this model's levers: {} collates in the main process, as the Trainer does."""
    from nb_helpers.fast.options import options_of

    if model is None or not options_of(model).prefetch:
        return {}
    if not sys.platform.startswith("linux"):
        say_once("prefetch", "[fast] prefetch off: DataLoader workers are forked on Linux only; batches are collated "
                             "in this process")
        return {}
    # no pinning: with workers torch pins in a thread of the training process, which then competes with the thread
    # that launches the kernels; a batch is 3 x tokens x 8 bytes (384 KiB at 8 x 2048), copied as fast unpinned
    return dict(dataloader_num_workers=WORKERS, dataloader_prefetch_factor=AHEAD, dataloader_pin_memory=False)


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
