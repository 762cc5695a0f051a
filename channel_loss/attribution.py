"""Attribute per-token losses of a packed (possibly sharded) batch to the sources of its samples."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from channel_loss.errors import ChannelLossMetadataError
from channel_loss.exchange import KeyedExchange, SourceId, group_size
from channel_loss.layout import PackedLayout, Shard, copy_to
from channel_loss.validation import is_int

__all__ = [
    "COLUMNS",
    "Column",
    "SourceId",
    "SourceTotals",
    "check_text",
    "source_keys",
    "source_totals",
]


@dataclass(frozen=True)
class Column:
    """One per-source column of ``SourceTotals``: the single definition everything else reads.

    Every column is additive: it merges by summing, across micro-batches (``+``),
    ranks (``all_reduce``, the meter's step reduction) and logging windows
    (``integrations.transformers.merge_step_metrics``). ``metric`` names the
    per-source metric family that reports the column unchanged
    (``"{prefix}_{metric}/{source}"``), or is None for a column that only
    derived metrics use (``loss_sum``: the mean and the weighted share).
    """

    name: str
    dtype: torch.dtype
    metric: str | None
    doc: str


def _column(dtype: torch.dtype, metric: str | None, doc: str) -> dict:
    # A SourceTotals field's metadata; the column's name is the field's.
    return {"column": (dtype, metric, doc)}


@dataclass(frozen=True, eq=False)
class SourceTotals:
    """Per-source sums over some tokens: ``keys[i]`` has ``loss_sum[i]``, ``tokens[i]``, ``samples[i]``.

    One tensor ``[len(keys)]`` per column of ``COLUMNS`` (``loss_sum``
    float64, ``tokens`` (scored targets) and ``samples`` int64), all on one
    device. Partials combine with ``+`` (``sum(partials)`` works too) and
    across ranks with ``all_reduce``. A new column is one more field here
    (with its ``_column``) and its computation in ``source_totals``.
    """

    keys: tuple[SourceId, ...]
    loss_sum: torch.Tensor = field(
        metadata=_column(torch.float64, None, "sum of the per-token losses of scored targets")
    )
    tokens: torch.Tensor = field(metadata=_column(torch.int64, "tokens", "scored targets"))
    samples: torch.Tensor = field(
        metadata=_column(
            torch.int64,
            "samples",
            "samples, each counted once (on the rank holding its first token)",
        )
    )

    def columns(self) -> tuple[torch.Tensor, ...]:
        """The column tensors, in ``COLUMNS`` order."""
        return tuple(getattr(self, column.name) for column in COLUMNS)

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> SourceTotals:
        """Totals over nothing."""
        return cls((), *(torch.zeros(0, dtype=c.dtype, device=device) for c in COLUMNS))

    @classmethod
    def from_rows(cls, keys: Iterable[SourceId], rows: torch.Tensor) -> SourceTotals:
        """Inverse of ``rows()``; integer columns are rounded back to int64."""
        return cls(
            tuple(keys),
            *(
                rows[:, i].to(torch.float64)
                if c.dtype.is_floating_point
                else rows[:, i].round().to(c.dtype)
                for i, c in enumerate(COLUMNS)
            ),
        )

    def rows(self) -> torch.Tensor:
        """float64 ``[len(keys), len(COLUMNS)]``, columns in ``COLUMNS`` order (counts exact below 2**53)."""
        return torch.stack([column.double() for column in self.columns()], dim=1)

    def to(self, device: torch.device | str) -> SourceTotals:
        """The same totals on ``device``."""
        return SourceTotals(self.keys, *(column.to(device) for column in self.columns()))

    def __add__(self, other: SourceTotals) -> SourceTotals:
        if not isinstance(other, SourceTotals):
            return NotImplemented
        position = {key: i for i, key in enumerate(self.keys)}
        extra = [key for key in other.keys if key not in position]
        position.update((key, len(self.keys) + i) for i, key in enumerate(extra))
        device = self.loss_sum.device
        into = copy_to(
            torch.tensor([position[key] for key in other.keys], dtype=torch.int64), device
        )

        def merged(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
            grown = torch.nn.functional.pad(mine, (0, len(extra)))
            return grown.index_add_(0, into, theirs.to(device))

        return SourceTotals(
            self.keys + tuple(extra),
            *(
                merged(mine, theirs)
                for mine, theirs in zip(self.columns(), other.columns(), strict=True)
            ),
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
        exchange = KeyedExchange([(key, "") for key in self.keys], [], group)
        known = torch.zeros(0, len(COLUMNS), dtype=torch.float64)
        reduced = exchange.reduce(known, self.rows())
        return SourceTotals.from_rows(reduced.new_keys, reduced.rows).to(self.loss_sum.device)

    def as_dict(self) -> dict[SourceId, tuple]:
        """``{source_id: (one value per column, in COLUMNS order: loss_sum, tokens, samples)}``, as Python numbers."""
        return (
            dict(
                zip(self.keys, zip(*(c.tolist() for c in self.columns()), strict=True), strict=True)
            )
            if self.keys
            else {}
        )


#: The per-source columns, in ``SourceTotals`` field (and ``rows()``) order.
COLUMNS: tuple[Column, ...] = tuple(
    Column(f.name, *f.metadata["column"]) for f in fields(SourceTotals) if "column" in f.metadata
)


def check_text(text: str, what: str) -> str:
    """``text`` if it encodes as UTF-8 (how ids and names travel between ranks), else a metadata error.

    A lone surrogate (``"\\ud800"``, e.g. from ``os.fsdecode`` of bad bytes) is a
    valid ``str`` that no rank could send.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ChannelLossMetadataError(
            f"{what} is {text!r}, which is not valid Unicode text ({error.reason} at "
            f"position {error.start}); ids and names must encode as UTF-8"
        ) from None
    return text


def _normalise_key(key, ids: list) -> SourceId:
    if isinstance(key, str):
        return check_text(str(key), f"source_ids[{ids.index(key)}]")
    return int(key)


def _check_types(ids: list) -> None:
    """Every id is an int or a str: checked per distinct type, before equal values merge."""
    first_of_type = {type(key): i for i, key in reversed(list(enumerate(ids)))}
    for kind, bad in sorted(first_of_type.items(), key=lambda item: item[1]):
        if not (issubclass(kind, str) or is_int(ids[bad])):
            raise ChannelLossMetadataError(
                f"source_ids[{bad}] is {ids[bad]!r} of type {kind.__name__}; source ids must be "
                "int or str (bool and float ids are refused: they would merge with the int "
                "equal to them)"
            )


def source_keys(source_ids, num_samples: int) -> tuple[tuple[SourceId, ...], torch.Tensor]:
    """Validate ``source_ids`` (one per sample) and split them into distinct keys and per-sample indices.

    ``source_ids`` is a sequence of ``int`` / ``str`` (keys in first-seen
    order; ``bool``, ``float`` and other types, and strings that do not
    encode as UTF-8, are a ``ChannelLossMetadataError``) or a 1-D integer tensor (keys in sorted order; a tensor on an
    accelerator costs one host sync). Returns ``(keys, index)`` with
    ``keys[index[k]]`` the source of sample ``k``; ``index`` is int64 on the
    host, or on the tensor's device.
    """
    if isinstance(source_ids, torch.Tensor):
        if (
            source_ids.dim() != 1
            or source_ids.dtype.is_floating_point
            or source_ids.dtype == torch.bool
        ):
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
    _check_types(ids)
    first_seen = dict.fromkeys(ids)
    # One Python step per distinct source, not per sample.
    keys = tuple(_normalise_key(key, ids) for key in first_seen)
    position = {key: i for i, key in enumerate(first_seen)}
    return keys, torch.tensor(list(map(position.__getitem__, ids)), dtype=torch.int64)


def _check_inputs(token_losses, targets, layout, shard) -> None:
    if not isinstance(layout, PackedLayout):
        raise ChannelLossMetadataError(
            f"layout must be a PackedLayout; got {type(layout).__name__}"
        )
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
    return SourceTotals(
        keys, loss_sum=loss_sum[:bucket], tokens=counts[0, :bucket], samples=counts[1, :bucket]
    )
