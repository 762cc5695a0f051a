"""Nothing escapes a case: processes its ranks start (daemons that ``setsid()``
and double-fork, plain subprocesses) end with it, kept or fresh ranks, passed
or failed, and within seconds of a SIGKILLed pytest; no such process holds
a lease descriptor. Real sessions, real signals, real lock files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
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

from harness.launcher.lease import acquire, slot_want

ESCAPES = '''
    import json
    import os
    import subprocess
    import time

    import pytest

    from recording import out_dir, record_pid


    def open_files():
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return found


    def start_daemon(name):
        """Double fork with setsid: the daemon's parent exits at once."""
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                if os.fork() == 0:
                    (out_dir() / f"{name}.fds").write_text(json.dumps(open_files()))
                    record_pid(name)
                    os.write(ready_w, b"x")
                    time.sleep(120)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        os.read(ready_r, 1)


    def start_processes(tag):
        rank = os.environ["RANK"]
        start_daemon(f"{tag}-daemon-{rank}")
        child = subprocess.Popen(["sleep", "120"])
        record_pid(f"{tag}-sleep-{rank}", child.pid)
        record_pid(f"{tag}-rank-{rank}")


    @pytest.mark.launch(nproc=2, timeout=60)
    def test_passes():
        start_processes("passes")


    @pytest.mark.launch(nproc=2, timeout=60)
    def test_fails():
        start_processes("fails")
        raise AssertionError("boom")


    @pytest.mark.launch(nproc=2, timeout=120)
    def test_hangs():
        start_processes("hangs")
        (out_dir() / f"hanging-{os.environ['RANK']}").write_text("")
        time.sleep(120)
'''


def _escapees(out, tag: str) -> list[int]:
    return [
        pid
        for name, pid in read_pids(out).items()
        if name.startswith(f"{tag}-") and "-rank-" not in name
    ]


def _lease_fds_held(out, leases) -> dict[str, list[str]]:
    """For every daemon: the open files it found that are lock files of the lease dir."""
    held = {}
    for path in out.glob("*.fds"):
        held[path.stem] = [f for f in json.loads(path.read_text()) if f.startswith(str(leases))]
    return held


@pytest.mark.parametrize("reuse", [True, False], ids=["kept", "fresh"])
def test_no_process_a_case_started_outlives_it(tmp_path, reuse):
    root = write_project(tmp_path / "project", {"test_escapes.py": ESCAPES})
    out, leases = root / "out", root / "leases"
    args = ["-k", "passes or fails", "--harness-max-procs", "2"]
    if reuse:
        args.append("--harness-reuse")
    session = run_session(root, *args, env=inner_env(out, leases))
    try:
        assert session.case("test_passes").status == "passed", session.output
        assert session.case("test_fails").status == "failed", session.output
        for tag in ("passes", "fails"):
            started = _escapees(out, tag)
            assert len(started) == 4, (tag, read_pids(out))  # a daemon and a sleep per rank
            assert survivors(started, wait=5) == [], f"{tag}: processes outlived their case"
        held = _lease_fds_held(out, leases)
        assert len(held) == 4, held
        assert not any(held.values()), f"lease descriptors reached a case's daemon: {held}"
        acquire(str(leases), [slot_want(2, 2)], timeout=5, holder="after the session").release()
    finally:
        for pid in read_pids(out).values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("reuse", [True, False], ids=["kept", "fresh"])
def test_nothing_outlives_a_sigkilled_pytest_by_more_than_seconds(tmp_path, reuse):
    root = write_project(tmp_path / "project", {"test_escapes.py": ESCAPES})
    out, leases = root / "out", root / "leases"
    args = ["-k", "hangs", "--harness-max-procs", "2"]
    if reuse:
        args.append("--harness-reuse")
    proc = subprocess.Popen(
        pytest_command(root, *args),
        cwd=root,
        env=inner_env(out, leases),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 90
        while (
            len(list(out.glob("hanging-*"))) < 2 and time.monotonic() < end and proc.poll() is None
        ):
            time.sleep(0.1)
        assert len(list(out.glob("hanging-*"))) == 2, "the case never started"
        started = [pid for name, pid in read_pids(out).items() if name.startswith("hangs-")]
        assert len(started) == 6
        assert survivors(started, wait=0) == started
        proc.kill()
        proc.communicate(timeout=30)
        killed = time.monotonic()
        assert survivors(started, wait=5) == [], "processes outlived the SIGKILLed pytest"
        # The lease is free at once, not held by an escaped process.
        acquire(str(leases), [slot_want(2, 2)], timeout=5, holder="after the kill").release()
        assert time.monotonic() - killed < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in read_pids(out).values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
