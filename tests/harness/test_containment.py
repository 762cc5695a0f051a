"""Nothing a run starts outlives it: not a daemon of a rank that killed its own
process group, not the pytest, xdist workers and ranks of a run or a pytest
killed by SIGKILL, not the pool or fresh case directory of a crashed worker; and a rank's
process-group timeout ends before its case's deadline.

Real ranks, real signals, real pytest sessions; leftovers are looked for by
pid (``launch_project.survivors``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from launch_project import (
    inner_env,
    pytest_command,
    read_pids,
    run_session,
    survivors,
    write_project,
)
from suite_project import make_project, manifest

import harness
from harness import LaunchError, LaunchSpec

#: Seconds a rank spends importing this module (a slow start-up: spawning,
#: importing torch under load), when set.
SLOW_START_ENV = "HARNESS_TEST_SLOW_START_S"
if os.environ.get(SLOW_START_ENV) and os.environ.get("RANK") is not None:
    time.sleep(float(os.environ[SLOW_START_ENV]))


def start_daemon_then_kill_my_group(pid_file: str) -> None:
    import subprocess
    import sys
    import time

    code = (
        "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
        "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(300)"
    )
    subprocess.Popen(
        [sys.executable, "-c", code, pid_file],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 60
    while not os.path.exists(pid_file) and time.monotonic() < end:
        time.sleep(0.02)
    subprocess.run(["sh", "-c", "kill -9 0"])
    time.sleep(30)  # not reached: the group kill took this rank too


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "kept"])
def test_a_rank_killing_its_process_group_leaves_no_daemon(tmp_path, reuse):
    pid_file = tmp_path / "daemon.pid"
    with pytest.raises(LaunchError, match="rank 0"):
        harness.launch(
            start_daemon_then_kill_my_group, LaunchSpec(nproc=1, reuse=reuse), str(pid_file)
        )
    daemon = int(pid_file.read_text())
    assert survivors([daemon], wait=10) == [], "the rank's setsid daemon outlived its case"


# -- SIGKILL of the pytest controller ---------------------------------------------

# Under `--dist load` the first two tests go to one worker, the last two to the
# other: one worker runs a plain test, the other a launched one, both hanging.
HANGING_CASES = """
    import os
    import time

    import psutil
    import pytest

    from recording import record_pid


    def test_a_plain():
        record_pid("plain-worker")
        end = time.monotonic() + 120
        while time.monotonic() < end:  # a test busy where an interrupt does not stop it
            try:
                time.sleep(0.5)
            except KeyboardInterrupt:
                pass


    def test_b_plain():
        time.sleep(120)


    @pytest.mark.launch(nproc=1)
    def test_c_launched():
        supervisor = psutil.Process().parent()
        record_pid("rank")
        record_pid("supervisor", supervisor.pid)
        record_pid("launching-worker", supervisor.parent().pid)
        time.sleep(120)


    @pytest.mark.launch(nproc=1)
    def test_d_launched():
        time.sleep(120)
"""


def wait_for_pids(
    out, names: set[str], proc: subprocess.Popen, timeout: float = 120
) -> dict[str, int]:
    end = time.monotonic() + timeout
    while not names <= set(read_pids(out)):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < end, f"pids {names - set(read_pids(out))} never written"
        time.sleep(0.1)
    return read_pids(out)


def test_sigkill_of_the_pytest_controller_takes_its_workers_and_ranks(tmp_path):
    root = write_project(tmp_path / "project", {"test_hang.py": HANGING_CASES})
    env = inner_env(root / "out", root / "leases")
    proc = subprocess.Popen(
        pytest_command(root, "-n", "2", "--dist", "load"),
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        names = {"plain-worker", "rank", "supervisor", "launching-worker"}
        pids = wait_for_pids(root / "out", names, proc)
        proc.kill()  # what the OOM killer does
        proc.wait(10)
        assert survivors(list(pids.values()), wait=15) == [], pids
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in survivors(list(read_pids(root / "out").values()), wait=0):
            os.kill(pid, signal.SIGKILL)


# -- a crashed xdist worker ----------------------------------------------------------

CRASHING_CASES = """
    import os
    import signal

    import pytest


    @pytest.mark.launch(nproc=1, reuse=True)
    def test_a_kept_pool():
        pass


    def test_b_crash():
        os.kill(os.getpid(), signal.SIGKILL)
"""


def run_crashing_worker(tmp_path, cases: str):
    """Run ``cases`` (which crash their one xdist worker) with a temp dir of their
    own; return the session and that temp dir."""
    root = write_project(tmp_path / "project", {"test_crash.py": cases})
    tmp = tmp_path / "session-tmp"
    tmp.mkdir()
    env = dict(inner_env(root / "out", root / "leases"), TMPDIR=str(tmp))
    session = run_session(root, "-n", "1", env=env)
    assert "crashed" in session.output, session.output
    return session, tmp


def leftovers(tmp, pattern: str, wait: float = 15) -> list:
    """What matches ``pattern`` in ``tmp`` once it is gone or ``wait`` seconds passed."""
    end = time.monotonic() + wait
    while list(tmp.glob(pattern)) and time.monotonic() < end:
        time.sleep(0.1)
    return list(tmp.glob(pattern))


def test_a_crashed_xdist_worker_leaves_no_pool_directory(tmp_path):
    session, tmp = run_crashing_worker(tmp_path, CRASHING_CASES)
    assert session.case("test_a_kept_pool").status == "passed", session.output
    assert leftovers(tmp, "harness-pool-*") == []


# The kernel closes a SIGKILLed worker's files (the pool's pipe) before it
# re-parents the worker's children: the kept rank reads EOF before its
# supervisor learns that the worker is gone. This case makes that window
# seconds wide: it closes the pipe, then kills the worker a while later.
CRASHING_AFTER_EOF_CASES = """
    import os
    import signal
    import time

    import pytest


    @pytest.mark.launch(nproc=1, reuse=True)
    def test_a_kept_pool():
        pass


    def test_b_eof_then_crash():
        from harness.launcher.pool import keeper

        for channel in keeper.pool._channels:
            channel.close()
        time.sleep(2)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_that_reads_eof_before_its_worker_dies_leaves_no_pool_directory(tmp_path):
    session, tmp = run_crashing_worker(tmp_path, CRASHING_AFTER_EOF_CASES)
    assert session.case("test_a_kept_pool").status == "passed", session.output
    assert leftovers(tmp, "harness-pool-*") == []


CRASHING_FRESH_CASE = """
    import os
    import signal
    import time

    import psutil
    import pytest


    @pytest.mark.launch(nproc=1, reuse=False)
    def test_kills_its_worker():
        worker = psutil.Process().parent().parent()  # the rank's supervisor's parent
        worker.send_signal(signal.SIGKILL)
        time.sleep(60)
"""


def test_a_worker_killed_mid_case_leaves_no_fresh_case_directory(tmp_path):
    _, tmp = run_crashing_worker(tmp_path, CRASHING_FRESH_CASE)
    assert leftovers(tmp, "harness-case-*") == []


# -- the process-group timeout against the deadline --------------------------------------


def group_timeout_and_case_deadline() -> tuple[float, float, float]:
    """This rank's process-group timeout, now, and its case's deadline (wall clock)."""
    import torch
    import torch.distributed as dist

    from harness.launcher.rank import EnclosingCase

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds(), time.time(), EnclosingCase.from_env().deadline


def test_a_collective_blocked_after_a_slow_start_times_out_before_the_deadline(monkeypatch):
    # 6 s of the 20 s go to start-up (importing this module): a group timeout
    # taken from the whole deadline (16 s) would end after it.
    monkeypatch.setenv(SLOW_START_ENV, "6")
    results = harness.launch(
        group_timeout_and_case_deadline, LaunchSpec(nproc=2, timeout=20, reuse=False)
    )
    for timeout, now, deadline in results:
        # A collective started now, blocked, raises at now + timeout at the latest.
        assert now + timeout < deadline, (timeout, deadline - now)


# -- SIGKILL to the process group of `harness run` ----------------------------------------

RUN_PLAIN = """
    import os
    import time
    from pathlib import Path


    def test_plain_waits():
        pids = Path(os.environ["PIDS_DIR"])
        (pids / "worker").write_text(str(os.getpid()))
        (pids / "controller").write_text(str(os.getppid()))
        end = time.monotonic() + 600
        while time.monotonic() < end:  # busy where an interrupt does not stop it
            try:
                time.sleep(0.5)
            except KeyboardInterrupt:
                pass
"""
RUN_LAUNCHED = """
    import os
    import time
    from pathlib import Path

    import pytest


    @pytest.mark.launch(nproc=1)
    def test_rank_waits():
        Path(os.environ["PIDS_DIR"], "rank").write_text(str(os.getpid()))
        time.sleep(600)
"""


def test_sigkill_to_the_group_of_harness_run_takes_the_whole_run(tmp_path):
    (tmp_path / "project").mkdir()
    root = make_project(
        tmp_path / "project",
        {"tests/plain/test_p.py": RUN_PLAIN, "tests/dist/test_d.py": RUN_LAUNCHED},
        {
            "cpu": manifest(
                "cpu",
                "cpu",
                [
                    {"id": "plain", "paths": ["tests/plain"]},
                    {"id": "dist", "paths": ["tests/dist"]},
                ],
            )
        },
    )
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "GITHUB_STEP_SUMMARY")
    }
    env["PIDS_DIR"] = str(pids_dir)
    # A session and group of its own, as a shell job's: "the group" is the harness's.
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", "cpu", "--out", "out", "--workers", "2"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 240
        while not {"worker", "controller", "rank"} <= {p.name for p in pids_dir.iterdir()}:
            assert proc.poll() is None, "harness run ended before its cases started"
            assert time.monotonic() < end, "the cases never started"
            time.sleep(0.2)
        pids = {p.name: int(p.read_text()) for p in pids_dir.iterdir()}
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert survivors(list(pids.values()), wait=15) == [], pids
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in survivors([int(p.read_text()) for p in pids_dir.iterdir()], wait=0):
            os.kill(pid, signal.SIGKILL)
