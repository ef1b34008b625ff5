"""Repack bitsandbytes' wheel for the lent H200 without the CUDA libraries its torch (CUDA 13.0) never loads, so the
wheels (.whl), the embedded model's cache (.devcarry) and the tracked tree fit the device's 64 MiB carry together
(bitsandbytes 0.50.2: 43 MB -> 13 MB). The entries leave RECORD too, so pip installs the rest unchanged.

    python bench/trim_bnb_wheel.py .whl-full/bitsandbytes-0.50.2-*.whl .whl/
"""

import sys
import zipfile
from pathlib import Path

DROP = tuple(f"bitsandbytes/libbitsandbytes_cuda{v}.so" for v in (118, 121, 124, 126, 128))


def trim(source: Path, folder: Path) -> Path:
    target = folder / source.name
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        for item in old.infolist():
            if item.filename in DROP:
                continue
            data = old.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                data = "\n".join(line for line in data.decode().split("\n") if line.split(",")[0] not in DROP).encode()
            new.writestr(item, data)
    return target


if __name__ == "__main__":
    out = trim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB")
