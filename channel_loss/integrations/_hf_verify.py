"""The first fused forward's verification: the chunked op against the model's own
logits and loss on that batch, refusing the model on a mismatch.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from channel_loss.ops import per_token_cross_entropy

if TYPE_CHECKING:
    from channel_loss.integrations._hf_fused import FusedLoss

# Per-token agreement the first fused forward demands between the model's own
# logits and the chunked op: rounding of one fp32 (or 16-bit) logit pass, far
# below what a missed cap, scale or head layer produces (a factor of 2 or more).
_VERIFY_TOLERANCE = {
    torch.float64: (1e-4, 1e-4),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}
# The loss function's result against the mean of the cross-entropies of the same logits:
# two fp32 reductions of the same values, whatever the logits' dtype.
_LOSS_RTOL = 1e-4
# Models verified once (per head and transform) stay verified for later patches.
_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _coarser(dtype: torch.dtype, other: torch.dtype | None) -> torch.dtype:
    """Of two floating dtypes, the one with the larger rounding unit (``dtype`` on a tie
    or where ``other`` is None or not floating)."""
    if other is None or not other.is_floating_point or not dtype.is_floating_point:
        return dtype
    return other if torch.finfo(other).eps > torch.finfo(dtype).eps else dtype


def _rounding_allowance(
    logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Per token, how far rounding the model's logits to ``dtype`` can move its
    cross-entropy: ``eps x (sum_i p_i |z_i| + |z_target|)`` (the log-sum-exp moves by the
    probability-weighted change of the logits, the target's logit by its own), with ``eps``
    two units of rounding. Logits that carry no probability (a ``-inf`` mask) add nothing.
    Float32, ``targets``' shape; row blocks bound the memory it takes."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    z = logits.reshape(-1, logits.shape[-1])
    t = torch.where(scored, targets, 0).reshape(-1)
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    step = max(1, (1 << 22) // max(z.shape[-1], 1))
    for s in range(0, z.shape[0], step):
        block = z[s : s + step].float()
        p = torch.softmax(block, -1)
        spread = torch.where(p > 0, p * block.abs(), 0.0).sum(-1)
        own = block.gather(-1, t[s : s + step, None]).squeeze(-1).abs()
        out[s : s + step] = eps * (spread + own)
    return out.reshape(targets.shape)


def verify(
    patch: FusedLoss, logits: torch.Tensor, loss: torch.Tensor, observed, head_dtype, args, kwargs
) -> None:
    """Compare ``patch``'s chunked op with the model's own logits and loss on this batch; refuse on a mismatch.

    The logits are judged at the coarser of their own dtype and ``head_dtype``, the
    dtype the output embeddings produced them in: a model that upcasts bf16 logits
    before its loss (``logits.float() / softcap``) still carries bf16 rounding."""
    formula = patch.transform.describe(type(patch.head).__name__)
    rounded = _coarser(logits.dtype, head_dtype)
    rtol, atol = _VERIFY_TOLERANCE.get(rounded, (1e-4, 1e-4))
    with torch.no_grad():
        try:
            own = per_token_cross_entropy(
                logits=logits.detach(),
                shift_labels=observed.targets,
                ignore_index=observed.ignore_index,
            )
        except ValueError as error:
            patch._refuse(f"its logits {tuple(logits.shape)} do not fit {formula}: {error}")
        ours = observed.token_losses
        scored = observed.scored
        if not bool((own.isfinite() == ours.isfinite())[scored].all()):
            at = int(((own.isfinite() != ours.isfinite()) & scored).reshape(-1).nonzero()[0])
            patch._refuse(
                f"the logits it passes to loss_function are not {formula} of the hidden "
                f"states its output embeddings receive: at token {at} its cross-entropy is "
                f"{float(own.reshape(-1)[at]):.6g}, the fused one {float(ours.reshape(-1)[at]):.6g}"
            )
        if not bool(ours[scored].isfinite().all()):
            # A non-finite batch (an overflow a loss scaler skips) verifies nothing; the
            # unpatched model's loss is not finite either: verification waits, as for a
            # batch without scored targets.
            return
        rounding = _rounding_allowance(logits.detach(), observed.targets, scored, rounded)
        excess = (own - ours).abs() - atol - rtol * own.abs() - rounding
        excess = excess.masked_fill(~scored, -1.0).reshape(-1)
        worst = int(excess.argmax())
        if float(excess[worst]) > 0:
            patch._refuse(
                f"the logits it passes to loss_function are not {formula} of the hidden states "
                f"its output embeddings receive (read from {list(patch.transform.fields)}): "
                f"at token {worst} its cross-entropy is {float(own.reshape(-1)[worst]):.6g}, "
                f"the fused one {float(observed.token_losses.reshape(-1)[worst]):.6g}"
            )
        if not patch.label_smoothing:
            reference = patch.original(*args, **kwargs)
            # The mean cross-entropy of the model's own logits, reduced as the op reduces
            # its own (the same divisor: scored tokens or num_items_in_batch): the loss
            # function must give it, from the same logits, with no rounding between them.
            own_sum, ours_sum = own[scored].double().sum(), ours[scored].double().sum()
            expected = loss.detach().double() * (own_sum / ours_sum if ours_sum else 1.0)
            if not torch.allclose(
                expected.float(), reference.detach().float(), rtol=_LOSS_RTOL, atol=0.0
            ):
                name = getattr(patch.original, "__name__", type(patch.original).__name__)
                patch._refuse(
                    f"its loss_function {name} gives {float(reference):.6g} on its own logits, "
                    f"chunk_cross_entropy {float(loss):.6g}: it is not the mean next-token "
                    "cross-entropy the fused path computes"
                )
    patch.verified = True
    model = patch._model()
    if model is not None:
        _VERIFIED.setdefault(model, set()).add(patch.verify_key)
