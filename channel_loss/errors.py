"""Errors raised by channel_loss."""

from __future__ import annotations

__all__ = ["ChannelLossMetadataError"]


class ChannelLossMetadataError(ValueError):
    """Per-sample metadata (layout, shard, source ids) does not fit the tokens it describes."""
