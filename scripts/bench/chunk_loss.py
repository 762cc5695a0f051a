"""Side-by-side benchmark of LM-head cross-entropy implementations (fwd + bwd), on the CPU.

Compares, in one run: naive full-logits CE, torch's chunked
``F.linear_cross_entropy`` (``options=LinearCrossEntropyOptions()``, where
this torch has it), the ``cut-cross-entropy`` package's torch-compile path
(when installed), our ``chunk_cross_entropy`` at its default chunk size
(the device's default chunk math: eager passes on the CPU), ours under
``capture()``, and ours with the compiled chunk math
(``chunk_math("compiled")``, the CUDA default). The default run covers three configurations, each
in fp32 and in bf16 (``--dtype`` picks; one column per configuration and
dtype in the ratio table):

    base    N=4096  H=256 V=32000   3 rounds
    vocab   N=4096  H=256 V=128256  2 rounds  (large vocabulary)
    tokens  N=32768 H=256 V=32000   3 rounds  (many tokens)

Every measurement is one fwd+bwd step in a fresh subprocess (after a
warm-up step on a tiny problem, and one at full size in ``base``; methods
that compile, ``cce`` and ``ours_compiled``, always get a full-size warm-up
step and report it as "first call": their compile time, kept out of the step
time), which
reports the step's time and its extra peak RSS (the kernel's high-water
mark, reset just before the step, above the RSS before it; inputs and their
``.grad`` already exist). Rounds visit the methods round-robin, odd rounds
backwards, so machine noise hits every method alike and no method always
runs right after the same neighbour; the table shows the best
time and the median extra peak of the rounds. The capture overhead comes
from adjacent ``ours`` / ``ours_capture`` steps in one process (16 pairs in
``base``, 4 in the others, the order alternating), as the median over the
pairs of each pair's time ratio, not from the separate processes: a pair
shares the machine's state of the moment, and a burst of noise that hits one
step of a pair moves one ratio, not the median. A peer whose
step takes longer than ``--peer-timeout`` (120 s; naive's and cce's bf16 on
a CPU without bf16 matrix units do) is reported as timed out, and ours / its
time as the upper bound ours / timeout (marked <=). Naive full
logits is skipped where it would need more than ``--naive-limit-gib`` (it
needs ~3 x N x V x 4 bytes); its extra peak is then the lower bound
2 x N x V x 4 (its fp32 logits and their log-softmax, both alive from the
forward's softmax to the backward's; measured runs hold about 4x N x V x 4),
so the "ours / naive" ratio printed is an upper bound (marked <=).

    python scripts/bench/chunk_loss.py                        # all three configurations
    python scripts/bench/chunk_loss.py --configs base         # one of them
    python scripts/bench/chunk_loss.py --dtype bfloat16       # bf16 columns only
    python scripts/bench/chunk_loss.py --rounds 1 --pairs 1   # a quick, noisier run
    python scripts/bench/chunk_loss.py --tokens 1024 --vocab 8000 --chunk-size 256
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
from channel_loss.ops import chunk_math

CONFIGS = {
    "base": {"tokens": 4096, "hidden": 256, "vocab": 32000, "rounds": 3, "warmup": 1, "pairs": 16},
    "vocab": {"tokens": 4096, "hidden": 256, "vocab": 128256, "rounds": 2, "warmup": 0, "pairs": 4},
    "tokens": {
        "tokens": 32768,
        "hidden": 256,
        "vocab": 32000,
        "rounds": 3,
        "warmup": 0,
        "pairs": 4,
    },
}
TARGETS = {
    "ours / torch_native time": 1.00,
    "ours / cce time": 1.00,
    "ours / torch_native extra peak": 1.00,
    "capture overhead (time)": 0.03,
    "ours / naive extra peak": 1 / 8,
}


#: The dtypes a run can take, with their column suffix.
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def _has_torch_native() -> bool:
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def _has_cce() -> bool:
    try:
        import cut_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


#: The methods that are not ours: a failure or timeout of one leaves its column empty.
PEERS = ("naive", "torch_native", "cce")


def methods() -> list[str]:
    """The methods this interpreter can run, in table order."""
    out = ["naive"]
    if _has_torch_native():
        out.append("torch_native")
    if _has_cce():
        out.append("cce")
    return [*out, "ours", "ours_capture", "ours_compiled"]


#: Methods whose first call compiles (torch.compile); timed apart from the step.
COMPILING = ("cce", "ours_compiled")


def make_inputs(n: int, h: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::17] = -100
    return hidden, weight, targets


def step(method: str, hidden, weight, targets, chunk_size: int | None) -> None:
    """One fwd+bwd of ``method``; gradients accumulate into the existing ``.grad``."""
    if method == "naive":
        logits = F.linear(hidden, weight).float()
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
    elif method == "torch_native":
        loss = F.linear_cross_entropy(
            hidden,
            weight,
            targets,
            ignore_index=-100,
            options=torch.nn.LinearCrossEntropyOptions(),
        )
    elif method == "cce":
        from cut_cross_entropy import linear_cross_entropy

        loss = linear_cross_entropy(
            hidden, weight, targets, ignore_index=-100, impl="torch_compile"
        )
    elif method == "ours":
        loss = cl.chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=chunk_size)
    elif method == "ours_compiled":
        with chunk_math("compiled"):
            loss = cl.chunk_cross_entropy(
                hidden, weight, shift_labels=targets, chunk_size=chunk_size
            )
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


def capture_pairs(args: argparse.Namespace, hidden, weight, targets) -> None:
    """Child mode: ``--pairs`` adjacent pairs of ``ours`` and ``ours_capture`` steps,
    the order alternating from pair to pair.

    Prints, as JSON, the best time of each and the median over the pairs of
    ``ours_capture / ours`` time. Adjacent steps in one process share the
    machine's state of the moment, which separate processes cannot: the
    capture overhead (a few microseconds of bookkeeping) is far below the
    noise between them.
    """
    best = {"ours": float("inf"), "ours_capture": float("inf")}
    for method in best:
        _tiny_warmup(method, args)
        for _ in range(args.warmup):
            step(method, hidden, weight, targets, args.chunk_size)
    ratios = []
    for k in range(args.pairs):
        took = {}
        for method in list(best) if k % 2 == 0 else list(best)[::-1]:
            t0 = time.perf_counter()
            step(method, hidden, weight, targets, args.chunk_size)
            took[method] = time.perf_counter() - t0
            best[method] = min(best[method], took[method])
        ratios.append(took["ours_capture"] / took["ours"])
    print(json.dumps({**best, "median_ratio": statistics.median(ratios)}))


def _tiny_warmup(method: str, args: argparse.Namespace) -> None:
    """One step on a tiny problem: lazy imports (dynamo: ~70 MiB), thread pools and
    allocator caches are set up before the measurement, not counted in it."""
    tiny = make_inputs(16, args.hidden, 64, args.torch_dtype, seed=1)
    step(method, *tiny, None)


def child(args: argparse.Namespace) -> None:
    """Child mode: print ``{"seconds", "extra_peak"}`` of one measured step as JSON."""
    hidden, weight, targets = make_inputs(args.tokens, args.hidden, args.vocab, args.torch_dtype)
    # Gradients of the inputs are part of every method's result, not extra memory.
    hidden.grad = torch.zeros_like(hidden)
    weight.grad = torch.zeros_like(weight)
    if args.child == "capture_pairs":
        capture_pairs(args, hidden, weight, targets)
        return
    t0 = time.perf_counter()
    _tiny_warmup(args.child, args)
    first = time.perf_counter() - t0
    for k in range(max(args.warmup, 1 if args.child in COMPILING else 0)):
        t0 = time.perf_counter()
        step(args.child, hidden, weight, targets, args.chunk_size)
        if k == 0:
            # A compiling method may recompile at the full size: that too is first-call cost.
            first += time.perf_counter() - t0
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    step(args.child, hidden, weight, targets, args.chunk_size)
    seconds = time.perf_counter() - t0
    extra = max(_status_kib("VmHWM") - base, 0) * 1024
    print(json.dumps({"seconds": seconds, "extra_peak": extra, "first_call": first}))


def run_child(method: str, config: dict, args: argparse.Namespace) -> dict:
    """One measured step of ``method`` in a fresh subprocess (see ``child``), within
    ``--child-timeout`` for ours and ``--peer-timeout`` for every other method."""
    argv = [
        "--tokens",
        str(config["tokens"]),
        "--hidden",
        str(config["hidden"]),
        "--vocab",
        str(config["vocab"]),
        "--dtype",
        args.dtype,
        "--warmup",
        str(config["warmup"]),
        "--pairs",
        str(config.get("pairs", 0)),
        "--child",
        method,
    ]
    if args.chunk_size is not None:
        argv += ["--chunk-size", str(args.chunk_size)]
    # A fixed mmap threshold makes glibc hand large blocks back on free, so RSS
    # follows live memory instead of the allocator's high-water mark.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(
        [sys.executable, __file__, *argv],
        check=True,
        capture_output=True,
        text=True,
        timeout=args.peer_timeout if method in PEERS else args.child_timeout,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _round_order(todo: list[str], r: int) -> list[str]:
    """The order round ``r`` visits the methods in: odd rounds go backwards, and each
    pair of rounds starts one method later, so no method always runs right after the
    same neighbour: whatever a process leaves the machine in never favours the same
    method in every round."""
    k = (r // 2) % max(len(todo), 1)
    order = todo[k:] + todo[:k]
    return order[::-1] if r % 2 else order


def bench_config(
    name: str, config: dict, args: argparse.Namespace
) -> tuple[dict[str, float], set[str]]:
    """Measure every method on one configuration; print its table; return its ratios
    and which of them are upper bounds (against a peer that timed out, or naive's
    lower-bound memory)."""
    n, h, v = config["tokens"], config["hidden"], config["vocab"]
    chunk = args.chunk_size or cl.default_chunk_size(n, h, v, args.torch_dtype)
    naive_bytes = 3 * n * v * 4
    run_naive = naive_bytes <= args.naive_limit_gib * 2**30
    todo = [m for m in methods() if m != "naive" or run_naive]
    print(
        f"\n[{name}] N={n} H={h} V={v} dtype={args.dtype} ours chunk_size={chunk}"
        f"{'' if args.chunk_size else ' (default)'} rounds={config['rounds']}",
        flush=True,
    )
    seconds: dict[str, list[float]] = {m: [] for m in todo}
    peaks: dict[str, list[float]] = {m: [] for m in todo}
    firsts: dict[str, list[float]] = {m: [] for m in todo}
    failed: dict[str, str] = {}
    timed_out: set[str] = set()
    for r in range(config["rounds"]):
        for method in _round_order(todo, r):
            if method in failed:
                continue
            try:
                got = run_child(method, config, args)
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
                if method not in PEERS:
                    raise
                # A failed peer leaves its column empty instead of losing the whole run.
                failed[method] = type(e).__name__
                if isinstance(e, subprocess.TimeoutExpired):
                    # Its time is at least the timeout: ratios against it are upper bounds.
                    failed[method] = f"> {e.timeout:g} (timed out)"
                    timed_out.add(method)
                print(f"  round {r + 1}/{config['rounds']} {method:<13} failed: {e}", flush=True)
                continue
            seconds[method].append(got["seconds"])
            peaks[method].append(got["extra_peak"])
            firsts[method].append(got["first_call"])
            print(
                f"  round {r + 1}/{config['rounds']} {method:<13} {got['seconds']:8.2f} s "
                f"{got['extra_peak'] / 2**20:9.1f} MiB  first call {got['first_call']:7.2f} s",
                flush=True,
            )
    # Best of the rounds: other processes only ever add time, so the minimum is the
    # least noisy estimate of each method's own cost.
    med_s = {m: min(ts) for m, ts in seconds.items() if ts}
    med_p = {m: statistics.median(ps) for m, ps in peaks.items() if ps}
    naive_note = ""
    if not run_naive:
        # F.cross_entropy keeps the logits and their log-softmax (each N x V x 4) alive at once.
        med_p["naive"] = 2 * n * v * 4
        naive_note = (
            f"  naive not run (needs ~{naive_bytes / 2**30:.1f} GiB > "
            f"--naive-limit-gib {args.naive_limit_gib}); its extra peak is the lower "
            f"bound 2 x N x V x 4 (fp32 logits and their log-softmax)"
        )
    print(
        f"\n  {'method':<14} {'fwd+bwd best (s)':>19} {'extra peak (MiB)':>17} "
        f"{'first call (s)':>15}"
    )
    for m in methods():
        t = f"{med_s[m]:.2f}" if m in med_s else failed.get(m, "not run")
        p = f"{med_p[m] / 2**20:.1f}" if m in med_p else "-"
        if m == "naive" and not run_naive:
            p = ">= " + p
        # The first call includes compilation for cce / ours_compiled (not in the step time).
        first = f"{statistics.median(firsts[m]):.2f}" if firsts.get(m) else "-"
        print(f"  {m:<14} {t:>19} {p:>17} {first:>15}")
    if naive_note:
        print(naive_note)
    ratios: dict[str, float] = {}
    bounds = {"ours / naive extra peak"} if not run_naive else set()
    for peer in timed_out & {"torch_native", "cce"}:
        ratios[f"ours / {peer} time"] = med_s["ours"] / args.peer_timeout
        bounds.add(f"ours / {peer} time")
    if "torch_native" in med_s:
        ratios["ours / torch_native time"] = med_s["ours"] / med_s["torch_native"]
        ratios["ours / torch_native extra peak"] = med_p["ours"] / max(med_p["torch_native"], 1)
    ratios["capture overhead (time)"] = med_s["ours_capture"] / med_s["ours"] - 1
    if config.get("pairs"):
        pairs = run_child("capture_pairs", config, args)
        ratios["capture overhead (time)"] = pairs["median_ratio"] - 1
        print(
            f"  capture overhead from {config['pairs']} adjacent pair(s) in one process: "
            f"median ours_capture / ours {pairs['median_ratio']:.3f} "
            f"(best: ours {pairs['ours']:.3f} s, ours_capture {pairs['ours_capture']:.3f} s)"
        )
    if "naive" in med_p:
        ratios["ours / naive extra peak"] = med_p["ours"] / max(med_p["naive"], 1)
    ratios["ours_compiled / ours time"] = med_s["ours_compiled"] / med_s["ours"]
    ratios["ours_compiled / ours extra peak"] = med_p["ours_compiled"] / max(med_p["ours"], 1)
    if "cce" in med_s:
        ratios["ours / cce time"] = med_s["ours"] / med_s["cce"]
        ratios["ours / cce extra peak"] = med_p["ours"] / max(med_p["cce"], 1)
    return ratios, bounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {', '.join(CONFIGS)}",
    )
    parser.add_argument("--tokens", type=int, help="N: run one custom configuration instead")
    parser.add_argument("--hidden", type=int, default=256, help="H (custom configuration)")
    parser.add_argument("--vocab", type=int, default=32000, help="V (custom configuration)")
    parser.add_argument("--rounds", type=int, help="rounds per configuration (overrides)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="ours: explicit chunk_size (default: the adaptive default)",
    )
    parser.add_argument(
        "--dtype",
        default="float32,bfloat16",
        help="comma-separated dtypes, each a column per configuration (float32, bfloat16)",
    )
    parser.add_argument(
        "--naive-limit-gib",
        type=float,
        default=2.0,
        help="skip naive full logits when it would need more memory than this",
    )
    parser.add_argument(
        "--child-timeout", type=float, default=1800, help="seconds for one step of ours"
    )
    parser.add_argument(
        "--peer-timeout",
        type=float,
        default=120,
        help="seconds for one step of a peer (naive, torch_native, cce); a peer that takes "
        "longer is reported as timed out, and ours / its time as an upper bound (<=)",
    )
    parser.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="adjacent ours / ours_capture pairs for the capture overhead (overrides)",
    )
    parser.add_argument(
        "--child",
        choices=(
            "naive",
            "torch_native",
            "cce",
            "ours",
            "ours_capture",
            "ours_compiled",
            "capture_pairs",
        ),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if not dtypes or bad:
        parser.error(
            f"--dtype takes a comma-separated subset of {', '.join(DTYPES)}; got {args.dtype!r}"
        )
    if args.child:
        args.torch_dtype = getattr(torch, dtypes[0])
        args.dtype = dtypes[0]
        args.tokens = args.tokens or CONFIGS["base"]["tokens"]
        child(args)
        return 0

    if args.tokens is not None:
        configs = {
            "custom": {
                "tokens": args.tokens,
                "hidden": args.hidden,
                "vocab": args.vocab,
                "rounds": 3,
                "warmup": 1,
                "pairs": 16,
            }
        }
    else:
        names = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = [c for c in names if c not in CONFIGS]
        if unknown:
            parser.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
        configs = {c: dict(CONFIGS[c]) for c in names}
    for config in configs.values():
        if args.rounds is not None:
            config["rounds"] = args.rounds
        if args.pairs is not None:
            config["pairs"] = args.pairs
    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} "
        f"methods={','.join(methods())}"
        + ("" if _has_cce() else " (cut-cross-entropy not installed)"),
        flush=True,
    )
    results: dict[str, dict[str, float]] = {}
    bounded: dict[str, set[str]] = {}
    for name, config in configs.items():
        for dtype in dtypes:
            column = f"{name}/{DTYPES[dtype]}"
            run = argparse.Namespace(
                **{**vars(args), "dtype": dtype, "torch_dtype": getattr(torch, dtype)}
            )
            results[column], bounded[column] = bench_config(column, config, run)

    names = list(results)
    print(f"\n{'ratio':<32} " + " ".join(f"{n:>12}" for n in names) + f" {'target':>9}  met")
    every = [r for r in TARGETS] + sorted(
        {r for res in results.values() for r in res} - set(TARGETS)
    )
    for ratio in every:
        cells, met = [], True
        for name in names:
            value = results[name].get(ratio)
            upper = ratio in bounded[name]
            text = "-" if value is None else ("<=" if upper else "") + format(value, ".3f")
            cells.append(f"{text:>12}")
            if value is not None and ratio in TARGETS:
                met = met and value <= TARGETS[ratio]
        target = f"<={TARGETS[ratio]:.3f}" if ratio in TARGETS else ""
        measured = any(results[name].get(ratio) is not None for name in names)
        verdict = ("yes" if met else "NO") if ratio in TARGETS and measured else ""
        print(f"{ratio:<32} " + " ".join(cells) + f" {target:>9}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
