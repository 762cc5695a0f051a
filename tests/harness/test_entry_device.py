"""A plain test of an accelerator suite entry under ``harness run``: it runs in a process of
its own with exactly its leased cards visible, to it and to what it starts; two at once
never share a card; the entry's ``env`` reaches every case of the entry, ranks and their
children included. Real ``harness run`` processes on simulated cards (``HARNESS_CARDS``)."""

from __future__ import annotations

import json
from pathlib import Path

from suite_project import GPU_RUNNER, make_project, manifest
from test_cli import harness

PROBE = """
    import json, os, subprocess, sys, time
    from pathlib import Path

    CHILD = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('PROBE_FLAG'))"


    def probe(name, launcher_pid):
        # A plain test as a suite whose tests pick the device at run time writes it:
        # no harness marker, no device parameter.
        out = Path(os.environ["PROBE_OUT"])
        (out / f"{name}.start").touch()
        end = time.monotonic() + 60  # wait for the other case: the two run at once
        while len(list(out.glob("*.start"))) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        child = subprocess.run(
            [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True
        ).stdout.split()
        seen = {
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "flag": os.environ.get("PROBE_FLAG"),
            "child": child,
            "pid": os.getpid(),
            "launcher": launcher_pid,
            "together": len(list(out.glob("*.start"))),
        }
        time.sleep(0.5)  # still holding its cards while the other looks
        (out / f"{name}.json").write_text(json.dumps(seen))


    def test_one(launcher_pid):
        probe("one", launcher_pid)


    def test_two(launcher_pid):
        probe("two", launcher_pid)
"""

UNITTEST = """
    import json, os, subprocess, sys, unittest
    from pathlib import Path

    CHILD = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"


    class TestStartsItsOwnRanks(unittest.TestCase):
        # A unittest method cannot run apart: it runs in the pytest process, and what it
        # starts (a MultiProcessTestCase's ranks) sees exactly its leased cards.
        def test_child(self):
            child = subprocess.run(
                [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True
            ).stdout.strip()
            seen = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "child": child}
            (Path(os.environ["PROBE_OUT"]) / "unit.json").write_text(json.dumps(seen))
"""

CONFTEST = """
    import os

    import pytest


    @pytest.fixture
    def launcher_pid():
        return os.getpid()  # set up in the pytest process, as a launched case's fixtures are
"""


def test_plain_cases_of_a_cuda_entry_see_exactly_their_own_leased_cards(pytester, tmp_path):
    probe_out = tmp_path / "probe"
    probe_out.mkdir()
    entry = {
        "id": "probe",
        "paths": ["tests/gpu"],
        "device": "cuda",
        "cards": 2,
        "env": {"PROBE_OUT": str(probe_out), "PROBE_FLAG": "from-the-entry"},
    }
    root = make_project(
        pytester.path,
        {
            "tests/gpu/test_probe.py": PROBE,
            "tests/gpu/test_unit.py": UNITTEST,
            "tests/gpu/conftest.py": CONFTEST,
        },
        {"gpu": manifest("gpu", "cuda", [entry], {**GPU_RUNNER, "cards": 4})},
    )
    env = {"HARNESS_CARDS": "cuda:0,1,2,3", "HARNESS_LEASE_DIR": str(tmp_path / "leases")}
    # Fewer cases than twice the workers: xdist deals them out one by one, so test_one and
    # test_two start on different workers, at the same time.
    done = harness(root, "run", "gpu", "--workers", "2", "--out", "out", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {n: json.loads((probe_out / f"{n}.json").read_text()) for n in ("one", "two")}
    cards = {}
    for name, s in seen.items():
        assert s["together"] == 2, s  # the two cases ran at the same time
        assert s["pid"] != s["launcher"], s  # in a process of its own
        visible = s["visible"].split(",")
        assert len(visible) == 2, s
        assert set(visible) <= {"0", "1", "2", "3"}, s
        assert s["child"] == [s["visible"], "from-the-entry"], s  # what it starts sees the same
        assert s["flag"] == "from-the-entry"
        cards[name] = set(visible)
    assert not cards["one"] & cards["two"], cards  # exclusive while it runs
    unit = json.loads((probe_out / "unit.json").read_text())
    assert len(unit["visible"].split(",")) == 2, unit
    assert unit["child"] == unit["visible"], unit
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert {c["nodeid"]: c["outcome"] for c in summary["cases"]} == {
        "tests/gpu/test_probe.py::test_one": "passed",
        "tests/gpu/test_probe.py::test_two": "passed",
        "tests/gpu/test_unit.py::TestStartsItsOwnRanks::test_child": "passed",
    }


LAUNCHED = """
    import os, subprocess, sys

    import pytest

    CHILD = "import os; print(os.environ['PROBE_FLAG'])"


    @pytest.mark.launch(nproc=2)
    def test_ranks_and_their_children_see_the_entry_env():
        assert os.environ["PROBE_FLAG"] == "from-the-entry"
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
        assert out.stdout.strip() == "from-the-entry"


    def test_in_process_case_sees_it_too():
        assert os.environ["PROBE_FLAG"] == "from-the-entry"


    def test_another_entry_does_not():
        assert "PROBE_FLAG" not in os.environ
"""


def test_entry_env_reaches_launched_ranks_and_plain_cases_of_that_entry_only(pytester, tmp_path):
    with_env = {
        "id": "env",
        "paths": ["tests/test_l.py::test_ranks_and_their_children_see_the_entry_env"],
        "env": {"PROBE_FLAG": "from-the-entry"},
    }
    in_process = {
        "id": "here",
        "paths": ["tests/test_l.py::test_in_process_case_sees_it_too"],
        "env": {"PROBE_FLAG": "from-the-entry"},
    }
    rest = {"id": "rest", "paths": ["tests"]}
    root = make_project(
        pytester.path,
        {"tests/test_l.py": LAUNCHED},
        {"cpu": manifest("cpu", "cpu", [with_env, in_process, rest])},
    )
    env = {"HARNESS_LEASE_DIR": str(tmp_path / "leases")}
    # One worker: the case without the entry's env runs in the process the others ran in.
    done = harness(root, "run", "cpu", "--workers", "1", "--out", "out", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((Path(root) / "out" / "summary.json").read_text())
    assert {c["outcome"] for c in summary["cases"]} == {"passed"}, summary["cases"]


def test_a_case_run_apart_is_stopped_at_its_deadline_not_at_the_start_bound(
    pytester, tmp_path, monkeypatch
):
    # Regression: the process of a plain case run apart never said it was ready, so its
    # deadline never began: it ran on under the bound on starting ranks (300 s) and a body
    # past its deadline passed.
    pytester.makepyfile(
        """
        import time

        import pytest


        @pytest.mark.harness_device(device="cuda", cards=1)
        def test_slow():
            time.sleep(8)
        """
    )
    monkeypatch.setenv("HARNESS_CARDS", "cuda:0")
    monkeypatch.setenv("HARNESS_LEASE_DIR", str(tmp_path / "leases"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--harness-timeout", "2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*still running at the 2 s deadline (--harness-timeout)*"])
