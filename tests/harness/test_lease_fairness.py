"""Lease waits are served in order: a holder that gives its lease back and
leases again at once cannot starve a process that was already waiting.

Real processes take real locks in a lease directory of their own; they report
when they held what through JSON lines in a file.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_project import inner_env, pytest_command, read_card_uses, run_session, write_project

from harness.launcher import lease as leases
from harness.launcher.lease import Lease, acquire, slot_want

#: Leases both slots of 2 over and over, holding each lease ``hold`` seconds and
#: leasing again right after giving it back, until ``stop`` exists (or
#: ``rounds`` leases). What a kept pool does that another session contends
#: with: close, then lease again for its next case.
CHURNER = textwrap.dedent("""
    import json, os, sys, time
    from harness.launcher.lease import acquire, slot_want

    lease_dir, log, stop, rounds, hold = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    for i in range(rounds):
        if os.path.exists(stop):
            break
        lease = acquire(lease_dir, [slot_want(2, 2)], timeout=60, holder=f"churner round {i}")
        start = time.time()
        with open(log, "a") as f:
            f.write(json.dumps({"who": "churner", "round": i, "start": start}) + "\\n")
        time.sleep(hold)
        end = time.time()
        lease.release()
        with open(log, "a") as f:
            f.write(json.dumps({"who": "churner", "round": i, "start": start, "end": end}) + "\\n")
""")

#: Waits for both slots (bounded by ``timeout``), holds them ``hold`` seconds.
WAITER = textwrap.dedent("""
    import json, sys, time
    from harness.launcher.lease import LeaseTimeout, acquire, slot_want

    lease_dir, log, name, timeout, hold = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
    asked = time.time()
    try:
        lease = acquire(lease_dir, [slot_want(2, 2)], timeout=timeout, holder=name)
    except LeaseTimeout as exc:
        with open(log, "a") as f:
            f.write(json.dumps({"who": name, "timed_out": str(exc), "asked": asked}) + "\\n")
        sys.exit(3)
    start = time.time()
    time.sleep(hold)
    end = time.time()
    lease.release()
    with open(log, "a") as f:
        f.write(json.dumps({"who": name, "asked": asked, "start": start, "end": end}) + "\\n")
""")


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spawn(script: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for ``proc`` (killing it past ``timeout``) and return its output."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return output


def assert_no_overlap(intervals: list[tuple[str, float, float]]) -> None:
    ordered = sorted(intervals, key=lambda i: i[1])
    for (a, _, a_end), (b, b_start, _) in itertools.pairwise(ordered):
        assert a_end <= b_start, f"{a} and {b} held the slots at once: {ordered}"


def test_a_waiter_gets_its_turn_while_the_holder_releases_and_leases_again(tmp_path):
    lease_dir, log, stop = tmp_path / "leases", tmp_path / "log.jsonl", tmp_path / "stop"
    # Without the waiter, the churner would lease 80 times in a row (20 s);
    # the waiter's own bound is 10 s.
    churner = spawn(CHURNER, lease_dir, log, stop, 80, 0.25)
    waiter = None
    try:
        end = time.monotonic() + 30
        while not any(e.get("end") for e in read_log(log)) and time.monotonic() < end:
            time.sleep(0.02)  # until the churner has released and leased again at least once
        assert churner.poll() is None, finish(churner, 5)
        waiter = spawn(WAITER, lease_dir, log, "waiter", 10, 0.25)
        waiter_output = finish(waiter, 30)
        stop.touch()
        churner_output = finish(churner, 60)
    finally:
        stop.touch()
        for proc in (waiter, churner):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    entries = read_log(log)
    waited = [e for e in entries if e["who"] == "waiter"]
    assert waiter.returncode == 0, (waiter_output, waited)
    assert churner.returncode == 0, churner_output
    (served,) = waited
    # The churner went on leasing after the waiter was served: it was not done, it yielded.
    rounds = [e for e in entries if e["who"] == "churner" and "end" in e]
    assert any(r["start"] >= served["end"] for r in rounds), rounds
    assert_no_overlap(
        [("waiter", served["start"], served["end"])]
        + [(f"churner {r['round']}", r["start"], r["end"]) for r in rounds]
    )


def wait_for_queue(lease_dir: Path, length: int, proc: subprocess.Popen) -> None:
    end = time.monotonic() + 30
    while len(leases.waiters(str(lease_dir))) < length and time.monotonic() < end:
        assert proc.poll() is None, finish(proc, 5)
        time.sleep(0.02)
    assert len(leases.waiters(str(lease_dir))) == length


@contextlib.contextmanager
def queued(
    tmp_path: Path, hold: float = 0, name: str = "waiter"
) -> Iterator[tuple[str, Lease, subprocess.Popen]]:
    """Both slots of 2 held here, and a waiter for them (then holding them ``hold`` s)
    queued: (the lease directory, the holder's lease, the waiter)."""
    lease_dir = str(tmp_path / "leases")
    holder = acquire(lease_dir, [slot_want(2, 2)], timeout=0, holder="the holder")
    waiter = spawn(WAITER, lease_dir, tmp_path / "log.jsonl", name, 60, hold)
    try:
        wait_for_queue(tmp_path / "leases", 1, waiter)
        yield lease_dir, holder, waiter
    finally:
        holder.release()
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()


def test_a_newcomer_does_not_jump_the_queue(tmp_path):
    with queued(tmp_path, hold=0.2) as (lease_dir, holder, waiter):
        holder.release()
        # Free now, but promised to the waiter: a bounded newcomer gets it only after.
        with acquire(lease_dir, [slot_want(2, 1)], timeout=30, holder="newcomer"):
            got = time.time()
        output = finish(waiter, 30)
        assert waiter.returncode == 0, output
    (served,) = read_log(tmp_path / "log.jsonl")
    assert served["end"] <= got


def test_a_waiter_does_not_wait_behind_a_queue_for_other_resources(tmp_path):
    # The queue is for slots of 2 over; slots of 3 over are other lock
    # files (slot:2) only partly: slot:2 is free and nobody waits for it.
    with (
        queued(tmp_path) as (lease_dir, _, _),
        acquire(lease_dir, [slot_want(3, 1)], timeout=0, holder="other") as other,
    ):
        assert other.resources == ("slot:2",)


@pytest.mark.parametrize("held", [True, False])
def test_a_process_never_defers_to_a_waiter_for_what_it_holds_itself(tmp_path, held):
    """Deferring to a waiter that waits for this very process would deadlock it."""
    lease_dir = str(tmp_path / "leases")
    log = tmp_path / "log.jsonl"
    mine = acquire(lease_dir, [slot_want(3, 1)], timeout=0, holder="mine")  # slot:0
    waiter = spawn(WAITER, lease_dir, log, "waiter", 60, 0)  # wants slot:0 and slot:1
    try:
        wait_for_queue(tmp_path / "leases", 1, waiter)
        if not held:
            mine.release()
            # Now slot:0 is free and the waiter is served before anyone else.
            with acquire(lease_dir, [slot_want(2, 1)], timeout=30, holder="after"):
                pass
            assert read_log(log)[0]["who"] == "waiter"
        else:
            with acquire(lease_dir, [slot_want(3, 1)], timeout=0, holder="more") as more:
                assert more.resources == ("slot:1",)
    finally:
        mine.release()
        finish(waiter, 30)


def test_a_waiter_that_died_is_not_waited_for(tmp_path):
    with queued(tmp_path) as (lease_dir, holder, waiter):
        waiter.send_signal(signal.SIGKILL)
        waiter.wait()
        assert leases.waiters(lease_dir) == []
        holder.release()
        acquire(lease_dir, [slot_want(2, 2)], timeout=0, holder="next").release()


def test_a_timed_out_wait_names_who_is_queued_ahead(tmp_path):
    with (
        queued(tmp_path, name="first in line") as (lease_dir, _, waiter),
        pytest.raises(leases.LeaseTimeout) as info,
    ):
        acquire(lease_dir, [slot_want(2, 1)], timeout=0.3, holder="second in line")
    message = str(info.value)
    assert f"slot:0: held by pid {os.getpid()} (the holder; for " in message
    assert "queued behind 1 earlier waiter(s):" in message
    assert f"pid {waiter.pid} (first in line, waiting " in message


# -- the same through the plugin: kept pools, 2 process slots, 2-rank cases ----

#: Twelve 2-rank cases of 2 s each; once the other session is done the rest skip.
POOL_SESSION = """
    import os
    import time

    import pytest

    from recording import out_dir, record_card_use


    @pytest.mark.parametrize("n", range(12))
    @pytest.mark.launch(nproc=2)
    def test_two_ranks(n):
        if (out_dir() / "waiter-done").exists():
            pytest.skip("the other session is done")
        record_card_use(f"churner-{n}-rank{os.environ['RANK']}", seconds=2.0)
"""

WAITING_SESSION = """
    import os

    import pytest

    from recording import record_card_use


    @pytest.mark.launch(nproc=2)
    def test_two_ranks_too():
        record_card_use(f"waiter-rank{os.environ['RANK']}", seconds=0.5)
"""


def test_a_session_waiting_for_slots_is_not_starved_by_a_kept_pool(tmp_path):
    """2 process slots, two sessions of 2-rank cases: the busy one closes its pool
    for the waiting one and leases again for its next case; it must line up behind."""
    leases, out = tmp_path / "leases", tmp_path / "out"
    out.mkdir()
    env = inner_env(out, leases)
    busy_root = write_project(tmp_path / "busy", {"test_busy.py": POOL_SESSION}, reuse=True)
    waiting_root = write_project(tmp_path / "waiting", {"test_waiting.py": WAITING_SESSION})
    busy = subprocess.Popen(
        pytest_command(busy_root, "--harness-max-procs", "2"),
        cwd=busy_root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 120
        while not read_card_uses(out) and busy.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert read_card_uses(out), finish(busy, 5)  # its first case ran: its pool holds both slots
        # Without a fair handoff the busy session keeps both slots for its 12 cases
        # (over 24 s); in turn, the wait is about one case and a pool start.
        waiting = run_session(
            waiting_root,
            "--harness-max-procs",
            "2",
            "--harness-lease-timeout",
            "20",
            env=env,
            timeout=120,
        )
        (out / "waiter-done").touch()
        busy_output = finish(busy, 180)
    finally:
        (out / "waiter-done").touch()
        if busy.poll() is None:
            busy.kill()
            busy.communicate()
    assert waiting.case("test_two_ranks_too").status == "passed", waiting.output
    assert busy.returncode == 0, busy_output
    uses = read_card_uses(out)
    assert_no_overlap(
        [(u["case"], u["start"], u["end"]) for u in uses if u["case"].endswith("rank0")]
    )
