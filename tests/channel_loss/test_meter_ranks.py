"""Hypothesis-drawn packed layouts on 2 and 4 real ranks: the meter and the loss under capture.

The tests are launched ``@given`` tests: Hypothesis draws (and shrinks) each
example once, in the pytest process, and every example runs on all ranks of
one kept pool (``reuse=True``: fresh ranks would cost a start per example).
One launch checks the example under every shard mode of ``SHARD_MODES`` and
every ``sp x dp`` split of the ranks (SP only, DP only, and 2 x 2 on four
ranks):

* the meter's metrics, with integer-valued token losses, equal the
  single-process plain-loop reference exactly (``==``) on every rank;
* ``chunk_cross_entropy`` on each rank's shard gives the same loss, the same
  gradients (also after a real all-reduce) and, under ``capture()``, the
  observation ``per_token_cross_entropy`` computes: bitwise, with and
  without the observer.

Every layout comes from ``tests.strategies.packed_cases``: ``[T]`` and
``[B, T]`` batches, tail padding (scored pad targets included), all-padding
rows, zero-supervision samples. The number of examples follows the loaded
Hypothesis profile at a fifteenth of its ``max_examples`` (4 under ``ci``, 20
under ``dev``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import harness
from channel_loss import ChannelLossMeter, capture, chunk_cross_entropy, per_token_cross_entropy
from channel_loss.capture import record
from channel_loss.layout import SHARD_MODES
from tests.channel_loss.reference import (
    add_totals,
    layout_of,
    reference_metrics,
    reference_totals,
)
from tests.strategies import IGNORE_INDEX, SOURCES, packed_cases

VOCAB, HIDDEN, CHUNK = 50, 8, 8  # packed_cases draws targets in [0, 50)
#: Each example runs every split and shard mode on the kept ranks: 4 under the ci profile.
EXAMPLES = max(1, settings.default.max_examples // 15)


def splits(world: int) -> list[tuple[int, int]]:
    """Every ``(sp, dp)`` with ``sp * dp == world``."""
    return [(sp, world // sp) for sp in range(1, world + 1) if world % sp == 0]


@st.composite
def examples(draw, world: int) -> dict:
    """Per DP rank (up to ``world`` of them) 1..3 micro-batches, each with its own source set."""
    per_rank = []
    for _ in range(world):
        sources = draw(st.lists(st.sampled_from(SOURCES), min_size=1, max_size=3, unique=True))
        per_rank.append(
            draw(
                st.lists(
                    packed_cases(max_rows=2, max_samples=4, sources=sources), min_size=1, max_size=3
                )
            )
        )
    return {"cases": per_rank, "seed": draw(st.integers(0, 2**16))}


def expected_metrics(example: dict, dp: int) -> dict:
    """The reference metrics of one step over DP ranks ``0..dp-1``'s micro-batches."""
    cases = [case for rank_cases in example["cases"][:dp] for case in rank_cases]
    return reference_metrics(add_totals(*(reference_totals(case) for case in cases)))


def _groups(sp: int, dp: int):
    """This rank's (sp_group, dp_group): rank = dp_rank * sp + sp_rank; every rank makes every
    group, through ``harness.kept_group``, so later examples on the kept ranks reuse them."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def made(blocks: list[list[int]]):
        if len(blocks[0]) == 1:
            return None
        if len(blocks[0]) == world:
            return dist.group.WORLD
        return next(
            group
            for ranks, group in [(ranks, harness.kept_group(ranks)) for ranks in blocks]
            if rank in ranks
        )

    return (
        made([[d * sp + s for s in range(sp)] for d in range(dp)]),
        made([[d * sp + s for d in range(dp)] for s in range(sp)]),
    )


def _meter_step(example: dict, groups, mode: str, device: str) -> dict:
    sp_group, dp_group = groups
    sp = 1 if sp_group is None else dist.get_world_size(sp_group)
    sp_rank = 0 if sp_group is None else dist.get_rank(sp_group)
    dp_rank = dist.get_rank() // sp
    meter = ChannelLossMeter(sp_group=sp_group, dp_group=dp_group)
    meter.begin_step()
    for case in example["cases"][dp_rank]:
        layout = layout_of(case)
        shard = layout.shard(sp, sp_rank, mode) if sp > 1 else None
        losses, targets = case.token_losses, case.targets
        if shard is not None:
            losses, targets = shard.take(losses, 0.0), shard.take(targets, IGNORE_INDEX)
        with meter.micro_batch(source_ids=list(case.source_ids), layout=layout, shard=shard):
            record(losses.to(device), targets.to(device))  # what the loss op hands the meter
    return meter.end_step()


def _loss_and_grads(hidden, weight, targets, observe: bool):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    observations = []
    if observe:
        with capture() as cap:
            loss = chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=CHUNK)
        observations = cap.observations
    else:
        loss = chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=CHUNK)
    loss.backward()
    weight_grad = weight.grad.clone()
    dist.all_reduce(weight_grad)  # what data / sequence parallelism does with it
    return loss.detach(), hidden.grad, weight.grad, weight_grad, observations


def _capture_parity(example: dict, mode: str, device: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for m, case in enumerate(example["cases"][0]):
        g = torch.Generator().manual_seed(example["seed"] + m)
        hidden = torch.randn(*case.shape, HIDDEN, generator=g)
        weight = torch.randn(VOCAB, HIDDEN, generator=g).to(device)
        shard = layout_of(case).shard(world, rank, mode)
        local = shard.take(hidden, 0.0).to(device)
        targets = shard.take(case.targets, IGNORE_INDEX).to(device)
        *plain, none = _loss_and_grads(local, weight, targets, observe=False)
        *observed, observations = _loss_and_grads(local, weight, targets, observe=True)
        assert none == []
        for name, a, b in zip(
            ("loss", "hidden grad", "weight grad", "all-reduced weight grad"),
            plain,
            observed,
            strict=True,
        ):
            assert torch.equal(a, b), f"micro-batch {m}, {mode}: {name} differs under capture"
        (observation,) = observations
        eager = per_token_cross_entropy(
            hidden_states=local, weight=weight, shift_labels=targets, chunk_size=CHUNK
        )
        assert torch.equal(observation.token_losses, eager), f"micro-batch {m}, {mode}"
        assert torch.equal(observation.targets, targets)


def run_example(example: dict, device: str) -> dict:
    """On every rank: the meter's metrics per ``(sp, dp, mode)``; asserts the capture parity."""
    metrics = {}
    for sp, dp in splits(dist.get_world_size()):
        groups = _groups(sp, dp)
        for mode in SHARD_MODES:
            metrics[sp, dp, mode] = _meter_step(example, groups, mode, device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # bitwise claims on accelerators need it
    try:
        for mode in SHARD_MODES:
            _capture_parity(example, mode, device)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return metrics


def check_example(example: dict, device: str) -> None:
    """On every rank of a launched test: the metrics of every split and mode are the reference's."""
    got = run_example(example, device)
    for sp, dp in splits(dist.get_world_size()):
        want = expected_metrics(example, dp)
        for mode in SHARD_MODES:
            assert got[sp, dp, mode] == want, f"rank {dist.get_rank()}, sp={sp} x dp={dp}, {mode}"


@pytest.mark.parametrize("device", harness.DEVICES)
@settings(max_examples=EXAMPLES)
@given(example=examples(2))
@pytest.mark.launch(nproc=2, timeout=240, reuse=True)
def test_drawn_layouts_on_two_ranks_match_the_reference(device, example):
    check_example(example, device)


@pytest.mark.parametrize("device", harness.DEVICES)
@settings(max_examples=EXAMPLES)
@given(example=examples(4))
@pytest.mark.launch(nproc=4, timeout=240, reuse=True)
def test_drawn_layouts_on_four_ranks_match_the_reference(device, example):
    check_example(example, device)
