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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from channel_loss.capture import active_capture, capture, record
from channel_loss.errors import ChannelLossError
from channel_loss.meter import ChannelLossMeter, columns_from_metrics, metrics_from_columns
from channel_loss.ops import chunk_cross_entropy, per_token_cross_entropy, resolve_targets
from channel_loss.validation import is_int, is_real

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "channel_loss.integrations.transformers needs Hugging Face transformers: "
        'pip install "channel-loss[hf]"'
    ) from error

__all__ = [
    "ChannelLossCallback",
    "FusedLoss",
    "LogitTransform",
    "LossPatch",
    "ObservingLoss",
    "ObservingOutputsLoss",
    "UnsupportedModelError",
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


# --------------------------------------------------------------------------- models and wrappers


class UnsupportedModelError(ChannelLossError, ValueError):
    """``patch_model`` cannot serve this model (the message names its class and the reason)."""


def _fsdp1_class():
    # Imported only when the program already uses it: FSDP1 wrappers exist only then.
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    return getattr(sys.modules["torch.distributed.fsdp"], "FullyShardedDataParallel", None)


def _unwrap(model, *, fused: bool) -> tuple[Any, list[str]]:
    """The transformers model inside DDP / DataParallel / ``torch.compile`` / PEFT wrappers.

    Returns it with the class names of the wrappers seen on the way (outermost
    first). PEFT wrappers are unwrapped to the model that owns
    ``loss_function`` (``get_base_model()``). FSDP1 flattens the parameters it
    wraps, so the fused path refuses it (FSDP2's ``fully_shard`` keeps the
    model itself and needs no unwrapping).
    """
    wrappers: list[str] = []
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            wrappers.append(type(model).__name__)
            model = model.module
            continue
        compiled = sys.modules.get("torch._dynamo.eval_frame")
        if compiled is not None and isinstance(model, compiled.OptimizedModule):
            wrappers.append(type(model).__name__)
            model = model._orig_mod
            continue
        peft = sys.modules.get("peft")
        if peft is not None and isinstance(model, peft.PeftModel):
            wrappers.append(type(model).__name__)
            model = model.get_base_model()
            continue
        fsdp1 = _fsdp1_class()
        if fsdp1 is not None and isinstance(model, fsdp1):
            if fused:
                raise UnsupportedModelError(
                    f"patch_model(fused=True) cannot see through FullyShardedDataParallel (FSDP1 "
                    f"flattens {type(model.module).__name__}'s parameters): use FSDP2's fully_shard, "
                    "or fused=False"
                )
            wrappers.append(type(model).__name__)
            model = model.module
            continue
        return model, wrappers


def _check_causal(model, original) -> None:
    """Refuse models whose loss is not HF's causal-LM (next-token) cross-entropy."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers < 4.46 has no loss_function at all
        return
    loss_type = getattr(model, "loss_type", None)
    mapped = LOSS_MAPPING.get(loss_type) if isinstance(loss_type, str) else None
    non_causal = (mapped is not None and mapped is not ForCausalLMLoss) or (
        original is not ForCausalLMLoss and original in LOSS_MAPPING.values()
    )
    if non_causal:
        name = getattr(original, "__name__", type(original).__name__)
        raise UnsupportedModelError(
            f"{type(model).__name__} computes its loss with {name} (loss_type={loss_type!r}), not "
            "the causal-LM next-token cross-entropy that channel_loss observes; it was left "
            "unpatched"
        )


# --------------------------------------------------------------------------- patch_model


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


# Config fields that give the logit transform HF models apply after the LM head
# (they only parametrise it: the first fused forward verifies the result).
# Multipliers, dividers (Granite's ``logits / logits_scaling``) and soft caps.
_SCALE_FIELDS = ("logit_scale", "lm_head_multiplier")
_DIVIDE_FIELDS = ("logits_scaling",)
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


def _configs_to_check(config) -> list[tuple[str, object]]:
    """The text (decoder) configs HF keeps inside composite models, then ``config``, with their paths."""
    found: list[tuple[str, object]] = []

    def add(path: str, value) -> None:
        if value is not None and all(value is not seen for _, seen in found):
            found.append(("config" if value is config else path, value))

    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            add("config.get_text_config(decoder=True)", get_text_config(decoder=True))
        except (TypeError, ValueError):  # older signature, or no single decoder config
            pass
        add("config.get_text_config()", get_text_config())
    for name in ("text_config", "language_config", "llm_config", "decoder"):
        add(f"config.{name}", getattr(config, name, None))
    add("config", config)
    return found


def _real_value(value) -> float | None:
    return float(value) if is_real(value) else None


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to ``lm_head(hidden)`` before its loss: ``softcap(logit_scale * x)``.

    ``fields`` names the config fields it was read from. ``kwargs()`` gives
    the matching ``chunk_cross_entropy`` keywords (empty for plain logits).
    """

    logit_scale: float | None = None
    softcap: float | None = None
    fields: tuple[str, ...] = ()

    @classmethod
    def of(cls, model) -> LogitTransform:
        """Read the transform from ``model.config`` and its text config (composite models)."""
        scale, cap, fields = 1.0, None, []
        seen: set[str] = set()
        for path, config in _configs_to_check(getattr(model, "config", None)):
            for name in (*_SCALE_FIELDS, *_DIVIDE_FIELDS, *_SOFTCAP_FIELDS):
                value = _real_value(getattr(config, name, None))
                if name in seen or value is None:
                    continue
                seen.add(name)  # the text config wins over the composite's top level
                if name in _SOFTCAP_FIELDS:
                    if value > 0:
                        cap = value
                        fields.append(f"{path}.{name}={value!r}")
                elif value != 1.0:
                    scale = scale / value if name in _DIVIDE_FIELDS else scale * value
                    fields.append(f"{path}.{name}={value!r}")
        return cls(None if scale == 1.0 else scale, cap, tuple(fields))

    def kwargs(self) -> dict[str, float]:
        """The ``chunk_cross_entropy`` keywords for this transform."""
        out = {}
        if self.logit_scale is not None:
            out["logit_scale"] = self.logit_scale
        if self.softcap is not None:
            out["softcap"] = self.softcap
        return out

    def describe(self, head: str) -> str:
        """The formula, e.g. ``softcap_30.0(0.5 * lm_head(h))``."""
        text = f"{head}(h)"
        if self.logit_scale is not None:
            text = f"{self.logit_scale!r} * {text}"
        if self.softcap is not None:
            text = f"softcap_{self.softcap!r}({text})"
        return text


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
# Set by fused_causal_lm_loss: fuse this forward even in eval mode.
_FORCE_FUSED: ContextVar[bool] = ContextVar("channel_loss_force_fused", default=False)


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
            self._verify(call["logits"], loss, observed, state.head_dtype, args, kwargs)
        if observed is not None and self.active:
            record(observed.token_losses, observed.targets, observed.ignore_index)
        return loss

    def _refuse(self, reason: str) -> None:
        self.refusal = f"patch_model(fused=True) refuses {self.model_class}: {reason}"
        raise UnsupportedModelError(self.refusal)

    def _verify(
        self, logits: torch.Tensor, loss: torch.Tensor, observed, head_dtype, args, kwargs
    ) -> None:
        """Compare the chunked op with the model's own logits and loss on this batch; refuse on a mismatch.

        The logits are judged at the coarser of their own dtype and ``head_dtype``, the
        dtype the output embeddings produced them in: a model that upcasts bf16 logits
        before its loss (``logits.float() / softcap``) still carries bf16 rounding."""
        formula = self.transform.describe(type(self.head).__name__)
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
                self._refuse(f"its logits {tuple(logits.shape)} do not fit {formula}: {error}")
            ours = observed.token_losses
            scored = observed.scored
            if not bool((own.isfinite() == ours.isfinite())[scored].all()):
                at = int(((own.isfinite() != ours.isfinite()) & scored).reshape(-1).nonzero()[0])
                self._refuse(
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
                self._refuse(
                    f"the logits it passes to loss_function are not {formula} of the hidden states "
                    f"its output embeddings receive (read from {list(self.transform.fields)}): "
                    f"at token {worst} its cross-entropy is {float(own.reshape(-1)[worst]):.6g}, "
                    f"the fused one {float(observed.token_losses.reshape(-1)[worst]):.6g}"
                )
            if not self.label_smoothing:
                reference = self.original(*args, **kwargs)
                # The mean cross-entropy of the model's own logits, reduced as the op reduces
                # its own (the same divisor: scored tokens or num_items_in_batch): the loss
                # function must give it, from the same logits, with no rounding between them.
                own_sum, ours_sum = own[scored].double().sum(), ours[scored].double().sum()
                expected = loss.detach().double() * (own_sum / ours_sum if ours_sum else 1.0)
                if not torch.allclose(
                    expected.float(), reference.detach().float(), rtol=_LOSS_RTOL, atol=0.0
                ):
                    name = getattr(self.original, "__name__", type(self.original).__name__)
                    self._refuse(
                        f"its loss_function {name} gives {float(reference):.6g} on its own logits, "
                        f"chunk_cross_entropy {float(loss):.6g}: it is not the mean next-token "
                        "cross-entropy the fused path computes"
                    )
        self.verified = True
        model = self._model()
        if model is not None:
            _VERIFIED.setdefault(model, set()).add(self.verify_key)

    @property
    def verify_key(self) -> tuple:
        """What a verification vouches for: this head module and this transform."""
        return (id(self.head), self.transform, self.original)


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
    head = _output_embeddings(target)
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise UnsupportedModelError(
            f"patch_model(fused=True) refuses {name}: its output embeddings are "
            f"{_class_name(head)}, not a plain torch.nn.Linear (the fused path computes "
            "F.linear(hidden, weight, bias) chunk by chunk); use fused=False"
        )
    transform = LogitTransform.of(target)
    loss = FusedLoss(original, model=target, head=head, transform=transform, chunk_size=chunk_size)
    loss.verified = loss.verify_key in _VERIFIED.get(target, ())
    head_saved = vars(head).get("forward", _MISSING)
    target.loss_function = loss
    target.forward = loss.patched_forward
    head.forward = loss.head_forward
    return LossPatch(target, loss, saved, head=head, head_saved=head_saved)


def _output_embeddings(model):
    """``model.get_output_embeddings()``, or None where it has none."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


#: Wrappers whose forward is their wrapped module's: torch.compile's and activation
#: checkpointing's. A head wrapped by one after patching still runs the patched forward.
_FORWARDING = ("_orig_mod", "_checkpoint_wrapped_module")


def _forwarded_to(module):
    """The module ``module``'s forward ends in, through ``_FORWARDING`` wrappers."""
    for _ in range(8):  # a bound: wrappers nest a few deep at most
        inner = next((getattr(module, a) for a in _FORWARDING if hasattr(module, a)), None)
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return module


def _class_name(obj) -> str:
    """The qualified class name of ``obj`` (PEFT's LoRA layer is also called ``Linear``)."""
    kind = type(obj)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _fused_patch_of(model) -> FusedLoss | None:
    loss = vars(model).get("_loss_function", vars(model).get("loss_function"))
    return loss if isinstance(loss, FusedLoss) and loss.active else None


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


def _is_fsdp2(model) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return module is not None and isinstance(model, module)


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
      by ``patch_model(model)`` or computed by ``patch_model(model, fused=True)``;
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
    When the model carries ``patch_model(model, fused=True)``, the Trainer's own
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
        self._pending: list[dict[str, float]] = []

    def attach(self, trainer) -> ChannelLossCallback:
        """Put this callback right after the Trainer's flow callback, before every reporter.

        Also makes the Trainer's own loss paths observable (label smoothing,
        ``compute_loss_func``): see the class docstring.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        flow = [i for i, cb in enumerate(callbacks) if type(cb).__name__ == "DefaultFlowCallback"]
        callbacks.insert(flow[-1] + 1 if flow else 0, self)
        self._attached = True
        smoother = getattr(trainer, "label_smoother", None)
        if smoother is not None and not isinstance(smoother, ObservingOutputsLoss):
            ignore_index = getattr(smoother, "ignore_index", -100)
            trainer.label_smoother = ObservingOutputsLoss(smoother, ignore_index=ignore_index)
        compute = getattr(trainer, "compute_loss_func", None)
        if compute is not None and not isinstance(compute, ObservingOutputsLoss):
            trainer.compute_loss_func = ObservingOutputsLoss(compute, always_shift=True)
        if smoother is not None:
            _with_fused_smoothing(trainer)
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
