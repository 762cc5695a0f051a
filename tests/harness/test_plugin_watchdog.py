"""Every phase of every case is under a deadline, and the results already earned
are kept: the fixtures of a launched case (set up and torn down in the pytest
process) are bounded by the case deadline. (``harness run``'s planned plain cases:
``test_run_pytest.py``.)"""

from __future__ import annotations

import pytest
from launch_project import inner_env, run_session, write_project
from suite_project import make_project, manifest
from test_cli import harness

FIXTURES = """
    import time

    import pytest


    @pytest.fixture
    def hangs_in_setup():
        time.sleep(60)
        yield


    @pytest.fixture
    def hangs_in_teardown():
        yield
        time.sleep(60)


    @pytest.mark.launch(nproc=1, timeout=120)
    def test_passes_first():
        pass


    @pytest.mark.launch(nproc=1, timeout=2)
    def test_setup_hangs(hangs_in_setup):
        pass


    @pytest.mark.timeout(3)
    @pytest.mark.launch(nproc=1)
    def test_teardown_hangs(hangs_in_teardown):
        pass


    def test_passes_after():
        pass
"""

MODULE_FIXTURE = """
    import time

    import pytest


    @pytest.fixture(scope="module")
    def module_hangs_in_teardown():
        yield
        time.sleep(60)


    @pytest.mark.launch(nproc=1, timeout=3)
    def test_module_teardown_hangs(module_hangs_in_teardown):
        pass
"""


def test_hanging_fixtures_of_a_launched_case_fail_at_the_case_deadline(tmp_path):
    root = write_project(
        tmp_path / "project", {"test_fixtures.py": FIXTURES, "test_zmodule.py": MODULE_FIXTURE}
    )
    session = run_session(root, "-p", "no:randomly", env=inner_env(root / "out", root / "leases"))
    assert session.case("test_passes_first").status == "passed", session.output
    assert session.case("test_passes_after").status == "passed", session.output

    setup = session.case("test_setup_hangs")
    assert setup.status == "error", session.output
    assert (
        "test_fixtures.py::test_setup_hangs: setup (fixtures of a launched case) ran past 2 s "
        "(the case deadline, LaunchSpec.timeout)" in setup.text
    ), setup.text
    assert "in hangs_in_setup" in setup.text  # where it hung, from this process's stacks

    # The call passed on the ranks; its teardown failed at pytest-timeout's timeout.
    teardown = session.case("test_teardown_hangs")
    assert teardown.status == "error", session.output
    assert "teardown (fixtures of a launched case) ran past 3 s" in teardown.text, teardown.text
    assert "pytest-timeout's timeout=3" in teardown.text
    assert "in hangs_in_teardown" in teardown.text

    module = session.case("test_module_teardown_hangs")
    assert module.status == "error", session.output
    assert "teardown (fixtures of a launched case) ran past 3 s" in module.text, module.text
    assert "in module_hangs_in_teardown" in module.text
    # Three deadlines of 2-3 s and one pool start: far from the 60 s hangs.
    assert session.seconds < 50, session.output


GIL_BOUND = """
    import re

    import pytest


    @pytest.fixture
    def holds_the_gil():
        # Catastrophic backtracking: C code that never releases the GIL for hours.
        re.match(r"(a+)+$", "a" * 48 + "b")


    @pytest.mark.launch(nproc=1, timeout=1)
    def test_fixture_in_native_code(holds_the_gil):
        pass
"""


def test_native_code_holding_the_gil_is_stopped_by_the_backstop(tmp_path):
    # Regression: the watch thread needs the GIL, which the stuck fixture holds: the
    # process ran on, far past every stated bound (no output, no exit).
    root = write_project(tmp_path / "project", {"test_gil.py": GIL_BOUND})
    session = run_session(root, env=inner_env(root / "out", root / "leases"), timeout=120)
    # The case deadline 1 s, the watchdog's grace 1 s, then the backstop's margin.
    assert session.returncode == 1, session.output
    assert session.seconds < 60, session.output
    assert "Timeout (0:00:0" in session.output, session.output
    assert "in holds_the_gil" in session.output, session.output


def test_a_nested_session_leaves_the_outer_faulthandler_timeout_alone(pytester):
    # Regression: the backstop was one switch per process, set by the last session
    # configured: a nested in-process session (pytester) turned it back on, and the outer
    # session's faulthandler_timeout dump never came.
    nested = (
        "import time\n\n"
        "def test_1_nested(pytester):\n"
        "    pytester.makepyfile('def test_x(): pass')\n"
        "    pytester.runpytest_inprocess('-p', 'no:cacheprovider').assert_outcomes(passed=1)\n\n"
        "def test_2_slow():\n"
        "    time.sleep(2)\n"
    )
    output = run_passing(pytester, nested, 'faulthandler_timeout = 1\naddopts = "-p pytester"\n')
    assert "Timeout (0:00:01)!" in output, output


def run_passing(pytester, test_file: str, pytest_ini: str, *args: str) -> str:
    """``harness run`` over a project of ``test_file`` with ``pytest_ini`` appended to its
    pytest configuration; it passes. Its output."""
    root = make_project(
        pytester.path,
        {"tests/n/test_n.py": test_file},
        {"cpu": manifest("cpu", "cpu", [{"id": "n", "paths": ["tests/n"], "timeout_s": 60}])},
    )
    with (root / "pyproject.toml").open("a") as f:
        f.write(pytest_ini)
    done = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0", *args, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


INNER_WITH_TIMEOUT = """
    INNER = \'\'\'
    import time

    import pytest


    @pytest.fixture
    def slow():
        time.sleep(2)


    @pytest.mark.launch(nproc=1)
    def test_inner(slow):  # its fixtures: a phase of the nested session's own
        pass
    \'\'\'


    def test_outer(pytester):
        pytester.makeini("[pytest]\\nfaulthandler_timeout = 1\\n")
        pytester.makepyfile(test_inner=INNER)
        pytester.runpytest_inprocess("-p", "no:cacheprovider", "-s").assert_outcomes(passed=1)
"""


def test_an_outer_session_leaves_a_nested_faulthandler_timeout_alone(pytester):
    # Regression: the outer session's phase held the backstop; the nested session's own
    # phase cancelled that timer, which was by then pytest's for the nested test: its
    # faulthandler_timeout dump never came.
    output = run_passing(pytester, INNER_WITH_TIMEOUT, 'addopts = "-p pytester"\n', "-s")
    assert "Timeout (0:00:01)!" in output, output


class _Overdue(Exception):
    pass


def _overdue(message: str) -> BaseException:
    return _Overdue(message)


def _inner_phase_then_sleep() -> None:
    import time

    from harness.watchdog import watchdog

    with (
        pytest.raises(_Overdue, match=r"inner ran past 0\.2 s; the stacks"),
        watchdog.bounding("inner", 0.2, grace=30.0, what="inner", error=_overdue),
    ):
        time.sleep(30)
    # The inner phase is over: the outer one is still armed.
    time.sleep(30)


def test_nested_phases_each_keep_their_own_deadline():
    from harness.watchdog import watchdog

    with (
        pytest.raises(_Overdue, match="outer ran past 1 s"),
        watchdog.bounding("outer", 1.0, grace=30.0, what="outer", error=_overdue),
    ):
        _inner_phase_then_sleep()


def test_a_deadline_years_away_keeps_the_watchdog_watching():
    # Regression: timeout_s = 1e10 (valid in a manifest) overflowed the watch thread's wait
    # (OverflowError: timestamp out of range): the thread died, and no deadline was kept.
    import time

    from harness.watchdog import watchdog

    with watchdog.bounding("far", 1e10, grace=30.0, what="far", error=_overdue):
        time.sleep(0.2)
        with (
            pytest.raises(_Overdue, match=r"near ran past 0\.5 s"),
            watchdog.bounding("near", 0.5, grace=30.0, what="near", error=_overdue),
        ):
            time.sleep(30)
