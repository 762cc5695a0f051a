"""Hugging Face transformers integration: observe an HF causal LM's loss, log it from the Trainer.

Three pieces (install with the ``hf`` extra):

* ``patch_model(model)`` — the drop-in path for any HF causal LM that returns
  logits. HF's causal LMs compute their loss as ``self.loss_function(logits=...,
  labels=..., vocab_size=..., **kwargs)``; the patch replaces that attribute on
  the *instance* with a function that first calls the original (so loss and
  gradients are bitwise unchanged) and then, only while a ``capture()`` scope is
  open (for example a ``ChannelLossMeter.micro_batch``), hands detached
  per-token losses from the same logits and the same targets to the scope.
* ``patch_model(model, fused=True)`` — the fused path: in training forwards
  with labels, the output embeddings hand their hidden states to the loss
  function, which computes ``chunk_cross_entropy`` from them inside the
  model's own forward, so ``[tokens, vocab]`` logits are never materialised,
  the per-token losses come out of the same pass, and DDP, FSDP2, PEFT and
  the model's MoE aux loss compose. ``fused_causal_lm_loss(model, ...)`` is
  the one-call form.
* ``ChannelLossCallback(meter)`` — a ``TrainerCallback`` that opens and closes
  the meter's steps around the Trainer's optimizer steps and adds the metrics
  to the Trainer's training logs.

Example (custom loop)::

    meter = ChannelLossMeter()
    handle = patch_model(model)
    meter.begin_step()
    with meter.micro_batch(source_ids=ids, layout=PackedLayout.from_position_ids(pos)):
        loss = model(input_ids=x, position_ids=pos, labels=y).loss
    loss.backward()
    metrics = meter.end_step()
    handle.remove()

This module is the public import path; the pieces live beside it in private
modules: ``_hf_models`` (wrappers, causal check, logit transform),
``_hf_observe`` (the observing loss), ``_hf_fused`` (the fused patch),
``_hf_verify`` (the first fused forward's check) and ``_hf_trainer`` (the
callback).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

try:
    from transformers import TrainerCallback  # noqa: F401 - the hf extra's check, before the rest
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "channel_loss.integrations.transformers needs Hugging Face transformers: "
        'pip install "channel-loss[hf]"'
    ) from error

from channel_loss.integrations._hf_fused import _FORCE_FUSED, FusedLoss, _fused_patch_of
from channel_loss.integrations._hf_models import (
    LogitTransform,
    UnsupportedModelError,
    _check_causal,
    _class_name,
    _is_fsdp2,
    _output_embeddings,
    _unwrap,
)
from channel_loss.integrations._hf_observe import ObservingLoss, ObservingOutputsLoss
from channel_loss.integrations._hf_trainer import (
    ChannelLossCallback,
    batch_layout,
    merge_step_metrics,
)
from channel_loss.integrations._hf_trl import has_trl_fused_head, trl_fused_refusal
from channel_loss.integrations._hf_verify import _VERIFIED

__all__ = [
    "ChannelLossCallback",
    "FusedLoss",
    "LogitTransform",
    "LossPatch",
    "ObservingLoss",
    "ObservingOutputsLoss",
    "UnsupportedModelError",
    "batch_layout",
    "fused_causal_lm_loss",
    "merge_step_metrics",
    "patch_model",
]

logger = logging.getLogger(__name__)

_MISSING = object()
# Instance attributes the patch may touch: HF's ``loss_function`` property
# stores an assigned value in ``_loss_function``; a model without the property
# gets a plain ``loss_function`` instance attribute instead.
_PATCHED_ATTRIBUTES = ("_loss_function", "loss_function")


class LossPatch:
    """The handle ``patch_model`` returns; calling it (or ``remove()``) undoes the patch.

    ``model`` is the transformers model that was patched (inside DDP / PEFT
    wrappers), ``loss`` the installed ``ObservingLoss`` (a ``FusedLoss`` with
    ``fused=True``). Removal is idempotent. It restores exactly the instance
    attributes the model (and, fused, its output embeddings) had before. If
    something replaced the model's loss function after the patch, removal
    leaves that in place and only switches the observer off (a warning says
    so), so the later change is not silently undone.
    Also a context manager: ``with patch_model(model): ...``.
    """

    def __init__(
        self,
        model,
        loss: ObservingLoss,
        saved: dict[str, object],
        head=None,
        head_saved: object = _MISSING,
    ):
        self.model = model
        self.loss = loss
        self._saved = saved
        self._head = head
        self._head_saved = head_saved
        self._removed = False

    @property
    def active(self) -> bool:
        """True until the patch is removed."""
        return not self._removed

    @property
    def fused(self) -> bool:
        """True for ``patch_model(..., fused=True)``."""
        return isinstance(self.loss, FusedLoss)

    def remove(self) -> None:
        """Undo the patch (a no-op the second time)."""
        if self._removed:
            return
        self._removed = True
        self.loss.active = False
        if isinstance(self.loss, FusedLoss):
            _restore(self._head, "forward", self.loss.head_forward, self._head_saved)
            _restore(self.model, "forward", self.loss.patched_forward, self._saved["forward"])
        if getattr(self.model, "loss_function", None) is not self.loss:
            logger.warning(
                "channel_loss: %s.loss_function was replaced after patch_model(); leaving the "
                "replacement in place (the channel-loss observer is switched off)",
                type(self.model).__name__,
            )
            return
        state = vars(self.model)
        for name in _PATCHED_ATTRIBUTES:
            value = self._saved[name]
            if value is _MISSING:
                state.pop(name, None)
            else:
                state[name] = value

    def __call__(self) -> None:
        """Same as ``remove()``."""
        self.remove()

    def __enter__(self) -> LossPatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def _restore(module, name: str, ours, saved) -> None:
    """Put back ``module.<name>`` unless something replaced ours since (then leave theirs)."""
    state = vars(module)
    if state.get(name) != ours:
        return
    if saved is _MISSING:
        state.pop(name, None)
    else:
        state[name] = saved


def patch_model(model, *, fused: bool = False, chunk_size: int | None = None) -> LossPatch:
    """Install an observing (or, ``fused=True``, a fused) loss on an HF causal LM; return its handle.

    ``model`` is a transformers ``PreTrainedModel`` whose forward computes its
    loss with ``self.loss_function(logits, labels, vocab_size, **kwargs)``
    (every ``*ForCausalLM`` in transformers >= 4.46), or a DDP /
    DataParallel / ``torch.compile`` / PEFT wrapper around one: the patch goes
    on the model that owns ``loss_function`` (``handle.model``), so calls
    through the wrapper keep the wrapper's behaviour (DDP's gradient hooks,
    PEFT's adapters). Models whose loss is not the causal next-token
    cross-entropy (``loss_type`` ``ForMaskedLM``, ``ForSequenceClassification``,
    ...) raise ``UnsupportedModelError`` and are left untouched.

    ``fused=False`` (the observer):

    * the loss and every gradient are bitwise identical to the unpatched
      model's (the original loss function computes them; observation uses
      detached logits under ``no_grad``);
    * inside an open ``capture()`` scope (e.g. ``ChannelLossMeter.micro_batch``)
      each loss call records one ``TokenObservation``: fp32 per-token CE of the
      logits against the targets HF uses (``shift_labels`` when given, else
      ``labels`` shifted by one), 0.0 where ignored; nothing is recorded or
      computed outside a scope or during a backward-pass recompute.

    ``fused=True`` (the memory saving): in every forward that runs in training
    mode with ``labels=`` given as a keyword, the output embeddings
    (``get_output_embeddings()``, a ``torch.nn.Linear``) hand their input
    hidden states on instead of computing logits, and the loss function
    computes ``chunk_cross_entropy`` from them (``[tokens, vocab]`` logits are
    never materialised; the observation comes from the same pass). Everything
    else stays the model's own forward: whatever it adds to the loss (the MoE
    router aux loss), DDP's and FSDP2's hooks, PEFT's adapters. The logit
    transform (``logit_scale`` / ``logits_scaling`` / ``lm_head_multiplier``,
    ``final_logit_softcapping`` / ``logits_soft_cap`` /
    ``output_logit_soft_cap``, on the config or its text config) is passed to
    the op. ``outputs.logits`` of a fused forward is an empty
    ``[..., 0]`` tensor (no logits were computed); eval-mode forwards and
    forwards without labels are the model's ordinary ones.

    The first fused forward that scores a target verifies the design on that
    batch: the output embeddings still compute real logits, the model
    transforms them as it does, and the per-token cross-entropy of those
    logits must equal the chunked op's (rtol = atol = 1e-4 for fp32 logits,
    5e-2 bf16, 1e-2 fp16, plus what rounding the logits to their dtype can
    move it by), and the model's own loss function on them must give their
    mean cross-entropy, reduced as the op reduces its own. Otherwise every fused forward raises
    ``UnsupportedModelError`` naming the model class and what differed (a
    head that is not ``lm_head(hidden)``, an unknown transform, a custom
    loss, a loss computed without ``loss_function``). A forward whose targets
    are all ``ignore_index`` verifies nothing: it returns the op's loss (0.0,
    zero gradients) and verification waits for the next forward; so does one
    whose scored losses are not finite, the model's own too. Verification
    is local to the process (no collective, so it cannot hang): under DDP a
    rank whose batch scores nothing defers it to a later batch of its own
    while the others verify; its loss still uses the same parameters, so
    DDP's gradient all-reduce is unchanged. Until verified, each fused forward
    also computes the real logits once, to compare with.

    ``model.forward`` presents the original forward's signature
    (``inspect.signature``), so the Trainer's ``remove_unused_columns`` and
    ``_supports_logits_to_keep()`` behave as unpatched. ``copy.deepcopy`` /
    pickling the patched model gives a patched copy tied to itself (the
    handle removes the original's patch only).

    ``chunk_size`` bounds the extra memory to ``chunk_size x vocab`` fp32
    values (None: the ops' default rule). Raises ``TypeError`` for a model
    without ``loss_function`` and ``RuntimeError`` when already patched. The
    original loss is resolved once, now: change ``model.loss_function`` (or
    ``config.loss_type``) before patching, not after.
    """
    target, wrappers = _unwrap(model, fused=fused)
    original = getattr(target, "loss_function", None)
    if original is None or not callable(original):
        inside = f" (inside {' > '.join(wrappers)})" if wrappers else ""
        raise TypeError(
            f"{type(target).__name__}{inside} has no callable loss_function; patch_model() needs "
            "a transformers causal LM (transformers >= 4.46) or a DDP / PEFT wrapper around one"
        )
    if isinstance(original, ObservingLoss):
        raise RuntimeError(
            f"{type(target).__name__} is already patched by channel_loss; remove that handle first"
        )
    _check_causal(target, original)
    state = vars(target)
    saved = {name: state.get(name, _MISSING) for name in (*_PATCHED_ATTRIBUTES, "forward")}
    if not fused:
        loss = ObservingLoss(original, chunk_size=chunk_size)
        # HF's property setter stores it in ``_loss_function``; plain modules get an attribute.
        target.loss_function = loss
        return LossPatch(target, loss, saved)

    name = type(target).__name__
    if has_trl_fused_head(target):
        raise UnsupportedModelError(trl_fused_refusal(name))
    head = _output_embeddings(target)
    # An activation-checkpointing wrapper forwards to the module inside: patch that one,
    # exactly as patching first and wrapping after does.
    while isinstance(getattr(head, "_checkpoint_wrapped_module", None), torch.nn.Module):
        head = head._checkpoint_wrapped_module
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise UnsupportedModelError(
            f"patch_model(fused=True) refuses {name}: its output embeddings are "
            f"{_class_name(head)}, not a plain torch.nn.Linear (the fused path computes "
            "F.linear(hidden, weight, bias) chunk by chunk); a torch.compile wrapper may be "
            "applied after patch_model, not before; otherwise use fused=False"
        )
    transform = LogitTransform.of(target)
    loss = FusedLoss(original, model=target, head=head, transform=transform, chunk_size=chunk_size)
    loss.verified = loss.verify_key in _VERIFIED.get(target, ())
    head_saved = vars(head).get("forward", _MISSING)
    target.loss_function = loss
    target.forward = loss.patched_forward
    head.forward = loss.head_forward
    return LossPatch(target, loss, saved, head=head, head_saved=head_saved)


def fused_causal_lm_loss(
    model,
    *,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    **model_inputs: Any,
) -> torch.Tensor:
    """``model(**model_inputs, labels=labels, ...).loss`` computed by the fused path, in any mode.

    A thin wrapper over ``patch_model(model, fused=True)``: unless the model
    already carries a fused patch, one is installed for this call only. The
    result is the model's own loss (MoE router aux loss included) up to
    float rounding, with the cross-entropy computed by
    ``chunk_cross_entropy`` (O(chunk_size x vocab) extra memory) and, inside
    a ``capture()`` scope, the per-token losses of this very pass recorded.
    The first call on a model verifies it as ``patch_model`` describes
    (once per model: later calls skip it) and raises
    ``UnsupportedModelError`` when the model cannot be fused.

    ``model`` may be a DDP / PEFT / ``torch.compile`` wrapper (the forward
    runs through it) or an FSDP2 (``fully_shard``) model. Passing the bare
    module of a DDP model in a multi-rank run skips DDP's gradient
    all-reduce: a ``UserWarning`` says so. ``shift_labels`` alone is enough
    (it is also passed as ``labels``, which HF needs to compute a loss).
    """
    target, wrappers = _unwrap(model, fused=True)
    if (
        not wrappers
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and not _is_fsdp2(target)
    ):
        warnings.warn(
            f"fused_causal_lm_loss({type(target).__name__}) in a world of "
            f"{dist.get_world_size()} ranks: a bare module's gradients are not all-reduced; "
            "pass the DistributedDataParallel wrapper (or use patch_model(ddp_model, fused=True))",
            UserWarning,
            stacklevel=2,
        )
    if labels is None and shift_labels is None:
        raise ValueError("fused_causal_lm_loss needs labels or shift_labels")
    loss_kwargs: dict[str, Any] = {"labels": labels if labels is not None else shift_labels}
    if shift_labels is not None:
        loss_kwargs["shift_labels"] = shift_labels
    if num_items_in_batch is not None:
        loss_kwargs["num_items_in_batch"] = num_items_in_batch
    if ignore_index != -100:
        loss_kwargs["ignore_index"] = ignore_index
    token = _FORCE_FUSED.set(True)
    try:
        if _fused_patch_of(target) is not None:
            outputs = model(**model_inputs, **loss_kwargs)
        else:
            with patch_model(model, fused=True, chunk_size=chunk_size):
                outputs = model(**model_inputs, **loss_kwargs)
    finally:
        _FORCE_FUSED.reset(token)
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
