"""Nothing hangs and nothing survives: case deadlines, ranks left running after
a failure, and the launching pytest process itself being signalled."""

from __future__ import annotations

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

DEADLINES = '''
    import os
    import subprocess
    import sys
    import time

    import pytest

    from harness import LaunchSpec
    from recording import record_pid


    def hang_forever():
        time.sleep(120)


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=5))
    def test_hang():
        import torch.distributed as dist

        rank = dist.get_rank()
        record_pid(f"hang-rank-{rank}")
        if rank == 1:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            record_pid("hang-grandchild", child.pid)
        # Both ranks hang outside any collective: a barrier here would time out
        # (process-group timeout 4 s) near the 5 s deadline and race it.
        hang_forever()


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=60))
    def test_peer_keeps_running_after_a_failure():
        import torch.distributed as dist

        record_pid(f"abandon-rank-{dist.get_rank()}")
        if dist.get_rank() == 1:
            raise ValueError("boom")
        hang_forever()
'''


@pytest.fixture(scope="module")
def deadlines(tmp_path_factory):
    root = write_project(tmp_path_factory.mktemp("deadlines"), {"test_deadlines.py": DEADLINES})
    return root, run_session(root, env=inner_env(root / "out", root / "leases"))


def test_hung_case_fails_at_its_deadline_with_the_stacks_of_running_ranks(deadlines):
    _, session = deadlines
    case = session.case("test_hang")
    assert case.status == "failed"
    assert case.text.startswith("case timed out (2 ranks, cpu/gloo): ranks 0, 1 still running at "
                                "the 5 s deadline (LaunchSpec.timeout)"), case.text
    rank0, rank1 = case.text.split("--- rank 0 stack at the deadline ---", 1)[1].split(
        "--- rank 1 stack at the deadline ---", 1)
    assert "in hang_forever" in rank0
    assert "in hang_forever" in rank1
    assert "in test_hang" in rank1


def test_hung_case_leaves_no_process_behind(deadlines):
    root, _ = deadlines
    pids = read_pids(root / "out")
    hang = {name: pid for name, pid in pids.items() if name.startswith("hang-")}
    assert set(hang) == {"hang-rank-0", "hang-rank-1", "hang-grandchild"}
    assert survivors(list(hang.values()), wait=0) == []


def test_ranks_still_running_after_a_failure_are_stopped(deadlines):
    root, session = deadlines
    case = session.case("test_peer_keeps_running_after_a_failure")
    assert case.status == "failed"
    assert case.text.startswith("rank 1 failed: ValueError: boom"), case.text
    assert "rank 0 was still running 5 s after the first failure; stopped" in case.text
    assert "in hang_forever" in case.text.split("--- rank 0 stack when stopped ---", 1)[1]
    pids = read_pids(root / "out")
    assert survivors([pids["abandon-rank-0"], pids["abandon-rank-1"]], wait=0) == []


def test_whole_session_is_bounded_by_the_deadlines(deadlines):
    _, session = deadlines
    # Two cases: a 5 s deadline and a 5 s post-failure grace, plus spawn,
    # stack dumps and stop; far below the 60 s the second case allowed.
    assert session.seconds < 45, session.output


HANGS = '''
    import time

    import pytest

    from harness import LaunchSpec
    from recording import record_pid


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=120))
    def test_hangs():
        import torch.distributed as dist

        record_pid(f"rank-{dist.get_rank()}")
        time.sleep(120)
'''


@pytest.mark.parametrize(("sig", "returncode"), [
    (signal.SIGTERM, -signal.SIGTERM),  # ranks reaped, then it dies of the SIGTERM
    (signal.SIGINT, pytest.ExitCode.INTERRUPTED),
    (signal.SIGKILL, -signal.SIGKILL),  # no cleanup possible: ranks die with their parent
], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_signalled_pytest_takes_its_ranks_with_it(tmp_path, sig, returncode):
    root = write_project(tmp_path / "project", {"test_hangs.py": HANGS})
    out = root / "out"
    proc = subprocess.Popen(pytest_command(root), cwd=root, env=inner_env(out, root / "leases"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while len(read_pids(out)) < 2 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.1)
        ranks = list(read_pids(out).values())
        assert len(ranks) == 2, "ranks never started"
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == returncode, output
    assert survivors(ranks, wait=5) == []
