"""The Trainer side: ``ChannelLossCallback`` (the meter's steps around the
optimizer steps, the metrics in the training logs) and the Trainer loss paths
``attach`` makes observable.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from channel_loss.errors import ChannelLossMetadataError
from channel_loss.integrations._hf_fused import _fused_patch_of
from channel_loss.integrations._hf_models import _unwrap
from channel_loss.integrations._hf_observe import ObservingOutputsLoss
from channel_loss.integrations._hf_trl import has_trl_fused_head, observe_trl_fused_head
from channel_loss.layout import PackedLayout
from channel_loss.meter import ChannelLossMeter, columns_from_metrics, metrics_from_columns
from channel_loss.validation import is_int

# The public module's logger: one name to configure for the whole integration.
logger = logging.getLogger("channel_loss.integrations.transformers")


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


#: The attribute ``attach`` sets on a trainer whose own ``compute_loss`` may smooth in the
#: fused loss (see ``_fused_smoothing_compute_loss``).
_FUSED_SMOOTHING = "_channel_loss_fused_smoothing"


def _fused_smoothing_compute_loss(original):
    """``transformers.Trainer.compute_loss`` (``original``) as ``attach`` leaves it: on a
    trainer ``attach`` marked, a training call with the labels on a model that carries an
    active ``patch_model(model, fused=True)`` runs with the label smoother off (so the labels
    reach the model, which never forms the logits) and the fused loss smoothing by the
    smoother's ``epsilon``; both are restored when it returns. Any other trainer, or call,
    runs ``original`` as it is; a subclass's own ``compute_loss`` code around
    ``super().compute_loss``, or instead of it, sees the smoother as it is."""

    @functools.wraps(original)
    def compute_loss(self, model, inputs, *args: Any, **kwargs: Any):
        smoother = getattr(self, "label_smoother", None)
        fused = None
        if (
            getattr(self, _FUSED_SMOOTHING, False)
            and smoother is not None
            and getattr(self, "compute_loss_func", None) is None  # it makes the loss then
            and model.training
            and "labels" in inputs
        ):
            fused = _fused_patch_of(_unwrap(model, fused=False)[0])
        if fused is None:
            return original(self, model, inputs, *args, **kwargs)
        before = fused.label_smoothing
        fused.label_smoothing = float(smoother.epsilon)
        self.label_smoother = None
        try:
            return original(self, model, inputs, *args, **kwargs)
        finally:
            self.label_smoother = smoother
            fused.label_smoothing = before

    compute_loss.__channel_loss__ = True
    return compute_loss


def _with_fused_smoothing(trainer) -> None:
    """Mark ``trainer`` for ``_fused_smoothing_compute_loss``, which wraps
    ``transformers.Trainer.compute_loss`` once per process (a subclass's ``super()`` call
    reaches it; the trainer keeps its own class)."""
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        return
    if not getattr(Trainer.compute_loss, "__channel_loss__", False):
        Trainer.compute_loss = _fused_smoothing_compute_loss(Trainer.compute_loss)
    setattr(trainer, _FUSED_SMOOTHING, True)


def batch_layout(inputs: Mapping[str, Any], tail_padding_length=0) -> PackedLayout:
    """The ``PackedLayout`` of a Trainer batch: from ``position_ids`` where it has them
    (packed or padding-free rows; samples start at position 0, the last
    ``tail_padding_length`` positions of a row are padding), else one sample per row of
    ``attention_mask`` (right padding: the zeros after a row's ones; TRL's DPO batch).
    Raises ``ChannelLossMetadataError`` for a batch with neither, or left padding."""
    position_ids = inputs.get("position_ids")
    if position_ids is not None:
        return PackedLayout.from_position_ids(position_ids, tail_padding_length=tail_padding_length)
    mask = inputs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        raise ChannelLossMetadataError(
            "the batch has neither position_ids nor a [B, T] attention_mask to take its layout from"
        )
    mask = mask.detach().to("cpu", torch.bool)
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ChannelLossMetadataError(
            "the batch's attention_mask is not right-padded (a 1 after a 0 in a row): give "
            "position_ids, or open meter.micro_batch with your own layout"
        )
    positions = torch.arange(mask.shape[1]).expand(mask.shape)
    return PackedLayout.from_position_ids(
        positions, tail_padding_length=(mask.shape[1] - mask.sum(1)).tolist()
    )


def _open_micro_batches(trainer, meter: ChannelLossMeter, key: str) -> None:
    """Wrap ``trainer.compute_loss`` (on the instance) to measure each training call: see
    ``ChannelLossCallback.attach(source_ids_key=...)``."""
    original = trainer.compute_loss
    if getattr(original, "__channel_loss_micro_batches__", False):
        return

    @functools.wraps(original)
    def compute_loss(model, inputs, *args: Any, **kwargs: Any):
        source_ids = inputs.pop(key, None)
        tail = inputs.pop("tail_padding_length", 0)
        if not model.training:
            return original(model, inputs, *args, **kwargs)
        if source_ids is None:
            raise KeyError(
                f"ChannelLossCallback.attach(source_ids_key={key!r}): the training batch has no "
                f"{key!r} (its keys: {sorted(inputs)}); have the collator add one source id per "
                "sample, and set remove_unused_columns=False"
            )
        with meter.micro_batch(source_ids=source_ids, layout=batch_layout(inputs, tail)):
            return original(model, inputs, *args, **kwargs)

    compute_loss.__channel_loss_micro_batches__ = True
    trainer.compute_loss = compute_loss


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
      source_ids=..., layout=...)``: ``attach(trainer, source_ids_key=...)``
      does it from the batch, or a ``Trainer`` subclass's ``compute_loss``
      (only while ``model.training``), with the loss observed by
      ``patch_model(model)`` or computed by ``patch_model(model, fused=True)``
      (TRL's trainers: neither, ``attach`` observes TRL's fused LM head);
    * keep the per-sample ``source_ids`` in the batch (``remove_unused_columns
      =False`` or a collator that adds them) and pop them before the forward;
    * under DDP, build the meter with ``dp_group`` (and ``sp_group`` under
      sequence parallelism) so every rank logs the same global metrics;
    * persist ``meter.state_dict()`` with checkpoints if source names must stay
      stable across restarts.

    Callbacks see ``on_log`` in list order, and a Trainer puts the reporting
    callbacks (TensorBoard, W&B, ...) before the ones passed in ``callbacks=``.
    Use ``ChannelLossCallback(meter).attach(trainer)`` so that every reporter
    sees the metrics; passed in ``callbacks=`` without ``attach``, only
    ``state.log_history``, the console and callbacks after it do, and
    ``on_train_begin`` warns when ``args.report_to`` names reporters.

    ``attach`` also covers the Trainer recipes that compute the loss outside
    the model (the model's ``loss_function`` never runs, so nothing would be
    observed): with ``label_smoothing_factor > 0`` the Trainer's label
    smoother, and a ``compute_loss_func``, are wrapped to observe the
    per-token cross-entropy (NLL) of ``outputs.logits`` against the labels
    shifted by one (the causal-LM convention; the loss itself is unchanged).
    With TRL's ``SFTTrainer`` / ``DPOTrainer``, whose loss comes from TRL's fused
    LM head (``trl.trainer.utils.add_fused_lm_head``), ``attach`` records the
    per-token NLL of that head's log-probabilities on every gradient-taking
    forward (the same pass; loss and gradients untouched) and refuses a model
    that also carries ``patch_model(model, fused=True)`` (``UnsupportedModelError``
    naming TRL). When the model carries ``patch_model(model, fused=True)``, the Trainer's own
    ``compute_loss`` (directly, or through a subclass's ``super().compute_loss``)
    runs a training call with the label smoother switched off and the fused loss
    applying the smoothing (normalised by ``num_items_in_batch`` as the Trainer's
    smoother does), so label smoothing keeps the memory saving; for that
    ``transformers.Trainer.compute_loss`` is wrapped once per process, acting on
    attached trainers only. Evaluation and prediction keep the smoother, as
    unattached; a subclass's own code sees the smoother as it is; the model keeps
    no smoothing after the call. Attach before ``train()``.

    ``interval_from_logging_steps=True`` sets ``meter.interval`` at train
    begin to the Trainer's resolved ``state.logging_steps`` (an int also
    when ``args.logging_steps`` is the fractional form, a ratio of
    ``max_steps``), so exactly the logged steps are measured.
    """

    def __init__(self, meter: ChannelLossMeter, *, interval_from_logging_steps: bool = False):
        self.meter = meter
        self.interval_from_logging_steps = interval_from_logging_steps
        self._in_step = False
        self._attached = False
        self._trl_hook = None
        self._pending: list[dict[str, float]] = []

    def attach(self, trainer, *, source_ids_key: str | None = None) -> ChannelLossCallback:
        """Put this callback right after the Trainer's flow callback, before every reporter.

        Also makes the Trainer's own loss paths observable (label smoothing,
        ``compute_loss_func``) and TRL's fused LM head: see the class docstring.

        ``source_ids_key`` (e.g. ``"source_ids"``): the batch key under which the
        collator puts one source id per sample. Given, ``attach`` also opens
        ``meter.micro_batch`` around every training ``compute_loss`` call itself, so
        no Trainer subclass is needed: it pops the key (and ``tail_padding_length``,
        when the batch has it) and takes the layout from the batch (``batch_layout``).
        A training batch without the key raises ``KeyError`` (the Trainer's
        ``remove_unused_columns`` drops unknown columns: set it False). Evaluation
        batches lose the key and are not measured.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        flow = [i for i, cb in enumerate(callbacks) if type(cb).__name__ == "DefaultFlowCallback"]
        callbacks.insert(flow[-1] + 1 if flow else 0, self)
        self._attached = True
        model = trainer.model
        if has_trl_fused_head(
            model.get_base_model() if hasattr(model, "get_base_model") else model
        ):
            # TRL's SFT / DPO loss: its fused LM head's per-token log-probabilities.
            if self._trl_hook is None:
                self._trl_hook = observe_trl_fused_head(trainer, _fused_patch_of)
            trl = True
        else:
            trl = False
        smoother = getattr(trainer, "label_smoother", None)
        if smoother is not None and not isinstance(smoother, ObservingOutputsLoss):
            ignore_index = getattr(smoother, "ignore_index", -100)
            trainer.label_smoother = ObservingOutputsLoss(smoother, ignore_index=ignore_index)
        compute = getattr(trainer, "compute_loss_func", None)
        if compute is not None and not isinstance(compute, ObservingOutputsLoss):
            trainer.compute_loss_func = ObservingOutputsLoss(compute, always_shift=True)
        if smoother is not None and not trl:  # TRL never reaches Trainer.compute_loss's smoother
            _with_fused_smoothing(trainer)
        if source_ids_key is not None:
            _open_micro_batches(trainer, self.meter, source_ids_key)
        return self

    def _close_step(self) -> None:
        self._in_step = False
        metrics = self.meter.end_step()
        if metrics:
            self._pending.append(metrics)

    def on_train_begin(self, args, state, control, **kwargs):
        """Start clean; align the interval; warn about set-ups whose metrics reporters would miss."""
        self._pending.clear()
        if self.interval_from_logging_steps:
            steps = getattr(state, "logging_steps", None)
            if is_int(steps) and steps >= 1:
                self.meter.interval = int(steps)
        if self._attached:
            return
        reporters = [r for r in (getattr(args, "report_to", None) or []) if r != "none"]
        problems = []
        if reporters:
            problems.append(
                f"the reporters {reporters} run before a callback passed in callbacks= and "
                "never see the channel metrics"
            )
        if (getattr(args, "label_smoothing_factor", 0) or 0) > 0:
            problems.append(
                "with label_smoothing_factor > 0 the Trainer computes the loss itself and "
                "nothing is observed"
            )
        if problems:
            message = (
                "ChannelLossCallback was not attached: "
                + "; ".join(problems)
                + ". Use ChannelLossCallback(meter).attach(trainer) before train()"
            )
            logger.warning("channel_loss: %s", message)
            warnings.warn(message, UserWarning, stacklevel=2)

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
