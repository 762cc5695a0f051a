"""The step meter: per-source cross-entropy metrics of a training step, reduced across SP and DP ranks.

Per micro-batch, ``micro_batch()`` opens ``capture()`` around forward + loss
and turns the observed per-token losses into this rank's partial
``SourceTotals`` on the device: no collective, no host sync. ``end_step()``
reduces the whole step over the sequence-parallel (SP) and data-parallel (DP)
ranks together in two collectives (see ``channel_loss.exchange``):

1. a fixed-size int64 header per rank (``exchange.StepHeader``): its SP group,
   how many micro-batches it ran and which of them failed (forward raised, or
   bad metadata) as up to ``exchange.RUNS`` runs of consecutive indices, the
   first metadata error message, and the sizes of its never-seen-before sources;
2. one float64 vector: rows for every registered source, plus each rank's new
   sources (ids and the names it was given, as numbers) with their rows.

Every rank reads the same headers, so every rank takes the same decisions
from them: an SP group drops a micro-batch that failed on any of its ranks;
with ``strict=True`` every rank raises when any rank saw bad metadata. New
sources are registered in rank order, so the registry (and the metric names)
are identical everywhere.

The per-source columns and how they merge are defined once, by
``channel_loss.attribution.COLUMNS``; ``metrics_from_columns`` turns summed
columns into the metric dict and ``columns_from_metrics`` reads them back (for
merging logging windows), so the meter, the HF callback and the demo agree.
"""

from __future__ import annotations

import hashlib
import logging
import unicodedata
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from channel_loss.attribution import COLUMNS, SourceId, SourceTotals, check_text, source_totals
from channel_loss.capture import TokenObservation, capture, record
from channel_loss.errors import ChannelLossMetadataError
from channel_loss.exchange import (
    SLOTS,
    KeyedExchange,
    StepHeader,
    failure_runs,
    gather_headers,
    group_size,
)
from channel_loss.layout import PackedLayout, Shard
from channel_loss.ops import per_token_cross_entropy, resolve_targets
from channel_loss.validation import check_int, is_int

__all__ = [
    "DROPPED",
    "MEAN",
    "WEIGHTED",
    "ChannelLossMeter",
    "columns_from_metrics",
    "metric_key",
    "metrics_from_columns",
]

logger = logging.getLogger(__name__)

_LOSS = next(i for i, c in enumerate(COLUMNS) if c.name == "loss_sum")
_TOKENS = next(i for i, c in enumerate(COLUMNS) if c.name == "tokens")
#: Metric families that are not a column: the mean CE (``{prefix}/{name}``),
#: the share of the step's loss (``{prefix}_weighted/{name}``).
MEAN, WEIGHTED = "", "weighted"
DROPPED = "dropped_micro_batches"


def metric_key(prefix: str, family: str, name: str = "") -> str:
    """The metric key of ``family`` (``MEAN``, ``WEIGHTED``, a column's ``metric``, ``DROPPED``) for source ``name``."""
    if family == DROPPED:
        return f"{prefix}_{DROPPED}"
    return f"{prefix}_{family}/{name}" if family else f"{prefix}/{name}"


def metrics_from_columns(
    columns: Mapping[str, Sequence[float]], *, prefix: str, dropped: float
) -> dict[str, float]:
    """The metric dict of summed per-source columns (values in ``COLUMNS`` order, per source name).

    Per source present (any non-zero count): ``{prefix}/{name}`` = loss_sum /
    tokens (absent without scored tokens), one ``{prefix}_{metric}/{name}`` per
    column with a ``metric`` family, ``{prefix}_weighted/{name}`` = loss_sum /
    the tokens of all sources; and ``{prefix}_dropped_micro_batches``.
    """
    all_tokens = sum(values[_TOKENS] for values in columns.values())
    metrics: dict[str, float] = {}
    for name, values in columns.items():
        if not any(v for i, v in enumerate(values) if i != _LOSS):
            continue  # not in this step
        loss, tokens = values[_LOSS], values[_TOKENS]
        if tokens:
            metrics[metric_key(prefix, MEAN, name)] = loss / tokens
        for column, value in zip(COLUMNS, values, strict=True):
            if column.metric is not None:
                metrics[metric_key(prefix, column.metric, name)] = float(value)
        metrics[metric_key(prefix, WEIGHTED, name)] = loss / all_tokens if all_tokens else 0.0
    metrics[metric_key(prefix, DROPPED)] = float(dropped)
    return metrics


def columns_from_metrics(
    metrics: Mapping[str, float], *, prefix: str
) -> tuple[dict[str, list[float]], float]:
    """Inverse of ``metrics_from_columns``: ``({name: column values}, dropped)``.

    ``loss_sum`` comes back as mean x tokens (0 without scored tokens: only
    scored tokens carry loss), exact up to one float rounding.
    """
    columns: dict[str, list[float]] = {}
    for column_index, column in enumerate(COLUMNS):
        if column.metric is None:
            continue
        start = metric_key(prefix, column.metric, "")
        for key, value in metrics.items():
            if key.startswith(start):
                columns.setdefault(key[len(start) :], [0.0] * len(COLUMNS))[column_index] = value
    for name, values in columns.items():
        values[_LOSS] = metrics.get(metric_key(prefix, MEAN, name), 0.0) * values[_TOKENS]
    return columns, metrics.get(metric_key(prefix, DROPPED), 0.0)


def _allowed(char: str, ascii_only: bool) -> bool:
    if char in "_.-":
        return True
    if ascii_only:
        return char.isascii() and char.isalnum()
    # Letters, marks (the vowel signs of Devanagari, combining accents) and digits: a name
    # in any script stays readable.
    return unicodedata.category(char)[0] in "LMN"


def sanitise_name(name: str, *, ascii_only: bool = False) -> str:
    """The metric name of a source called ``name``; the same in every process and run.

    ``name`` itself when every character is allowed: a Unicode letter, mark or
    digit, ``_``, ``.`` or ``-`` (with ``ascii_only``, only ``[A-Za-z0-9_.-]``).
    Otherwise each other character becomes ``_`` and ``-`` plus the first 8 hex
    digits of the SHA-256 of ``name`` (UTF-8) are appended, so names that differ
    only in replaced characters stay distinct (``"a b"`` -> ``"a_b-c8687a08"``;
    ``ascii_only``: ``"日本語"`` -> ``"___-77710aed"``). The result holds only
    allowed characters, so it is its own metric name.
    """
    kept = "".join(c if _allowed(c, ascii_only) else "_" for c in name)
    if kept == name and name:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{kept or '_'}-{digest}"


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


def _plan(headers: list[StepHeader], sp_id: int) -> _Plan:
    groups: dict[int, list[StepHeader]] = {}
    for header in headers:
        groups.setdefault(header.sp_id, []).append(header)
    plan = _Plan([], 0, None, None)
    mismatch = None
    for gid, members in groups.items():
        count = max(h.micro_batches for h in members)
        failed = {
            m
            for h in members
            for start, length in h.failed
            for m in range(start, min(start + length, count))
        }
        # A micro-batch failed on any peer is dropped on all: its fingerprint (a bad
        # layout, on the rank that failed it) must not drop the rest of the step.
        skipped = {m % SLOTS for m in failed}
        checked = [i for i in range(SLOTS) if i not in skipped]
        prints = {tuple(h.fingerprint[i] for i in checked) for h in members}
        if len({h.micro_batches for h in members}) == 1 and len(prints) == 1:
            kept = [m for m in range(count) if m not in failed]
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
    plan.error = (
        f"rank {first.rank}, micro-batch {first.error_at}: {first.error}" if first else mismatch
    )
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
    ``str(source_id)``, made a metric name by ``sanitise_name``: readable in any
    script, with a stable hash suffix where a character was replaced, ASCII-only
    with ``ascii_names=True``; a name still taken by another source gets
    ``_2``, ``_3``, ... once and for good):
    ``{prefix}/{name}`` mean CE (absent when none of its targets was scored),
    ``{prefix}_tokens/{name}``, ``{prefix}_samples/{name}``,
    ``{prefix}_weighted/{name}`` (its loss sum over all scored tokens of the
    step), and ``{prefix}_dropped_micro_batches``.

    Every metric ignores exactly the targets the loss ignored: each
    observation carries the ``ignore_index`` of the loss that made it
    (``ignore_index`` here is only what ``observe_logits`` scores with).

    A micro-batch whose forward raised on any SP rank is dropped on all of
    them, whatever the number of micro-batches in the step (see ``exchange.failure_runs``
    for the one approximation: a rank whose failures in one step form more
    than 16 separate runs also drops the micro-batches between its last
    ones). Bad metadata (``ChannelLossMetadataError``: a bad layout, shard,
    source id (only ``int`` / ``str``, valid UTF-8) or name) drops the
    micro-batch the same way with ``strict=False`` (logged on the rank that
    saw it); with ``strict=True`` every rank raises it from ``end_step``,
    together.

    Source names: a source's name is fixed in the step it is first
    measured. When ranks (or micro-batches) give one new source different
    names in that step, ``strict=True`` makes every rank raise from
    ``end_step`` (the registry is left unchanged); ``strict=False`` takes,
    on every rank alike, the name given by the lowest rank that gave one
    (its earliest micro-batch), and logs a warning. A name given for an
    already registered source is ignored: names stay stable across steps
    and restarts.
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
        ascii_names: bool = False,
    ):
        self.strict = strict
        self.ascii_names = bool(ascii_names)
        # A fractional interval (the Trainer's logging_steps < 1 form) is the caller's to convert.
        self.interval = check_int(interval, "interval", minimum=1)
        self.prefix = prefix
        self.ignore_index = check_int(ignore_index, "ignore_index")
        self._sp_size = group_size(sp_group)
        self._sp_rank = dist.get_rank(sp_group) if self._sp_size > 1 else 0
        self._group = _metrics_group(sp_group, dp_group)
        distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if distributed else 0
        self._sp_id = (
            min(dist.get_process_group_ranks(sp_group)) if self._sp_size > 1 else self._rank
        )
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
        index = self._next_step if step is None else check_int(step, "begin_step(step=...)")
        self._step = _Step(index, sampled=index % self.interval == 0)

    @contextmanager
    def micro_batch(
        self,
        *,
        source_ids,
        layout: PackedLayout,
        shard: Shard | None = None,
        source_names: Mapping[SourceId, str] | None = None,
        observe: int | None = None,
    ) -> Iterator[None]:
        """Measure one micro-batch: wrap its forward and loss.

        ``source_ids`` has one id (``int`` or ``str``) per sample of
        ``layout``, in the layout's row-major sample order (paired samples,
        e.g. DPO's chosen and rejected, are two samples: give each the pair's
        id; for TRL's ``[chosen rows; rejected rows]`` batch that is
        ``pair_ids + pair_ids``); ``shard`` is this rank's slice when ``sp_group`` has more
        than one rank; ``source_names`` maps ids to display names.

        The loss inside must be computed with ``chunk_cross_entropy`` (or
        reported with ``observe_logits``) exactly once, unless ``observe``
        says which call to attribute: with an auxiliary or multi-token
        prediction head computing a second cross-entropy, pass the index of
        the main loss's call in call order (``0``: the first, ``-1``: the
        last); the other calls are not measured. Any other number of calls
        (or an ``observe`` index the forward did not reach) is a metadata
        error: the micro-batch is dropped and counted in
        ``{prefix}_dropped_micro_batches`` with a warning, or raised from
        ``end_step`` with ``strict=True``; never silently measured wrong.

        If the body raises, the micro-batch is dropped on every SP rank and
        the exception propagates unchanged.
        """
        if observe is not None:
            observe = check_int(observe, "micro_batch(observe=...)")
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
                cap.observations, source_ids, layout, shard, source_names, observe
            )
        except ChannelLossMetadataError as error:
            self._reject(step, len(step.micro_batches) - 1, error)

    def observe_logits(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> None:
        """Report the per-token losses of a model that returns ``logits``; call inside ``micro_batch``.

        Targets follow the usual rule (``shift_labels``, else ``labels``
        shifted by one); the losses are computed detached, chunk by chunk
        (``chunk_size`` None: ``per_token_cross_entropy``'s default for logits).
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
            logits=logits,
            shift_labels=targets,
            ignore_index=self.ignore_index,
            chunk_size=chunk_size,
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
            "sources": self._sources(),
        }

    def _sources(self) -> list[list]:
        """The registry: ``[source id, name]`` in registration order."""
        return [[key, self._names[slot]] for key, slot in self._slots.items()]

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()``: the same sources keep the same names (and suffixes).

        Call it on every rank with the same state: ranks whose registries
        differ make the next sampled ``end_step`` raise ``RuntimeError`` on
        every rank (the step is closed; restoring on every rank recovers).
        """
        if self._step is not None:
            raise RuntimeError("load_state_dict() inside a step")
        if not isinstance(state, Mapping):
            raise ValueError(
                f"ChannelLossMeter state must be a mapping; got {type(state).__name__}"
            )
        if state.get("version") != 1:
            raise ValueError(f"unknown ChannelLossMeter state version {state.get('version')!r}")
        lacking = [key for key in ("sources", "next_step") if key not in state]
        if lacking:
            raise ValueError(f"ChannelLossMeter state lacks {', '.join(map(repr, lacking))}")
        if not isinstance(state["sources"], (list, tuple)):
            raise ValueError(
                "ChannelLossMeter state 'sources' must be a list of [source, name] pairs; got "
                f"{type(state['sources']).__name__}"
            )
        slots: dict[SourceId, int] = {}
        names: list[str] = []
        for entry in state["sources"]:
            key, name = (
                entry if isinstance(entry, (list, tuple)) and len(entry) == 2 else (None, None)
            )
            if not (is_int(key) or isinstance(key, str)) or not isinstance(name, str):
                raise ValueError(f"bad source entry in ChannelLossMeter state: {entry!r}")
            key = key if isinstance(key, str) else int(key)
            if key in slots:
                raise ValueError(f"ChannelLossMeter state lists source {key!r} twice")
            if name in names:
                other = next(k for k, slot in slots.items() if names[slot] == name)
                raise ValueError(
                    f"ChannelLossMeter state gives sources {other!r} and {key!r} the same metric "
                    f"name {name!r}; one would overwrite the other"
                )
            if name != sanitise_name(name, ascii_only=self.ascii_names):
                allowed = "[A-Za-z0-9_.-]" if self.ascii_names else "letters, marks, digits, _.-"
                raise ValueError(
                    f"ChannelLossMeter state: the name {name!r} of source {key!r} is not a metric "
                    f"name (characters outside {allowed})"
                )
            slots[key] = len(names)
            names.append(name)
        next_step = check_int(state["next_step"], "ChannelLossMeter state next_step")
        self._slots, self._names, self._taken = slots, names, set(names)
        self._next_step = next_step

    def _register(self, key: SourceId, name: str) -> int:
        base = sanitise_name(name or str(key), ascii_only=self.ascii_names)
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
        self,
        observations: list[TokenObservation],
        source_ids,
        layout,
        shard,
        source_names,
        observe: int | None,
    ) -> tuple[SourceTotals, dict[SourceId, str]]:
        count = len(observations)
        if observe is None and count != 1:
            raise ChannelLossMetadataError(
                f"expected 1 loss observation inside micro_batch(), got {count} (compute the loss "
                "once with chunk_cross_entropy, or call observe_logits once; with an auxiliary "
                "head, pass micro_batch(observe=i) to attribute the i-th call)"
            )
        if observe is not None and not -count <= observe < count:
            raise ChannelLossMetadataError(
                f"micro_batch(observe={observe}) but the forward made {count} loss observations"
            )
        if shard is None and self._sp_size > 1:
            raise ChannelLossMetadataError(
                f"sp_group has {self._sp_size} ranks but micro_batch() got no shard"
            )
        if isinstance(shard, Shard) and (shard.world_size, shard.rank) != (
            self._sp_size,
            self._sp_rank,
        ):
            raise ChannelLossMetadataError(
                f"the shard is rank {shard.rank} of {shard.world_size} but this is rank "
                f"{self._sp_rank} of {self._sp_size} in sp_group"
            )
        if source_names is not None and not isinstance(source_names, Mapping):
            raise ChannelLossMetadataError(
                f"source_names must map source ids to names; got {type(source_names).__name__}"
            )
        observed = observations[0 if observe is None else observe]
        totals = source_totals(
            observed.token_losses,
            observed.targets,
            layout=layout,
            source_ids=source_ids,
            shard=shard,
            ignore_index=observed.ignore_index,
        )
        names = {}
        for key in totals.keys:  # distinct sources, not samples
            name = (source_names or {}).get(key)
            if name is not None and not isinstance(name, str):
                raise ChannelLossMetadataError(
                    f"source_names[{key!r}] must be a str; got {type(name).__name__}"
                )
            if name:
                check_text(name, f"source_names[{key!r}]")
                names[key] = name
        return totals, names

    def _reject(self, step: _Step, index: int, error: ChannelLossMetadataError) -> None:
        if step.error_at < 0:
            step.error_at, step.error = index, str(error)
        if not self.strict:
            logger.warning(
                "channel_loss: micro-batch %d of step %d dropped on every sequence-parallel "
                "rank: %s",
                index,
                step.index,
                error,
            )

    def _header(self, step: _Step) -> StepHeader:
        failed = [m for m, micro in enumerate(step.micro_batches) if micro.totals is None]
        fingerprint = [0] * SLOTS
        for m, micro in enumerate(step.micro_batches):
            if micro.totals is not None:
                slot = m % SLOTS
                fingerprint[slot] = zlib.crc32(
                    repr((fingerprint[slot], m, micro.fingerprint)).encode()
                )
        registry = self._sources()
        return StepHeader(
            self._rank,
            self._sp_id,
            len(step.micro_batches),
            fingerprint,
            failure_runs(failed),
            step.error_at,
            step.error,
            (len(registry), zlib.crc32(repr(registry).encode())),
        )

    def _reduce(self, step: _Step) -> dict[str, float]:
        # Sources this rank measured that no rank has registered yet, with every name given.
        new: dict[SourceId, list[str]] = {}
        for micro in step.micro_batches:
            for key in micro.totals.keys if micro.totals is not None else ():
                if key not in self._slots:
                    given = new.setdefault(key, [])
                    name = micro.names.get(key, "")
                    if name and name not in given:
                        given.append(name)
        entries = [(key, name) for key, given in new.items() for name in given or [""]]
        exchange = KeyedExchange(entries, self._header(step).pack(), self._group)
        headers = [StepHeader.unpack(row) for row in exchange.headers]
        if len({h.registry for h in headers}) > 1:
            # Each rank's rows follow its own registry: summing them would mix sources
            # (or, at different lengths, abort the collective). Every rank raises here.
            sizes = ", ".join(f"rank {h.rank}: {h.registry[0]}" for h in headers)
            raise RuntimeError(
                f"ChannelLossMeter: the ranks' source registries differ ({sizes} sources): "
                "restore the same state_dict() on every rank with load_state_dict()"
            )
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
        rows = torch.zeros(known + len(new), len(COLUMNS), dtype=torch.float64, device=device)
        for totals in kept:
            into = torch.tensor(
                [slot[key] for key in totals.keys], dtype=torch.int64, device=device
            )
            rows.index_add_(0, into, totals.rows())
        reduced = exchange.reduce(rows[:known], rows[known:])

        # Every rank's new sources, first seen in rank order: the same registry everywhere.
        announced = {
            key: [(headers[rank].rank, name) for rank, name in given]
            for key, given in reduced.names.items()
        }
        self._check_names(announced, step)
        for key in reduced.new_keys:
            self._register(key, announced[key][0][1] if key in announced else "")
        return metrics_from_columns(
            dict(zip(self._names, reduced.rows.tolist(), strict=True)),
            prefix=self.prefix,
            dropped=plan.dropped,
        )

    def _check_names(self, announced: dict[SourceId, list[tuple[int, str]]], step: _Step) -> None:
        """Different names for one new source: every rank raises (strict) or warns alike."""
        clashes = {key: given for key, given in announced.items() if len({n for _, n in given}) > 1}
        if not clashes:
            return
        key, given = next(iter(clashes.items()))
        detail = ", ".join(f"rank {rank} {name!r}" for rank, name in given)
        more = f" (and {len(clashes) - 1} more sources)" if len(clashes) > 1 else ""
        message = f"step {step.index}: source {key!r} was given different names: {detail}{more}"
        if self.strict:
            raise ChannelLossMetadataError(message)
        logger.warning("channel_loss: %s; using the first (lowest rank)", message)
