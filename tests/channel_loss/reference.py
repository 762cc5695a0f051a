"""Plain-Python references for attribution and sharding, written from DESIGN.md, not from the code.

Deliberately loop-based and slow: each line can be checked against the
contract by eye. Import as ``from tests.channel_loss.reference import ...``.
"""

from __future__ import annotations

import math
import re

from tests.strategies import IGNORE_INDEX, PackedCase


def samples_of(case: PackedCase):
    """Yield ``(sample_number, source_id, first_flat_index, length)`` row-major."""
    number = 0
    for b, lengths in enumerate(case.rows):
        start = b * case.row_length
        for length in lengths:
            yield number, case.source_ids[number], start, length
            start += length
            number += 1


def reference_totals(case: PackedCase, token_losses=None) -> dict:
    """``{source: [loss_sum, tokens, samples]}`` over the whole (unsharded) batch, float64 sums."""
    losses = (case.token_losses if token_losses is None else token_losses).reshape(-1).tolist()
    targets = case.targets.reshape(-1).tolist()
    out: dict = {}
    for _, source, start, length in samples_of(case):
        entry = out.setdefault(source, [0.0, 0, 0])
        entry[2] += 1
        for i in range(start, start + length):
            if targets[i] != IGNORE_INDEX:
                entry[0] += float(losses[i])
                entry[1] += 1
    return out


def add_totals(*parts: dict) -> dict:
    """Sum several ``reference_totals`` results."""
    out: dict = {}
    for part in parts:
        for source, (loss, tokens, samples) in part.items():
            entry = out.setdefault(source, [0.0, 0, 0])
            entry[0] += loss
            entry[1] += tokens
            entry[2] += samples
    return out


def reference_global_index(case: PackedCase, world: int, rank: int, mode: str) -> list[list[int]]:
    """Per row, the original flat index of each of ``rank``'s local positions (-1: shard padding)."""
    T = case.row_length
    rows = []
    for b, (lengths, tail) in enumerate(zip(case.rows, case.tails, strict=True)):
        row = []
        if mode == "contiguous":
            part = math.ceil(T / world)
            for offset in range(rank * part, (rank + 1) * part):
                row.append(b * T + offset if offset < T else -1)
        else:
            blocks, start = [], 0
            for length in [*lengths, tail] if tail else lengths:
                blocks.append((start, length))
                start += length
            for start, length in blocks:
                chunk = math.ceil(length / (2 * world))  # P_k / (2w)
                first = range(rank * chunk, (rank + 1) * chunk)
                second = range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)
                for offset in [*first, *second]:
                    row.append(b * T + start + offset if offset < length else -1)
        rows.append(row)
    width = max(len(row) for row in rows)
    return [row + [-1] * (width - len(row)) for row in rows]


def sanitised(name) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(name))


def reference_metrics(totals: dict, *, names: dict | None = None, dropped: int = 0,
                      prefix: str = "channel_loss") -> dict:
    """The meter's metrics for ``{source: [loss, tokens, samples]}`` (no name collisions assumed)."""
    names = names or {}
    all_tokens = sum(tokens for _, tokens, _ in totals.values())
    out = {}
    for source, (loss, tokens, samples) in totals.items():
        if tokens == 0 and samples == 0:
            continue
        name = sanitised(names.get(source, source))
        if tokens:
            out[f"{prefix}/{name}"] = loss / tokens
        out[f"{prefix}_tokens/{name}"] = float(tokens)
        out[f"{prefix}_samples/{name}"] = float(samples)
        out[f"{prefix}_weighted/{name}"] = loss / all_tokens if all_tokens else 0.0
    out[f"{prefix}_dropped_micro_batches"] = float(dropped)
    return out
