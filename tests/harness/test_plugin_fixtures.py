"""A launched test's fixtures are what they are in-process: a ``monkeypatch``
shared with another fixture, fixture values of classes an inner conftest
defines, and what the whole conftest chain sets at import."""

from __future__ import annotations

import textwrap

import pytest
from launch_project import inner_env, run_session, write_project

HELPER = """
    VALUE = "original"
    CONFIG = {"key": "original"}
    GONE = "present"
"""

SHARED_MONKEYPATCH = """
    import os

    import pytest

    import helper


    @pytest.fixture
    def patched(monkeypatch):
        monkeypatch.setenv("HARNESS_SHARED_VAR", "from the fixture")
        monkeypatch.setattr(helper, "VALUE", "patched")
        monkeypatch.setitem(helper.CONFIG, "key", "patched")
        monkeypatch.delattr(helper, "GONE")


    def check(monkeypatch):
        assert os.environ["HARNESS_SHARED_VAR"] == "from the fixture"
        assert helper.VALUE == "patched"
        assert helper.CONFIG["key"] == "patched"
        assert not hasattr(helper, "GONE")
        monkeypatch.setattr(helper, "VALUE", "by the test")


    def test_shared_in_process(patched, monkeypatch):
        check(monkeypatch)


    @pytest.mark.launch(nproc=2)
    def test_shared_launched(patched, monkeypatch):
        check(monkeypatch)


    @pytest.mark.launch(nproc=2)
    def test_nothing_left_patched_after_it():
        assert (helper.VALUE, helper.CONFIG["key"], helper.GONE) == ("original",) * 2 + (
            "present",
        )
        assert "HARNESS_SHARED_VAR" not in os.environ
"""

OUTER_CONFTEST = """
    import pytest


    @pytest.fixture
    def outer():
        return 5
"""

INNER_CONFTEST = """
    import pytest
    from hypothesis import settings

    settings.register_profile("inner", max_examples=3)
    settings.load_profile("inner")


    class Token:
        def __init__(self, value):
            self.value = value


    @pytest.fixture
    def token():
        return Token(7)
"""

INNER_TESTS = """
    import pytest
    from hypothesis import settings


    def check(outer, token):
        assert (outer, token.value) == (5, 7)
        assert settings.default.max_examples == 3  # the inner conftest's profile


    def test_chain_in_process(outer, token):
        check(outer, token)


    @pytest.mark.launch(nproc=1)
    def test_chain_launched(outer, token):
        check(outer, token)
"""


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "kept"])
def test_fixtures_reach_the_ranks_as_in_process(tmp_path, reuse):
    # Regressions: a `monkeypatch` a fixture had used (setenv, setattr on a module)
    # failed the launched test before any rank started (its undo records do not
    # pickle); only the outermost conftest was imported in the ranks, so a fixture
    # value of a class of an inner conftest could not be unpickled there, and the
    # inner conftest's import-time settings were missing.
    files = {
        "helper.py": HELPER,
        "test_shared.py": SHARED_MONKEYPATCH,
        "conftest.py": OUTER_CONFTEST,
    }
    root = write_project(tmp_path / "project", files, reuse=reuse)
    (root / "sub").mkdir()
    (root / "sub" / "conftest.py").write_text(textwrap.dedent(INNER_CONFTEST))
    (root / "sub" / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    session = run_session(root, env=inner_env(root / "out", root / "leases"), timeout=600)
    names = (
        "test_shared_in_process",
        "test_shared_launched",
        "test_nothing_left_patched_after_it",
        "test_chain_in_process",
        "test_chain_launched",
    )
    statuses = {name: session.case(name).status for name in names}
    assert statuses == dict.fromkeys(names, "passed"), session.output
