"""`python -m nb_helpers train ...` under cProfile, one report per process (bench/multi_gpu.py --profile-dir).

    accelerate launch --multi_gpu --num_processes 2 bench/profile_train.py DIR --config runs/x/config.json

Writes DIR/rank<R>.txt: the top functions by own time and by cumulative time, for the whole process (loading
included). Used to see where a host-bound step spends its time with 1 and with 2 processes."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    out_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    from nb_helpers.cli import main as cli_main

    profiler = cProfile.Profile()
    code = profiler.runcall(cli_main, ["train", *argv])
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{os.environ.get('RANK', '0')}.txt").write_text(text.getvalue())
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
