"""A launched case gets the verdict its in-process twin gets: each scenario is a
pair (or trio: kept and fresh ranks) of tests in one real pytest session,
compared by the session's JUnit report."""

from __future__ import annotations

import pytest
from launch_project import inner_env, run_session, write_project

TWINS = """
    import os
    import time
    import unittest

    import pytest

    from recording import out_dir


    class Boom(Exception):
        pass


    @pytest.mark.xfail(raises=Boom, strict=True)
    def test_xfail_raises_in_process():
        raise Boom("expected")


    @pytest.mark.xfail(raises=Boom, strict=True)
    @pytest.mark.launch(nproc=2)
    def test_xfail_raises_kept():
        raise Boom("expected")


    @pytest.mark.xfail(raises=(KeyError, Boom), strict=True)
    @pytest.mark.launch(nproc=1, reuse=False)
    def test_xfail_raises_fresh():
        raise Boom("expected")


    @pytest.mark.xfail(raises=KeyError, strict=True)
    def test_xfail_other_error_in_process():
        raise Boom("not a KeyError")


    @pytest.mark.xfail(raises=KeyError, strict=True)
    @pytest.mark.launch(nproc=1)
    def test_xfail_other_error_launched():
        raise Boom("not a KeyError")


    async def test_async_in_process():
        (out_dir() / "async-in-process.ran").write_text("")


    @pytest.mark.launch(nproc=1)
    async def test_async_launched():
        (out_dir() / "async-launched.ran").write_text("")


    class TestSelfState:
        @pytest.fixture(autouse=True)
        def prepare(self):
            self.from_fixture = 3

        def setup_method(self, method):
            self.from_setup = 4

        def check(self):
            assert (self.from_fixture, self.from_setup) == (3, 4)

        def test_in_process(self):
            self.check()

        @pytest.mark.launch(nproc=2, reuse=True)
        def test_kept(self):
            self.check()

        @pytest.mark.launch(nproc=1, reuse=False)
        def test_fresh(self):
            self.check()


    def hang_in_rank():
        time.sleep(120)


    # The deadline counts from the moment the rank is ready: a short one is all body.
    @pytest.mark.timeout(5)
    @pytest.mark.launch(nproc=1)
    def test_timeout_marker():
        hang_in_rank()


    class TestUnit(unittest.TestCase):
        def test_unit_in_process(self):
            pass

        @pytest.mark.launch(nproc=2)
        def test_unit_launched(self):
            (out_dir() / f"unit-{os.environ.get('RANK')}.ran").write_text("")
"""


#: Module-level statements a process can run once: the module is imported once
#: in-process, and again (in a fresh module) for every case on a kept rank.
IMPORT_ONCE = """
    import multiprocessing

    import pytest
    import torch

    multiprocessing.set_start_method("spawn")
    LIB = torch.library.Library("harness_twins", "DEF")


    def test_once_in_process():
        pass


    @pytest.mark.launch(nproc=1, reuse=True)
    def test_once_first_case():
        pass


    @pytest.mark.launch(nproc=1, reuse=True)
    def test_once_second_case():
        pass
"""


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    files = {"test_twins.py": TWINS, "test_import_once.py": IMPORT_ONCE}
    root = write_project(tmp_path_factory.mktemp("twins"), files)
    return root, run_session(root, env=inner_env(root / "out", root / "leases"), timeout=600)


@pytest.mark.parametrize("launched", ["test_xfail_raises_kept", "test_xfail_raises_fresh"])
def test_xfail_raises_matches_what_the_ranks_raised(twins, launched):
    _, session = twins
    assert session.case("test_xfail_raises_in_process").status == "skipped"  # JUnit's xfail
    assert session.case(launched).status == "skipped", session.case(launched).text


def test_xfail_raises_of_another_error_fails_as_in_process(twins):
    _, session = twins
    assert session.case("test_xfail_other_error_in_process").status == "failed"
    case = session.case("test_xfail_other_error_launched")
    assert case.status == "failed", session.output
    assert "rank 0 failed: test_twins.Boom: not a KeyError" in case.text


def test_async_test_fails_as_in_process_without_running_its_body(twins):
    root, session = twins
    twin = session.case("test_async_in_process")
    launched = session.case("test_async_launched")
    assert twin.status == launched.status == "failed"
    assert "async def functions are not natively supported" in launched.text
    assert not list((root / "out").glob("async-*.ran"))


@pytest.mark.parametrize("launched", ["test_kept", "test_fresh"])
def test_self_state_from_setup_method_and_autouse_fixtures_reaches_the_ranks(twins, launched):
    _, session = twins
    assert session.case("test_in_process").status == "passed"
    assert session.case(launched).status == "passed", session.case(launched).text


def test_launch_marker_on_a_unittest_method_is_refused_clearly(twins):
    root, session = twins
    assert session.case("test_unit_in_process").status == "passed"
    case = session.case("test_unit_launched")
    assert case.status in ("failed", "error"), session.output
    assert "unittest.TestCase" in case.text + case.message
    assert "TestUnit.test_unit_launched" in case.text + case.message
    assert not list((root / "out").glob("unit-*.ran"))  # never run unlaunched


UNITTEST_CASES = """
    import unittest

    import pytest


    class TestUnit(unittest.TestCase):
        def test_plain(self):
            pass

        @pytest.mark.launch(nproc=2)
        def test_launched(self):
            pass
"""


def test_inventory_refuses_the_unittest_method_the_plugin_refuses(pytester):
    from suite_project import make_project, manifest

    from harness.suites.inventory import build_inventory

    root = make_project(
        pytester.path,
        {"tests/test_unit.py": UNITTEST_CASES},
        {"cpu": manifest("cpu", "cpu", [{"id": "unit", "paths": ["tests"]}])},
    )
    inv = build_inventory(root)
    by_id = {c.nodeid: c for c in inv.cases}
    launched = by_id["tests/test_unit.py::TestUnit::test_launched"]
    assert launched.spec is None  # not listed as a 2-rank case
    assert launched.nproc == 1
    assert by_id["tests/test_unit.py::TestUnit::test_plain"].spec is not None
    (problem,) = [p for p in inv.problems if p.rule == "bad-launch-spec"]
    assert problem.where == "tests/test_unit.py::TestUnit::test_launched"
    assert "cannot run the unittest.TestCase method TestUnit.test_launched" in problem.message


ENTRY_CASES = """
    import pytest


    def test_plain():
        pass


    @pytest.mark.launch(nproc=1)
    def test_launched():
        pass
"""


def test_harness_run_records_the_entry_owning_each_case(pytester):
    import xml.etree.ElementTree as ET

    from suite_project import make_project, manifest
    from test_cli import harness

    root = make_project(
        pytester.path,
        {"tests/a/test_a.py": "def test_other():\n    pass\n", "tests/e/test_e.py": ENTRY_CASES},
        {
            "cpu": manifest(
                "cpu",
                "cpu",
                [{"id": "first", "paths": ["tests/a"]}, {"id": "dist", "paths": ["tests/e"]}],
            )
        },
    )
    done = harness(root, "run", "cpu", "--out", "out", "--", "-p", "no:xdist")
    assert done.returncode == 0, done.stdout + done.stderr
    props = {
        tc.get("name"): {p.get("name"): p.get("value") for p in tc.iter("property")}
        for tc in ET.parse(root / "out/junit.xml").getroot().iter("testcase")
    }
    assert props["test_other"] == {"harness.entry": "first"}
    assert props["test_plain"] == {"harness.entry": "dist"}
    assert props["test_launched"]["harness.entry"] == "dist"
    assert props["test_launched"]["harness.nproc"] == "1"


def test_module_level_start_method_and_library_definition_work_on_ranks(twins):
    _, session = twins
    for name in ("test_once_in_process", "test_once_first_case", "test_once_second_case"):
        assert session.case(name).status == "passed", session.case(name).text


def test_pytest_timeout_marker_is_the_case_deadline(twins):
    _, session = twins
    case = session.case("test_timeout_marker")
    assert case.status == "failed"
    assert "still running at the 5 s deadline (pytest-timeout's timeout=5)" in case.text, case.text
    assert "in hang_in_rank" in case.text  # the rank's stack, not the launcher's


def test_each_launched_case_records_where_and_how_it_ran(twins):
    import xml.etree.ElementTree as ET

    root, _ = twins
    props = {
        tc.get("name"): {p.get("name"): p.get("value") for p in tc.iter("property")}
        for tc in ET.parse(root / "junit.xml").getroot().iter("testcase")
    }
    assert props["test_kept"] == {
        "harness.device": "cpu",
        "harness.nproc": "2",
        "harness.cards": "",
        "harness.ranks": "kept (case 1 of its pool)",
    }
    assert props["test_fresh"]["harness.ranks"] == "fresh"
    assert props["test_in_process"] == {}


SUBTESTS = """
    import pytest

    from recording import out_dir


    def test_subtests_in_process(subtests):
        for i in range(2):
            with subtests.test(i=i):
                assert i < 2


    @pytest.mark.launch(nproc=1)
    def test_subtests_launched(subtests):
        (out_dir() / "subtests.ran").write_text("")
        with subtests.test(i=0):
            assert False
"""


def test_the_subtests_fixture_in_a_launched_test_is_refused_naming_it(scenarios):
    # Regression: pytest's own `subtests` fixture travelled to the ranks, where its
    # subtests could not report to the session, and nothing said it was unsupported.
    pytest.importorskip("_pytest.subtests")  # pytest >= 9
    root, session = scenarios
    assert session.case("test_subtests_in_process").status == "passed", session.output
    case = session.case("test_subtests_launched")
    assert case.status in ("failed", "error"), session.output
    assert "`subtests` fixture" in case.text + case.message
    assert "parametrize" in case.text + case.message
    assert not list((root / "out").glob("subtests.ran"))


def test_inventory_refuses_the_subtests_test_the_plugin_refuses(pytester):
    pytest.importorskip("_pytest.subtests")  # pytest >= 9
    from suite_project import make_project, manifest

    from harness.suites.inventory import build_inventory

    root = make_project(
        pytester.path,
        {"tests/test_sub.py": SUBTESTS.replace("from recording import out_dir", "")},
        {"cpu": manifest("cpu", "cpu", [{"id": "sub", "paths": ["tests"]}])},
    )
    (problem,) = [p for p in build_inventory(root).problems if p.rule == "bad-launch-spec"]
    assert problem.where == "tests/test_sub.py::test_subtests_launched"
    assert "`subtests` fixture" in problem.message


EXPLAINED = """
    import pytest


    def test_compare_in_process():
        assert [1, 2, 3] == [1, 2, 4]


    @pytest.mark.launch(nproc=1)
    def test_compare_launched():
        assert [1, 2, 3] == [1, 2, 4]
"""


def test_a_launched_assertion_keeps_pytests_whole_explanation(scenarios):
    # Regression: ranks had no pytest session to explain a failing comparison, so the
    # report kept only "assert [1, 2, 3] == [1, 2, 4]", without "At index 2 diff".
    _, session = scenarios
    here = session.case("test_compare_in_process")
    launched = session.case("test_compare_launched")
    assert here.status == launched.status == "failed", session.output
    for line in ("At index 2 diff: 3 != 4", "Use -v to get more diff"):
        assert line in here.text, session.output
        assert line in launched.text, session.output


def test_assertion_settings_of_a_pytest_without_get_verbosity(pytestconfig):
    # Regression: pytest 7 has no Config.get_verbosity (pytest 8 added it with per-type
    # verbosity): every launched case failed there before its ranks started.
    from harness.launcher.explain import AssertionSettings

    class Pytest7Config:
        """This session's configuration as pytest 7's Config offers it."""

        def getini(self, name):
            return pytestconfig.getini(name)

        def getvalue(self, name):
            return pytestconfig.getvalue(name)

        def getoption(self, name):
            return pytestconfig.getoption(name)

    settings = AssertionSettings.of(Pytest7Config())
    assert settings.verbosity == pytestconfig.getoption("verbose")
    assert settings.assertmode == str(pytestconfig.getvalue("assertmode"))


LOGGED = """
    import logging

    import pytest


    def emit():
        logging.getLogger("twin.logger").warning("something %s", "odd")
        logging.getLogger("twin.logger").debug("below the level")


    def test_log_in_process():
        emit()
        assert False


    @pytest.mark.launch(nproc=1)
    def test_log_launched():
        emit()
        assert False
"""


def test_a_launched_log_record_is_in_the_captured_log_section(scenarios):
    # Regression: a rank's log record showed as bare text in the rank's output, not
    # in a "Captured log call" section with its level, logger and line.
    import re

    _, session = scenarios
    assert session.case("test_log_in_process").status == "failed", session.output
    assert session.case("test_log_launched").status == "failed", session.output
    captured = re.findall(
        r"-+ Captured log call -+\n(WARNING +twin\.logger:test_log\.py:\d+ (?:\[rank 0\] )?"
        r"something odd\n)(?!.*below the level)",
        session.output,
    )
    assert len(captured) == 2, session.output
    assert "below the level" not in session.output


CAPTURING = """
    import logging

    import pytest

    from recording import out_dir


    @pytest.mark.launch(nproc=1)
    def test_caplog_launched(caplog):
        (out_dir() / "caplog.ran").write_text("")
        logging.warning("seen?")
        assert "seen?" in caplog.text


    @pytest.mark.launch(nproc=1)
    def test_capfd_launched(capfd):
        (out_dir() / "capfd.ran").write_text("")
"""


def test_a_capture_fixture_in_a_launched_test_is_refused_naming_it(scenarios):
    # Regression: pytest's capsys / capfd / caplog, which capture the pytest process,
    # failed the test with a pickling error instead of saying they cannot work on ranks.
    root, session = scenarios
    for name in ("caplog", "capfd"):
        case = session.case(f"test_{name}_launched")
        assert case.status == "error", session.output
        assert f"pytest's `{name}` fixture" in case.text + case.message, session.output
        assert "Captured log call" in case.text + case.message
        assert not (root / "out" / f"{name}.ran").exists()


@pytest.fixture(scope="module", params=[False, True], ids=["fresh", "kept"])
def scenarios(request, tmp_path_factory):
    """One session, fresh or kept ranks, of the small scenarios above, each a file: a
    session (and ranks) per scenario would cost a pytest start each."""
    files = {"test_cmp.py": EXPLAINED, "test_log.py": LOGGED, "test_cap.py": CAPTURING}
    try:
        import _pytest.subtests  # noqa: F401  (pytest >= 9)
    except ImportError:
        pass
    else:
        files["test_sub.py"] = SUBTESTS
    root = write_project(tmp_path_factory.mktemp("scenarios"), files, reuse=request.param)
    return root, run_session(root, env=inner_env(root / "out", root / "leases"))
