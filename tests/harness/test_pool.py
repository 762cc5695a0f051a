"""Kept rank pools end to end: real pytest sessions, real ranks, pids compared.

One session runs a sequence of launched cases whose order matters (pytest
runs a file top to bottom); each test below checks one step of it. Ranks
record their pids, so "the same pool" and "fresh ranks" are facts, not log
lines.
"""

from __future__ import annotations

import json
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

SEQUENCE = """
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    import psutil
    import pytest

    from harness import LaunchSpec
    from recording import out_dir, record_pid

    STATE = {}


    def rank():
        import torch.distributed as dist

        return dist.get_rank()


    def note(case):
        record_pid(f"{case}-{rank()}")


    def pids(case):
        found = {int(p.stem.rsplit("-", 1)[1]): int(p.read_text())
                 for p in out_dir().glob(f"{case}-*.pid")}
        return [found[r] for r in sorted(found)]


    @pytest.fixture
    def case_env(request, monkeypatch):
        monkeypatch.setenv("HARNESS_TEST_CASE", request.node.name)


    @pytest.mark.launch(nproc=2)
    def test_01_dirty(case_env):
        import torch
        import torch.distributed as dist
        from channel_loss.capture import capture

        note("dirty")
        assert os.environ["HARNESS_TEST_CASE"] == "test_01_dirty"
        (out_dir() / f"draw-{rank()}.json").write_text(json.dumps(torch.rand(3).tolist()))
        STATE["set by"] = "test_01_dirty"
        os.environ["HARNESS_TEST_LEAK"] = "1"
        os.chdir(out_dir())
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(1234)
        capture().__enter__()  # a capture scope left open
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 2


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=100))
    def test_02_clean(case_env):
        import torch
        import torch.distributed as dist
        from channel_loss.capture import active_capture

        note("clean")
        # The kept group's timeout follows this case's deadline (100 s), not the first case's.
        gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert gloo.options._timeout.total_seconds() == 80.0
        assert STATE == {}
        assert "HARNESS_TEST_LEAK" not in os.environ
        # The launcher's environment as it is now, as a fresh rank would inherit it.
        assert os.environ["HARNESS_TEST_CASE"] == "test_02_clean"
        assert os.getcwd() == os.path.dirname(os.path.abspath(__file__))
        assert torch.get_default_dtype() == torch.float32
        assert not torch.are_deterministic_algorithms_enabled()
        assert active_capture() is None
        # The generator is where it was when the pool's first case began.
        first = json.loads((out_dir() / f"draw-{rank()}.json").read_text())
        assert torch.rand(3).tolist() == first


    @pytest.mark.launch(nproc=2)
    def test_03_fails():
        note("fails")
        assert rank() == 0


    @pytest.mark.launch(nproc=2)
    def test_04_after_failure():
        note("after-failure")


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=4))
    def test_05_hangs():
        note("hangs")
        time.sleep(60)


    @pytest.mark.launch(nproc=2)
    def test_06_after_hang():
        note("after-hang")


    @pytest.mark.launch(nproc=3)
    def test_07_three():
        import torch
        import torch.distributed as dist

        import harness

        note("three")
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 3
        # Made in its pool's first case: the timeout the ranks joined with.
        world = dist.distributed_c10d._get_default_group()
        outer = harness.kept_group([0, 2])
        if rank() != 1:
            assert gloo_timeout(outer) == gloo_timeout(world) < 300


    @pytest.mark.launch(nproc=2)
    def test_08_two():
        note("two")
        # The kept ranks' supervisors hold their pool's lease (crash-safe);
        # the ranks, and so what a case starts, hold none.
        def held(proc):
            return sorted(os.path.basename(f.path) for f in proc.open_files()
                          if f.path.endswith(".lock"))

        (out_dir() / f"locks-{rank()}.json").write_text(json.dumps(
            [held(psutil.Process()), held(psutil.Process().parent())]))


    @pytest.mark.launch(nproc=2)
    def test_09_skips():
        note("skips")
        pytest.skip("nothing to do on this pool")


    @pytest.mark.launch(nproc=2)
    def test_10_leaves_a_child():
        note("leaves-child")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        record_pid(f"child-{rank()}", child.pid)


    def test_11_child_is_gone():
        for pid in (int(p.read_text()) for p in out_dir().glob("child-*.pid")):
            try:
                assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                pass


    @pytest.mark.launch(LaunchSpec(nproc=2, reuse=False))
    def test_12_no_reuse_a():
        note("no-reuse-a")


    @pytest.mark.launch(LaunchSpec(nproc=2, reuse=False))
    def test_13_no_reuse_b():
        note("no-reuse-b")


    @pytest.mark.launch(nproc=2)
    def test_14_two_again():
        note("two-again")


    def gloo_timeout(group):
        import torch

        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=90))
    def test_14a_makes_kept_groups():
        import numpy as np
        import torch
        import torch.distributed as dist

        import harness

        note("kept-groups")
        pair = harness.kept_group([0, 1])
        singles = [harness.kept_group([r]) for r in range(2)]  # every rank, in one order
        assert harness.kept_group([1, 0]) is pair
        assert harness.kept_group(np.arange(2)) is pair  # numpy ranks too
        total = torch.ones(1)
        dist.all_reduce(total, group=pair)
        assert total.item() == 2
        assert dist.get_world_size(singles[rank()]) == 1
        assert singles[1 - rank()] is dist.GroupMember.NON_GROUP_MEMBER
        assert gloo_timeout(pair) == 72.0  # made under this case's 90 s deadline
        (out_dir() / f"groups-{rank()}.json").write_text(json.dumps([id(pair), id(singles[rank()])]))
        for bad, words in (([0, 0], "repeat a rank"), ([2], "outside the world of 2 ranks"),
                           ([], "ranks is empty"), (["0"], "'0' in ['0'] is not an int")):
            with pytest.raises(ValueError, match=re.escape(words)):
                harness.kept_group(bad)


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=60))
    def test_14a_kept_groups_next_case():
        import torch
        import torch.distributed as dist

        import harness

        note("kept-groups-next")
        pair = harness.kept_group([0, 1])
        singles = [harness.kept_group([r]) for r in range(2)]
        made = json.loads((out_dir() / f"groups-{rank()}.json").read_text())
        assert [id(pair), id(singles[rank()])] == made  # the very groups of the last case
        assert gloo_timeout(pair) == 48.0  # the kept group follows this case's 60 s deadline
        total = torch.ones(1)
        dist.all_reduce(total, group=pair)
        assert total.item() == 2


    @pytest.mark.launch(nproc=2)
    def test_14b_makes_a_group():
        import torch.distributed as dist

        note("makes-group")
        dist.new_group([0, 1])


    @pytest.mark.launch(nproc=2)
    def test_14c_leaves_a_thread():
        import threading

        note("leaves-thread")
        threading.Thread(target=time.sleep, args=(30,), name="sleeper", daemon=True).start()


    @pytest.mark.launch(nproc=2)
    def test_14d_after_leftovers():
        note("after-leftovers")


"""

# Runs after the harness plugin's own sessionfinish: the pool must be gone by then.
CONFTEST = """
    import json

    import psutil
    import pytest

    from recording import out_dir


    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(session):
        alive = []
        for path in out_dir().glob("after-leftovers-*.pid"):
            try:
                if psutil.Process(int(path.read_text())).status() != psutil.STATUS_ZOMBIE:
                    alive.append(path.stem)
            except psutil.NoSuchProcess:
                pass
        (out_dir() / "at-sessionfinish.json").write_text(json.dumps(alive))
"""


@pytest.fixture(scope="module")
def sequence(tmp_path_factory):
    root = write_project(
        tmp_path_factory.mktemp("pool"),
        {"test_sequence.py": SEQUENCE, "conftest.py": CONFTEST},
        reuse=True,
    )
    # Slots for the kept pool and the reuse=False cases beside it.
    session = run_session(
        root, "--harness-max-procs", "8", env=inner_env(root / "out", root / "leases")
    )
    pids: dict[str, list[int]] = {}
    for name, pid in sorted(read_pids(root / "out").items()):
        pids.setdefault(name.rpartition("-")[0], []).append(pid)
    return root, session, pids


def test_consecutive_cases_run_on_the_same_ranks(sequence):
    _, session, pids = sequence
    assert session.case("test_01_dirty").status == "passed", session.output
    assert len(set(pids["dirty"])) == 2
    assert pids["clean"] == pids["dirty"]
    assert pids["fails"] == pids["dirty"]


def test_state_a_case_changed_does_not_reach_the_next(sequence):
    _, session, _ = sequence
    case = session.case("test_02_clean")
    assert case.status == "passed", case.text


def test_a_failed_case_is_followed_by_fresh_ranks(sequence):
    _, session, pids = sequence
    assert session.case("test_03_fails").text.startswith("rank 1 failed: AssertionError")
    assert session.case("test_04_after_failure").status == "passed"
    assert not set(pids["after-failure"]) & set(pids["fails"])


def test_a_hung_case_is_stopped_and_followed_by_fresh_ranks(sequence):
    _, session, pids = sequence
    case = session.case("test_05_hangs")
    assert case.status == "failed"
    assert case.text.startswith(
        "case timed out (2 ranks, cpu/gloo): ranks 0, 1 still running at the 4 s deadline"
    ), case.text
    assert "in test_05_hangs" in case.text  # the stacks of the kept ranks
    assert pids["hangs"] == pids["after-failure"]
    assert session.case("test_06_after_hang").status == "passed"
    assert not set(pids["after-hang"]) & set(pids["hangs"])
    assert survivors(pids["hangs"], wait=0) == []


def test_another_rank_count_gets_its_own_ranks(sequence):
    root, session, pids = sequence
    assert session.case("test_07_three").status == "passed", session.output
    assert len(pids["three"]) == 3
    assert not set(pids["three"]) & set(pids["after-hang"])
    assert session.case("test_08_two").status == "passed", session.output
    assert not set(pids["two"]) & (set(pids["three"]) | set(pids["after-hang"]))
    for rank in (0, 1):
        rank_held, held = json.loads((root / "out" / f"locks-{rank}.json").read_text())
        assert rank_held == []
        assert len(held) == 2, held
        assert all(name.startswith("slot-") for name in held), held


def test_a_skip_inside_the_ranks_keeps_the_pool(sequence):
    _, session, pids = sequence
    case = session.case("test_09_skips")
    assert case.status == "skipped"
    assert case.message == "nothing to do on this pool"
    assert pids["skips"] == pids["two"]
    assert pids["leaves-child"] == pids["two"]


def test_processes_a_case_started_are_stopped_when_it_ends(sequence):
    _, session, pids = sequence
    assert session.case("test_10_leaves_a_child").status == "passed"
    assert len(pids["child"]) == 2
    assert session.case("test_11_child_is_gone").status == "passed", session.output


def test_reuse_false_spawns_fresh_ranks_beside_the_pool(sequence):
    _, session, pids = sequence
    for name in ("test_12_no_reuse_a", "test_13_no_reuse_b", "test_14_two_again"):
        assert session.case(name).status == "passed", session.output
    a, b = set(pids["no-reuse-a"]), set(pids["no-reuse-b"])
    assert len(a) == len(b) == 2
    assert not a & b
    assert not (a | b) & set(pids["two"])
    assert pids["two-again"] == pids["two"]  # the kept pool was left alone


def test_sub_groups_from_kept_group_keep_the_ranks_and_reach_the_next_case(sequence):
    _, session, pids = sequence
    for name in ("test_14a_makes_kept_groups", "test_14a_kept_groups_next_case"):
        assert session.case(name).status == "passed", session.output
    assert pids["kept-groups"] == pids["kept-groups-next"] == pids["two"]


def test_a_case_leaving_what_cannot_be_reset_retires_its_ranks(sequence):
    _, session, pids = sequence
    for name in ("test_14b_makes_a_group", "test_14c_leaves_a_thread", "test_14d_after_leftovers"):
        assert session.case(name).status == "passed", session.output
    assert pids["makes-group"] == pids["two"]
    assert not set(pids["leaves-thread"]) & set(pids["makes-group"])
    assert not set(pids["after-leftovers"]) & set(pids["leaves-thread"])
    # Only the case's own new_group counts: the kept groups made before are the ranks' own.
    for note in (
        "rank 0: the case created 1 process group(s)",
        "rank 0: the case left 1 thread(s) running (sleeper)",
    ):
        assert f"harness: the case passed, but its ranks are not reused: {note}" in session.output


def test_no_rank_outlives_the_session(sequence):
    root, _, pids = sequence
    assert json.loads((root / "out" / "at-sessionfinish.json").read_text()) == []
    everyone = [pid for case in pids.values() for pid in case]
    assert survivors(everyone, wait=5) == []


#: Two consecutive launched cases of one shape: enough to tell kept ranks from fresh ones.
PAIR = """
    import os

    import pytest

    import harness
    from harness import LaunchSpec
    from recording import record_pid


    def rank_pid():
        return os.getpid()


    @pytest.mark.launch(nproc=2)
    def test_a():
        record_pid(f"a-{os.environ['RANK']}")


    @pytest.mark.launch(nproc=2)
    def test_b():
        record_pid(f"b-{os.environ['RANK']}")
"""

SHORT = (
    PAIR
    + """

    def test_launch_from_the_session():
        # Needs both process slots, which the kept pool holds: it must give them up.
        pids = harness.launch(rank_pid, LaunchSpec(nproc=2, timeout=60))
        for rank, pid in enumerate(pids):
            record_pid(f"launched-{rank}", pid)


    @pytest.mark.launch(nproc=2)
    def test_c():
        record_pid(f"c-{os.environ['RANK']}")
"""
)


def short_session(tmp_path, *args, reuse=True, cases=SHORT):
    root = write_project(tmp_path, {"test_short.py": cases}, reuse=reuse)
    session = run_session(
        root,
        "--harness-max-procs",
        "2",
        "--harness-lease-timeout",
        "30",
        *args,
        env=inner_env(root / "out", root / "leases"),
    )
    assert session.returncode == 0, session.output
    pids: dict[str, set[int]] = {}
    for name, pid in read_pids(root / "out").items():
        pids.setdefault(name.rpartition("-")[0], set()).add(pid)
    assert survivors([p for case in pids.values() for p in case], wait=5) == []
    return pids


def test_a_pool_gives_its_slots_to_a_launch_of_its_own_process(tmp_path):
    pids = short_session(tmp_path)
    assert pids["a"] == pids["b"]
    assert len(pids["launched"]) == 2
    assert not pids["c"] & pids["a"]  # the pool was closed for the launch


def test_no_reuse_option_spawns_fresh_ranks_for_every_case(tmp_path):
    pids = short_session(tmp_path, "--harness-no-reuse", cases=PAIR)
    assert len(pids["a"] | pids["b"]) == 4


def test_fresh_ranks_for_every_case_unless_the_session_opts_in(tmp_path):
    # Kept pools are opt-in: without harness_reuse every case gets its own ranks.
    pids = short_session(tmp_path / "default", reuse=False, cases=PAIR)
    assert len(pids["a"] | pids["b"]) == 4
    pids = short_session(tmp_path / "option", "--harness-reuse", reuse=False, cases=PAIR)
    assert pids["a"] == pids["b"]


IDLE_POOL = """
    import os
    import time

    import pytest

    from recording import out_dir, record_pid


    @pytest.mark.launch(nproc=2)
    def test_keeps_a_pool():
        record_pid(f"rank-{os.environ['RANK']}")


    def test_idles():
        record_pid("idling")
        time.sleep(60)
"""


@pytest.mark.parametrize(
    ("sig", "returncode"),
    [
        (signal.SIGTERM, -signal.SIGTERM),  # the ranks die with their parent
        (signal.SIGINT, pytest.ExitCode.INTERRUPTED),  # the session closes its pool
        (signal.SIGKILL, -signal.SIGKILL),  # no cleanup possible: they die with their parent
    ],
    ids=["SIGTERM", "SIGINT", "SIGKILL"],
)
def test_signalled_pytest_takes_its_idle_pool_and_lease_with_it(tmp_path, sig, returncode):
    root = write_project(tmp_path / "project", {"test_idle.py": IDLE_POOL}, reuse=True)
    out, leases = root / "out", root / "leases"
    proc = subprocess.Popen(
        pytest_command(root, "--harness-max-procs", "2"),
        cwd=root,
        env=inner_env(out, leases),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        while "idling" not in read_pids(out) and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.1)
        ranks = [pid for name, pid in read_pids(out).items() if name.startswith("rank-")]
        assert len(ranks) == 2, "the pool never started"
        assert survivors(ranks, wait=0) == ranks  # kept while the plain test runs
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == returncode, output
    assert survivors(ranks, wait=5) == []
    # Both process slots are free again.
    acquire(str(leases), [slot_want(2, 2)], timeout=5, holder="after the session").release()


HOLDER = """
    import time

    import pytest

    from harness import LaunchSpec
    from recording import out_dir, record_pid

    TWO_CARDS = LaunchSpec(device="cuda", nproc=2, backend="gloo")


    @pytest.mark.launch(TWO_CARDS)
    def test_keeps_a_pool():
        import os

        record_pid(f"holder-{os.environ['RANK']}")


    def test_idles():
        # Until the other session is done (or 60 s): the kept pool sits idle meanwhile.
        end = time.monotonic() + 60
        while not (out_dir() / "waiter-done").exists() and time.monotonic() < end:
            time.sleep(0.1)
"""

WAITER = """
    import pytest

    from harness import LaunchSpec


    @pytest.mark.launch(LaunchSpec(device="cuda", nproc=2, backend="gloo"))
    def test_needs_the_cards():
        pass
"""


def test_an_idle_pool_yields_its_cards_to_another_session(tmp_path):
    leases, out = tmp_path / "leases", tmp_path / "out"
    holder_root = write_project(tmp_path / "holder", {"test_holder.py": HOLDER}, reuse=True)
    waiter_root = write_project(tmp_path / "waiter", {"test_waiter.py": WAITER})
    out.mkdir()
    env = inner_env(out, leases, cards="cuda:0,1")
    holder = subprocess.Popen(
        pytest_command(holder_root, "--harness-max-procs", "8"),
        cwd=holder_root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        while len(read_pids(out)) < 2 and holder.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert len(read_pids(out)) == 2, "the holder's case never ran"
        # The holder now idles with its pool (and both cards) kept, until told.
        waiter = run_session(
            waiter_root,
            "--harness-max-procs",
            "8",
            "--harness-lease-timeout",
            "30",
            env=env,
            timeout=60,
        )
        assert holder.poll() is None, "the holder ended before the waiter got the cards"
        (out / "waiter-done").touch()
        assert waiter.case("test_needs_the_cards").status == "passed", waiter.output
        assert survivors(list(read_pids(out).values()), wait=5) == []
        output, _ = holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()
    assert holder.returncode == 0, output


def test_a_waiting_lease_makes_the_holders_lease_contended(tmp_path):
    import threading

    lease_dir = str(tmp_path / "leases")
    with acquire(lease_dir, [slot_want(1, 1)], timeout=0, holder="the pool") as held:
        assert not held.contended()
        got: list = []
        waiter = threading.Thread(
            target=lambda: got.append(
                acquire(lease_dir, [slot_want(1, 1)], timeout=30, holder="a waiter")
            )
        )
        waiter.start()
        end = time.monotonic() + 10
        while not held.contended() and time.monotonic() < end:
            time.sleep(0.02)
        assert held.contended()
    waiter.join(30)
    assert len(got) == 1
    with got[0] as theirs:
        assert not theirs.contended()  # the wait is over, and so is its announcement


def test_baseline_restores_what_a_case_changed():
    import gc
    import random

    import numpy as np
    import torch

    from harness.launcher.reset import Baseline

    def state():
        return (
            torch.get_default_dtype(),
            torch.is_grad_enabled(),
            torch.is_anomaly_enabled(),
            torch.are_deterministic_algorithms_enabled(),
            torch.get_num_threads(),
            torch.is_autocast_enabled("cpu"),
            len(torch.nn.modules.module._global_forward_hooks),
        )

    before = state()
    baseline = Baseline.capture()
    try:
        draws = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_anomaly_enabled(True)
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(before[4] + 1)
        torch.autocast("cpu", dtype=torch.bfloat16).__enter__()
        torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
        baseline.restore()
        assert state() == before
        assert (random.random(), float(np.random.rand()), torch.rand(2).tolist()) == draws
        # (Only our thread is asserted on: the test process may start threads of its own.)
        assert "sleeper" not in (baseline.leftovers() or "")
        sleeper = start_sleeper_thread()
        assert "thread(s) running (" in baseline.leftovers()
        assert "sleeper" in baseline.leftovers()
        sleeper.set()
    finally:
        baseline.restore()
        gc.unfreeze()


def start_sleeper_thread():
    """A thread named "sleeper" that runs until the returned event is set (10 s at most)."""
    import threading

    stop = threading.Event()
    threading.Thread(target=stop.wait, args=(10,), name="sleeper", daemon=True).start()
    return stop


PEER_PASSED = """
    import os
    import time

    import pytest

    from harness import LaunchSpec
    from recording import out_dir


    @pytest.mark.launch(LaunchSpec(nproc=2, timeout=40))
    def test_blocked_after_peer_passed():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            return
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
        finally:
            (out_dir() / "blocked-seconds").write_text(str(time.monotonic() - start))
"""


@pytest.mark.parametrize("reuse", [True, False], ids=["kept", "fresh"])
def test_a_rank_blocked_on_a_peer_that_passed_fails_when_the_peer_is_gone(tmp_path, reuse):
    root = write_project(tmp_path / "project", {"test_peer.py": PEER_PASSED})
    out = root / "out"
    args = ["--harness-max-procs", "2"] + (["--harness-reuse"] if reuse else [])
    session = run_session(root, *args, env=inner_env(out, root / "leases"))
    case = session.case("test_blocked_after_peer_passed")
    assert case.status == "failed"
    # The peer's leaving ends the collective (as its exit does for fresh
    # ranks), not the process-group timeout (32 s) nor the deadline.
    assert case.text.startswith("rank 0 failed: "), case.text
    assert "timed out" not in case.text.splitlines()[0].lower(), case.text
    assert float((out / "blocked-seconds").read_text()) < 32 / 2


def test_kept_group_without_a_process_group_says_where_to_call_it():
    import torch.distributed as dist

    import harness

    assert not dist.is_initialized(), "an earlier test left a default process group here"
    with pytest.raises(
        RuntimeError,
        match=r"harness.kept_group: torch.distributed has no "
        r"default process group here; call it on launched",
    ):
        harness.kept_group([0])
