"""Lease directories on shared hosts: planted links are never followed, a bad
directory is one usage error at session start, and unrelated projects on one
host lease cards from the same place.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from harness.devices import Card
from harness.launcher import lease as leases
from harness.launcher.lease import acquire, card_want, slot_want

CARD = [Card("cuda", "0")]
#: This user's lock file of a resource (each user leases through its own).
UID = os.geteuid()
VICTIM_TEXT = "someone's precious file\n"


@pytest.fixture
def shared_dir(tmp_path):
    """A lease directory as the default one is: world-writable and sticky."""
    path = tmp_path / "leases"
    path.mkdir()
    path.chmod(0o777 | stat.S_ISVTX)
    return path


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    path.chmod(0o600)
    return path


def assert_untouched(victim) -> None:
    assert victim.read_text() == VICTIM_TEXT
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def lease_and_catch(lease_dir, wants, timeout: float = 1.0):
    try:
        acquire(str(lease_dir), wants, timeout=timeout, holder="a test").release()
    except Exception as exc:  # the victim is checked before the error's type
        return exc
    return None


@pytest.mark.parametrize(
    ("link", "wants"),
    [
        (f"cuda-0.u{UID}.lock", [card_want(CARD, 1)]),
        (f"slot-0.u{UID}.lock", [slot_want(1, 1)]),
    ],
    ids=["card", "slot"],
)
def test_a_planted_symlink_leaves_its_target_alone(shared_dir, victim, link, wants):
    (shared_dir / link).symlink_to(victim)
    error = lease_and_catch(shared_dir, wants)
    assert_untouched(victim)
    assert isinstance(error, leases.LeaseFileError), error
    assert str(error).startswith(f"lease file {shared_dir / link} is a symbolic link")
    assert "remove it" in str(error)


def test_a_planted_hard_link_leaves_its_target_alone(shared_dir, victim):
    os.link(victim, shared_dir / f"cuda-0.u{UID}.lock")
    error = lease_and_catch(shared_dir, [card_want(CARD, 1)])
    assert_untouched(victim)
    assert isinstance(error, leases.LeaseFileError), error
    assert "has 2 links" in str(error)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's files")
def test_a_held_lock_file_given_a_second_link_is_still_held(shared_dir):
    # Regression: another user's lock file with a second hard link (its owner made one, or
    # anyone where protected_hardlinks is off) counted as free: two sessions held one slot.
    theirs = shared_dir / "slot-0.u4242.lock"
    fd = os.open(theirs, os.O_RDWR | os.O_CREAT, 0o644)
    os.fchown(fd, 4242, 4242)  # uid 4242's lock file (root makes it here)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # its holder's lease
        os.link(theirs, shared_dir / "another-name")
        error = lease_and_catch(shared_dir, [slot_want(1, 1)], timeout=0.5)
        assert isinstance(error, leases.LeaseTimeout), error
        assert "slot:0: held by a process that left no record" in str(error)
    finally:
        os.close(fd)
    assert lease_and_catch(shared_dir, [slot_want(1, 1)]) is None  # released: free


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's files")
def test_a_queue_file_linked_under_a_lock_files_name_holds_nothing(shared_dir):
    # Regression (of the fix above): anyone may link a queue file (mode 666) under a lock
    # file's name; its waiter's own lock then made the resource "held" by that waiter, who
    # timed out waiting for itself.
    waiter = shared_dir / "waiter-0.lock"
    fd = os.open(waiter, os.O_RDWR | os.O_CREAT, 0o666)
    os.fchown(fd, 4242, 4242)
    try:
        os.write(fd, json.dumps({"ticket": 1, "pid": os.getpid(), "holder": "w"}).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)  # a waiter, alive
        os.link(waiter, shared_dir / "slot-0.u4242.lock")
        assert lease_and_catch(shared_dir, [slot_want(1, 1)], timeout=0.5) is None
    finally:
        os.close(fd)


def test_a_lock_file_nobody_else_may_read_is_named_when_a_wait_times_out(shared_dir, monkeypatch):
    # Regression: the timeout said "held by a process that left no record", with no word of
    # the file counted as held because its owner's mode hides it.
    theirs = shared_dir / "slot-0.u4242.lock"
    theirs.write_text("")
    theirs.chmod(0)
    if os.geteuid() == 0:  # root opens any file: the open another user would make, refused
        real_open = os.open

        def refused(path, *args, **kwargs):
            if path == theirs.name:
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", refused)
    error = lease_and_catch(shared_dir, [slot_want(1, 1)], timeout=0.3)
    assert isinstance(error, leases.LeaseTimeout), error
    assert (
        f"slot:0: counted as held, whether or not it is: cannot open lease file {theirs}: "
        "Permission denied"
    ) in str(error), error
    assert "its owner can chmod 644 it" in str(error)  # others read a lock file, never write it


def test_planted_queue_files_leave_their_targets_alone(shared_dir, victim, tmp_path):
    # The queue's waiter files are skipped when planted; the ticket counter is refused.
    (shared_dir / "waiter-0.lock").symlink_to(victim)
    with acquire(str(shared_dir), [card_want(CARD, 1)], timeout=0, holder="holder"):
        got: list = []
        waiter = threading.Thread(
            target=lambda: got.append(lease_and_catch(shared_dir, [card_want(CARD, 1)], timeout=30))
        )
        waiter.start()
        end = time.monotonic() + 10
        while not leases.waiters(str(shared_dir)) and time.monotonic() < end:
            time.sleep(0.02)
        assert [w["holder"] for w in leases.waiters(str(shared_dir))] == ["a test"]
    waiter.join(30)
    assert got == [None]
    assert_untouched(victim)
    other = tmp_path / "other"
    other.mkdir()
    (other / "tickets").symlink_to(victim)
    with acquire(str(other), [card_want(CARD, 1)], timeout=0, holder="holder"):
        error = lease_and_catch(other, [card_want(CARD, 1)], timeout=0.5)
    assert_untouched(victim)
    assert isinstance(error, leases.LeaseFileError), error


def test_a_file_the_harness_did_not_write_is_left_alone(shared_dir):
    notes = shared_dir / f"cuda-0.u{UID}.lock"
    notes.write_text(VICTIM_TEXT)
    notes.chmod(0o600)
    error = lease_and_catch(shared_dir, [card_want(CARD, 1)])
    assert_untouched(notes)
    assert isinstance(error, leases.LeaseFileError), error
    assert "holds something the harness never writes there" in str(error)


def test_lock_files_the_harness_creates_can_be_looked_at_by_every_user(shared_dir):
    old = os.umask(0o077)
    try:
        acquire(str(shared_dir), [card_want(CARD, 1)], timeout=0, holder="x").release()
    finally:
        os.umask(old)
    # Other users' sessions look whether it is locked and who holds it.
    assert stat.S_IMODE((shared_dir / f"cuda-0.u{UID}.lock").stat().st_mode) == 0o644


def test_a_symlinked_default_lease_dir_is_refused(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o777 | stat.S_ISVTX)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp / "harness-leases").symlink_to(elsewhere)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.delenv("HARNESS_LEASE_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    path, source = leases.resolve_lease_dir(None)
    assert path == str(tmp / "harness-leases")
    with pytest.raises(leases.LeaseDirError, match=r"is a symbolic link in the world-writable"):
        leases.check_lease_dir(path, source)
    assert list(elsewhere.iterdir()) == []


# -- a bad lease directory is one usage error at session start ---------------

NEEDS_A_CARD = """
    import pytest


    @pytest.mark.parametrize("device", ["cuda"])
    @pytest.mark.parametrize("n", range(3))
    def test_plain_needs_a_card(device, n):
        pass


    def test_needs_nothing():
        pass
"""


@pytest.fixture
def card_project(pytester, monkeypatch):
    monkeypatch.setenv("HARNESS_CARDS", "cuda:0")
    monkeypatch.delenv("HARNESS_LEASE_DIR", raising=False)
    pytester.makepyfile(test_cards=textwrap.dedent(NEEDS_A_CARD))
    return pytester


def assert_one_usage_error(result, *words: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    output = result.stdout.str() + result.stderr.str()
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1, output
    for word in words:
        assert word in errors[0], errors[0]
    assert "Traceback" not in output, output
    assert "NotADirectoryError" not in output, output


def test_a_lease_dir_that_is_a_file_is_one_usage_error(card_project, tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    result = card_project.runpytest_subprocess(
        f"--harness-lease-dir={not_a_dir}", "-p", "no:cacheprovider"
    )
    assert_one_usage_error(
        result, f"harness lease directory {not_a_dir}", "--harness-lease-dir", "is not a directory"
    )


def test_a_lease_dir_that_cannot_be_created_is_one_usage_error(card_project, tmp_path, monkeypatch):
    under_a_file = tmp_path / "a-file" / "leases"
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HARNESS_LEASE_DIR", str(under_a_file))
    result = card_project.runpytest_subprocess("-p", "no:cacheprovider")
    assert_one_usage_error(
        result,
        f"harness lease directory {under_a_file}",
        "(set by $HARNESS_LEASE_DIR)",
        "cannot be created",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_a_lease_dir_that_is_not_writable_is_one_usage_error(card_project, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    result = card_project.runpytest_subprocess(
        f"--harness-lease-dir={locked}", "-p", "no:cacheprovider"
    )
    assert_one_usage_error(
        result, f"harness lease directory {locked}", "--harness-lease-dir", "is not writable"
    )


def test_an_unusable_default_lease_dir_stops_only_the_cases_that_lease(
    card_project, tmp_path, monkeypatch
):
    # Regression: the host-wide default, made by another user (or left unusable), stopped
    # every pytest session with the plugin installed, those of projects that lease nothing
    # too, with exit 4.
    tmp = tmp_path / "host-tmp"
    tmp.mkdir()
    (tmp / "harness-leases").mkdir()
    (tmp / "harness-leases").chmod(0o777)  # no sticky bit: refused
    monkeypatch.setenv("TMPDIR", str(tmp))
    result = card_project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=3)
    problem = f"harness lease directory {tmp}/harness-leases (set by the default"
    result.stdout.fnmatch_lines(
        [f"harness: cases that lease cards or process slots will fail: {problem}*"]
    )
    assert result.stdout.str().count("is world-writable without the sticky bit") >= 4


def test_a_lease_dir_the_harness_creates_is_usable_whatever_the_umask(card_project, tmp_path):
    # Regression: under umask 000 the harness made a named lease directory 777, then
    # refused it (world-writable without the sticky bit), in that session and every later one.
    named = tmp_path / "not-yet" / "leases"
    old = os.umask(0)
    try:
        result = card_project.runpytest_subprocess(
            f"--harness-lease-dir={named}", "-p", "no:cacheprovider"
        )
    finally:
        os.umask(old)
    result.assert_outcomes(passed=4)
    assert stat.S_IMODE(named.stat().st_mode) == 0o700
    # ... and the folders made for it are no one else's to write (a rename moved it away).
    assert stat.S_IMODE(named.parent.stat().st_mode) == 0o755


# -- unrelated projects on one host exclude each other for cards ---------------

HOLD_WITH_DEFAULTS = textwrap.dedent("""
    import sys, time
    from harness.devices import Card
    from harness.launcher.lease import acquire, card_want, default_lease_dir
    lease = acquire(default_lease_dir(), [card_want([Card("cuda", "0")], 1)], timeout=10,
                    holder="project one")
    print("held", flush=True)
    time.sleep(60)
""")


def test_unrelated_projects_share_the_card_leases_of_the_host(card_project, tmp_path, monkeypatch):
    # Neither project sets a lease directory: both use the host's default.
    tmp = tmp_path / "host-tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    project_one = tmp_path / "project-one"
    project_one.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_WITH_DEFAULTS],
        cwd=project_one,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = card_project.runpytest_subprocess(
            "--harness-lease-timeout=0.5", "-p", "no:cacheprovider"
        )
    finally:
        holder.kill()
        holder.wait()
    result.assert_outcomes(passed=1, errors=3)
    result.stdout.fnmatch_lines(
        [
            f"*lease wait timed out after * (lease dir {tmp}/harness-leases):",
            f"*cuda:0: held by pid {holder.pid} (project one; for *",
        ]
    )
