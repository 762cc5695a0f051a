"""Detached per-source ("channel") cross-entropy metrics for packed / sequence-parallel training."""

from channel_loss.attribution import SourceTotals, source_totals
from channel_loss.capture import Capture, TokenObservation, capture
from channel_loss.errors import ChannelLossMetadataError
from channel_loss.layout import PackedLayout, Shard
from channel_loss.meter import ChannelLossMeter
from channel_loss.ops import chunk_cross_entropy, default_chunk_size, per_token_cross_entropy

__all__ = [
    "Capture",
    "ChannelLossMetadataError",
    "ChannelLossMeter",
    "PackedLayout",
    "Shard",
    "SourceTotals",
    "TokenObservation",
    "capture",
    "chunk_cross_entropy",
    "default_chunk_size",
    "per_token_cross_entropy",
    "source_totals",
]
