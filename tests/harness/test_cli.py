"""The ``harness`` command end to end: run (JUnit, summary, durations, shards,
--changed-from), matrix, report parsing, and the real repository's inventory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from suite_project import make_project, manifest

from harness.suites import changes, report
from harness.suites.cli import main
from harness.suites.manifest import load_manifest
from harness.suites.run import worker_count

REPO = Path(__file__).resolve().parents[2]

RUN_TESTS = {
    "tests/fast/test_f.py": """
        import pytest

        def test_ok():
            pass

        @pytest.mark.skip(reason="not today")
        def test_skip():
            pass

        @pytest.mark.parametrize("device", ["cpu", "cuda"])
        def test_dev(device):
            pass
    """,
    "tests/mixed/test_m.py": """
        def test_pass():
            pass

        def test_fail():
            assert 1 == 2, "expected failure"
    """,
}
LAUNCHED = {
    "tests/dist/test_d.py": """
        import os

        import pytest

        @pytest.mark.launch(nproc=2)
        def test_two_ranks():
            import torch.distributed as dist

            assert dist.get_world_size() == 2
            assert os.environ["WORLD_SIZE"] == "2"
    """,
}
CPU_ENTRIES = [
    {"id": "fast", "paths": ["tests/fast"]},
    {"id": "mixed", "paths": ["tests/mixed"]},
]


def harness(
    cwd: Path, *args: str, env: dict | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    # Not the outer session's PYTEST_ADDOPTS / step summary: they are its own.
    base = {
        k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "GITHUB_STEP_SUMMARY")
    }
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
    )


def summary_rows(md: str) -> dict[str, list[str]]:
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("entry",):
            rows[cells[0]] = cells[1:]
    return rows


def test_run_end_to_end_cpu_suite_with_a_launched_case(pytester):
    root = make_project(
        pytester.path,
        {**RUN_TESTS, **LAUNCHED},
        {
            "cpu": manifest(
                "cpu",
                "cpu",
                [*CPU_ENTRIES, {"id": "dist", "paths": ["tests/dist"], "timeout_s": 120}],
            )
        },
    )
    step = root / "step_summary.md"
    out = root / "results"
    done = harness(
        root,
        "run",
        "cpu",
        "--out",
        str(out),
        "--durations-out",
        str(root / "d.json"),
        env={"GITHUB_STEP_SUMMARY": str(step), "PYTEST_ADDOPTS": f"--junitxml={root / 'ci/j.xml'}"},
    )
    assert done.returncode == 1, done.stdout + done.stderr  # test_fail fails

    # JUnit: exactly the planned cases (the cuda variant belongs to no cpu entry).
    tree = ET.parse(out / "junit.xml").getroot()
    cases = {f"{tc.get('classname')}::{tc.get('name')}": tc for tc in tree.iter("testcase")}
    assert sorted(cases) == [
        "tests.dist.test_d::test_two_ranks",
        "tests.fast.test_f::test_dev[cpu]",
        "tests.fast.test_f::test_ok",
        "tests.fast.test_f::test_skip",
        "tests.mixed.test_m::test_fail",
        "tests.mixed.test_m::test_pass",
    ]
    assert cases["tests.mixed.test_m::test_fail"].find("failure") is not None
    assert cases["tests.fast.test_f::test_skip"].find("skipped") is not None
    # A --junitxml the caller gave pytest (here in PYTEST_ADDOPTS, as .ci/run does) gets the merged file.
    assert (root / "ci/j.xml").read_bytes() == (out / "junit.xml").read_bytes()

    # Summary per entry: cases, passed, failed, skipped, missing, cards, time.
    md = (out / "summary.md").read_text()
    rows = summary_rows(md)
    assert rows["fast"][:6] == ["3", "2", "0", "1", "0", "0"]
    assert rows["mixed"][:6] == ["2", "1", "1", "0", "0", "0"]
    assert rows["dist"][:6] == ["1", "1", "0", "0", "0", "0"]
    assert rows["total"][:5] == ["6", "4", "1", "1", "0"]
    assert "failed: `tests/mixed/test_m.py::test_fail` — AssertionError: expected failure" in md
    assert md in done.stdout
    assert step.read_text().strip() == md.strip()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"]["failed"] == 1

    # One pytest process for every case, the entry with its own timeout_s included (its
    # deadline travels with each case); the last line says the verdict and names the reports.
    assert "group" not in done.stdout
    assert done.stdout.count("harness: harness run") == 0  # the prefix said once
    assert done.stdout.splitlines()[-1] == (
        "harness run cpu: FAILED (1 failed); "
        f"summary {out / 'summary.md'}, JUnit {out / 'junit.xml'}"
    )

    durations = json.loads((root / "d.json").read_text())["durations"]
    assert set(durations) == {
        "tests/dist/test_d.py::test_two_ranks",
        "tests/fast/test_f.py::test_dev[cpu]",
        "tests/fast/test_f.py::test_ok",
        "tests/mixed/test_m.py::test_pass",
    }
    assert durations["tests/dist/test_d.py::test_two_ranks"] > 0


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def commit_all(root: Path) -> None:
    """A git repository at ``root`` whose branch ``main`` holds everything there."""
    git(root, "init", "-q", "-b", "main")
    git(root, "-c", "user.email=t@e", "-c", "user.name=t", "add", ".")
    git(root, "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", "base")


def test_run_changed_from_and_shards(pytester):
    tests = {
        "tests/a/test_a.py": "def test_a1():\n    pass\n\ndef test_a2():\n    pass\n",
        "tests/b/test_b.py": "def test_b1():\n    pass\n\ndef test_b2():\n    pass\n",
    }
    entries = [
        {"id": "a", "paths": ["tests/a"], "depends_on": ["src/a.py"]},
        {"id": "b", "paths": ["tests/b"], "depends_on": ["src/b.py"]},
    ]
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", entries)},
        {"src/a.py": "", "src/b.py": "", ".gitignore": "out/\n"},
    )
    commit_all(root)
    (root / "src/b.py").write_text("changed = True\n")

    # Without xdist (-p no:xdist is passed through to pytest): selection is what is tested here.
    done = harness(
        root, "run", "cpu", "--changed-from", "main", "--out", "out/changed", "--", "-p", "no:xdist"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 changed file(s) select 1 of 2 entries" in done.stdout
    planned = json.loads((root / "out/changed/plan.json").read_text())["cases"]
    assert planned == [["tests/b/test_b.py::test_b1", "b"], ["tests/b/test_b.py::test_b2", "b"]]
    assert set(summary_rows((root / "out/changed/summary.md").read_text())) == {"b", "total"}

    # Shard 1/2 of the whole suite: an LPT half, planned exactly as `harness matrix` plans it.
    assert main(["--root", str(root), "matrix", "cpu", "--shards", "2"]) == 0
    done = harness(root, "run", "cpu", "--shard", "1/2", "--out", "out/s1", "--", "-p", "no:xdist")
    assert done.returncode == 0, done.stdout + done.stderr
    planned = [c for c, _ in json.loads((root / "out/s1/plan.json").read_text())["cases"]]
    assert len(planned) == 2
    assert summary_rows((root / "out/s1/summary.md").read_text())["total"][:2] == ["2", "2"]


def test_changed_files_are_read_from_the_harness_root(tmp_path):
    # Regressions: in a monorepo's project folder git's paths (from the repository's top)
    # matched no entry, and a file name with non-ASCII letters came quoted: both selected
    # nothing and the run was green. A pytest.ini change did not run everything.
    top = tmp_path / "mono"
    project = top / "python"
    project.mkdir(parents=True)
    entries = [
        {"id": "core", "paths": ["tests/core"], "depends_on": ["pkg/core.py"]},
        {"id": "uni", "paths": ["tests/ä"], "depends_on": ["pkg/ü.py"]},
    ]
    make_project(
        project,
        {"tests/core/test_core.py": "def test_c():\n    pass\n", "tests/ä/test_ä.py": ""},
        {"cpu": manifest("cpu", "cpu", entries)},
        {"pkg/core.py": "", "pkg/ü.py": "", "pytest.ini": "[pytest]\n"},
    )
    (top / "README.md").write_text("top\n")
    commit_all(top)
    m = load_manifest(project / "suites/cpu.json", project)

    def selected() -> set[str]:
        return set(changes.select(m.entries, *changes.changed_files(project, "main")).entries)

    # A change outside the project may be read by its tests (a conftest, a library beside
    # it): every entry runs.
    (top / "README.md").write_text("outside the project\n")
    assert changes.changed_files(project, "main") == (["../README.md"], "")
    (top / "conftest.py").write_text("")  # untracked
    assert changes.changed_files(project, "main") == (["../README.md", "../conftest.py"], "")
    sel = changes.select(m.entries, *changes.changed_files(project, "main"))
    assert sel.everything, sel.reason
    assert sel.reason == "../README.md changed: running every entry"
    (top / "conftest.py").unlink()
    git(top, "checkout", "-q", "--", ".")
    (project / "pkg/core.py").write_text("x = 1\n")
    assert selected() == {"core"}
    git(top, "checkout", "-q", "--", ".")
    (project / "pkg/ü.py").write_text("x = 1\n")
    (project / "tests/ä/test_new.py").write_text("")  # untracked
    assert changes.changed_files(project, "main") == (["pkg/ü.py", "tests/ä/test_new.py"], "")
    assert selected() == {"uni"}
    git(top, "checkout", "-q", "--", ".")
    (project / "tests/ä/test_new.py").unlink()
    (project / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    sel = changes.select(m.entries, *changes.changed_files(project, "main"))
    assert sel.everything, sel.reason


def test_a_root_in_a_submodule_runs_everything(tmp_path):
    # Regression: a project checked out as a submodule saw only its own history: a library
    # beside it in the superproject changed, and the change selected nothing (green).
    project = tmp_path / "project"
    project.mkdir()
    entries = [{"id": "core", "paths": ["tests"], "depends_on": ["pkg/**"]}]
    make_project(
        project,
        {"tests/test_a.py": "def test_a():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", entries)},
        {"pkg/a.py": ""},
    )
    commit_all(project)
    top = tmp_path / "super"
    (top / "libs").mkdir(parents=True)
    (top / "libs/x.py").write_text("a = 1\n")
    commit_all(top)
    file_ok = ("-c", "protocol.file.allow=always")
    git(top, *file_ok, "submodule", "-q", "add", str(project), "proj")
    git(top, "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", "sub")
    (top / "libs/x.py").write_text("a = 2\n")
    changed, why = changes.changed_files(top / "proj", "main")
    assert changed is None
    assert "is a submodule of" in why, why


def test_a_run_with_nothing_to_run_still_writes_its_report_files(pytester):
    # Regression: only summary.md was written; a CI step reading junit.xml or summary.json
    # (an upload, a test reporter) failed on a green run.
    tests = {"tests/a/test_a.py": "def test_a1():\n    pass\n"}
    entries = [{"id": "a", "paths": ["tests/a"], "depends_on": ["src/a.py"]}]
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", entries)},
        {"src/a.py": "", "README.md": "", ".gitignore": "out/\n"},
    )
    commit_all(root)
    (root / "README.md").write_text("docs only\n")
    done = harness(root, "run", "cpu", "--changed-from", "main", "--out", "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing to run" in (root / "out/summary.md").read_text()
    summary = json.loads((root / "out/summary.json").read_text())
    assert (summary["entries"], summary["cases"], summary["total"]["cases"]) == ([], [], 0)
    junit = ET.parse(root / "out/junit.xml").getroot()
    assert (junit.tag, junit.get("tests"), list(junit)) == ("testsuites", "0", [])


def test_matrix_changed_from_keeps_only_the_affected_shards(pytester, capsys):
    tests = {
        "tests/a/test_a.py": "def test_a1():\n    pass\n\ndef test_a2():\n    pass\n",
        "tests/b/test_b.py": "def test_b1():\n    pass\n\ndef test_b2():\n    pass\n",
    }
    entries = [
        {"id": "a", "paths": ["tests/a"], "depends_on": ["src/a.py"], "estimated_s": 10},
        {"id": "b", "paths": ["tests/b"], "depends_on": ["src/b.py"], "estimated_s": 20},
    ]
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", entries)},
        {"src/a.py": "", "src/b.py": "", "README.md": ""},
    )
    commit_all(root)

    said = []

    def matrix() -> dict:
        assert (
            main(["--root", str(root), "matrix", "cpu", "--shards", "2", "--changed-from", "main"])
            == 0
        )
        out = capsys.readouterr()
        said.append(out.err.splitlines()[-1])
        return json.loads(out.out)

    (root / "README.md").write_text("docs only\n")
    # Nothing selected: an empty matrix, for a job `if:` to skip (the required check still reports).
    assert matrix() == {"include": []}
    # Regression: the stderr line still planned the whole suite (4 cases in 2 shards).
    assert said[-1] == "harness matrix: cpu: 0 affected case(s) in 0 of 2 shard(s)"
    (root / "src/b.py").write_text("changed = True\n")
    rows = matrix()["include"]
    assert said[-1].startswith("harness matrix: cpu: 2 affected case(s) in 2 of 2 shard(s): 1/2 ")
    whole = {
        r["shard"]: r
        for r in json.loads(
            (
                main(["--root", str(root), "matrix", "cpu", "--shards", "2"]),
                capsys.readouterr().out,
            )[1]
        )["include"]
    }
    # LPT puts one case of each entry on each shard: both shards hold one of b's cases.
    assert [(r["shard"], r["cases"]) for r in rows] == [("1/2", 1), ("2/2", 1)]
    assert all(whole[r["shard"]]["cases"] == 2 for r in rows)


STRICT_CONFIG = """[tool.pytest.ini_options]
testpaths = ["tests"]
markers = ["mine: a registered marker"]
addopts = ["--strict-markers"]
xfail_strict = true
"""
STRICT_TESTS = {
    "tests/s/test_s.py": """
        import pytest

        @pytest.mark.mine
        def test_marked():
            pass

        @pytest.mark.xfail(reason="strict: a pass is a failure")
        def test_xpass():
            pass

        def test_other():
            pass
    """,
}


@pytest.mark.parametrize("form", ["space", "equals"])
def test_option_value_after_double_dash_keeps_the_project_configuration(
    pytester, tmp_path_factory, form
):
    # `--harness-lease-dir DIR` (space-separated) made pytest take DIR
    # for a path while looking for its configuration: --strict-markers and
    # xfail_strict were silently dropped; `--harness-lease-dir=DIR` worked.
    root = make_project(
        pytester.path,
        STRICT_TESTS,
        {"cpu": manifest("cpu", "cpu", [{"id": "s", "paths": ["tests/s"]}])},
        {"pyproject.toml": STRICT_CONFIG},
    )
    lease = tmp_path_factory.mktemp("leases")  # outside the project, as /tmp/harness-leases is
    lease_args = (
        ["--harness-lease-dir", str(lease)] if form == "space" else [f"--harness-lease-dir={lease}"]
    )
    done = harness(
        root,
        "run",
        "cpu",
        "--out",
        "out",
        "--",
        "-p",
        "no:xdist",
        "-k",
        "marked or xpass",
        *lease_args,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "configfile: pyproject.toml" in done.stdout
    results = {
        c["nodeid"].split("::")[1]: c["outcome"]
        for c in json.loads((root / "out/summary.json").read_text())["cases"]
    }
    assert results == {"test_marked": "passed", "test_xpass": "failed", "test_other": "deselected"}


def test_run_and_inventory_with_plugin_autoload_disabled(pytester):
    # With PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 the harness loads what it
    # needs itself (-p xdist, -p harness); before: "unrecognized arguments: -n".
    tests = {
        "tests/fast/test_f.py": "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
        **LAUNCHED,
    }
    root = make_project(
        pytester.path,
        tests,
        {
            "cpu": manifest(
                "cpu",
                "cpu",
                [
                    {"id": "fast", "paths": ["tests/fast"]},
                    {"id": "dist", "paths": ["tests/dist"], "timeout_s": 120},
                ],
            )
        },
    )
    env = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = harness(root, "inventory", "-q", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 case(s); per suite: cpu 3; 0 problem(s)" in done.stdout
    done = harness(root, "run", "cpu", "--out", "out", "--workers", "2", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = summary_rows((root / "out/summary.md").read_text())
    assert rows["total"][:5] == ["3", "3", "0", "0", "0"]
    assert "2 workers [3 items]" in done.stdout  # xdist was loaded and used


def test_changed_from_keeps_the_shards_of_the_whole_suite(pytester, capsys):
    # A shard job narrowed by --changed-from runs its share of the
    # matrix's partition of the whole suite, not a re-partition of the narrowed cases.
    tests = {
        "tests/a/test_a.py": "def test_a1():\n    pass\n",
        "tests/b/test_b.py": "def test_b1():\n    pass\n\ndef test_b2():\n    pass\n\ndef test_b3():\n    pass\n",
    }
    durations = {
        "durations": {
            "tests/a/test_a.py::test_a1": 10,
            "tests/b/test_b.py::test_b1": 3,
            "tests/b/test_b.py::test_b2": 3,
            "tests/b/test_b.py::test_b3": 3,
        }
    }
    entries = [
        {"id": "a", "paths": ["tests/a"], "depends_on": ["src/a.py"]},
        {"id": "b", "paths": ["tests/b"], "depends_on": ["src/b.py"]},
    ]
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", entries)},
        {
            "src/a.py": "",
            "src/b.py": "",
            ".gitignore": "out/\n",
            "suites/durations/cpu.json": durations,
        },
    )
    commit_all(root)
    (root / "src/b.py").write_text("changed = True\n")

    # The matrix: a1 alone on shard 1 (10 s), b1-b3 on shard 2 (9 s).
    assert main(["--root", str(root), "matrix", "cpu", "--shards", "2"]) == 0
    assert [s["cases"] for s in json.loads(capsys.readouterr().out)["include"]] == [1, 3]
    for shard, expected in (("1/2", []), ("2/2", ["test_b1", "test_b2", "test_b3"])):
        out = f"out/{shard[0]}"
        code = main(
            [
                "--root",
                str(root),
                "run",
                "cpu",
                "--shard",
                shard,
                "--changed-from",
                "main",
                "--out",
                out,
                "--",
                "-p",
                "no:xdist",
            ]
        )
        assert code == 0, capsys.readouterr()
        planned = json.loads((root / out / "plan.json").read_text())["cases"]
        assert [c.split("::")[1] for c, _ in planned] == expected


def test_hung_plain_case_is_stopped_by_the_backstop(pytester):
    tests = {
        # It swallows pytest-timeout's interruption at its deadline: only stopping its
        # worker ends it.
        "tests/h/test_h.py": "import time\n\ndef test_hang():\n    while True:\n        try:\n"
        "            time.sleep(120)\n        except BaseException:\n            pass\n\n"
        "def test_ok():\n    pass\n"
    }
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", [{"id": "h", "paths": ["tests/h"], "timeout_s": 1}])},
    )
    done = harness(root, "run", "cpu", "--out", "out", timeout=90)
    assert done.returncode == 1, done.stdout + done.stderr
    assert summary_rows((root / "out/summary.md").read_text())["h"][:4] == ["2", "1", "1", "0"]
    assert (
        "- backstop: tests/h/test_h.py::test_hang: stopped 2 s after it started, past its "
        "deadline; stacks in" in done.stdout
    )
    (log,) = (root / "out").glob("backstop-*.log")
    assert "Timeout (0:00:02)!" in log.read_text()
    assert "in test_hang" in log.read_text()


def test_run_refuses_a_suite_with_problems(pytester):
    root = make_project(
        pytester.path,
        RUN_TESTS,
        {"cpu": manifest("cpu", "cpu", [*CPU_ENTRIES, {"id": "ghost", "paths": ["tests/none"]}])},
    )
    done = harness(root, "run", "cpu")
    assert done.returncode == 2
    assert "[entry-matches-nothing]" in done.stderr
    assert "see `harness inventory cpu`" in done.stderr
    # A narrow run plans what its paths collect: a rule that needs the whole suite is not
    # judged there (the run's own collection is the plan's; `harness inventory` judges it).
    done = harness(root, "run", "cpu", "--", "tests/fast")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "entry-matches-nothing" not in done.stderr
    assert "cannot be planned" not in done.stderr


@pytest.mark.parametrize(
    ("entries", "shard"),
    [
        ([*CPU_ENTRIES, {"id": "ghost", "paths": ["tests/none"]}], []),
        ([{**CPU_ENTRIES[0], "estimated_s": 3600}, CPU_ENTRIES[1]], []),
        ([{**CPU_ENTRIES[0], "estimated_s": 3600}, CPU_ENTRIES[1]], ["--shard", "1/1"]),
    ],
    ids=["inventory-problem", "case-over-budget", "case-over-budget-shard"],
)
def test_unplannable_suite_gives_the_same_code_from_run_and_matrix(
    pytester, capsys, entries, shard
):
    # `run` said 2 and `matrix` 1 for a suite with inventory problems;
    # a case over its runner's budget stopped the matrix but ran under `run`.
    root = make_project(pytester.path, RUN_TESTS, {"cpu": manifest("cpu", "cpu", entries)})
    codes = {
        "run": main(["--root", str(root), "run", "cpu", *shard]),
        "matrix": main(
            ["--root", str(root), "matrix", "cpu", *(["--shards", "1"] if shard else [])]
        ),
    }
    assert codes == {"run": 2, "matrix": 2}, capsys.readouterr()
    # The run's own collection found the problems: no case ran, no summary was written.
    assert not list(root.glob("out/**/summary.md"))


def test_matrix_uses_checked_in_durations(pytester, capsys):
    tests = {
        "tests/t/test_t.py": "import pytest\n\n@pytest.mark.parametrize('i', range(6))\ndef test_t(i):\n    pass\n"
    }
    durations = {
        "durations": {
            f"tests/t/test_t.py::test_t[{i}]": s for i, s in enumerate([50, 10, 10, 10, 10, 10])
        }
    }
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", [{"id": "t", "paths": ["tests/t"]}])},
        {"suites/durations/cpu.json": durations},
    )
    assert main(["--root", str(root), "matrix", "cpu", "--shards", "2"]) == 0
    out = capsys.readouterr()
    matrix = json.loads(out.out)
    assert [(x["shard"], x["cases"]) for x in matrix["include"]] == [("1/2", 1), ("2/2", 5)]
    assert "longest/mean 1.000" in out.err

    assert main(["--root", str(root), "matrix", "cpu", "--target-minutes", "0.9"]) == 0
    assert len(json.loads(capsys.readouterr().out)["include"]) == 2
    assert (
        main(["--root", str(root), "matrix", "cpu", "--target-minutes", "0.5"]) == 2
    )  # unplannable: as from run
    assert "over --target-minutes 0.5" in capsys.readouterr().err


def test_matrix_shards_over_budget_prints_the_plan_and_a_warning(pytester, capsys):
    # Regression: `harness matrix --shards N` over the runner's budget refused the count.
    entries = [{"id": "t", "paths": ["tests/t"], "estimated_s": 200}]
    tests = {
        "tests/t/test_t.py": "import pytest\n\n@pytest.mark.parametrize('i', range(4))\ndef test_t(i):\n    pass\n"
    }
    runner = {"labels": ["ubuntu-latest"], "cards": 0, "timeout_minutes": 10}  # 7.5-min budget
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries, runner)})
    assert main(["--root", str(root), "matrix", "cpu", "--shards", "1"]) == 0
    out = capsys.readouterr()
    assert [(x["shard"], x["cases"]) for x in json.loads(out.out)["include"]] == [("1/1", 4)]
    assert "warning: shard 1/1 is planned at 13.3 min, over the 7.5-min budget" in out.err
    assert main(["--root", str(root), "matrix", "cpu", "--shards", "2"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["matrix", "run"])
def test_numbers_that_are_not_numbers_stop_before_planning(pytester, capsys, command):
    # NaN / Infinity used to print invalid matrix JSON or fail every launched case.
    doc = json.dumps(
        manifest(
            "cpu", "cpu", [{"id": "t", "paths": ["tests/t"], "estimated_s": 1, "timeout_s": 60}]
        )
    )
    doc = doc.replace('"estimated_s": 1', '"estimated_s": NaN').replace(
        '"timeout_s": 60', '"timeout_s": Infinity'
    )
    root = make_project(
        pytester.path, {"tests/t/test_t.py": "def test_t():\n    pass\n"}, {"cpu": doc}
    )
    assert main(["--root", str(root), command, "cpu"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "suites/cpu.json: [json] not valid JSON: NaN is not a finite number" in out.err


def test_matrix_refuses_non_finite_recorded_durations(pytester, capsys):
    root = make_project(
        pytester.path,
        {"tests/t/test_t.py": "def test_t():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", [{"id": "t", "paths": ["tests/t"]}])},
        {"suites/durations/cpu.json": '{"durations": {"tests/t/test_t.py::test_t": Infinity}}'},
    )
    assert main(["--root", str(root), "matrix", "cpu"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "suites/durations/cpu.json: " in out.err
    assert "Infinity is not a finite number" in out.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["matrix", "cpu", "--shards", "0"], "--shards: expected an integer >= 1, got '0'"),
        (
            ["matrix", "cpu", "--target-minutes", "nan"],
            "--target-minutes: expected a finite number > 0, got 'nan'",
        ),
        (
            ["matrix", "cpu", "--target-minutes", "inf"],
            "--target-minutes: expected a finite number > 0, got 'inf'",
        ),
        (["run", "cpu", "--workers", "0"], "--workers: expected an integer >= 1, got '0'"),
        (["run", "cpu", "--max-cards", "-1"], "--max-cards: expected an integer >= 0, got '-1'"),
        (["run", "cpu", "--shard", "3/2"], "--shard 3/2: need 1 <= I <= N"),
        # An empty shard (an unset matrix variable) ran the whole suite, green.
        (["run", "cpu", "--shard", ""], "--shard takes I/N, e.g. 2/4; got ''"),
        (["run", "cpu", "--shard", "+1/2"], "--shard takes I/N, e.g. 2/4; got '+1/2'"),
        # A file as the output folder was a FileExistsError traceback.
        (["run", "cpu", "--out", "pyproject.toml"], "pyproject.toml is not a folder"),
        # A folder that cannot be made or written was an OSError traceback, exit 1.
        (["run", "cpu", "--out", "pyproject.toml/sub"], "cannot make the output folder"),
        (["run", "cpu", "--out", "/proc/harness-out"], "cannot make the output folder"),
        (["matrix", "cpu", "--shards", ""], "--shards: expected an integer >= 1, got ''"),
        (["inventory", "--bogus"], "unrecognized arguments: --bogus"),
        (["matrix", "cpu", "--", "-x"], "only `harness run` takes pytest arguments"),
    ],
)
def test_usage_errors_exit_2_everywhere(pytester, capsys, args, message):
    # Usage errors exit 2 whatever the subcommand, naming the option and the value.
    root = make_project(
        pytester.path,
        {"tests/t/test_t.py": "def test_t():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", [{"id": "t", "paths": ["tests/t"]}])},
    )
    try:
        code = main(["--root", str(root), *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_version_names_the_distribution(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("harness ")
    assert out.strip() != "harness"


def test_pytest_args_only_for_run(capsys):
    with pytest.raises(SystemExit) as info:
        main(["matrix", "cpu", "--", "-x"])
    assert info.value.code == 2


# --------------------------------------------------------------------------- report


@pytest.mark.parametrize(
    "nodeid",
    [
        "tests/a/test_x.py::test_y",
        "tests/test_x.py::TestC::test_m[cuda-2]",
        "t.py::test_p[a::b/c.py]",
        "x/test_z.py",
    ],
)
def test_junit_key_matches_pytest(nodeid):
    from _pytest.junitxml import mangle_test_address

    names = mangle_test_address(nodeid)
    assert report.junit_key(nodeid) == (".".join(names[:-1]), names[-1])


def test_read_junit_outcomes_and_missing(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="t.test_a" name="test_f" time="2"><failure message="boom&#10;more"/></testcase>'
        '<testcase classname="t.test_a" name="test_e" time="0"><error message="teardown"/></testcase>'
        '<testcase classname="t.test_a" name="test_s" time="0"><skipped message="no card"/></testcase>'
        "</testsuite></testsuites>"
    )
    ids = [f"t/test_a.py::{n}" for n in ("test_ok", "test_f", "test_e", "test_s", "test_gone")]
    junit = report.read_junit([xml, tmp_path / "absent.xml"])
    res = {n: junit[k] for n in ids if (k := report.junit_key(n)) in junit}
    assert [r.outcome for r in res.values()] == ["passed", "failed", "failed", "skipped"]
    assert ids[4] not in res
    assert res[ids[1]].message == "boom"
    assert res[ids[0]].seconds == 1.5


def test_wall_shares_of_cases_pytest_timed_at_zero(tmp_path):
    # Regression: quick cases pytest timed at 0.000 s got a share of 0.0 s of their run's
    # wall time (the planner then took them as free).
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" time="2.0">'
        '<testcase classname="t.test_a" name="test_1" time="0.000"/>'
        '<testcase classname="t.test_a" name="test_2" time="0.000"/>'
        '</testsuite><testsuite name="harness run" time="0">'
        '<testcase classname="t.test_a" name="test_3" time="0"><skipped message="not run"/></testcase>'
        "</testsuite></testsuites>"
    )
    shares = report.read_junit([xml], wall_shares=True)
    assert {k[1]: r.seconds for k, r in shares.items()} == {"test_1": 1.0, "test_2": 1.0}


# --------------------------------------------------------------------------- workers


def test_workers_sized_to_slots_and_leasable_cards(monkeypatch):
    # Sized before anything is collected (the run's one collection is pytest's own): the
    # process slots, and on accelerators the leasable cards; a wider case waits for its lease.
    monkeypatch.setenv("HARNESS_CARDS", "cuda:0,1,2,3")
    assert worker_count("cuda", ["--harness-max-procs", "16"]) == 4
    assert worker_count("cuda", ["--harness-max-procs=2"]) == 2  # nor more than slots
    monkeypatch.setenv("HARNESS_CARDS", "none")
    assert worker_count("cuda", ["--harness-max-procs", "16"]) == 1
    assert worker_count("cpu", ["--harness-max-procs", "3"]) == 3
    assert worker_count("cpu", [], requested=5) == 5
    # Named cases only: no more workers than cases (a rerun of one case starts one worker).
    wide = ["--harness-max-procs", "4"]
    assert worker_count("cpu", [*wide, "t/test_a.py::test_x"]) == 1
    assert worker_count("cpu", [*wide, "t/a.py::x", "t/b.py::C::y[p::q]"]) == 2
    assert worker_count("cpu", [*wide, "t/a.py::x", "t/b.py"]) == 4  # a path: unknown
    assert worker_count("cpu", [*wide, "-k", "x", "t/a.py::x"]) == 1  # -k's value
    assert worker_count("cpu", ["t/a.py::x"], requested=3) == 3


def test_run_sizes_workers_to_its_largest_case(pytester, tmp_path_factory):
    # `harness run cpu` on 2 slots used -n 2 with 2-rank cases, so one worker waited for
    # the other's slots until its lease timed out. Workers are sized before collection now
    # (2 slots: 2 workers): the second 2-rank case waits for its lease, head of the queue.
    body = "".join(
        f"\n\n@pytest.mark.launch(nproc=2)\ndef test_r{i}():\n    import torch.distributed as dist\n"
        f"    assert dist.get_world_size() == 2\n"
        for i in range(2)
    )
    root = make_project(
        pytester.path,
        {"tests/r/test_r.py": "import pytest" + body},
        {"cpu": manifest("cpu", "cpu", [{"id": "r", "paths": ["tests/r"], "timeout_s": 120}])},
    )
    lease = tmp_path_factory.mktemp("leases")
    done = harness(
        root,
        "run",
        "cpu",
        "--out",
        "out",
        "--",
        "--harness-max-procs",
        "2",
        f"--harness-lease-dir={lease}",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "up to 2 xdist worker(s)" in done.stdout
    assert summary_rows((root / "out/summary.md").read_text())["total"][:3] == ["2", "2", "0"]


def test_a_wide_case_runs_beside_the_others_in_one_pytest(pytester, tmp_path_factory):
    # The widest case no longer runs in a pytest process of its own: it waits for its slots
    # while the plain cases run on the run's two workers.
    body = (
        "import pytest\n\n@pytest.mark.launch(nproc=2)\ndef test_wide():\n"
        "    import torch.distributed as dist\n    assert dist.get_world_size() == 2\n"
        + "".join(f"\n\ndef test_plain_{i}():\n    pass\n" for i in range(3))
    )
    root = make_project(
        pytester.path,
        {"tests/w/test_w.py": body},
        {"cpu": manifest("cpu", "cpu", [{"id": "w", "paths": ["tests/w"]}])},
    )
    lease = tmp_path_factory.mktemp("leases")
    args = ["--harness-max-procs", "2", f"--harness-lease-dir={lease}"]
    done = harness(root, "run", "cpu", "--out", "out", "--", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "up to 2 xdist worker(s)" in done.stdout
    assert summary_rows((root / "out/summary.md").read_text())["total"][:3] == ["4", "4", "0"]


# --------------------------------------------------------------------------- the real repository


def test_real_repository_inventory_is_clean_and_fast():
    done = subprocess.run(
        [sys.executable, "-m", "harness", "inventory", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 problem(s)" in done.stdout


def test_a_new_subcommand_declares_its_own_root_and_pytest_arguments(tmp_path, monkeypatch, capsys):
    # A subcommand is its `_add_<name>` function alone: how it finds the repository root
    # and whether it takes pytest arguments are its parser's defaults, not cases in main().
    from harness.suites import cli

    seen = {}

    def handler(root, args):
        seen.update(root=root, pytest_args=args.pytest_args)
        return 0

    def add_probe(sub):
        probe = sub.add_parser("probe")
        probe.set_defaults(handler=handler, root_is_cwd=True, takes_pytest_args=True)

    def add_plain(sub):
        sub.add_parser("plain").set_defaults(handler=handler)

    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, add_probe, add_plain])
    monkeypatch.chdir(tmp_path)  # no suites/ here or above
    assert main(["probe", "-x", "--", "-k", "a"]) == 0
    assert seen == {"root": tmp_path.resolve(), "pytest_args": ["-x", "-k", "a"]}
    with pytest.raises(SystemExit) as raised:
        main(["plain", "-x"])
    assert raised.value.code == 2
    assert "unrecognized arguments: -x" in capsys.readouterr().err


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "harness" / "pyproject.toml").read_text())


@pytest.mark.parametrize("how", ["console_script", "python_-m"])
@pytest.mark.parametrize(
    ("absent", "command"),
    [(["psutil"], "run"), (["psutil", "jsonschema"], "run"), (["jsonschema"], "inventory")],
)
def test_a_missing_dependency_is_named_not_a_traceback(tmp_path, how, absent, command):
    # An environment that has the harness but not its dependencies (a source tree on
    # PYTHONPATH, `pip install --no-deps`): sys.modules[name] = None hides a module from
    # both import and importlib.util.find_spec, as an uninstalled one is.
    hide = "".join(f"sys.modules[{name!r}] = None\n" for name in absent)
    (tmp_path / "sitecustomize.py").write_text(f"import sys\n{hide}")
    if how == "console_script":
        module, _, func = _pyproject()["project"]["scripts"]["harness"].partition(":")
        cmd = [
            sys.executable,
            "-c",
            f"import sys; from {module} import {func}; raise SystemExit({func}([{command!r}]))",
        ]
    else:
        cmd = [sys.executable, "-m", "harness", command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"missing {'dependency' if len(absent) == 1 else 'dependencies'}" in lines[0]
    for name in absent:
        assert name in lines[0]
    assert "pip install ./harness" in lines[0]


def test_the_dependency_check_is_what_the_command_imports():
    # Exactly the declared dependencies that importing the command loads: one more (torch,
    # pytest-xdist) would refuse commands that work without it, one fewer would let an
    # ImportError traceback through.
    from harness.suites.entry import REQUIREMENTS, RUN_REQUIREMENTS

    declared = {
        re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0].lower()
        for spec in _pyproject()["project"]["dependencies"]
    }
    modules = {"pytest-xdist": "xdist", "pytest-timeout": "pytest_timeout"}
    probe = (
        "import sys, harness.suites.cli\n"
        f"print(' '.join(d for d in {sorted(declared)!r} if {modules!r}.get(d, d) in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert {dist for _, dist in REQUIREMENTS} == set(done.stdout.split())
    assert {(modules.get(d, d), d) for d in done.stdout.split()} == set(REQUIREMENTS)
    # `harness run` also needs psutil and junitparser, imported where used (not by the
    # import above), and pytest-timeout and pytest-rerunfailures, which the run's pytest
    # loads (each planned case's deadline, flaky entries' reruns).
    run_only = {"psutil", "pytest-timeout", "junitparser", "pytest-rerunfailures"}
    assert {dist for _, dist in RUN_REQUIREMENTS} == run_only <= declared


def test_inventory_and_run_need_neither_torch_nor_xdist(tmp_path):
    # The check refused them with "missing dependencies pytest-xdist, psutil, torch" where
    # only psutil was missing; without torch or xdist both work (run serially).
    root = make_project(
        tmp_path,
        {"tests/plain/test_p.py": "def test_ok():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", [{"id": "plain", "paths": ["tests/plain"]}])},
    )
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import sys\nsys.modules['torch'] = None\nsys.modules['xdist'] = None\n"
    )
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
        # an uninstalled xdist has no entry point either
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    done = harness(root, "inventory", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 case(s)" in done.stdout
    done = harness(root, "run", "cpu", "--out", "out", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary_rows((root / "out/summary.md").read_text())["total"][:3] == ["1", "1", "0"]

    # Without psutil the inventory works too (it failed with "missing dependency psutil");
    # `harness run`, which stops process trees with it, says it is missing.
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import sys\nfor name in ('torch', 'xdist', 'psutil'):\n    sys.modules[name] = None\n"
    )
    done = harness(root, "inventory", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 case(s)" in done.stdout
    done = harness(root, "run", "cpu", "--out", "out", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("harness: missing dependency psutil"), done.stderr

    # Regression: without junitparser, which only harness run's JUnit needs, the inventory
    # failed ("missing dependencies junitparser").
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import sys\nfor name in ('torch', 'xdist', 'junitparser'):\n    sys.modules[name] = None\n"
    )
    done = harness(root, "inventory", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 case(s)" in done.stdout
    done = harness(root, "run", "cpu", "--out", "out", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("harness: missing dependency junitparser"), done.stderr


@pytest.mark.parametrize("args", [["inventory", "--cases"], ["--version"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path, args):
    # Regression: `harness inventory --cases | head -1` ended in a BrokenPipeError traceback.
    root = make_project(
        tmp_path,
        {"tests/plain/test_p.py": "def test_ok():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", [{"id": "plain", "paths": ["tests/plain"]}])},
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # the reader is gone before anything is written
    try:
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in err, err
    assert "BrokenPipeError" not in err, err
    assert code == 128 + signal.SIGPIPE, err  # as a shell shows a process SIGPIPE killed


def test_a_closed_stdout_is_no_traceback(tmp_path):
    # Regression: with stdout closed (`>&-`, sys.stdout None) the flush added for `| head`
    # raised AttributeError.
    root = make_project(
        tmp_path,
        {"tests/plain/test_p.py": "def test_ok():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", [{"id": "plain", "paths": ["tests/plain"]}])},
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -m harness inventory >&-'],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", [["inventory", "-q"], ["matrix", "cpu"], ["init"]])
def test_root_goes_before_or_after_the_subcommand(pytester, capsys, command):
    # Regression: `harness init` refused in a subfolder with "(or pass --root DIR)", and
    # `harness init --root DIR` was "unrecognized arguments: --root".
    root = make_project(
        pytester.path,
        {"tests/t/test_t.py": "def test_t():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", [{"id": "t", "paths": ["tests/t"]}])},
        {".gitignore": "out/\n"},  # else init's first run appends it, and the second does not
    )
    outputs = []
    for args in (["--root", str(root), *command], [*command, "--root", str(root)]):
        code = main(args)
        outputs.append((code, *capsys.readouterr()))
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == 0, outputs[0]
    if command == ["init"]:  # it finds the manifest written by hand, not its own: keeps it
        assert "suites/cpu.json exists with other content: kept as it is" in outputs[0][2]
