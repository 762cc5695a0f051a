"""Turning what the ranks did into one verdict and a report that leads with the cause."""

from __future__ import annotations

import pickle
import signal

import pytest

from harness.launcher.outcome import (
    FAILED,
    PASSED,
    SKIPPED,
    XFAILED,
    CaseOutcome,
    RankOutcome,
    describe_exit,
)


def result(**kw) -> CaseOutcome:
    return CaseOutcome(
        nproc=kw.pop("nproc", 2),
        label="cpu/gloo",
        deadline_s=5,
        deadline_source="LaunchSpec.timeout",
        **kw,
    )


def passed(rank: int, value=None) -> RankOutcome:
    return RankOutcome(rank, PASSED, 1.0, value=pickle.dumps(value))


def failed(rank: int, at: float, summary: str) -> RankOutcome:
    return RankOutcome(rank, FAILED, at, summary=summary, traceback=f"Traceback of rank {rank}\n")


def test_status_rules():
    assert result(outcomes={0: passed(0), 1: passed(1)}).status == PASSED
    skipped = RankOutcome(1, SKIPPED, 1.0, summary="why")
    assert result(outcomes={0: passed(0), 1: skipped}).status == SKIPPED
    assert result(outcomes={0: passed(0), 1: skipped}).reason() == "why"
    assert result(outcomes={0: RankOutcome(0, XFAILED, 1.0), 1: skipped}).status == XFAILED
    assert result(outcomes={0: passed(0), 1: failed(1, 2.0, "E")}).status == FAILED
    assert result(outcomes={0: passed(0)}, exits={1: (2.0, -9)}).status == FAILED
    assert result(outcomes={0: passed(0)}, timed_out=[1]).status == FAILED
    # Passing, then crashing on the way out, is a failure too.
    assert result(outcomes={0: passed(0), 1: passed(1)}, exits={1: (2.0, -11)}).status == FAILED


def test_values_in_rank_order():
    assert result(outcomes={1: passed(1, "b"), 0: passed(0, "a")}).values() == ["a", "b"]


def test_first_failure_leads_and_the_others_are_summarised():
    report = result(
        nproc=3,
        outcomes={
            0: failed(0, 5.0, "RuntimeError: peer gone"),
            1: passed(1),
            2: failed(2, 3.0, "AssertionError: x"),
        },
    ).report()
    assert report.startswith(
        "rank 2 failed: AssertionError: x\n(3 ranks, cpu/gloo)\n\nTraceback of rank 2"
    )
    assert report.endswith("other ranks:\n  rank 0 failed: RuntimeError: peer gone")
    assert "Traceback of rank 0" not in report


def test_a_dead_rank_leads_over_the_errors_its_death_causes():
    # rank 0's collective failed 0.3 s after the launcher saw rank 1 die.
    report = result(
        outcomes={0: failed(0, 10.3, "RuntimeError: Connection reset by peer")},
        exits={1: (10.0, -signal.SIGKILL)},
        logs={1: "last words\n"},
    ).report()
    assert report.startswith("rank 1 was killed by signal SIGKILL (9) before reporting an outcome")
    assert "--- rank 1 output (last 1 lines) ---\nlast words" in report
    assert "other ranks:\n  rank 0 failed: RuntimeError: Connection reset by peer" in report


def test_timeout_report_names_running_ranks_with_their_stacks():
    report = result(
        outcomes={0: failed(0, 1.0, "RuntimeError: timed out")},
        timed_out=[1],
        stacks={1: 'File "t.py", line 3 in hang'},
    ).report()
    assert report.startswith(
        "case timed out (2 ranks, cpu/gloo): rank 1 still running at the 5 s "
        "deadline (LaunchSpec.timeout); stopped with SIGTERM, then SIGKILL"
    )
    assert '--- rank 1 stack at the deadline ---\nFile "t.py", line 3 in hang' in report
    assert "other ranks:\n  rank 0 failed: RuntimeError: timed out" in report


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (3, "exited with code 3"),
        (-signal.SIGKILL, "was killed by signal SIGKILL (9)"),
        (-signal.SIGSEGV, "was killed by signal SIGSEGV (11)"),
    ],
)
def test_describe_exit(code, words):
    assert describe_exit(code) == words


def test_outcome_file_round_trip(tmp_path):
    path = str(tmp_path / "rank-0.outcome")
    assert RankOutcome.read(path) is None
    failed(0, 1.5, "E").write(path)
    assert RankOutcome.read(path) == failed(0, 1.5, "E")


def test_one_failure_puts_a_bounded_amount_into_the_report(tmp_path):
    from harness.launcher.outcome import SUMMARY_KEEP_CHARS, TRACEBACK_KEEP_CHARS
    from harness.launcher.rank import outcome_from_exception

    message = "m" * 100_000_000
    try:
        raise ValueError(message)
    except ValueError as exc:
        ranks = {r: outcome_from_exception(r, exc) for r in range(4)}
    del message
    # What travels from the rank (its outcome file) is bounded ...
    ranks[0].write(str(tmp_path / "rank-0.outcome"))
    assert (tmp_path / "rank-0.outcome").stat().st_size < 4 * TRACEBACK_KEEP_CHARS
    for rank, outcome in ranks.items():
        outcome.at = float(rank)
    report = result(nproc=4, outcomes=ranks).report()
    # ... and so is the report: the first failure's traceback, one summary per other rank.
    assert len(report) < 2 * TRACEBACK_KEEP_CHARS + 4 * 2 * SUMMARY_KEEP_CHARS + 2000
    assert report.startswith("rank 0 failed: ValueError: mmm")
    assert "characters dropped]" in report
    assert "  rank 3 failed: ValueError: mmm" in report
