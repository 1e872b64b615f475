#!/usr/bin/env bash
# gptlab on one CUDA GPU in under 8 minutes: the CUDA tests, the model FLOP utilisation of a
# GPT-2-124M-shaped bfloat16 training step (gpu_mfu.py), the speedrun preset trained on the GPU, timed
# whole, and batch-1 decoding (gpu_decode.py); then one table of what each stage gave.
#
#   bash benchmarks/gpu.sh              # on a machine with a CUDA GPU
#   bash benchmarks/gpu.sh --dry-run    # every stage at a tiny size on the CPU: checks this script
#
# Nothing is installed or downloaded (such a machine may have no network): gptlab runs from this
# checkout's src/ through PYTHONPATH, under the first Python whose torch sees a CUDA GPU: $PYTHON if set,
# else .venv/bin/python, else python3. That Python needs gptlab's dependencies (torch built for CUDA,
# numpy, safetensors, tokenizers, tqdm, matplotlib, jinja2, scipy, filelock) and pytest; the script
# names what is missing. The speedrun trains on the built-in shakespeare when gptlab's cache holds it
# ($GPTLAB_CACHE, else ~/.cache/gptlab: copy shakespeare.txt there), else on python-stdlib, the
# interpreter's own source; GPU_DATA=NAME|PATH chooses. Each stage has a time limit (460 s in all) and
# its own log in $GPU_LOGS (default: a new temporary folder). The exit status is 0 only when every
# stage succeeded.
set -uo pipefail

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu.sh [--dry-run]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The Python to use: the first candidate whose torch sees a CUDA GPU (in a dry run, the first found).
if [ -n "${PYTHON:-}" ]; then candidates=("$PYTHON"); else candidates=(.venv/bin/python python3); fi
PY=""
for candidate in "${candidates[@]}"; do
  command -v "$candidate" >/dev/null 2>&1 || continue
  if [ "$DRY_RUN" = 1 ] || "$candidate" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null
  then PY=$candidate; break; fi
  echo "$candidate: $("$candidate" -c 'import torch; print("torch", torch.__version__, "sees no CUDA GPU")' 2>&1 | tail -n 1)"
done
if [ -z "$PY" ]; then
  echo "no Python here has a torch that sees a CUDA GPU (tried: ${candidates[*]}): set PYTHON to one, or run" \
       "bash benchmarks/gpu.sh --dry-run to check the script on the CPU" >&2
  exit 2
fi
if ! missing=$("$PY" -c 'import pytest, gptlab.training.loop, gptlab.generate' 2>&1); then
  echo "$PY cannot run gptlab from $ROOT/src: $(echo "$missing" | tail -n 1)" >&2
  exit 2
fi
WORK=$(mktemp -d -t gptlab-gpu-XXXXXX)
LOGS=${GPU_LOGS:-$WORK}
mkdir -p "$LOGS"
if [ "$DRY_RUN" = 1 ]; then
  DEVICE=cpu; MFU=(--tiny --no-compile --batch 4 --steps 3 --warmup 1); SPEEDRUN=(--max-steps 5)
  DECODE=(--tiny --new 32)
else
  DEVICE=cuda; MFU=(); SPEEDRUN=(); DECODE=(--new 256)
fi
if [ -n "${GPU_DATA:-}" ]; then DATA=$GPU_DATA
elif "$PY" -c 'import sys; from gptlab.data.corpora import cache_dir
sys.exit(not (cache_dir() / "shakespeare.txt").is_file())'; then DATA=shakespeare
else DATA=python-stdlib
fi

"$PY" - "$DEVICE" <<'EOF' | tee "$LOGS/environment.log"
import platform, sys
import torch
from gptlab.common import cpu_name
name = torch.cuda.get_device_name() if sys.argv[1] == "cuda" else cpu_name()
print(f"device: {name}; Python {platform.python_version()} at {sys.executable}; torch {torch.__version__}, "
      f"CUDA {torch.version.cuda or '-'}")
EOF
echo "speedrun data: $DATA; logs in $LOGS"

ROWS=()
FAILED=0
# stage NAME SECONDS COMMAND...: run the command under a time limit, its output shown and kept in
# $LOGS/NAME.log, and add a row (status, seconds) to the summary.
stage() {
  local name=$1 limit=$2 start status rc tenths
  shift 2
  echo
  echo "== $name (at most ${limit} s): $*"
  start=$(date +%s%N)
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124) status="timed out after $limit s"; FAILED=1 ;;
    *) status="failed (exit $rc)"; FAILED=1 ;;
  esac
  tenths=$(( ($(date +%s%N) - start) / 100000000 ))
  ROWS+=("| $name | $status | $((tenths / 10)).$((tenths % 10))")
}

TOTAL=$(date +%s)
stage cuda-tests 100 "$PY" -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider
stage mfu 150 "$PY" benchmarks/gpu_mfu.py --device "$DEVICE" "${MFU[@]}"
stage speedrun 120 "$PY" -m gptlab train --preset speedrun --device "$DEVICE" --data "$DATA" \
  --out "$WORK/speedrun" --no-progress --samples 0 "${SPEEDRUN[@]}"
stage decode 90 "$PY" benchmarks/gpu_decode.py --device "$DEVICE" "${DECODE[@]}"

# One line of figures from each stage's log.
tests=$(grep -E "passed|failed|skipped|error" "$LOGS/cuda-tests.log" | tail -n 1)
steps=$(grep -Eo "finished at step [0-9]+: [0-9,]+ tokens/s" "$LOGS/speedrun.log" | tail -n 1)
loss=$(grep -Eo "on the val split: loss [0-9.]+" "$LOGS/speedrun.log" | tail -n 1)
FIGURES=("$tests" "see the MFU table below" "whole command; ${steps:-no finished line}, ${loss:-no val loss} ($DATA)"
         "see the decoding table below")
echo
cat "$LOGS/environment.log"
if [ "$DRY_RUN" = 1 ]; then note=", a dry run on the CPU at tiny sizes"; else note=""; fi
echo "total $(( $(date +%s) - TOTAL )) s$note"
echo
echo "| stage | status | seconds | figures |"
echo "|---|---|---|---|"
for i in "${!ROWS[@]}"; do
  echo "${ROWS[$i]} | ${FIGURES[$i]} |"
done
echo
grep -E "^\|" "$LOGS/mfu.log"
echo
grep -E "^\|" "$LOGS/decode.log"
exit "$FAILED"
