"""Side-by-side benchmark of LM-head cross-entropy implementations (fwd + bwd).

Compares, in one run: naive full-logits CE, torch's chunked
``F.linear_cross_entropy`` (``options=LinearCrossEntropyOptions()``), our
``chunk_cross_entropy``, and ours under ``capture()``. Times are medians of
round-robin repeats in this process (so machine noise hits every method
alike); extra peak memory is measured in a fresh subprocess per method as the peak
RSS of a step above the RSS before it (inputs and their gradients exist).

    python scripts/bench/chunk_loss.py                  # N=4096 H=256 V=32000
    python scripts/bench/chunk_loss.py --tokens 1024 --vocab 8000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import channel_loss as cl

METHODS = ("naive", "torch_native", "ours", "ours_capture")
TARGETS = {
    "ours / torch_native time": ("<=", 1.00),
    "ours / torch_native extra peak": ("<=", 1.00),
    "capture overhead (time)": ("<=", 0.03),
    "ours / naive extra peak": ("<=", 1 / 8),
}


def make_inputs(n: int, h: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::17] = -100
    return hidden, weight, targets


def step(method: str, hidden, weight, targets, chunk_size: int, keep_grads: bool = False) -> None:
    if not keep_grads:
        hidden.grad = None
        weight.grad = None
    if method == "naive":
        logits = F.linear(hidden, weight).float()
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
    elif method == "torch_native":
        loss = F.linear_cross_entropy(
            hidden, weight, targets, ignore_index=-100,
            options=torch.nn.LinearCrossEntropyOptions(),
        )
    elif method == "ours":
        loss = cl.chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=chunk_size)
    elif method == "ours_capture":
        with cl.capture() as cap:
            loss = cl.chunk_cross_entropy(
                hidden, weight, shift_labels=targets, chunk_size=chunk_size
            )
        assert len(cap.observations) == 1
    else:
        raise ValueError(f"unknown method {method!r}")
    loss.backward()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def measure_memory(args: argparse.Namespace) -> None:
    """Child mode: print the extra peak RSS of one fwd+bwd of one method, as JSON.

    A warm-up step first creates thread pools and allocator caches; then the
    kernel's peak-RSS mark is reset (``clear_refs`` 5) before each measured
    step, and the median of the measured steps is reported.
    """
    hidden, weight, targets = make_inputs(args.tokens, args.hidden, args.vocab, args.torch_dtype)
    # Gradients of the inputs are part of every method's result, not extra memory.
    hidden.grad = torch.zeros_like(hidden)
    weight.grad = torch.zeros_like(weight)
    step(args.child, hidden, weight, targets, args.chunk_size, keep_grads=True)
    extras = []
    for _ in range(3):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_kib("VmRSS")
        step(args.child, hidden, weight, targets, args.chunk_size, keep_grads=True)
        extras.append(max(_status_kib("VmHWM") - base, 0) * 1024)
    print(json.dumps({"extra_peak": statistics.median(extras)}))


def child_memory(method: str, argv: list[str]) -> int:
    # A fixed mmap threshold makes glibc hand large blocks back on free, so RSS
    # follows live memory instead of the allocator's high-water mark.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--child", method],
        check=True, capture_output=True, text=True, timeout=600, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_peak"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="N, tokens per call")
    parser.add_argument("--hidden", type=int, default=256, help="H")
    parser.add_argument("--vocab", type=int, default=32000, help="V")
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per method")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.torch_dtype = getattr(torch, args.dtype)
    if args.child:
        measure_memory(args)
        return 0

    shared = [
        "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
        "--chunk-size", str(args.chunk_size), "--dtype", args.dtype,
    ]
    print(f"N={args.tokens} H={args.hidden} V={args.vocab} chunk_size={args.chunk_size} "
          f"dtype={args.dtype} threads={torch.get_num_threads()} torch={torch.__version__}",
          flush=True)
    memory = {}
    for method in METHODS:
        memory[method] = child_memory(method, shared)
        print(f"  memory measured: {method}", flush=True)

    hidden, weight, targets = make_inputs(args.tokens, args.hidden, args.vocab, args.torch_dtype)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for method in METHODS:  # warm-up
        step(method, hidden, weight, targets, args.chunk_size)
    for r in range(args.repeats):
        for method in METHODS:
            t0 = time.perf_counter()
            step(method, hidden, weight, targets, args.chunk_size)
            times[method].append(time.perf_counter() - t0)
        print(f"  round {r + 1}/{args.repeats}", flush=True)
    med = {m: statistics.median(ts) for m, ts in times.items()}

    print()
    print(f"{'method':<14} {'fwd+bwd median (ms)':>20} {'extra peak (MiB)':>17}")
    for m in METHODS:
        print(f"{m:<14} {med[m] * 1e3:>20.1f} {memory[m] / 2**20:>17.1f}")
    ratios = {
        "ours / torch_native time": med["ours"] / med["torch_native"],
        "ours / torch_native extra peak": memory["ours"] / max(memory["torch_native"], 1),
        "capture overhead (time)": med["ours_capture"] / med["ours"] - 1,
        "ours / naive extra peak": memory["ours"] / max(memory["naive"], 1),
    }
    print()
    print(f"{'ratio':<32} {'measured':>9} {'target':>9}  met")
    for name, value in ratios.items():
        op, bound = TARGETS[name]
        met = value <= bound
        print(f"{name:<32} {value:>9.3f} {op + format(bound, '.3f'):>9}  {'yes' if met else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
