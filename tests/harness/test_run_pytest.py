"""``harness run`` speaks pytest: pytest parses its own options (from the command line,
after ``--``, from ``addopts``) and each planned case's outcome is recorded by node id inside
the run, not read back from JUnit. Real ``harness run`` processes on a small project."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from suite_project import make_project, manifest
from test_cli import harness, summary_rows

from harness import processes
from harness.suites import run as run_module
from harness.suites.cli import main
from harness.suites.report import junit_key, read_junit, results_from_records
from harness.suites.selection import Records

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


def test_pytest_paths_given_in_a_subfolder_mean_what_they_mean_there(pytester):
    # Regression: pytest ran in the repository root, so from tests/ --junitxml=j.xml wrote
    # <root>/j.xml and --ignore=b ignored nothing, while --out was read from tests/.
    root = project(pytester.path)
    done = harness(
        root / "tests", "run", "cpu", "-k", "not bad", "--out", "out", "--junitxml=j.xml",
        "--ignore=b",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert outcomes(root / "tests/out") == {
        "tests/a/test_a.py::test_ok": "passed",
        "tests/a/test_a.py::test_bad": "deselected",
        "tests/a/test_a.py::test_after": "passed",
        "tests/b/test_b.py::test_b": "deselected",
        "tests/c/test_c.py::test_c": "passed",
    }
    assert (root / "tests/j.xml").read_bytes() == (root / "tests/out/junit.xml").read_bytes()
    assert not (root / "j.xml").exists()


def test_the_run_collects_once_in_its_own_pytest(pytester):
    # `harness run` collected the suite in-process (importing every test module and its
    # conftests) to plan it, then its pytest collected it again: about twice plain pytest's
    # cost on a small repository. The plan is made from the run's own collection now.
    tests = {
        **TESTS,
        "tests/conftest.py": (
            "import os\n\nwith open(os.environ['IMPORTS'], 'a') as f:\n"
            "    f.write(f'{os.getpid()}\\n')\n"
        ),
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", ENTRIES)})
    imports = root / "imports.txt"
    for shard in ((), ("--shard", "1/2")):
        imports.write_text("")
        done = harness(
            root,
            "run",
            "cpu",
            *shard,
            "--out",
            "out",
            "--",
            "-n",
            "0",
            env={"IMPORTS": str(imports)},
        )
        assert done.returncode in (0, 1), done.stdout + done.stderr
        assert len(imports.read_text().split()) == 1, imports.read_text()  # pytest's alone
    assert outcomes(root / "out")  # the shard was planned and run


def test_a_run_from_a_subfolder_or_elsewhere_imports_from_the_root(pytester, tmp_path):
    # pytest runs where the run was started: the root stays importable first, as under
    # `python -m pytest` there (a package at the root, not installed, no pythonpath).
    root = make_project(
        pytester.path,
        {
            "pkg/__init__.py": "",
            "pkg/mod.py": "def f():\n    return 1\n",
            "tests/a/test_a.py": "from pkg.mod import f\n\ndef test_f():\n    assert f() == 1\n",
        },
        {"cpu": manifest("cpu", "cpu", [{"id": "a", "paths": ["tests/a"]}])},
    )
    for where, args in ((root / "tests", ()), (tmp_path, ("--root", str(root)))):
        done = harness(where, *args, "run", "cpu", "--out", str(tmp_path / where.name))
        assert done.returncode == 0, done.stdout + done.stderr
        assert outcomes(tmp_path / where.name) == {"tests/a/test_a.py::test_f": "passed"}


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
    "tests/typo/test_typo.py": "from os import name_that_os_lacks\n\ndef test_never():\n    pass\n",
    "tests/gone/test_gone.py": """
        import pytest

        pytest.importorskip("module_that_does_not_exist")

        def test_never():
            pass
    """,
}


def test_a_file_that_fails_to_collect_fails_its_entry_and_the_rest_runs(pytester, capsys):
    entries = [{"id": k, "paths": [f"tests/{k}"]} for k in ("a", "broken", "typo", "gone")]
    root = make_project(pytester.path, BROKEN, {"cpu": manifest("cpu", "cpu", entries)})
    # The inventory names the broken files (a module not installed here only warns); a
    # module-level skip is no idle entry.
    assert main(["--root", str(root), "inventory", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "tests/typo/test_typo.py line 1: [collection-error]" in err
    assert "tests/broken/test_broken.py: [missing-dependency]" in err
    assert "entry-matches-nothing" not in err

    done = harness(root, "run", "cpu", "--out", "out")
    assert done.returncode == 1, done.stdout + done.stderr
    assert outcomes(root / "out") == {
        "tests/a/test_a.py::test_ok": "passed",
        "tests/broken/test_broken.py": "failed",
        "tests/typo/test_typo.py": "failed",
        "tests/gone/test_gone.py": "skipped",
    }
    # A run stays strict: a dependency the inventory only warns about fails the file.
    assert "failed: `tests/broken/test_broken.py` — " in done.stdout
    assert "module_that_does_not_exist" in done.stdout
    assert "**FAILED**: 2 failed" in done.stdout
    # A node id in a file that is one case names that case (it "selected no case").
    for file, said in (
        ("broken/test_broken.py", "**FAILED**: 1 failed\n"),
        ("gone/test_gone.py", "**PASSED**"),
    ):
        done = harness(root, "run", "cpu", "--out", "out", "--", f"tests/{file}::test_never")
        assert said in done.stdout, done.stdout
    # harness matrix plans the same cases.
    assert main(["--root", str(root), "matrix", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["include"][0]["cases"] == 4


SKIPPED_FOLDER = {
    "tests/a/test_a.py": "def test_a():\n    pass\n",
    "tests/c/conftest.py": 'import pytest\n\npytest.skip("skip dir", allow_module_level=True)\n',
    "tests/c/test_c.py": "def test_c():\n    pass\n",
}


@pytest.mark.parametrize("paths", [["tests/a", "tests/c"], ["tests"]], ids=["named", "parent"])
def test_a_folder_whose_conftest_skips_is_one_skipped_case(pytester, paths):
    # Named on pytest's command line, the folder's conftest is loaded before the session,
    # where its skip escaped as a traceback; reached from above, the folder held no case.
    # (A subprocess: in this one the escaping skip would skip the test, not fail it.)
    entries = [{"id": f"e{i}", "paths": [p]} for i, p in enumerate(paths)]
    root = make_project(pytester.path, SKIPPED_FOLDER, {"cpu": manifest("cpu", "cpu", entries)})
    done = harness(root, "inventory", "cpu")  # no idle entry either
    assert done.returncode == 0, done.stdout + done.stderr

    done = harness(root, "run", "cpu", "--out", "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    # Skipped as a whole, as a test module's module-level skip is: one case, the folder.
    assert outcomes(root / "out") == {"tests/a/test_a.py::test_a": "passed", "tests/c": "skipped"}
    (case,) = [
        c
        for c in json.loads((root / "out/summary.json").read_text())["cases"]
        if c["nodeid"] == "tests/c"
    ]
    assert "skip dir" in case["message"]
    # A file inside that folder selects its case (it was "select no case of the run").
    done = harness(root, "run", "cpu", "--out", "out", "--", "tests/c/test_c.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert outcomes(root / "out")["tests/c"] == "skipped"


SLOW = {
    "tests/s/test_s.py": """
        import os
        import signal
        import time
        from pathlib import Path

        def test_slow():
            if os.environ.get("KILL_MY_PYTEST"):
                os.kill(os.getpid(), signal.SIGKILL)
            started = os.environ.get("STARTED")
            if started:
                Path(started).write_text(str(os.getpid()))
                release = Path(started + ".release")
                deadline = time.monotonic() + 120
                while not release.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
    """,
}
SLOW_ID = "tests/s/test_s.py::test_slow"


def slow_project(root: Path) -> Path:
    return make_project(
        root, SLOW, {"cpu": manifest("cpu", "cpu", [{"id": "s", "paths": ["tests/s"]}])}
    )


def test_a_case_that_kills_its_own_pytest_fails_and_records_no_duration(pytester):
    # Its setup had passed and nothing else was reported: it was counted as passed, with
    # its setup's seconds recorded as its duration.
    root = slow_project(pytester.path)
    done = harness(
        root, "run", "cpu", "--out", "out", "--durations-out", "d.json", "--", "-n", "0",
        env={"KILL_MY_PYTEST": "1"},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    (case,) = json.loads((root / "out/summary.json").read_text())["cases"]
    assert case["outcome"] == "failed", case
    assert case["message"] == "its pytest process died during its call"
    assert json.loads((root / "d.json").read_text())["durations"] == {}
    assert f"- failed: `{SLOW_ID}` — its pytest process died during its call" in done.stdout


class _TimeoutOnceStarted:
    """``time`` for ``harness.suites.run``: the runner's timeout passes as soon as the case
    has started (its ``STARTED`` file exists), whatever the timeout is."""

    def __init__(self, started: Path):
        self.started = started

    def __getattr__(self, name: str):
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + (1e6 if self.started.exists() else 0.0)


def _release_when_started(started: Path, after_s: float = 1.0) -> threading.Thread:
    """A thread that lets the SLOW case end ``after_s`` seconds after it started."""

    def release() -> None:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(after_s)
        Path(f"{started}.release").write_text("")

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("ci", ["", "true"])
def test_the_runners_timeout_bounds_a_run_only_in_ci(pytester, monkeypatch, capsys, ci):
    # Regression (issue 44): the runner's timeout_minutes, a CI job's budget, stopped local
    # runs too (`harness run cpu` on a loaded machine: red after 30 min). The budget here
    # passes as soon as the case starts; the case ends a second later.
    root = slow_project(pytester.path)
    started = root / "started"
    monkeypatch.setenv("STARTED", str(started))
    monkeypatch.setenv("CI", ci)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.setattr(run_module, "time", _TimeoutOnceStarted(started))
    _release_when_started(started)
    argv = ["--root", str(root), "run", "cpu", "--out", "out", "--durations-out", "d.json"]
    # This process is a child subreaper for its session (the plugin): the run must give
    # back the state it found, here off (the plugin turns it on again before each case).
    processes.subreaper(False)
    code = main(argv)
    out = capsys.readouterr().out
    assert started.exists()
    (case,) = json.loads((root / "out/summary.json").read_text())["cases"]
    if not ci:  # a local run: not bounded, the case passes
        assert code == 0, out
        assert case["outcome"] == "passed", case
        assert "no time budget (CI unset)" in out
        return
    assert code == 1, out
    assert case == {
        "nodeid": SLOW_ID,
        "outcome": "not run",
        "seconds": 0.0,
        "message": "the run stopped during its call "
        "(stopped at the runner's timeout of 10 min (CI is set))",
    }
    assert json.loads((root / "d.json").read_text())["durations"] == {}
    assert "**FAILED**: stopped at the runner's timeout of 10 min (CI is set)" in out
    # Called in-process, the run gives its caller back its subreaper state.
    assert not processes.is_subreaper()


def test_timeout_minutes_bounds_a_run_anywhere(pytester):
    # --timeout-minutes takes a fraction of a minute: 0.5 min is 30 s, the case takes 120 s
    # (and pytest, which plans the run as it collects, gets to plan it first).
    root = slow_project(pytester.path)
    started = root / "started"
    t0 = time.monotonic()
    done = harness(
        root,
        "run",
        "cpu",
        "--out",
        "out",
        "--timeout-minutes",
        "0.5",
        env={"STARTED": str(started), "CI": ""},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert time.monotonic() - t0 < 100
    assert "**FAILED**: stopped at --timeout-minutes 0.5" in done.stdout
    assert outcomes(root / "out") == {SLOW_ID: "not run"}


def _records(reports: dict[str, list[tuple[str, str]]], finish: int | None) -> Records:
    return Records(
        collected=set(reports),
        reports={n: [(w, o, 0.5, "") for w, o in phases] for n, phases in reports.items()},
        finish=finish,
    )


def test_only_a_case_whose_call_and_teardown_passed_passed():
    done = [("setup", "passed"), ("call", "passed"), ("teardown", "passed")]
    reports = {
        "passed": done,
        # pytest-rerunfailures: a failed attempt's failing phase is reported "rerun".
        "rerun then passed": [done[0], ("call", "rerun"), done[2], *done],
        "rerun, failed again": [done[0], ("call", "rerun"), done[2], done[0], ("call", "failed")],
        "skipped at setup": [("setup", "skipped"), ("teardown", "passed")],
        "xfail": [done[0], ("call", "skipped"), done[2]],
        "failed at teardown": [*done[:2], ("teardown", "failed")],
        "in its call": [done[0]],
        "in its teardown": done[:2],
    }
    finished = results_from_records(reports, _records(reports, None))  # pytest died
    assert {n: r.outcome for n, r in finished.items()} == {
        "passed": "passed",
        "rerun then passed": "flaky",  # never a plain pass
        "rerun, failed again": "failed",
        "skipped at setup": "skipped",
        "xfail": "skipped",
        "failed at teardown": "failed",
        "in its call": "failed",
        "in its teardown": "failed",
    }
    unfinished = {n: reports[n] for n in ("in its call", "in its teardown")}
    for finish, halted in [(None, ""), (2, ""), (0, ""), (None, "stopped at the runner's timeout")]:
        got = results_from_records(unfinished, _records(unfinished, finish), halted)
        # Exit status 0 with a case never finished and no pytest.exit: a worker that could
        # not send its report (xdist then exits 0), a failure.
        want = "failed" if (finish, halted) in [(None, ""), (0, "")] else "not run"
        assert {r.outcome for r in got.values()} == {want}, (finish, halted, got)
    assert finished["in its teardown"].message == "its pytest process died during its teardown"
    got = results_from_records(unfinished, _records(unfinished, 0))
    assert got["in its call"].message == "pytest ended (exit status 0) without reporting its call"
    # pytest.exit in a case: the cases after it were collected and never reported.
    exited = {"before": done, "exits": [done[0]], "after": []}
    records = _records({n: p for n, p in exited.items() if p}, 0)
    records.collected.add("after")
    records.interrupted = "Exit: abort"
    got = results_from_records(exited, records)
    assert [got[n].outcome for n in exited] == ["passed", "not run", "not run"], got
    assert got["after"].message == "Exit: abort during a case", got
    set_up = {"set up": [done[0], done[2]]}  # --setup-only / --setup-plan: never called
    records = _records(set_up, 0)
    records.options["setuponly"] = True
    assert results_from_records(set_up, records)["set up"].outcome == "not run"


def test_a_second_run_into_the_same_output_folder_is_refused(pytester, tmp_path):
    # Both runs wrote and read back out/select.json.*.jsonl (and the second cleared the
    # first's records): each reported a mix of the two runs' outcomes.
    root = slow_project(pytester.path)
    started = tmp_path / "started"
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "GITHUB_STEP_SUMMARY")
    }
    first = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", "cpu", "--out", "out"],
        cwd=root,
        env={**env, "STARTED": str(started)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first run's case never started"
            time.sleep(0.1)
        second = harness(root, "run", "cpu", "--out", "out")
        Path(f"{started}.release").touch()
        out, _ = first.communicate(timeout=120)  # a bound against a hang, not a timing claim
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"the output folder {root / 'out'} is in use by another run (pid {first.pid}: " in (
        second.stderr
    )
    assert "--out DIR" in second.stderr
    assert first.returncode == 0, out
    assert outcomes(root / "out") == {SLOW_ID: "passed"}
    # The folder is free again once its run has ended.
    again = harness(root, "run", "cpu", "--out", "out")
    assert again.returncode == 0, again.stdout + again.stderr


def test_coverage_through_harness_run_covers_every_case(pytester):
    # Regression: the run's xdist workers were set after pytest-cov had picked its
    # single-process controller (INTERNALERROR: no attribute 'configure_node').
    pytest.importorskip("pytest_cov")
    from coverage import CoverageData

    root = pytester.path
    tests = {
        "pkg/__init__.py": "",
        "pkg/mod.py": "def f():\n    return 1\n\n\ndef g():\n    return 2\n",
        "tests/a/test_a.py": "from pkg.mod import f\n\ndef test_1():\n    assert f() == 1\n\n"
        "def test_2():\n    assert f() == 1\n",
        "tests/b/test_b.py": "from pkg.mod import g\n\ndef test_g():\n    assert g() == 2\n",
    }
    entries = [
        {"id": "a", "paths": ["tests/a"]},
        {"id": "b", "paths": ["tests/b"], "timeout_s": 120},
    ]
    make_project(root, tests, {"cpu": manifest("cpu", "cpu", entries)})
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n'
    )
    done = harness(root, "run", "cpu", "--", "--cov=pkg", "--cov-report=term")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "INTERNALERROR" not in done.stdout + done.stderr
    data = CoverageData(basename=str(root / ".coverage"))
    data.read()
    (mod,) = [f for f in data.measured_files() if f.endswith("mod.py")]
    assert {2, 6} <= set(data.lines(mod)), sorted(data.lines(mod))  # f's body and g's

    # --cov-fail-under fails the run, red though no case failed (exit 1 was ignored).
    args = ["run", "cpu", "--", "--cov=pkg", "--cov-fail-under=100"]
    done = harness(root, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    (root / "pkg/mod.py").write_text(tests["pkg/mod.py"] + "\n\ndef h():\n    return 3\n")
    done = harness(root, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pytest exited with 1 though no case failed" in done.stdout, done.stdout


def test_a_run_under_python_warnings_as_errors_runs_its_cases(pytester):
    # Regression: harness run started pytest through pytest.console_main(), which pytest
    # 9.2 deprecates: each group printed the warning, and under PYTHONWARNINGS=error pytest
    # died before collecting (every case "missing").
    root = make_project(
        pytester.path,
        {"tests/a/test_a.py": "def test_ok():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", [{"id": "a", "paths": ["tests/a"]}])},
    )
    done = harness(root, "run", "cpu", "--out", "out", env={"PYTHONWARNINGS": "error"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert outcomes(root / "out") == {"tests/a/test_a.py::test_ok": "passed"}
    assert "console_main" not in done.stdout + done.stderr


TWO_ENTRIES = [
    {"id": "first", "paths": ["tests/first"], "timeout_s": 60},
    {"id": "second", "paths": ["tests/second"], "timeout_s": 120},
]


def test_x_stops_the_run_and_junit_holds_the_cases_not_run(pytester):
    tests = {
        "tests/first/test_first.py": "def test_fails():\n    assert False\n",
        "tests/second/test_second.py": "def test_it():\n    pass\n",
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    done = harness(root, "run", "cpu", "--out", "out", "--", "-x", "-n", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    # JUnit holds the case -x left unrun, as not run (skipped).
    junit = read_junit([root / "out/junit.xml"])
    assert junit[junit_key("tests/second/test_second.py::test_it")].outcome == "skipped"
    cases = {c["nodeid"]: c for c in json.loads((root / "out/summary.json").read_text())["cases"]}
    assert cases["tests/first/test_first.py::test_fails"]["outcome"] == "failed"
    second = cases["tests/second/test_second.py::test_it"]
    assert second["outcome"] == "not run", second
    assert second["message"].startswith("stopping after 1 failures"), second


@pytest.mark.parametrize("prefix", ["", "PFX"])
def test_refreshed_durations_keep_the_figures_of_cases_that_did_not_run(pytester, prefix):
    # Regression: the durations refresh (then scripts/refresh_durations.py) took the cases
    # harness run adds to junit.xml for pytest (not run after -x, never collected) as
    # having run in 0.0 s, overwriting
    # their recorded figures; a run stopped at the runner's timeout zeroed them all.
    # Under a --junit-prefix in addopts it recorded no figure at all ("0 case(s) ran").
    tests = {
        "tests/first/test_first.py": "def test_fails():\n    assert False\n",
        "tests/second/test_second.py": "def test_it():\n    pass\n",
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    if prefix:
        (root / "pyproject.toml").write_text(
            f'[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "--junit-prefix={prefix}"\n'
        )
    recorded = root / "suites/durations/cpu.json"
    recorded.parent.mkdir(parents=True, exist_ok=True)
    second = "tests/second/test_second.py::test_it"
    recorded.write_text(json.dumps({"suite": "cpu", "durations": {second: 5.0}}))
    done = harness(root, "run", "cpu", "--out", "out", "--", "-x", "-n", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    refresh = harness(root, "durations", "out")
    assert refresh.returncode == 0, refresh.stdout + refresh.stderr
    assert "cpu: 1 case(s) ran" in refresh.stdout
    figures = json.loads(recorded.read_text())["durations"]
    assert figures[second] == 5.0
    assert figures["tests/first/test_first.py::test_fails"] > 0


def test_a_pytest_that_exits_124_itself_is_not_the_runners_timeout(pytester):
    # Regression: exit status 124 of pytest's own was reported as the runner's timeout.
    tests = {"tests/first/test_first.py": "import os\n\ndef test_it():\n    os._exit(124)\n"}
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES[:1])})
    done = harness(root, "run", "cpu", "--out", "out", "--", "-p", "no:xdist")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pytest exited with 124" in done.stdout
    assert "runner's timeout" not in done.stdout


def test_a_case_that_ends_the_session_with_status_0_fails_the_run(pytester):
    # Regression: pytest.exit(returncode=0) in a case left that case and every later one
    # "not run" (as after the caller's -x) and the run green.
    tests = {
        "tests/first/test_first.py": (
            "import pytest\n\ndef test_it():\n    pytest.exit('abort on purpose', returncode=0)\n"
        ),
        "tests/second/test_second.py": "def test_it():\n    pass\n",
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    done = harness(root, "run", "cpu", "--out", "out", "--", "-p", "no:xdist")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "**FAILED**: a case ended pytest's session (Exit: abort on purpose)" in done.stdout
    cases = {c["nodeid"]: c for c in json.loads((root / "out/summary.json").read_text())["cases"]}
    second = cases["tests/second/test_second.py::test_it"]
    assert second["outcome"] == "not run", second
    assert second["message"] == "Exit: abort on purpose during a case", second


@pytest.mark.parametrize("failing", ["first", "second"])
def test_last_failed_reruns_the_runs_failures_only(pytester, failing):
    # Regression: when the run was split over several pytest processes, pytest's --lf
    # reran every case of a process whose cases held none of the recorded failures.
    tests = {
        f"tests/{g}/test_{g}.py": (
            f"import os\n\ndef test_flaky():\n    assert not os.environ.get('FAIL_{g.upper()}')\n\n"
            "def test_fine():\n    pass\n"
        )
        for g in ("first", "second")
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    failed = harness(root, "run", "cpu", "--out", "out", env={f"FAIL_{failing.upper()}": "1"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    again = harness(root, "run", "cpu", "--out", "out", "--", "--lf")
    assert again.returncode == 0, again.stdout + again.stderr
    # (pytest's --lf collects only the failures: the run plans what it collects.)
    assert outcomes(root / "out") == {f"tests/{failing}/test_{failing}.py::test_flaky": "passed"}
    # With no failure recorded anywhere, --lf reruns everything, as pytest's does.
    everything = harness(root, "run", "cpu", "--out", "out", "--", "--lf")
    assert everything.returncode == 0, everything.stdout + everything.stderr
    assert set(outcomes(root / "out").values()) == {"passed"}


def test_last_failed_deselects_the_files_it_skips(pytester):
    # Regression: under --lf every planned case in a file pytest's --lf skipped (no failure
    # in it) was "missing", the rerun red.
    tests = {
        "tests/test_a.py": (
            "import os\n\ndef test_flaky():\n    assert not os.environ.get('FAIL')\n\n"
            "def test_fine():\n    pass\n"
        ),
        "tests/test_b.py": "def test_b():\n    pass\n",
    }
    entries = [{"id": "all", "paths": ["tests"]}]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    failed = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0", env={"FAIL": "1"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    # A failure to rerun: pytest collects it alone, skipping the files without one, and
    # the run plans what pytest collects.
    rerun = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0", "--lf")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert outcomes(root / "out") == {"tests/test_a.py::test_flaky": "passed"}


def test_a_usage_error_fails_the_run_once(pytester, tmp_path):
    # Regression: a usage error of pytest's (an unusable lease dir, a bad option, a --pdb
    # refusal) called every planned case missing ("never collected"). The run plans as
    # pytest collects now: a pytest stopped before it collects planned no case.
    tests = {f"tests/{g}/test_{g}.py": "def test_it():\n    pass\n" for g in ("first", "second")}
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    (tmp_path / "a-file").write_text("")
    done = harness(
        root, "run", "cpu", "--out", "out", env={"HARNESS_LEASE_DIR": str(tmp_path / "a-file")}
    )
    assert done.returncode == 1, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert said.count(f"harness lease directory {tmp_path / 'a-file'}") == 1, said
    assert outcomes(root / "out") == {}
    assert "never ran" not in done.stdout
    assert "pytest exited with 4 (a usage error: see pytest's message above)" in done.stdout


def test_junit_holds_the_cases_of_a_pytest_that_died(pytester):
    # Regression: pytest writes its JUnit file as its session ends; a pytest killed (the
    # runner's timeout) or dying (os._exit in a case) left none, and the merged junit.xml
    # was empty and green while the summary and the exit code were red.
    tests = {
        "tests/first/test_first.py": (
            "import os\n\ndef test_ok():\n    pass\n\n"
            "def test_control():\n    assert False, 'col\\x1bor \\x07bell'\n\n"
            "def test_dies():\n    os._exit(3)\n\ndef test_after():\n    pass\n"
        ),
        "tests/second/test_second.py": "def test_never_collected():\n    pass\n",
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    # The second group's file goes between planning and its pytest: never collected.
    (root / "conftest.py").write_text(
        "import os\n\ndef pytest_configure(config):\n"
        "    if os.path.exists('tests/first/.done'):\n"
        "        os.remove('tests/second/test_second.py')\n"
        "    elif 'harness_select' in vars(config.option) and config.option.harness_select:\n"
        "        open('tests/first/.done', 'w').close()\n"
    )
    # Named as pytest names them (its --junit-prefix too), and well-formed XML: a control
    # character in a message (an ANSI colour) made the file unreadable.
    done = harness(root, "run", "cpu", "--out", "out", "--", "-p", "no:xdist", "--junit-prefix=pre")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = outcomes(root / "out")
    junit = read_junit([root / "out/junit.xml"])

    def key(n):
        classname, name = junit_key(n)
        return f"pre.{classname}", name

    assert junit[key("tests/first/test_first.py::test_control")].message == (
        "failed: AssertionError: col#x1Bor #x07bell"
    )
    assert {n: junit[key(n)].outcome for n in summary} == {
        "tests/first/test_first.py::test_ok": "passed",
        "tests/first/test_first.py::test_control": "failed",
        "tests/first/test_first.py::test_dies": "failed",
        "tests/first/test_first.py::test_after": "failed",  # missing: an error in JUnit
        "tests/second/test_second.py::test_never_collected": "failed",
    }, summary
    assert {c: summary[c] for c in summary if "second" in c or "after" in c} == {
        "tests/first/test_first.py::test_after": "missing",
        "tests/second/test_second.py::test_never_collected": "missing",
    }


def test_a_failure_message_with_a_lone_surrogate_is_reported(pytester):
    # Regression: the summary could not be written (UnicodeEncodeError after the tests), and
    # the previous run's PASSED summary.md and summary.json stayed in the output folder.
    # Under xdist the worker cannot send such a report at all (execnet: "strings must be
    # utf-8 encodable"); pytest then exits 0 with the case never reported: it fails too.
    tests = {
        "tests/a/test_a.py": (
            "def test_fine():\n    pass\n\n"
            "def test_surrogate():\n    assert False, 'name ' + b'x\\xff'.decode('utf-8', 'surrogateescape')\n"
        )
    }
    entries = [{"id": "a", "paths": ["tests/a"]}]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    fine = harness(root, "run", "cpu", "--out", "out", "-k", "fine")
    assert fine.returncode == 0, fine.stdout + fine.stderr
    for workers in ("0", "2"):
        # pytest prints the message's byte as it is: not UTF-8 output.
        run = ["run", "cpu", "--out", "out", "-k", "surrogate", "--", "-n", workers]
        done = subprocess.run(
            [sys.executable, "-m", "harness", *run],
            cwd=root,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=240,
            env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        summary = (root / "out/summary.md").read_text(encoding="utf-8")
        assert "**FAILED**: 1 failed" in summary
        if workers == "0":
            assert "name x\\udcff" in summary, summary
        cases = json.loads((root / "out/summary.json").read_text())["cases"]
        surrogate = [c for c in cases if c["nodeid"].endswith("test_surrogate")]
        assert [c["outcome"] for c in surrogate] == ["failed"], (workers, surrogate)


def test_a_run_that_dies_before_its_summary_leaves_no_earlier_summary(pytester):
    tests = {"tests/a/test_a.py": "def test_fine():\n    pass\n"}
    entries = [{"id": "a", "paths": ["tests/a"]}]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    assert harness(root, "run", "cpu", "--out", "out").returncode == 0
    assert (root / "out/summary.md").exists()
    # The caller's own conftest kills the run's process as its pytest ends.
    (root / "conftest.py").write_text(
        "import os, signal\n\ndef pytest_unconfigure(config):\n"
        "    if getattr(config.option, 'harness_select', None):\n"
        "        os.kill(os.getppid(), signal.SIGKILL)\n"
    )
    done = harness(root, "run", "cpu", "--out", "out", "--", "-p", "no:xdist")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert not (root / "out/summary.md").exists()
    assert not (root / "out/summary.json").exists()


def test_paths_and_node_ids_given_to_pytest_narrow_the_run(pytester):
    # Regression: pytest collected the union of the run's files and the caller's node id:
    # `harness run cpu -- FILE::TEST` ran the whole suite.
    tests = {
        "tests/first/test_first.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
        "tests/second/test_second.py": (
            "import pytest\n\n@pytest.mark.parametrize('x', [1, 2])\ndef test_p(x):\n    pass\n\n"
            "class TestK:\n    def test_m(self):\n        pass\n"
        ),
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    cases = [
        "tests/first/test_first.py::test_a",
        "tests/first/test_first.py::test_b",
        "tests/second/test_second.py::test_p[1]",
        "tests/second/test_second.py::test_p[2]",
        "tests/second/test_second.py::TestK::test_m",
    ]
    for cwd, args, ran in [
        (root, ["tests/first/test_first.py::test_b"], {1}),
        (root, ["tests/second/test_second.py::test_p"], {2, 3}),
        (root, ["tests/second/test_second.py::TestK", "tests/first"], {0, 1, 4}),
        (root / "tests", ["second/test_second.py::test_p[2]"], {3}),
    ]:
        done = harness(cwd, "run", "cpu", "--out", str(root / "out"), "--", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        # The run plans what the paths given collect: the other cases are in no plan.
        assert outcomes(root / "out") == {c: "passed" for i, c in enumerate(cases) if i in ran}, (
            args
        )


def test_a_configuration_that_disables_the_harness_plugin_fails_the_run(pytester):
    # Regression: with `-p no:harness` the run's launched cases ran in pytest's own process
    # (a 2-rank case: "Default process group has not been initialized").
    tests = {"tests/a/test_a.py": "def test_a():\n    pass\n"}
    root = make_project(
        pytester.path, tests, {"cpu": manifest("cpu", "cpu", [{"id": "a", "paths": ["tests/a"]}])}
    )
    for args in (["--", "-p", "no:harness"], ["-pno:harness"], []):
        if not args:  # the same from a configuration's addopts
            (root / "pyproject.toml").write_text(
                '[tool.pytest.ini_options]\naddopts = "-p no:harness"\n'
            )
        done = harness(root, "run", "cpu", "--out", "out", *args)
        assert done.returncode == 1, done.stdout + done.stderr
        said = done.stdout + done.stderr
        assert "harness run needs the pytest plugin harness.launcher.plugin" in said
        assert outcomes(root / "out") == {}  # pytest stopped before it collected


def test_named_cases_whose_collection_crashed_are_never_deselected(pytester):
    # Regression: both groups collect the caller's paths; in the first, every xdist worker
    # died importing the other group's file, nothing was collected, and the named cases of
    # that group were "deselected: not among the paths and node ids given": PASSED, exit 0.
    tests = {
        "tests/first/test_first.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
        "tests/second/test_second.py": (
            # Dies in the run's own xdist workers (not in this session's, whose run id the
            # harness process inherits).
            "import os\n\nrun = os.environ.get('PYTEST_XDIST_TESTRUNUID', '')\n"
            "if run not in ('', os.environ['OUTER_RUN']):\n    os._exit(0)\n\n"
            "def test_it():\n    pass\n"
        ),
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    outer = {"OUTER_RUN": os.environ.get("PYTEST_XDIST_TESTRUNUID", "")}
    args = ("--", "-n", "2", "tests/first", "tests/second/test_second.py")
    done = harness(root, "run", "cpu", "--out", "out", *args, env=outer)
    assert done.returncode == 1, done.stdout + done.stderr
    # Every worker died as it collected: no plan was made, and the run says so.
    assert "pytest ended before its collection planned the run" in done.stdout


def test_what_the_callers_ignore_leaves_out_of_their_paths_is_deselected(pytester):
    # Regression: the first version of the narrowing called it missing, the run red.
    tests = {
        "tests/a/test_a.py": "def test_kept():\n    pass\n",
        "tests/b/test_b.py": "def test_b():\n    pass\n",
    }
    entries = [{"id": k, "paths": [f"tests/{k}"]} for k in "ab"]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    for ignore in ("--ignore=tests/b", "--ignore-glob=*/b/*"):
        done = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0", "tests/b", ignore)
        assert done.returncode == 1, done.stdout + done.stderr  # nothing of the run ran
        assert outcomes(root / "out").get("tests/b/test_b.py::test_b", "none") in (
            "deselected",  # pytest collected the path given, the run applied --ignore
            "none",  # pytest applied --ignore to the path given: nothing collected
        )
        done = harness(root, "run", "cpu", "--out", "out", "--", "tests", ignore)
        assert done.returncode == 0, done.stdout + done.stderr
        # (pytest never collects tests/b under tests: the run plans what it collects.)
        assert outcomes(root / "out") == {"tests/a/test_a.py::test_kept": "passed"}


def test_names_given_to_pytest_are_found_or_the_run_is_red(pytester):
    # Regression: the run's own files went to pytest next to the caller's, and a file
    # subsumes a node id in it: a misspelled node id, a module given by --pyargs, a path
    # outside the suite, and --lf with a path each ran nothing, green.
    tests = {
        "tests/__init__.py": "",
        "tests/a/__init__.py": "",
        "tests/a/test_a.py": "def test_ok():\n    pass\n\ndef test_bad():\n    assert False\n",
        "tests/b/__init__.py": "",
        "tests/b/test_b.py": "def test_b1():\n    pass\n\ndef test_b2():\n    pass\n",
        "tests/c/test_c.py": "def test_c():\n    pass\n",  # in no entry
    }
    entries = [{"id": k, "paths": [f"tests/{k}"]} for k in "ab"]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    b = {"tests/b/test_b.py::test_b1": "passed", "tests/b/test_b.py::test_b2": "passed"}

    def run(*args):
        return harness(root, "run", "cpu", "--out", "out", "--", "-p", "no:xdist", *args)

    typo = run("tests/b/test_b.py::test_b9")
    assert typo.returncode == 1, typo.stdout + typo.stderr
    assert "not found" in typo.stdout + typo.stderr
    assert "pytest exited with 4" in typo.stdout
    # Under xdist pytest says nothing of a path that is not there ("no tests ran"): the
    # verdict names it.
    typo_n2 = harness(root, "run", "cpu", "--out", "out", "--", "-n", "2", "tests/b/test_bb.py")
    assert typo_n2.returncode == 1, typo_n2.stdout + typo_n2.stderr
    assert "paths given to pytest are not there: tests/b/test_bb.py" in typo_n2.stdout, (
        typo_n2.stdout
    )
    outside = run("tests/c/test_c.py")
    assert outside.returncode == 1, outside.stdout + outside.stderr
    assert "the paths and options given to pytest select no case of the run" in outside.stdout
    module = run("--pyargs", "tests.b.test_b")
    assert module.returncode == 0, module.stdout + module.stderr
    assert outcomes(root / "out") == b
    assert run().returncode == 1  # records test_bad as failed
    rerun = run("--lf", "tests/b")  # pytest alone: no failure there, so all of tests/b runs
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert outcomes(root / "out") == b
    # A path whose cases pytest's own -k then deselects in part: the caller's choice, green.
    some = run("tests/b", "-k", "b1")
    assert some.returncode == 0, some.stdout + some.stderr
    assert outcomes(root / "out") == {**b, "tests/b/test_b.py::test_b2": "deselected"}
    # ... and in full: nothing ran, where pytest alone exits 5; red (it was PASSED, exit 0).
    none = run("tests/b", "-k", "nomatch")
    assert none.returncode == 1, none.stdout + none.stderr
    assert "the paths and options given to pytest select no case of the run" in none.stdout
    assert set(outcomes(root / "out").values()) == {"deselected"}
    assert harness(root, "run", "cpu", "--out", "out", "-k", "nomatch").returncode == 1
    # A shard may hold none of the cases a -k or a path selects: not red for that (it was).
    for shard in ("1/2", "2/2"):
        for pick in (("-k", "test_b1"), ("--", "tests/b/test_b.py::test_b1")):
            part = harness(root, "run", "cpu", "--shard", shard, "--out", "out", *pick)
            assert part.returncode == 0, part.stdout + part.stderr


def test_the_repository_reached_through_a_link_names_its_own_files(pytester, tmp_path):
    tests = {
        "tests/a/test_a.py": "def test_a():\n    pass\n",
        "tests/b/test_b.py": (
            "def test_b1():\n    pass\n\ndef test_b2():\n    pass\n\n"
            "class TestK:\n    def test_k(self):\n        pass\n"
        ),
    }
    entries = [{"id": k, "paths": [f"tests/{k}"]} for k in "ab"]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    # The repository reached through a link from outside names its own files: selected.
    (tmp_path / "repo").symlink_to(root)
    for prefix in ((), ("--junit-prefix=P",)):
        linked = str(tmp_path / "repo/tests/b/test_b.py")
        done = harness(root, "run", "cpu", "--out", "out", "--", linked, *prefix)
        assert done.returncode == 0, done.stdout + done.stderr
        got = outcomes(root / "out")
        b = ("test_b1", "test_b2", "TestK::test_k")
        assert {got[f"tests/b/test_b.py::{t}"] for t in b} == {"passed"}, got
        assert "tests/a/test_a.py::test_a" not in got, got  # not collected: in no plan
        # ... each once in JUnit (pytest names them from its rootdir, a class ".TestK").
        cases = list(ET.parse(root / "out/junit.xml").getroot().iter("testcase"))
        assert len(cases) == 3, [c.attrib for c in cases]


def test_cases_the_paths_given_collect_outside_the_suite_are_named(pytester):
    # Regression: a test file in a folder given to pytest that no entry owns was dropped
    # without a word, the run green; pytest alone would have run it.
    tests = {
        "tests/a/test_one.py": "def test_x():\n    pass\n",
        "tests/a/test_new.py": "def test_new():\n    assert False\n",
        "tests/b/test_b.py": "def test_b():\n    pass\n",
    }
    entries = [
        {"id": "one", "paths": ["tests/a/test_one.py"]},
        {"id": "b", "paths": ["tests/b"]},
    ]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    note = "- not in suite cpu, not run: `tests/a/test_new.py::test_new` (collected under"
    for workers in ("0", "2"):
        done = harness(root, "run", "cpu", "--out", "out", "--", "-n", workers, "tests/a")
        assert done.returncode == 0, done.stdout + done.stderr
        assert note in done.stdout, done.stdout
        assert note in (root / "out/summary.md").read_text()
    # What pytest's own -k or --deselect leaves out, pytest alone would not run: no note.
    for narrowing in (("-k", "test_x"), ("--deselect", "tests/a/test_new.py::test_new")):
        done = harness(root, "run", "cpu", "--out", "out", "--", "tests/a", *narrowing)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "not in suite" not in done.stdout, done.stdout
    # pytest's -k now comes first: what it deselects was collected (a note said it was not).
    done = harness(root, "run", "cpu", "--out", "out", "-k", "test_x", "--", "-n", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    # Without paths the run gives pytest its own files only: no note. A shard's paths
    # collect the other shard's cases too: they are the suite's, only the file outside it
    # is named.
    done = harness(root, "run", "cpu", "--out", "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not in suite" not in done.stdout
    for shard in ("1/2", "2/2"):
        done = harness(root, "run", "cpu", "--shard", shard, "--out", "out", "--", "tests")
        assert done.stdout.count("not in suite") == 1, done.stdout
        assert note in done.stdout, done.stdout


#: A conftest that adds cases with an option: without --runslow it drops the slow items
#: (pytest's own recipe skips them instead, which the inventory sees).
DROPS_SLOW_UNLESS_RUNSLOW = """
    def pytest_addoption(parser):
        parser.addoption("--runslow", action="store_true")

    def pytest_collection_modifyitems(config, items):
        if not config.getoption("--runslow"):
            items[:] = [i for i in items if "slow" not in i.name]
"""


def test_cases_only_the_options_given_collect_are_planned_and_run(pytester):
    # A conftest option that adds cases (--runslow dropping slow items unless given) made
    # pytest collect cases the inventory, collected without it, never saw: they were
    # dropped without a word and the run green (then named "not planned" and the run red).
    # The run plans from its own collection now: its entries own them, and they run.
    tests = {
        "tests/conftest.py": DROPS_SLOW_UNLESS_RUNSLOW,
        "tests/a/test_a.py": "def test_fast():\n    pass\n\ndef test_slow():\n    assert 0\n",
        "tests/b/test_b.py": "def test_b():\n    pass\n",
        # Held by a node id that names the function: its "slow" variant is the entry's too.
        "tests/c/test_c.py": """
            import pytest

            @pytest.mark.parametrize("x", ["fast", "slow"])
            def test_p(x):
                assert x != "slow"

            def test_other():
                pass
        """,
    }
    entries = [
        {"id": "a", "paths": ["tests/a"]},
        {"id": "b", "paths": ["tests/b"]},
        {"id": "c", "paths": ["tests/c/test_c.py::test_p"]},
        {"id": "other", "paths": ["tests/c/test_c.py::test_other"]},
    ]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    for args in (["-n", "0"], ["-n", "2"], ["tests/a", "tests/c"]):
        done = harness(root, "run", "cpu", "--out", "out", "--", "--runslow", *args)
        assert done.returncode == 1, done.stdout + done.stderr
        got = outcomes(root / "out")
        assert got["tests/a/test_a.py::test_slow"] == "failed", got
        assert got["tests/c/test_c.py::test_p[slow]"] == "failed", got
        assert "**FAILED**: 2 failed" in done.stdout, done.stdout
        assert "not in suite" not in done.stdout, done.stdout
    done = harness(root, "run", "cpu", "--out", "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tests/a/test_a.py::test_slow" not in outcomes(root / "out")


def test_last_failed_and_a_shared_file_keep_the_not_planned_rule_honest(pytester):
    # Regressions of the first "not planned" rule: --lf, which deselects after the harness's
    # hook, left cases it would drop counted as not planned (a false red); another suite's
    # case in a file shared by node-id entries lost its "not in suite" note.
    tests = {
        "tests/conftest.py": DROPS_SLOW_UNLESS_RUNSLOW,
        "tests/a/test_a.py": """
            import os

            def test_flaky():
                assert os.environ.get("FIXED")

            def test_slow():
                pass
        """,
        "tests/s/test_s.py": "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
    }
    cpu = [
        {"id": "a", "paths": ["tests/a"]},
        {"id": "one", "paths": ["tests/s/test_s.py::test_one"]},
    ]
    other = [{"id": "two", "paths": ["tests/s/test_s.py::test_two"]}]
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", cpu), "other": manifest("other", "cpu", other)},
    )
    assert harness(root, "run", "cpu", "--out", "out", "--", "-n", "0").returncode == 1
    done = harness(
        root, "run", "cpu", "--out", "out", "--", "-n", "0", "--lf", "--runslow",
        env={"FIXED": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not planned" not in done.stdout, done.stdout
    done = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0", "tests/s/test_s.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "- not in suite cpu, not run: `tests/s/test_s.py::test_two`" in done.stdout


def test_cases_of_two_files_reached_through_a_link_keep_their_own_results(pytester, tmp_path):
    # Regression: outside its rootdir pytest names a file's cases without the file
    # ("::test_dup"); two files' cases shared one name, one file's went missing and the
    # other's failure was pinned on the file that passed.
    tests = {
        "tests/test_a.py": "def test_dup():\n    assert 0, 'a fails'\n",
        "tests/test_b.py": "def test_dup():\n    pass\n",
    }
    entries = [{"id": "all", "paths": ["tests"]}]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    (tmp_path / "repo").symlink_to(root)
    files = [str(tmp_path / f"repo/tests/test_{k}.py") for k in "ab"]
    for workers in ("0", "2"):
        done = harness(root, "run", "cpu", "--out", "out", "--", "-n", workers, *files)
        assert done.returncode == 1, done.stdout + done.stderr
        assert outcomes(root / "out") == {
            "tests/test_a.py::test_dup": "failed",
            "tests/test_b.py::test_dup": "passed",
        }
        assert len(list(ET.parse(root / "out/junit.xml").getroot().iter("testcase"))) == 2


def test_cache_clear_clears_the_cache_once_per_run(pytester):
    # Regression: each group's pytest got the caller's --cache-clear: the last group cleared
    # the failures the groups before it recorded, and a later --lf missed them.
    tests = {
        f"tests/{g}/test_{g}.py": "def test_bad():\n    assert False\n" for g in ("first", "second")
    }
    tests["tests/first/test_first.py"] += (
        "\ndef test_stores(request):\n    request.config.cache.set('my/key', 1)\n"
    )
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", TWO_ENTRIES)})
    for workers in ("0", "2"):  # xdist's workers clear the cache too, unless told not to
        done = harness(root, "run", "cpu", "--out", "out", "--", "-n", workers, "--cache-clear")
        assert done.returncode == 1, done.stdout + done.stderr
        lastfailed = json.loads((root / ".pytest_cache/v/cache/lastfailed").read_text())
        assert set(lastfailed) == {
            "tests/first/test_first.py::test_bad",
            "tests/second/test_second.py::test_bad",
        }, workers
        assert (root / ".pytest_cache/v/my/key").exists(), workers


def test_junit_names_a_file_that_fails_to_import_once_under_a_prefix(pytester):
    # Regression: pytest names a file-level case classname PFX; the added case was "PFX."
    # and, not found, written a second time.
    tests = {
        "tests/a/test_a.py": "raise ImportError('broken on purpose')\n",
        "tests/b/test_b.py": "def test_b():\n    pass\n",
    }
    entries = [{"id": k, "paths": [f"tests/{k}"]} for k in "ab"]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    done = harness(root, "run", "cpu", "--out", "out", "--", "--junit-prefix=PFX")
    assert done.returncode == 1, done.stdout + done.stderr
    cases = json.loads((root / "out/summary.json").read_text())["cases"]
    testcases = list(ET.parse(root / "out/junit.xml").getroot().iter("testcase"))
    assert len(testcases) == len(cases) == 2, [t.attrib for t in testcases]


# --------------------------------------------------------------------------- deadlines


def test_a_planned_case_in_native_code_fails_and_the_run_goes_on(pytester):
    # A regex backtracking in native code: interrupted at its deadline (the run used to go on
    # until the runner's timeout), the other cases keep their verdicts.
    stuck = 're.match(r"(a+)+$", "a" * 48 + "b")'
    tests = {
        "tests/s/test_s.py": f"import re\n\ndef test_ok():\n    pass\n\ndef test_stuck():\n    {stuck}\n",
        "tests/t/test_t.py": "def test_then():\n    pass\n",
    }
    entries = [
        {"id": "s", "paths": ["tests/s"], "timeout_s": 0.5},
        {"id": "t", "paths": ["tests/t"], "timeout_s": 30},
    ]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    done = harness(root, "run", "cpu", "--out", "out", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = summary_rows((root / "out/summary.md").read_text())
    assert rows["s"][:3] == ["2", "1", "1"], done.stdout  # test_ok kept its pass
    assert rows["t"][:3] == ["1", "1", "0"], done.stdout
    assert "- failed: `tests/s/test_s.py::test_stuck` — Failed: Timeout (>0.5s)" in done.stdout


DEADLINE_CASES = """
    import time


    def test_first():
        pass


    def test_hangs():
        time.sleep(60)


    def test_then():
        pass


    def test_stuck():
        # Swallows the interruption at its deadline: only stopping the process ends it.
        while True:
            try:
                time.sleep(60)
            except BaseException:
                pass
"""


def test_planned_cases_keep_their_deadline_and_the_verdicts_earned_before_a_hang(pytester):
    root = make_project(
        pytester.path,
        {"tests/s/test_s.py": DEADLINE_CASES},
        {"cpu": manifest("cpu", "cpu", [{"id": "s", "paths": ["tests/s"], "timeout_s": 1}])},
    )
    done = harness(root, "run", "cpu", "--out", "out", "--", "-p", "no:xdist", timeout=90)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    # test_hangs fails at its deadline (pytest-timeout's marker, from the entry's
    # timeout_s) and the session goes on; test_stuck does not come back from its
    # interruption and the backstop stops pytest: it fails, and the cases that passed
    # before it stay passed.
    summary = (root / "out/summary.md").read_text()
    assert summary_rows(summary)["s"][:3] == ["4", "2", "2"], summary
    assert "Timeout (>1.0s) from pytest-timeout" in output
    assert "- backstop: tests/s/test_s.py::test_stuck: stopped 2 s after it started" in summary
    (log,) = (root / "out").glob("backstop-*.log")
    assert "in test_stuck" in log.read_text()


def test_a_launched_case_without_timeout_s_keeps_its_own_deadline_and_no_warning(pytester):
    # A launched case of an entry without timeout_s gets no marker from the run: its deadline
    # is its LaunchSpec.timeout (else --harness-timeout), and nothing warns that a marker
    # it never had is shorter. (The plugin told the run's fallback marker apart by its value.)
    test = (
        "import pytest\nfrom harness import LaunchSpec\n\n"
        "@pytest.mark.launch(LaunchSpec(nproc=1, timeout=400))\n"
        "def test_long():\n"
        "    pass\n"
    )
    entries = [{"id": "a", "paths": ["tests/a"]}]
    root = make_project(
        pytester.path, {"tests/a/test_a.py": test}, {"cpu": manifest("cpu", "cpu", entries)}
    )
    done = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0", "-W", "always")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LaunchSpec.timeout=400" not in done.stdout + done.stderr
    assert outcomes(root / "out") == {"tests/a/test_a.py::test_long": "passed"}


def test_a_case_or_project_timeout_wins_over_the_default_deadline(pytester):
    # The one carrier of a planned case's deadline is pytest-timeout's marker: the case's
    # own marker wins, then the entry's timeout_s, then the project's `timeout` ini, then
    # the default (names.DEFAULT_CASE_TIMEOUT_S).
    test = (
        "import pytest\n\n"
        "def test_default(request):\n"
        "    assert request.node.get_closest_marker('timeout').args == ({expect},)\n\n"
        "@pytest.mark.timeout(7)\n"
        "def test_own(request):\n"
        "    assert request.node.get_closest_marker('timeout').args == (7,)\n"
    )
    entries = [
        {"id": "a", "paths": ["tests/a"], "timeout_s": 42},
        {"id": "b", "paths": ["tests/b"]},
    ]
    tests = {
        "tests/a/test_a.py": test.format(expect=42),
        "tests/b/test_b.py": test.format(expect=300.0),
    }
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    done = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    # The project's own pytest-timeout setting stands where no entry sets one.
    (root / "tests/b/test_b.py").write_text(
        "def test_ini(request):\n    assert request.node.get_closest_marker('timeout') is None\n"
    )
    with (root / "pyproject.toml").open("a") as f:
        f.write("timeout = 50\n")
    done = harness(root, "run", "cpu", "--out", "out", "--", "-n", "0", "tests/b")
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------- flaky, quarantine

# summary_rows cells past NOT_RUN: flaky, quarantined
FLAKY, QUARANTINED = 9, 10

ATTEMPTS = """
    from pathlib import Path

    def attempt(name):
        # How many times this case has started, counted in a file beside it.
        counter = Path(__file__).with_name(f".{name}.count")
        n = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(n))
        return n
"""
FLAKY_TESTS = {
    "tests/attempts.py": ATTEMPTS,
    "tests/flaky/test_fl.py": """
        from attempts import attempt

        def test_second_try():
            assert attempt("second") >= 2, "fails on its first try"

        def test_always():
            assert attempt("always") < 0, "fails every try"
    """,
    "tests/steady/test_st.py": "def test_ok():\n    pass\n",
    "tests/quar/test_q.py": """
        def test_broken():
            assert False, "broken for now"

        def test_fine():
            pass
    """,
}


def _properties(junit: Path, name: str) -> list[dict[str, str]]:
    """The ``<properties>`` of each ``<testcase name=name>`` of a JUnit file, in order."""
    return [
        {p.get("name"): p.get("value") for p in tc.iter("property")}
        for tc in ET.parse(junit).getroot().iter("testcase")
        if tc.get("name") == name
    ]


def flaky_project(root: Path, quarantine_until: str = "2999-12-31") -> Path:
    entries = [
        {"id": "flaky", "paths": ["tests/flaky"], "flaky": {"retries": 2, "reason": "issue 7"}},
        {"id": "steady", "paths": ["tests/steady"]},
        {
            "id": "quar",
            "paths": ["tests/quar"],
            "quarantine": {"reason": "issue 8", "until": quarantine_until},
        },
    ]
    tests = {k: v for k, v in FLAKY_TESTS.items() if k != "tests/attempts.py"}
    # A helper module, not a test file (make_project dedents only .py files it is given).
    make_project(root, tests, {"cpu": manifest("cpu", "cpu", entries)})
    (root / "tests/attempts.py").write_text(textwrap.dedent(ATTEMPTS))
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["tests"]\n'
    )
    return root


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_flaky_case_passing_on_a_rerun_is_flaky_and_the_run_green(pytester, workers):
    # Regression: an entry could not say `flaky`; its failures could only be deselected.
    root = flaky_project(pytester.path)
    done = harness(root, "run", "cpu", "--out", "out", "-k", "second or ok", "--", "-n", workers)
    assert done.returncode == 0, done.stdout + done.stderr
    results = outcomes(root / "out")
    assert results["tests/flaky/test_fl.py::test_second_try"] == "flaky"
    assert results["tests/steady/test_st.py::test_ok"] == "passed"
    rows = summary_rows((root / "out/summary.md").read_text())
    assert rows["flaky"][FLAKY] == "1"
    assert rows["flaky"][PASSED] == "0"  # never a plain pass
    assert rows["total"][FLAKY] == "1"
    assert rows["steady"][FLAKY] == "0"
    # Its JUnit record of the passing attempt says so.
    props = _properties(root / "out/junit.xml", "test_second_try")
    assert props[-1]["harness.flaky"] == "passed on attempt 2", props
    assert props[-1]["harness.entry"] == "flaky"
    summary = json.loads((root / "out/summary.json").read_text())
    (case,) = [c for c in summary["cases"] if c["nodeid"].endswith("test_second_try")]
    assert case["message"].startswith("passed on attempt 2; first failure: AssertionError: fails")


def test_a_flaky_case_failing_every_try_fails_the_run(pytester):
    root = flaky_project(pytester.path)
    done = harness(root, "run", "cpu", "--out", "out", "-k", "flaky")
    assert done.returncode == 1, done.stdout + done.stderr
    results = outcomes(root / "out")
    assert results["tests/flaky/test_fl.py::test_always"] == "failed"
    assert results["tests/flaky/test_fl.py::test_second_try"] == "flaky"
    assert (root / "tests/.always.count").read_text() == "3"  # 1 + 2 retries
    summary = json.loads((root / "out/summary.json").read_text())
    (case,) = [c for c in summary["cases"] if c["nodeid"].endswith("test_always")]
    assert case["message"].endswith("(failed all 3 attempts)"), case
    assert "1 failed" in done.stdout


def test_each_attempt_of_a_flaky_case_has_its_deadline(pytester):
    # Regression: the backstop that stops a plain case's process past its deadline counted
    # one attempt: a flaky case timing out on its first tries was killed with its pytest.
    root = flaky_project(pytester.path)
    (root / "tests/flaky/test_fl.py").write_text(
        "import time\n\nfrom attempts import attempt\n\n\n"
        "def test_slow():\n    attempt('slow')\n    time.sleep(30)\n"
    )
    doc = json.loads((root / "suites/cpu.json").read_text())
    doc["entries"][0]["timeout_s"] = 1
    (root / "suites/cpu.json").write_text(json.dumps(doc))
    done = harness(
        root, "run", "cpu", "--out", "out", "-k", "test_slow or test_ok", "--", "-n", "0"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((root / "out/summary.json").read_text())
    cases = {c["nodeid"]: c for c in summary["cases"]}
    slow = cases["tests/flaky/test_fl.py::test_slow"]
    assert slow["outcome"] == "failed"
    assert slow["message"].startswith("Failed: Timeout"), slow
    assert slow["message"].endswith("(failed all 3 attempts)"), slow
    assert (root / "tests/.slow.count").read_text() == "3"
    assert cases["tests/steady/test_st.py::test_ok"]["outcome"] == "passed"


def test_reruns_the_caller_gives_pytest_rerunfailures_show_as_flaky(pytester):
    # pytest-rerunfailures' own --reruns: a case passing on a rerun is flaky, not passed.
    root = flaky_project(pytester.path)
    (root / "suites/cpu.json").write_text(
        json.dumps(manifest("cpu", "cpu", [{"id": "a", "paths": ["tests"]}]))
    )
    done = harness(root, "run", "cpu", "--out", "out", "-k", "second", "--", "--reruns", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert outcomes(root / "out")["tests/flaky/test_fl.py::test_second_try"] == "flaky"
    assert summary_rows((root / "out/summary.md").read_text())["total"][FLAKY] == "1"


def test_a_quarantined_failing_case_leaves_the_run_green(pytester):
    root = flaky_project(pytester.path)
    done = harness(root, "run", "cpu", "--out", "out", "-k", "quar or steady")
    assert done.returncode == 0, done.stdout + done.stderr
    results = outcomes(root / "out")
    assert results["tests/quar/test_q.py::test_broken"] == "quarantined"
    assert results["tests/quar/test_q.py::test_fine"] == "passed"
    rows = summary_rows((root / "out/summary.md").read_text())
    assert rows["quar"][QUARANTINED] == "1"
    assert rows["quar"][FAILED] == "0"
    assert rows["total"][QUARANTINED] == "1"
    assert "**PASSED**" in done.stdout
    summary = json.loads((root / "out/summary.json").read_text())
    (case,) = [c for c in summary["cases"] if c["nodeid"].endswith("test_broken")]
    assert case["message"] == "AssertionError: broken for now [issue 8]", case
    # JUnit keeps the failure as it happened, marked with the quarantine.
    (props,) = _properties(root / "out/junit.xml", "test_broken")
    assert props["harness.quarantine"] == "issue 8"
    junit = read_junit([root / "out/junit.xml"])
    assert junit[junit_key("tests/quar/test_q.py::test_broken")].outcome == "failed"


def test_an_expired_quarantine_blocks_inventory_and_run(pytester):
    root = flaky_project(pytester.path, quarantine_until="2020-01-31")
    done = harness(root, "inventory")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "suites/cpu.json /entries/2/quarantine/until: [quarantine-expired]" in done.stderr
    assert "2020-01-31" in done.stderr
    done = harness(root, "run", "cpu", "--out", "out")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "[quarantine-expired]" in done.stderr


# --------------------------------------------------------------------------- durations


def test_harness_durations_writes_the_file_and_names_a_run_of_another_load(pytester):
    # Regression: the refresh was a script of this repository's (not shipped: an adopter
    # could not feed durations back), and a refresh from a run of another load or runner
    # mixed its figures in silently.
    root = make_project(pytester.path, TESTS, {"cpu": manifest("cpu", "cpu", ENTRIES)})
    done = harness(root, "run", "cpu", "--out", "out/serial", "-k", "not bad", "--", "-n", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    context = json.loads((root / "out/serial/summary.json").read_text())["context"]
    assert context["runner"] == "ubuntu-latest"
    assert context["workers"] == 0
    refresh = harness(root, "durations", "out")
    assert refresh.returncode == 0, refresh.stdout + refresh.stderr
    assert "cpu: 4 case(s) ran" in refresh.stdout
    assert "suites/durations/cpu.json: 4 case(s), 4 refreshed" in refresh.stdout
    assert "note:" not in refresh.stderr  # nothing recorded before: nothing to differ from
    doc = json.loads((root / "suites/durations/cpu.json").read_text())
    assert sorted(doc["durations"]) == [
        "tests/a/test_a.py::test_after",
        "tests/a/test_a.py::test_ok",
        "tests/b/test_b.py::test_b",
        "tests/c/test_c.py::test_c",
    ]
    assert doc["recorded_with"] == [context]
    # The same load again: no note. Two xdist workers: the refresh says so.
    assert harness(root, "durations", "out/serial").stderr == ""
    done = harness(root, "run", "cpu", "--out", "out/two", "-k", "not bad", "--", "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    refresh = harness(root, "durations", "out/two")
    assert refresh.returncode == 0, refresh.stdout + refresh.stderr
    assert "note: out/two ran with runner ubuntu-latest, 2 xdist workers" in refresh.stderr
    assert "recorded with runner ubuntu-latest, 0 xdist workers" in refresh.stderr
    # Nothing to fold in: a usage error naming the folder.
    (root / "empty").mkdir()
    refresh = harness(root, "durations", "empty")
    assert refresh.returncode == 2
    assert "no `harness run` output" in refresh.stderr
