"""``@given`` on a launched test: Hypothesis draws and shrinks in the launcher,
every rank runs the same example (on a kept pool), and a failure reports the
shrunk example and the failing rank."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from launch_project import inner_env, run_session, write_project

GIVEN = """
    import os
    import time

    import pytest
    from hypothesis import given, settings, strategies as st

    from recording import out_dir


    @settings(max_examples=12, database=None)
    @given(x=st.integers(0, 10_000))
    @pytest.mark.launch(nproc=2)
    def test_same_example_on_every_rank(x):
        import torch
        import torch.distributed as dist

        total = torch.tensor([float(x)])
        dist.all_reduce(total)
        assert total.item() == 2 * x
        with open(out_dir() / f"examples-{os.environ['RANK']}.txt", "a") as f:
            f.write(f"{x} {time.time()}\\n")


    @settings(max_examples=30, database=None, derandomize=True)
    @given(x=st.integers(0, 50))
    @pytest.mark.launch(nproc=2)
    def test_failure_shows_the_shrunk_example(x):
        if os.environ["RANK"] == "1":
            assert x < 3
"""


@pytest.fixture(scope="module")
def given_session(tmp_path_factory):
    # Kept ranks: each example is a case, and a fresh pair of ranks per example is slow.
    root = write_project(tmp_path_factory.mktemp("given"), {"test_given.py": GIVEN}, reuse=True)
    session = run_session(root, env=inner_env(root / "out", root / "leases"), timeout=600)
    return root, session


def test_every_rank_runs_the_examples_drawn_in_the_launcher(given_session):
    root, session = given_session
    case = session.case("test_same_example_on_every_rank")
    assert case.status == "passed", case.text
    lines = [(root / "out" / f"examples-{r}.txt").read_text().splitlines() for r in (0, 1)]
    drawn = [[line.split()[0] for line in rank] for rank in lines]
    assert drawn[0] == drawn[1]
    assert len(drawn[0]) >= 5
    # The launched @given test's throughput on a kept 2-rank pool, after the
    # pool's start (for the record; never asserted).
    times = [float(line.split()[1]) for line in lines[0]]
    rate = (len(times) - 1) / (times[-1] - times[0])
    print(f"launched @given, kept 2-rank pool: {rate:.1f} examples/s")


def test_failure_reports_the_shrunk_example_and_the_failing_rank(given_session):
    _, session = given_session
    case = session.case("test_failure_shows_the_shrunk_example")
    assert case.status == "failed"
    assert "x=3" in case.text, case.text
    assert "rank 1 failed: AssertionError" in case.text, case.text
    # The reproducer names the test, not the launcher's wrapper; no "explanation" that
    # points into the launcher's failure handling (the body ran on the ranks).
    assert "Failing test case: test_failure_shows_the_shrunk_example(" in case.text, case.text
    assert "Explanation:" not in case.text, case.text


def test_a_given_case_records_where_it_ran(given_session):
    root, _ = given_session
    (case,) = [
        tc
        for tc in ET.parse(root / "junit.xml").getroot().iter("testcase")
        if tc.get("name") == "test_same_example_on_every_rank"
    ]
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["harness.device"] == "cpu"
    assert props["harness.nproc"] == "2"
    assert props["harness.cards"] == ""
    assert props["harness.ranks"].startswith(("kept", "fresh")), props
    assert int(props["harness.examples"]) >= 5
