"""PackedLayout and Shard against the documented definitions of layouts and shard modes, written out as plain loops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from channel_loss import ChannelLossMetadataError, PackedLayout
from channel_loss.layout import SHARD_MODES
from tests.channel_loss.reference import (
    INDEX_FORMULAS,
    layout_of,
    reference_global_index,
    samples_of,
)
from tests.strategies import packed_cases, sp_shardings


@given(packed_cases())
def test_from_position_ids_finds_every_sample(case):
    layout = layout_of(case)
    expected_index = [-1] * (len(case.rows) * case.row_length)
    starts, lengths = [], []
    for number, _, start, length in samples_of(case):
        starts.append(start)
        lengths.append(length)
        expected_index[start : start + length] = [number] * length
    assert layout.shape == case.shape
    assert layout.num_samples == case.num_samples
    assert layout.sample_starts.tolist() == starts
    assert layout.seqlens.tolist() == lengths
    assert layout.sample_index.tolist() == expected_index
    cumulative = [0]
    for length in lengths:
        cumulative.append(cumulative[-1] + length)
    assert layout.cu_seqlens.tolist() == cumulative
    assert layout.cu_seqlens.dtype == torch.int32


@given(packed_cases(max_rows=1))
def test_from_cu_seqlens_matches_position_ids(case):
    tail = case.tails[0]
    by_position = PackedLayout.from_position_ids(
        case.position_ids().reshape(-1), tail_padding_length=tail
    )
    real_only = PackedLayout.from_cu_seqlens(
        case.cu_seqlens(), total_length=case.row_length, tail_padding_length=tail
    )
    assert real_only.same_as(by_position)
    assert real_only.sample_index.tolist() == by_position.sample_index.tolist()
    if tail and case.num_samples:
        # Some collators write the padding as one more segment.
        with_pad = PackedLayout.from_cu_seqlens(
            [*case.cu_seqlens(), case.row_length],
            total_length=case.row_length,
            tail_padding_length=tail,
        )
        assert with_pad.cu_seqlens.tolist() == real_only.cu_seqlens.tolist()


@pytest.mark.parametrize("rows", [3, 4])
@given(case=packed_cases())
def test_mrope_position_ids_take_boundaries_from_the_temporal_row(rows, case):
    # Qwen2-VL style [3, B, T] (temporal, height, width) and the 4-row form (text positions
    # first): for text tokens every row equals the 1-D position ids.
    plain = layout_of(case)
    position_ids = case.position_ids()
    batched = position_ids if position_ids.dim() == 2 else position_ids[None]
    tails = list(case.tails)
    layout = PackedLayout.from_position_ids(
        batched.expand(rows, *batched.shape), tail_padding_length=tails
    )
    assert layout.shape == (len(case.rows), case.row_length)
    assert layout.num_samples == plain.num_samples
    assert layout.sample_index.tolist() == plain.sample_index.reshape(-1).tolist()


def test_mrope_image_opening_a_sample_is_one_sample():
    # Sample 0: an image of 2 x 3 patches first (temporal 0 for all of them: Qwen2-VL's
    # get_rope_index), then text; sample 1: text only. Only the first patch is 0 in every row.
    t = [0, 0, 0, 0, 0, 0, 3, 4, 0, 1, 2]
    h = [0, 0, 0, 1, 1, 1, 3, 4, 0, 1, 2]
    w = [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]
    layout = PackedLayout.from_position_ids(torch.tensor([t, h, w])[:, None, :])
    assert layout.num_samples == 2
    assert layout.seqlens.tolist() == [8, 3]


def test_padding_needs_its_declared_length():
    position_ids = torch.tensor(
        [0, 1, 2, 0, 0, 0, 0]
    )  # a length-1 sample, then 3 pads at position 0
    assert PackedLayout.from_position_ids(position_ids).num_samples == 5
    declared = PackedLayout.from_position_ids(position_ids, tail_padding_length=3)
    assert declared.seqlens.tolist() == [3, 1]  # the real final length-1 sample is kept
    assert declared.sample_index.tolist() == [0, 0, 0, 1, -1, -1, -1]


def test_zigzag_worked_example():
    # Samples of length 5 and 2, tail 3, w=2: P = 8, 4, 4 (c = 2, 1, 1).
    layout = PackedLayout.from_cu_seqlens([0, 5, 7], total_length=10, tail_padding_length=3)
    rank0 = layout.shard(2, 0, "zigzag").global_index.tolist()
    rank1 = layout.shard(2, 1, "zigzag").global_index.tolist()
    assert rank0 == [0, 1, -1, -1, 5, -1, 7, -1]
    assert rank1 == [2, 3, 4, -1, 6, -1, 8, 9]


def test_headtail_worked_example():
    # Two 8-token documents in one row on 2 ranks: chunks of 4, rank r holds chunks r and 3 - r.
    layout = PackedLayout.from_cu_seqlens([0, 8, 16], total_length=16)
    assert layout.shard(2, 0, "headtail").global_index.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.shard(2, 1, "headtail").global_index.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # A row of 10 on 2 ranks is padded to 12 (chunks of 3); the padding lands on rank 0's tail.
    odd = PackedLayout.from_cu_seqlens([0, 4, 10], total_length=10)
    assert odd.shard(2, 0, "headtail").global_index.tolist() == [0, 1, 2, 9, -1, -1]
    assert odd.shard(2, 1, "headtail").global_index.tolist() == [3, 4, 5, 6, 7, 8]


def torch_head_tail_balancer():
    attention = pytest.importorskip("torch.distributed.tensor.experimental._attention")
    balancer = getattr(attention, "_HeadTailLoadBalancer", None)
    if balancer is None:
        pytest.skip("this torch has no _HeadTailLoadBalancer")
    return balancer


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("row_length", [1, 7, 16, 24, 29])
def test_headtail_matches_torch_context_parallel_balancer(world, row_length):
    # torch reorders the row padded to a multiple of 2w, then gives rank r the r-th equal part.
    balancer = torch_head_tail_balancer()
    padded = -(-row_length // (2 * world)) * 2 * world
    order = balancer(padded, world, "cpu")._generate_indices()[0].to(torch.int64)
    layout = PackedLayout.from_cu_seqlens([0, row_length], total_length=row_length)
    for rank, part in enumerate(order.chunk(world)):
        expected = torch.where(part < row_length, part, -1)
        assert torch.equal(layout.shard(world, rank, "headtail").global_index, expected)


def test_every_registered_shard_mode_has_a_reference_formula():
    assert set(INDEX_FORMULAS) == set(SHARD_MODES)


def test_numpy_integers_are_integers_everywhere():
    np = pytest.importorskip("numpy")
    layout = PackedLayout.from_cu_seqlens(
        [0, 3, 5], total_length=np.int64(7), tail_padding_length=np.int32(2)
    )
    by_python = PackedLayout.from_cu_seqlens([0, 3, 5], total_length=7, tail_padding_length=2)
    assert layout.same_as(by_python)
    rows = PackedLayout.from_position_ids(
        torch.zeros(2, 3, dtype=torch.long), tail_padding_length=[np.int64(1), 2]
    )
    assert rows.tail_padding == (1, 2)
    for mode in SHARD_MODES:
        shard = layout.shard(np.int64(2), np.int64(1), mode)
        assert (shard.world_size, shard.rank) == (2, 1)
        assert type(shard.world_size) is int
        assert torch.equal(shard.global_index, by_python.shard(2, 1, mode).global_index)
    with pytest.raises(ChannelLossMetadataError, match="world_size"):
        layout.shard(np.float64(2.0), 0, "zigzag")
    with pytest.raises(ChannelLossMetadataError, match="total_length"):
        PackedLayout.from_cu_seqlens([0, 2], total_length=True)


@given(packed_cases(), sp_shardings())
def test_shard_global_index_follows_the_definition(case, sharding):
    world, mode = sharding
    layout = layout_of(case)
    seen = []
    for rank in range(world):
        shard = layout.shard(world, rank, mode)
        expected = reference_global_index(case, world, rank, mode)
        assert shard.local_shape == (
            (len(expected[0]),) if case.one_d else (len(expected), len(expected[0]))
        )
        assert shard.global_index.dtype == torch.int64
        assert shard.global_index.tolist() == [i for row in expected for i in row]
        seen += [i for i in shard.global_index.tolist() if i >= 0]
    assert sorted(seen) == list(range(layout.numel))  # every position on exactly one rank


@given(packed_cases(), sp_shardings())
def test_take_slices_and_fills(case, sharding):
    world, mode = sharding
    layout = layout_of(case)
    features = torch.arange(layout.numel * 2, dtype=torch.float32).reshape(*case.shape, 2)
    for rank in range(world):
        shard = layout.shard(world, rank, mode)
        local = shard.take(features, fill=-1.0)
        assert tuple(local.shape) == (*shard.local_shape, 2)
        flat = features.reshape(-1, 2)
        for got, index in zip(
            local.reshape(-1, 2).tolist(), shard.global_index.tolist(), strict=True
        ):
            assert got == (flat[index].tolist() if index >= 0 else [-1.0, -1.0])
        labels = shard.take(case.targets, fill=-100)
        assert labels.dtype == torch.int64
        assert tuple(labels.shape) == shard.local_shape


ONE_ROW = PackedLayout.from_cu_seqlens([0, 2], total_length=2)


@pytest.mark.parametrize(
    ("build", "needles"),
    [
        pytest.param(
            lambda: PackedLayout.from_position_ids(torch.zeros(2, 3, 4, dtype=torch.long)),
            ["(2, 3, 4)", "[3, B, T]"],
            id="3-d position_ids that are not mrope",
        ),
        pytest.param(
            lambda: PackedLayout.from_position_ids(torch.tensor([0, 1]), tail_padding_length=3),
            ["[0, 2]", "3"],
            id="tail longer than the row",
        ),
        pytest.param(
            lambda: PackedLayout.from_position_ids(
                torch.zeros(2, 4, dtype=torch.long), tail_padding_length=[1, 1, 1]
            ),
            ["3 entries", "2 rows"],
            id="one tail per row",
        ),
        pytest.param(
            lambda: PackedLayout.from_position_ids(torch.tensor([[0, 1], [1, 2]])),
            ["row 1"],
            id="row starts mid-sample",
        ),
        pytest.param(
            lambda: PackedLayout.from_cu_seqlens([0, 3, 5], total_length=8, tail_padding_length=2),
            ["8 - 2 = 6", "0 .. 5"],
            id="cu_seqlens end",
        ),
        pytest.param(
            lambda: PackedLayout.from_cu_seqlens([0, 3, 3, 6], total_length=6),
            ["strictly increasing"],
            id="empty sample",
        ),
        pytest.param(
            lambda: ONE_ROW.shard(2, 2, "zigzag"), ["[0, 2)", "2"], id="rank out of range"
        ),
        pytest.param(lambda: ONE_ROW.shard(2, 0, "ring"), ["'ring'"], id="unknown mode"),
        pytest.param(
            lambda: ONE_ROW.shard(2, 0, "zigzag").take(torch.zeros(3), 0),
            ["(2,)", "(3,)"],
            id="take of another shape",
        ),
    ],
)
def test_bad_layouts_are_named(build, needles):
    with pytest.raises(ChannelLossMetadataError) as info:
        build()
    for needle in needles:
        assert needle in str(info.value)
