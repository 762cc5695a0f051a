"""Plain-Python references for attribution and sharding, written from the documented contracts, not from the code.

Deliberately loop-based and slow: each line can be checked against the
contract by eye. Import as ``from tests.channel_loss.reference import ...``.

Columns: ``reference_totals`` returns one value per entry of
``channel_loss.attribution.COLUMNS``, in that order. ``loss_sum``, ``tokens``
and ``samples`` come from the loop below; a column added to ``COLUMNS`` that
the loop does not know is taken from the unsharded, single-process
``source_totals``, so everything downstream of attribution (sharded partials,
``+``, the cross-rank reduction, the meter's metrics) is still checked
exactly against it without editing this file.

Shard modes: ``reference_global_index`` has its own formula per mode, and
``SHARD_MODES`` (the library's registry) says which modes exist: a registered
mode without a formula here fails loudly.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata

import torch

from channel_loss import PackedLayout, source_totals
from channel_loss.attribution import COLUMNS
from channel_loss.layout import SHARD_MODES
from tests.strategies import IGNORE_INDEX, PackedCase

#: The columns the loop computes itself.
LOOP_COLUMNS = ("loss_sum", "tokens", "samples")
_INDEX = {column.name: i for i, column in enumerate(COLUMNS)}


def layout_of(case: PackedCase) -> PackedLayout:
    """The ``PackedLayout`` of a case, from its position ids and tail padding."""
    tails = case.tails[0] if case.one_d else list(case.tails)
    return PackedLayout.from_position_ids(case.position_ids(), tail_padding_length=tails)


def samples_of(case: PackedCase):
    """Yield ``(sample_number, source_id, first_flat_index, length)`` row-major."""
    number = 0
    for b, lengths in enumerate(case.rows):
        start = b * case.row_length
        for length in lengths:
            yield number, case.source_ids[number], start, length
            start += length
            number += 1


def zero_row() -> list:
    """One source's totals over nothing, in ``COLUMNS`` order."""
    return [0.0 if column.dtype.is_floating_point else 0 for column in COLUMNS]


def reference_totals(case: PackedCase, token_losses=None) -> dict:
    """``{source: [value per COLUMNS entry]}`` over the whole (unsharded) batch, float64 sums."""
    losses = case.token_losses if token_losses is None else token_losses
    flat_losses = losses.reshape(-1).tolist()
    targets = case.targets.reshape(-1).tolist()
    out: dict = {}
    for _, source, start, length in samples_of(case):
        entry = out.setdefault(source, zero_row())
        entry[_INDEX["samples"]] += 1
        for i in range(start, start + length):
            if targets[i] != IGNORE_INDEX:
                entry[_INDEX["loss_sum"]] += float(flat_losses[i])
                entry[_INDEX["tokens"]] += 1
    others = [c.name for c in COLUMNS if c.name not in LOOP_COLUMNS]
    if others and out:
        unsharded = source_totals(
            torch.as_tensor(losses),
            case.targets,
            layout=layout_of(case),
            source_ids=list(case.source_ids),
        ).as_dict()
        for source, entry in out.items():
            for name in others:
                entry[_INDEX[name]] = unsharded[source][_INDEX[name]]
    return out


def add_totals(*parts: dict) -> dict:
    """Sum several ``reference_totals`` results, column by column."""
    out: dict = {}
    for part in parts:
        for source, values in part.items():
            entry = out.setdefault(source, zero_row())
            for i, value in enumerate(values):
                entry[i] += value
    return out


def make_totals(keys, **columns):
    """A ``SourceTotals`` with the given columns (lists, one value per key); the others zero."""
    from channel_loss import SourceTotals

    unknown = set(columns) - set(_INDEX)
    assert not unknown, f"no such columns: {unknown}"
    return SourceTotals(
        tuple(keys),
        **{
            c.name: torch.tensor(columns.get(c.name, [0] * len(keys)), dtype=c.dtype)
            for c in COLUMNS
        },
    )


def pick(totals_dict: dict, *names: str) -> dict:
    """``{source: (values of the named columns)}`` of an ``as_dict()`` or ``reference_totals``."""
    return {key: tuple(values[_INDEX[n]] for n in names) for key, values in totals_dict.items()}


def _contiguous(T: int, lengths, tail: int, world: int, rank: int) -> list[int]:
    part = math.ceil(T / world)
    return [offset if offset < T else -1 for offset in range(rank * part, (rank + 1) * part)]


def _zigzag(T: int, lengths, tail: int, world: int, rank: int) -> list[int]:
    blocks, start = [], 0
    for length in [*lengths, tail] if tail else lengths:
        blocks.append((start, length))
        start += length
    row = []
    for start, length in blocks:
        chunk = math.ceil(length / (2 * world))  # P_k / (2w)
        first = range(rank * chunk, (rank + 1) * chunk)
        second = range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)
        row += [start + offset if offset < length else -1 for offset in [*first, *second]]
    return row


def _headtail(T: int, lengths, tail: int, world: int, rank: int) -> list[int]:
    chunk = math.ceil(T / (2 * world))  # the row padded to 2w chunks
    first = range(rank * chunk, (rank + 1) * chunk)
    second = range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)
    return [offset if offset < T else -1 for offset in [*first, *second]]


#: One formula per shard mode: a row's local offsets (within the row, -1: shard padding).
INDEX_FORMULAS = {"contiguous": _contiguous, "zigzag": _zigzag, "headtail": _headtail}


def reference_global_index(case: PackedCase, world: int, rank: int, mode: str) -> list[list[int]]:
    """Per row, the original flat index of each of ``rank``'s local positions (-1: shard padding)."""
    assert mode in SHARD_MODES, f"{mode!r} is not a registered shard mode"
    assert mode in INDEX_FORMULAS, f"shard mode {mode!r} has no reference formula in {__file__}"
    T = case.row_length
    rows = []
    for b, (lengths, tail) in enumerate(zip(case.rows, case.tails, strict=True)):
        local = INDEX_FORMULAS[mode](T, lengths, tail, world, rank)
        rows.append([b * T + offset if offset >= 0 else -1 for offset in local])
    width = max(len(row) for row in rows)
    return [row + [-1] * (width - len(row)) for row in rows]


def sanitised(name) -> str:
    """The documented metric name of ``name``: itself when it holds only letters, marks and
    digits of any script and ``_.-``; else those kept, the others ``_``, then ``-`` and the
    first 8 hex digits of the SHA-256 of the name."""
    name = str(name)
    kept = "".join(c if c in "_.-" or unicodedata.category(c)[0] in "LMN" else "_" for c in name)
    if kept == name and name:
        return name
    return f"{kept or '_'}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def reference_metrics(
    totals: dict, *, names: dict | None = None, dropped: int = 0, prefix: str = "channel_loss"
) -> dict:
    """The meter's metrics for ``reference_totals``-shaped ``totals`` (no name collisions assumed).

    Per source present (any column but ``loss_sum`` non-zero): the mean CE
    when it has scored tokens, one ``{prefix}_{metric}/{name}`` per column
    with a metric family, and the weighted share.
    """
    names = names or {}
    loss, tokens = _INDEX["loss_sum"], _INDEX["tokens"]
    all_tokens = sum(values[tokens] for values in totals.values())
    out = {}
    for source, values in totals.items():
        if not any(value for i, value in enumerate(values) if i != loss):
            continue
        name = sanitised(names.get(source, source))
        if values[tokens]:
            out[f"{prefix}/{name}"] = values[loss] / values[tokens]
        for column, value in zip(COLUMNS, values, strict=True):
            if column.metric is not None:
                out[f"{prefix}_{column.metric}/{name}"] = float(value)
        out[f"{prefix}_weighted/{name}"] = values[loss] / all_tokens if all_tokens else 0.0
    out[f"{prefix}_dropped_micro_batches"] = float(dropped)
    return out
