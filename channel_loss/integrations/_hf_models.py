"""The HF models ``patch_model`` serves: unwrapping DDP / PEFT / compile / FSDP1
wrappers, the causal-LM check, the output embeddings and the logit transform read
from the config.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from channel_loss.errors import ChannelLossError
from channel_loss.validation import is_real


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


def _is_fsdp2(model) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return module is not None and isinstance(model, module)
