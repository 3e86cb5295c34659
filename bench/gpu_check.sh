#!/usr/bin/env bash
# GPU check for kernels/: Triton vs torch-kernel parity on CUDA tensors (two-pass, top-k list,
# split-K decode), then timings against
# SDPA (flash) at 4k/16k/32k/64k tokens, 32 heads, d_head 128, bf16, and decode rows against SDPA and
# the K/V read time. Under 8 minutes on an H100/H200 (the script stops starting cases at --budget-s).
#
#   bash bench/gpu_check.sh                 # everything
#   bash bench/gpu_check.sh --skip-sweep    # extra arguments go to bench/gpu_check.py
#   TRITON_INTERPRET=1 bash bench/gpu_check.sh --dry-run   # no GPU: checks the script on CPU
set -u
cd "$(dirname "$0")/.."

# the first interpreter that has torch and triton (and, unless dry-running, a CUDA device)
want_cuda=1
for arg in "$@"; do [ "$arg" = "--dry-run" ] && want_cuda=0; done
PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
    if "$cand" -c "import torch, triton, sys; sys.exit(0 if ($want_cuda == 0 or torch.cuda.is_available()) else 1)" \
        >/dev/null 2>&1; then
        PY="$cand"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "gpu_check: no python with torch + triton + CUDA found (set PYTHON=...)" >&2
    exit 2
fi
echo "gpu_check: using $PY"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# hard stop at 7m50s so a hung case cannot eat the machine's time; the script itself stops
# starting new cases after --budget-s (default 420 s)
timeout --signal=INT --kill-after=10 470 "$PY" -u bench/gpu_check.py "$@"
status=$?
[ $status -eq 124 ] && echo "gpu_check: timed out (partial table above)"
exit $status
