"""Hypothesis strategies (and their deterministic builder) for packed / sequence-parallel batches.

Import as ``from tests.strategies import ...`` (``tests/conftest.py`` puts the
repository root on ``sys.path``).

A ``PackedCase`` is described the way a collator sees a batch (sample lengths
per row, tail padding per row, one source per sample) plus per-token
``targets`` and integer-valued ``token_losses``, so that sums of sharded
partials can be compared with ``==``. References that check code under test
should be computed from these plain fields, not from ``channel_loss``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from channel_loss.layout import SHARD_MODES

__all__ = [
    "IGNORE_INDEX",
    "SOURCES",
    "PackedCase",
    "make_case",
    "packed_cases",
    "sp_shardings",
    "sp_world_sizes",
]

IGNORE_INDEX = -100
#: Mixed int and str ids, including names that need sanitising.
SOURCES: tuple = ("web", "code/python", 3, 17, "wiki en")


@dataclass(frozen=True, eq=False)
class PackedCase:
    """One packed batch: ``rows[b]`` are the sample lengths of row ``b``, then ``tails[b]`` pad positions.

    ``one_d`` batches are ``[T]`` (one row); others ``[B, T]``. ``source_ids``
    has one id per sample, row-major. ``targets`` (int64) and ``token_losses``
    (float32, integer-valued, 0.0 exactly where the target is ignored) have
    the batch's shape; tail padding may carry non-ignored targets, which
    belong to no sample.
    """

    rows: tuple[tuple[int, ...], ...]
    tails: tuple[int, ...]
    row_length: int
    one_d: bool
    source_ids: tuple
    targets: torch.Tensor
    token_losses: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.row_length,) if self.one_d else (len(self.rows), self.row_length)

    @property
    def num_samples(self) -> int:
        return sum(len(row) for row in self.rows)

    def position_ids(self) -> torch.Tensor:
        """0, 1, ... within each sample; the tail padding counts on from 0 like a collator's pad."""
        rows = []
        for lengths, tail in zip(self.rows, self.tails, strict=True):
            rows.append([p for length in lengths for p in range(length)] + list(range(tail)))
        ids = torch.tensor(rows, dtype=torch.int64)
        return ids[0] if self.one_d else ids

    def cu_seqlens(self) -> list[int]:
        """Cumulative lengths of a one-row case's samples."""
        assert len(self.rows) == 1
        out = [0]
        for length in self.rows[0]:
            out.append(out[-1] + length)
        return out


def make_case(
    rows: Sequence[Sequence[int]],
    *,
    source_ids: Sequence,
    rng: random.Random,
    tails: Sequence[int] | None = None,
    one_d: bool = False,
    zero_supervised: Sequence[int] = (),
    scored_fraction: float = 0.7,
    max_loss: int = 20,
) -> PackedCase:
    """Build a case from sample lengths per row; rows are padded at the tail to a common length.

    ``tails`` are the minimum tail padding per row (default 0); samples whose
    index is in ``zero_supervised`` get no scored target at all.
    """
    rows = tuple(tuple(int(n) for n in row) for row in rows)
    minimum = list(tails) if tails is not None else [0] * len(rows)
    row_length = max(1, max(sum(row) + tail for row, tail in zip(rows, minimum, strict=True)))
    tails = tuple(row_length - sum(row) for row in rows)
    if len(source_ids) != sum(len(row) for row in rows):
        raise ValueError("one source id per sample")
    targets, losses = [], []
    sample = 0
    for row, tail in zip(rows, tails, strict=True):
        row_targets, row_losses = [], []
        for length in row:
            for _ in range(length):
                scored = sample not in zero_supervised and rng.random() < scored_fraction
                row_targets.append(rng.randrange(0, 50) if scored else IGNORE_INDEX)
                row_losses.append(float(rng.randrange(0, max_loss + 1)) if scored else 0.0)
            sample += 1
        for _ in range(tail):
            # Padding is usually ignored; a stray scored pad target must still count nowhere.
            scored = rng.random() < 0.2
            row_targets.append(rng.randrange(0, 50) if scored else IGNORE_INDEX)
            row_losses.append(float(rng.randrange(1, max_loss + 1)) if scored else 0.0)
        targets.append(row_targets)
        losses.append(row_losses)
    targets_t = torch.tensor(targets, dtype=torch.int64)
    losses_t = torch.tensor(losses, dtype=torch.float32)
    if one_d:
        assert len(rows) == 1, "a [T] case has one row"
        targets_t, losses_t = targets_t[0], losses_t[0]
    return PackedCase(rows, tails, row_length, one_d, tuple(source_ids), targets_t, losses_t)


@st.composite
def packed_cases(
    draw,
    *,
    max_rows: int = 3,
    max_samples: int = 5,
    max_length: int = 9,
    max_tail: int = 4,
    sources: Sequence = SOURCES,
) -> PackedCase:
    """Packed batches: 1..max_rows rows of 0..max_samples samples of length 1..max_length.

    Covers length-1 samples, tail padding (rows padded to the longest, plus
    up to ``max_tail``), all-padding rows, zero-supervision samples, scored
    pad targets, ``[T]`` and ``[B, T]`` batches, int and str source ids.
    """
    n_rows = draw(st.integers(1, max_rows))
    rows = [
        draw(st.lists(st.integers(1, max_length), min_size=0, max_size=max_samples))
        for _ in range(n_rows)
    ]
    tails = [draw(st.integers(0, max_tail)) for _ in range(n_rows)]
    n = sum(len(row) for row in rows)
    source_ids = draw(st.lists(st.sampled_from(list(sources)), min_size=n, max_size=n))
    zero = draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)) if n else set()
    one_d = n_rows == 1 and draw(st.booleans())
    rng = draw(st.randoms(use_true_random=False))
    return make_case(
        rows, source_ids=source_ids, rng=rng, tails=tails, one_d=one_d, zero_supervised=sorted(zero)
    )


def sp_world_sizes() -> st.SearchStrategy[int]:
    """Sequence-parallel world sizes 1..4."""
    return st.integers(1, 4)


def sp_shardings() -> st.SearchStrategy[tuple[int, str]]:
    """``(world_size, mode)`` for every shard mode and world sizes 1..4."""
    return st.tuples(sp_world_sizes(), st.sampled_from(tuple(SHARD_MODES)))
