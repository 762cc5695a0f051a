"""The loss features (logit scale, softcap, label smoothing, z-loss): their checked
values, and the eager per-chunk softmax / cross-entropy / logits-gradient passes that
apply them (``_fused`` holds the same math as compiled kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from channel_loss._gemm import _probe
from channel_loss.validation import is_real

REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class _Features:
    """Loss features on top of plain CE; each ``None`` / 0 when off."""

    logit_scale: float | None = None
    softcap: float | None = None
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0

    @property
    def changes_loss(self) -> bool:
        """Whether the training loss differs from the per-token NLL summed."""
        return self.label_smoothing != 0.0 or self.lse_square_scale != 0.0


def _real(
    value, what: str, *, low: float, high: float = math.inf, open_low: bool = False, hint: str = ""
) -> float:
    ok = is_real(value) and math.isfinite(float(value))
    if ok:
        value = float(value)
        ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = (f"> {low}" if open_low else f">= {low}") + (
            f" and <= {high}" if high != math.inf else ""
        )
        raise ValueError(f"{what} must be a finite number {bound}{hint}; got {value!r}")
    return value


def _resolve_features(
    logit_scale, softcap, label_smoothing, lse_square_scale, reduction
) -> _Features:
    """Checked loss features; ``ValueError`` names the argument and the allowed values."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if logit_scale is not None:
        logit_scale = _real(
            logit_scale, "logit_scale", low=0.0, open_low=True, hint=" (None: no scaling)"
        )
    if softcap is not None:
        softcap = _real(softcap, "softcap", low=0.0, open_low=True, hint=" (None: no cap)")
    smoothing = _real(label_smoothing, "label_smoothing", low=0.0, high=1.0)
    z_scale = _real(lse_square_scale, "lse_square_scale", low=0.0)
    return _Features(logit_scale, softcap, smoothing, z_scale)


def _final_logits_(
    logits: torch.Tensor, features: _Features, keep_cap_slope: bool
) -> torch.Tensor | None:
    """Apply ``logit_scale`` then ``softcap`` to fp32 ``logits`` in place.

    Returns, when ``keep_cap_slope`` and a cap is set, ``d softcap / d input``
    (``1 - tanh**2``, a second chunk-sized buffer) for backward; else None.
    """
    if features.logit_scale is not None:
        logits.mul_(features.logit_scale)
    if features.softcap is None:
        return None
    logits.div_(features.softcap).tanh_()
    slope = torch.square(logits).neg_().add_(1.0) if keep_cap_slope else None
    logits.mul_(features.softcap)
    return slope


def _softmax_ce_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    features: _Features = _Features(),
    final_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    """Per-token CE of fp32 ``logits`` (0.0 where not ``valid``); turns ``logits`` into softmax.

    Returns ``(token_nll, sumexp, lse, train_loss)``; afterwards ``logits``
    holds the softmax times ``sumexp``: ``exp(logits - rowmax)`` from the
    passes, the softmax itself (``sumexp`` all ones) from the fused kernel.
    ``train_loss`` is the per-token loss with label smoothing and z-loss
    (``token_nll`` itself when neither is on). ``final_rows(rows)``, which
    recomputes the given rows' final logits, is what the fused softmax (see
    ``_fused_softmax``) needs for rows whose target probability underflows;
    without it the passes run.
    """
    safe = torch.where(valid, targets, 0).unsqueeze(1)
    target_logit = logits.gather(1, safe).squeeze(1)
    smoothing = features.label_smoothing
    logit_sum = logits.sum(dim=1) if smoothing else None
    if final_rows is not None and _fused_softmax(logits):
        torch.ops.aten._softmax.out(logits, 1, False, out=logits)
        # -log p_t is the NLL, without the cancellation of lse - x_t; where p_t
        # underflows (an NLL above ~87) the row's lse comes from its recomputed logits.
        token_loss = logits.gather(1, safe).squeeze(1).log_().neg_()
        lse = target_logit + token_loss
        lost = ((token_loss > _NLL_LIMIT) & valid).nonzero().squeeze(1)
        if lost.shape[0]:
            lse[lost] = torch.logsumexp(final_rows(lost), dim=1)
            token_loss[lost] = lse[lost] - target_logit[lost]
        token_loss = torch.where(valid, token_loss, 0.0)
        sumexp = torch.ones_like(lse)
    else:
        rowmax = logits.amax(dim=1)
        logits.sub_(rowmax.unsqueeze(1)).exp_()
        sumexp = logits.sum(dim=1)
        lse = sumexp.log() + rowmax
        token_loss = torch.where(valid, lse - target_logit, 0.0)
    if not features.changes_loss:
        return token_loss, sumexp, lse, token_loss
    train = token_loss
    if smoothing:
        # F.cross_entropy's definition: (1 - e) * nll + e * mean_j(-log softmax_j).
        smooth = lse - logit_sum / logits.shape[1]
        train = (1.0 - smoothing) * train + smoothing * smooth
    if features.lse_square_scale:
        train = train + features.lse_square_scale * lse.square()
    return token_loss, sumexp, lse, torch.where(valid, train, 0.0)


#: An NLL above this came from a target probability at or below fp32's smallest
#: normal number (-log(2**-126) = 87.3), so it lost digits or is inf.
_NLL_LIMIT = 87.0


def _fused_softmax(logits: torch.Tensor) -> bool:
    """Whether the chunk math turns ``logits`` into its softmax by torch's fused kernel
    in place (the CPU) rather than by max / subtract / exp / sum passes.

    On the CPU the kernel reads each row about once from memory (the row stays
    in cache between its max, exp-sum and scale), the passes four times:
    measured (with the logits from oneDNN's linear, since replaced by
    ``torch.mm``) at N=4096 H=256 V=32000 fp32, a whole step 0.80x the time
    of the passes over vocabulary-major blocks (median of 6 alternating
    pairs). Finding rows whose target probability underflowed needs their
    count on the host, free only on the CPU. The kernel writing
    over its own input is probed once against the out-of-place softmax.
    """
    if logits.device.type != "cpu" or not logits.is_contiguous():
        return False

    def check() -> bool:
        x = torch.tensor([[0.5, -1.0, 3.0, 2.0], [1.0, 1.0, -30.0, 0.0]])
        want = torch.softmax(x, dim=1)
        torch.ops.aten._softmax.out(x, 1, False, out=x)
        return torch.equal(x, want)

    return _probe("softmax_in_place", "cpu", check)


def _final_logit_rows(logits: torch.Tensor, features: _Features, rows: torch.Tensor):
    """The final fp32 logits of ``rows`` of given ``logits`` (the logits path's ``final_rows``)."""
    chosen = logits.index_select(0, rows).to(torch.float32, copy=True)
    _final_logits_(chosen, features, keep_cap_slope=False)
    return chosen


def _eager_dlogits(
    logits, t, v, sumexp, lse, cap_slope, scale, features, *, fold: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 logits gradient, written over ``logits`` (which ``_softmax_ce_`` left holding
    the softmax times ``sumexp``), as ``(block, row_factor)``: the gradient is
    ``row_factor[:, None] * block``, or ``block`` itself where ``row_factor`` is None.

    With ``fold`` the per-row factor is left out of the block for the products to
    apply to their ``[rows, H]`` operands and results, which spares a pass over the
    ``[rows, V]`` block; without, ``row_factor`` is None.
    """
    smoothing, z_scale = features.label_smoothing, features.lse_square_scale
    # d(training loss)/d(final logits) on valid rows, times the loss scale:
    # softmax * (1 + 2 s lse) - (1 - e) onehot - e / V, where softmax = E / sumexp.
    row_scale = torch.where(v, scale, 0.0)
    safe = torch.where(v, t, 0).unsqueeze(1)
    target_e = logits.gather(1, safe)
    if fold:
        # = (row_scale / sumexp) * (E (1 + 2 s lse) - sumexp ((1 - e) onehot + e / V)):
        # a factor that is finite on every row (sumexp >= 1) and zero on ignored ones.
        row_factor = row_scale / sumexp
        unit = sumexp
        if z_scale:
            logits.mul_((1.0 + 2.0 * z_scale * lse).unsqueeze(1))
    else:
        row_factor = None
        unit = row_scale
        coef = row_scale / sumexp
        if z_scale:
            coef = coef * (1.0 + 2.0 * z_scale * lse)
        logits.mul_(coef.unsqueeze(1))
    if smoothing:
        logits.sub_((unit * (smoothing / logits.shape[1])).unsqueeze(1))
    target = _target_grad(target_e, sumexp, row_scale, lse, features, fold, logits.shape[1])
    logits.scatter_(1, safe, target)
    # Back through the cap and the scale to the logits of the LM head.
    if cap_slope is not None:
        logits.mul_(cap_slope)
    if features.logit_scale is not None:
        if row_factor is not None:
            row_factor = row_factor * features.logit_scale
        else:
            logits.mul_(features.logit_scale)
    return logits, row_factor


def _target_grad(
    target_e, sumexp, row_scale, lse, features, fold: bool, vocab: int
) -> torch.Tensor:
    """The target column of ``_eager_dlogits``'s block, ``[rows, 1]``:
    ``(p_t - (1 - e)) + 2 s lse p_t - e / V``, in the block's units.

    Formed from the target's ``E`` before any scaling, as
    ``(E_t - (1 - e) sumexp + 2 s lse E_t - e sumexp / V) / sumexp``: the
    cancellation of a confident target (p_t near 1) happens in ``E_t -
    sumexp``, exactly, leaving only the rounding ``sumexp`` already has, as in
    the standard path's CE gradient. Scaling ``E_t`` first and subtracting
    the one-hot after lost those digits: with z-loss, 470x the standard path's
    error at V = 1; without, 1.3x at V = 8.
    """
    smoothing, z_scale = features.label_smoothing, features.lse_square_scale
    e = target_e.squeeze(1)
    value = e - (1.0 - smoothing) * sumexp
    if z_scale:
        value = value + (2.0 * z_scale * lse) * e
    if smoothing:
        value = value - sumexp * (smoothing / vocab)
    # fold: the block is in units of sumexp (its row factor comes later); else scaled.
    return (value if fold else value * (row_scale / sumexp)).unsqueeze(1)
