"""Integrations with training frameworks.

Each submodule imports its framework lazily: ``channel_loss.integrations``
itself needs nothing beyond ``channel_loss``. Available:

* ``channel_loss.integrations.transformers`` (extra ``hf``): ``patch_model``,
  ``fused_causal_lm_loss`` and ``ChannelLossCallback`` for Hugging Face
  transformers causal LMs and the ``Trainer``; ``ChannelLossCallback.attach``
  also serves TRL's ``SFTTrainer`` and ``DPOTrainer`` (extra ``trl``).
"""
