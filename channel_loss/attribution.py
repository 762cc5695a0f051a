"""Attribute per-token losses of a packed (possibly sharded) batch to the sources of its samples."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from numbers import Integral

import torch
import torch.distributed as dist

from channel_loss.errors import ChannelLossMetadataError
from channel_loss.exchange import (
    SourceId,
    all_reduce_rows,
    decode_entries,
    encode_entries,
    gather_headers,
    group_size,
)
from channel_loss.layout import PackedLayout, Shard, copy_to

__all__ = ["SourceId", "SourceTotals", "source_keys", "source_totals"]


@dataclass(frozen=True, eq=False)
class SourceTotals:
    """Per-source sums over some tokens: ``keys[i]`` has ``loss_sum[i]``, ``tokens[i]``, ``samples[i]``.

    ``loss_sum`` is float64, ``tokens`` (non-ignored targets) and ``samples``
    int64, all ``[len(keys)]`` on one device. Partials combine with ``+``
    (``sum(partials)`` works too) and across ranks with ``all_reduce``.
    """

    keys: tuple[SourceId, ...]
    loss_sum: torch.Tensor
    tokens: torch.Tensor
    samples: torch.Tensor

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> SourceTotals:
        """Totals over nothing."""
        return cls(
            (),
            torch.zeros(0, dtype=torch.float64, device=device),
            torch.zeros(0, dtype=torch.int64, device=device),
            torch.zeros(0, dtype=torch.int64, device=device),
        )

    @classmethod
    def from_rows(cls, keys: Iterable[SourceId], rows: torch.Tensor) -> SourceTotals:
        """Inverse of ``rows()``; counts are rounded back to int64."""
        return cls(
            tuple(keys),
            rows[:, 0].to(torch.float64),
            rows[:, 1].round().to(torch.int64),
            rows[:, 2].round().to(torch.int64),
        )

    def rows(self) -> torch.Tensor:
        """float64 ``[len(keys), 3]``: loss_sum, tokens, samples (counts exact below 2**53)."""
        return torch.stack([self.loss_sum, self.tokens.double(), self.samples.double()], dim=1)

    def to(self, device: torch.device | str) -> SourceTotals:
        """The same totals on ``device``."""
        return SourceTotals(
            self.keys, self.loss_sum.to(device), self.tokens.to(device), self.samples.to(device)
        )

    def __add__(self, other: SourceTotals) -> SourceTotals:
        if not isinstance(other, SourceTotals):
            return NotImplemented
        position = {key: i for i, key in enumerate(self.keys)}
        extra = [key for key in other.keys if key not in position]
        position.update((key, len(self.keys) + i) for i, key in enumerate(extra))
        device = self.loss_sum.device
        into = copy_to(torch.tensor([position[key] for key in other.keys], dtype=torch.int64), device)

        def merged(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
            grown = torch.nn.functional.pad(mine, (0, len(extra)))
            return grown.index_add_(0, into, theirs.to(device))

        return SourceTotals(
            self.keys + tuple(extra),
            merged(self.loss_sum, other.loss_sum),
            merged(self.tokens, other.tokens),
            merged(self.samples, other.samples),
        )

    def __radd__(self, other) -> SourceTotals:
        # Lets sum(partials) start from its default 0.
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def all_reduce(self, group=None) -> SourceTotals:
        """The sum of every rank's totals in ``group`` (default: the whole job), on every rank.

        Ranks may hold different keys: the result has their union, in the same
        order on every rank. Two collectives, no pickling. Returns a new
        object; ``self`` is unchanged. Without an initialised process group
        this is ``self``.
        """
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group_size(group) == 1:
            return self
        words = encode_entries([(key, "") for key in self.keys])
        headers = gather_headers([len(self.keys), len(words)], group)
        known = torch.zeros(0, 3, dtype=torch.float64)
        _, arrivals = all_reduce_rows(
            known, self.rows(), words, [(h[0], h[1]) for h in headers], group
        )
        total = SourceTotals.empty()
        for (n, _), (rows, their_words) in zip(headers, arrivals, strict=True):
            keys = [key for key, _ in decode_entries(their_words, n)]
            total = total + SourceTotals.from_rows(keys, rows)
        return total.to(self.loss_sum.device)

    def as_dict(self) -> dict[SourceId, tuple[float, int, int]]:
        """``{source_id: (loss_sum, tokens, samples)}`` as Python numbers (reads the tensors back)."""
        return {
            key: (loss, tokens, samples)
            for key, loss, tokens, samples in zip(
                self.keys,
                self.loss_sum.tolist(),
                self.tokens.tolist(),
                self.samples.tolist(),
                strict=True,
            )
        }


def _normalise_key(key, ids: list) -> SourceId:
    if isinstance(key, str):
        return str(key)
    if isinstance(key, Integral) and not isinstance(key, bool):
        return int(key)
    raise ChannelLossMetadataError(
        f"source_ids[{ids.index(key)}] is {key!r} of type {type(key).__name__}; "
        "source ids must be int or str"
    )


def source_keys(source_ids, num_samples: int) -> tuple[tuple[SourceId, ...], torch.Tensor]:
    """Validate ``source_ids`` (one per sample) and split them into distinct keys and per-sample indices.

    ``source_ids`` is a sequence of ``int`` / ``str`` (keys in first-seen
    order) or a 1-D integer tensor (keys in sorted order; a tensor on an
    accelerator costs one host sync). Returns ``(keys, index)`` with
    ``keys[index[k]]`` the source of sample ``k``; ``index`` is int64 on the
    host, or on the tensor's device.
    """
    if isinstance(source_ids, torch.Tensor):
        if source_ids.dim() != 1 or source_ids.dtype.is_floating_point or source_ids.dtype == torch.bool:
            raise ChannelLossMetadataError(
                f"a source_ids tensor must be 1-D of integers; got shape {tuple(source_ids.shape)}, "
                f"dtype {source_ids.dtype}"
            )
        if source_ids.numel() != num_samples:
            raise ChannelLossMetadataError(
                f"the layout has {num_samples} samples but source_ids has {source_ids.numel()} entries"
            )
        keys, index = torch.unique(source_ids, return_inverse=True)
        return tuple(keys.tolist()), index.to(torch.int64)
    if isinstance(source_ids, (str, bytes, Mapping)) or not isinstance(source_ids, Iterable):
        raise ChannelLossMetadataError(
            f"source_ids must be a sequence with one id per sample; got {type(source_ids).__name__}"
        )
    ids = list(source_ids)
    if len(ids) != num_samples:
        raise ChannelLossMetadataError(
            f"the layout has {num_samples} samples but source_ids has {len(ids)} entries"
        )
    try:
        first_seen = dict.fromkeys(ids)
    except TypeError:
        bad = next(i for i, key in enumerate(ids) if not isinstance(key, Hashable))
        raise ChannelLossMetadataError(
            f"source_ids[{bad}] is an unhashable {type(ids[bad]).__name__} ({ids[bad]!r}); "
            "source ids must be int or str"
        ) from None
    # One Python step per distinct source, not per sample.
    keys = tuple(_normalise_key(key, ids) for key in first_seen)
    position = {key: i for i, key in enumerate(first_seen)}
    return keys, torch.tensor(list(map(position.__getitem__, ids)), dtype=torch.int64)


def _check_inputs(token_losses, targets, layout, shard) -> None:
    if not isinstance(layout, PackedLayout):
        raise ChannelLossMetadataError(f"layout must be a PackedLayout; got {type(layout).__name__}")
    if shard is None:
        expected, what = layout.shape, "the layout (position_ids) has shape"
    else:
        if not isinstance(shard, Shard):
            raise ChannelLossMetadataError(f"shard must be a Shard; got {type(shard).__name__}")
        if not shard.layout.same_as(layout):
            raise ChannelLossMetadataError(
                f"the shard was made for another layout: shard of {shard.layout!r}, layout {layout!r}"
            )
        expected, what = shard.local_shape, "the shard's local shape is"
    for name, tensor in (("token_losses", token_losses), ("targets", targets)):
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
        if shape != expected:
            raise ChannelLossMetadataError(
                f"{name} has shape {shape if shape is not None else type(tensor).__name__} "
                f"but {what} {expected}"
            )


def source_totals(
    token_losses: torch.Tensor,
    targets: torch.Tensor,
    *,
    layout: PackedLayout,
    source_ids,
    shard: Shard | None = None,
    ignore_index: int = -100,
) -> SourceTotals:
    """Per-source ``loss_sum`` (float64), ``tokens`` and ``samples`` of one packed batch.

    ``token_losses`` / ``targets`` have the layout's shape, or with ``shard``
    the shard's ``local_shape`` (this rank's view; the result is its partial).
    ``source_ids`` has one id per sample of ``layout``, in order. A token
    counts when it belongs to a sample and its target is not
    ``ignore_index``; a sample counts once, on the rank holding its first
    token, even when none of its targets is scored. Summing every rank's
    partial gives the unsharded totals (exactly, for integer-valued losses).

    Runs as a fixed number of tensor ops on the losses' device: no loop over
    samples or tokens, no host sync (unless ``source_ids`` is an accelerator
    tensor). Raises ``ChannelLossMetadataError`` when the inputs do not fit.
    """
    _check_inputs(token_losses, targets, layout, shard)
    keys, sample_source = source_keys(source_ids, layout.num_samples)
    device = token_losses.device
    if not keys:
        return SourceTotals.empty(device)
    sample_index, sample_starts = layout.on(device)
    if shard is None:
        position = torch.arange(layout.numel, device=device)
        sample = sample_index
    else:
        position = shard.on(device)
        sample = torch.where(position >= 0, sample_index[position.clamp(min=0)], -1)
    held = sample >= 0
    safe = sample.clamp(min=0)
    source = copy_to(sample_source, device)[safe]
    # Tokens that count nowhere go to one extra bucket that is cut off at the end.
    bucket = len(keys)
    scored = torch.where(held & (targets.reshape(-1) != ignore_index), source, bucket)
    first = torch.where(held & (position == sample_starts[safe]), source, bucket)
    loss_sum = torch.zeros(bucket + 1, dtype=torch.float64, device=device)
    loss_sum.index_add_(0, scored, token_losses.reshape(-1).to(torch.float64))
    counts = torch.zeros(2, bucket + 1, dtype=torch.int64, device=device)
    counts[0].index_add_(0, scored, torch.ones_like(scored))
    counts[1].index_add_(0, first, torch.ones_like(first))
    return SourceTotals(keys, loss_sum[:bucket], counts[0, :bucket], counts[1, :bucket])
