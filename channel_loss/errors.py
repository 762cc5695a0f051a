"""Errors raised by channel_loss."""

from __future__ import annotations

__all__ = ["ChannelLossError", "ChannelLossMetadataError"]


class ChannelLossError(Exception):
    """Base of the errors channel_loss raises on purpose (bad arguments, bad metadata)."""


class ChannelLossMetadataError(ChannelLossError, ValueError):
    """Per-sample metadata (layout, shard, source ids) does not fit the tokens it describes."""
