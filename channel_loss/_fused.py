"""The per-chunk softmax / cross-entropy / logits-gradient math as two fused kernels.

``chunk_cross_entropy`` turns each ``[chunk, V]`` block of fp32 logits into
per-token losses and the logits gradient. Eagerly that is four to seven full
passes over the block (scale / cap, max, subtract, exp, sum, the gradient
scale, which fp32 products apply to their operands instead, the one-hot
scatter). Here the same math is written once,
functionally, and ``torch.compile`` (inductor: C++ on the CPU, Triton on
CUDA) fuses it into one reduction kernel (the row statistics: max,
log-sum-exp, the target logit, the smoothing sum) and one pointwise kernel
(the gradient, written over the logits in place or straight into the model
dtype). ``logit_scale`` and ``softcap`` are recomputed inside each kernel
instead of being stored.

Which path a call takes is ``chunk_math``'s policy: ``"auto"`` is the device's
measured-fastest path (``COMPILED_BY_DEFAULT``), ``"compiled"`` /
``"eager"`` force one; the ``CHANNEL_LOSS_CHUNK_MATH`` environment variable
sets the process default the same way. When compilation is unavailable or
fails, the call runs eagerly and a ``RuntimeWarning`` says why, once per
device type.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["CHUNK_MATH", "CHUNK_MATH_ENV", "COMPILED_BY_DEFAULT", "chunk_math"]

#: ``chunk_math`` names.
CHUNK_MATH = ("auto", "compiled", "eager")
#: Environment variable holding the process default of ``chunk_math``.
CHUNK_MATH_ENV = "CHANNEL_LOSS_CHUNK_MATH"
#: Device types whose ``"auto"`` policy is the compiled kernels. The CPU is not one:
#: there the eager passes were measured faster (inductor's C++ recomputes ``exp`` in
#: the gradient kernel, and at CPU bandwidth the saved passes do not pay for it; see
#: docs/benchmarks.md). On CUDA the chunk math is bandwidth-bound, which fusion cuts.
COMPILED_BY_DEFAULT = frozenset({"cuda"})

_POLICY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "channel_loss_chunk_math", default=None
)
#: Device types where compilation failed in this process, with the reason.
_FAILED: dict[str, str] = {}
_COMPILED: dict[str, Callable] = {}


@contextlib.contextmanager
def chunk_math(policy: str) -> Iterator[str]:
    """Choose how the per-chunk softmax / CE / logits-gradient math runs inside the scope.

    - ``"compiled"``: two ``torch.compile``'d kernels per chunk (row
      statistics, then the gradient), falling back to the eager passes with a
      ``RuntimeWarning`` if compilation is unavailable or fails.
    - ``"eager"``: the eager in-place passes; never touches ``torch.compile``.
    - ``"auto"``: compiled on the device types in ``COMPILED_BY_DEFAULT``,
      eager elsewhere.

    Without a scope the policy is the ``CHANNEL_LOSS_CHUNK_MATH`` environment
    variable, else ``"auto"``. Scopes are per context and nest. The two paths
    agree to float rounding, not bitwise: the bitwise contracts (observed vs
    unobserved, ``per_token_cross_entropy`` vs ``capture()``) hold between
    calls under the same policy. Raises ``ValueError`` for a name outside
    ``CHUNK_MATH``.
    """
    token = _POLICY.set(_checked(policy, "chunk_math"))
    try:
        yield policy
    finally:
        _POLICY.reset(token)


def _checked(policy: object, what: str) -> str:
    if policy not in CHUNK_MATH:
        raise ValueError(f"{what} must be one of {CHUNK_MATH}; got {policy!r}")
    return policy


def _policy() -> str:
    policy = _POLICY.get()
    if policy is None:
        policy = _checked(os.environ.get(CHUNK_MATH_ENV, "auto"), f"${CHUNK_MATH_ENV}")
    return policy


def use_compiled(device: torch.device) -> bool:
    """Whether a chunk pass on ``device`` runs the compiled kernels now."""
    policy = _policy()
    if policy == "eager" or device.type in _FAILED:
        return False
    return policy == "compiled" or device.type in COMPILED_BY_DEFAULT


def compile_failed(device: torch.device, exc: BaseException) -> bool:
    """Whether ``exc`` is torch.compile failing; if so, ``device``'s type runs eagerly from now.

    Only errors raised by dynamo / inductor (a missing C++ compiler, an
    unsupported build) count; any other error belongs to the caller.
    """
    origin = type(exc).__module__ or ""
    if not origin.startswith(("torch._dynamo", "torch._inductor")):
        return False
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    _FAILED[device.type] = reason
    warnings.warn(
        f"channel_loss: compiling the fused chunk math failed on {device.type} ({reason}); "
        f"running it eagerly from now on (set {CHUNK_MATH_ENV}=eager to skip compilation)",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def _final(x: torch.Tensor, logit_scale: float | None, softcap: float | None) -> torch.Tensor:
    """The final logits: ``logit_scale`` then ``softcap``, as the eager path applies them."""
    if logit_scale is not None:
        x = x * logit_scale
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return x


def _stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    logit_scale: float | None,
    softcap: float | None,
    smoothing: float,
    z_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _final(logits, logit_scale, softcap)
    target_logit = x.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    rowmax = x.amax(dim=1)
    sumexp = torch.exp(x - rowmax.unsqueeze(1)).sum(dim=1)
    lse = sumexp.log() + rowmax
    nll = torch.where(valid, lse - target_logit, 0.0)
    train = nll
    if smoothing:
        # F.cross_entropy's definition: (1 - e) * nll + e * mean_j(-log softmax_j).
        train = (1.0 - smoothing) * train + smoothing * (lse - x.sum(dim=1) / x.shape[1])
    if z_scale:
        train = train + z_scale * lse.square()
    return nll, torch.where(valid, train, 0.0), lse, rowmax, sumexp


def _dlogits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    lse: torch.Tensor,
    rowmax: torch.Tensor,
    sumexp: torch.Tensor,
    scale: torch.Tensor,
    logit_scale: float | None,
    softcap: float | None,
    smoothing: float,
    z_scale: float,
    out_dtype: torch.dtype | None,
) -> torch.Tensor | None:
    scaled = logits * logit_scale if logit_scale is not None else logits
    if softcap is not None:
        capped = torch.tanh(scaled / softcap)
        x = capped * softcap
    else:
        x = scaled
    # d(training loss)/d(final logits) on valid rows, times the loss scale:
    # (E - (1 - e) S onehot + 2 z lse E - e S / V) / S with E = exp(x - rowmax) and S
    # its row sum, as the eager passes form it. exp(x - lse) would carry lse's
    # rounding, at the size of the largest logit, into every probability; and a
    # confident target (p_t near 1) cancels in E_t - S, exactly, before the z-loss
    # term is added, as the standard path's CE gradient does.
    sumexp = sumexp.unsqueeze(1)
    row_scale = torch.where(valid, scale, 0.0)
    e = torch.exp(x - rowmax.unsqueeze(1))
    hot = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == torch.where(
        valid, targets, 0
    ).unsqueeze(1)
    d = torch.where(hot, e - (1.0 - smoothing) * sumexp, e)
    if z_scale:
        d = d + (2.0 * z_scale * lse).unsqueeze(1) * e
    if smoothing:
        d = d - sumexp * (smoothing / x.shape[1])
    d = d * (row_scale.unsqueeze(1) / sumexp)
    if softcap is not None:
        d = d * (1.0 - capped.square())
    if logit_scale is not None:
        d = d * logit_scale
    if out_dtype is None:
        logits.copy_(d)
        return None
    return d.to(out_dtype)


def _compiled(name: str, fn: Callable) -> Callable:
    # dynamic=True: one kernel for every chunk and vocabulary size, so the last,
    # shorter chunk and later calls reuse it (no recompiles, same code for a shape).
    compiled = _COMPILED.get(name)
    if compiled is None:
        compiled = _COMPILED[name] = torch.compile(fn, dynamic=True)
    return compiled


def stats(logits, targets, valid, features) -> tuple[torch.Tensor, ...]:
    """Compiled row statistics of fp32 ``logits`` (left unchanged):
    ``(nll, train, lse, rowmax, sumexp)``.

    ``nll``: per-token CE of the final logits, 0.0 where not ``valid``;
    ``train``: with label smoothing and z-loss (0.0 where not valid); ``lse``:
    the log-sum-exp of the final logits, ``log(sumexp) + rowmax`` (their row
    maximum and ``sum(exp(x - rowmax))``).
    """
    return _compiled("stats", _stats)(
        logits,
        targets,
        valid,
        features.logit_scale,
        features.softcap,
        features.label_smoothing,
        features.lse_square_scale,
    )


def dlogits_(logits, targets, valid, row_stats, scale, features, out_dtype) -> torch.Tensor:
    """Compiled gradient of ``scale * sum(train loss)`` w.r.t. the LM-head logits ``logits``,
    given ``row_stats = (lse, rowmax, sumexp)`` from ``stats``.

    ``out_dtype=None``: written over ``logits`` (fp32) and returned;
    otherwise returned as a new tensor of ``out_dtype`` with ``logits`` left
    unchanged.
    """
    out = _compiled("dlogits", _dlogits)(
        logits,
        targets,
        valid,
        *row_stats,
        scale,
        features.logit_scale,
        features.softcap,
        features.label_smoothing,
        features.lse_square_scale,
        out_dtype,
    )
    return logits if out is None else out
