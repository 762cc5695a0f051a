"""ChannelLossMeter in one process: metrics, names, sampling, and the drop / raise rules.

The "model" in most tests is ``fake_loss``: it hands integer-valued
per-token losses to the open ``capture()`` scope exactly as
``chunk_cross_entropy`` does, so metrics compare with ``==`` against the
plain-loop reference. The last tests use the real ops.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import harness
from channel_loss import (
    ChannelLossMetadataError,
    ChannelLossMeter,
    PackedLayout,
    chunk_cross_entropy,
)
from channel_loss.capture import active_capture, record
from tests.channel_loss.reference import add_totals, reference_metrics, reference_totals
from tests.strategies import IGNORE_INDEX, make_case, packed_cases


def layout_of(case) -> PackedLayout:
    tails = case.tails[0] if case.one_d else list(case.tails)
    return PackedLayout.from_position_ids(case.position_ids(), tail_padding_length=tails)


def fake_loss(case) -> None:
    """What chunk_cross_entropy does under capture(), with the case's integer losses."""
    record(case.token_losses, case.targets)


def run_micro_batch(meter, case, **kwargs) -> None:
    with meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case), **kwargs):
        fake_loss(case)


def simple_case(seed=0, sources=("web", "code")):
    rng = random.Random(seed)
    return make_case([[3, 1, 4]], source_ids=[sources[0], sources[1], sources[0]], rng=rng,
                     tails=[2], scored_fraction=1.0)


@given(st.lists(packed_cases(), min_size=1, max_size=3))
def test_step_metrics_match_the_reference(cases):
    meter = ChannelLossMeter()
    meter.begin_step()
    for case in cases:
        run_micro_batch(meter, case)
    got = meter.end_step()
    assert got == reference_metrics(add_totals(*(reference_totals(c) for c in cases)))


def test_zero_supervision_source_reports_samples_but_no_mean():
    case = make_case([[2, 3]], source_ids=["seen", "silent"], rng=random.Random(1),
                     zero_supervised=[1], scored_fraction=1.0)
    meter = ChannelLossMeter()
    meter.begin_step()
    run_micro_batch(meter, case)
    got = meter.end_step()
    assert "channel_loss/silent" not in got
    assert got["channel_loss_tokens/silent"] == 0.0
    assert got["channel_loss_samples/silent"] == 1.0
    assert got["channel_loss_weighted/silent"] == 0.0
    assert got["channel_loss_tokens/seen"] == 2.0


def test_names_are_sanitised_and_collisions_get_stable_suffixes():
    meter = ChannelLossMeter(prefix="cl")
    case = make_case([[1, 1, 1, 1]], source_ids=["a/b", "a_b", 7, "x"], rng=random.Random(2),
                     scored_fraction=1.0)
    meter.begin_step()
    run_micro_batch(meter, case, source_names={7: "a b", "x": "x y"})
    first = meter.end_step()
    names = {key.split("/", 1)[1] for key in first if key.startswith("cl_samples/")}
    assert names == {"a_b", "a_b_2", "a_b_3", "x_y"}
    state = meter.state_dict()
    assert state["sources"] == [["a/b", "a_b"], ["a_b", "a_b_2"], [7, "a_b_3"], ["x", "x_y"]]

    # A restarted meter keeps every name, even when sources arrive in another order,
    # and a name given later does not rename a registered source.
    restored = ChannelLossMeter(prefix="cl")
    restored.load_state_dict(state)
    shuffled = make_case([[1, 1, 1, 1]], source_ids=["x", 7, "a_b", "a/b"], rng=random.Random(2),
                         scored_fraction=1.0)
    restored.begin_step()
    run_micro_batch(restored, shuffled, source_names={"a/b": "renamed"})
    assert {k for k in restored.end_step() if k.startswith("cl_samples/")} == {
        f"cl_samples/{n}" for n in names}
    assert restored.state_dict()["sources"] == state["sources"]


def test_interval_skips_unsampled_steps_entirely():
    meter = ChannelLossMeter(interval=3)
    case = simple_case()
    results = []
    for _ in range(4):
        meter.begin_step()
        with meter.micro_batch(source_ids=["not", "even", "checked", "!"], layout=layout_of(case)):
            measuring = active_capture() is not None
            fake_loss(case)
        results.append((meter.end_step() != {}, measuring))
    assert results == [(True, True), (False, False), (False, False), (True, True)]
    meter.begin_step(step=7)  # the trainer's step decides: 7 % 3 != 0
    assert not meter.sampled
    assert meter.end_step() == {}


def test_bad_metadata_drops_the_micro_batch_when_lenient(caplog):
    good, bad = simple_case(0), simple_case(1)
    meter = ChannelLossMeter()
    meter.begin_step()
    run_micro_batch(meter, good)
    with caplog.at_level(logging.WARNING, logger="channel_loss.meter"), \
            meter.micro_batch(source_ids=["web", "code"], layout=layout_of(bad)):
        fake_loss(bad)
    assert "3 samples but source_ids has 2 entries" in caplog.text
    assert meter.end_step() == reference_metrics(reference_totals(good), dropped=1)


def test_bad_metadata_raises_at_end_step_when_strict():
    meter = ChannelLossMeter(strict=True)
    case = simple_case()
    meter.begin_step()
    with meter.micro_batch(source_ids=["web"], layout=layout_of(case)):
        fake_loss(case)  # the forward itself is never interrupted
    with pytest.raises(ChannelLossMetadataError, match=r"micro-batch 0: .*3 samples .* 1 entries"):
        meter.end_step()
    meter.begin_step()  # the meter is usable again
    run_micro_batch(meter, case)
    assert meter.end_step() == reference_metrics(reference_totals(case))


def test_failed_forward_propagates_unchanged_and_is_dropped():
    good = simple_case(0)
    meter = ChannelLossMeter(strict=True)  # a failed forward is not a metadata error
    meter.begin_step()
    boom = RuntimeError("out of memory")

    def failing_forward():
        with meter.micro_batch(source_ids=list(good.source_ids), layout=layout_of(good)):
            fake_loss(good)
            raise boom

    with pytest.raises(RuntimeError) as info:
        failing_forward()
    assert info.value is boom
    run_micro_batch(meter, good)
    assert meter.end_step() == reference_metrics(reference_totals(good), dropped=1)


@pytest.mark.parametrize("calls", [0, 2])
def test_exactly_one_loss_observation_is_expected(calls):
    case = simple_case()
    meter = ChannelLossMeter(strict=True)
    meter.begin_step()
    with meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case)):
        for _ in range(calls):
            fake_loss(case)
    with pytest.raises(ChannelLossMetadataError, match=f"got {calls}"):
        meter.end_step()


def test_lifecycle_misuse_raises():
    meter = ChannelLossMeter()
    case = simple_case()
    with pytest.raises(RuntimeError, match="begin_step"):
        meter.end_step()
    meter.begin_step()
    with pytest.raises(RuntimeError, match="begin_step"):
        meter.begin_step()
    with pytest.raises(RuntimeError, match="inside micro_batch"), \
            meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case)):
        meter.end_step()
    with pytest.raises(RuntimeError, match="inside micro_batch"):
        meter.observe_logits(torch.zeros(2, 3), shift_labels=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="interval"):
        ChannelLossMeter(interval=0)


def real_batch(device, seed=0):
    """A packed row with hidden states and an LM head, plus a float64 per-token reference."""
    g = torch.Generator().manual_seed(seed)
    case = make_case([[5, 1, 7, 3]], source_ids=["web", 3, "web", "code"], rng=random.Random(seed),
                     tails=[4], zero_supervised=[3], one_d=True)
    hidden = torch.randn(case.row_length, 16, generator=g)
    weight = torch.randn(64, 16, generator=g)
    reference = F.cross_entropy(hidden.double() @ weight.double().T, case.targets,
                                ignore_index=IGNORE_INDEX, reduction="none")
    return case, hidden.to(device), weight.to(device), reference


def assert_metrics_close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("device", harness.DEVICES)
def test_real_loss_paths_match_a_float64_reference(device):
    case, hidden, weight, reference = real_batch(device)
    targets = case.targets.to(device)
    expected = reference_metrics(reference_totals(case, reference))
    meter = ChannelLossMeter()

    meter.begin_step()
    with meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case)):
        loss = chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=8)
    assert_metrics_close(meter.end_step(), expected)

    # Observing never changes the loss, bit for bit.
    assert torch.equal(loss, chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=8))

    meter.begin_step()
    with meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case)):
        meter.observe_logits(hidden @ weight.T, shift_labels=targets)
    assert_metrics_close(meter.end_step(), expected)
