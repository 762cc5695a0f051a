"""Lease directories on shared hosts: a planted symbolic link is never followed,
a bad directory is one usage error at session start, and unrelated projects on
one host lease cards from the same place.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from harness.devices import Card
from harness.launcher import lease as leases
from harness.launcher.lease import acquire, card_want, slot_want

CARD = [Card("cuda", "0")]
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
        ("cuda-0.lock", [card_want(CARD, 1)]),
        ("slot-0.lock", [slot_want(1, 1)]),
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


def test_lock_files_the_harness_creates_can_be_used_by_every_user(shared_dir):
    old = os.umask(0o077)
    try:
        acquire(str(shared_dir), [card_want(CARD, 1)], timeout=0, holder="x").release()
    finally:
        os.umask(old)
    # Other users' sessions lease through the same file and write their record into it.
    assert stat.S_IMODE((shared_dir / "cuda-0.lock").stat().st_mode) == 0o666


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
