"""The chunk walk: one pass over the token rows in chunks that forms each chunk's fp32
logits once (the only place the LM head is applied) and takes from them the per-token
losses and every input's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from channel_loss import _fused
from channel_loss._checks import _Bias
from channel_loss._features import (
    _eager_dlogits,
    _Features,
    _final_logits_,
    _softmax_ce_,
)
from channel_loss._gemm import _accumulator_dtype, _fp16_lift, _Products, _row_scaled


def _chunks(n: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


@dataclass(frozen=True)
class _Span:
    """The token rows of one chunk: flat rows ``[start, end)``, or, where the walk skips
    ignored targets, the flat rows that ``index`` lists."""

    start: int
    end: int
    index: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.end - self.start

    def sub(self, rows: torch.Tensor) -> _Span:
        """The span of this chunk's rows ``rows`` (int64 positions within the chunk)."""
        index = self.start + rows if self.index is None else self.index.index_select(0, rows)
        return _Span(0, rows.shape[0], index)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This chunk's rows of ``x`` (a view for a plain range, a copy for an index)."""
        return x[self.start : self.end] if self.index is None else x.index_select(0, self.index)

    def put(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` into this chunk's rows of ``out``."""
        if self.index is None:
            out[self.start : self.end] = value
        else:
            out.index_copy_(0, self.index, value)

    def add(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """Add ``value`` to this chunk's rows of ``out``."""
        if self.index is None:
            out[self.start : self.end] += value
        else:
            out.index_add_(0, self.index, value)

    def fill(self, out: torch.Tensor, produce: Callable[[torch.Tensor], None]) -> None:
        """Have ``produce(rows)`` write this chunk's rows of ``out`` (in place for a range)."""
        if self.index is None:
            produce(out[self.start : self.end])
            return
        rows = out.new_empty((self.size, *out.shape[1:]))
        produce(rows)
        out.index_copy_(0, self.index, rows)


def _skips_ignored(device: torch.device) -> bool:
    """Whether a walk on ``device`` leaves out the rows whose target is ignored.

    Their loss is 0 and their gradient is zero by definition, so computing
    their logits is wasted work (in fine-tuning, masked prompts are often
    most of the rows). Finding the scored rows needs their count on the host:
    free on the CPU, a device sync elsewhere, so accelerators compute every
    row and zero the ignored ones.
    """
    return device.type == "cpu"


def _spans(valid: torch.Tensor, chunk_size: int) -> tuple[list[_Span], bool]:
    """The chunks of one walk, and whether they skip ignored rows (see ``_skips_ignored``).

    Skipping, a chunk holds ``chunk_size`` scored rows; rows that no span
    covers keep a zero loss and a zero hidden gradient.
    """
    n = valid.shape[0]
    if _skips_ignored(valid.device):
        scored = valid.nonzero().squeeze(1)
        if scored.shape[0] < n:
            return [_Span(s, e, scored[s:e]) for s, e in _chunks(scored.shape[0], chunk_size)], True
    return [_Span(s, e) for s, e in _chunks(n, chunk_size)], False


def _bias_rows(bias: _Bias, rows: torch.Tensor, span: _Span) -> torch.Tensor:
    if bias.row_of_token is None:
        return span.take(rows)
    return rows.index_select(0, span.take(bias.row_of_token))


def _chunk_logits(
    h_rows: torch.Tensor,
    products: _Products,
    bias: _Bias,
    span: _Span,
    buffer: torch.Tensor | None,
) -> torch.Tensor:
    """Row-major fp32 logits ``[rows, V]`` of ``span``'s token rows (``h_rows``, as a
    product operand); the only place the LM head is applied.

    Written into the flat fp32 ``buffer`` when one is given (one buffer for
    every chunk of a walk spares the allocator a fresh chunk-sized block per
    chunk), else a new tensor (rows recomputed alone).
    """
    vocab = products.weight.shape[0]
    out = None if buffer is None else buffer[: span.size * vocab].view(-1, vocab)
    logits = products.logits(h_rows, out)
    if bias.full is not None:
        logits.add_(_bias_rows(bias, bias.full, span).float())
    elif bias.factor is not None:
        factor = products.operand(_bias_rows(bias, bias.factor, span))
        logits.add_(products.mm32(factor, products.factor_weight.t()))
    return logits


def _final_rows(
    h_rows: torch.Tensor, products: _Products, bias: _Bias, span: _Span, features: _Features
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``rows -> final logits of those rows of the chunk`` (recomputed from the LM head)."""

    def final(rows: torch.Tensor) -> torch.Tensor:
        logits = _chunk_logits(h_rows.index_select(0, rows), products, bias, span.sub(rows), None)
        _final_logits_(logits, features, keep_cap_slope=False)
        return logits

    return final


def _chunked_pass(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: _Bias,
    targets: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor | None,
    chunk_size: int,
    needs: tuple[bool, bool, bool, bool, bool],
    features: _Features,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
    """One walk over the chunks: per-token NLL [N], per-token training loss [N], the
    gradients ``needs`` asks for, and the per-row powers of two an fp16 hidden gradient's
    rows are stored times (``_fp16_lift``; None for any other).

    The chunk math runs as ``_fused.chunk_math`` says: compiled kernels or
    the eager passes. A compilation failure reruns the whole walk eagerly
    (with a warning), so one call never mixes the two.

    The NLL is the CE of the final logits (after ``logit_scale`` and
    ``softcap``); the training loss adds label smoothing and z-loss (it is the
    NLL tensor itself when neither is on). Gradients are those of
    ``sum(training loss) * scale`` for (hidden rows, weight, full bias rows,
    bias factor rows, bias factor weight), in fp32 except the hidden one,
    which has the hidden dtype.
    """
    args = (h, weight, bias, targets, valid, scale, chunk_size, needs, features)
    if _fused.use_compiled(h.device):
        try:
            return _walk(*args, fused=True)
        except Exception as exc:
            if not _fused.compile_failed(h.device, exc):
                raise
    return _walk(*args, fused=False)


def _walk(
    *args, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
    """``_chunked_pass`` (same positional arguments) with the chunk math ``fused`` or eager."""
    h, weight, bias, targets, valid, scale, chunk_size, needs, features = args
    n = targets.shape[0]
    need_h, need_w, need_full, need_factor, need_factor_w = needs

    def zeros(t: torch.Tensor | None, need: bool, *, wide: bool = True) -> torch.Tensor | None:
        # Accumulated in fp32, or in float64 for a float64 input whose gradient the
        # standard path forms by float64 products (``wide``).
        dtype = _accumulator_dtype(t.dtype) if need and wide else torch.float32
        return torch.zeros(t.shape, dtype=dtype, device=h.device) if need else None

    spans, skipping = _spans(valid, chunk_size)
    # Skipped rows are never written: their loss and hidden gradient start at zero.
    rows_of = torch.zeros if skipping else torch.empty
    token_losses = rows_of(n, dtype=torch.float32, device=h.device)
    train_losses = (
        rows_of(n, dtype=torch.float32, device=h.device) if features.changes_loss else token_losses
    )
    grad_h = rows_of(h.shape, dtype=h.dtype, device=h.device) if need_h else None
    # fp16 hidden-gradient rows are stored lifted (see _fp16_lift); skipped rows are zeros.
    lifts = (
        torch.ones(n, dtype=torch.float32, device=h.device)
        if need_h and h.dtype == torch.float16
        else None
    )
    grad_w = zeros(weight, need_w)
    # The standard path sums a full bias's gradient in fp32 (``logits_bias.float()``).
    grad_full = zeros(bias.full, need_full, wide=False)
    grad_factor = zeros(bias.factor, need_factor)
    grad_factor_w = zeros(bias.factor_weight, need_factor_w)
    any_grad = any(needs)
    products = _Products(weight, bias.factor_weight)
    # One chunk of fp32 logits for the whole walk (see _chunk_logits).
    widest = max((span.size for span in spans), default=0)
    buffer = torch.empty(widest * weight.shape[0], dtype=torch.float32, device=h.device)
    for span in spans:
        h_rows = products.operand(span.take(h))
        logits = _chunk_logits(h_rows, products, bias, span, buffer)
        t, v = span.take(targets), span.take(valid)
        if fused:
            nll, train, *row_stats = _fused.stats(logits, t, v, features)
        else:
            cap_slope = _final_logits_(logits, features, keep_cap_slope=any_grad)
            final = _final_rows(h_rows, products, bias, span, features)
            nll, sumexp, lse, train = _softmax_ce_(logits, t, v, features, final)
        span.put(token_losses, nll)
        if train_losses is not token_losses:
            span.put(train_losses, train)
        if not any_grad:
            del logits
            continue
        # The gradient is row_factor[:, None] * dlogits (row_factor None: dlogits itself).
        row_factor = None
        if fused:
            dlogits, dl = _fused_dlogits(
                logits, t, v, row_stats, scale, features, products, needs, lifts is not None
            )
        else:
            # Folding the row factor into the products needs fp32 operands (a
            # model-dtype operand would be rounded twice) and no full bias
            # gradient (which takes the block itself).
            fold = products.grad_operand_dtype() == torch.float32 and not need_full
            dlogits, row_factor = _eager_dlogits(
                logits, t, v, sumexp, lse, cap_slope, scale, features, fold=fold
            )
            dl = (
                products.grad_operand(dlogits)
                if need_h or need_w or bias.factor is not None
                else None
            )
            del cap_slope
        acc = products.accumulated_grad_operand(dlogits, dl)
        if need_h:
            dl_h, dl_lift = dl, None
            if lifts is not None and dl.dtype != torch.float32:
                # The operand is rounded to fp16 too: lift its rows first (max into
                # [0.5, 1), so that the product stays in range); the weight's keeps dl.
                dl_lift = _fp16_lift(dlogits, top=0)
                # Lifted in place and back (exact: powers of two), not into an fp32
                # temporary; rounded over dl where the other products take the fp32
                # gradient instead ("mixed").
                dl_h = dl if acc is not dl else torch.empty_like(dl)
                dl_h.copy_(dlogits.mul_(dl_lift.unsqueeze(1)))
                dlogits.div_(dl_lift.unsqueeze(1))
            _fill_grad_hidden(grad_h, lifts, span, products, dl_h, row_factor, dl_lift)
            del dl_h
        if need_w:
            products.addmm32_(grad_w, acc.t(), _row_scaled(h_rows, row_factor))
        if need_full:
            _scatter_rows(grad_full, bias, dlogits, span)
        if need_factor:
            d_factor = _row_scaled(products.mm_wide(acc, products.factor_weight), row_factor)
            _scatter_rows(grad_factor, bias, d_factor, span)
        if need_factor_w:
            factor = products.operand(_bias_rows(bias, bias.factor, span))
            products.addmm32_(grad_factor_w, acc.t(), _row_scaled(factor, row_factor))
        # This chunk's model-dtype operand goes before the next chunk makes its own.
        del logits, dlogits, dl, acc, h_rows, row_factor
    grads = [grad_h, grad_w, grad_full, grad_factor, grad_factor_w]
    return token_losses, train_losses, grads, lifts


def _fill_grad_hidden(
    grad_h: torch.Tensor,
    lifts: torch.Tensor | None,
    span: _Span,
    products: _Products,
    dl: torch.Tensor,
    row_factor: torch.Tensor | None,
    dl_lift: torch.Tensor | None = None,
) -> None:
    """Write ``span``'s rows of the hidden gradient, lifted (and their lifts recorded in
    ``lifts``) where ``lifts`` is given (see ``_Products.grad_hidden``)."""

    def produce(out: torch.Tensor) -> None:
        lift = products.grad_hidden(dl, out, row_factor, lifted=lifts is not None, dl_lift=dl_lift)
        if lifts is not None:
            span.put(lifts, lift)

    span.fill(grad_h, produce)


def _fused_dlogits(logits, t, v, row_stats, scale, features, products, needs, keep_fp32):
    """``(fp32 logits gradient or None, its product operand)`` from the compiled kernel.

    The fp32 gradient is written over ``logits`` when the products take fp32,
    the full bias needs its gradient (``needs[2]``) or ``keep_fp32`` asks for it;
    otherwise the kernel writes the model-dtype operand directly and the fp32
    gradient is never formed.
    """
    operand = products.grad_operand_dtype()
    if operand == torch.float32 or needs[2] or keep_fp32:
        dlogits = _fused.dlogits_(logits, t, v, row_stats, scale, features, None)
        return dlogits, products.grad_operand(dlogits)
    return None, _fused.dlogits_(logits, t, v, row_stats, scale, features, operand)


def _scatter_rows(grad_rows: torch.Tensor, bias: _Bias, d: torch.Tensor, span: _Span) -> None:
    if bias.row_of_token is None:
        span.add(grad_rows, d)
    else:
        grad_rows.index_add_(0, span.take(bias.row_of_token), d)
