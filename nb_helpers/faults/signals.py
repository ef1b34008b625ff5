"""SIGTERM handled like the first Ctrl-C. A laptop shutting down, `timeout`, a batch scheduler or `docker stop` send
SIGTERM, and by default Python dies at once (exit 143) with no checkpoint, adapter or summary. During trainer.train()
it raises Terminated instead, a KeyboardInterrupt: the Ctrl-C path writes a checkpoint at the last finished step,
finish_run the adapter and summary.json ("interrupted"), and then the process exits with 143, as a SIGTERM'd
process does. A second SIGTERM while that is being written gets the previous handler (by default: exit now)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during training."""


def _raise_terminated(signum, frame):
    print("\n[run] SIGTERM received: stopping as Ctrl-C does (checkpoint, adapter, summary), then exiting", flush=True)
    raise Terminated("SIGTERM")


@contextmanager
def sigterm_as_interrupt():
    """Install the handler for the block, then put back the one there was. Only the main thread may install signal
    handlers (signal.signal raises elsewhere); Jupyter runs cells there, so only a caller's own threads go without."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: not set from Python
