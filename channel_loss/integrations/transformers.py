"""Hugging Face transformers integration: observe an HF causal LM's loss, log it from the Trainer.

Three pieces (install with the ``hf`` extra):

* ``patch_model(model)`` — the drop-in path for any HF causal LM that returns
  logits. HF's causal LMs compute their loss as ``self.loss_function(logits=...,
  labels=..., vocab_size=..., **kwargs)``; the patch replaces that attribute on
  the *instance* with a function that first calls the original (so loss and
  gradients are bitwise unchanged) and then, only while a ``capture()`` scope is
  open (for example a ``ChannelLossMeter.micro_batch``), hands detached
  per-token losses from the same logits and the same targets to the scope.
* ``fused_causal_lm_loss(model, ...)`` — the fused path: runs the model's
  decoder and computes the loss with ``chunk_cross_entropy`` from
  ``last_hidden_state`` and ``lm_head.weight``, so ``[tokens, vocab]`` logits
  are never materialised and the per-token losses come out of the same pass.
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
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from channel_loss.capture import active_capture, record
from channel_loss.meter import ChannelLossMeter, columns_from_metrics, metrics_from_columns
from channel_loss.ops import chunk_cross_entropy, per_token_cross_entropy, resolve_targets

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "channel_loss.integrations.transformers needs Hugging Face transformers: "
        'pip install "channel-loss[hf]"'
    ) from error

__all__ = [
    "ChannelLossCallback",
    "LossPatch",
    "ObservingLoss",
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


# --------------------------------------------------------------------------- patch_model


class ObservingLoss:
    """A loss function with HF's ``loss_function`` signature that also observes per-token losses.

    Calls ``original`` with the arguments it was given and returns its result
    untouched. Afterwards, while a ``capture()`` scope is open and the patch is
    active, records ``per_token_cross_entropy`` of the detached logits against
    the targets HF uses (``shift_labels`` if given, else ``labels`` shifted left
    by one with ``ignore_index`` appended). Outside a scope it costs nothing.
    """

    def __init__(self, original, *, chunk_size: int | None = None):
        self.original = original
        self.chunk_size = chunk_size
        self.active = True

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: int | torch.Tensor | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Return ``original(...)``'s loss; record per-token losses into the open capture scope."""
        # Forward only what the caller gave (HF's defaults otherwise): a custom
        # original that lacks one of these keywords keeps working.
        extra = dict(kwargs)
        if num_items_in_batch is not None:
            extra["num_items_in_batch"] = num_items_in_batch
        if ignore_index != -100:
            extra["ignore_index"] = ignore_index
        if shift_labels is not None:
            extra["shift_labels"] = shift_labels
        loss = self.original(logits=logits, labels=labels, vocab_size=vocab_size, **extra)
        if self.active and active_capture() is not None:
            self._observe(logits, labels, shift_labels, ignore_index)
        return loss

    def _observe(self, logits, labels, shift_labels, ignore_index: int) -> None:
        if shift_labels is None and labels is None:
            return  # nothing is scored: the original loss saw no targets either
        lead = logits.shape[:-1]
        if shift_labels is not None:
            labels = None  # HF scores shift_labels when both are given
            shift_labels = shift_labels.to(logits.device)
            if shift_labels.shape != lead and shift_labels.numel() == lead.numel():
                shift_labels = shift_labels.reshape(lead)  # HF flattens both; flat is fine there
        else:
            labels = labels.to(logits.device)
        # The same shift as HF's ForCausalLMLoss: shift_labels, else labels shifted by one.
        targets = resolve_targets(lead, labels, shift_labels, ignore_index, logits.shape[-1],
                                  "logits")
        losses = per_token_cross_entropy(
            logits=logits.detach(), shift_labels=targets, ignore_index=ignore_index,
            chunk_size=self.chunk_size,
        )
        record(losses, targets, ignore_index)


class LossPatch:
    """The handle ``patch_model`` returns; calling it (or ``remove()``) undoes the patch.

    Removal is idempotent. It restores exactly the instance attributes the
    model had before. If something replaced the model's loss function after
    the patch, removal leaves that in place and only switches the observer off
    (a warning says so), so the later change is not silently undone.
    Also a context manager: ``with patch_model(model): ...``.
    """

    def __init__(self, model, loss: ObservingLoss, saved: dict[str, object]):
        self.model = model
        self.loss = loss
        self._saved = saved
        self._removed = False

    @property
    def active(self) -> bool:
        """True until the patch is removed."""
        return not self._removed

    def remove(self) -> None:
        """Undo the patch (a no-op the second time)."""
        if self._removed:
            return
        self._removed = True
        self.loss.active = False
        if getattr(self.model, "loss_function", None) is not self.loss:
            logger.warning(
                "channel_loss: %s.loss_function was replaced after patch_model(); leaving the "
                "replacement in place (the channel-loss observer is switched off)",
                type(self.model).__name__,
            )
            return
        state = vars(self.model)
        for name, value in self._saved.items():
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


def patch_model(model, *, chunk_size: int | None = None) -> LossPatch:
    """Install an observing loss function on an HF causal LM; return the handle that removes it.

    ``model`` is a transformers ``PreTrainedModel`` whose forward computes its
    loss with ``self.loss_function(logits=..., labels=..., vocab_size=...,
    **kwargs)`` (every ``*ForCausalLM`` in transformers >= 4.46). Pass the
    model itself, not a DDP / FSDP wrapper around it.

    Contract:

    * the loss and every gradient are bitwise identical to the unpatched
      model's (the original loss function computes them; observation uses
      detached logits under ``no_grad``);
    * inside an open ``capture()`` scope (e.g. ``ChannelLossMeter.micro_batch``)
      each loss call records one ``TokenObservation``: fp32 per-token CE of the
      logits against the targets HF uses (``shift_labels`` when given, else
      ``labels`` shifted by one), 0.0 where ignored; nothing is recorded or
      computed outside a scope or during a backward-pass recompute;
    * the original is resolved once, now: change ``model.loss_function`` (or
      ``config.loss_type``) before patching, not after.

    ``chunk_size`` bounds the observer's extra memory to ``chunk_size x vocab``
    fp32 values (None: ``per_token_cross_entropy``'s default for logits). Raises ``TypeError`` for a model without ``loss_function`` and
    ``RuntimeError`` when the model is already patched.
    """
    original = getattr(model, "loss_function", None)
    if original is None or not callable(original):
        raise TypeError(
            f"{type(model).__name__} has no callable loss_function; patch_model() needs a "
            "transformers causal LM (transformers >= 4.46), not a wrapper around one"
        )
    if isinstance(original, ObservingLoss):
        raise RuntimeError(
            f"{type(model).__name__} is already patched by channel_loss; remove that handle first"
        )
    state = vars(model)
    saved = {name: state.get(name, _MISSING) for name in _PATCHED_ATTRIBUTES}
    loss = ObservingLoss(original, chunk_size=chunk_size)
    # HF's property setter stores it in ``_loss_function``; plain modules get an attribute.
    model.loss_function = loss
    return LossPatch(model, loss, saved)


# --------------------------------------------------------------------------- fused path

# Config fields with which a model's forward rescales or caps its logits after
# the LM head (Gemma 2/3: final_logit_softcapping, Cohere: logit_scale, Granite:
# logits_scaling, ...); the fused path computes ``lm_head(hidden)`` only, so it
# refuses them. A value of None / False / 1 (scaling) means "no transform".
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
    "lm_head_multiplier", "output_multiplier", "mup_enabled",
)


def _configs_to_check(config) -> list[tuple[str, object]]:
    """``config`` and the text (decoder) configs HF keeps inside composite models, with their paths."""
    found: list[tuple[str, object]] = []

    def add(path: str, value) -> None:
        if value is not None and all(value is not seen for _, seen in found):
            found.append((path, value))

    add("config", config)
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        add("config.get_text_config()", get_text_config())
        try:
            add("config.get_text_config(decoder=True)", get_text_config(decoder=True))
        except (TypeError, ValueError):  # older signature, or no single decoder config
            pass
    for name in ("text_config", "language_config", "llm_config", "decoder"):
        add(f"config.{name}", getattr(config, name, None))
    return found


def _check_no_logit_transform(model) -> None:
    """Raise ``ValueError`` naming the config field when ``model`` scales or caps its logits."""
    for path, config in _configs_to_check(getattr(model, "config", None)):
        for name in _LOGIT_TRANSFORMS:
            value = getattr(config, name, None)
            if value is None or value is False or (
                isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 1
            ):
                continue
            raise ValueError(
                f"{type(model).__name__} transforms its logits ({path}.{name}={value!r}); "
                "fused_causal_lm_loss computes lm_head(hidden) only: use patch_model() instead"
            )


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
    """The causal-LM loss of an HF model from its last hidden state, without materialising logits.

    Runs ``model.base_model(**model_inputs)`` (``input_ids``,
    ``attention_mask``, ``position_ids``, ...), then returns
    ``chunk_cross_entropy(last_hidden_state, lm_head.weight, labels,
    shift_labels=..., num_items_in_batch=..., logits_bias=lm_head.bias)``: the
    same value as ``model(..., labels=labels).loss`` up to float rounding (the
    logits are computed chunk by chunk), with O(chunk_size x vocab) extra
    memory (None: ``chunk_cross_entropy``'s default rule), and inside a ``capture()`` scope the per-token losses of this very
    pass are recorded (no second LM-head projection).

    Valid for models whose logits are exactly ``lm_head(last_hidden_state)``
    (Llama, Mistral, Qwen2/3, ...); raises ``ValueError`` for configs that
    scale or soft-cap logits (``final_logit_softcapping``, ``logit_scale``,
    ``logits_scaling``, ...: checked on ``config`` and on the text config of
    composite models, ``config.get_text_config()``, e.g. a PaliGemma whose
    Gemma 2 text model soft-caps), or for an output layer that is not a
    linear head.
    Call it with the unwrapped model (under DDP, call the wrapper's forward:
    use ``patch_model`` instead).
    """
    _check_no_logit_transform(model)
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__}.get_output_embeddings() is {type(head).__name__}, not a "
            "torch.nn.Linear LM head: use patch_model() instead"
        )
    outputs = model.base_model(**model_inputs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    return chunk_cross_entropy(
        hidden, head.weight, labels, shift_labels=shift_labels,
        logits_bias=head.bias, ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
    )


# --------------------------------------------------------------------------- Trainer callback


def merge_step_metrics(
    steps: Iterable[Mapping[str, float]], *, prefix: str = "channel_loss"
) -> dict[str, float]:
    """Combine several steps' ``ChannelLossMeter.end_step()`` dicts into one for a logging window.

    Token-weighted, like the Trainer's own averaged ``loss``: each step's
    per-source columns (``channel_loss.attribution.COLUMNS``: loss sum,
    tokens, samples) are read back with ``columns_from_metrics``, summed, and
    turned into metrics again, so ``{prefix}/name`` is the source's loss sum
    over all the steps divided by its tokens, counts are summed, ``_weighted``
    is its loss sum over all scored tokens of all the steps, and dropped
    micro-batches are summed. A single step comes back unchanged (a copy).
    """
    steps = [dict(s) for s in steps if s]
    if len(steps) <= 1:
        return steps[0] if steps else {}
    total: dict[str, list[float]] = {}
    dropped = 0.0
    for step in steps:
        columns, step_dropped = columns_from_metrics(step, prefix=prefix)
        dropped += step_dropped
        for name, values in columns.items():
            into = total.setdefault(name, [0.0] * len(values))
            for i, value in enumerate(values):
                into[i] += value
    return metrics_from_columns(total, prefix=prefix, dropped=dropped)


class ChannelLossCallback(TrainerCallback):
    """Runs a ``ChannelLossMeter``'s steps alongside the Trainer and logs its metrics.

    Lifecycle: ``on_step_begin`` opens a meter step numbered like the Trainer
    will log it (``state.global_step + 1``), so ``ChannelLossMeter(interval=
    args.logging_steps)`` measures exactly the logged steps and costs nothing
    on the others; ``on_step_end`` (after the optimizer step, before the
    Trainer builds its logs) closes it with ``end_step()`` (a collective: every
    rank runs it); ``on_log`` adds the metrics gathered since the previous
    training log (merged with ``merge_step_metrics``) to the next log that
    carries ``"loss"``, and to that entry of ``state.log_history``.

    What the training code must still do:

    * wrap each micro-batch's forward + loss in ``meter.micro_batch(
      source_ids=..., layout=...)`` (in a ``Trainer`` subclass's
      ``compute_loss``, only while ``model.training``), with the loss observed
      by ``patch_model(model)`` or computed by ``fused_causal_lm_loss``;
    * keep the per-sample ``source_ids`` in the batch (``remove_unused_columns
      =False`` or a collator that adds them) and pop them before the forward;
    * under DDP, build the meter with ``dp_group`` (and ``sp_group`` under
      sequence parallelism) so every rank logs the same global metrics;
    * persist ``meter.state_dict()`` with checkpoints if source names must stay
      stable across restarts.

    Callbacks see ``on_log`` in list order, and a Trainer puts the reporting
    callbacks (TensorBoard, W&B, ...) before the ones passed in ``callbacks=``.
    Use ``ChannelLossCallback(meter).attach(trainer)`` so that every reporter
    sees the metrics; passed in ``callbacks=``, only ``state.log_history``,
    the console and callbacks after it do.
    """

    def __init__(self, meter: ChannelLossMeter):
        self.meter = meter
        self._in_step = False
        self._pending: list[dict[str, float]] = []

    def attach(self, trainer) -> ChannelLossCallback:
        """Put this callback right after the Trainer's flow callback, before every reporter."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        flow = [i for i, cb in enumerate(callbacks) if type(cb).__name__ == "DefaultFlowCallback"]
        callbacks.insert(flow[-1] + 1 if flow else 0, self)
        return self

    def _close_step(self) -> None:
        self._in_step = False
        metrics = self.meter.end_step()
        if metrics:
            self._pending.append(metrics)

    def on_train_begin(self, args, state, control, **kwargs):
        """Start clean: no step open, nothing pending."""
        self._pending.clear()

    def on_step_begin(self, args, state, control, **kwargs):
        """Open the meter step for the optimizer step that follows."""
        if self._in_step:
            # A step the Trainer never closed: close it (every rank sees the same calls).
            self._close_step()
        self.meter.begin_step(step=state.global_step + 1)
        self._in_step = True

    def on_step_end(self, args, state, control, **kwargs):
        """Close the meter step (collective) and keep its metrics for the next training log."""
        if self._in_step:
            self._close_step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the pending metrics to a training log (one with ``"loss"``)."""
        if logs is None or "loss" not in logs or not self._pending:
            return
        merged = merge_step_metrics(self._pending, prefix=self.meter.prefix)
        self._pending.clear()
        logs.update(merged)
        # The Trainer appended a copy of ``logs`` to log_history before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(merged)

    def on_train_end(self, args, state, control, **kwargs):
        """Close a step left open by an interrupted accumulation window."""
        if self._in_step:
            self._close_step()
        self._pending.clear()
