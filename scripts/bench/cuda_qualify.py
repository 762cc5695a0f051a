"""CUDA qualification of the chunked loss: the device claims and a training-shape benchmark.

Three parts, each its own process so that ``scripts/device_check.sh`` can bound
each one with a timeout and keep what the others wrote:

    python scripts/bench/cuda_qualify.py claims --out DIR       # -> DIR/claims.json
    python scripts/bench/cuda_qualify.py bench --out DIR        # -> DIR/bench.json, DIR/bench.md
    python scripts/bench/cuda_qualify.py report --out DIR       # -> DIR/device_check.{json,md}

``claims`` checks, on the device (default ``cuda``), with ``chunk_cross_entropy``
at its default chunk size:

- *plain is deterministic*: two plain fwd+bwd with deterministic algorithms are
  bitwise equal (else the next claim would mean nothing);
- *observed == plain*: loss and every gradient are bitwise equal with and
  without ``capture()`` (deterministic algorithms on, the previous mode
  restored after); the observation equals ``per_token_cross_entropy`` bitwise;
- *no extra matmul*: the matmul-family aten ops (a ``TorchDispatchMode`` count)
  and, on CUDA, the GEMM kernels the profiler sees are the same with and
  without ``capture()``;
- *no host sync added by capture* (CUDA only): the synchronizing operations
  ``torch.cuda.set_sync_debug_mode("warn")`` reports are the same with and
  without ``capture()``; *ours syncs nothing*: there are none at all, and the
  observed step then also runs under ``set_sync_debug_mode("error")``.

``bench`` times fwd+bwd (median of round-robin repeats, CUDA events) and the
peak memory of one step (``torch.cuda.max_memory_allocated``, absolute and
above what was allocated before the step) for: naive full logits, torch's
``F.linear_cross_entropy`` (chunked options when this torch has them), Liger-Kernel's
fused linear cross-entropy and Cut Cross-Entropy (each when importable; both
need CUDA and triton), ours at the default and two other chunk sizes, ours
under ``capture()``, and ours as fp32-parameter mixed-precision training calls it
(fp32 copies of the inputs inside ``torch.autocast``; its ratio to ours is bounded
by 1.10: the products must not become fp32 GEMMs); every row also gets its achieved TFLOP/s against the
6 x N x H x V floor of the three GEMMs. Then the loss features against Liger:
softcap 30, label smoothing 0.1 and z-loss 1e-4, each as an ``ours[...]`` and a
``liger[...]`` row. Default shapes: bf16, N=16384, H=4096, V=128256 and V=32000.
On CPU (the dry run) the same code runs at the shapes given, with times from
``perf_counter`` and no memory figures (peers absent: their rows are skipped
with the reason).

Each shape records its *gates*: ours (default chunk) slower than the fastest
peer (torch-native, Liger, CCE) by more than 10%, or an extra peak above
torch-native's; on a device run a failed gate fails the verdict.

``report`` reads what the phases left (``phases.tsv`` written by
``device_check.sh``, the suite's ``suite/summary.json``, ``claims.json``,
``bench.json``) and writes the verdict; its exit status is 0 only when every
phase exited 0 and no claim failed. Benchmark targets are reported with their
ratios; of them only the gates above decide the verdict, and only on a device.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# The script belongs to a checkout: its `report` phase runs even where the install phase
# never ran (no time left in the budget), so the checkout's own package is importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import channel_loss as cl
from channel_loss.ops import CHUNK_MATH, chunk_math

IGNORE = -100
DEFAULT_SHAPES = ("16384x4096x128256", "16384x4096x32000")
DEFAULT_OTHER_CHUNKS = (2048, 8192)
#: cuBLAS needs this before its first handle for deterministic GEMMs.
CUBLAS_DETERMINISTIC = ":4096:8"
MATMUL_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "matmul",
        "linear",
        "baddbmm",
        "_addmm_activation",
        "_scaled_mm",
        "addmv",
        "mv",
    }
)
#: Kernel names of matrix products across cuBLAS / cuBLASLt / CUTLASS generations.
GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|gemv", re.IGNORECASE)
#: Ratio name -> (numerator method, denominator method, measure, bound); not gating.
TARGETS = {
    "ours / torch_native time": ("ours", "torch_native", "ms", 1.0),
    "ours / torch_native extra peak": ("ours", "torch_native", "extra_peak_bytes", 1.0),
    "ours / liger time": ("ours", "liger", "ms", None),
    "ours / liger extra peak": ("ours", "liger", "extra_peak_bytes", None),
    "ours / cce time": ("ours", "cce", "ms", None),
    "ours / cce extra peak": ("ours", "cce", "extra_peak_bytes", None),
    "ours / naive extra peak": ("ours", "naive", "extra_peak_bytes", 0.125),
    "ours_capture / ours time": ("ours_capture", "ours", "ms", 1.03),
    # fp32 parameters under autocast must run the products in the autocast dtype, not as
    # fp32 GEMMs (several times slower): the casts of the fp32 copies are the only extra.
    "ours[autocast] / ours time": ("ours[autocast]", "ours", "ms", 1.10),
    "compiled / eager chunk math time": (
        "ours[chunk_math=compiled]",
        "ours[chunk_math=eager]",
        "ms",
        None,
    ),
}


# --------------------------------------------------------------------------- shared


def environment(device: torch.device) -> dict[str, Any]:
    """What ran: interpreter, torch build, device name, and the chunk-size default."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "default_chunk_size": _default_chunk_size(),
        "has_linear_cross_entropy": hasattr(F, "linear_cross_entropy"),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def _default_chunk_size() -> Any:
    default = inspect.signature(cl.chunk_cross_entropy).parameters["chunk_size"].default
    return None if default is inspect.Parameter.empty else default


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"NxHxV"`` -> (N, H, V); raises ``ValueError`` naming the text otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"shape {text!r} must be NxHxV with positive integers, e.g. 16384x4096x128256"
        )
    n, h, v = map(int, parts)
    return n, h, v


def make_inputs(n: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Hidden ``[n, h]`` and weight ``[v, h]`` (requiring grad) and int64 targets with every
    17th ignored, generated on the device (a 128k x 4k weight made on the host is slow)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device, dtype=dtype).requires_grad_()
    weight = (
        torch.randn(v, h, generator=g, device=device, dtype=dtype).mul_(h**-0.5).requires_grad_()
    )
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    targets[::17] = IGNORE
    return hidden, weight, targets


def _chunk_kwargs(chunk_size: int | None) -> dict[str, int]:
    return {} if chunk_size is None else {"chunk_size": chunk_size}


def ours(hidden, weight, targets, chunk_size: int | None = None, observe: bool = False):
    """Our loss (fwd only); with ``observe`` inside a ``capture()`` scope, returning it too."""
    if not observe:
        return cl.chunk_cross_entropy(
            hidden, weight, shift_labels=targets, **_chunk_kwargs(chunk_size)
        ), None
    with cl.capture() as cap:
        loss = cl.chunk_cross_entropy(
            hidden, weight, shift_labels=targets, **_chunk_kwargs(chunk_size)
        )
    return loss, cap


def _ours_under(policy: str, hidden, weight, targets):
    """Our loss (fwd only) at the default chunk with the chunk math forced to ``policy``."""
    with chunk_math(policy):
        return cl.chunk_cross_entropy(hidden, weight, shift_labels=targets)


def _ours_under_autocast(hidden, weight, targets):
    """Our loss (fwd only) as mixed-precision training with fp32 parameters calls it: on
    fp32 copies of the inputs (differentiable, so gradients reach them) inside
    ``torch.autocast`` of the inputs' dtype (fp32 inputs: autocast's default dtype)."""
    amp = hidden.dtype if hidden.dtype != torch.float32 else None
    with torch.autocast(hidden.device.type, dtype=amp):
        return cl.chunk_cross_entropy(hidden.float(), weight.float(), shift_labels=targets)


def fwd_bwd(hidden, weight, targets, chunk_size: int | None = None, observe: bool = False):
    """One fwd+bwd of ours from cleared gradients: (detached loss, hidden grad, weight grad, capture)."""
    hidden.grad = None
    weight.grad = None
    loss, cap = ours(hidden, weight, targets, chunk_size, observe)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, cap


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic algorithms inside; the previous mode (and warn-only flag) restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


# --------------------------------------------------------------------------- claims


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside, by overload packet name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def matmuls(self) -> int:
        return sum(n for name, n in self.ops.items() if name in MATMUL_OPS)


def gpu_kernels(fn: Callable[[], Any], device: torch.device) -> Counter[str]:
    """Names (with counts) of the device kernels ``fn`` launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def sync_warnings(fn: Callable[[], Any]) -> list[str]:
    """The synchronizing CUDA operations ``fn`` performs, as ``set_sync_debug_mode("warn")`` reports them."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return [
        f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)
    ]


def _claim(name: str, status: str, detail: str, **data: Any) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "data": data}


def _guarded(name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one claim's check; an exception is the claim's result ("error"), not the run's end."""
    try:
        return check()
    except Exception as e:
        return _claim(name, "error", f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


def claim_bitwise(h, w, t, device) -> list[dict[str, Any]]:
    """Plain twice and observed once under deterministic algorithms; all compared bitwise."""
    out = []
    with deterministic():
        fwd_bwd(h, w, t)  # warm-up: allocator, cuBLAS handles
        plain = fwd_bwd(h, w, t)
        again = fwd_bwd(h, w, t)
        observed = fwd_bwd(h, w, t, observe=True)
    _sync(device)
    names = ("loss", "hidden.grad", "weight.grad")

    def differs(a, b) -> list[str]:
        return [n for n, x, y in zip(names, a[:3], b[:3], strict=True) if not torch.equal(x, y)]

    bad = differs(plain, again)
    out.append(
        _claim(
            "plain is deterministic (bitwise, two runs)",
            "failed" if bad else "held",
            f"differ: {', '.join(bad)}" if bad else "loss and grads equal",
        )
    )
    bad = differs(plain, observed)
    n_obs = len(observed[3].observations)
    if n_obs != 1:
        bad.append(f"{n_obs} observations, expected 1")
    out.append(
        _claim(
            "observed == plain (loss, grads, bitwise)",
            "failed" if bad else "held",
            f"differ: {', '.join(bad)}" if bad else "loss and grads equal",
            loss=float(plain[0]),
        )
    )
    return out


def claim_per_token(h, w, t, device, chunk_size: int) -> dict[str, Any]:
    with deterministic():
        # The training forward (gradients on), as a step would record it.
        _, cap = ours(h, w, t, chunk_size, observe=True)
        fallback = cl.per_token_cross_entropy(
            hidden_states=h, weight=w, shift_labels=t, chunk_size=chunk_size
        )
    same = torch.equal(cap.observations[0].token_losses, fallback)
    return _claim(
        f"observation == per_token_cross_entropy (bitwise, chunk_size={chunk_size})",
        "held" if same else "failed",
        "equal" if same else "token losses differ",
    )


def claim_no_extra_matmul(h, w, t, device) -> dict[str, Any]:
    counts = {}
    for observe in (False, True):
        with OpCounter() as counter:
            fwd_bwd(h, w, t, observe=observe)
        counts[observe] = counter.matmuls
    data: dict[str, Any] = {
        "aten_matmuls_plain": counts[False],
        "aten_matmuls_observed": counts[True],
    }
    problems = []
    if counts[False] != counts[True]:
        problems.append(f"aten matmul ops {counts[False]} plain vs {counts[True]} observed")
    if counts[False] == 0:
        problems.append("no aten matmul op seen in the plain step (counter broken?)")
    if device.type == "cuda":
        kernels = {
            obs: gpu_kernels(lambda o=obs: fwd_bwd(h, w, t, observe=o), device)
            for obs in (False, True)
        }
        gemm = {
            obs: sum(n for k, n in ks.items() if GEMM_KERNEL.search(k))
            for obs, ks in kernels.items()
        }
        data.update(
            gemm_kernels_plain=gemm[False],
            gemm_kernels_observed=gemm[True],
            kernels_plain=sum(kernels[False].values()),
            kernels_observed=sum(kernels[True].values()),
            top_kernels_observed=kernels[True].most_common(25),
        )
        if gemm[False] != gemm[True]:
            problems.append(f"GEMM kernels {gemm[False]} plain vs {gemm[True]} observed")
        if gemm[False] == 0:
            problems.append(
                "no kernel name matched GEMM_KERNEL in the plain step (see top_kernels_observed)"
            )
        detail = (
            f"aten matmuls {counts[False]}={counts[True]}, GEMM kernels {gemm[False]}={gemm[True]}"
        )
    else:
        detail = f"aten matmuls {counts[False]}={counts[True]} (no profiler kernel count off CUDA)"
    return _claim(
        "no extra matmul under capture",
        "failed" if problems else "held",
        "; ".join(problems) or detail,
        **data,
    )


def claim_no_sync(h, w, t, device) -> list[dict[str, Any]]:
    if device.type != "cuda":
        reason = f"{device.type}: no host-device synchronization to detect"
        return [
            _claim("capture adds no host sync", "skipped", reason),
            _claim("ours fwd+bwd makes no host sync", "skipped", reason),
        ]
    fwd_bwd(h, w, t, observe=True)  # warm-up: lazy initialisation may sync once
    _sync(device)
    plain = sync_warnings(lambda: fwd_bwd(h, w, t))
    observed = sync_warnings(lambda: fwd_bwd(h, w, t, observe=True))
    _sync(device)
    out = [
        _claim(
            "capture adds no host sync",
            "held" if len(observed) == len(plain) else "failed",
            f"{len(plain)} sync(s) plain, {len(observed)} observed",
            plain=plain,
            observed=observed,
        )
    ]
    if plain or observed:
        out.append(
            _claim(
                "ours fwd+bwd makes no host sync",
                "failed",
                f"{len(plain)} sync(s) plain; first: {(plain or observed)[0]}",
            )
        )
        return out
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(h, w, t, observe=True)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    _sync(device)
    out.append(
        _claim(
            "ours fwd+bwd makes no host sync",
            "held",
            'none under set_sync_debug_mode("warn"); observed step clean under "error"',
        )
    )
    return out


def run_claims(args: argparse.Namespace) -> int:
    # Before the first cuBLAS handle; the caller's setting wins.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    device = torch.device(args.device)
    n, hd, v = parse_shape(args.shape)
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "env": environment(device),
        "shape": {"N": n, "H": hd, "V": v, "dtype": args.dtype},
        "claims": [],
    }
    h, w, t = make_inputs(n, hd, v, dtype, device)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("observed == plain (loss, grads, bitwise)", lambda: claim_bitwise(h, w, t, device)),
        (
            "observation == per_token_cross_entropy",
            lambda: claim_per_token(h, w, t, device, args.chunk_size),
        ),
        ("no extra matmul under capture", lambda: claim_no_extra_matmul(h, w, t, device)),
        ("capture adds no host sync", lambda: claim_no_sync(h, w, t, device)),
    ]
    for name, check in steps:
        t0 = time.perf_counter()
        result = _guarded(name, check)
        for c in result if isinstance(result, list) else [result]:
            c["seconds"] = round(time.perf_counter() - t0, 3)
            doc["claims"].append(c)
            print(f"claim: {c['status']:<7} {c['name']}: {c['detail']}", flush=True)
        _write_json(out / "claims.json", doc)  # after each claim: a timeout keeps what was found
    bad = [c for c in doc["claims"] if c["status"] in ("failed", "error")]
    return 1 if bad else 0


# --------------------------------------------------------------------------- benchmark


def _torch_native_fn() -> tuple[Callable | None, str]:
    if not hasattr(F, "linear_cross_entropy"):
        return None, f"torch {torch.__version__} has no F.linear_cross_entropy"
    options_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options_cls is None:
        return (
            lambda h, w, t: F.linear_cross_entropy(h, w, t, ignore_index=IGNORE)
        ), "no LinearCrossEntropyOptions in this torch: its reference (unchunked) path"
    return (
        lambda h, w, t: F.linear_cross_entropy(h, w, t, ignore_index=IGNORE, options=options_cls())
    ), ""


#: Loss features benchmarked against Liger: row suffix -> (our keywords, Liger's keywords).
FEATURES = {
    "softcap=30": ({"softcap": 30.0}, {"softcap": 30.0}),
    "label_smoothing=0.1": ({"label_smoothing": 0.1}, {"label_smoothing": 0.1}),
    "z_loss=1e-4": ({"lse_square_scale": 1e-4}, {"lse_square_scale": 1e-4}),
}
#: Peers whose time ours must be within ``PEER_SLACK`` of; memory is gated against torch-native.
PEERS = ("torch_native", "liger", "cce")
PEER_SLACK = 1.10


def _liger_fn(device: torch.device, **features: Any) -> tuple[Callable | None, str]:
    if device.type != "cuda":
        return None, "Liger-Kernel runs triton kernels: CUDA only"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as e:  # not carried, or its triton disagrees with the image's
        return None, f"liger_kernel not importable: {type(e).__name__}: {e}"
    return (
        lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE, **features)
    ), ""


def _cce_fn(device: torch.device) -> tuple[Callable | None, str]:
    if device.type != "cuda":
        return None, "Cut Cross-Entropy's default kernels are triton: CUDA only"
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as e:
        return None, f"cut_cross_entropy not importable: {type(e).__name__}: {e}"
    return (lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=IGNORE)), ""


def methods(device: torch.device, other_chunks: tuple[int, ...]) -> list[dict[str, Any]]:
    """The benchmarked methods: name, chunk size, loss function (None when unavailable) and why."""
    native, native_note = _torch_native_fn()
    liger, liger_note = _liger_fn(device)
    cce, cce_note = _cce_fn(device)
    rows = [
        {
            "method": "naive",
            "fn": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, ignore_index=IGNORE),
        },
        {"method": "torch_native", "fn": native, "note": native_note},
        {"method": "liger", "fn": liger, "note": liger_note},
        {"method": "cce", "fn": cce, "note": cce_note},
        {
            "method": "ours",
            "chunk_size": _default_chunk_size(),
            "fn": lambda h, w, t: ours(h, w, t)[0],
            "note": "default chunk size",
        },
    ]
    for c in other_chunks:
        rows.append(
            {
                "method": f"ours[chunk={c}]",
                "chunk_size": c,
                "fn": lambda h, w, t, c=c: ours(h, w, t, c)[0],
            }
        )
    # Both chunk-math paths, so a device run shows which is faster there (the
    # "auto" default compiles on CUDA); the CPU dry run skips compiling.
    for policy in CHUNK_MATH[1:]:
        skip = policy == "compiled" and device.type != "cuda"
        rows.append(
            {
                "method": f"ours[chunk_math={policy}]",
                "chunk_size": _default_chunk_size(),
                "fn": None if skip else lambda h, w, t, p=policy: _ours_under(p, h, w, t),
                "note": "CPU dry run: compiling is measured by scripts/bench/chunk_loss.py"
                if skip
                else "",
            }
        )
    rows.append(
        {
            "method": "ours_capture",
            "chunk_size": _default_chunk_size(),
            "fn": lambda h, w, t: ours(h, w, t, observe=True)[0],
            "note": "default chunk size",
        }
    )
    rows.append(
        {
            "method": "ours[autocast]",
            "chunk_size": _default_chunk_size(),
            "fn": _ours_under_autocast,
            "note": "fp32 copies of the inputs under torch.autocast(model dtype)",
        }
    )
    for name, (our_kw, liger_kw) in FEATURES.items():
        rows.append(
            {
                "method": f"ours[{name}]",
                "chunk_size": _default_chunk_size(),
                "fn": lambda h, w, t, kw=our_kw: cl.chunk_cross_entropy(h, w, shift_labels=t, **kw),
            }
        )
        fn, note = _liger_fn(device, **liger_kw)
        rows.append({"method": f"liger[{name}]", "fn": fn, "note": note})
    return rows


def gates(by: dict[str, dict[str, Any]]) -> list[str]:
    """The failed gates of one shape: ours slower than the fastest peer by more than
    ``PEER_SLACK``, or more extra memory than torch-native (missing figures: no gate)."""
    failed = []
    mine = by.get("ours", {})
    peers = {p: by[p]["ms"] for p in PEERS if by.get(p, {}).get("ms") is not None}
    if mine.get("ms") is not None and peers:
        fastest = min(peers, key=peers.get)
        if mine["ms"] > PEER_SLACK * peers[fastest]:
            failed.append(
                f"ours {mine['ms']:.2f} ms > {PEER_SLACK:.2f} x {fastest} {peers[fastest]:.2f} ms"
            )
    native = by.get("torch_native", {}).get("extra_peak_bytes")
    if (
        mine.get("extra_peak_bytes") is not None
        and native is not None
        and mine["extra_peak_bytes"] > native
    ):
        failed.append(
            f"ours extra peak {_mib(mine['extra_peak_bytes'])} MiB > torch_native "
            f"{_mib(native)} MiB"
        )
    for name in FEATURES:
        a, b = by.get(f"ours[{name}]", {}).get("ms"), by.get(f"liger[{name}]", {}).get("ms")
        if a is not None and b is not None and a > PEER_SLACK * b:
            failed.append(f"ours[{name}] {a:.2f} ms > {PEER_SLACK:.2f} x liger[{name}] {b:.2f} ms")
    return failed


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Milliseconds of ``fn`` on the device (CUDA events) or the host clock."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def bench_shape(
    n: int,
    hd: int,
    v: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    other_chunks: tuple[int, ...],
) -> dict[str, Any]:
    """One shape: per-method median fwd+bwd ms and peak memory, and the ratios."""
    h, w, t = make_inputs(n, hd, v, dtype, device)
    timer = _Timer(device)
    rows = methods(device, other_chunks)

    def step(fn):
        h.grad = None
        w.grad = None
        fn(h, w, t).backward()

    for r in rows:
        r.update(status="ok" if r["fn"] is not None else "skipped", times=[])
        if r["fn"] is None:
            continue
        try:
            step(r["fn"])  # warm-up (Liger compiles here)
            _sync(device)
            if device.type == "cuda":
                h.grad = None
                w.grad = None
                gc.collect()
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                step(r["fn"])
                torch.cuda.synchronize(device)
                r["peak_bytes"] = torch.cuda.max_memory_allocated(device)
                r["extra_peak_bytes"] = r["peak_bytes"] - base
        except Exception as e:
            r.update(status="error", note=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    live = [r for r in rows if r["status"] == "ok"]
    for _ in range(repeats):  # round robin: drift hits every method alike
        for r in live:
            try:
                r["times"].append(timer(lambda r=r: step(r["fn"])))
            except Exception as e:
                r.update(status="error", note=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        live = [r for r in live if r["status"] == "ok"]
    floor_flop = 6 * n * hd * v  # the three GEMMs: logits, hidden and weight gradients
    for r in rows:
        r.pop("fn")
        if r["times"]:
            r["ms"] = statistics.median(r["times"])
            r["tflops"] = floor_flop / (r["ms"] / 1e3) / 1e12
    by = {r["method"]: r for r in rows}
    ratios = {}
    for name, (num, den, key, bound) in TARGETS.items():
        a, b = by.get(num, {}).get(key), by.get(den, {}).get(key)
        value = a / b if a is not None and b else None
        ratios[name] = {
            "value": value,
            "bound": bound,
            "met": None if value is None or bound is None else value <= bound,
        }
    for name in FEATURES:
        a, b = by.get(f"ours[{name}]", {}).get("ms"), by.get(f"liger[{name}]", {}).get("ms")
        ratios[f"ours / liger time [{name}]"] = {
            "value": a / b if a is not None and b else None,
            "bound": PEER_SLACK,
            "met": None if a is None or not b else a / b <= PEER_SLACK,
        }
    return {
        "shape": {"N": n, "H": hd, "V": v},
        "rows": rows,
        "ratios": ratios,
        "gates_failed": gates(by),
    }


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def bench_markdown(doc: dict[str, Any]) -> str:
    """The benchmark as markdown tables, one per shape."""
    env = doc["env"]
    lines = [
        f"### chunked-loss benchmark ({env['device']}"
        + (f", {env['device_name']}" if "device_name" in env else "")
        + f", torch {env.get('torch')}, {doc['dtype']}, median of {doc['repeats']})",
        "",
    ]
    for s in doc["shapes"]:
        sh = s["shape"]
        lines += [
            f"**N={sh['N']} H={sh['H']} V={sh['V']}**",
            "",
            "| method | chunk | fwd+bwd ms | TFLOP/s (6NHV) | peak MiB | extra peak MiB | note |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in s["rows"]:
            ms = f"{r['ms']:.2f}" if "ms" in r else r["status"]
            tflops = f"{r['tflops']:.3g}" if "tflops" in r else "-"
            lines.append(
                f"| {r['method']} | {r.get('chunk_size') or '-'} | {ms} | {tflops} | {_mib(r.get('peak_bytes'))} "
                f"| {_mib(r.get('extra_peak_bytes'))} | {r.get('note', '')} |"
            )
        lines += ["", "| ratio | measured | target | met |", "|---|---:|---:|---|"]
        for name, q in s["ratios"].items():
            value = "-" if q["value"] is None else f"{q['value']:.3f}"
            bound = "-" if q["bound"] is None else f"<= {q['bound']:.3f}"
            met = {True: "yes", False: "NO", None: "-"}[q["met"]]
            lines.append(f"| {name} | {value} | {bound} | {met} |")
        failed = s.get("gates_failed", [])
        lines += ["", "gates: " + ("; ".join(failed) if failed else "all held"), ""]
    return "\n".join(lines) + "\n"


def run_bench(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = [parse_shape(s) for s in (args.shape or DEFAULT_SHAPES)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "env": environment(device),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "shapes": [],
    }
    print(f"bench: {doc['env']}", flush=True)
    for n, hd, v in shapes:
        t0 = time.perf_counter()
        doc["shapes"].append(bench_shape(n, hd, v, dtype, device, args.repeats, tuple(args.chunks)))
        gc.collect()  # this shape's inputs go before the next shape's arrive
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"bench: N={n} H={hd} V={v} done in {time.perf_counter() - t0:.1f}s", flush=True)
        # After each shape: a timeout keeps the shapes already measured.
        _write_json(out / "bench.json", doc)
        (out / "bench.md").write_text(bench_markdown(doc), encoding="utf-8")
    print(bench_markdown(doc), flush=True)
    ours_broken = [
        f"{s['shape']}: {r['method']} ({r.get('note')})"
        for s in doc["shapes"]
        for r in s["rows"]
        if r["method"].startswith("ours") and r["status"] not in ("ok", "skipped")
    ]
    for line in ours_broken:
        print(f"bench: ours failed at {line}", file=sys.stderr)
    return 1 if ours_broken else 0


# --------------------------------------------------------------------------- report


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


#: device_check.sh runs no phase with less time than this left (and records 124).
MIN_PHASE_S = 5


def read_phases(path: Path) -> list[dict[str, Any]]:
    """``phases.tsv`` lines ``name<TAB>exit status<TAB>seconds<TAB>limit seconds``."""
    phases = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[1].lstrip("-").isdigit():
                phases.append(
                    {
                        "phase": parts[0],
                        "rc": int(parts[1]),
                        "seconds": float(parts[2]),
                        "limit_s": float(parts[3]),
                    }
                )
    return phases


def verdict(out: Path) -> dict[str, Any]:
    """Everything the phases left in ``out``, and whether every phase and claim held."""
    phases = read_phases(out / "phases.tsv")
    suite = _read_json(out / "suite" / "summary.json")
    claims = _read_json(out / "claims.json")
    bench = _read_json(out / "bench.json")
    reasons = []
    if not phases:
        reasons.append("no phase recorded (phases.tsv missing)")
    for p in phases:
        if p["rc"] in (124, 137) and p["limit_s"] < MIN_PHASE_S:
            reasons.append(f"phase {p['phase']} not run: no time left in the budget")
        elif p["rc"] in (124, 137):
            reasons.append(f"phase {p['phase']} timed out after {p['limit_s']:.0f}s")
        elif p["rc"] != 0:
            reasons.append(f"phase {p['phase']} exited {p['rc']}")
    if suite is None and not (out / "suite" / "summary.md").is_file():
        reasons.append("suite summary missing")
    if claims is None:
        reasons.append("claims.json missing")
    else:
        reasons += [
            f"claim {c['status']}: {c['name']}: {c['detail']}"
            for c in claims["claims"]
            if c["status"] in ("failed", "error")
        ]
    if bench is None:
        reasons.append("bench.json missing")
    elif bench.get("env", {}).get("device", "cpu") != "cpu":
        # Times on the CPU dry run say nothing about the device: gates apply to device runs.
        for shape in bench.get("shapes", []):
            sh = shape["shape"]
            reasons += [
                f"bench gate N={sh['N']} H={sh['H']} V={sh['V']}: {g}"
                for g in shape.get("gates_failed", [])
            ]
    return {
        "passed": not reasons,
        "reasons": reasons,
        "phases": phases,
        "suite": None if suite is None else suite.get("total"),
        "claims": claims,
        "bench": bench,
    }


def report_markdown(v: dict[str, Any], out: Path) -> str:
    lines = ["# device check: " + ("PASSED" if v["passed"] else "FAILED"), ""]
    lines += [f"- {r}" for r in v["reasons"]]
    env = (v["claims"] or v["bench"] or {}).get("env")
    if env:
        lines += ["", "```", json.dumps(env, indent=1), "```"]
    lines += ["", "| phase | exit | seconds | limit |", "|---|---:|---:|---:|"]
    lines += [
        f"| {p['phase']} | {p['rc']} | {p['seconds']:.0f} | {p['limit_s']:.0f} |"
        for p in v["phases"]
    ]
    summary = out / "suite" / "summary.md"
    if summary.is_file():
        lines += ["", summary.read_text(encoding="utf-8").strip()]
    if v["claims"]:
        lines += ["", "### claims", "", "| claim | status | detail |", "|---|---|---|"]
        lines += [f"| {c['name']} | {c['status']} | {c['detail']} |" for c in v["claims"]["claims"]]
    if v["bench"]:
        lines += ["", bench_markdown(v["bench"]).strip()]
    return "\n".join(lines) + "\n"


def run_report(args: argparse.Namespace) -> int:
    out = Path(args.out)
    v = verdict(out)
    _write_json(out / "device_check.json", v)
    text = report_markdown(v, out)
    (out / "device_check.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    return 0 if v["passed"] else 1


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    claims = sub.add_parser("claims", help="the device claims -> OUT/claims.json")
    bench = sub.add_parser("bench", help="the benchmark -> OUT/bench.json, OUT/bench.md")
    report = sub.add_parser(
        "report", help="the verdict over every phase -> OUT/device_check.{json,md}"
    )
    for p in (claims, bench, report):
        p.add_argument("--out", required=True, help="output folder")
    for p in (claims, bench):
        p.add_argument("--device", default="cuda")
        p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    claims.add_argument(
        "--shape", default="4096x4096x32000", help="NxHxV (default 4096x4096x32000)"
    )
    claims.add_argument(
        "--chunk-size",
        type=int,
        default=1024,
        help="explicit chunk size of the per-token comparison",
    )
    bench.add_argument(
        "--shape",
        action="append",
        help=f"NxHxV, repeatable (default: {' and '.join(DEFAULT_SHAPES)})",
    )
    bench.add_argument(
        "--chunks",
        type=int,
        nargs="*",
        default=list(DEFAULT_OTHER_CHUNKS),
        help="chunk sizes besides the default (default: 2048 8192)",
    )
    bench.add_argument("--repeats", type=int, default=10, help="timed rounds per method")
    args = parser.parse_args(argv)
    if args.part != "report":
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            print(
                f"cuda_qualify: --device {args.device} but torch {torch.__version__} sees no CUDA device",
                file=sys.stderr,
            )
            return 2
        try:
            parse_shape(args.shape) if args.part == "claims" else [
                parse_shape(s) for s in args.shape or ()
            ]
        except ValueError as e:
            parser.error(str(e))
    return {"claims": run_claims, "bench": run_bench, "report": run_report}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
