#!/usr/bin/env bash
# On a CUDA machine: the GPU suite (pytest -m gpu), the private-API checks (tests/test_compat.py) and the pins check
# (tests/test_pins.py), with the versions they ran on. The log lands in $OUT/pytest-gpu-<commit>.log and is committed
# under bench/results/raw/. On the lent device, carry .whl (../shared/device-wheels.sh liger-kernel==0.8.5) and
# .devcarry/cache (the embedded model's tokenizer files: the tests' tiny model uses its tokenizer).
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
[ -d .devcarry/cache ] && export NB_CACHE_DIR=$PWD/.devcarry/cache
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo worktree)}
log="$OUT/pytest-gpu-$commit.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "from nb_helpers.summary import package_versions; print(package_versions())"
} > "$log" 2>&1
python3 -m pytest -p no:cacheprovider --ignore=tests/browser -q -rs -m "gpu" tests >> "$log" 2>&1
gpu=$?
python3 -m pytest -p no:cacheprovider -q tests/test_compat.py tests/test_pins.py >> "$log" 2>&1
other=$?
grep -E "passed|failed|error" "$log" | tail -4
exit $((gpu || other))
