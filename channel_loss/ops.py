"""Chunked cross-entropy over an LM head that hands out per-token losses from the same pass.

The op never materialises ``[tokens, vocab]`` logits: it walks the tokens in
chunks of ``chunk_size`` rows, and from each chunk's fp32 logits takes the
per-token loss and the gradients of every input at once, keeping only the
gradients for backward. Because the per-token loss falls out of the same
log-sum-exp the gradient needs, observing it costs no extra pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from channel_loss._autograd import _ChunkedCE
from channel_loss._checks import (
    ACCELERATOR_CHUNK_BOUNDS,
    CPU_CHUNK_BOUNDS,
    LOGITS_CHUNK_ELEMENTS,
    _as_autocast_would,
    _check_chunk_size,
    _check_hidden_weight,
    _checked_arguments,
    _denominator,
    _resolve_bias,
    _resolve_chunk_size,
    default_chunk_size,
    resolve_targets,
)
from channel_loss._features import (
    REDUCTIONS,
    _Features,
    _final_logit_rows,
    _final_logits_,
    _softmax_ce_,
)
from channel_loss._fused import CHUNK_MATH, CHUNK_MATH_ENV, chunk_math
from channel_loss._gemm import GEMM_POLICIES, cpu_has_bf16_gemm, default_gemm_policy, gemm_policy
from channel_loss._walk import _chunked_pass, _chunks
from channel_loss.capture import record

__all__ = [
    "ACCELERATOR_CHUNK_BOUNDS",
    "CHUNK_MATH",
    "CHUNK_MATH_ENV",
    "CPU_CHUNK_BOUNDS",
    "GEMM_POLICIES",
    "LOGITS_CHUNK_ELEMENTS",
    "REDUCTIONS",
    "chunk_cross_entropy",
    "chunk_math",
    "cpu_has_bf16_gemm",
    "default_chunk_size",
    "default_gemm_policy",
    "gemm_policy",
    "per_token_cross_entropy",
]


# --------------------------------------------------------------------------- public API


_COMPILE_NOTE = (
    "channel_loss ops run eagerly under torch.compile: a traced chunk loop loses the "
    "O(chunk_size x V) memory bound (it grows with the token count like full logits)"
)
_EAGER: dict[Callable, Callable] = {}
_FUNC_TRANSFORMS = (
    "chunk_cross_entropy does not support torch.func transforms (grad, jvp, vjp, vmap, "
    "jacrev, ...): its gradients are formed in the forward pass by a custom autograd.Function. "
    "Differentiate it with loss.backward() or torch.autograd.grad, or, inside torch.func, "
    "use F.cross_entropy of the logits"
)


def _under_func_transform() -> bool:
    """Whether a ``torch.func`` transform is active (torch's own error would only say that
    the autograd.Function lacks ``setup_context``)."""
    probe = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(probe()) if probe is not None else False


def _eager_under_compile(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, made on the first call so importing stays cheap.

    ``torch.compiler.disable`` imports ``torch._dynamo`` (seconds). Under
    ``torch.compile`` the call is a graph break and ``fn`` runs eagerly; with
    ``fullgraph=True`` compilation fails with ``_COMPILE_NOTE`` in the message
    (also when the very first call is being traced, via the ``raise`` below).
    """

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        disabled = _EAGER.get(fn)
        if disabled is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(_COMPILE_NOTE)
            disabled = _EAGER[fn] = torch.compiler.disable(fn, reason=_COMPILE_NOTE)
        return disabled(*args, **kwargs)

    return eager


_FEATURES_DOC = """
    Loss features (keyword-only, off by default), in the order applied:
    ``logit_scale`` multiplies the fp32 logits (Cohere's ``logit_scale``,
    Granite's ``1 / logits_scaling``); ``softcap`` then maps them to
    ``softcap * tanh(logits / softcap)`` (Gemma 2/3). The result is the
    *final logits*. ``label_smoothing`` mixes the NLL with the uniform
    target as ``F.cross_entropy`` defines it; ``lse_square_scale`` adds the
    z-loss ``lse_square_scale * logsumexp(final logits)**2`` per scored token,
    reduced like the CE. ``reduction="sum"`` returns the sum over scored
    tokens (no divisor; ``num_items_in_batch`` must then be None).

    The observation (``capture()``, ``per_token_cross_entropy``) is always
    the per-token NLL of the final logits, never the smoothing or z-loss
    terms, so channel metrics stay comparable across recipes.
"""


def _loss_features_doc(fn: Callable) -> Callable:
    fn.__doc__ = (fn.__doc__ or "") + _FEATURES_DOC
    return fn


@_eager_under_compile
@_loss_features_doc
def chunk_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    logits_bias: torch.Tensor | None = None,
    logits_bias_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    chunk_size: int | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean token cross-entropy of ``F.linear(hidden_states, weight)`` logits, chunked.

    Targets are ``shift_labels`` or ``labels`` shifted left by one (last
    position ignored). Logits are the fp32 product ``h @ weight.T`` plus
    ``logits_bias.float()`` (broadcastable to ``[..., V]``) or plus the fp32
    product ``logits_bias @ logits_bias_weight.T`` (factored); for bf16 /
    fp16 inputs the products accumulate in fp32, and only the CPU's bf16
    policy on CPUs with bf16 units rounds the logits to the model dtype, as
    the standard ``F.linear(h, W).float()`` does (``gemm_policy`` says how
    each product is formed per device). Under ``torch.autocast`` for the inputs'
    device, ``hidden_states``, ``weight`` and a factored bias pair are first cast to
    its dtype, as autocast casts ``F.linear``'s operands (float64 kept; an additive
    ``logits_bias`` is added as given); the op's own matmuls never are.

    Returns a 0-d fp32 tensor: the CE summed over targets that are not
    ``ignore_index``, divided by ``num_items_in_batch`` (never modified) or by
    the local count of such targets. With no valid target the loss is 0.0 and
    every gradient zero. Gradients reach every input that requires grad; the
    weight gradient accumulates in fp32; fp16 gradients are as accurate as
    the standard ``F.linear(...).float()`` + CE path under loss scaling (the
    divisor is applied in backward, with the upstream factor). Extra memory is
    O(chunk_size x V) plus the gradients; ``chunk_size=None`` picks it from
    the shapes (``default_chunk_size``), an int wins. Inside ``capture()`` the
    per-token losses of this very pass are recorded; loss and gradients are
    bitwise the same with or without a scope.

    Not differentiable twice (second-order gradients raise), and not under
    ``torch.func`` transforms (``grad``, ``jvp``, ``vmap``, ...: ``RuntimeError``
    naming the op and the alternatives). Under
    ``torch.compile`` the call runs eagerly (one graph break; with
    ``fullgraph=True`` compilation fails naming this op), which keeps the
    memory bound; inside, the per-chunk softmax / CE / gradient math runs as
    ``chunk_math`` says (compiled kernels on CUDA, eager passes on the CPU by
    default). On accelerators the checks of target range and of
    ``num_items_in_batch`` values cost no host sync: they run on the device
    and a failure surfaces as a device-side assertion at the next sync.

    Raises ``ValueError`` naming the argument for inconsistent shapes, dtypes,
    targets outside ``[0, V)``, ``chunk_size < 1``, a ``num_items_in_batch``
    that is negative, not finite, or 0 while targets are scored, a loss
    feature out of range (``softcap`` or ``logit_scale`` <= 0,
    ``label_smoothing`` outside [0, 1], ``lse_square_scale`` < 0, a
    ``reduction`` other than "mean" / "sum"), or a DTensor input (call the
    op where FSDP has unsharded the weight, inside the model's forward, or
    pass ``.full_tensor()``).
    """
    features = _checked_arguments(locals())
    if _under_func_transform():
        raise RuntimeError(_FUNC_TRANSFORMS)
    if reduction == "sum" and num_items_in_batch is not None:
        raise ValueError(
            "num_items_in_batch divides the summed loss: pass it with reduction='mean' "
            f"(the default), not with reduction='sum'; got {num_items_in_batch!r}"
        )
    (hidden_states, weight, logits_bias, logits_bias_weight), own_precision = _as_autocast_would(
        hidden_states, weight, logits_bias, logits_bias_weight
    )
    _check_hidden_weight(hidden_states, weight)
    vocab = weight.shape[0]
    chunk_size = _resolve_chunk_size(chunk_size, hidden_states, vocab)
    lead = hidden_states.shape[:-1]
    targets = resolve_targets(lead, labels, shift_labels, ignore_index, vocab, "hidden_states")
    bias = _resolve_bias(logits_bias, logits_bias_weight, lead, vocab, hidden_states.device)
    flat_targets = targets.reshape(-1)
    valid = flat_targets != ignore_index
    if reduction == "sum":
        denom = torch.ones((), dtype=torch.float32, device=valid.device)
    else:
        denom = _denominator(num_items_in_batch, valid)
    h = hidden_states.flatten(0, -2)  # not reshape(-1, H): H may be 0
    inputs = (h, weight, bias.full, bias.factor, bias.factor_weight)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and t is not None and t.requires_grad for t in inputs)
    with own_precision:
        loss, token_losses = _ChunkedCE.apply(
            *inputs, flat_targets, valid, denom, bias.row_of_token, chunk_size, needs, features
        )
    record(token_losses.reshape(lead), targets, ignore_index)
    return loss


@_eager_under_compile
@_loss_features_doc
def per_token_cross_entropy(
    *,
    logits: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    logits_bias: torch.Tensor | None = None,
    logits_bias_weight: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Detached fp32 per-token CE with the leading shape of the targets, 0.0 where ignored.

    Give either ``logits`` (``[..., V]``, as a logits-returning model produces)
    or ``hidden_states`` and ``weight`` (with optional bias, as for
    ``chunk_cross_entropy``). For the hidden path and the same ``chunk_size``
    and loss features (also when both calls leave the chunk None, since the
    default depends only on the shapes, dtype and device), the result is
    bitwise equal to what ``capture()`` records for ``chunk_cross_entropy``.
    For logits the default chunk keeps each fp32 working copy at most
    ``LOGITS_CHUNK_ELEMENTS`` elements; ``logit_scale`` / ``softcap`` are
    applied to the given logits (pass them only if the model has not). Never
    builds an autograd graph. ``label_smoothing``, ``lse_square_scale`` and
    ``reduction`` are checked and accepted so a caller can pass the same
    arguments as to ``chunk_cross_entropy``; they do not change the
    per-token NLL returned here.
    """
    checked = _checked_arguments(locals())
    if logits is not None:
        # Only the terms that change the final logits matter to the NLL.
        features = _Features(checked.logit_scale, checked.softcap)
        if hidden_states is not None or weight is not None:
            raise ValueError("pass either logits or hidden_states + weight, not both")
        if logits_bias is not None or logits_bias_weight is not None:
            raise ValueError("logits_bias applies to the hidden_states path only; add it to logits")
        if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
            raise ValueError(
                f"logits must be a [..., V] tensor; got {getattr(logits, 'shape', logits)}"
            )
        if not logits.dtype.is_floating_point:
            raise ValueError(f"logits must be floating point; got dtype {logits.dtype}")
        lead, vocab = logits.shape[:-1], logits.shape[-1]
        chunk_size = (
            max(1, LOGITS_CHUNK_ELEMENTS // max(vocab, 1))
            if chunk_size is None
            else _check_chunk_size(chunk_size)
        )
        targets = resolve_targets(lead, labels, shift_labels, ignore_index, vocab, "logits")
        flat_logits = logits.detach().flatten(0, -2)  # V may be 0
        flat_targets = targets.reshape(-1)
        valid = flat_targets != ignore_index
        out = torch.zeros(flat_targets.shape[0], dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            # V == 0: every target is ignored (``resolve_targets``), every loss 0.0.
            for s, e in _chunks(flat_targets.shape[0] if vocab else 0, chunk_size):
                # .float() of fp32 logits is the caller's tensor: clone before the in-place softmax.
                chunk = flat_logits[s:e].to(torch.float32, copy=True)
                _final_logits_(chunk, features, keep_cap_slope=False)
                final = functools.partial(_final_logit_rows, flat_logits[s:e], features)
                out[s:e] = _softmax_ce_(chunk, flat_targets[s:e], valid[s:e], final_rows=final)[0]
        return out.reshape(lead)
    if hidden_states is None or weight is None:
        raise ValueError("pass logits, or both hidden_states and weight")
    with torch.no_grad():
        (hidden_states, weight, logits_bias, logits_bias_weight), own_precision = (
            _as_autocast_would(hidden_states, weight, logits_bias, logits_bias_weight)
        )
    _check_hidden_weight(hidden_states, weight)
    lead = hidden_states.shape[:-1]
    vocab = weight.shape[0]
    chunk_size = _resolve_chunk_size(chunk_size, hidden_states, vocab)
    targets = resolve_targets(lead, labels, shift_labels, ignore_index, vocab, "hidden_states")
    with torch.no_grad(), own_precision:
        bias = _resolve_bias(logits_bias, logits_bias_weight, lead, vocab, hidden_states.device)
        flat_targets = targets.reshape(-1)
        h = hidden_states.flatten(0, -2)  # not reshape(-1, H): H may be 0
        out, _, _, _ = _chunked_pass(
            h,
            weight,
            bias,
            flat_targets,
            flat_targets != ignore_index,
            None,
            chunk_size,
            (False,) * 5,
            # All the features, not only those that change the final logits: the
            # compiled chunk math is then the very kernel the loss call ran.
            checked,
        )
    return out.reshape(lead)
