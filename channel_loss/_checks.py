"""Argument checking and resolution for the chunked cross-entropy ops.

Targets, the autocast view of the operands, shapes and dtypes, the logits
bias, DTensor refusal, the default chunk size and the ``num_items_in_batch``
divisor: everything ``channel_loss.ops`` checks before a chunk is formed.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from channel_loss._features import _Features, _resolve_features
from channel_loss.validation import check_int, is_real


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _require(ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless the 0-d bool ``ok`` holds, without a host sync.

    On the CPU the check is immediate. On an accelerator reading ``ok`` would
    stall the host until the device catches up, so the check is queued on the
    device instead (``torch._assert_async``): a failure surfaces as a
    device-side assertion carrying ``message`` at the next synchronisation.
    """
    if ok.device.type == "cpu":
        if not bool(ok):
            raise ValueError(message)
    elif ok.device.type != "meta":
        torch._assert_async(ok, message)


def resolve_targets(
    lead: torch.Size,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    ignore_index: int,
    vocab: int,
    what: str,
) -> torch.Tensor:
    """The int64 targets every op here scores against, with leading shape ``lead``.

    ``shift_labels`` as given (``labels`` is then not read, as in HF's
    causal-LM loss), else ``labels`` shifted left by one with ``ignore_index``
    appended (the HF convention). Raises ``ValueError`` unless one is given,
    integer-typed, shaped ``lead`` (the leading shape of ``what``), with every
    target in ``[0, vocab)`` or ``ignore_index``. On the
    CPU the error names the first bad target; on an accelerator the range
    check costs no host sync: it runs on the device and fails at the next
    synchronisation (see ``_require``). ``ignore_index`` must be an integer
    (a bool is not: ``True`` would silently ignore class 1).
    """
    check_int(ignore_index, "ignore_index", minimum=-(2**63), maximum=2**63 - 1)  # int64 targets
    if labels is None and shift_labels is None:
        raise ValueError("pass labels or shift_labels; got neither")
    if shift_labels is not None:
        labels = None
    name, given = ("labels", labels) if labels is not None else ("shift_labels", shift_labels)
    if not isinstance(given, torch.Tensor):
        raise ValueError(f"{name} must be a tensor; got {type(given).__name__}")
    if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor; got dtype {given.dtype}")
    if given.shape != lead:
        raise ValueError(
            f"{name} shape {_shape(given)} must equal the leading shape of {what} {tuple(lead)}"
        )
    if given.numel() == 0:
        return given.to(torch.int64)
    if labels is not None:
        targets = F.pad(labels.to(torch.int64), (0, 1), value=ignore_index)[..., 1:]
    else:
        targets = shift_labels.to(torch.int64)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if targets.device.type == "cpu":
        if bool(bad.any()):
            first = targets[bad][0].item()
            raise ValueError(
                f"{name} holds target {first} outside [0, {vocab}) that is not "
                f"ignore_index={ignore_index}"
            )
    else:
        _require(
            ~bad.any(),
            f"{name} holds a target outside [0, {vocab}) that is not ignore_index={ignore_index}",
        )
    return targets


#: The dtypes autocast casts to its lower precision for a matmul (never float64).
_AUTOCAST_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives a matmul on ``device`` here, or None where it is off."""
    kind = device.type
    try:
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    except (AttributeError, TypeError, RuntimeError):  # a torch before the device_type forms
        if kind == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        if kind == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None


def _as_autocast_would(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bias_weight: torch.Tensor | None,
) -> tuple[tuple, contextlib.AbstractContextManager]:
    """The operands of the LM-head products as autocast would hand them to ``F.linear``
    (cast, differentiably, to its dtype where it is on for their device; float64 kept),
    and a context that turns autocast off for the op itself, so that none of its own
    matmuls is cast again (the op forms them under its dtype policy). An additive
    ``logits_bias`` (no ``bias_weight``) is not an operand: it is added as given."""
    amp = _autocast_dtype(hidden.device) if isinstance(hidden, torch.Tensor) else None
    if amp is None:
        return (hidden, weight, bias, bias_weight), contextlib.nullcontext()

    def cast(t):
        castable = isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CASTABLE
        return t.to(amp) if castable and t.dtype != amp else t

    operands = (cast(hidden), cast(weight))
    operands += (cast(bias), cast(bias_weight)) if bias_weight is not None else (bias, None)
    return operands, torch.autocast(hidden.device.type, enabled=False)


def _check_hidden_weight(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(
            "hidden_states must be a [B, T, H] or [T, H] tensor; got "
            + (_shape(hidden) if isinstance(hidden, torch.Tensor) else type(hidden).__name__)
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            "weight must be a [V, H] tensor; got "
            + (_shape(weight) if isinstance(weight, torch.Tensor) else type(weight).__name__)
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {_shape(weight)} does not match hidden_states width: "
            f"hidden_states {_shape(hidden)} has H={hidden.shape[-1]}, weight has "
            f"H={weight.shape[1]}"
        )
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        amp = _autocast_dtype(hidden.device)
        under = (
            ""
            if amp is None
            else f" (under torch.autocast({hidden.device.type!r}, {amp}), which casts float32 / "
            f"float16 / bfloat16 operands to {amp} and leaves float64 as it is)"
        )
        raise ValueError(
            f"hidden_states and weight must share one floating dtype; got {hidden.dtype} "
            f"and {weight.dtype}{under}"
        )


def _check_broadcast_rows(bias: torch.Tensor, name: str, lead: torch.Size, width: int) -> None:
    """``bias`` must broadcast to ``lead + (width,)`` without adding leading dims beyond it."""
    target = (*lead, width)
    if bias.dim() < 1 or bias.dim() > len(target) or bias.shape[-1] != width:
        raise ValueError(f"{name} shape {_shape(bias)} cannot broadcast to {target}")
    for have, want in zip(reversed(bias.shape[:-1]), reversed(lead), strict=False):
        if have not in (1, want):
            raise ValueError(f"{name} shape {_shape(bias)} cannot broadcast to {target}")


@dataclass(frozen=True)
class _Bias:
    """A logits bias, flattened to rows with a map from token row to bias row."""

    full: torch.Tensor | None  # [rows, V]
    factor: torch.Tensor | None  # [rows, R]
    factor_weight: torch.Tensor | None  # [V, R]
    row_of_token: torch.Tensor | None  # [N] int64, or None when bias rows == token rows


def _resolve_bias(
    logits_bias: torch.Tensor | None,
    logits_bias_weight: torch.Tensor | None,
    lead: torch.Size,
    vocab: int,
    device: torch.device,
) -> _Bias:
    if logits_bias is None:
        if logits_bias_weight is not None:
            raise ValueError(
                f"logits_bias_weight {_shape(logits_bias_weight)} was given without logits_bias"
            )
        return _Bias(None, None, None, None)
    if not isinstance(logits_bias, torch.Tensor) or not logits_bias.dtype.is_floating_point:
        raise ValueError("logits_bias must be a floating tensor")
    if logits_bias_weight is None:
        _check_broadcast_rows(logits_bias, "logits_bias", lead, vocab)
        width = vocab
    else:
        if logits_bias_weight.dim() != 2 or logits_bias_weight.shape[0] != vocab:
            raise ValueError(
                f"logits_bias_weight must be [V={vocab}, R]; got {_shape(logits_bias_weight)}"
            )
        width = logits_bias_weight.shape[1]
        _check_broadcast_rows(logits_bias, "logits_bias (factored form, [..., R])", lead, width)
        if logits_bias_weight.dtype != logits_bias.dtype:
            raise ValueError(
                f"logits_bias and logits_bias_weight must share a dtype; got "
                f"{logits_bias.dtype} and {logits_bias_weight.dtype}"
            )
    padded = logits_bias.reshape((1,) * (len(lead) + 1 - logits_bias.dim()) + logits_bias.shape)
    rows = padded.flatten(0, -2)  # not reshape(-1, width): a factored width may be 0
    if tuple(padded.shape[:-1]) == tuple(lead):
        row_of_token = None
    else:
        # Map each token row to the bias row it broadcasts from: broadcast dims
        # contribute index 0, the others their own index.
        bias_index = torch.arange(rows.shape[0], device=device).reshape(padded.shape[:-1])
        row_of_token = bias_index.expand(lead).reshape(-1)
    if logits_bias_weight is None:
        return _Bias(rows, None, None, row_of_token)
    return _Bias(None, rows, logits_bias_weight, row_of_token)


def _checked_arguments(arguments: dict) -> _Features:
    """The loss features of a public call's ``arguments`` (its ``locals()`` on entry), after
    refusing DTensor inputs with advice instead of torch's mixed-tensor error."""
    _refuse_dtensor(arguments)
    return _resolve_features(
        arguments["logit_scale"],
        arguments["softcap"],
        arguments["label_smoothing"],
        arguments["lse_square_scale"],
        arguments["reduction"],
    )


def _refuse_dtensor(arguments: dict) -> None:
    """Raise ``ValueError`` for a DTensor among ``arguments``' values, naming it.

    No DTensor can exist unless ``torch.distributed.tensor`` was imported, so
    the check imports nothing.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return
    for name, t in arguments.items():
        if isinstance(t, dtensor):
            raise ValueError(
                f"{name} is a DTensor (placements {tuple(t.placements)}): the chunked loss works "
                "on local tensors. Call it inside the model's forward, where FSDP has "
                f"unsharded the parameters, or pass {name}.full_tensor()"
            )


#: Bounds of the default chunk (rows) on the CPU and on accelerators.
CPU_CHUNK_BOUNDS = (8, 4096)
ACCELERATOR_CHUNK_BOUNDS = (512, 8192)
#: Largest default chunk of fp32 logits for the logits fallback (elements).
LOGITS_CHUNK_ELEMENTS = 1 << 24


def _floor_pow2(x: float) -> int:
    return 1 << max(0, math.floor(math.log2(x))) if x >= 1 else 1


def default_chunk_size(
    tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> int:
    """The ``chunk_size`` that ``chunk_cross_entropy(chunk_size=None)`` uses.

    The rule: the largest power of two ``c`` such that one chunk's fp32 logits
    (``c x vocab x 4`` bytes) are no larger than the hidden states
    (``tokens x hidden x dtype.itemsize`` bytes), clamped to the device's
    bounds: ``CPU_CHUNK_BOUNDS`` = [8, 4096] rows on the CPU,
    ``ACCELERATOR_CHUNK_BOUNDS`` = [512, 8192] elsewhere (CUDA, NPU). On the
    CPU the chunk may also grow to ``hidden`` rows, i.e. fp32 logits of the
    size of the fp32 weight gradient that the op holds anyway.

    Why: every chunk reads the weight twice and reads and writes the whole
    fp32 weight gradient (``16 x vocab x hidden`` bytes) for ``6 x c x vocab x
    hidden`` FLOPs, so small chunks are bound by memory traffic, not compute.
    On the CPU below ~``hidden`` rows that traffic and the GEMMs' short
    inner dimension dominate (measured at H=256, V=32000: 32 rows 4-6x slower
    than 128, and 128 rows 1.2x slower than 256), while the extra memory stays
    under 2x the weight gradient plus two hidden-state copies. Larger chunks
    are faster still (512 rows 0.85x the step time of 256 at N=32768, fp32)
    but there cost more memory than torch's chunked ``linear_cross_entropy``
    (127.0 against 126.4 MiB extra peak). On
    accelerators the floor of 512 rows is where, at H200-class bandwidth and
    tensor-core rates, the weight-gradient traffic stops
    setting the time (a roofline estimate; ``scripts/bench/cuda_qualify.py`` measures
    the default against other chunk sizes). Depends only on the arguments,
    so calls with the same shapes chunk alike (the bitwise
    ``per_token_cross_entropy`` contract).
    """
    on_cpu = torch.device(device).type == "cpu"
    low, high = CPU_CHUNK_BOUNDS if on_cpu else ACCELERATOR_CHUNK_BOUNDS
    rows = tokens * hidden * dtype.itemsize / (4 * max(vocab, 1))
    if on_cpu:
        rows = max(rows, hidden)
    return min(max(_floor_pow2(rows), low), high)


def _resolve_chunk_size(chunk_size, hidden_states: torch.Tensor, vocab: int) -> int:
    if chunk_size is None:
        tokens = hidden_states.numel() // max(hidden_states.shape[-1], 1)
        return default_chunk_size(
            tokens, hidden_states.shape[-1], vocab, hidden_states.dtype, hidden_states.device
        )
    return _check_chunk_size(chunk_size)


def _check_chunk_size(chunk_size) -> int:
    return check_int(chunk_size, "chunk_size", minimum=1)


# --------------------------------------------------------------------------- num_items_in_batch


def _denominator(num_items_in_batch, valid: torch.Tensor) -> torch.Tensor:
    """fp32 0-d divisor on ``valid``'s device; the caller's value is never written to.

    One rule for ints, floats, numpy scalars and tensors: a finite number
    >= 0, and 0 only when no target is scored (an empty batch gives loss 0
    and zero gradients, never NaN). ``None``: the local count of scored
    targets. A value the host knows (a Python or numpy number, a CPU tensor)
    is checked at once; a tensor on an accelerator is checked there, without a
    host sync (``_require``), and so is "0 while targets are scored" when the
    targets live on an accelerator.
    """
    what = "num_items_in_batch"
    if num_items_in_batch is None:
        denom = valid.sum().to(torch.float32)
        return torch.where(denom == 0, torch.ones_like(denom), denom)
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"{what} must be a scalar; got shape {_shape(num_items_in_batch)}")
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.dtype.is_complex:
            raise ValueError(f"{what} must be a real number; got dtype {num_items_in_batch.dtype}")
        given = num_items_in_batch.detach().reshape(())
        # A CPU tensor's value is already on the host: reading it syncs nothing.
        host = float(given.item()) if given.device.type == "cpu" else None
    elif is_real(num_items_in_batch):
        given, host = None, float(num_items_in_batch)
    else:
        raise ValueError(
            f"{what} must be an int, a float, a numpy scalar, a scalar tensor or None; "
            f"got {type(num_items_in_batch).__name__}"
        )
    zero_msg = f"{what} is 0 while some targets are scored (the loss would be inf)"
    if host is None:
        denom = given.to(valid.device, torch.float32)
        _require(
            torch.isfinite(denom) & (denom >= 0) & ((denom != 0) | ~valid.any()),
            f"{what} must be a finite number >= 0, and not 0 while targets are scored",
        )
    else:
        if not math.isfinite(host) or host < 0:
            raise ValueError(f"{what} must be a finite number >= 0; got {num_items_in_batch!r}")
        # torch.full fills on the device; torch.tensor(host, device=...) would copy and sync.
        denom = torch.full((), host, dtype=torch.float32, device=valid.device)
        if host == 0:
            if valid.device.type == "cpu":
                if bool(valid.any()):
                    raise ValueError(zero_msg)
            else:
                _require(~valid.any(), zero_msg)
    return torch.where(denom == 0, torch.ones_like(denom), denom)
