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

    base    N=4096  H=256 V=32000   2 rounds, 10 interleaved
    vocab   N=4096  H=256 V=128256  1 round,   3 interleaved  (large vocabulary)
    tokens  N=32768 H=256 V=32000   1 round,   3 interleaved  (many tokens)

A round runs every method once, each in a fresh subprocess (after a warm-up
step on a tiny problem, and one at full size in ``base``; methods that
compile, ``cce`` and ``ours_compiled``, always get a full-size warm-up step
and report it as "first call": their compile time, kept out of the step
time), which reports the step's time and its extra peak RSS (the kernel's
high-water mark, reset just before the step, above the RSS before it; inputs
and their ``.grad`` already exist). Rounds visit the methods round-robin, odd
rounds backwards. The separate processes give the memory columns (median of
the rounds), the first call, and which peers time out.

The time ratios against torch_native, cce and ours_capture (the capture
overhead) come from one more process, the interleaved one: in each of its
rounds every such peer steps right next to a step of ours (the peers' order
rotating, ours first in even rounds and second in odd ones), each timed step
right after an untimed step of the same method, and a ratio is the median
over the pairs of each pair's time ratio. On this shared machine
one process's best time for the same step differed from another's by up to
20 % (base fp32, ours, 8 steps each: 2.03 against 2.44 s); interleaved, both
sides of a ratio are drawn from the same stretch of time, and a burst of
noise that hits one step moves one pair's ratio, not the median (the ratio
of best times did not hold that: one step of ours 11 % faster than any
other once put the capture overhead at +0.122 from 4 pairs whose median
put it at -0.002). A step's time also depends on the step before it (base
fp32: cce after ours took 3.09 s, cce after cce 2.63 s; ours after cce 2.62 s,
after ours 2.50 s), so a timed step always follows one of its own method,
the steady state of a loop that repeats one loss. The separate processes
fix glibc's mmap threshold, so that RSS follows live memory; the interleaved
one keeps glibc's defaults, as a training process does (with the fixed
threshold every large block is a fresh mapping whose pages fault in on first
touch: at base fp32, a step of ours taking a new logits block per chunk,
from oneDNN's linear, against one taking MKL's GEMM into a reused block was
0.96x under the fixed threshold and 0.78x under the defaults). Every pair's times are
printed. ``ours_compiled / ours`` (no
target) is from the separate processes' best times. A peer whose
step takes longer than ``--peer-timeout`` (120 s; naive's and cce's bf16 on
a CPU without bf16 matrix units do) is reported as timed out, left out of
the interleaved rounds, and ours / its time given as the upper bound ours /
timeout (marked <=). Naive full
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
from channel_loss.ops import chunk_math, cpu_has_bf16_gemm, default_gemm_policy

CONFIGS = {
    "base": {"tokens": 4096, "hidden": 256, "vocab": 32000, "rounds": 2, "warmup": 1, "pairs": 10},
    "vocab": {"tokens": 4096, "hidden": 256, "vocab": 128256, "rounds": 1, "warmup": 0, "pairs": 3},
    "tokens": {
        "tokens": 32768,
        "hidden": 256,
        "vocab": 32000,
        "rounds": 1,
        "warmup": 0,
        "pairs": 3,
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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip().replace(" ", "_")
    except OSError:
        pass
    return "unknown"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _pair_order(peers: list[str], k: int) -> list[tuple[str, str]]:
    """The adjacent pairs of round ``k`` of the interleaved child: every peer once,
    next to a step of ``ours``. The peers' order rotates from round to round, and
    ``ours`` goes first in every pair of even rounds, second in odd ones, so over
    an even number of rounds each peer goes first in half of its pairs."""
    j0 = k % max(len(peers), 1)
    return [("ours", p) if k % 2 == 0 else (p, "ours") for p in peers[j0:] + peers[:j0]]


def interleaved(args: argparse.Namespace, hidden, weight, targets) -> None:
    """Child mode: ``--pairs`` rounds, each stepping every method in ``--peers`` right
    next to a step of ``ours``, all in this one process (see ``_pair_order``); each
    timed step follows an untimed step of its own method.

    Prints, as JSON, for each peer the times of its steps and of the steps of
    ``ours`` it was paired with, pair by pair. Adjacent steps in one process
    share the machine's state of the moment, which separate processes do not.
    """
    peers = [p for p in args.peers.split(",") if p]
    for method in ["ours", *peers]:
        _tiny_warmup(method, args)
        for _ in range(max(args.warmup, 1 if method in COMPILING else 0)):
            step(method, hidden, weight, targets, args.chunk_size)
    took: dict[str, dict[str, list[float]]] = {p: {"ours": [], p: []} for p in peers}
    for k in range(args.pairs):
        for pair in _pair_order(peers, k):
            peer = pair[0] if pair[1] == "ours" else pair[1]
            for method in pair:
                # Untimed: a step's time depends on the step before it (module docstring).
                step(method, hidden, weight, targets, args.chunk_size)
                t0 = time.perf_counter()
                step(method, hidden, weight, targets, args.chunk_size)
                took[peer][method].append(time.perf_counter() - t0)
    print(json.dumps(took))


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
    if args.child == "interleaved":
        interleaved(args, hidden, weight, targets)
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


def run_child(
    method: str, config: dict, args: argparse.Namespace, peers: tuple[str, ...] = ()
) -> dict:
    """One measured step of ``method`` in a fresh subprocess (see ``child``), within
    ``--child-timeout`` for ours and ``--peer-timeout`` for every other method; or,
    for ``method="interleaved"``, the interleaved rounds of ours beside ``peers``
    (see ``interleaved``), within ``--child-timeout``."""
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
        "--peers",
        ",".join(peers),
    ]
    if args.chunk_size is not None:
        argv += ["--chunk-size", str(args.chunk_size)]
    # A fixed mmap threshold makes glibc hand large blocks back on free, so RSS
    # follows live memory instead of the allocator's high-water mark. It also makes
    # every large block a fresh mapping whose pages fault in on first touch, which a
    # training process under glibc's defaults does not pay for blocks up to 32 MiB
    # (they come back from the heap): the interleaved process, which measures only
    # time, runs with the defaults.
    env = dict(os.environ)
    if method != "interleaved":
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
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
    print(f"\n  separate processes, best time / median extra peak of {config['rounds']} round(s):")
    print(
        f"  {'method':<14} {'fwd+bwd best (s)':>19} {'extra peak (MiB)':>17} {'first call (s)':>15}"
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
    # Time ratios of the separate processes; the interleaved rounds replace them below.
    for peer in ("torch_native", "cce"):
        if peer in med_s:
            ratios[f"ours / {peer} time"] = med_s["ours"] / med_s[peer]
            ratios[f"ours / {peer} extra peak"] = med_p["ours"] / max(med_p[peer], 1)
    ratios["capture overhead (time)"] = med_s["ours_capture"] / med_s["ours"] - 1
    if "naive" in med_p:
        ratios["ours / naive extra peak"] = med_p["ours"] / max(med_p["naive"], 1)
    ratios["ours_compiled / ours time"] = med_s["ours_compiled"] / med_s["ours"]
    ratios["ours_compiled / ours extra peak"] = med_p["ours_compiled"] / max(med_p["ours"], 1)
    peers = tuple(p for p in ("torch_native", "cce", "ours_capture") if p in med_s)
    if config.get("pairs") and peers:
        got = run_child("interleaved", config, args, peers)
        print(
            f"\n  interleaved in one process, {config['pairs']} round(s), each peer's steps "
            f"beside as many of ours (s):"
        )
        for peer, ts in got.items():
            # Pair by pair: ours / peer for the peers, ours_capture / ours for the
            # capture overhead.
            num, den = (peer, "ours") if peer == "ours_capture" else ("ours", peer)
            over = [a / b for a, b in zip(ts[num], ts[den], strict=True)]
            name = f"{num} / {den}"
            print(f"  {peer:<14} {' '.join(f'{t:6.2f}' for t in ts[peer])}")
            print(f"  {'beside ours':<14} {' '.join(f'{t:6.2f}' for t in ts['ours'])}")
            print(
                f"  {'':<14} {name}: median of the pairs {statistics.median(over):.3f}, "
                f"pairs {min(over):.3f} to {max(over):.3f}"
            )
            if peer == "ours_capture":
                ratios["capture overhead (time)"] = statistics.median(over) - 1
            else:
                ratios[f"ours / {peer} time"] = statistics.median(over)
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
        help="rounds of the interleaved child, whose adjacent pairs give every time ratio "
        "against torch_native, cce and ours_capture (overrides; 0: the separate "
        "processes' best times give them)",
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
            "interleaved",
        ),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--peers", default="", help=argparse.SUPPRESS)
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
                "pairs": 10,
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
    # What decides our CPU GEMM policy, and so the bf16 columns: bf16 units or not.
    policies = {d: default_gemm_policy("cpu", getattr(torch, d)) for d in dtypes}
    print(
        f"cpu={_cpu_model()} capability={torch.backends.cpu.get_cpu_capability()} "
        f"bf16_units={cpu_has_bf16_gemm()} gemm_policy={policies}",
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
