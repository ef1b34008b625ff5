"""What keeps a run from being lost, and a bad setting from reaching the model: not needed to follow the course.

Settings checked for type, range and finiteness before anything loads; one process per run folder (a lock);
checkpoints that count only once complete; SIGTERM handled like Ctrl-C; a write failure (full disk, read-only,
permission) reported the same way whatever the library that hit it raised.
"""
