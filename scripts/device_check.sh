#!/usr/bin/env bash
# Run the GPU suite on a CUDA machine and keep the evidence.
#
#   scripts/device_check.sh [OUT_DIR] [PYTEST_ARGS...]     (OUT_DIR default: $OUT)
#
# Writes to OUT_DIR: env.txt (python, torch, GPUs), inventory.txt (the gpu
# suite's cases), junit.xml, summary.md / summary.json (per entry), the
# harness run log, and durations.json (recorded seconds per case, for
# suites/durations/gpu.json). Exits with `harness run`'s status: non-zero when
# a case failed, or when no CUDA card is visible (--harness-require cuda).
set -uo pipefail

out="${OUT:-}"
if [ $# -ge 1 ]; then
    out="$1"
    shift
fi
if [ -z "$out" ]; then
    echo "usage: $0 OUT_DIR   (or set \$OUT)" >&2
    exit 2
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."

py="${PYTHON:-python3}"
{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(hostname)"
    "$py" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not available"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# The machine's torch stays: install only what the harness and the tests need.
if ! "$py" -c 'import harness.suites.cli, jsonschema, pytest, xdist, hypothesis, filelock, psutil' >/dev/null 2>&1; then
    "$py" -m pip install -q --no-deps -e . >"$out/pip.log" 2>&1
    "$py" -m pip install -q pytest pytest-xdist hypothesis jsonschema filelock psutil numpy >>"$out/pip.log" 2>&1
fi

"$py" -m harness inventory gpu >"$out/inventory.txt" 2>&1
echo "inventory: $(tail -n 1 "$out/inventory.txt")"

# Cases needing more cards than this machine has are listed in the summary as
# not run here (the suite's multi-card runners run them), not failed.
cards="$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
max_cards=()
if [ "${cards:-0}" -gt 0 ]; then
    max_cards=(--max-cards "$cards")
fi
"$py" -m harness run gpu --out "$out" --durations-out "$out/durations.json" "${max_cards[@]}" -- "$@" 2>&1 | tee "$out/run.log"
status=${PIPESTATUS[0]}
echo "device_check: harness run gpu exited $status; results in $out"
exit "$status"
