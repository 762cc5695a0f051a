"""The fused patch (``patch_model(model, fused=True)``): the model's forward, its
output embeddings' forward and its ``loss_function`` replaced so that the loss is
``chunk_cross_entropy`` of the hidden states, inside the model's own forward.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from channel_loss.capture import capture, record
from channel_loss.integrations._hf_models import (
    LogitTransform,
    UnsupportedModelError,
    _class_name,
    _forwarded_to,
    _is_fsdp2,
    _output_embeddings,
)
from channel_loss.integrations._hf_observe import ObservingLoss, _read_loss_call, _targets_like
from channel_loss.integrations._hf_verify import verify
from channel_loss.ops import chunk_cross_entropy

# Set by fused_causal_lm_loss: fuse this forward even in eval mode.
_FORCE_FUSED: ContextVar[bool] = ContextVar("channel_loss_force_fused", default=False)


@dataclass
class _Pass:
    """One fused forward in flight."""

    verifying: bool
    hidden: torch.Tensor | None = None
    head_calls: int = 0
    loss_calls: int = 0
    # The dtype the output embeddings rounded the logits to (verifying passes only).
    head_dtype: torch.dtype | None = None


class _PatchedForward:
    """``model.forward`` under ``patch_model(model, fused=True)``: calls ``FusedLoss.model_forward``.

    It presents the signature of the forward it wraps (``__signature__``, as
    ``functools.wraps`` would, but with no ``__wrapped__`` that a tool could
    call past the patch), so ``inspect.signature(model.forward)`` lists
    ``input_ids``, ... as unpatched: the Trainer's ``remove_unused_columns``
    keeps the model's columns and ``_supports_logits_to_keep()`` stays true.
    It is a plain object, not a bound method: accelerate's mixed-precision
    wrapping (which rebinds a bound method's ``__func__`` to the model) wraps
    it as a callable, and copies and pickles of the model carry their own.
    """

    def __init__(self, loss: FusedLoss):
        self.loss = loss

    def __call__(self, *args: Any, **kwargs: Any):
        if args and args[0] is self.loss._model():
            # Bound to its model as a method (accelerate's unwrap_model rebinds a forward
            # with no __wrapped__ that way): the model is not an input.
            args = args[1:]
        return self.loss.model_forward(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return self.loss.original_signature()

    @property
    def __name__(self) -> str:
        return "forward"

    def __repr__(self) -> str:
        return f"<fused channel_loss forward of {self.loss.model_class}>"


class FusedLoss(ObservingLoss):
    """The loss function ``patch_model(model, fused=True)`` installs.

    Inside a fused forward (training mode, ``labels`` given) it computes the
    loss with ``chunk_cross_entropy`` from the hidden states the output
    embeddings received, ignoring the (empty) logits it is handed; in any
    other forward it is an ``ObservingLoss``. ``patched_forward`` is what the
    patch installs as ``model.forward``.

    ``copy.deepcopy`` and pickling (``torch.save(model)``) of the patched
    model give a patched model whose patch refers to the copy (its training
    flag, its forward, its output embeddings), never to the original; a
    copy keeps the original's ``verified`` / ``refusal`` state.
    """

    def __init__(
        self,
        original,
        *,
        model,
        head,
        transform: LogitTransform,
        chunk_size: int | None = None,
        verified: bool = False,
    ):
        super().__init__(original, chunk_size=chunk_size)
        self.model_class = type(model).__name__
        self.head = head
        self.transform = transform
        self.label_smoothing = 0.0
        self.verified = verified
        self.refusal: str | None = None
        self._pass: ContextVar[_Pass | None] = ContextVar("channel_loss_fused_pass", default=None)
        # The forwards the patch wraps: an instance attribute the module already had, or None
        # for its class's own. The bound methods are rebuilt from these for a copy (see
        # ``__setstate__``), so a copy calls its own forwards, never the original's.
        self._model_forward_saved = vars(model).get("forward")
        self._head_forward_saved = vars(head).get("forward")
        self._model = weakref.ref(model)
        self._bind_forwards(model)
        self.patched_forward = _PatchedForward(self)

    def _bind_forwards(self, model) -> None:
        saved = self._model_forward_saved
        self._model_forward = saved if saved is not None else type(model).forward.__get__(model)
        saved = self._head_forward_saved
        self._head_forward = (
            saved if saved is not None else type(self.head).forward.__get__(self.head)
        )

    # Copying and pickling (``copy.deepcopy(model)``, ``torch.save(model)``): the copy's patch
    # refers to the copy. The model goes into the state as a strong reference (deepcopy's memo
    # and pickle's map it to the copy); the per-pass context variable is made anew.

    def __getstate__(self) -> dict[str, Any]:
        """The attributes, with the model strongly referenced and no per-pass context variable."""
        state = dict(vars(self))
        for name in ("_pass", "_model_forward", "_head_forward"):
            state.pop(name, None)
        state["_model"] = self._model()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore ``__getstate__``'s attributes; bind the forwards of the model it now belongs to."""
        model = state.pop("_model")
        vars(self).update(state)
        self._pass = ContextVar("channel_loss_fused_pass", default=None)
        self._model = weakref.ref(model)
        # Only the types are needed: an unpickled model may not have its attributes yet.
        self._bind_forwards(model)

    def original_signature(self) -> inspect.Signature:
        """The signature of the forward the patch wraps (what ``model.forward`` presents)."""
        return inspect.signature(self._model_forward)

    # The three entry points: the model's forward, the head's forward, the loss.

    def model_forward(self, *args: Any, **kwargs: Any):
        """The model's forward; fused when training (or forced) with ``labels`` given."""
        model = self._model()
        fuse = (
            self.active
            and kwargs.get("labels") is not None
            and (_FORCE_FUSED.get() or (model is not None and model.training))
        )
        if not fuse:
            return self._model_forward(*args, **kwargs)
        if self.refusal is not None:
            raise UnsupportedModelError(self.refusal)
        head = _output_embeddings(model) if model is not None else self.head
        if _forwarded_to(head) is not self.head:
            # The new head's output would be added to (or replace) the empty logits of the
            # patched one: a LoRA delta on lm_head got no gradient, then a shape error.
            self._refuse(
                f"its output embeddings were replaced after patch_model (the patched "
                f"{_class_name(self.head)} is now {_class_name(head)}: a PEFT adapter on "
                "lm_head, resize_token_embeddings, ...); patch the model after changing them"
            )
        state = _Pass(verifying=not self.verified)
        token = self._pass.set(state)
        try:
            outputs = self._model_forward(*args, **kwargs)
        finally:
            self._pass.reset(token)
        if state.loss_calls == 0:
            self._refuse(
                f"{self.model_class}.forward(labels=...) never called self.loss_function"
                + (" after its output embeddings" if state.head_calls else "")
                + ": the fused path replaces exactly that call"
            )
        if state.verifying:
            # Every fused forward returns the same kind of logits: none.
            if isinstance(outputs, Mapping) and "logits" in outputs:
                logits = outputs["logits"]
                outputs["logits"] = logits.new_empty((*logits.shape[:-1], 0))
            elif isinstance(outputs, tuple) and len(outputs) > 1:
                # return_dict=False with labels: (loss, logits, ...), or (loss, aux_loss,
                # logits, ...) for a MoE model that returns its router loss.
                vocab = self.head.weight.shape[0]
                at = next(
                    (
                        i
                        for i, item in enumerate(outputs[1:3], start=1)
                        if isinstance(item, torch.Tensor)
                        and item.dim() > 1
                        and item.shape[-1:] == (vocab,)
                    ),
                    None,
                )
                if at is not None:
                    empty = outputs[at].new_empty((*outputs[at].shape[:-1], 0))
                    outputs = (*outputs[:at], empty, *outputs[at + 1 :])
        return outputs

    def head_forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The output embeddings' forward; inside a fused forward it keeps ``hidden`` for the loss."""
        state = self._pass.get()
        if state is None or args or kwargs:
            return self._head_forward(hidden, *args, **kwargs)
        state.head_calls += 1
        if state.head_calls > 1:
            self._refuse(
                f"{self.model_class}.forward calls its output embeddings "
                f"({type(self.head).__name__}) more than once per forward; the fused path "
                "replaces a single lm_head(hidden) -> loss_function pair"
            )
        state.hidden = hidden
        if state.verifying:
            logits = self._head_forward(hidden)  # real logits, to compare with
            state.head_dtype = logits.dtype
            return logits
        return hidden.new_empty((*hidden.shape[:-1], 0))

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Inside a fused forward: the chunked loss; otherwise ``ObservingLoss``'s."""
        state = self._pass.get()
        if state is None:
            return super().__call__(*args, **kwargs)
        state.loss_calls += 1
        call = _read_loss_call(args, kwargs).arguments
        hidden, state.hidden = state.hidden, None
        if hidden is None:
            self._refuse(
                f"{self.model_class} passes its loss_function logits that do not come from its "
                f"output embeddings ({type(self.head).__name__}), or calls it twice per forward; "
                "the fused path cannot compute them from hidden states"
            )
        labels, shift_labels = _targets_like(
            hidden.shape[:-1], hidden.device, call["labels"], call["shift_labels"]
        )
        features = self.transform.kwargs()
        if self.label_smoothing:
            features["label_smoothing"] = self.label_smoothing
        with capture() as own, _unsharded(self.head):
            loss = chunk_cross_entropy(
                hidden,
                self.head.weight,
                labels,
                shift_labels=shift_labels,
                logits_bias=self.head.bias,
                ignore_index=call["ignore_index"],
                num_items_in_batch=call["num_items_in_batch"],
                chunk_size=self.chunk_size,
                **features,
            )
        observed = own.observations[0] if own.observations else None  # none during a recompute
        if state.verifying and observed is not None and bool(observed.scored.any()):
            # A batch without a scored target verifies nothing (HF's own loss is 0/0 there):
            # verification waits for the first forward that scores a target.
            verify(self, call["logits"], loss, observed, state.head_dtype, args, kwargs)
        if observed is not None and self.active:
            record(observed.token_losses, observed.targets, observed.ignore_index)
        return loss

    def _refuse(self, reason: str) -> None:
        self.refusal = f"patch_model(fused=True) refuses {self.model_class}: {reason}"
        raise UnsupportedModelError(self.refusal)

    @property
    def verify_key(self) -> tuple:
        """What a verification vouches for: this head module and this transform."""
        return (id(self.head), self.transform, self.original)


def _fused_patch_of(model) -> FusedLoss | None:
    loss = vars(model).get("_loss_function", vars(model).get("loss_function"))
    return loss if isinstance(loss, FusedLoss) and loss.active else None


@contextlib.contextmanager
def _unsharded(head) -> Iterator[None]:
    """The output embeddings' parameters gathered for the fused loss, where they are an FSDP2
    unit of their own that resharded them when their forward returned."""
    weight = head.weight
    if not (_is_fsdp2(head) and type(weight).__name__ == "DTensor"):
        yield
        return
    head.unshard()
    try:
        yield
    finally:
        head.reshard()
