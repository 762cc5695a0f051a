"""Every case contained, plain ones too: a process a case leaves running after its
teardown (a ``setsid`` daemon, a multiprocessing child and what it started) is stopped
when that case ends and reported against it, naming its pid and command line; ini
``harness_leaks = fail`` fails the case. Real inner pytest sessions (plain, under xdist),
real processes; the next case and the outer test look for the pids.
"""

from __future__ import annotations

import contextlib
import os
import signal
import xml.etree.ElementTree as ET

import pytest
from launch_project import inner_env, read_pids, run_session, survivors, write_project

# The leaking case records its child's pid; the case after it (same file, so the same
# xdist worker under --dist loadfile) records whether that pid was still running.
LEAKS = """
    import os
    import subprocess
    import sys

    import psutil

    from recording import out_dir, record_pid

    SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


    def running(name):
        pid = int((out_dir() / f"{name}.pid").read_text())
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


    def test_leaks_a_daemon():
        child = subprocess.Popen(SLEEPER, start_new_session=True)
        record_pid("daemon", child.pid)


    def test_next_sees_it_gone():
        assert not running("daemon"), "the daemon outlived the case that started it"


    def test_waits_for_its_children():
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        child = subprocess.Popen(SLEEPER, start_new_session=True)
        child.terminate()
        child.wait()
"""

TREE = """
    import multiprocessing
    import multiprocessing.resource_tracker
    import os
    import subprocess
    import time

    import psutil

    from recording import out_dir, record_pid


    def parent(out):
        grandchild = subprocess.Popen(["sleep", "600"])
        (out / "tree-child.pid").write_text(str(os.getpid()))
        (out / "tree-grandchild.pid").write_text(str(grandchild.pid))
        time.sleep(600)


    def test_leaks_a_tree():
        # As torch's mp.spawn(join=False) does: a spawned child that starts its own.
        ctx = multiprocessing.get_context("spawn")
        ctx.Process(target=parent, args=(out_dir(),)).start()
        deadline = time.monotonic() + 60
        while not (out_dir() / "tree-grandchild.pid").exists():
            assert time.monotonic() < deadline, "the tree never started"
            time.sleep(0.05)


    def test_joins_its_multiprocessing_child():
        # The resource tracker this starts is multiprocessing's, kept for the process's life.
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=time.sleep, args=(0.1,))
        proc.start()
        proc.join()
        record_pid("tracker", multiprocessing.resource_tracker._resource_tracker._pid)


    def test_next_sees_the_tree_gone():
        for name in ("tree-child", "tree-grandchild"):
            pid = int((out_dir() / f"{name}.pid").read_text())
            gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
            assert gone, f"{name} outlived the case that started it"
"""

FIXTURE = """
    import subprocess

    import pytest

    from recording import record_pid


    @pytest.fixture(scope="module")
    def server():
        proc = subprocess.Popen(["sleep", "600"])
        record_pid("server", proc.pid)
        yield proc
        proc.kill()
        proc.wait()


    @pytest.fixture(scope="module")
    def forgotten():
        proc = subprocess.Popen(["sleep", "601"])
        record_pid("forgotten", proc.pid)
        yield proc  # never stopped: a leak of the case whose teardown ends the module


    def test_first(server, forgotten):
        assert server.poll() is None


    def test_second(server, forgotten):
        # A wider-scoped fixture's process is not any one case's leak while it is set up.
        assert server.poll() is None
        assert forgotten.poll() is None
"""


@pytest.fixture
def project(tmp_path):
    """``make(files, ini="")``: an inner project and its environment; every pid its
    cases recorded is killed at the end, whatever happened (on a harness that lets them
    live, they would outlive this test)."""
    made = []

    def make(files: dict[str, str], ini: str = ""):
        root = write_project(tmp_path / "proj", files)
        if ini:
            (root / "pytest.ini").write_text("[pytest]\n" + ini)
        made.append(root)
        return root, inner_env(root / "out", tmp_path / "leases")

    yield make
    for root in made:
        for pid in read_pids(root / "out").values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _leak_reported(output: str, case: str, pid: int, command: str) -> bool:
    """The output names ``case`` as having left pid ``pid`` running ``command``."""
    return (
        f"{case} left 1 process(es) running after its teardown" in output
        and f"pid {pid}: " in output
        and command in output
    )


@pytest.mark.parametrize("workers", [None, "2"], ids=["plain", "xdist"])
def test_a_leaked_setsid_daemon_is_stopped_at_its_case_end_and_named(project, workers):
    # Regression: a plain case's setsid daemon lived until the end of the pytest process
    # under `harness run` (named by pid alone, without its case), and outlived the session
    # under plain pytest.
    root, env = project({"test_leaks.py": LEAKS})
    args = ["-n", workers, "--dist", "loadfile"] if workers else ["-p", "no:xdist"]
    session = run_session(root, *args, env=env)
    daemon = read_pids(root / "out")["daemon"]
    assert session.returncode == 0, session.output
    assert session.case("test_next_sees_it_gone").status == "passed", session.output
    assert survivors([daemon], wait=0) == [], "the daemon outlived the session"
    case = "test_leaks.py::test_leaks_a_daemon"
    assert _leak_reported(session.output, case, daemon, "time.sleep(600)"), session.output
    # pytest's warnings summary names the case the warning belongs to.
    summary = session.output.split("warnings summary", 1)[1]
    assert summary.lstrip("= \n").startswith(case), session.output
    assert "LeakWarning" in summary
    # The case's JUnit record carries the leak; a case that waited for its own has none.
    props = _junit_properties(root / "junit.xml")
    assert f"pid {daemon}: " in props["test_leaks_a_daemon"].get("harness.leaked", "")
    assert "harness.leaked" not in props["test_waits_for_its_children"]
    assert session.output.count("left 1 process(es)") == 1, session.output


def _junit_properties(path) -> dict[str, dict[str, str]]:
    return {
        tc.get("name"): {p.get("name"): p.get("value") for p in tc.iter("property")}
        for tc in ET.parse(path).getroot().iter("testcase")
    }


def test_harness_leaks_fail_fails_the_case_that_leaked(project):
    root, env = project({"test_leaks.py": LEAKS}, ini="harness_leaks = fail\n")
    session = run_session(root, "-p", "no:xdist", env=env)
    daemon = read_pids(root / "out")["daemon"]
    assert session.returncode == 1, session.output
    leaked = session.case("test_leaks_a_daemon")
    assert leaked.status == "error", session.output  # its teardown failed
    assert f"pid {daemon}: " in leaked.message + leaked.text
    assert session.case("test_next_sees_it_gone").status == "passed"
    assert session.case("test_waits_for_its_children").status == "passed"
    assert survivors([daemon], wait=0) == []


def test_a_bad_harness_leaks_value_is_a_usage_error(project):
    root, env = project(
        {"test_ok.py": "def test_ok():\n    pass\n"}, ini="harness_leaks = sometimes\n"
    )
    session = run_session(root, "-p", "no:xdist", env=env)
    assert session.returncode == 4, session.output
    assert "harness_leaks = 'sometimes': choose one of warn, fail" in session.output


def test_a_multiprocessing_child_and_its_child_are_stopped_whole(project):
    # The tree a case leaves (a spawned child and the process it started) goes with the
    # case; multiprocessing's resource tracker, kept for the process's life, is no leak.
    root, env = project({"test_tree.py": TREE})
    session = run_session(root, "-p", "no:xdist", env=env, timeout=60)
    pids = read_pids(root / "out")
    assert session.returncode == 0, session.output
    assert session.case("test_next_sees_the_tree_gone").status == "passed", session.output
    assert "test_tree.py::test_leaks_a_tree left 2 process(es)" in session.output
    assert f"pid {pids['tree-child']}: " in session.output
    assert f"pid {pids['tree-grandchild']}: sleep 600" in session.output
    assert "test_joins_its_multiprocessing_child left" not in session.output
    assert "outlived the session" not in session.output
    # The tracker ends by itself once pytest has.
    assert survivors(list(pids.values()), wait=5) == []


def test_a_wider_scoped_fixtures_process_is_checked_when_it_is_torn_down(project):
    root, env = project({"test_fixture.py": FIXTURE})
    session = run_session(root, "-p", "no:xdist", env=env)
    pids = read_pids(root / "out")
    assert session.returncode == 0, session.output
    assert session.case("test_second").status == "passed", session.output
    # The forgotten one is reported against the case whose teardown ended its module.
    assert _leak_reported(
        session.output, "test_fixture.py::test_second", pids["forgotten"], "sleep 601"
    ), session.output
    assert "test_fixture.py::test_first left" not in session.output
    assert f"pid {pids['server']}:" not in session.output
    assert survivors(list(pids.values()), wait=0) == []


LAUNCHED_LEAKS = """
    import subprocess
    import sys

    import pytest
    import torch.distributed as dist

    from recording import record_pid

    SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


    @pytest.mark.launch(nproc=2, reuse={reuse})
    def test_ranks_leak_a_daemon_{variant}():
        child = subprocess.Popen(SLEEPER, start_new_session=True)
        record_pid(f"daemon-{variant}-{{dist.get_rank()}}", child.pid)


    @pytest.mark.launch(nproc=2, reuse={reuse})
    def test_ranks_wait_for_their_children_{variant}():
        subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.fixture(scope="module")
def launched_leaks(tmp_path_factory):
    """``{mode: (root, session)}``: for each ``harness_leaks`` mode, one inner session of
    ``LAUNCHED_LEAKS`` on fresh ranks and again on kept ranks (a file each, ``reuse=`` on
    its markers); every daemon pid recorded is killed at the end, whatever happened."""
    tmp_path = tmp_path_factory.mktemp("launched")
    sessions = {}
    try:
        for mode in ("warn", "fail"):
            files = {
                f"test_launched_{v}.py": LAUNCHED_LEAKS.format(variant=v, reuse=v == "kept")
                for v in ("fresh", "kept")
            }
            root = write_project(tmp_path / mode, files)
            with open(root / "pytest.ini", "a") as ini:
                ini.write(f"harness_leaks = {mode}\n")
            sessions[mode] = (
                root,
                run_session(
                    root, "-p", "no:xdist", env=inner_env(root / "out", tmp_path / "leases")
                ),
            )
        yield sessions
    finally:
        for mode in ("warn", "fail"):
            for pid in read_pids(tmp_path / mode / "out").values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("variant", ["fresh", "kept"])
def test_what_a_launched_cases_ranks_leave_is_named_against_the_case(launched_leaks, variant):
    # Regression: a launched case's ranks (and a plain case run apart on its cards) had
    # their leftovers stopped by their supervisors, silently: no warning, no JUnit
    # property, and `harness_leaks = fail` did not fail the case.
    for mode, (root, session) in launched_leaks.items():
        pids = read_pids(root / "out")
        daemons = [pids[f"daemon-{variant}-0"], pids[f"daemon-{variant}-1"]]
        assert survivors(daemons, wait=0) == [], session.output
        leaker, waiter = (
            f"test_ranks_leak_a_daemon_{variant}",
            f"test_ranks_wait_for_their_children_{variant}",
        )
        case = f"test_launched_{variant}.py::{leaker}"
        assert f"{case} left 2 process(es) running after its teardown" in session.output
        for rank, pid in enumerate(daemons):
            assert f"rank {rank}: pid {pid}: " in session.output, session.output
        props = _junit_properties(root / "junit.xml")
        assert "harness.leaked" not in props[waiter]
        assert session.case(waiter).status == "passed"
        leaked = session.case(leaker)
        if mode == "fail":
            assert leaked.status == "error", session.output
        else:
            assert leaked.status == "passed", session.output
            assert f"pid {daemons[0]}: " in props[leaker]["harness.leaked"]
