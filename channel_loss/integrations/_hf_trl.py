"""TRL's trainers (``trl.SFTTrainer``, ``trl.DPOTrainer``): their loss comes from TRL's own
fused LM head (``trl.trainer.utils.add_fused_lm_head``), a forward that returns per-token
log-probabilities instead of logits and never calls the model's ``loss_function``.
``ChannelLossCallback.attach`` observes those log-probabilities: the very pass the loss
is formed from, read detached, so loss and gradients are untouched.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from channel_loss.capture import active_capture, record
from channel_loss.integrations._hf_models import UnsupportedModelError

#: TRL's fused forward scores against labels it masks with this value, whatever the meter's.
TRL_IGNORE_INDEX = -100


def has_trl_fused_head(model) -> bool:
    """Whether ``model.forward`` is the forward TRL's ``add_fused_lm_head`` installed.

    TRL wraps it with ``functools.wraps(type(model).forward)``, which copies the
    name and module of the model's own forward: the code object tells them apart.
    """
    utils = sys.modules.get("trl.trainer.utils")
    forward = vars(model).get("forward") if isinstance(model, torch.nn.Module) else None
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return (
        utils is not None
        and code is not None
        and code.co_name == "_fused_forward"
        and code.co_filename == getattr(utils, "__file__", None)
    )


def trl_fused_refusal(name: str) -> str:
    """The ``UnsupportedModelError`` message for ``patch_model(fused=True)`` on a model with
    TRL's fused LM head (``name``: its class)."""
    return (
        f"patch_model(fused=True) refuses {name}: it carries TRL's fused LM head "
        "(trl.trainer.utils.add_fused_lm_head, installed by SFTTrainer / DPOTrainer), which "
        "already computes the loss without logits and never calls loss_function, so the "
        "channel_loss fused path would never run. Leave the model unpatched (or use "
        "patch_model(model), the observer): ChannelLossCallback(meter).attach(trainer) "
        "observes TRL's own per-token log-probabilities"
    )


def observe_trl_fused_head(trainer, fused_patch_of) -> torch.utils.hooks.RemovableHandle:
    """Record, inside an open ``capture()`` scope, the per-token NLL of every gradient-taking
    fused forward of ``trainer.model`` (TRL's ``model(..., fused_lm_head=True)``).

    The hook sits on ``trainer.model`` itself (a PEFT model calls its base model's
    ``forward`` directly, past any hook there); forwards under ``no_grad`` (DPO's
    reference pass through the same PEFT model, TRL's metric-only forwards, evaluation)
    are not observed. Raises ``UnsupportedModelError`` when the model also carries
    ``patch_model(fused=True)`` (``fused_patch_of(base)`` is not None).
    """
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if fused_patch_of(base) is not None:
        raise UnsupportedModelError(trl_fused_refusal(type(base).__name__))
    return model.register_forward_hook(_record_log_probs, with_kwargs=True)


def _record_log_probs(module, args, kwargs, output) -> None:
    if not kwargs.get("fused_lm_head") or not torch.is_grad_enabled():
        return
    if active_capture() is None:
        return
    log_probs = getattr(output, "log_probs", None)
    labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
    if log_probs is None or (labels is None and shift_labels is None):
        return
    with torch.no_grad():
        nll = log_probs.detach().float().neg()
        if shift_labels is not None:
            targets = shift_labels
            nll = nll[..., nll.shape[-1] - targets.shape[-1] :]
        else:
            # TRL scores position t against labels[t + 1] for t < T - 1: the HF convention,
            # with the last position (no next label) ignored. Prompt-learning PEFT prepends
            # virtual tokens to the output: keep the last positions, as TRL does.
            targets = F.pad(labels[..., 1:], (0, 1), value=TRL_IGNORE_INDEX)
            nll = F.pad(nll[..., nll.shape[-1] - (targets.shape[-1] - 1) :], (0, 1))
        targets = targets.to(nll.device)
        record(nll.masked_fill(targets == TRL_IGNORE_INDEX, 0.0), targets, TRL_IGNORE_INDEX)
