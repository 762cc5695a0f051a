"""The test's pytest configuration is in effect in its ranks: warning filters
(ini, ``-W``, ``filterwarnings`` marks) apply as they apply in-process, the
ranks' warnings reach pytest's summary, and the conftest chain is imported."""

from __future__ import annotations

import pytest
from launch_project import inner_env, run_session, write_project

INI = """[pytest]
filterwarnings =
    error::FutureWarning
"""

WARNS = """
    import warnings

    import pytest


    def test_ini_in_process():
        warnings.warn("ini says error", FutureWarning)


    @pytest.mark.launch(nproc=1)
    def test_ini_launched():
        warnings.warn("ini says error", FutureWarning)


    @pytest.mark.filterwarnings("error::RuntimeWarning")
    def test_marker_in_process():
        warnings.warn("the marker says error", RuntimeWarning)


    @pytest.mark.filterwarnings("error::RuntimeWarning")
    @pytest.mark.launch(nproc=2)
    def test_marker_launched():
        warnings.warn("the marker says error", RuntimeWarning)


    def test_cmdline_in_process():
        warnings.warn("-W says error", ImportWarning)


    @pytest.mark.launch(nproc=1)
    def test_cmdline_launched():
        warnings.warn("-W says error", ImportWarning)


    @pytest.mark.launch(nproc=2)
    def test_rank_warning_is_reported():
        warnings.warn("a warning from the ranks", UserWarning)
"""


CONFTEST = """
from hypothesis import settings

settings.register_profile("tiny", max_examples=3)
settings.load_profile("tiny")
"""

CHAIN = """
    import pytest
    from hypothesis import settings


    def test_profile_in_process():
        assert settings().max_examples == 3


    @pytest.mark.launch(nproc=1)
    def test_profile_launched():
        assert settings().max_examples == 3
"""


@pytest.fixture(scope="module")
def warned(tmp_path_factory):
    files = {
        "pytest.ini": INI,
        "conftest.py": CONFTEST,
        "test_warns.py": WARNS,
        "test_chain.py": CHAIN,
    }
    root = write_project(tmp_path_factory.mktemp("warned"), files)
    env = inner_env(root / "out", root / "leases")
    return run_session(root, "-W", "error::ImportWarning", env=env, timeout=400)


@pytest.mark.parametrize(
    ("twin", "says"),
    [
        ("ini", "FutureWarning: ini says error"),
        ("marker", "RuntimeWarning: the marker says error"),
        ("cmdline", "ImportWarning: -W says error"),
    ],
)
def test_filters_turn_rank_warnings_into_errors_as_in_process(warned, twin, says):
    assert warned.case(f"test_{twin}_in_process").status == "failed"
    launched = warned.case(f"test_{twin}_launched")
    assert launched.status == "failed", warned.output
    assert says in launched.text


def test_rank_warnings_reach_the_warnings_summary(warned):
    assert warned.case("test_rank_warning_is_reported").status == "passed"
    summary = warned.output.split("warnings summary", 1)[1]
    assert "test_warns.py::test_rank_warning_is_reported" in summary
    assert "UserWarning: [ranks [0, 1]] a warning from the ranks" in summary


def test_conftest_chain_is_imported_in_the_ranks(warned):
    assert warned.case("test_profile_in_process").status == "passed"
    launched = warned.case("test_profile_launched")
    assert launched.status == "passed", launched.text


RETURNS = """
    import pytest


    def test_returns_in_process():
        return 42


    @pytest.mark.launch(nproc=2)
    def test_returns_launched():
        return 42


    @pytest.mark.filterwarnings("error::pytest.PytestReturnNotNoneWarning")
    def test_returns_error_in_process():
        return 42


    @pytest.mark.filterwarnings("error::pytest.PytestReturnNotNoneWarning")
    @pytest.mark.launch(nproc=1)
    def test_returns_error_launched():
        return 42


    @pytest.mark.timeout(3)
    @pytest.mark.launch(nproc=1, timeout=60)
    def test_longer_spec_timeout():
        pass


    @pytest.mark.timeout(90)
    @pytest.mark.launch(nproc=1, timeout=60)
    def test_shorter_spec_timeout():
        pass
"""


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "kept"])
def test_return_values_and_overridden_timeout_markers_warn(tmp_path, reuse):
    # Regressions: a launched test returning a value got no PytestReturnNotNoneWarning
    # (in-process it does; under an error filter it fails); a timeout marker shorter
    # than the LaunchSpec.timeout that overrides it was dropped without a word.
    pytest.importorskip("pytest_timeout")
    root = write_project(tmp_path / "project", {"test_ret.py": RETURNS}, reuse=reuse)
    session = run_session(root, "-W", "always", env=inner_env(root / "out", root / "leases"))
    out = session.output
    assert session.case("test_returns_in_process").status == "passed", out
    assert session.case("test_returns_launched").status == "passed", out
    summary = out.split("warnings summary")[-1]
    assert "test_ret.py::test_returns_launched" in summary, out
    assert "test_ret.test_returns_launched returned <class 'int'>" in summary, out
    assert session.case("test_returns_error_in_process").status == "failed", out
    case = session.case("test_returns_error_launched")
    assert case.status == "failed", out
    assert "PytestReturnNotNoneWarning" in case.text, out
    assert session.case("test_longer_spec_timeout").status == "passed", out
    assert "LaunchSpec.timeout=60" in summary, out
    assert "mark.timeout(3)" in summary, out
    assert "mark.timeout(90)" not in summary, out
