"""Leases: exclusive across processes, all-or-nothing, bounded, crash-safe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness.devices import Card
from harness.launcher.lease import LeaseTimeout, acquire, card_want, read_holder, slot_want

CARDS = [Card("cuda", str(i)) for i in range(3)]

HOLD = textwrap.dedent("""
    import sys, time
    from harness.devices import Card
    from harness.launcher.lease import acquire, card_want
    lease = acquire(sys.argv[1], [card_want([Card("cuda", "0")], 1)], timeout=10, holder="holder script")
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def lease_dir(tmp_path):
    return str(tmp_path / "leases")


def start_holder(lease_dir: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, lease_dir], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_card_is_held_by_one_process_at_a_time(lease_dir):
    with acquire(lease_dir, [card_want(CARDS, 2)], timeout=0, holder="first") as first:
        assert first.cards() == CARDS[:2]
        # Another open of the lock file (same process or not) cannot take it.
        with acquire(lease_dir, [card_want(CARDS, 1)], timeout=0, holder="second") as second:
            assert second.cards() == [CARDS[2]]
        with pytest.raises(LeaseTimeout):
            acquire(lease_dir, [card_want(CARDS, 2)], timeout=0.2, holder="third")
    with acquire(lease_dir, [card_want(CARDS, 3)], timeout=0, holder="after release") as lease:
        assert lease.cards() == CARDS


def test_lease_is_all_or_nothing(lease_dir):
    with acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0, holder="holds cuda:0"):
        with pytest.raises(LeaseTimeout):
            acquire(lease_dir, [card_want(CARDS[:2], 2)], timeout=0.2, holder="wants two")
        # The failed attempt gave cuda:1 back instead of sitting on it.
        with acquire(lease_dir, [card_want(CARDS[1:2], 1)], timeout=0, holder="wants cuda:1"):
            pass


def test_slots_limit_processes_and_a_big_case_takes_them_all(lease_dir):
    assert slot_want(2, 4).count == 2
    with acquire(lease_dir, [slot_want(3, 2)], timeout=0, holder="two ranks") as lease:
        assert lease.resources == ("slot:0", "slot:1")
        with pytest.raises(LeaseTimeout, match=r"waited for 2 of the 3 process slots"):
            acquire(lease_dir, [slot_want(3, 2)], timeout=0.1, holder="two more")


def test_wait_is_bounded_and_names_what_it_waited_for_and_the_holder(lease_dir):
    holder = start_holder(lease_dir)
    try:
        start = time.monotonic()
        with pytest.raises(LeaseTimeout) as info:
            acquire(lease_dir, [card_want(CARDS[:2], 2)], timeout=0.5, holder="waiter")
        assert 0.5 <= time.monotonic() - start < 2.0
        message = str(info.value)
        assert f"lease wait timed out after 0.5 s (lease dir {lease_dir}):" in message
        assert "waited for 2 of the 2 cuda cards:" in message
        assert f"cuda:0: held by pid {holder.pid} (holder script; for " in message
        assert "cuda:1: free" in message
    finally:
        holder.kill()
        holder.wait()


def test_lease_of_a_sigkilled_holder_is_free_at_once(lease_dir):
    holder = start_holder(lease_dir)
    with pytest.raises(LeaseTimeout):
        acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0.1, holder="waiter")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=1, holder="next") as lease:
        assert read_holder(lease_dir, "cuda:0")["holder"] == "next"
        assert lease.cards() == CARDS[:1]


def test_lease_outlives_its_holder_while_processes_it_passed_it_to_run(lease_dir):
    lease = acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0, holder="launcher")
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=lease.fds()
    )
    try:
        # The launcher is done with it but its rank is not: the card stays busy.
        lease.release(holders_gone=False)
        with pytest.raises(LeaseTimeout):
            acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0.2, holder="next")
    finally:
        rank.kill()
        rank.wait()
    acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=1, holder="next").release()


def test_holder_record_lists_rank_pids(lease_dir):
    with acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0, holder="case") as lease:
        lease.annotate(ranks=[11, 12])
        record = read_holder(lease_dir, "cuda:0")
        assert record["pid"] == os.getpid()
        assert record["ranks"] == [11, 12]
        with pytest.raises(LeaseTimeout, match=r"ranks 11,12"):
            acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0, holder="x")


def test_impossible_request_fails_immediately(lease_dir):
    with pytest.raises(ValueError, match=r"cannot lease 4 cuda cards: only 3 exist"):
        acquire(lease_dir, [card_want(CARDS, 4)], timeout=60, holder="x")


def test_a_long_holder_record_stays_readable(lease_dir):
    with acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0, holder="x" * 5000) as lease:
        lease.annotate(ranks=list(range(100_000, 101_000)))
        record = read_holder(lease_dir, "cuda:0")
        assert record["pid"] == os.getpid()
        assert record["ranks"][:3] == [100_000, 100_001, 100_002]
    # ...and the file is still one the harness leases again.
    acquire(lease_dir, [card_want(CARDS[:1], 1)], timeout=0, holder="next").release()
