"""Faults a run survives, not needed to follow the course: what keeps a run from being lost, and a damaged adapter
from being exported.

One process per run folder (run_lock); checkpoints that count only once complete (checkpoints); SIGTERM handled like
Ctrl-C (signals); a write failure (full disk, read-only, permission) reported the same way whatever the library that
hit it raised (write_errors); an adapter checked complete, finite and made for its base before export merges it
(adapter_check).
"""
