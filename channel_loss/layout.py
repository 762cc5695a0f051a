"""Where the samples of a packed batch lie, and which of its tokens a sequence-parallel rank holds.

A ``PackedLayout`` describes one packed batch: ``[T]`` or ``[B, T]`` token
positions (rows laid out row-major), each row holding whole samples back to
back followed by ``tail_padding_length`` padding positions that belong to no
sample. A ``Shard`` is one sequence-parallel rank's slice of that batch, in
one of the orders in ``SHARD_MODES``: Ulysses ("contiguous"), per-sample
load-balanced context parallelism ("zigzag") or torch's whole-row head-tail
context-parallel balancer ("headtail").

Everything is built with tensor ops over all samples and tokens at once.
Building a layout or a shard reads a few sizes back to the host (the number of
samples, the local length); attribution, which runs every micro-batch, does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from channel_loss.errors import ChannelLossMetadataError
from channel_loss.validation import is_int

__all__ = ["SHARD_MODES", "PackedLayout", "Shard", "copy_to"]


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, without making the host wait for the device.

    A plain host-to-accelerator copy synchronises the stream; staging through
    pinned memory and copying non-blocking does not.
    """
    device = torch.device(device)
    if tensor.device == device or device.type == "cpu" or tensor.device.type != "cpu":
        return tensor.to(device)
    try:
        staged = tensor.pin_memory()
    except RuntimeError:  # no pinned memory for this accelerator: pay the sync
        return tensor.to(device)
    return staged.to(device, non_blocking=True)


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _row_tails(tail_padding_length, rows: int, row_length: int) -> tuple[int, ...]:
    """Per-row tail padding lengths from an int (every row) or one value per row."""
    if isinstance(tail_padding_length, torch.Tensor):
        tail_padding_length = tail_padding_length.tolist()
    if is_int(tail_padding_length):
        tails = (tail_padding_length,) * rows
    elif isinstance(tail_padding_length, Sequence) and not isinstance(tail_padding_length, str):
        tails = tuple(tail_padding_length)
        if len(tails) != rows:
            raise ChannelLossMetadataError(
                f"tail_padding_length has {len(tails)} entries but the batch has {rows} rows"
            )
    else:
        raise ChannelLossMetadataError(
            f"tail_padding_length must be an int or one int per row; got {tail_padding_length!r}"
        )
    for row, tail in enumerate(tails):
        if not is_int(tail) or not 0 <= tail <= row_length:
            raise ChannelLossMetadataError(
                f"tail_padding_length of row {row} must be an int in [0, {row_length}] "
                f"(the row length); got {tail!r}"
            )
    return tuple(int(tail) for tail in tails)


class PackedLayout:
    """The samples packed into a ``[T]`` or ``[B, T]`` batch.

    Build one with :meth:`from_position_ids` or :meth:`from_cu_seqlens`.
    Token ``i`` of the flattened batch (row-major over ``B``) belongs to sample
    ``sample_index[i]``, or to no sample (``-1``) when it is tail padding.
    Samples are numbered in row-major order of their first token.

    Attributes:
        shape: the batch's leading shape, ``(T,)`` or ``(B, T)``.
        tail_padding: padding positions at the end of each row.
        num_samples: the number of real samples.
        seqlens: int64 ``[num_samples]`` sample lengths.
        sample_starts: int64 ``[num_samples]`` flat index of each sample's first token.
        sample_index: int64 ``[numel]`` sample of each token, ``-1`` for padding.
    """

    def __init__(self, shape: Sequence[int], tail_padding: Sequence[int], starts: torch.Tensor):
        """Low-level constructor; prefer the ``from_*`` class methods.

        ``starts`` is a bool tensor with ``shape`` marking each sample's first
        token; every row must either be all padding or start a sample at column 0.
        """
        self.shape = _shape(shape)
        self.tail_padding = tuple(int(t) for t in tail_padding)
        rows, row_length = self.num_rows, self.row_length
        device = starts.device
        real = (
            torch.arange(row_length, device=device)[None, :]
            < torch.tensor([row_length - t for t in self.tail_padding], device=device)[:, None]
        )
        starts = starts.reshape(rows, row_length) & real
        bad_rows = (real[:, 0] & ~starts[:, 0]).nonzero().flatten().tolist()
        if bad_rows:
            raise ChannelLossMetadataError(
                f"row {bad_rows[0]} does not start a sample at column 0 (a sample must start "
                "where position_ids == 0, and each row holds whole samples)"
            )
        flat_starts = starts.reshape(-1)
        flat_real = real.reshape(-1)
        index = torch.cumsum(flat_starts, 0, dtype=torch.int64) - 1
        self.sample_index = torch.where(flat_real, index, -1)
        self.sample_starts = flat_starts.nonzero().flatten()
        self.num_samples = int(self.sample_starts.numel())
        self.seqlens = torch.zeros(self.num_samples, dtype=torch.int64, device=device).index_add_(
            0, self.sample_index[flat_real], torch.ones_like(self.sample_index[flat_real])
        )
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, *, tail_padding_length: int | Sequence[int] = 0
    ) -> PackedLayout:
        """Layout of a batch whose samples start where ``position_ids == 0``.

        ``position_ids`` is ``[T]`` or ``[B, T]``, or multimodal rope
        (Qwen2-VL style "mrope") position ids ``[3, B, T]`` / ``[4, B, T]``
        (temporal, height, width; the 4-row form puts the plain text
        positions first): then the layout has shape ``(B, T)`` and a sample
        starts where the first (temporal) row is 0 *and* so are the others.
        For text tokens every row is equal, so this is the temporal row; the
        other rows keep an image that opens a sample (all of its first
        frame's patches have temporal position 0, only its first patch is 0
        in every row) one sample. The last ``tail_padding_length`` positions of
        each row (an int for every row, or one int per row) are padding
        whatever their position ids say: padding with position 0 would
        otherwise count as one sample per pad.
        """
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
            if position_ids.shape[0] not in (3, 4):
                raise ChannelLossMetadataError(
                    "3-D position_ids must be multimodal rope ids [3, B, T] or [4, B, T] "
                    f"(temporal row first); got shape {tuple(position_ids.shape)}"
                )
            starts = (position_ids == 0).all(dim=0)
            position_ids = position_ids[0]
        else:
            starts = None
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2):
            raise ChannelLossMetadataError(
                "position_ids must be a [T], [B, T], [3, B, T] or [4, B, T] tensor; got "
                + str(tuple(getattr(position_ids, "shape", ())) or type(position_ids).__name__)
            )
        if position_ids.shape[-1] == 0:
            raise ChannelLossMetadataError(
                f"position_ids must hold at least one position per row; got shape {tuple(position_ids.shape)}"
            )
        shape = _shape(position_ids.shape)
        tails = _row_tails(tail_padding_length, 1 if len(shape) == 1 else shape[0], shape[-1])
        return cls(shape, tails, position_ids == 0 if starts is None else starts)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: torch.Tensor | Sequence[int],
        *,
        total_length: int,
        tail_padding_length: int = 0,
    ) -> PackedLayout:
        """Layout of one row of ``total_length`` positions from cumulative sample lengths.

        ``cu_seqlens`` is ``[0, L_0, L_0 + L_1, ...]`` over the real samples, so
        it ends at ``total_length - tail_padding_length``. A final entry equal
        to ``total_length`` (the padding written as one more segment, as some
        collators do) is accepted and dropped.
        """
        cu = torch.as_tensor(cu_seqlens)
        if cu.dim() != 1 or cu.numel() == 0 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise ChannelLossMetadataError(
                f"cu_seqlens must be a non-empty 1-D integer tensor; got shape {tuple(cu.shape)}, "
                f"dtype {cu.dtype}"
            )
        if not is_int(total_length) or total_length < 1:
            raise ChannelLossMetadataError(
                f"total_length must be a positive int; got {total_length!r}"
            )
        (tail,) = _row_tails(tail_padding_length, 1, total_length)
        cu = cu.to(torch.int64)
        values = cu.tolist()
        real_end = total_length - tail
        if tail and len(values) >= 2 and values[-1] == total_length and values[-2] == real_end:
            cu, values = cu[:-1], values[:-1]
        if values[0] != 0 or values[-1] != real_end:
            raise ChannelLossMetadataError(
                f"cu_seqlens must run from 0 to total_length - tail_padding_length = "
                f"{total_length} - {tail} = {real_end}; got {values[0]} .. {values[-1]}"
            )
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ChannelLossMetadataError(
                f"cu_seqlens must be strictly increasing (no empty samples); got {values}"
            )
        starts = torch.zeros(total_length, dtype=torch.bool, device=cu.device)
        starts[cu[:-1]] = True
        return cls((total_length,), (tail,), starts)

    @property
    def num_rows(self) -> int:
        """``B``, or 1 for a ``[T]`` layout."""
        return 1 if len(self.shape) == 1 else self.shape[0]

    @property
    def row_length(self) -> int:
        """``T``."""
        return self.shape[-1]

    @property
    def numel(self) -> int:
        """Positions in the batch, padding included (``B * T``)."""
        return self.num_rows * self.row_length

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 ``[num_samples + 1]`` cumulative lengths of the real samples (flash-attn varlen form)."""
        return torch.nn.functional.pad(torch.cumsum(self.seqlens, 0), (1, 0)).to(torch.int32)

    def same_as(self, other: PackedLayout) -> bool:
        """True when ``other`` describes the same batch (same shape, padding and samples)."""
        return self is other or (
            isinstance(other, PackedLayout)
            and self.shape == other.shape
            and self.tail_padding == other.tail_padding
            and self.num_samples == other.num_samples
            and torch.equal(self.sample_starts.cpu(), other.sample_starts.cpu())
        )

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sample_index, sample_starts)`` on ``device``, copied once and cached."""
        if device not in self._on_device:
            self._on_device[device] = (
                copy_to(self.sample_index, device),
                copy_to(self.sample_starts, device),
            )
        return self._on_device[device]

    def shard(self, world_size: int, rank: int, mode: str) -> Shard:
        """The slice of this batch that sequence-parallel ``rank`` of ``world_size`` holds.

        ``mode`` is a name in ``SHARD_MODES``: ``"contiguous"`` (Ulysses: each
        row right-padded to a multiple of ``world_size``, rank ``r`` holds the
        ``r``-th equal part), ``"zigzag"`` (per-sample load-balanced context
        parallelism: each sample, and the tail padding as one more block,
        padded to a multiple of ``2 * world_size`` and cut in
        ``2 * world_size`` chunks; rank ``r`` holds chunks ``r`` and
        ``2 * world_size - 1 - r`` of every block) or ``"headtail"`` (torch's
        whole-row head-tail context-parallel balancer, as ``context_parallel``
        uses without document masking: the same two chunks, of each row
        right-padded to a multiple of ``2 * world_size``).
        """
        return Shard(self, world_size, rank, mode)

    def __repr__(self) -> str:
        return (
            f"PackedLayout(shape={self.shape}, num_samples={self.num_samples}, "
            f"tail_padding={self.tail_padding})"
        )


class Shard:
    """One sequence-parallel rank's view of a ``PackedLayout``.

    Attributes:
        layout: the whole batch this is a slice of.
        world_size, rank, mode: as passed to ``PackedLayout.shard``.
        local_shape: the leading shape of this rank's tensors: ``(L,)`` for a
            ``[T]`` layout, ``(B, L)`` for a ``[B, T]`` one (zigzag rows of
            different local length are right-padded to the longest).
        global_index: int64 ``[prod(local_shape)]``: for each local position
            (row-major), its index in the original unpadded batch (row-major
            over ``B``), or ``-1`` for padding added by sharding.
    """

    def __init__(self, layout: PackedLayout, world_size: int, rank: int, mode: str):
        if not is_int(world_size) or world_size < 1:
            raise ChannelLossMetadataError(f"world_size must be a positive int; got {world_size!r}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ChannelLossMetadataError(
                f"rank must be an int in [0, {world_size}) for world_size {world_size}; got {rank!r}"
            )
        if not isinstance(mode, str) or mode not in SHARD_MODES:
            raise ChannelLossMetadataError(
                f"mode must be one of {tuple(SHARD_MODES)}; got {mode!r}"
            )
        self.layout, self.mode = layout, mode
        self.world_size, self.rank = int(world_size), int(rank)
        index = SHARD_MODES[mode](self)
        self.local_shape = _shape(index.shape) if len(layout.shape) == 2 else (index.shape[1],)
        self.global_index = index.reshape(-1)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """``global_index`` on ``device``, copied once and cached."""
        if device not in self._on_device:
            self._on_device[device] = copy_to(self.global_index, device)
        return self._on_device[device]

    def take(self, global_tensor: torch.Tensor, fill) -> torch.Tensor:
        """This rank's slice of a per-token tensor of the whole batch.

        ``global_tensor`` has the layout's leading shape (any trailing dims
        are kept); the result has ``local_shape`` plus those trailing dims,
        with ``fill`` at padding added by sharding (pass ``ignore_index`` for
        labels).
        """
        lead = len(self.layout.shape)
        if (
            not isinstance(global_tensor, torch.Tensor)
            or _shape(global_tensor.shape[:lead]) != self.layout.shape
        ):
            raise ChannelLossMetadataError(
                f"take() needs a tensor with the layout's leading shape {self.layout.shape}; got "
                f"{tuple(getattr(global_tensor, 'shape', ())) or type(global_tensor).__name__}"
            )
        rest = global_tensor.shape[lead:]
        flat = global_tensor.reshape(self.layout.numel, *rest)
        index = self.on(global_tensor.device)
        local = flat.index_select(0, index.clamp(min=0))
        pad = (index < 0).view(-1, *([1] * len(rest)))
        return local.masked_fill(pad, fill).reshape(*self.local_shape, *rest)

    def __repr__(self) -> str:
        return (
            f"Shard(mode={self.mode!r}, world_size={self.world_size}, rank={self.rank}, "
            f"local_shape={self.local_shape}, layout={self.layout!r})"
        )


def _contiguous_index(shard: Shard) -> torch.Tensor:
    """``[B, T'/w]`` global indices: rank r holds ``[r*T'/w, (r+1)*T'/w)`` of each padded row."""
    layout, device = shard.layout, shard.layout.sample_index.device
    rows, row_length = layout.num_rows, layout.row_length
    part = -(-row_length // shard.world_size)
    column = shard.rank * part + torch.arange(part, device=device)
    row_base = torch.arange(rows, device=device)[:, None] * row_length
    return torch.where(column[None, :] < row_length, row_base + column[None, :], -1)


def _zigzag_index(shard: Shard) -> torch.Tensor:
    """``[B, L]`` global indices of the two zigzag chunks of every block, block by block."""
    layout, device = shard.layout, shard.layout.sample_index.device
    w, r = shard.world_size, shard.rank
    rows, row_length = layout.num_rows, layout.row_length
    # Blocks: every sample, then each row's tail padding as one more block.
    tails = torch.tensor(layout.tail_padding, dtype=torch.int64, device=device)
    has_tail = tails > 0
    tail_rows = torch.arange(rows, device=device)[has_tail]
    starts = torch.cat(
        [layout.sample_starts, tail_rows * row_length + row_length - tails[has_tail]]
    )
    lengths = torch.cat([layout.seqlens, tails[has_tail]])
    order = torch.argsort(starts, stable=True)  # row-major: row by row, in position order
    starts, lengths = starts[order], lengths[order]
    block_rows = starts // row_length
    chunk = -(-lengths // (2 * w))  # c_k = P_k / (2w)
    local = 2 * chunk  # positions of block k held by every rank
    row_local = torch.zeros(rows, dtype=torch.int64, device=device).index_add_(0, block_rows, local)
    width = int(row_local.max()) if rows else 0
    # Where each block's local positions begin within its row's local view.
    local_begin = _exclusive_cumsum(local) - _exclusive_cumsum(row_local)[block_rows]

    block = torch.repeat_interleave(torch.arange(starts.numel(), device=device), local)
    q = torch.arange(block.numel(), device=device) - torch.repeat_interleave(
        _exclusive_cumsum(local), local
    )
    c = chunk[block]
    offset = torch.where(q < c, r * c + q, (2 * w - 1 - r) * c + (q - c))
    global_index = torch.where(offset < lengths[block], starts[block] + offset, -1)
    out = torch.full((rows * width,), -1, dtype=torch.int64, device=device)
    out[block_rows[block] * width + local_begin[block] + q] = global_index
    return out.reshape(rows, width)


def _headtail_index(shard: Shard) -> torch.Tensor:
    """``[B, 2c]`` global indices: chunks ``r`` and ``2w-1-r`` of each row padded to ``2w * c``."""
    layout, device = shard.layout, shard.layout.sample_index.device
    w, r = shard.world_size, shard.rank
    rows, row_length = layout.num_rows, layout.row_length
    chunk = -(-row_length // (2 * w))
    within = torch.arange(chunk, device=device)
    column = torch.cat([r * chunk + within, (2 * w - 1 - r) * chunk + within])
    row_base = torch.arange(rows, device=device)[:, None] * row_length
    return torch.where(column[None, :] < row_length, row_base + column[None, :], -1)


#: The shard modes, by name: each maps a ``Shard`` (its layout, ``world_size``
#: and ``rank``) to its ``[B, L]`` int64 global indices, -1 for padding added by
#: sharding. A new mode is one entry here (the tests' reference and the demo's
#: ``--sp-mode`` read this registry).
SHARD_MODES: dict[str, Callable[[Shard], torch.Tensor]] = {
    "contiguous": _contiguous_index,
    "zigzag": _zigzag_index,
    "headtail": _headtail_index,
}
