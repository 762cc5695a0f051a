"""Leases on a shared host hold across its users and against failures.

Other users are real local users (``harness-t1``, ``harness-t2``), created for
the session when the tests run as root (skipped otherwise); their sessions are
real processes leasing through the same directory.
"""

from __future__ import annotations

import contextlib
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
from harness.launcher.lease import acquire, slot_want

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


# -- leases hold across the users of a host -------------------------------------------

PRIME = """
    import sys
    from harness.launcher.lease import acquire, default_lease_dir, slot_want
    acquire(default_lease_dir(), [slot_want(1, 1)], timeout=10, holder="first user").release()
"""

LEASE_AGAIN = """
    from harness.launcher.lease import LeaseTimeout, acquire, default_lease_dir, slot_want
    lease_dir = default_lease_dir()
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


def test_a_lease_excludes_other_users_through_the_files_they_made(users, host_tmp):
    shared = shared_lease_dir(host_tmp)
    t1 = users["harness-t1"]
    code, output = run_as(t1, PRIME, tmp=host_tmp)  # harness-t1 creates the lock file
    assert code == 0, output
    # root leases the one slot through harness-t1's file; harness-t1 waits in vain.
    with acquire(str(shared), [slot_want(1, 1)], timeout=5, holder="root's case"):
        code, output = run_as(t1, LEASE_AGAIN, tmp=host_tmp)
    assert code == 0, output
    assert output.strip() == "refused"
    code, output = run_as(t1, LEASE_AGAIN, tmp=host_tmp)
    assert (code, output.strip()) == (0, "leased"), output


LEASE_DEFAULT = """
    from harness.launcher.lease import LeaseDirError, acquire, default_lease_dir, slot_want
    try:
        acquire(default_lease_dir(), [slot_want(1, 1)], timeout=1, holder="t1").release()
    except LeaseDirError as exc:
        print(exc)
    else:
        print("leased in", default_lease_dir())
"""


def test_the_documented_shared_dir_of_root_is_used_by_everyone(users, host_tmp):
    shared = shared_lease_dir(host_tmp)
    code, output = run_as(users["harness-t1"], LEASE_DEFAULT, tmp=host_tmp)
    assert code == 0, output
    assert output.strip() == f"leased in {shared}"


# -- a relative lease directory is resolved once -------------------------------------

CHDIR_CASES = """
    import pytest

    from harness import LaunchSpec
    from recording import record_card_use

    ON_THE_CARD = LaunchSpec(device="cuda", nproc=1, backend="gloo")


    @pytest.fixture(autouse=True)
    def elsewhere(tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)


    @pytest.mark.parametrize("case", "abcd")
    @pytest.mark.launch(ON_THE_CARD)
    def test_case(case):
        record_card_use(case)
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


# -- a holder record that cannot be written leaves the lease working --------------------

FULL_DISK = """
    import resource, signal, sys
    from harness.launcher.lease import LeaseTimeout, acquire, slot_want
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    lease_dir = sys.argv[1]
    acquire(lease_dir, [slot_want(1, 1)], timeout=1, holder="makes the files").release()
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))
    try:
        with acquire(lease_dir, [slot_want(1, 1)], timeout=1, holder="a holder longer than 16 bytes"):
            try:
                acquire(lease_dir, [slot_want(1, 1)], timeout=0, holder="meanwhile")
            except LeaseTimeout:
                print("held")
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


def test_a_holder_record_that_cannot_be_written_leaves_the_lease_working(tmp_path):
    # A full disk: the record only informs waiters; the lock is the lease.
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK), str(tmp_path / "leases")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["held", "free"], result.stdout


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
