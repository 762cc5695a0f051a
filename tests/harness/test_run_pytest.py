"""``harness run`` speaks pytest: pytest parses its own options (from the command line,
after ``--``, from ``addopts``) and each planned case's outcome is recorded by node id inside
the run, not read back from JUnit. Real ``harness run`` processes on a small project."""

from __future__ import annotations

import json
from pathlib import Path

from suite_project import make_project, manifest
from test_cli import harness, summary_rows

from harness.suites.cli import main

TESTS = {
    "tests/a/test_a.py": """
        def test_ok():
            pass

        def test_bad():
            assert False, "bad on purpose"

        def test_after():
            pass
    """,
    "tests/b/test_b.py": "def test_b():\n    pass\n",
    "tests/c/test_c.py": "def test_c():\n    pass\n",
}
ENTRIES = [{"id": k, "paths": [f"tests/{k}"]} for k in "abc"]
# A --junit-prefix in the project's addopts renames every JUnit testcase.
CONFIG = '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = ["--junit-prefix=pre"]\n'

# summary_rows cells: cases, passed, failed, skipped, missing, cards, time, deselected, not run
CASES, PASSED, FAILED, SKIPPED, MISSING, DESELECTED, NOT_RUN = 0, 1, 2, 3, 4, 7, 8


def project(root: Path) -> Path:
    make_project(root, TESTS, {"cpu": manifest("cpu", "cpu", ENTRIES)})
    (root / "pyproject.toml").write_text(CONFIG)
    return root


def outcomes(out: Path) -> dict[str, str]:
    return {
        c["nodeid"]: c["outcome"] for c in json.loads((out / "summary.json").read_text())["cases"]
    }


def test_deselection_ignore_and_pytest_options_under_xdist(pytester):
    root = project(pytester.path)
    # -k and --durations N before `--` are pytest's; --ignore after it applies to the named files.
    done = harness(
        root,
        "run",
        "cpu",
        "-k",
        "not bad",
        "--durations",
        "5",
        "--out",
        "out",
        "--",
        "--ignore=tests/b",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "slowest 5 durations" in done.stdout  # pytest's --durations, not a durations file
    assert outcomes(root / "out") == {
        "tests/a/test_a.py::test_ok": "passed",  # passes despite --junit-prefix in addopts
        "tests/a/test_a.py::test_bad": "deselected",
        "tests/a/test_a.py::test_after": "passed",
        "tests/b/test_b.py::test_b": "deselected",
        "tests/c/test_c.py::test_c": "passed",
    }
    rows = summary_rows((root / "out/summary.md").read_text())
    assert rows["b"][DESELECTED] == "1"
    assert rows["total"][MISSING] == "0"
    assert "never ran" not in done.stdout


def test_exitfirst_in_a_combined_flag_leaves_the_rest_not_run(pytester):
    root = project(pytester.path)
    done = harness(root, "run", "cpu", "-vx", "--out", "out", "--", "-p", "no:xdist")
    assert done.returncode == 1, done.stdout + done.stderr
    got = outcomes(root / "out")
    assert got["tests/a/test_a.py::test_ok"] == "passed"
    assert got["tests/a/test_a.py::test_bad"] == "failed"
    assert (
        sorted(
            v
            for k, v in got.items()
            if k not in ("tests/a/test_a.py::test_ok", "tests/a/test_a.py::test_bad")
        )
        == ["not run"] * 3
    )
    assert "**FAILED**: 1 failed" in done.stdout
    assert "never ran" not in done.stdout


def test_collect_only_is_not_red(pytester):
    root = project(pytester.path)
    done = harness(root, "run", "cpu", "--out", "out", "--", "--co")
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(outcomes(root / "out").values()) == {"not run"}
    assert summary_rows((root / "out/summary.md").read_text())["total"][NOT_RUN] == "5"


def test_a_named_durations_file_that_is_missing_is_a_usage_error(pytester, capsys):
    root = project(pytester.path)
    assert main(["--root", str(root), "run", "cpu", "--durations-file", "nope.json"]) == 2
    assert "nope.json: no such durations file" in capsys.readouterr().err
    assert main(["--root", str(root), "matrix", "cpu", "--durations", "nope.json"]) == 2
    assert "nope.json: no such durations file" in capsys.readouterr().err


BROKEN = {
    "tests/a/test_a.py": "def test_ok():\n    pass\n",
    "tests/broken/test_broken.py": "import module_that_does_not_exist\n\ndef test_never():\n    pass\n",
    "tests/gone/test_gone.py": """
        import pytest

        pytest.importorskip("module_that_does_not_exist")

        def test_never():
            pass
    """,
}


def test_a_file_that_fails_to_collect_fails_its_entry_and_the_rest_runs(pytester, capsys):
    entries = [{"id": k, "paths": [f"tests/{k}"]} for k in ("a", "broken", "gone")]
    root = make_project(pytester.path, BROKEN, {"cpu": manifest("cpu", "cpu", entries)})
    # The inventory names the broken file; a module-level skip is no idle entry.
    assert main(["--root", str(root), "inventory", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "tests/broken/test_broken.py line 1: [collection-error]" in err
    assert "entry-matches-nothing" not in err

    done = harness(root, "run", "cpu", "--out", "out")
    assert done.returncode == 1, done.stdout + done.stderr
    assert outcomes(root / "out") == {
        "tests/a/test_a.py::test_ok": "passed",
        "tests/broken/test_broken.py": "failed",
        "tests/gone/test_gone.py": "skipped",
    }
    assert "failed: `tests/broken/test_broken.py` — " in done.stdout
    assert "module_that_does_not_exist" in done.stdout
    assert "**FAILED**: 1 failed" in done.stdout
    # harness matrix plans the same cases.
    assert main(["--root", str(root), "matrix", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["include"][0]["cases"] == 3
