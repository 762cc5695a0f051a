"""Launched cases under plain ``pytest -n 2``: real xdist sessions, real ranks.

With two workers and process slots for one 2-rank pool, the launched cases
must all run in one worker, on one kept pool (its ranks' pids are the same for
every case), under ``--dist`` ``load``, ``loadscope`` and ``loadfile``; plain
tests still go to either worker, except that a scope distribution keeps a
file's plain tests with its launched cases. Ranks record their worker and pid,
and the JUnit properties say which case of its pool each one was.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from launch_project import inner_env, run_session, write_project

from harness.launcher.routing import concurrent_lanes
from harness.spec import LaunchSpec

LAUNCHED = """
    import json
    import os

    import pytest

    from recording import out_dir

    @pytest.mark.launch(nproc=2)
    @pytest.mark.parametrize("i", range({cases}))
    def test_launched(i):
        import torch.distributed as dist

        record = {{"worker": os.environ["PYTEST_XDIST_WORKER"], "pid": os.getpid()}}
        (out_dir() / f"{name}-{{i}}-{{dist.get_rank()}}.json").write_text(json.dumps(record))


    def test_plain():
        (out_dir() / "plain-{name}.json").write_text(os.environ["PYTEST_XDIST_WORKER"])
"""


def launched_file(name: str, cases: int) -> str:
    return LAUNCHED.format(name=name, cases=cases)


def junit_properties(path) -> dict[str, dict[str, str]]:
    """Each test's JUnit <properties> by ``classname::name``."""
    found = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        found[f"{tc.get('classname')}::{tc.get('name')}"] = props
    return found


def _session(tmp_path, dist):
    root = write_project(
        tmp_path / "project",
        {"test_a.py": launched_file("a", 3), "test_b.py": launched_file("b", 3)},
    )
    args = ["-n", "2", "--harness-max-procs=2", "-p", "no:randomly"]
    session = run_session(
        root,
        *args,
        *(["--dist", dist] if dist else []),
        env=inner_env(root / "out", root / "leases"),
    )
    assert session.returncode == 0, session.output
    ranks = [json.loads(p.read_text()) for p in (root / "out").glob("[ab]-*.json")]
    assert len(ranks) == 12, session.output
    return root, ranks


@pytest.mark.parametrize("dist", [None, "loadscope", "loadfile"])
def test_launched_cases_run_in_one_worker_on_one_pool_under_n_2(tmp_path, dist):
    root, ranks = _session(tmp_path, dist)
    assert len({r["worker"] for r in ranks}) == 1, ranks
    assert len({r["pid"] for r in ranks}) == 2, ranks  # the same two ranks for all six cases
    kept = sorted(
        props["harness.ranks"]
        for name, props in junit_properties(root / "junit.xml").items()
        if "test_launched" in name
    )
    assert kept == sorted(f"kept (case {k} of its pool)" for k in range(1, 7)), kept
    if dist is not None:
        # The scope distributions' promise holds: each file's plain test ran
        # on the worker of its launched cases (one lane takes whole files).
        worker = ranks[0]["worker"]
        assert (root / "out" / "plain-a.json").read_text() == worker
        assert (root / "out" / "plain-b.json").read_text() == worker


def test_lanes_are_the_pools_of_the_widest_case_that_fit_at_once(monkeypatch):
    cpu2, cpu1 = LaunchSpec(nproc=2), LaunchSpec(nproc=1)
    assert concurrent_lanes([cpu2] * 5, slots=2) == 1
    assert concurrent_lanes([cpu2, cpu1], slots=4) == 2
    assert concurrent_lanes([cpu1], slots=3) == 3
    # A case wider than the host holds nothing (it fails its lease at once).
    assert concurrent_lanes([LaunchSpec(nproc=8), cpu1], slots=2) == 2
    monkeypatch.setenv("HARNESS_CARDS", "cuda:0,1,2,3")
    cuda2 = LaunchSpec(device="cuda", nproc=2)
    assert concurrent_lanes([cuda2, cpu1], slots=16) == 2
    # Cases this host has no cards for skip: they do not narrow the lanes.
    assert concurrent_lanes([LaunchSpec(device="npu", nproc=2), cpu1], slots=2) == 2


CRASHING = """
    import os
    import signal

    import pytest


    @pytest.fixture
    def kill_worker():
        os.kill(os.getpid(), signal.SIGKILL)


    @pytest.mark.launch(nproc=2)
    def test_a():
        pass


    @pytest.mark.launch(nproc=2)
    def test_die(kill_worker):
        pass


    @pytest.mark.launch(nproc=2)
    def test_z():
        pass


    def test_plain():
        pass
"""


def test_a_case_that_crashes_its_worker_runs_once_and_its_lane_goes_on(tmp_path):
    # Regression: the lane went back to the queue with its crashed case still pending,
    # so every new worker ran it (and crashed) again until xdist gave up on crashed
    # workers; test_z, after it in the lane, never ran.
    root = write_project(tmp_path / "project", {"test_lane.py": CRASHING})
    session = run_session(
        root,
        "-n",
        "2",
        "--harness-max-procs=2",
        "-p",
        "no:randomly",
        env=inner_env(root / "out", root / "leases"),
    )
    assert session.returncode == 1, session.output
    assert "maximum crashed workers reached" not in session.output, session.output
    reports = [tc.get("name") for tc in ET.parse(root / "junit.xml").getroot().iter("testcase")]
    assert sorted(reports) == ["test_a", "test_die", "test_plain", "test_z"], session.output
    assert session.case("test_die").status in ("failed", "error"), session.output
    for name in ("test_a", "test_z", "test_plain"):
        assert session.case(name).status == "passed", (name, session.output)
