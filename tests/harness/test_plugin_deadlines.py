"""Nothing hangs and nothing survives: case deadlines, ranks left running after
a failure, and the launching pytest process itself being signalled."""

from __future__ import annotations

import re
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

DEADLINES = """
    import os
    import subprocess
    import sys
    import time

    import pytest

    from harness import LaunchSpec
    from recording import record_pid


    def hang_forever():
        time.sleep(120)


    # The first case starts the kept pool (a case's deadline counts from the
    # moment its ranks are ready, so the 5 s of the next one are all test body).
    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=120))
    def test_a_warm_up():
        pass


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
"""


@pytest.fixture(scope="module")
def deadlines(tmp_path_factory):
    root = write_project(
        tmp_path_factory.mktemp("deadlines"), {"test_deadlines.py": DEADLINES}, reuse=True
    )
    return root, run_session(root, env=inner_env(root / "out", root / "leases"))


def test_hung_case_fails_at_its_deadline_with_the_stacks_of_running_ranks(deadlines):
    _, session = deadlines
    case = session.case("test_hang")
    assert case.status == "failed"
    assert case.text.startswith(
        "case timed out (2 ranks, cpu/gloo): ranks 0, 1 still running at "
        "the 5 s deadline (LaunchSpec.timeout)"
    ), case.text
    rank0, rank1 = case.text.split("--- rank 0 stack at the deadline ---", 1)[1].split(
        "--- rank 1 stack at the deadline ---", 1
    )
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
    # A warm-up and two cases: a 5 s deadline and a 5 s post-failure grace,
    # plus start-ups, stack dumps and stops. Had the grace not stopped the
    # second case, the two would take at least 5 + 60 s.
    assert session.seconds < 65, session.output


HANGS = """
    import time

    import pytest

    from harness import LaunchSpec
    from recording import record_pid


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=120))
    def test_hangs():
        import torch.distributed as dist

        record_pid(f"rank-{dist.get_rank()}")
        time.sleep(120)
"""


@pytest.mark.parametrize(
    ("sig", "returncode"),
    [
        (signal.SIGTERM, -signal.SIGTERM),  # ranks reaped, then it dies of the SIGTERM
        (signal.SIGINT, pytest.ExitCode.INTERRUPTED),
        (signal.SIGKILL, -signal.SIGKILL),  # no cleanup possible: ranks die with their parent
    ],
    ids=["SIGTERM", "SIGINT", "SIGKILL"],
)
def test_signalled_pytest_takes_its_ranks_with_it(tmp_path, sig, returncode):
    root = write_project(tmp_path / "project", {"test_hangs.py": HANGS})
    out = root / "out"
    proc = subprocess.Popen(
        pytest_command(root),
        cwd=root,
        env=inner_env(out, root / "leases"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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


def test_sigterm_to_pytest_with_fresh_ranks_leaves_no_case_directory(tmp_path):
    root = write_project(tmp_path / "project", {"test_hangs.py": HANGS})
    out, tmp = root / "out", tmp_path / "tmp"
    tmp.mkdir()
    env = {**inner_env(out, root / "leases"), "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        pytest_command(root, "--harness-no-reuse"),
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        while len(read_pids(out)) < 2 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.1)
        ranks = list(read_pids(out).values())
        assert len(ranks) == 2, "ranks never started"
        assert list(tmp.glob("harness-case-*")), "the case directory is not where TMPDIR says"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM, output
    assert survivors(ranks, wait=5) == []
    assert list(tmp.glob("harness-case-*")) == []


FLOOD = """
    import sys

    import pytest

    from harness import LaunchSpec


    # The deadline counts from the moment the ranks are ready: 8 s of flooding.
    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=8))
    def test_floods():
        line = "x" * 200 + "\\n"
        sys.stderr.write("first words\\n")
        while True:
            sys.stderr.write(line)
"""


@pytest.mark.parametrize("reuse", [True, False], ids=["kept", "fresh"])
def test_flooding_rank_output_is_kept_to_its_head_and_tail(tmp_path, reuse):
    root = write_project(tmp_path / "project", {"test_flood.py": FLOOD})
    args = ("--harness-reuse",) if reuse else ()
    session = run_session(root, *args, env=inner_env(root / "out", root / "leases"))
    case = session.case("test_floods")
    assert case.status == "failed"
    assert case.text.startswith("case timed out (2 ranks, cpu/gloo)"), case.text[:2000]
    # Head and tail of each rank's output, and a note of what was dropped:
    # well under a megabyte in all, however much the ranks wrote.
    assert session.output.count("first words") == 2, session.output[:5000]
    assert session.output.count("bytes of this rank's output dropped") == 2, session.output[:5000]
    assert len(session.output) < 1_500_000
    # Deadline, stack dumps and the stop grace; not the time to read gigabytes.
    assert session.seconds < (70 if not reuse else 60), session.output[:5000]


STOPS = """
    import os
    import signal
    import time

    import pytest

    from recording import out_dir, record_pid


    @pytest.mark.launch(nproc=2, timeout=120)
    def test_rank_stops_itself():
        import torch.distributed as dist

        marker = out_dir() / "stopping"
        if dist.get_rank() == 1:
            record_pid("stopped-rank")
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGSTOP)
        while not marker.exists():
            time.sleep(0.05)
        time.sleep(0.5)
        raise RuntimeError("rank 0 gives up on its stopped peer")
"""


def test_a_rank_stopped_by_a_signal_is_stopped_and_its_missing_stack_explained(tmp_path):
    root = write_project(tmp_path / "project", {"test_stops.py": STOPS})
    session = run_session(root, env=inner_env(root / "out", root / "leases"))
    case = session.case("test_rank_stops_itself")
    assert case.status == "failed"
    assert case.text.startswith("rank 0 failed: RuntimeError: rank 0 gives up"), case.text
    stack = case.text.split("--- rank 1 stack when stopped ---", 1)[1]
    assert "the rank did not answer the stack-dump signal" in stack, case.text
    assert survivors([read_pids(root / "out")["stopped-rank"]], wait=5) == []


FAR = """
    import pytest


    @pytest.mark.launch(nproc=2, timeout=1e300)
    def test_far():
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2


    def test_pg_timeout_is_capped():
        from harness.launcher.rank import LONGEST_PG_TIMEOUT_S, pg_timeout_for

        assert pg_timeout_for(1e300) == LONGEST_PG_TIMEOUT_S
        assert pg_timeout_for(100.0) == 80.0
"""


@pytest.mark.parametrize("reuse", [True, False], ids=["kept", "fresh"])
def test_a_deadline_past_what_a_process_group_holds_runs_the_case(tmp_path, reuse):
    # Regression: a schema-valid timeout_s of 1e300 failed every rank with "OverflowError:
    # Python int too large to convert to C int" (timedelta(seconds=1e300) for the group).
    root = write_project(tmp_path / "project", {"test_far.py": FAR})
    args = ("--harness-reuse",) if reuse else ()
    session = run_session(root, *args, env=inner_env(root / "out", root / "leases"))
    assert session.returncode == 0, session.output[-5000:]
    assert session.case("test_far").status == "passed"


SLOW_START = """
    import os
    import time

    import pytest

    from harness import LaunchSpec

    # What a slow import (torch on a loaded host) does to a rank: it takes longer
    # than the case deadline before the test can run. Ranks only (RANK is theirs).
    if os.environ.get("RANK") is not None:
        time.sleep(4)


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=3))
    def test_quick_body_after_a_slow_start():
        pass


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=3))
    def test_slow_body_after_a_slow_start():
        time.sleep(60)
"""


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "kept"])
def test_the_deadline_counts_from_the_moment_the_ranks_are_ready(tmp_path, reuse):
    # Regression: a case's deadline counted its ranks' start (spawning, importing
    # torch and the test module), so at high load a short deadline failed a quick
    # test with every rank "still running" inside its imports.
    root = write_project(tmp_path / "project", {"test_slow.py": SLOW_START}, reuse=reuse)
    session = run_session(root, env=inner_env(root / "out", root / "leases"))
    assert session.case("test_quick_body_after_a_slow_start").status == "passed", session.output
    case = session.case("test_slow_body_after_a_slow_start")
    assert case.status == "failed"
    assert re.search(
        r"still running at the 3 s deadline \(LaunchSpec\.timeout\), counted from the moment "
        r"the ranks were ready \((\d+\.\d) s after they were started\)",
        case.text,
    ), case.text
    started = float(re.search(r"ready \((\d+\.\d) s after", case.text).group(1))
    assert started >= 4.0
    assert "in test_slow_body_after_a_slow_start" in case.text  # the body's stack, not imports
