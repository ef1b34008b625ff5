#!/usr/bin/env bash
# On the GPU device: the reference recipe on a TinyLlama-1.1B-shaped model (random weights) under an emulated
# 4 GiB budget, then the same run with micro-batch 8 x accumulation 1 (same effective batch), then the GPU
# tests. Results land in $OUT and are committed under examples/.
# Anywhere with the project installed: `bash bench/gpu_reference_example.sh`. On the lent device, carry .whl
# (../shared/device-wheels.sh) and .devcarry/cache (the embedded model's tokenizer files, for the GPU tests).
set -euo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
[ -d .devcarry/cache ] && export NB_CACHE_DIR=$PWD/.devcarry/cache
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUNS=$(mktemp -d)  # fresh every call: a warm machine keeps /tmp between calls
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 bench/build_tinyllama_shape.py --out /tmp/tinyllama-shape
for spec in "reference-1x8 1 8" "batch8-8x1 8 1"; do
  set -- $spec
  python3 -m nb_helpers train --config examples/gpu_reference_4gib.json --set run_name=$1 --set runs_dir=$RUNS \
    --set micro_batch_size=$2 --set grad_accum=$3 2>&1 | grep -v "examples/s\]" | tee "$OUT/train-$1.log" | grep -E "^\[" || true
done
tar -czf "$OUT/runs.tar.gz" -C "$RUNS" reference-1x8/config.json reference-1x8/metrics.jsonl \
  reference-1x8/summary.json batch8-8x1/config.json batch8-8x1/metrics.jsonl batch8-8x1/summary.json
python3 -m pytest -m gpu -v -p no:cacheprovider tests > "$OUT/pytest-gpu.log" 2>&1 || true
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest-gpu.log" | tail -8
RUNS=$RUNS python3 - <<'PY'
import json, os
print(f"{'run':<16}{'s/step':>8}{'tok/s':>9}{'peak dev GiB':>14}{'peak reserved':>15}{'loss first->last':>20}")
for name in ("reference-1x8", "batch8-8x1"):
    s = json.load(open(f"{os.environ['RUNS']}/{name}/summary.json"))
    print(f"{name:<16}{s['median_step_s']:>8.3f}{s['tokens_per_s']:>9.0f}{s['peak_vram_gib']:>14.2f}"
          f"{s['peak_reserved_gib']:>15.2f}{s['train_loss_first']:>10.3f}->{s['train_loss_last']:.3f}")
PY
