"""ChannelLossMeter in one process: metrics, names, sampling, and the drop / raise rules.

The "model" in most tests is ``fake_loss``: it hands integer-valued
per-token losses to the open ``capture()`` scope exactly as
``chunk_cross_entropy`` does, so metrics compare with ``==`` against the
plain-loop reference. The last tests use the real ops.
"""

from __future__ import annotations

import hashlib
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
from channel_loss.meter import columns_from_metrics, metrics_from_columns
from tests.channel_loss.reference import add_totals, layout_of, reference_metrics, reference_totals
from tests.strategies import IGNORE_INDEX, make_case, packed_cases


def fake_loss(case) -> None:
    """What chunk_cross_entropy does under capture(), with the case's integer losses."""
    record(case.token_losses, case.targets)


def run_micro_batch(meter, case, **kwargs) -> None:
    with meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case), **kwargs):
        fake_loss(case)


def simple_case(seed=0, sources=("web", "code")):
    rng = random.Random(seed)
    return make_case(
        [[3, 1, 4]],
        source_ids=[sources[0], sources[1], sources[0]],
        rng=rng,
        tails=[2],
        scored_fraction=1.0,
    )


@given(st.lists(packed_cases(), min_size=1, max_size=3))
def test_step_metrics_match_the_reference(cases):
    meter = ChannelLossMeter()
    meter.begin_step()
    for case in cases:
        run_micro_batch(meter, case)
    got = meter.end_step()
    assert got == reference_metrics(add_totals(*(reference_totals(c) for c in cases)))


def test_zero_supervision_source_reports_samples_but_no_mean():
    case = make_case(
        [[2, 3]],
        source_ids=["seen", "silent"],
        rng=random.Random(1),
        zero_supervised=[1],
        scored_fraction=1.0,
    )
    meter = ChannelLossMeter()
    meter.begin_step()
    run_micro_batch(meter, case)
    got = meter.end_step()
    assert "channel_loss/silent" not in got
    assert got["channel_loss_tokens/silent"] == 0.0
    assert got["channel_loss_samples/silent"] == 1.0
    assert got["channel_loss_weighted/silent"] == 0.0
    assert got["channel_loss_tokens/seen"] == 2.0


def _hashed(name: str, kept: str) -> str:
    """The documented metric name of a source whose name had characters replaced."""
    return f"{kept}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def test_names_are_sanitised_and_collisions_get_stable_suffixes():
    meter = ChannelLossMeter(prefix="cl")
    case = make_case(
        [[1, 1, 1, 1, 1]],
        source_ids=["a/b", "a_b", 7, "x", "a_b-" + _hashed("a/b", "a_b")[4:]],
        rng=random.Random(2),
        scored_fraction=1.0,
    )
    meter.begin_step()
    run_micro_batch(meter, case, source_names={7: "a b", "x": "x y"})
    first = meter.end_step()
    names = {key.split("/", 1)[1] for key in first if key.startswith("cl_samples/")}
    # Names that differ only in replaced characters stay apart by their hash suffix; a
    # literal name equal to one of them still gets the numbered suffix.
    a_slash, a_space, x_space = _hashed("a/b", "a_b"), _hashed("a b", "a_b"), _hashed("x y", "x_y")
    assert names == {a_slash, "a_b", a_space, x_space, a_slash + "_2"}
    state = meter.state_dict()
    assert state["sources"] == [
        ["a/b", a_slash],
        ["a_b", "a_b"],
        [7, a_space],
        ["x", x_space],
        [a_slash, a_slash + "_2"],
    ]

    # A restarted meter keeps every name, even when sources arrive in another order,
    # and a name given later does not rename a registered source.
    restored = ChannelLossMeter(prefix="cl")
    restored.load_state_dict(state)
    shuffled = make_case(
        [[1, 1, 1, 1, 1]],
        source_ids=[a_slash, "x", 7, "a_b", "a/b"],
        rng=random.Random(2),
        scored_fraction=1.0,
    )
    restored.begin_step()
    run_micro_batch(restored, shuffled, source_names={"a/b": "renamed"})
    assert {k for k in restored.end_step() if k.startswith("cl_samples/")} == {
        f"cl_samples/{n}" for n in names
    }
    assert restored.state_dict()["sources"] == state["sources"]


def test_unicode_source_names_stay_readable_distinct_and_stable():
    """Regression: every non-ASCII character became ``_``, so ``日本語`` and ``中文字`` were
    ``___`` and ``____2`` (which one got the suffix depended on arrival order)."""
    names = ["日本語", "中文字", "हिन्दी", "Ünïcödé", "emoji 🙂"]

    def metric_names(order, **kwargs):
        meter = ChannelLossMeter(**kwargs)
        case = make_case(
            [[1] * len(order)], source_ids=order, rng=random.Random(3), scored_fraction=1.0
        )
        meter.begin_step()
        run_micro_batch(meter, case)
        metrics = meter.end_step()
        names = dict(meter.state_dict()["sources"])
        assert {f"channel_loss_samples/{n}" for n in names.values()} <= metrics.keys()
        return names

    got = metric_names(names)
    assert got == {
        "日本語": "日本語",
        "中文字": "中文字",
        "हिन्दी": "हिन्दी",
        "Ünïcödé": "Ünïcödé",
        "emoji 🙂": _hashed("emoji 🙂", "emoji__"),
    }
    assert metric_names(names[::-1]) == got  # the same names whatever the arrival order
    ascii_names = metric_names(names, ascii_names=True)
    assert ascii_names["日本語"] == _hashed("日本語", "___")
    assert ascii_names["中文字"] == _hashed("中文字", "___")
    assert len(set(ascii_names.values())) == len(names)
    assert all(n.isascii() for n in ascii_names.values())
    assert metric_names(names[::-1], ascii_names=True) == ascii_names


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
    with (
        caplog.at_level(logging.WARNING, logger="channel_loss.meter"),
        meter.micro_batch(source_ids=["web", "code"], layout=layout_of(bad)),
    ):
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
    with pytest.raises(ChannelLossMetadataError, match=rf"got {calls} .*micro_batch\(observe=i\)"):
        meter.end_step()


def test_observe_picks_one_of_several_loss_calls():
    # A multi-token-prediction / auxiliary head computes a second cross-entropy in the same
    # forward: without observe= the micro-batch is dropped (counted, never silently), with it
    # the chosen call is attributed.
    main, aux = simple_case(0), simple_case(1)  # one layout and sources, other losses
    assert reference_totals(main) != reference_totals(aux)

    def step(meter, **kwargs):
        meter.begin_step()
        with meter.micro_batch(source_ids=list(main.source_ids), layout=layout_of(main), **kwargs):
            fake_loss(main)
            fake_loss(aux)
        return meter.end_step()

    assert step(ChannelLossMeter()) == reference_metrics({}, dropped=1)
    for observe, attributed in ((0, main), (-2, main), (1, aux), (-1, aux)):
        assert step(ChannelLossMeter(), observe=observe) == reference_metrics(
            reference_totals(attributed)
        ), observe
    with pytest.raises(ChannelLossMetadataError, match=r"observe=2\) but the forward made 2"):
        step(ChannelLossMeter(strict=True), observe=2)
    for bad in (True, 1.5, "0"):
        with pytest.raises(ValueError, match="observe"):
            step(ChannelLossMeter(), observe=bad)


def test_lifecycle_misuse_raises():
    meter = ChannelLossMeter()
    case = simple_case()
    with pytest.raises(RuntimeError, match="begin_step"):
        meter.end_step()
    meter.begin_step()
    with pytest.raises(RuntimeError, match="begin_step"):
        meter.begin_step()
    with (
        pytest.raises(RuntimeError, match="inside micro_batch"),
        meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case)),
    ):
        meter.end_step()
    with pytest.raises(RuntimeError, match="inside micro_batch"):
        meter.observe_logits(torch.zeros(2, 3), shift_labels=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="interval"):
        ChannelLossMeter(interval=0)


def real_batch(device, seed=0):
    """A packed row with hidden states and an LM head, plus a float64 per-token reference."""
    g = torch.Generator().manual_seed(seed)
    case = make_case(
        [[5, 1, 7, 3]],
        source_ids=["web", 3, "web", "code"],
        rng=random.Random(seed),
        tails=[4],
        zero_supervised=[3],
        one_d=True,
    )
    hidden = torch.randn(case.row_length, 16, generator=g)
    weight = torch.randn(64, 16, generator=g)
    reference = F.cross_entropy(
        hidden.double() @ weight.double().T,
        case.targets,
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
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
    assert torch.equal(
        loss, chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=8)
    )

    meter.begin_step()
    with meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case)):
        meter.observe_logits(hidden @ weight.T, shift_labels=targets)
    assert_metrics_close(meter.end_step(), expected)


def test_metrics_ignore_exactly_what_the_loss_ignored():
    # Regression: chunk_cross_entropy(..., ignore_index=-1) in a default meter (ignore_index=-100)
    # counted the -1 targets as scored: 8 tokens instead of 5, and weighted shares that did not
    # add up to the loss.
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(8, 16, generator=g), torch.randn(32, 16, generator=g)
    targets = torch.tensor([5, -1, 7, 9, -1, 2, 31, -1])
    scored = targets != -1
    reference = F.cross_entropy(
        hidden.double() @ weight.double().T, targets, ignore_index=-1, reduction="none"
    )
    layout = PackedLayout.from_cu_seqlens([0, 3, 8], total_length=8)
    meter = ChannelLossMeter()
    meter.begin_step()
    with meter.micro_batch(source_ids=["a", "b"], layout=layout):
        loss = chunk_cross_entropy(hidden, weight, shift_labels=targets, ignore_index=-1)
    got = meter.end_step()
    assert got["channel_loss_tokens/a"] + got["channel_loss_tokens/b"] == 5.0
    assert got["channel_loss_tokens/a"] == 2.0
    assert got["channel_loss/a"] == pytest.approx(float(reference[:3][scored[:3]].mean()), rel=1e-5)
    assert got["channel_loss/b"] == pytest.approx(float(reference[3:][scored[3:]].mean()), rel=1e-5)
    weighted = got["channel_loss_weighted/a"] + got["channel_loss_weighted/b"]
    assert weighted == pytest.approx(float(loss), rel=1e-5)

    # The meter's own ignore_index is what observe_logits scores with.
    meter = ChannelLossMeter(ignore_index=-1)
    meter.begin_step()
    with meter.micro_batch(source_ids=["a", "b"], layout=layout):
        meter.observe_logits(hidden @ weight.T, shift_labels=targets)
    assert meter.end_step()["channel_loss_tokens/b"] == 3.0


def many_micro_batches(count: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [
        make_case(
            [[rng.randint(1, 4), rng.randint(1, 4)]],
            source_ids=[rng.choice("abc"), "d"],
            rng=rng,
            scored_fraction=1.0,
        )
        for _ in range(count)
    ]


def run_many(meter, cases, failed) -> dict:
    meter.begin_step()
    for m, case in enumerate(cases):
        try:
            with meter.micro_batch(source_ids=list(case.source_ids), layout=layout_of(case)):
                fake_loss(case)
                if m in failed:
                    raise RuntimeError("simulated OOM")
        except RuntimeError:
            pass
    return meter.end_step()


def test_a_failure_past_256_micro_batches_drops_only_that_one():
    # Regression: failure bits were capped at 256 micro-batches; one failure at index 299 of 300
    # dropped 45 of them.
    cases = many_micro_batches(300)
    got = run_many(ChannelLossMeter(), cases, failed={299})
    kept = [c for m, c in enumerate(cases) if m != 299]
    assert got == reference_metrics(add_totals(*map(reference_totals, kept)), dropped=1)
    got = run_many(ChannelLossMeter(), cases, failed={3, 4, 5, 150, 298})
    kept = [c for m, c in enumerate(cases) if m not in {3, 4, 5, 150, 298}]
    assert got == reference_metrics(add_totals(*map(reference_totals, kept)), dropped=5)


def test_more_failure_runs_than_the_header_holds_drop_a_documented_superset():
    # 20 separate failures: the first 15 are exact, the 16th run stretches to the last failure.
    cases = many_micro_batches(60, seed=1)
    failed = set(range(0, 40, 2))
    dropped = set(range(0, 30, 2)) | set(range(30, 39))
    got = run_many(ChannelLossMeter(), cases, failed=failed)
    kept = [c for m, c in enumerate(cases) if m not in dropped]
    assert got == reference_metrics(add_totals(*map(reference_totals, kept)), dropped=len(dropped))


@pytest.mark.parametrize(
    ("ids", "needles"),
    [
        pytest.param(["web", True, "web"], ["source_ids[1]", "bool"], id="bool"),
        pytest.param(["web", 3.0, "web"], ["source_ids[1]", "float"], id="float"),
        pytest.param(["web", "\ud800", "web"], ["source_ids[1]", "UTF-8"], id="lone surrogate"),
    ],
)
def test_bad_source_ids_are_metadata_errors_at_micro_batch_time(ids, needles, caplog):
    case, good = simple_case(0, sources=(3, 4)), simple_case(1)
    meter = ChannelLossMeter()
    meter.begin_step()
    with (
        caplog.at_level(logging.WARNING, logger="channel_loss.meter"),
        meter.micro_batch(source_ids=ids, layout=layout_of(case)),
    ):
        fake_loss(case)
    assert all(needle in caplog.text for needle in needles)
    run_micro_batch(meter, good)
    assert meter.end_step() == reference_metrics(reference_totals(good), dropped=1)

    strict = ChannelLossMeter(strict=True)
    strict.begin_step()
    with strict.micro_batch(source_ids=ids, layout=layout_of(case)):
        fake_loss(case)
    with pytest.raises(ChannelLossMetadataError, match=r"micro-batch 0: source_ids\[1\]"):
        strict.end_step()


def test_an_unencodable_name_is_a_metadata_error():
    case = simple_case()
    meter = ChannelLossMeter(strict=True)
    meter.begin_step()
    run_micro_batch(meter, case, source_names={"web": "bad \udcff name"})
    with pytest.raises(ChannelLossMetadataError, match=r"source_names\['web'\].*UTF-8"):
        meter.end_step()


def test_different_names_for_one_new_source():
    case = simple_case()
    strict = ChannelLossMeter(strict=True)
    strict.begin_step()
    run_micro_batch(strict, case, source_names={"web": "Web"})
    run_micro_batch(strict, case, source_names={"web": "WWW"})
    with pytest.raises(
        ChannelLossMetadataError,
        match=r"source 'web' was given different names: "
        r"rank 0 'Web', rank 0 'WWW'",
    ):
        strict.end_step()
    assert strict.state_dict()["sources"] == []  # nothing registered by the failed step

    lenient = ChannelLossMeter()
    lenient.begin_step()
    run_micro_batch(lenient, case)  # no name: agrees with any
    run_micro_batch(lenient, case, source_names={"web": "WWW"})
    run_micro_batch(lenient, case, source_names={"web": "Web"})
    got = lenient.end_step()
    assert "channel_loss/WWW" in got
    assert "channel_loss/Web" not in got


def test_load_state_dict_rejects_a_registry_that_would_merge_sources():
    meter = ChannelLossMeter()
    good = {"version": 1, "next_step": 4, "sources": [["a", "a"], [1, "one"]]}
    meter.load_state_dict(good)
    for sources, needle in [
        ([["a", "x"], ["b", "x"]], "'a' and 'b' the same metric name 'x'"),
        ([["a", "x"], ["a", "y"]], "source 'a' twice"),
        ([[True, "x"]], "bad source entry"),
        ([["a", "x y"]], "not a metric name"),
    ]:
        with pytest.raises(ValueError, match=needle):
            meter.load_state_dict({**good, "sources": sources})
        assert meter.state_dict() == good  # unchanged
    # Regression: a missing key was a bare KeyError, a list an AttributeError.
    for bad, needle in [
        ({"version": 1, "sources": []}, "lacks 'next_step'"),
        ({"version": 1, "next_step": 1}, "lacks 'sources'"),
        ({**good, "sources": "ab"}, "'sources' must be a list"),
        ([], "must be a mapping; got list"),
    ]:
        with pytest.raises(ValueError, match=needle):
            meter.load_state_dict(bad)
        assert meter.state_dict() == good


def test_paired_samples_repeat_the_pair_id():
    # DPO: a [2B, T] batch of B chosen rows then B rejected rows (TRL's concatenated forward);
    # each pair is two samples of its source, so the ids are the pairs' ids twice.
    pair_ids = ["math", "code"]
    rng = random.Random(5)
    case = make_case(
        [[4], [3], [5], [2]],
        source_ids=pair_ids + pair_ids,
        rng=rng,
        tails=[1, 1, 0, 2],
        scored_fraction=1.0,
    )
    meter = ChannelLossMeter()
    meter.begin_step()
    with meter.micro_batch(source_ids=pair_ids + pair_ids, layout=layout_of(case)):
        fake_loss(case)
    got = meter.end_step()
    assert got["channel_loss_samples/math"] == got["channel_loss_samples/code"] == 2.0
    assert got == reference_metrics(reference_totals(case))


@given(st.lists(packed_cases(), min_size=1, max_size=3))
def test_metric_columns_round_trip(cases):
    metrics = reference_metrics(add_totals(*(reference_totals(c) for c in cases)), dropped=2)
    columns, dropped = columns_from_metrics(metrics, prefix="channel_loss")
    again = metrics_from_columns(columns, prefix="channel_loss", dropped=dropped)
    assert again.keys() == metrics.keys()
    for key, value in metrics.items():
        assert again[key] == pytest.approx(value, rel=1e-12), key


def test_numpy_integers_are_integers_and_bools_and_floats_are_not():
    np = pytest.importorskip("numpy")
    meter = ChannelLossMeter(interval=np.int64(2), ignore_index=np.int32(-100))
    assert (meter.interval, meter.ignore_index) == (2, -100)
    assert type(meter.interval) is int
    meter.begin_step(step=np.int64(4))
    assert meter.sampled
    meter.end_step()
    meter.load_state_dict(
        {"version": 1, "next_step": np.int64(3), "sources": [[np.int64(7), "seven"]]}
    )
    assert meter.state_dict() == {"version": 1, "next_step": 3, "sources": [[7, "seven"]]}
    assert type(meter.state_dict()["sources"][0][0]) is int
    for bad in (True, 2.0, 0.5):  # a Trainer's fractional logging_steps is the caller's to convert
        with pytest.raises(ValueError, match="interval must be an int >= 1"):
            ChannelLossMeter(interval=bad)
    with pytest.raises(ValueError, match="ignore_index"):
        ChannelLossMeter(ignore_index=False)
