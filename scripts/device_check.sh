#!/usr/bin/env bash
# Accelerator qualification in one shot, offline: install this checkout from a
# wheel folder, run the GPU suite through the harness, then the CUDA claims and
# the chunked-loss benchmark at training shapes; keep every piece of evidence.
#
#   scripts/device_check.sh [OUT_DIR] [PYTEST_ARGS...]     (OUT_DIR default: $OUT)
#   DEVICE_CHECK_DRY=1 scripts/device_check.sh OUT_DIR     (CPU dry run, see below)
#
# Offline: pip runs with --no-index --find-links "$DEVICE_WHEELS" (default
# .whl/device, git-ignored), a folder prepared on a networked machine by the
# companion script `python scripts/device_wheels.py` (jsonschema and its
# dependencies for Python 3.10-3.14 on x86_64/aarch64, the test tools,
# setuptools, the Liger-Kernel wheel; ~19 MiB). The machine's own torch,
# numpy and triton are used as they are. The install goes into a throwaway
# venv that sees $PYTHON's packages (a .pth listing its site-packages, written
# by scripts/_common.py; $PYTHON may itself be a virtualenv), so only what is
# missing comes from the folder and the image is left untouched.
# DEVICE_CHECK_INSTALL=0 skips the install and uses $PYTHON as it is.
#
# Phases, each under `timeout`, the whole within $DEVICE_CHECK_BUDGET_S
# (default 450 s, for an 8-minute slot; 1350 s for the dry run); files in OUT_DIR:
#   (env)      env.txt: python, torch, CUDA, GPUs
#   install    install.log, pip-freeze.txt
#   inventory  inventory.txt (harness inventory gpu)
#   suite      suite/{junit.xml,summary.md,summary.json,plan.json}, suite.log,
#              durations.json (recorded seconds per case: copy it to
#              suites/durations/gpu.json); cases needing more cards than this
#              machine has are listed as not run (--max-cards)
#   claims     claims.json (scripts/bench/cuda_qualify.py claims: bitwise
#              observed-vs-plain with deterministic algorithms, no extra
#              matmul, no host sync added by capture)
#   bench      bench.json, bench.md (naive, torch, Liger, ours at three chunk
#              sizes, ours under capture(); bf16 N=16384 H=4096 V=128256, 32000)
#   report     device_check.json, device_check.md (the verdict, all tables)
# phases.tsv records each phase's exit status, seconds and limit.
#
# The suite runs with the environment CI gives it; the claims phase sets
# CUBLAS_WORKSPACE_CONFIG=:4096:8 for itself (deterministic cuBLAS).
#
# DEVICE_CHECK_DRY=1: the same phases on the CPU at tiny shapes, so CI can
# prove this script works: inventory of the gpu suite, the cpu suite narrowed
# to a few cases (DEVICE_CHECK_DRY_K, a pytest -k expression), claims and
# benchmark with --device cpu.
#
# Exit status: 0 when every phase exited 0 and every claim held; 2 for a
# usage or setup error; 1 otherwise.
set -uo pipefail

out="${OUT:-}"
if [ $# -ge 1 ]; then
    out="$1"
    shift
fi
if [ -z "$out" ]; then
    echo "usage: $0 OUT_DIR [PYTEST_ARGS...]   (or set \$OUT; DEVICE_CHECK_DRY=1 for the CPU dry run)" >&2
    exit 2
fi
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.." || exit 2
repo="$(pwd)"

py="${PYTHON:-python3}"
dry="${DEVICE_CHECK_DRY:-0}"
wheels="${DEVICE_WHEELS:-$repo/.whl/device}"
# The CPU dry run is not held to the card's 8 minutes (a loaded CI machine is slow).
budget="${DEVICE_CHECK_BUDGET_S:-$([ "$dry" = 1 ] && echo 1350 || echo 450)}"
case "$budget" in
    '' | *[!0-9]*)
        echo "device_check: DEVICE_CHECK_BUDGET_S must be whole seconds; got '$budget'" >&2
        exit 2
        ;;
esac
start=$SECONDS
rm -f "$out/phases.tsv"

if [ "${DEVICE_CHECK_INSTALL:-1}" != 0 ]; then
    if [ ! -d "$wheels" ]; then
        echo "device_check: wheel folder $wheels is missing: prepare it on a networked machine with" \
             "'python scripts/device_wheels.py' and carry it (or set DEVICE_WHEELS)" >&2
        exit 2
    fi
    wheels="$(cd "$wheels" && pwd)"
fi

log() { echo "device_check: $*"; }

# phase NAME CAP RESERVE CMD...: run CMD under `timeout`, for CAP seconds or
# what the budget leaves after RESERVE seconds kept for the later phases (both
# given for the 450 s budget and scaled with it); record the exit status (124:
# timed out or no time left) in phases.tsv.
phase() {
    local name=$1 cap=$(($2 * budget / 450)) reserve=$(($3 * budget / 450))
    shift 3
    local left=$((budget - (SECONDS - start) - reserve))
    local limit=$((cap < left ? cap : left))
    local t0=$SECONDS rc
    if [ "$limit" -lt 5 ]; then
        log "phase $name: no time left in the ${budget}s budget; not run"
        rc=124
    else
        local what="$*"
        log "phase $name (limit ${limit}s): ${what:0:160}"
        timeout --kill-after=10 "$limit" "$@"
        rc=$?
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$out/phases.tsv"
    log "phase $name exited $rc after $((SECONDS - t0))s"
    return "$rc"
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(hostname)"
    echo "mode: $([ "$dry" = 1 ] && echo 'dry run (cpu)' || echo cuda)"
    echo "checkout: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (modified)')"
    "$py" -c 'import sys, torch; print("python", sys.version.split()[0], sys.executable); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not available"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# ---------------------------------------------------------------- install
venv=""
cleanup() { [ -n "$venv" ] && rm -rf "$venv"; }
trap cleanup EXIT
vpy="$py"
if [ "${DEVICE_CHECK_INSTALL:-1}" != 0 ]; then
    # A throwaway venv over the interpreter's packages: pip adds only what is missing.
    # Not --system-site-packages: that reaches the *base* interpreter's packages, not those
    # of a virtualenv $py may be (no torch there); a .pth lists $py's own instead.
    venv="$(mktemp -d "${TMPDIR:-/tmp}/device-check-venv.XXXXXX")" || exit 2
    if "$py" -m venv --clear --without-pip "$venv" >"$out/install.log" 2>&1 \
        && purelib="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        && "$py" "$repo/scripts/_common.py" outer-site-pth "$purelib" >>"$out/install.log" 2>&1 \
        && "$venv/bin/python" -m pip --version >>"$out/install.log" 2>&1; then
        vpy="$venv/bin/python"
    else
        log "no venv here (see install.log); installing into $py itself"
        export PIP_BREAK_SYSTEM_PACKAGES=1
    fi
fi
# pip never reaches for the network, whoever starts it, and reads no machine
# configuration: the wheel folder is the only source.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONFIG_FILE=/dev/null
export DC_VPY="$vpy" DC_REPO="$repo" DC_WHEELS="$wheels" DC_DRY="$dry" DC_OUT="$out"

install_checkout() {
    set -o pipefail
    local projects=(-e "$DC_REPO")
    [ -f "$DC_REPO/harness/pyproject.toml" ] && projects+=(-e "$DC_REPO/harness")
    # The interpreter's setuptools builds the checkout when it meets every
    # build-system requirement; else pip's isolated build takes it from the folder.
    local build=()
    if "$DC_VPY" "$DC_REPO/scripts/_common.py" build-ready "$DC_REPO/pyproject.toml" "$DC_REPO/harness/pyproject.toml"
    then
        build=(--no-build-isolation)
    fi
    "$DC_VPY" -m pip install --no-index --find-links "$DC_WHEELS" --no-input \
        "${build[@]}" "${projects[@]}" "pytest-xdist>=3.5" "hypothesis>=6.100" || return 1
    if compgen -G "$DC_WHEELS/liger_kernel-*.whl" >/dev/null; then
        # The benchmark's comparison only: without it that row says why, nothing fails.
        "$DC_VPY" -m pip install --no-index --find-links "$DC_WHEELS" --no-input --no-deps liger-kernel \
            || echo "liger-kernel did not install; its benchmark row will say so"
    fi
    "$DC_VPY" -m pip list --format=freeze >"$DC_OUT/pip-freeze.txt" 2>&1
    # The checkout, not another copy, must be what runs.
    "$DC_VPY" -c 'import channel_loss, harness, harness.suites.cli, jsonschema; print("channel_loss from", channel_loss.__file__); print("harness from", harness.__file__)'
}

if [ "${DEVICE_CHECK_INSTALL:-1}" != 0 ]; then
    phase install 120 330 bash -c "$(declare -f install_checkout); install_checkout" >>"$out/install.log" 2>&1
    tail -n 3 "$out/install.log"
fi

# ---------------------------------------------------------------- suite
if [ "$dry" = 1 ]; then
    device=cpu
    suite=cpu
    suite_args=()
    if [ $# -eq 0 ]; then
        # A few cases, in one process: enough to prove the run, its JUnit and summary.
        set -- -p no:xdist -k "${DEVICE_CHECK_DRY_K:-test_capture_is_bitwise_invisible and none}"
    fi
    claims_args=(--device cpu --shape 128x32x500 --chunk-size 32)
    bench_args=(--device cpu --shape 128x32x500 --chunks 32 64 --repeats 2)
else
    device=cuda
    suite=gpu
    cards="$("$vpy" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
    suite_args=()
    if [ "${cards:-0}" -gt 0 ]; then
        # Cases needing more cards than this machine has are listed as not run, not failed.
        suite_args=(--max-cards "$cards")
    fi
    claims_args=(--device cuda)
    bench_args=(--device cuda)
fi

phase inventory 60 300 "$vpy" -m harness inventory gpu >"$out/inventory.txt" 2>&1
log "inventory: $(tail -n 1 "$out/inventory.txt")"

phase suite 210 130 "$vpy" -m harness run "$suite" --out "$out/suite" --durations-out "$out/durations.json" \
    "${suite_args[@]}" -- "$@" 2>&1 | tee "$out/suite.log" | tail -n 25

# ---------------------------------------------------------------- claims, bench, report
phase claims 90 120 "$vpy" scripts/bench/cuda_qualify.py claims --out "$out" "${claims_args[@]}" 2>&1 \
    | tee "$out/claims.log"
phase bench 180 15 "$vpy" scripts/bench/cuda_qualify.py bench --out "$out" "${bench_args[@]}" >"$out/bench.log" 2>&1
tail -n 40 "$out/bench.log"

timeout --kill-after=5 60 "$vpy" scripts/bench/cuda_qualify.py report --out "$out" >"$out/report.log" 2>&1
status=$?
[ "$status" -le 1 ] || status=1
log "$([ "$status" = 0 ] && echo PASSED || echo FAILED) in $((SECONDS - start))s; see $out/device_check.md"
sed -n '1,/^$/p' "$out/device_check.md" 2>/dev/null
exit "$status"
