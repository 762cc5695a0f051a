"""The step meter: per-source cross-entropy metrics of a training step, reduced across SP and DP ranks.

Per micro-batch, ``micro_batch()`` opens ``capture()`` around forward + loss
and turns the observed per-token losses into this rank's partial
``SourceTotals`` on the device: no collective, no host sync. ``end_step()``
reduces the whole step over the sequence-parallel (SP) and data-parallel (DP)
ranks together in two collectives (see ``channel_loss.exchange``):

1. a fixed-size int64 header per rank: its SP group, how many micro-batches it
   ran and which of them failed (forward raised, or bad metadata), the first
   metadata error message, and the sizes of its never-seen-before sources;
2. one float64 vector: rows for every registered source, plus each rank's new
   sources (ids and names as numbers) with their rows.

Every rank reads the same headers, so every rank takes the same decisions
from them: an SP group drops a micro-batch that failed on any of its ranks;
with ``strict=True`` every rank raises when any rank saw bad metadata. New
sources are registered in rank order, so the registry (and the metric names)
are identical everywhere.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from channel_loss.attribution import SourceId, SourceTotals, source_totals
from channel_loss.capture import TokenObservation, capture, record
from channel_loss.errors import ChannelLossMetadataError
from channel_loss.exchange import (
    all_reduce_rows,
    decode_entries,
    encode_entries,
    gather_headers,
    group_size,
)
from channel_loss.layout import PackedLayout, Shard
from channel_loss.ops import per_token_cross_entropy, resolve_targets

__all__ = ["ChannelLossMeter"]

logger = logging.getLogger(__name__)

_FAIL_WORDS = 4
_TRACKED = 64 * _FAIL_WORDS  # micro-batches past the last one tracked share its status bit
_MESSAGE_WORDS = 32  # an error message travels truncated to 8 * 32 bytes
_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def sanitise_name(name: str) -> str:
    """``name`` with every character outside ``[A-Za-z0-9_.-]`` replaced by ``_`` (``"_"`` if empty)."""
    return _NAME.sub("_", name) or "_"


@dataclass
class _Header:
    """What one rank tells every other rank at the end of a step (collective 1)."""

    rank: int
    sp_id: int  # lowest global rank of the rank's SP group: equal headers = same SP group
    micro_batches: int
    fingerprint: int  # the micro-batches' (num_samples, shape): SP peers must agree
    new_keys: int
    new_words: int
    failed: int  # bit m: micro-batch m (capped at _TRACKED - 1) failed on this rank
    error_at: int = -1  # micro-batch of the first metadata error, -1 for none
    error: str = ""

    def pack(self) -> list[int]:
        message = self.error.encode("utf-8")[: 8 * _MESSAGE_WORDS]
        return [
            self.rank, self.sp_id, self.micro_batches, self.fingerprint,
            self.new_keys, self.new_words, self.error_at, len(message),
            *_to_words(self.failed.to_bytes(8 * _FAIL_WORDS, "little")),
            *_to_words(message.ljust(8 * _MESSAGE_WORDS, b"\0")),
        ]

    @classmethod
    def unpack(cls, row: list[int]) -> _Header:
        rank, sp_id, micro_batches, fingerprint, new_keys, new_words, error_at, length = row[:8]
        failed = int.from_bytes(_from_words(row[8 : 8 + _FAIL_WORDS]), "little")
        message = _from_words(row[8 + _FAIL_WORDS :])[:length].decode("utf-8", errors="replace")
        return cls(rank, sp_id, micro_batches, fingerprint, new_keys, new_words, failed,
                   error_at, message)


def _to_words(data: bytes) -> list[int]:
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def _from_words(words: list[int]) -> bytes:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words)


@dataclass
class _MicroBatch:
    fingerprint: tuple
    totals: SourceTotals | None = None  # None: dropped on this rank (forward raised, bad metadata)
    names: dict[SourceId, str] = field(default_factory=dict)


@dataclass
class _Step:
    index: int
    sampled: bool
    micro_batches: list[_MicroBatch] = field(default_factory=list)
    error_at: int = -1
    error: str = ""


@dataclass
class _Plan:
    """The decisions every rank derives identically from the gathered headers."""

    kept: list[int]  # this rank's micro-batches that enter the sums
    dropped: int  # micro-batches dropped this step, summed over SP groups
    error: str | None  # what every rank raises under strict=True: first metadata error or mismatch
    mismatch_here: str | None  # this rank's SP group ran different micro-batches


def _plan(headers: list[_Header], sp_id: int) -> _Plan:
    groups: dict[int, list[_Header]] = {}
    for header in headers:
        groups.setdefault(header.sp_id, []).append(header)
    plan = _Plan([], 0, None, None)
    mismatch = None
    for gid, members in groups.items():
        count = max(h.micro_batches for h in members)
        if len({(h.micro_batches, h.fingerprint) for h in members}) == 1:
            failed = 0
            for h in members:
                failed |= h.failed
            kept = [m for m in range(count) if not failed >> min(m, _TRACKED - 1) & 1]
            problem = None
        else:
            # SP ranks that ran different micro-batches cannot be paired up: drop the step.
            kept = []
            problem = (
                f"sequence-parallel ranks {[h.rank for h in members]} ran different micro-batches "
                f"this step (counts {[h.micro_batches for h in members]}, or different layouts)"
            )
            mismatch = mismatch or problem
        plan.dropped += count - len(kept)
        if gid == sp_id:
            plan.kept, plan.mismatch_here = kept, problem
    first = next((h for h in headers if h.error_at >= 0), None)
    plan.error = f"rank {first.rank}, micro-batch {first.error_at}: {first.error}" if first else mismatch
    return plan


def _metrics_group(sp_group, dp_group):
    """The process group spanning ``sp_group x dp_group`` (None when both are trivial)."""
    if group_size(sp_group) == 1:
        return dp_group if group_size(dp_group) > 1 else None
    if group_size(dp_group) == 1:
        return sp_group
    sp_ranks = sorted(dist.get_process_group_ranks(sp_group))
    # Construction-time collective over dp_group: the union of the DP peers' SP groups.
    rows = gather_headers(sp_ranks, dp_group)
    union = sorted({rank for row in rows for rank in row})
    expected = len(sp_ranks) * group_size(dp_group)
    if len(union) != expected:
        raise ValueError(
            f"sp_group (size {len(sp_ranks)}) and dp_group (size {group_size(dp_group)}) must "
            f"form a {len(sp_ranks)} x {group_size(dp_group)} block of {expected} ranks; "
            f"their union has {len(union)}"
        )
    if union == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(union, use_local_synchronization=True)


class ChannelLossMeter:
    """Per-source ("channel") cross-entropy metrics of each training step.

    ``sp_group`` / ``dp_group`` are the sequence- and data-parallel process
    groups (``None``: that dimension is absent). Each step::

        meter.begin_step()
        for batch in micro_batches:
            with meter.micro_batch(source_ids=..., layout=..., shard=...):
                loss = model(...)  # computed with chunk_cross_entropy, or call observe_logits
            loss.backward()
        metrics = meter.end_step()  # same dict on every rank

    ``end_step`` must be called on every rank of ``sp_group x dp_group`` for
    every step (it runs the two collectives); other calls communicate
    nothing. Only every ``interval``-th step is measured; the others do no
    work at all and return ``{}``.

    Metrics, per source ``name`` (the source's name when one is given, else
    ``str(source_id)``, sanitised to ``[A-Za-z0-9_.-]``; a name already taken
    by another source gets ``_2``, ``_3``, ... once and for good):
    ``{prefix}/{name}`` mean CE (absent when none of its targets was scored),
    ``{prefix}_tokens/{name}``, ``{prefix}_samples/{name}``,
    ``{prefix}_weighted/{name}`` (its loss sum over all scored tokens of the
    step), and ``{prefix}_dropped_micro_batches``.

    A micro-batch whose forward raised on any SP rank is dropped on all of
    them. Bad metadata (``ChannelLossMetadataError``) drops the micro-batch
    the same way with ``strict=False`` (logged on the rank that saw it); with
    ``strict=True`` every rank raises it from ``end_step``, together.
    """

    def __init__(
        self,
        *,
        sp_group=None,
        dp_group=None,
        strict: bool = False,
        interval: int = 1,
        prefix: str = "channel_loss",
        ignore_index: int = -100,
    ):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be a positive int; got {interval!r}")
        self.strict = strict
        self.interval = interval
        self.prefix = prefix
        self.ignore_index = ignore_index
        self._sp_size = group_size(sp_group)
        self._sp_rank = dist.get_rank(sp_group) if self._sp_size > 1 else 0
        self._group = _metrics_group(sp_group, dp_group)
        distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if distributed else 0
        self._sp_id = min(dist.get_process_group_ranks(sp_group)) if self._sp_size > 1 else self._rank
        self._slots: dict[SourceId, int] = {}
        self._names: list[str] = []
        self._taken: set[str] = set()
        self._next_step = 0
        self._step: _Step | None = None
        self._open: _MicroBatch | None = None

    # ------------------------------------------------------------------ step lifecycle

    @property
    def sampled(self) -> bool:
        """True inside a step that ``end_step`` will measure."""
        return self._step is not None and self._step.sampled

    def begin_step(self, step: int | None = None) -> None:
        """Open a step; ``step`` (default: one more than the last) decides whether it is sampled.

        All ranks must agree on ``step``; pass the trainer's global step to
        keep ``interval`` aligned with its logging across restarts.
        """
        if self._step is not None:
            raise RuntimeError("begin_step() called again before end_step()")
        index = self._next_step if step is None else int(step)
        self._step = _Step(index, sampled=index % self.interval == 0)

    @contextmanager
    def micro_batch(
        self,
        *,
        source_ids,
        layout: PackedLayout,
        shard: Shard | None = None,
        source_names: Mapping[SourceId, str] | None = None,
    ) -> Iterator[None]:
        """Measure one micro-batch: wrap its forward and loss.

        ``source_ids`` has one id (``int`` or ``str``) per sample of
        ``layout``; ``shard`` is this rank's slice when ``sp_group`` has more
        than one rank; ``source_names`` maps ids to display names. The loss
        inside must be computed with ``chunk_cross_entropy`` (or reported
        with ``observe_logits``) exactly once. If the body raises, the
        micro-batch is dropped on every SP rank and the exception propagates
        unchanged.
        """
        step = self._require_step("micro_batch")
        if not step.sampled:
            yield
            return
        if self._open is not None:
            raise RuntimeError("micro_batch() scopes do not nest")
        micro = _MicroBatch(
            (layout.num_samples, layout.shape) if isinstance(layout, PackedLayout) else ("?",)
        )
        step.micro_batches.append(micro)
        self._open = micro
        try:
            with capture() as cap:
                yield
        finally:
            self._open = None
        # Only a forward that returned gets here; a raised one leaves totals None.
        try:
            micro.totals, micro.names = self._attribute(
                cap.observations, source_ids, layout, shard, source_names
            )
        except ChannelLossMetadataError as error:
            self._reject(step, len(step.micro_batches) - 1, error)

    def observe_logits(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        chunk_size: int = 1024,
    ) -> None:
        """Report the per-token losses of a model that returns ``logits``; call inside ``micro_batch``.

        Targets follow the usual rule (``shift_labels``, else ``labels``
        shifted by one); the losses are computed detached, chunk by chunk.
        """
        step = self._require_step("observe_logits")
        if not step.sampled:
            return
        if self._open is None:
            raise RuntimeError("observe_logits() must be called inside micro_batch()")
        targets = resolve_targets(
            logits.shape[:-1], labels, shift_labels, self.ignore_index, logits.shape[-1], "logits"
        )
        losses = per_token_cross_entropy(
            logits=logits, shift_labels=targets, ignore_index=self.ignore_index, chunk_size=chunk_size
        )
        record(losses, targets, self.ignore_index)

    def end_step(self) -> dict[str, float]:
        """Close the step; on a sampled one, reduce it over all ranks and return the metrics.

        Runs at most two collectives over ``sp_group x dp_group`` and returns
        the same dict on every rank (``{}`` on unsampled steps). With
        ``strict=True`` raises ``ChannelLossMetadataError`` on every rank
        when any rank saw bad metadata this step.
        """
        step = self._require_step("end_step")
        if self._open is not None:
            raise RuntimeError("end_step() called inside micro_batch()")
        self._step = None
        self._next_step = step.index + 1
        if not step.sampled:
            return {}
        return self._reduce(step)

    # ------------------------------------------------------------------ registry

    def state_dict(self) -> dict:
        """The source registry (ids and names, in registration order) and the step counter."""
        return {
            "version": 1,
            "next_step": self._next_step,
            "sources": [[key, self._names[slot]] for key, slot in self._slots.items()],
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()``: the same sources keep the same names (and suffixes)."""
        if self._step is not None:
            raise RuntimeError("load_state_dict() inside a step")
        if state.get("version") != 1:
            raise ValueError(f"unknown ChannelLossMeter state version {state.get('version')!r}")
        self._slots, self._names, self._taken = {}, [], set()
        for key, name in state["sources"]:
            if not isinstance(key, (int, str)) or not isinstance(name, str):
                raise ValueError(f"bad source entry in ChannelLossMeter state: {[key, name]!r}")
            self._slots[key] = len(self._names)
            self._names.append(name)
            self._taken.add(name)
        self._next_step = int(state["next_step"])

    def _register(self, key: SourceId, name: str) -> int:
        base = sanitise_name(name or str(key))
        unique, suffix = base, 2
        while unique in self._taken:
            unique, suffix = f"{base}_{suffix}", suffix + 1
        self._slots[key] = len(self._names)
        self._names.append(unique)
        self._taken.add(unique)
        return self._slots[key]

    # ------------------------------------------------------------------ internals

    def _require_step(self, what: str) -> _Step:
        if self._step is None:
            raise RuntimeError(f"{what}() needs an open step: call begin_step() first")
        return self._step

    def _attribute(
        self, observations: list[TokenObservation], source_ids, layout, shard, source_names
    ) -> tuple[SourceTotals, dict[SourceId, str]]:
        if len(observations) != 1:
            raise ChannelLossMetadataError(
                f"expected 1 loss observation inside micro_batch(), got {len(observations)} "
                "(compute the loss once with chunk_cross_entropy, or call observe_logits once)"
            )
        if shard is None and self._sp_size > 1:
            raise ChannelLossMetadataError(
                f"sp_group has {self._sp_size} ranks but micro_batch() got no shard"
            )
        if isinstance(shard, Shard) and (shard.world_size, shard.rank) != (self._sp_size, self._sp_rank):
            raise ChannelLossMetadataError(
                f"the shard is rank {shard.rank} of {shard.world_size} but this is rank "
                f"{self._sp_rank} of {self._sp_size} in sp_group"
            )
        if source_names is not None and not isinstance(source_names, Mapping):
            raise ChannelLossMetadataError(
                f"source_names must map source ids to names; got {type(source_names).__name__}"
            )
        observed = observations[0]
        totals = source_totals(
            observed.token_losses, observed.targets, layout=layout, source_ids=source_ids,
            shard=shard, ignore_index=self.ignore_index,
        )
        names = {}
        for key in totals.keys:  # distinct sources, not samples
            name = (source_names or {}).get(key)
            if name is not None and not isinstance(name, str):
                raise ChannelLossMetadataError(
                    f"source_names[{key!r}] must be a str; got {type(name).__name__}"
                )
            if name:
                names[key] = name
        return totals, names

    def _reject(self, step: _Step, index: int, error: ChannelLossMetadataError) -> None:
        if step.error_at < 0:
            step.error_at, step.error = index, str(error)
        if not self.strict:
            logger.warning(
                "channel_loss: micro-batch %d of step %d dropped on every sequence-parallel "
                "rank: %s", index, step.index, error,
            )

    def _header(self, step: _Step, new_keys: int, new_words: int) -> _Header:
        failed = 0
        for m, micro in enumerate(step.micro_batches):
            if micro.totals is None:
                failed |= 1 << min(m, _TRACKED - 1)
        fingerprint = zlib.crc32(repr([m.fingerprint for m in step.micro_batches]).encode())
        return _Header(self._rank, self._sp_id, len(step.micro_batches), fingerprint,
                       new_keys, new_words, failed, step.error_at, step.error)

    def _reduce(self, step: _Step) -> dict[str, float]:
        # Sources this rank measured that no rank has registered yet, with the first name given.
        new: dict[SourceId, str] = {}
        for micro in step.micro_batches:
            for key in micro.totals.keys if micro.totals is not None else ():
                if key not in self._slots and not new.get(key):
                    new[key] = micro.names.get(key, "")
        words = encode_entries(list(new.items()))
        headers = [_Header.unpack(row) for row in
                   gather_headers(self._header(step, len(new), len(words)).pack(), self._group)]
        plan = _plan(headers, self._sp_id)
        if self.strict and plan.error is not None:
            raise ChannelLossMetadataError(plan.error)
        if plan.mismatch_here is not None:
            logger.warning("channel_loss: step %d dropped: %s", step.index, plan.mismatch_here)

        # This rank's rows: registered sources first, then its new ones, in `new` order.
        known = len(self._names)
        slot = {**self._slots, **{key: known + i for i, key in enumerate(new)}}
        kept = [step.micro_batches[m].totals for m in plan.kept]
        device = kept[0].loss_sum.device if kept else torch.device("cpu")
        rows = torch.zeros(known + len(new), 3, dtype=torch.float64, device=device)
        for totals in kept:
            into = torch.tensor([slot[key] for key in totals.keys], dtype=torch.int64, device=device)
            rows.index_add_(0, into, totals.rows())
        summed, arrivals = all_reduce_rows(
            rows[:known], rows[known:], words, [(h.new_keys, h.new_words) for h in headers], self._group
        )

        # Register what any rank announced, in rank order: the same registry everywhere.
        slots, parts = [], [summed]
        for header, (their_rows, their_words) in zip(headers, arrivals, strict=True):
            for key, name in decode_entries(their_words, header.new_keys):
                slots.append(self._slots[key] if key in self._slots else self._register(key, name))
            parts.append(their_rows)
        totals = torch.zeros(len(self._names), 3, dtype=torch.float64)
        totals.index_add_(0, torch.arange(known), summed)
        if slots:
            totals.index_add_(0, torch.tensor(slots, dtype=torch.int64), torch.cat(parts[1:]))
        return self._metrics(totals, plan.dropped)

    def _metrics(self, totals: torch.Tensor, dropped: int) -> dict[str, float]:
        p = self.prefix
        all_tokens = float(totals[:, 1].sum())
        metrics: dict[str, float] = {}
        for name, (loss, tokens, samples) in zip(self._names, totals.tolist(), strict=True):
            if tokens == 0 and samples == 0:
                continue  # not in this step
            if tokens:
                metrics[f"{p}/{name}"] = loss / tokens
            metrics[f"{p}_tokens/{name}"] = tokens
            metrics[f"{p}_samples/{name}"] = samples
            metrics[f"{p}_weighted/{name}"] = loss / all_tokens if all_tokens else 0.0
        metrics[f"{p}_dropped_micro_batches"] = float(dropped)
        return metrics
