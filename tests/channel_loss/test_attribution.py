"""source_totals / SourceTotals against a plain per-sample loop.

Token losses are integer-valued, so every comparison is exact (``==``):
sharded partials must add up to the unsharded result with no tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given

import harness
from channel_loss import ChannelLossMetadataError, PackedLayout, SourceTotals, source_totals
from channel_loss.attribution import COLUMNS
from channel_loss.layout import SHARD_MODES
from tests.channel_loss.reference import (
    LOOP_COLUMNS,
    layout_of,
    make_totals,
    pick,
    reference_global_index,
    reference_totals,
    samples_of,
)
from tests.strategies import IGNORE_INDEX, make_case, packed_cases, sp_shardings


def as_lists(totals: SourceTotals) -> dict:
    return {key: list(value) for key, value in totals.as_dict().items()}


def sharded_partials(case, layout, world, mode, device="cpu"):
    partials = []
    for rank in range(world):
        shard = layout.shard(world, rank, mode)
        partials.append(
            source_totals(
                shard.take(case.token_losses, 0.0).to(device),
                shard.take(case.targets, IGNORE_INDEX).to(device),
                layout=layout,
                source_ids=list(case.source_ids),
                shard=shard,
            )
        )
    return partials


@given(packed_cases())
def test_unsharded_totals_match_the_loop(case):
    totals = source_totals(
        case.token_losses, case.targets, layout=layout_of(case), source_ids=list(case.source_ids)
    )
    assert totals.loss_sum.dtype == torch.float64
    assert totals.tokens.dtype == totals.samples.dtype == torch.int64
    assert as_lists(totals) == reference_totals(case)


@given(packed_cases(), sp_shardings())
def test_sharded_partials_add_up_exactly(case, sharding):
    world, mode = sharding
    layout = layout_of(case)
    partials = sharded_partials(case, layout, world, mode)
    assert as_lists(sum(partials)) == reference_totals(case)
    # Each sample is counted once, by the rank that holds its first token.
    for rank, partial in enumerate(partials):
        held = {i for row in reference_global_index(case, world, rank, mode) for i in row}
        expected: dict = {}
        for _, source, start, _ in samples_of(case):
            expected[source] = expected.get(source, 0) + (start in held)
        got = {key: samples for key, (samples,) in pick(partial.as_dict(), "samples").items()}
        assert {k: v for k, v in got.items() if v} == {k: v for k, v in expected.items() if v}


@given(packed_cases(sources=(0, 5, 9)))
def test_tensor_source_ids_match_a_list(case):
    layout = layout_of(case)
    from_list = source_totals(
        case.token_losses, case.targets, layout=layout, source_ids=list(case.source_ids)
    )
    from_tensor = source_totals(
        case.token_losses,
        case.targets,
        layout=layout,
        source_ids=torch.tensor(case.source_ids, dtype=torch.int64),
    )
    assert from_tensor.as_dict() == from_list.as_dict()


def test_adding_totals_takes_the_union_of_keys():
    a = make_totals(("x", 1), loss_sum=[1.0, 2.0], tokens=[1, 2], samples=[1, 1])
    b = make_totals((2, "x"), loss_sum=[4.0, 8.0], tokens=[4, 8], samples=[0, 1])
    total = a + b
    assert total.keys == ("x", 1, 2)
    assert pick(total.as_dict(), *LOOP_COLUMNS) == {
        "x": (9.0, 9, 2),
        1: (2.0, 2, 1),
        2: (4.0, 4, 0),
    }
    assert sum([a, b]).as_dict() == total.as_dict()
    assert (SourceTotals.empty() + a).as_dict() == a.as_dict()
    assert a.all_reduce().as_dict() == a.as_dict()  # no process group: itself


def test_columns_are_defined_once():
    # SourceTotals' fields, rows() and as_dict() all follow COLUMNS, in one order.
    assert [c.name for c in COLUMNS][: len(LOOP_COLUMNS)] == list(LOOP_COLUMNS)
    values = {c.name: [2.5 if c.dtype.is_floating_point else i + 2] for i, c in enumerate(COLUMNS)}
    totals = make_totals(("x",), **values)
    assert totals.rows().tolist() == [[float(values[c.name][0]) for c in COLUMNS]]
    assert totals.as_dict() == {"x": tuple(values[c.name][0] for c in COLUMNS)}
    assert SourceTotals.from_rows(["x"], totals.rows()).as_dict() == totals.as_dict()
    assert [t.dtype for t in SourceTotals.empty().columns()] == [c.dtype for c in COLUMNS]


def test_numpy_and_python_ints_are_one_source():
    np = pytest.importorskip("numpy")
    layout = PackedLayout.from_cu_seqlens([0, 1, 2], total_length=2)
    totals = source_totals(
        torch.ones(2), torch.zeros(2, dtype=torch.long), layout=layout, source_ids=[np.int64(4), 4]
    )
    assert pick(totals.as_dict(), *LOOP_COLUMNS) == {4: (2.0, 2, 2)}
    assert type(totals.keys[0]) is int


LAYOUT = PackedLayout.from_cu_seqlens([0, 2, 5], total_length=6, tail_padding_length=1)


def attribute(*, losses=None, targets=None, source_ids=("a", "b"), shard=None):
    return source_totals(
        torch.ones(6) if losses is None else losses,
        torch.zeros(6, dtype=torch.long) if targets is None else targets,
        layout=LAYOUT,
        source_ids=source_ids,
        shard=shard,
    )


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        pytest.param(
            {"source_ids": ["a", "b", "c"]}, ["2 samples", "3 entries"], id="too many ids"
        ),
        pytest.param(
            {"source_ids": torch.tensor([1])}, ["2 samples", "1 entries"], id="short tensor"
        ),
        pytest.param(
            {"source_ids": [["a"], "b"]}, ["source_ids[0]", "of type list"], id="unhashable id"
        ),
        pytest.param({"source_ids": [1.5, "b"]}, ["source_ids[0]", "float"], id="float id"),
        # Equal to an int id and hashed like it: these merged silently into source 1.
        pytest.param({"source_ids": [1, True]}, ["source_ids[1]", "True", "bool"], id="bool id"),
        pytest.param(
            {"source_ids": [1, 1.0]},
            ["source_ids[1]", "1.0", "float"],
            id="float equal to an int id",
        ),
        pytest.param(
            {"source_ids": ["a", "\ud800"]},
            ["source_ids[1]", "'\\ud800'", "UTF-8"],
            id="lone surrogate",
        ),
        pytest.param({"source_ids": "ab"}, ["str"], id="bare string"),
        pytest.param({"losses": torch.ones(2, 3)}, ["(2, 3)", "(6,)"], id="losses shape"),
        pytest.param(
            {"targets": torch.zeros(7, dtype=torch.long)},
            ["(7,)", "(6,)"],
            id="labels vs position_ids shape",
        ),
        pytest.param(
            {
                "shard": PackedLayout.from_cu_seqlens(
                    [0, 3, 5], total_length=6, tail_padding_length=1
                ).shard(1, 0, "contiguous")
            },
            ["another layout", "num_samples=2"],
            id="shard of another layout",
        ),
        pytest.param(
            {"shard": LAYOUT.shard(2, 0, "contiguous")},
            ["(6,)", "(3,)"],
            id="global losses with a shard",
        ),
    ],
)
def test_bad_metadata_is_named(overrides, needles):
    with pytest.raises(ChannelLossMetadataError) as info:
        attribute(**overrides)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("device", harness.DEVICES)
@pytest.mark.parametrize("mode", SHARD_MODES)
def test_device_partials_match_the_loop(device, mode):
    rng = random.Random(7)
    rows = [[rng.randint(1, 40) for _ in range(12)] for _ in range(2)]
    case = make_case(
        rows,
        source_ids=[rng.choice(["a", "b", 3]) for _ in range(24)],
        rng=rng,
        tails=[5, 0],
        zero_supervised=[4, 9],
    )
    layout = layout_of(case)
    partials = sharded_partials(case, layout, 3, mode, device=device)
    assert all(p.loss_sum.device.type == torch.device(device).type for p in partials)
    assert as_lists(sum(partials)) == reference_totals(case)
