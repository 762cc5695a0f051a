"""Code that runs only in ranks is measured by ``pytest --cov`` (pytest-cov),
on kept and on fresh ranks."""

from __future__ import annotations

import re

import pytest
from launch_project import inner_env, run_session, write_project

pytest.importorskip("pytest_cov")

HELPER = """
def only_in_ranks(x):
    y = x + 1
    return y * 2


def only_in_fresh_ranks(x):
    y = x * 3
    return y - 1
"""

TESTS = """
    import pytest

    import helper


    @pytest.mark.launch(nproc=2, reuse=True)
    def test_kept_ranks_run_it():
        assert helper.only_in_ranks(1) == 4


    @pytest.mark.launch(nproc=1, reuse=False)
    def test_fresh_ranks_run_it():
        assert helper.only_in_fresh_ranks(1) == 2
"""


def test_lines_run_only_in_ranks_are_covered(tmp_path):
    root = write_project(tmp_path / "project", {"helper.py": HELPER, "test_cov.py": TESTS})
    session = run_session(
        root,
        "--cov=helper",
        "--cov-report=term-missing",
        env=inner_env(root / "out", root / "leases"),
        timeout=300,
    )
    assert session.returncode == 0, session.output
    line = re.search(r"^helper\.py\s.*$", session.output, re.MULTILINE)
    assert line is not None, session.output
    assert line.group(0).split()[1:4] == ["6", "0", "100%"], session.output


KEPT_TO_THE_END = """
    import pytest

    import helper


    @pytest.mark.launch(nproc=2, reuse=True)
    def test_kept_ranks_run_it():
        assert helper.only_in_ranks(1) == 4


    def test_here():
        assert helper.only_in_fresh_ranks(1) == 2
"""


def test_ranks_kept_to_the_end_leave_no_data_files_behind(tmp_path):
    # Regression: kept ranks wrote their data once more when the pool closed, after
    # pytest-cov had combined (and removed) the files: an empty .coverage.<host>.pid<N>...
    # per rank, left next to .coverage after every run.
    root = write_project(
        tmp_path / "project", {"helper.py": HELPER, "test_cov.py": KEPT_TO_THE_END}
    )
    session = run_session(
        root, "--cov=helper", env=inner_env(root / "out", root / "leases"), timeout=300
    )
    assert session.returncode == 0, session.output
    assert re.search(r"^helper\.py\s+6\s+0\s+100%", session.output, re.MULTILINE), session.output
    assert sorted(p.name for p in root.glob(".coverage*")) == [".coverage"]


ONLY_IN_RANKS = """
    import pytest


    @pytest.mark.launch(nproc=1)
    def test_ranks_run_it():
        import helper  # only the ranks import it

        assert helper.only_in_ranks(1) == 4
"""


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "kept"])
@pytest.mark.parametrize("werror", [False, True], ids=["warnings", "W-error"])
def test_the_harness_raises_no_coverage_warning(tmp_path, reuse, werror):
    # Regression: learning the data file's name, the harness called get_data() on the
    # launcher's live Coverage, which flushed it and ran coverage's end-of-run checks:
    # "Module helper was never imported" (the launcher never imports what only ranks
    # run) became a failure of every launched test under -W error, two warnings without.
    root = write_project(
        tmp_path / "project", {"helper.py": HELPER, "test_cov.py": ONLY_IN_RANKS}, reuse=reuse
    )
    session = run_session(
        root,
        "--cov=helper",
        *(["-W", "error"] if werror else []),
        env=inner_env(root / "out", root / "leases"),
        timeout=300,
    )
    assert session.returncode == 0, session.output
    assert session.case("test_ranks_run_it").status == "passed", session.output
    # pytest-cov's own end-of-run checks may still warn on stderr (the launcher never
    # imports helper): no warning of the test's.
    assert "warnings summary" not in session.output, session.output
    assert re.search(r"^helper\.py\s+6\s+2\s+67%", session.output, re.MULTILINE), session.output
