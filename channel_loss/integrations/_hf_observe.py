"""The observing loss (``patch_model(model)``): HF's ``loss_function`` called as it
is, then the per-token cross-entropy of its detached logits recorded into the open
``capture()`` scope; and the same for a Trainer-side loss of ``outputs.logits``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

from channel_loss.capture import active_capture, record
from channel_loss.ops import per_token_cross_entropy, resolve_targets

# The public module's logger: one name to configure for the whole integration.
logger = logging.getLogger("channel_loss.integrations.transformers")


def _hf_loss_signature(
    logits,
    labels=None,
    vocab_size=None,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    **kwargs,
):
    """HF's ``loss_function`` signature (``ForCausalLMLoss``), used to read a call's arguments."""


_LOSS_SIGNATURE = inspect.signature(_hf_loss_signature)


def _read_loss_call(args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = _LOSS_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def _targets_like(lead: torch.Size, device, labels, shift_labels):
    """``(labels, shift_labels)`` on ``device``, exactly one kept, as HF's causal loss reads them.

    HF scores ``shift_labels`` when both are given, and flattens both, so a
    flat ``shift_labels`` of the right size is reshaped to ``lead``.
    """
    if shift_labels is not None:
        shift_labels = shift_labels.to(device)
        if shift_labels.shape != lead and shift_labels.numel() == lead.numel():
            shift_labels = shift_labels.reshape(lead)
        return None, shift_labels
    return (labels.to(device) if labels is not None else None), None


class ObservingLoss:
    """A loss function with HF's ``loss_function`` signature that also observes per-token losses.

    Calls ``original`` with exactly the arguments it was given (positional and
    keyword, defaults included or not, as the caller chose) and returns its
    result untouched. Afterwards, while a ``capture()`` scope is open and the
    patch is active, records ``per_token_cross_entropy`` of the detached
    logits against the targets HF uses (``shift_labels`` if given, else
    ``labels`` shifted left by one with ``ignore_index`` appended). Outside a
    scope it costs nothing.
    """

    def __init__(self, original, *, chunk_size: int | None = None):
        self.original = original
        self.chunk_size = chunk_size
        self.active = True

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Return ``original(*args, **kwargs)``; record per-token losses into the open capture scope."""
        loss = self.original(*args, **kwargs)
        if self.active and active_capture() is not None:
            try:
                call = _read_loss_call(args, kwargs)
            except TypeError as error:
                logger.warning(
                    "channel_loss: cannot read the loss call's arguments (%s); this "
                    "micro-batch is not observed",
                    error,
                )
                return loss
            self._observe(
                call.arguments["logits"],
                call.arguments["labels"],
                call.arguments["shift_labels"],
                call.arguments["ignore_index"],
            )
        return loss

    def _observe(self, logits, labels, shift_labels, ignore_index: int) -> None:
        if shift_labels is None and labels is None:
            return  # nothing is scored: the original loss saw no targets either
        lead = logits.shape[:-1]
        labels, shift_labels = _targets_like(lead, logits.device, labels, shift_labels)
        targets = resolve_targets(
            lead, labels, shift_labels, ignore_index, logits.shape[-1], "logits"
        )
        losses = per_token_cross_entropy(
            logits=logits.detach(),
            shift_labels=targets,
            ignore_index=ignore_index,
            chunk_size=self.chunk_size,
        )
        record(losses, targets, ignore_index)


class ObservingOutputsLoss:
    """Wraps a Trainer-side loss ``fn(outputs, labels, ...)``; observes ``outputs.logits`` per token.

    Returns ``fn``'s result untouched (called with exactly its arguments).
    Inside an open ``capture()`` scope it then records the per-token NLL of
    the detached logits against ``labels`` shifted by one (the HF causal
    convention: always with ``always_shift``, else when the call passes
    ``shift_labels=True`` as the Trainer does for causal LMs; otherwise
    ``labels`` are the targets as they are).
    """

    def __init__(self, original, *, ignore_index: int = -100, always_shift: bool = False):
        self.original = original
        self.ignore_index = ignore_index
        self.always_shift = always_shift
        self._observer = ObservingLoss(original)

    def __getattr__(self, name: str):
        if name == "original":  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.original, name)  # e.g. LabelSmoother.epsilon

    def __call__(self, outputs, labels, *args: Any, **kwargs: Any):
        """Return ``original(outputs, labels, ...)``; record the per-token losses of its logits."""
        loss = self.original(outputs, labels, *args, **kwargs)
        if labels is None or active_capture() is None:
            return loss
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        if self.always_shift or kwargs.get("shift_labels") is True:
            self._observer._observe(logits, labels, None, self.ignore_index)
        else:
            self._observer._observe(logits, None, labels, self.ignore_index)
        return loss
