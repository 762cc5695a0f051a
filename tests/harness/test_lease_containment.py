"""Leases on a shared host hold against other users and against failures.

Other users are real local users (``harness-t1``, ``harness-t2``), created for
the session when the tests run as root (skipped otherwise); their sessions are
real processes leasing through the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest
from launch_project import (
    assert_disjoint_per_card,
    inner_env,
    read_card_uses,
    run_session,
    write_project,
)

from harness.launcher import lease as leases
from harness.launcher.case import Settings
from harness.launcher.lease import LeaseDirError, LeaseTimeout, acquire, slot_want

REPO = str(Path(__file__).resolve().parents[2])
USERS = ("harness-t1", "harness-t2")


@pytest.fixture(scope="session")
def users():
    """Two throwaway local users, removed at the end of the session."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("creating local users needs root and useradd")
    made = []
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                check=True,
                capture_output=True,
            )
            made.append(name)
    try:
        yield {name: pwd.getpwnam(name) for name in USERS}
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def host_tmp():
    """A system-temp stand-in every user can enter (tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="harness-host-tmp-", dir="/tmp"))
    path.chmod(0o777 | stat.S_ISVTX)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_as(
    user: pwd.struct_passwd, script: str, *args: object, tmp: Path, timeout: float = 60
) -> tuple[int, str]:
    """Run ``script`` as ``user`` with ``tmp`` as its system temp directory, in a
    fork of this process (the interpreter lives where other users cannot
    enter); return its exit status and output."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child leaves by os._exit
        code = 1
        try:
            os.close(read_end)
            os.closerange(3, write_end)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.environ.pop("HARNESS_LEASE_DIR", None)
            os.environ.update(TMPDIR=str(tmp), HOME=str(tmp))
            tempfile.tempdir = None
            os.chdir(tmp)
            out = os.fdopen(write_end, "w")
            sys.stdout = sys.stderr = out
            sys.argv = ["-c", *map(str, args)]
            exec(compile(textwrap.dedent(script), "<as user>", "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.append(_read_all(read_end)))
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        os.kill(pid, signal.SIGKILL)
        reader.join()
    _, status = os.waitpid(pid, 0)
    os.close(read_end)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data


HOLD_SLOT = textwrap.dedent("""
    import sys, time
    from harness.launcher.lease import acquire, slot_want
    lease = acquire(sys.argv[1], [slot_want(1, 1)], timeout=10, holder="slot holder")
    print("held", flush=True)
    time.sleep(60)
""")


def start_slot_holder(lease_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_SLOT, str(lease_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


def wait_for_waiter(lease_dir: Path) -> None:
    end = time.monotonic() + 20
    while not leases.waiters(str(lease_dir)):
        assert time.monotonic() < end, "the lease wait never joined the queue"
        time.sleep(0.02)


# -- the directory is opened once ---------------------------------------------


def test_a_directory_swapped_for_a_link_during_a_wait_redirects_nothing(tmp_path):
    lease_dir, elsewhere = tmp_path / "leases", tmp_path / "elsewhere"
    elsewhere.mkdir()
    holder = start_slot_holder(lease_dir)
    got: list = []

    def wait() -> None:
        try:
            acquire(str(lease_dir), [slot_want(1, 1)], timeout=3, holder="waiter").release()
            got.append("leased")
        except LeaseTimeout as exc:
            got.append(exc)

    try:
        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_for_waiter(lease_dir)
        # What the directory's owner can do at any time: move it away and put
        # a link to a directory of its choosing in its place.
        lease_dir.rename(tmp_path / "moved")
        lease_dir.symlink_to(elsewhere)
        waiter.join(30)
    finally:
        stop(holder)
    assert list(elsewhere.iterdir()) == []
    assert len(got) == 1, got
    assert isinstance(got[0], LeaseTimeout), got  # the slot stayed held


# -- other users cannot break a lease -------------------------------------------

PRIME = """
    import sys
    from harness.launcher.lease import acquire, default_lease_dir, slot_want
    acquire(default_lease_dir(), [slot_want(1, 1)], timeout=10, holder="first user").release()
"""

UNLINK_AND_LEASE = """
    import os, sys
    from harness.launcher.lease import LeaseTimeout, acquire, default_lease_dir, slot_want
    lease_dir = default_lease_dir()
    for name in os.listdir(lease_dir):
        if name.startswith("slot-0"):
            try:
                os.unlink(os.path.join(lease_dir, name))
            except OSError:
                pass
    try:
        acquire(lease_dir, [slot_want(1, 1)], timeout=1, holder="second session").release()
    except LeaseTimeout:
        print("refused")
    else:
        print("leased")
"""


def shared_lease_dir(host_tmp: Path) -> Path:
    """The host-wide default, as root makes it: root's, mode 1777."""
    shared = host_tmp / "harness-leases"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def test_the_owner_of_lock_files_cannot_break_another_users_lease(users, host_tmp, monkeypatch):
    shared = shared_lease_dir(host_tmp)
    t1 = users["harness-t1"]
    code, output = run_as(t1, PRIME, tmp=host_tmp)
    assert code == 0, output
    # root leases the one slot; harness-t1 deletes what it can and leases it.
    with acquire(str(shared), [slot_want(1, 1)], timeout=5, holder="root's case"):
        code, output = run_as(t1, UNLINK_AND_LEASE, tmp=host_tmp)
    assert code == 0, output
    assert output.strip() == "refused"


def test_another_users_lease_dir_is_refused_naming_its_owner(users, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, users["harness-t1"].pw_uid, users["harness-t1"].pw_gid)
    with pytest.raises(LeaseDirError) as info:
        acquire(str(theirs), [slot_want(1, 1)], timeout=0, holder="root")
    message = str(info.value)
    assert f"harness lease directory {theirs}" in message
    assert (
        f"is owned by harness-t1 (uid {users['harness-t1'].pw_uid}), not by you (root (uid 0))"
        in message
    )
    assert "install -d -o root -m 1777" in message
    assert list(theirs.iterdir()) == []


LEASE_DEFAULT = """
    from harness.launcher.lease import LeaseDirError, acquire, default_lease_dir, slot_want
    try:
        acquire(default_lease_dir(), [slot_want(1, 1)], timeout=1, holder="t1").release()
    except LeaseDirError as exc:
        print(exc)
    else:
        print("leased in", default_lease_dir())
"""


def test_a_per_user_fallback_made_by_someone_else_is_refused(users, host_tmp):
    t1, t2 = users["harness-t1"], users["harness-t2"]
    shared = host_tmp / "harness-leases"
    shared.mkdir(mode=0o755)  # root's and closed: harness-t1 falls back to its own
    fallback = host_tmp / f"harness-leases-{t1.pw_uid}"
    fallback.mkdir()
    fallback.chmod(0o1777)
    os.chown(fallback, t2.pw_uid, t2.pw_gid)
    code, output = run_as(t1, LEASE_DEFAULT, tmp=host_tmp)
    assert code == 0, output
    assert f"harness lease directory {fallback}" in output
    assert f"is owned by harness-t2 (uid {t2.pw_uid}), not by you (harness-t1" in output


def test_the_documented_shared_dir_of_root_is_used_by_everyone(users, host_tmp):
    shared = shared_lease_dir(host_tmp)
    code, output = run_as(users["harness-t1"], LEASE_DEFAULT, tmp=host_tmp)
    assert code == 0, output
    assert output.strip() == f"leased in {shared}"


# -- forged waiter records --------------------------------------------------------

HOLD_FLOCK = """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(60)
"""


def forge_waiter(lease_dir: Path) -> tuple[Path, subprocess.Popen]:
    """A waiter record for every slot claiming pid 1, its file locked by some process."""
    lease_dir.mkdir(exist_ok=True)
    forged = lease_dir / "waiter-0.lock"
    forged.write_text(
        json.dumps(
            {
                "ticket": 0,
                "pid": 1,
                "holder": "x",
                "since": time.time(),
                "wants": [{"what": "slots", "names": ["slot:0"], "count": 1}],
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD_FLOCK), str(forged)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    return forged, proc


def test_a_forged_waiter_record_is_not_waited_for(tmp_path):
    lease_dir = tmp_path / "leases"
    _, locker = forge_waiter(lease_dir)
    try:
        assert leases.waiters(str(lease_dir)) == []
        acquire(str(lease_dir), [slot_want(1, 1)], timeout=2, holder="a case").release()
    finally:
        stop(locker)


def test_a_timed_out_wait_names_the_waiter_files(tmp_path):
    lease_dir = tmp_path / "leases"
    forged, locker = forge_waiter(lease_dir)
    holder = start_slot_holder(lease_dir)
    try:
        with pytest.raises(LeaseTimeout) as info:
            acquire(str(lease_dir), [slot_want(1, 1)], timeout=0.5, holder="a case")
    finally:
        stop(holder)
        stop(locker)
    message = str(info.value)
    assert (
        f"ignored a forged waiter record: {forged} (its record names pid 1; pid {locker.pid}"
        in message
    )
    assert "pid 1 (" not in message


# -- a relative lease directory is resolved once -------------------------------------

CHDIR_CASES = """
    import pytest

    from harness import LaunchSpec
    from recording import record_card_use

    ON_THE_CARD = LaunchSpec(device="cuda", nproc=1, backend="gloo")


    @pytest.fixture(autouse=True)
    def elsewhere(tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)


    @pytest.mark.launch(ON_THE_CARD)
    def test_a():
        record_card_use("a")


    @pytest.mark.launch(ON_THE_CARD)
    def test_b():
        record_card_use("b")


    @pytest.mark.launch(ON_THE_CARD)
    def test_c():
        record_card_use("c")


    @pytest.mark.launch(ON_THE_CARD)
    def test_d():
        record_card_use("d")
"""


def test_a_relative_lease_dir_is_one_place_for_the_whole_session(tmp_path):
    root = write_project(tmp_path / "project", {"test_chdir.py": CHDIR_CASES})
    env = inner_env(root / "out", root / "unused", cards="cuda:0")
    del env["HARNESS_LEASE_DIR"]
    session = run_session(
        root, "-n", "2", "--harness-lease-dir=leases", "--harness-max-procs=8", env=env
    )
    assert session.returncode == 0, session.output
    uses = read_card_uses(root / "out")
    assert sorted(u["case"] for u in uses) == ["a", "b", "c", "d"]
    assert_disjoint_per_card(uses)
    assert (root / "leases").is_dir()


def test_settings_hold_an_absolute_lease_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Settings(lease_dir="leases").lease_dir == str(tmp_path / "leases")
    assert leases.resolve_lease_dir("leases") == (str(tmp_path / "leases"), "--harness-lease-dir")
    monkeypatch.setenv("HARNESS_LEASE_DIR", "rel")
    assert leases.resolve_lease_dir(None) == (str(tmp_path / "rel"), "$HARNESS_LEASE_DIR")


# -- a failure after locking gives the locks back ----------------------------------------

FULL_DISK = """
    import resource, signal, sys
    from harness.launcher.lease import LeaseError, LeaseTimeout, acquire, slot_want
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    lease_dir = sys.argv[1]
    acquire(lease_dir, [slot_want(1, 1)], timeout=1, holder="makes the files").release()
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))
    try:
        acquire(lease_dir, [slot_want(1, 1)], timeout=1, holder="a holder longer than 16 bytes")
    except LeaseError as exc:
        print("error:", type(exc).__name__, exc)
    except BaseException as exc:
        print("raw:", type(exc).__name__, exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        acquire(lease_dir, [slot_want(1, 1)], timeout=0, holder="next case").release()
    except LeaseTimeout:
        print("still held")
    else:
        print("free")
"""


def test_a_holder_record_that_cannot_be_written_gives_the_lease_back(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK), str(tmp_path / "leases")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    error, after = result.stdout.splitlines()
    assert error.startswith(
        "error: LeaseError cannot write the holder record into lease file "
        f"{tmp_path / 'leases'}/slot-0.u{os.geteuid()}.lock: File too large"
    ), error
    assert "given back" in error
    assert after == "free"


def test_the_flock_holder_is_read_from_the_system(tmp_path):
    path = tmp_path / "f"
    path.write_text("")
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        holders = leases._flock_holders(os.fstat(fd))
    finally:
        os.close(fd)
    assert holders in ({os.getpid()}, None)


# -- another user's `harness run` output folder ------------------------------------------

CLAIM = """
    import sys
    from pathlib import Path

    from harness.suites.run import _Refused, claim_out

    try:
        with claim_out(Path(sys.argv[1]), "their run"):
            print("claimed")
    except _Refused as e:
        print("refused:", e)
"""


def test_an_output_folder_held_by_another_user_is_refused_naming_the_run(users, host_tmp):
    # Regression: the lock file, created 0o644 by its first user, could not be opened
    # for writing by a second one: a PermissionError traceback instead of the refusal.
    from harness.suites.run import claim_out

    out = host_tmp / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    with claim_out(out, "harness run cpu"):
        code, text = run_as(users["harness-t1"], CLAIM, out, tmp=host_tmp)
        assert code == 0, text
        assert "refused: harness run: the output folder" in text, text
        assert f"pid {os.getpid()}: harness run cpu" in text, text
    code, text = run_as(users["harness-t1"], CLAIM, out, tmp=host_tmp)
    assert (code, text.strip()) == (0, "claimed"), text
