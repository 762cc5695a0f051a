"""ChannelLossMeter across real rank processes, against a single-process float64 reference.

Every rank rebuilds the same global micro-batches from a seed (SP peers share
theirs; each DP rank has its own, with its own set of sources), feeds its
slice through the meter with integer-valued losses, and checks that
``end_step`` returns exactly the metrics a plain loop over all ranks' data
gives, using at most two collectives and none outside ``end_step``.

The cases run on kept ranks (``reuse=True``): consecutive cases of one rank
count share one pool instead of a start each.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import harness
from channel_loss import ChannelLossMetadataError, ChannelLossMeter, PackedLayout, source_totals
from channel_loss.attribution import COLUMNS
from channel_loss.capture import record
from channel_loss.exchange import BACKEND_DEVICES, comm_device, count_collectives
from channel_loss.layout import SHARD_MODES
from tests.channel_loss.reference import (
    add_totals,
    layout_of,
    make_totals,
    reference_metrics,
    reference_totals,
)
from tests.strategies import IGNORE_INDEX, make_case

#: Source sets of DP ranks 0..3: overlapping, never equal.
DP_SOURCES = (("web", "code/py"), (3, "math", "web"), ("wiki en", 3), ("code/py", 11))


class SimulatedOOM(RuntimeError):
    """A forward failure the training loop catches and survives."""


def micro_batches(seed: int, sources=("web", "code/py", 3, "math"), count: int = 3) -> list:
    """``count`` two-row packed micro-batches; the same on every rank passing the same seed."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        rows = [[rng.randint(1, 12) for _ in range(rng.randint(1, 4))] for _ in range(2)]
        n = sum(len(row) for row in rows)
        cases.append(
            make_case(
                rows,
                source_ids=[rng.choice(sources) for _ in range(n)],
                rng=rng,
                tails=[rng.randint(0, 3), 0],
                zero_supervised=[0],
            )
        )
    return cases


def run_step(
    meter,
    cases,
    device,
    *,
    shard=None,
    source_ids=None,
    layouts=None,
    names=None,
    fail=(),
    skip=(),
) -> dict:
    """One training step over ``cases``: this rank's slice (``shard=(world, rank, mode)``).

    ``source_ids`` and ``layouts`` override micro-batch ``m``'s ids and the
    layout given to the meter (not the one sharded) on this rank; ``names``
    are this rank's ``source_names``; the forward of micro-batches in ``fail``
    raises (and the loop carries on); those in ``skip`` are never run on this
    rank.
    """
    meter.begin_step()
    with count_collectives() as outside_end_step:
        for m, case in enumerate(cases):
            if m in skip:
                continue
            layout = layout_of(case)
            piece = layout.shard(*shard) if shard else None
            losses, targets = case.token_losses, case.targets
            if piece is not None:
                losses, targets = piece.take(losses, 0.0), piece.take(targets, IGNORE_INDEX)
            ids = (source_ids or {}).get(m, list(case.source_ids))
            try:
                with meter.micro_batch(
                    source_ids=ids,
                    layout=(layouts or {}).get(m, layout),
                    shard=piece,
                    source_names=names,
                ):
                    record(losses.to(device), targets.to(device))  # what the loss op does
                    if m in fail:
                        raise SimulatedOOM(f"micro-batch {m}")
            except SimulatedOOM:
                pass
    assert outside_end_step == []
    with count_collectives() as calls:
        try:
            return meter.end_step()
        finally:
            assert len(calls) <= 2, calls


def expected(*case_lists, dropped: int = 0, names=None) -> dict:
    """The metrics of every case in ``case_lists``, by the plain-loop reference."""
    totals = add_totals(*(reference_totals(case) for cases in case_lists for case in cases))
    return reference_metrics(totals, dropped=dropped, names=names)


@pytest.mark.parametrize("device", harness.DEVICES)
@pytest.mark.launch(nproc=2, timeout=120, reuse=True)
def test_two_ranks_sp_only_and_dp_only(device):
    rank = dist.get_rank()
    for mode in SHARD_MODES:
        meter = ChannelLossMeter(sp_group=dist.group.WORLD)
        for step in range(2):  # the second step meets registered and new sources
            cases = micro_batches(seed=step * 10 + len(mode))
            assert run_step(meter, cases, device, shard=(2, rank, mode)) == expected(cases)

    own = [micro_batches(seed=100 + r, sources=DP_SOURCES[r]) for r in range(2)]
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    assert run_step(meter, own[rank], device) == expected(*own)  # the union of both source sets

    first = [own[r][0] for r in range(2)]
    partial = source_totals(
        first[rank].token_losses.to(device),
        first[rank].targets.to(device),
        layout=layout_of(first[rank]),
        source_ids=list(first[rank].source_ids),
    )
    summed = {key: list(value) for key, value in partial.all_reduce().as_dict().items()}
    assert summed == add_totals(*(reference_totals(case) for case in first))


@pytest.mark.parametrize("device", harness.DEVICES)
@pytest.mark.launch(nproc=4, timeout=150, reuse=True)
def test_four_ranks_sp_dp_and_sp_by_dp_subgroups(device):
    rank = dist.get_rank()
    cases = micro_batches(seed=1)
    meter = ChannelLossMeter(sp_group=dist.group.WORLD)
    assert run_step(meter, cases, device, shard=(4, rank, "zigzag")) == expected(cases)

    own = [micro_batches(seed=200 + r, sources=DP_SOURCES[r]) for r in range(4)]
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    assert run_step(meter, own[rank], device) == expected(*own)

    # 2 x 2: rank = 2 * dp_rank + sp_rank; every rank creates every group, in one order
    # (kept: later 4-rank cases run on these ranks).
    sp_groups = [harness.kept_group([0, 1]), harness.kept_group([2, 3])]
    dp_groups = [harness.kept_group([0, 2]), harness.kept_group([1, 3])]
    sp_rank, dp_rank = rank % 2, rank // 2
    meter = ChannelLossMeter(sp_group=sp_groups[dp_rank], dp_group=dp_groups[sp_rank])
    own = [micro_batches(seed=300 + d, sources=DP_SOURCES[d]) for d in range(2)]
    for mode in SHARD_MODES:
        got = run_step(meter, own[dp_rank], device, shard=(2, sp_rank, mode))
        assert got == expected(*own)
    # Rank 3's forward fails in micro-batch 1: only its SP group (ranks 2, 3) drops it.
    got = run_step(
        meter, own[dp_rank], device, shard=(2, sp_rank, "zigzag"), fail={1} if rank == 3 else ()
    )
    assert got == expected(own[0], [own[1][0], own[1][2]], dropped=1)


def rank_columns(rank: int) -> tuple[tuple, dict]:
    """Rank ``rank``'s keys (one shared, one its own) and a distinct value in every column."""
    keys = ("shared", f"own{rank}")
    return keys, {
        c.name: [
            (rank + 1) * 100 + 10 * i + k + (0.5 if c.dtype.is_floating_point else 0)
            for k in range(2)
        ]
        for i, c in enumerate(COLUMNS)
    }


@pytest.mark.launch(nproc=2, timeout=60, reuse=True)
def test_the_two_rank_reduction_carries_every_column():
    # Built from COLUMNS alone: a column added there is reduced, or this fails.
    rank = dist.get_rank()
    keys, values = rank_columns(rank)
    with count_collectives() as calls:
        summed = make_totals(keys, **values).all_reduce()
    assert len(calls) == 2
    want: dict = {}
    for r in range(2):
        their_keys, theirs = rank_columns(r)
        for k, key in enumerate(their_keys):
            entry = want.setdefault(key, [0] * len(COLUMNS))
            for i, column in enumerate(COLUMNS):
                entry[i] += theirs[column.name][k]
    assert summed.keys == ("shared", "own0", "own1")
    assert {key: list(v) for key, v in summed.as_dict().items()} == want
    assert [t.dtype for t in summed.columns()] == [c.dtype for c in COLUMNS]

    # The meter reports every column with a metric family, summed over both ranks.
    cases = micro_batches(seed=12)
    meter = ChannelLossMeter(sp_group=dist.group.WORLD)
    got = run_step(meter, cases, "cpu", shard=(2, rank, "headtail"))
    assert got == expected(cases)
    for column in COLUMNS:
        if column.metric is not None:
            assert any(key.startswith(f"channel_loss_{column.metric}/") for key in got), column


def short_ids(case) -> list:
    return list(case.source_ids)[:-1]


@pytest.mark.launch(nproc=2, timeout=60, reuse=True)
def test_strict_bad_metadata_raises_on_every_rank():
    rank = dist.get_rank()
    cases = micro_batches(seed=5)
    n = cases[1].num_samples
    meter = ChannelLossMeter(sp_group=dist.group.WORLD, strict=True)
    with pytest.raises(
        ChannelLossMetadataError,
        match=rf"rank 1, micro-batch 1: the layout has {n} samples but source_ids "
        rf"has {n - 1} entries",
    ):
        run_step(
            meter,
            cases,
            "cpu",
            shard=(2, rank, "zigzag"),
            source_ids={1: short_ids(cases[1])} if rank == 1 else None,
        )
    # Both raised from the same collective step: the next step runs normally.
    assert run_step(meter, cases, "cpu", shard=(2, rank, "zigzag")) == expected(cases)

    # A DP peer with good metadata raises too, instead of training on alone.
    own = [micro_batches(seed=50 + r, sources=DP_SOURCES[r]) for r in range(2)]
    meter = ChannelLossMeter(dp_group=dist.group.WORLD, strict=True)
    with pytest.raises(ChannelLossMetadataError, match=r"rank 0, micro-batch 2: "):
        run_step(
            meter, own[rank], "cpu", source_ids={2: short_ids(own[0][2])} if rank == 0 else None
        )


@pytest.mark.launch(nproc=2, timeout=60, reuse=True)
def test_lenient_bad_metadata_drops_the_same_micro_batch_everywhere():
    rank = dist.get_rank()
    cases = micro_batches(seed=6)
    meter = ChannelLossMeter(sp_group=dist.group.WORLD)
    got = run_step(
        meter,
        cases,
        "cpu",
        shard=(2, rank, "contiguous"),
        source_ids={1: short_ids(cases[1])} if rank == 1 else None,
    )
    assert got == expected([cases[0], cases[2]], dropped=1)

    # SP ranks that ran different micro-batches cannot be paired: the step is dropped.
    got = run_step(
        meter, cases, "cpu", shard=(2, rank, "contiguous"), skip={2} if rank == 1 else ()
    )
    assert got == {"channel_loss_dropped_micro_batches": 3.0}
    assert run_step(meter, cases, "cpu", shard=(2, rank, "contiguous")) == expected(cases)

    # DP: only the rank with bad metadata loses its micro-batch.
    own = [micro_batches(seed=60 + r, sources=DP_SOURCES[r]) for r in range(2)]
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    got = run_step(meter, own[rank], "cpu", source_ids={0: [["unhashable"]]} if rank == 0 else None)
    assert got == expected(own[0][1:], own[1], dropped=1)


@pytest.mark.launch(nproc=2, timeout=90, reuse=True)
def test_a_bad_layout_on_one_sp_rank_drops_only_its_micro_batch():
    # Regression: the layout went into the step's fingerprint before it was checked, so a
    # bad one on one rank read as "SP ranks ran different micro-batches": the whole step
    # was dropped instead of the one micro-batch.
    rank = dist.get_rank()
    cases = micro_batches(seed=10)
    other = PackedLayout.from_position_ids(torch.tensor([0, 1, 2, 0, 1]))  # the wrong shape
    meter = ChannelLossMeter(sp_group=dist.group.WORLD)
    for bad in (None, other):
        layouts = {1: bad} if rank == 1 else None
        got = run_step(meter, cases, "cpu", shard=(2, rank, "zigzag"), layouts=layouts)
        assert got == expected([cases[0], cases[2]], dropped=1), bad
    # Ranks out of step are still caught in the micro-batches that did not fail.
    first, last = layout_of(cases[0]), layout_of(cases[2])
    assert (first.num_samples, first.shape) != (last.num_samples, last.shape)
    swapped = [cases[2], cases[1], cases[0]] if rank == 1 else cases
    got = run_step(meter, swapped, "cpu", shard=(2, rank, "zigzag"), layouts=layouts)
    assert got == {"channel_loss_dropped_micro_batches": 3.0}
    assert run_step(meter, cases, "cpu", shard=(2, rank, "zigzag")) == expected(cases)


@pytest.mark.launch(nproc=2, timeout=60, reuse=True)
def test_registries_that_differ_across_ranks_raise_on_every_rank():
    # Regression: a state restored on rank 0 only made each rank sum rows in its own
    # registry's order; at different lengths Gloo aborted the process.
    rank = dist.get_rank()
    cases = micro_batches(seed=11)
    state = {"version": 1, "next_step": 0, "sources": [["web", "web"]]}
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    if rank == 0:
        meter.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"registries differ \(rank 0: 1, rank 1: 0 sources\)"):
        run_step(meter, cases, "cpu")
    meter.load_state_dict(state)  # the step is closed: restoring on every rank recovers
    assert run_step(meter, cases, "cpu") == expected(cases, cases)  # DP: both ranks' data


@pytest.mark.launch(nproc=2, timeout=60, reuse=True)
def test_failed_forward_on_one_rank_is_dropped_on_every_sp_rank():
    rank = dist.get_rank()
    cases = micro_batches(seed=7)
    meter = ChannelLossMeter(sp_group=dist.group.WORLD, strict=True)  # not a metadata error
    got = run_step(meter, cases, "cpu", shard=(2, rank, "zigzag"), fail={0} if rank == 0 else ())
    assert got == expected(cases[1:], dropped=1)
    assert run_step(meter, cases, "cpu", shard=(2, rank, "zigzag")) == expected(cases)


@pytest.mark.launch(nproc=8, timeout=150, reuse=True)
def test_sp_by_dp_blocks_inside_a_larger_world():
    # 2 (DP) x 2 (SP) x 2 (TP): rank = 4 * dp + 2 * sp + tp. TP peers see the same data, so each
    # TP slice is its own SP x DP block: the meter derives a group per block, not the world.
    rank = dist.get_rank()
    dp_rank, sp_rank, tp_rank = rank // 4, rank // 2 % 2, rank % 2
    sp_groups = {
        (d, t): dist.new_group([4 * d + 2 * s + t for s in range(2)])
        for d in range(2)
        for t in range(2)
    }
    dp_groups = {
        (s, t): dist.new_group([4 * d + 2 * s + t for d in range(2)])
        for s in range(2)
        for t in range(2)
    }
    meter = ChannelLossMeter(
        sp_group=sp_groups[dp_rank, tp_rank], dp_group=dp_groups[sp_rank, tp_rank]
    )
    own = [micro_batches(seed=400 + d, sources=DP_SOURCES[d]) for d in range(2)]
    got = run_step(
        meter, own[dp_rank], "cpu", shard=(2, sp_rank, "zigzag"), fail={2} if rank == 5 else ()
    )  # dp 1, sp 0, tp 1: only its block drops it
    if tp_rank == 1:
        assert got == expected(own[0], own[1][:2], dropped=1)
    else:
        assert got == expected(*own)


@pytest.mark.launch(nproc=2, timeout=120, reuse=True)
def test_one_failure_among_300_micro_batches_drops_exactly_that_one():
    # Regression: past 256 micro-batches the failure bits were shared: a failure at index 299
    # of 300 dropped 45 micro-batches. Still two collectives (run_step checks).
    rank = dist.get_rank()
    cases = micro_batches(seed=8, count=300)
    meter = ChannelLossMeter(sp_group=dist.group.WORLD)
    got = run_step(meter, cases, "cpu", shard=(2, rank, "zigzag"), fail={299} if rank == 1 else ())
    assert got == expected(cases[:299], dropped=1)

    own = [micro_batches(seed=80 + r, sources=DP_SOURCES[r], count=300) for r in range(2)]
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    got = run_step(meter, own[rank], "cpu", fail={299} if rank == 0 else ())
    assert got == expected(own[0][:299], own[1], dropped=1)


@pytest.mark.parametrize("bad", ["\ud800", True, 1.0], ids=["lone surrogate", "bool", "float"])
@pytest.mark.launch(nproc=2, timeout=90, reuse=True)
def test_bad_source_ids_on_one_rank_are_metadata_errors_everywhere(bad):
    # Regression: a lone surrogate raised UnicodeEncodeError in end_step on rank 1 (and a
    # peer-closed error on rank 0) even with strict=False; True / 1.0 merged into source 1.
    rank = dist.get_rank()
    cases = micro_batches(seed=9, sources=(1, 2, "web"))
    ids = {1: [bad, *list(cases[1].source_ids)[1:]]} if rank == 1 else None
    meter = ChannelLossMeter(sp_group=dist.group.WORLD)
    got = run_step(meter, cases, "cpu", shard=(2, rank, "zigzag"), source_ids=ids)
    assert got == expected([cases[0], cases[2]], dropped=1)

    meter = ChannelLossMeter(sp_group=dist.group.WORLD, strict=True)
    with pytest.raises(ChannelLossMetadataError, match=r"rank 1, micro-batch 1: source_ids\[0\]"):
        run_step(meter, cases, "cpu", shard=(2, rank, "zigzag"), source_ids=ids)
    assert run_step(meter, cases, "cpu", shard=(2, rank, "zigzag")) == expected(cases)


@pytest.mark.launch(nproc=2, timeout=90, reuse=True)
def test_rank_inconsistent_names():
    # Regression: rank 0's name silently won, even with strict=True.
    rank = dist.get_rank()
    own = [micro_batches(seed=90 + r, sources=("web", 3)) for r in range(2)]
    names = {"web": ["Web", "WWW"][rank]}
    strict = ChannelLossMeter(dp_group=dist.group.WORLD, strict=True)
    with pytest.raises(
        ChannelLossMetadataError,
        match=r"source 'web' was given different names: rank 0 'Web', rank 1 'WWW'",
    ):
        run_step(strict, own[rank], "cpu", names=names)
    assert strict.state_dict()["sources"] == []  # every rank left its registry unchanged
    # Lenient: the lowest rank's name, on every rank alike.
    lenient = ChannelLossMeter(dp_group=dist.group.WORLD)
    got = run_step(lenient, own[rank], "cpu", names=names)
    assert got == expected(*own, names={"web": "Web"})
    # Once registered, a name is fixed: a later different name changes nothing.
    again = run_step(lenient, own[rank], "cpu", names={"web": "other"})
    assert again == expected(*own, names={"web": "Web"})


def _gloo_under_another_name(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@pytest.mark.launch(nproc=2, timeout=60, reuse=True)
def test_an_unknown_backend_raises_instead_of_guessing_the_device():
    # Regression: an unknown backend silently got host tensors.
    if "channel_loss_test" not in dist.Backend.backend_list:  # kept ranks run this twice
        dist.Backend.register_backend(
            "channel_loss_test", _gloo_under_another_name, devices=["cpu"]
        )
    group = dist.new_group([0, 1], backend="channel_loss_test")
    assert comm_device(dist.group.WORLD) == torch.device("cpu")
    assert comm_device(dist.new_group([0, 1], backend="cpu:gloo")) == torch.device("cpu")
    meter = ChannelLossMeter(dp_group=group)
    cases = micro_batches(seed=11)
    with pytest.raises(
        ValueError, match=r"'channel_loss_test' process-group backend.*BACKEND_DEVICES"
    ):
        run_step(meter, cases, "cpu")  # on every rank, before any collective: no hang
    assert BACKEND_DEVICES["gloo"] == "cpu"
