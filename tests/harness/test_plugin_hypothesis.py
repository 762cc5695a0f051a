"""``@given`` on a launched test: Hypothesis draws and shrinks in the launcher,
every rank runs the same example (on a kept pool), and a failure reports the
shrunk example and the failing rank."""

from __future__ import annotations

import re
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


    # One bug is all it has: no search for more after the first failing example (a
    # failing example costs the kept pool a restart).
    @settings(max_examples=30, database=None, derandomize=True, report_multiple_bugs=False)
    @given(x=st.integers(0, 50))
    @pytest.mark.launch(nproc=2)
    def test_failure_shows_the_shrunk_example(x):
        if os.environ["RANK"] == "1":
            assert x < 3
"""


IN_TEST_API = """
    import os

    import pytest
    from hypothesis import assume, event, given, note, settings, target, strategies as st

    from recording import out_dir


    @settings(max_examples={examples}, database=None, derandomize=True)
    @given(x=st.integers(0, 1000))
    @pytest.mark.launch(nproc=2, reuse={reuse})
    def test_assume_rejects_the_example_{variant}(x):
        with open(out_dir() / f"assume-{variant}-{{os.environ['RANK']}}.txt", "a") as f:
            f.write(f"{{x}} {{os.getpid()}}\\n")
        assume(x % 2 == 0)
        assert x % 2 == 0


    @settings(max_examples={event_examples}, database=None, derandomize=True)
    @given(x=st.integers(0, 10))
    @pytest.mark.launch(nproc=2, reuse={reuse})
    def test_event_and_target_{variant}(x):
        event(f"parity {{x % 2}}")
        target(7.0 + (x > 100), label="x")


    @settings(max_examples=20, database=None, derandomize=True, report_multiple_bugs=False)
    @given(x=st.integers(5, {highest}))
    @pytest.mark.launch(nproc=2, reuse={reuse})
    def test_note_in_the_failure_report_{variant}(x):
        note(f"noted {{x}} on rank {{os.environ['RANK']}}")
        assert x < 5


    @given(data=st.data())
    @pytest.mark.launch(nproc=1, reuse={reuse})
    def test_data_strategy_{variant}(data):
        (out_dir() / "data-{variant}.ran").write_text("")
"""

VARIANTS = ("fresh", "kept")


def in_test_api(variant: str) -> str:
    """``IN_TEST_API`` on fresh or kept ranks, its tests and files named after ``variant``.
    Fresh ranks cost a start per example: fewer examples (one shows an event and a
    target), no shrinking."""
    kept = variant == "kept"
    return IN_TEST_API.format(
        variant=variant,
        reuse=kept,
        examples=6 if kept else 2,
        event_examples=6 if kept else 1,
        highest=50 if kept else 5,
    )


DRAWS = """
    import pytest
    from hypothesis import given, settings, strategies as st

    from recording import out_dir


    {marker}
    @settings(max_examples=8, database=None, derandomize=True)
    @given(x=st.integers(0, 10**6))
    def test_draws(x):
        with open(out_dir() / f"{{__name__}}.txt", "a") as f:
            f.write(f"{{x}}\\n")
"""


def test_a_launched_given_test_draws_what_it_draws_in_process(tmp_path):
    # Regression: Hypothesis seeded a launched test's draws (derandomize) and keyed its
    # database by the launcher's wrapper (its source and signature), not the test's body:
    # the same test drew other examples launched than in-process, and any edit of the
    # launcher's wrapper changed them.
    files = {
        "test_draws_in_process.py": DRAWS.format(marker=""),
        "test_draws_launched.py": DRAWS.format(marker="@pytest.mark.launch(nproc=1)"),
    }
    root = write_project(tmp_path, files)
    session = run_session(root, env=inner_env(root / "out", root / "leases"))
    assert session.returncode == 0, session.output
    drawn = {
        name: (root / "out" / f"{name}.txt").read_text().split()
        for name in ("test_draws_in_process", "test_draws_launched")
    }
    assert len(drawn["test_draws_in_process"]) == 8, drawn
    assert drawn["test_draws_launched"] == drawn["test_draws_in_process"]


def _statistics(output: str, test: str) -> str:
    """The ``--hypothesis-show-statistics`` block of ``test`` (a node id) in ``output``."""
    block = output.split(f"{test}:\n", 1)[1]
    return re.split(r"\n(?=\S)", block, maxsplit=1)[0]


@pytest.fixture(scope="module")
def given_session(tmp_path_factory):
    """One inner session for every launched ``@given`` test of this module: ``GIVEN`` and
    ``IN_TEST_API`` on kept ranks, ``IN_TEST_API`` again on fresh ranks (its own file,
    ``reuse=False`` on its markers)."""
    # Kept ranks: each example is a case, and a fresh pair of ranks per example is slow.
    files = {"test_given.py": GIVEN, **{f"test_api_{v}.py": in_test_api(v) for v in VARIANTS}}
    root = write_project(tmp_path_factory.mktemp("given"), files, reuse=True)
    session = run_session(
        root,
        "--hypothesis-show-statistics",
        env=inner_env(root / "out", root / "leases"),
        timeout=600,
    )
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


@pytest.mark.parametrize("variant", VARIANTS)
def test_hypothesis_in_test_api_works_on_the_ranks(given_session, variant):
    # Regression: the body ran on the ranks outside any Hypothesis build context:
    # `assume` failed the test (and tore the kept pool down at each rejection),
    # `note` / `event` / `target` raised InvalidArgument, and st.data() failed to pickle.
    root, session = given_session
    assume = session.case(f"test_assume_rejects_the_example_{variant}")
    assert assume.status == "passed", session.output
    runs = [
        [
            line.split()
            for line in (root / "out" / f"assume-{variant}-{r}.txt").read_text().splitlines()
        ]
        for r in (0, 1)
    ]
    drawn = [[x for x, _ in run] for run in runs]
    assert drawn[0] == drawn[1]  # the same examples on both ranks, in order ...
    assert any(int(x) % 2 for x in drawn[0])  # ... some rejected
    if variant == "kept":  # ... and no rejection replaced the pool
        assert len({pid for _, pid in runs[0]}) == 1, runs[0]

    assert session.case(f"test_event_and_target_{variant}").status == "passed", session.output
    stats = _statistics(session.output, f"test_api_{variant}.py::test_event_and_target_{variant}")
    assert re.search(r"\d%, parity [01]\n", stats), session.output  # the events
    assert "Highest target score: 7" in stats, session.output

    noted = session.case(f"test_note_in_the_failure_report_{variant}")
    assert noted.status == "failed"
    assert "noted 5 on rank 0" in noted.text, noted.text
    assert "rank 1: noted 5 on rank 1" in noted.text, noted.text

    data = session.case(f"test_data_strategy_{variant}")
    assert data.status in ("failed", "error")
    assert "st.data()" in data.text + data.message, session.output
    assert "'data'" in data.text + data.message
    assert not (root / "out" / f"data-{variant}.ran").exists()


DATA_DRAWN = """
    import pytest
    from hypothesis import given, strategies as st


    @given(data=st.data())
    @pytest.mark.launch(nproc=1)
    def test_draws_in_the_body(data):
        pass


    @given(x=st.integers())
    @pytest.mark.launch(nproc=1)
    def test_draws_in_given(x):
        pass
"""


def test_inventory_refuses_the_data_strategy_the_plugin_refuses(pytester):
    from suite_project import make_project, manifest

    from harness.suites.inventory import build_inventory

    root = make_project(
        pytester.path,
        {"tests/test_data.py": DATA_DRAWN},
        {"cpu": manifest("cpu", "cpu", [{"id": "data", "paths": ["tests"]}])},
    )
    (problem,) = [p for p in build_inventory(root).problems if p.rule == "bad-launch-spec"]
    assert problem.where == "tests/test_data.py::test_draws_in_the_body"
    assert "st.data()" in problem.message
