"""The autograd Function of ``chunk_cross_entropy``: gradients formed in the forward
walk, saved, and rescaled by the upstream gradient in backward.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from channel_loss._checks import _Bias
from channel_loss._walk import _chunked_pass

# Rows of a gradient rescaled per step in backward: an fp32 temporary of at
# most this many elements instead of one as large as the gradient.
_RESCALE_BLOCK = 1 << 20


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _rescaled(
    g: torch.Tensor,
    factor: torch.Tensor,
    dtype: torch.dtype,
    reuse: bool,
    in_fp32: bool,
    row_lifts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``g * factor`` (``g * factor / row_lifts[:, None]`` where ``row_lifts`` is given) as
    ``dtype``, written into ``g`` itself when ``reuse``.

    ``in_fp32``: multiply in fp32 even though ``g`` is low precision (an
    fp16 gradient times a factor that may lie below fp16's range). Otherwise
    the arithmetic is ``g * factor`` in ``g``'s dtype, as autograd would do it.
    Never allocates an fp32 temporary larger than ``_RESCALE_BLOCK`` elements.
    """
    if row_lifts is not None:
        in_fp32 = True
    if g.dtype == dtype and not in_fp32:
        return g.mul_(factor) if reuse else g * factor
    if reuse and not in_fp32:
        return g.mul_(factor).to(dtype)
    out = g if reuse and g.dtype == dtype else torch.empty(g.shape, dtype=dtype, device=g.device)
    rows = max(1, _RESCALE_BLOCK // max(1, math.prod(g.shape[1:])))
    for s in range(0, g.shape[0], rows):
        f = factor if row_lifts is None else factor / row_lifts[s : s + rows].unsqueeze(1)
        out[s : s + rows] = g[s : s + rows].float() * f
    return out


_SECOND_ORDER = (
    "chunk_cross_entropy is once differentiable (trying to differentiate twice a function "
    "that was marked with @once_differentiable): its backward returns gradients computed "
    "in the forward pass, so create_graph=True / second-order gradients through it are "
    "not supported"
)


class _ChunkedCE(torch.autograd.Function):
    """Loss, per-token losses and input gradients from one chunked pass.

    Forward returns ``(loss, token_losses)``; token_losses is non-differentiable.
    Only the finished gradients are saved for backward, so saved-tensor hooks
    (offload, checkpoint) see a few long-lived tensors and never the chunk
    intermediates.

    fp16 (``defer``): the saved gradients are those of the *summed* CE; the
    divisor is applied in backward together with the upstream factor (a
    ``GradScaler`` scale), so values that fp16 can hold are never divided
    into its underflow range first. Other dtypes keep the divisor folded in.

    Backward writes into the saved gradients (holding each one once) unless
    the graph is being retained, and is not differentiable itself: a
    backward with ``create_graph=True`` (second-order gradients) raises
    ``RuntimeError`` with the standard ``once_differentiable`` wording.
    """

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        bias_full,
        bias_factor,
        bias_factor_weight,
        targets,
        valid,
        denom,
        bias_map,
        chunk_size,
        needs,
        features,
    ):
        bias = _Bias(bias_full, bias_factor, bias_factor_weight, bias_map)
        defer = h.dtype == torch.float16
        scale = torch.ones_like(denom) if defer else denom.reciprocal()
        token_losses, train_losses, grads, lifts = _chunked_pass(
            h, weight, bias, targets, valid, scale, chunk_size, needs, features
        )
        loss = train_losses.sum() / denom
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(token_losses)
        inputs = (h, weight, bias_full, bias_factor, bias_factor_weight)
        ctx.dtypes = [None if g is None else x.dtype for g, x in zip(grads, inputs, strict=True)]
        ctx.defer = defer
        ctx.lifted = lifts is not None
        ctx.save_for_backward(
            denom, *([lifts] if ctx.lifted else []), *(g for g in grads if g is not None)
        )
        return loss, token_losses

    @staticmethod
    def backward(ctx, grad_loss, _grad_token_losses):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients returned here are constants of the
            # forward, so any derivative taken of them would be silently wrong.
            raise RuntimeError(_SECOND_ORDER)
        return _ChunkedCE._backward(ctx, grad_loss)

    @staticmethod
    @once_differentiable
    def _backward(ctx, grad_loss):
        denom, *saved = ctx.saved_tensors
        lifts = saved.pop(0) if ctx.lifted else None
        grads = [None] * len(ctx.dtypes)
        if grad_loss is not None:
            # Multiply unconditionally: testing grad_loss == 1 would sync the host.
            factor = grad_loss.float() / denom if ctx.defer else grad_loss
            reuse = not _keep_graph()
            saved_grads = iter(saved)
            for i, dtype in enumerate(ctx.dtypes):
                if dtype is not None:
                    g = next(saved_grads)
                    grads[i] = _rescaled(
                        g,
                        factor,
                        dtype,
                        reuse,
                        in_fp32=ctx.defer and g.dtype != torch.float32,
                        row_lifts=lifts if i == 0 else None,
                    )
        return (*grads, None, None, None, None, None, None, None)
