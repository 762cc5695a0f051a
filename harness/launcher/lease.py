"""Exclusive, crash-safe, first-come-first-served leases on accelerator cards
and CPU process slots.

Every pytest process on the host (xdist workers, concurrent sessions, other
projects, scripts calling ``harness.launch``) leases through one
*lease directory*. Each resource has one lock file per user in it::

    <lease dir>/cuda-0.u1000.lock   card cuda:0, as leased by uid 1000
    <lease dir>/npu-3.u0.lock       card npu:3, as leased by root
    <lease dir>/slot-0.u1000.lock   CPU process slot 0 (slot-0 .. slot-<max_procs-1>)

A resource is held while a process holds an exclusive ``flock`` on one of
its files. A lease locks its own user's file, then looks at every other
user's file of that resource: one locked means the resource is taken, and the
lease lets its own go again. Both sides look only after locking their own,
so two users can never both go on. The OS drops a lock when the last process
holding it exits, however it exits, so a crashed holder never leaves a stale
lease. The holder writes who it is (pid, what it runs, since when, its rank
pids) into its locked file so a waiter that gives up can say who holds what.
Cards are a host-wide resource: the default directory is one per host,
shared by every project and user.

Lock files are never deleted: deleting a lock file while someone holds it
would let a second process lock a new file of the same name. A user's lock
files are its own: in a sticky directory nobody but their owner (and the
directory's owner, which must be the user or root) can delete them, so no
other user can break a lease.

**Waiters are served in order.** A lease that cannot be had at once joins a
queue: it takes the next number from ``<lease dir>/tickets`` and holds an
exclusive ``flock`` on a *waiter file* (``waiter-<k>.lock``) holding its
ticket and what it wants, until its wait ends (the OS drops that lock too
when a waiter dies, so a dead waiter is never waited for; a record naming a
pid other than the one holding its lock is forged and ignored). Every lease,
a newcomer's or a queued one's, leaves alone what a waiter with an earlier
ticket wants; so a holder that gives its resources back and leases again at
once (a kept pool yielding between cases) lines up behind whoever was
waiting. The one exception avoids a deadlock: a waiter that wants something
this very process holds cannot be served before this process goes on, so it
is not deferred to. A holder that could give its resources back early (an
idle pool of rank processes) checks ``Lease.contended()`` (does a waiter
want them?) and yields. Within one process, a wait that finds resources busy
first asks the registered *yield hooks* (``add_yield_hook``) to free what
this very process holds idle.

**Shared directories are hostile ground.** The default directory is in the
world-writable system temp directory, so any user can plant entries in it.
A lease opens its directory once (``O_DIRECTORY | O_NOFOLLOW``) and does
everything after relative to that descriptor, so swapping the directory for
a link meanwhile redirects nothing. A directory owned by another user is
refused (its owner could delete the lock files in it), except the host-wide
default when root owns it with mode 1777. Files in a lease directory are
opened with ``O_NOFOLLOW`` and must be plain files with one link: a planted
symbolic or hard link to someone's file is refused with an error naming it,
never followed, written, truncated or chmod'ed. Only a file this harness has
just created (``O_EXCL``) is made world-writable (queue files) or
world-readable (lock files, which other users' sessions look at).

The locks are ``fcntl.flock`` rather than ``filelock.FileLock`` because
filelock opens lock files with ``O_TRUNC`` (erasing the holder record on every
attempt) and hides the descriptor, which the launcher passes to the ranks so
that a card stays leased until the ranks using it are gone, even when the
pytest process that leased it is killed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import random
import re
import socket
import stat
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from harness.devices import Card
from harness.errors import HarnessError

LEASE_DIR_ENV = "HARNESS_LEASE_DIR"
#: Where a lease directory came from, as ``resolve_lease_dir`` names it.
LEASE_DIR_OPTION = "--harness-lease-dir"
_HOLDER_RECORD_MAX = 4096
_TICKETS = "tickets"
_WAITER_RE = re.compile(r"waiter-(\d+)\.lock")
_LOCK_RE = re.compile(r"(.+)\.u(\d+)\.lock")
#: Longest pause between two looks of a waiting lease: also the longest a
#: waiter lets a resource promised to it lie idle.
_POLL_MAX_S = 0.2
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
#: The mode of a host-wide lease directory: everyone may add files, only
#: their owners (and root) may delete them.
_SHARED_MODE = 0o1777


class LeaseError(HarnessError, RuntimeError):
    """A lease could not be had. The message says what, where and why."""


class LeaseTimeout(LeaseError, TimeoutError):
    """A lease wait ran past its bound. The message names what was wanted and who holds it."""


class LeaseFileError(LeaseError):
    """A file in the lease directory cannot be used safely (a planted link, not a
    plain file, not ours to write). The message names the file and what to do."""


class LeaseDirError(LeaseError):
    """The lease directory is unusable. The message names it and what set it."""


class _Unreadable(LeaseFileError):
    """A lease file we may not open (its owner's mode): what it holds is unknown."""


def _default_source() -> str:
    return f"the default (neither {LEASE_DIR_OPTION} nor ${LEASE_DIR_ENV} is set)"


def _shared_dir() -> str:
    return os.path.join(os.path.abspath(tempfile.gettempdir()), "harness-leases")


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def default_lease_dir() -> str:
    """``$HARNESS_LEASE_DIR``, else ``<system temp>/harness-leases`` (absolute).

    The default is shared by every user and project on the host (cards are a
    host-wide resource); when another user created it without letting us
    write, a per-user directory ``harness-leases-<uid>`` is used instead.
    """
    return resolve_lease_dir(None)[0]


def resolve_lease_dir(option: str | None) -> tuple[str, str]:
    """The lease directory to use, as an absolute path, and what chose it.

    ``option`` is ``--harness-lease-dir``'s value (None: not given); then
    ``$HARNESS_LEASE_DIR``; then the host-wide default. A relative path is
    resolved against the current directory now, once: a session that
    resolves it at start keeps leasing in the same place whatever directory
    its tests change to. The second item names the source:
    ``"--harness-lease-dir"``, ``"$HARNESS_LEASE_DIR"`` or a phrase saying it
    is the default.
    """
    if option:
        return os.path.abspath(option), LEASE_DIR_OPTION
    env = os.environ.get(LEASE_DIR_ENV)
    if env:
        return os.path.abspath(env), f"${LEASE_DIR_ENV}"
    shared = _shared_dir()
    if (
        os.path.isdir(shared)
        and not os.path.islink(shared)
        and not os.access(shared, os.W_OK | os.X_OK)
    ):
        return f"{shared}-{os.getuid()}", _default_source()
    return shared, _default_source()


class _Dir:
    """An open lease directory: every file operation goes through ``fd``
    (``dir_fd=``), never through the path again; ``path`` is for messages."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.fd)
        except OSError:
            return []

    def dup(self) -> _Dir:
        return _Dir(self.path, os.dup(self.fd))

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> _Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_dir(path: str, source: str, *, create: bool = True) -> _Dir:
    """Open (creating if missing, with ``create``) and check lease directory
    ``path``; see ``check_lease_dir``."""

    def fail(
        problem: str,
        fix: str = f"point {LEASE_DIR_OPTION} or ${LEASE_DIR_ENV} at a writable directory",
    ) -> LeaseDirError:
        return LeaseDirError(f"harness lease directory {path} (set by {source}) {problem}; {fix}")

    path = os.path.abspath(path)
    shared = path == _shared_dir()
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        if not create:
            raise fail("does not exist") from None
        made = []  # the folders this call creates, the lease directory's parents included
        parent = path
        while not os.path.lexists(parent) and parent != os.path.dirname(parent):
            made.append(parent)
            parent = os.path.dirname(parent)
        try:
            os.makedirs(path, mode=0o700)
        except FileExistsError:
            pass  # another process made it meanwhile
        except OSError as exc:
            raise fail(f"cannot be created ({exc.strerror})") from None
        else:
            # Not left to the umask (000 made them 777: anyone could rename the lease
            # directory away, or it was refused below).
            for folder in made[1:]:
                with contextlib.suppress(OSError):
                    os.chmod(folder, stat.S_IMODE(os.stat(folder).st_mode) & ~0o022)
            with contextlib.suppress(OSError):
                os.chmod(path, _SHARED_MODE if shared else 0o700)
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise fail(f"cannot be examined ({exc.strerror})") from None
    except OSError as exc:
        raise fail(f"cannot be examined ({exc.strerror})") from None
    target = path
    if stat.S_ISLNK(st.st_mode):
        parent = os.path.dirname(path)
        with contextlib.suppress(OSError):
            if os.stat(parent).st_mode & stat.S_IWOTH:
                raise fail(
                    f"is a symbolic link in the world-writable {parent}, which anyone "
                    "could have planted; it is not followed"
                )
        target = os.path.realpath(path)
    elif not stat.S_ISDIR(st.st_mode):
        raise fail("is not a directory")
    try:
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise fail("became a symbolic link while being opened; it is not followed") from None
        if exc.errno == errno.ENOTDIR:
            raise fail("is not a directory") from None
        raise fail(f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        me = os.geteuid()
        if st.st_uid != me and not (
            st.st_uid == 0 and shared and mode & _SHARED_MODE == _SHARED_MODE
        ):
            raise fail(
                f"is owned by {_user(st.st_uid)}, not by you ({_user(me)}): its owner can delete "
                "the lock files your leases hold",
                f"point {LEASE_DIR_OPTION} or ${LEASE_DIR_ENV} at a directory you own, or, for "
                f"the host-wide default, have root create it: install -d -o root -m 1777 {_shared_dir()}",
            )
        if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
            raise fail("is not writable")
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise fail(
                "is world-writable without the sticky bit (any user could delete the lock "
                "files others hold: chmod +t it)"
            )
    except BaseException:
        os.close(fd)
        raise
    return _Dir(path, fd)


def check_lease_dir(path: str, source: str) -> None:
    """Make sure ``path`` is a usable lease directory, creating it if missing
    (the host-wide default world-writable and sticky, so every user of the
    host can lease through it).

    Raises ``LeaseDirError`` naming ``path`` and ``source`` (what set it, e.g.
    ``"--harness-lease-dir"``) when it is not a directory, cannot be created,
    cannot be written, is world-writable without the sticky bit (anyone could
    delete lock files others hold), is owned by another user (root included,
    except for the host-wide default with mode 1777: the message names the
    owner and the fix), or is a symbolic link inside a world-writable
    directory (anyone could have planted it).
    """
    _open_dir(path, source).close()


def _source_of(lease_dir: str) -> str:
    if lease_dir == os.environ.get(LEASE_DIR_ENV) or (
        os.environ.get(LEASE_DIR_ENV)
        and os.path.abspath(lease_dir) == os.path.abspath(os.environ[LEASE_DIR_ENV])
    ):
        return f"${LEASE_DIR_ENV}"
    if os.path.abspath(lease_dir) == resolve_lease_dir(None)[0]:
        return _default_source()
    return "the caller"


def ensure_lease_dir(lease_dir: str) -> str:
    """Create ``lease_dir`` if needed, check it is usable (``check_lease_dir``:
    ``LeaseDirError``) and return it."""
    check_lease_dir(lease_dir, _source_of(lease_dir))
    return lease_dir


def _open_lease_file(
    where: _Dir, name: str, *, create: bool = True, write: bool = True, mode: int = 0o666
) -> int:
    """Open file ``name`` of the lease directory without following links.

    Raises ``LeaseFileError`` (naming the file) for a symbolic link, a file
    with other links opened to ``write`` (a planted hard link to someone's file; one
    opened to read may have them: its lock is still its holder's), anything not a
    plain file, or one we may not open; ``FileNotFoundError`` when it is
    missing and ``create`` is False. Only a file created here is chmod'ed
    (to ``mode``).
    """
    path = where.join(name)
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    created = False
    try:
        for _ in range(8):
            if create:
                try:
                    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=where.fd)
                    created = True
                    break
                except FileExistsError:
                    pass
            try:
                fd = os.open(name, flags, dir_fd=where.fd)
                break
            except FileNotFoundError:
                if not create:
                    raise
                continue  # gone between the two opens: create it again
        else:
            raise LeaseFileError(f"lease file {path} keeps appearing and disappearing")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LeaseFileError(
                f"lease file {path} is a symbolic link, which the harness never follows (one "
                "planted in a shared directory could point at anyone's file): remove it"
            ) from None
        if isinstance(exc, FileNotFoundError):
            raise
        raise _Unreadable(
            f"cannot open lease file {path}: {exc.strerror}{_owner(where, name)}"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LeaseFileError(f"lease file {path} is not a plain file: remove it")
        if st.st_nlink != 1 and write:  # reading (a holder's lock, its record) harms no one
            raise LeaseFileError(
                f"lease file {path} has {st.st_nlink} links (a hard link to another file, "
                "which the harness never writes): remove it"
            )
        if created:
            with contextlib.suppress(OSError):
                # Lets other users' sessions use (queue files) or look at
                # (lock files) this file too, whatever our umask.
                os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _try_lock(fd: int, how: int) -> bool:
    """``flock(fd, how)`` without waiting: False when someone else's lock is in
    the way; other errors raise."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


def _owner(where: _Dir, name: str) -> str:
    try:
        st = os.stat(name, dir_fd=where.fd, follow_symlinks=False)
    except OSError:
        return ""
    # Lock files are for others to look at (644); queue files for them to write (666).
    mode = "644" if _LOCK_RE.fullmatch(name) else "666"
    return f" (owner {_user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):o}; its owner can chmod {mode} it)"


@dataclass(frozen=True)
class Want:
    """``count`` of the interchangeable resources ``names``, e.g. 2 of cuda:0..3."""

    what: str
    names: tuple[str, ...]
    count: int


def card_want(cards: Sequence[Card], count: int) -> Want:
    """Want ``count`` of ``cards`` (all of one device type)."""
    device = cards[0].device if cards else "?"
    return Want(f"{device} cards", tuple(str(c) for c in cards), count)


def slot_want(max_procs: int, count: int) -> Want:
    """Want ``count`` CPU process slots out of ``max_procs``.

    A case with more ranks than there are slots takes all of them (it then
    runs alone) instead of never running.
    """
    return Want(
        "process slots", tuple(f"slot:{i}" for i in range(max_procs)), min(count, max_procs)
    )


def _lock_base(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name.replace(":", "-"))


def _lock_file(name: str, uid: int) -> str:
    """The lock file of resource ``name`` for user ``uid``."""
    return f"{_lock_base(name)}.u{uid}.lock"


def _lock_files(where: _Dir, name: str) -> list[str]:
    """Every user's lock file of resource ``name`` present in ``where``."""
    base = _lock_base(name)
    return sorted(
        n for n in where.names() if (m := _LOCK_RE.fullmatch(n)) is not None and m.group(1) == base
    )


def _locked_by_another(where: _Dir, name: str, *, besides: str | None = None) -> str | None:
    """The first lock file of resource ``name`` (other than ``besides``) that some
    process holds, or None. A file we may not look at counts as held: it may be."""
    for file in _lock_files(where, name):
        if file == besides:
            continue
        try:
            fd = _open_lease_file(where, file, create=False, write=False)
        except FileNotFoundError:
            continue
        except _Unreadable:
            return file
        except LeaseFileError:
            continue  # a symbolic link or odd file: no harness holds a lease through it
        try:
            if not _named_for(fd, file):
                continue
            if not _try_lock(fd, fcntl.LOCK_SH):
                return file
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return None


def _named_for(fd: int, file: str) -> bool:
    """Whether the open lease file ``fd`` is a lock file as its name ``file`` says. One with
    other links must also be owned by the user its name gives and hold no waiter's record:
    anyone may link a queue file (mode 666), whose waiter holds its lock, under a lock
    file's name."""
    st = os.fstat(fd)
    if st.st_nlink == 1:
        return True
    named = _LOCK_RE.fullmatch(file)
    record = _read_record(fd)
    return (
        named is not None
        and st.st_uid == int(named.group(2))
        and not (record is not None and "ticket" in record)
    )


class _Lock:
    """Resource ``name``, held through an exclusive flock on this user's lock file."""

    def __init__(self, where: _Dir, name: str) -> None:
        self.where = where
        self.name = name
        self.file = _lock_file(name, os.geteuid())
        self.path = where.join(self.file)
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        # No O_TRUNC: the file carries the current holder's record.
        fd = _open_lease_file(self.where, self.file, mode=0o644)
        got = False
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise LeaseFileError(
                    f"lease file {self.path} is owned by {_user(st.st_uid)}, not by you "
                    f"({_user(os.geteuid())}), who alone write it: it was planted; have its owner "
                    "or root remove it"
                )
            if not _try_lock(fd, fcntl.LOCK_EX):
                return False
            _check_ours(fd, self.path)
            # Locked what the name still means? (Unlinked or replaced between
            # the open and the lock: a lock nobody else would see.)
            try:
                now = os.stat(self.file, dir_fd=self.where.fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return False
            # Only after locking ours: another user's session that looks at
            # ours after locking its own sees ours held, so one of us backs off.
            if _locked_by_another(self.where, self.name, besides=self.file) is not None:
                return False
            got = True
        finally:
            if not got:
                os.close(fd)
        self.fd = fd
        return True

    def write_record(self, record: dict) -> None:
        assert self.fd is not None
        _write_record(self.fd, record)

    def release(self, *, unlock: bool) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if unlock:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                # Unlocking drops the lock for every process sharing this
                # open file (the ranks it was passed to), so only when they
                # are known to be gone.
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _check_ours(fd: int, path: str) -> None:
    """Refuse (``LeaseFileError``) a file holding anything but what the harness
    writes in its files (nothing, a JSON record, a ticket number): the harness
    did not create it, so it is never written or truncated."""
    data = os.pread(fd, _HOLDER_RECORD_MAX + 1, 0)
    if not data:
        return
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if len(data) > _HOLDER_RECORD_MAX or not isinstance(value, (dict, int)):
        raise LeaseFileError(
            f"lease file {path} holds something the harness never writes there (the harness "
            "did not create it, so it leaves it alone): remove it or use another lease directory"
        )


def _write_record(fd: int, record: dict) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > _HOLDER_RECORD_MAX:
        # Still a valid record (what _check_ours accepts), just shorter.
        short = {k: v for k, v in record.items() if k in ("pid", "host", "since", "ticket")}
        short["holder"] = str(record.get("holder", ""))[:512]
        if isinstance(record.get("ranks"), list):
            short["ranks"] = record["ranks"][:64]
        data = json.dumps(short, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    done = 0
    while done < len(data):  # a short write (a file size limit) errors on the next one
        written = os.pwrite(fd, data[done:], done)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += written


def _read_record(fd: int) -> dict | None:
    try:
        data = os.pread(fd, _HOLDER_RECORD_MAX, 0)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


#: ``hook(lease_dir, busy_names) -> bool``: free what this process holds idle
#: among ``busy_names``; True when it freed something.
YieldHook = Callable[[str, frozenset[str]], bool]
_yield_hooks: list[YieldHook] = []


def add_yield_hook(hook: YieldHook) -> None:
    """Register ``hook``: a lease wait in this process that finds resources busy
    calls it before waiting (e.g. to close this process's idle rank pool)."""
    if hook not in _yield_hooks:
        _yield_hooks.append(hook)


def _yield(lease_dir: str, busy: set[str]) -> bool:
    freed = False
    for hook in list(_yield_hooks):
        freed = bool(hook(lease_dir, frozenset(busy))) or freed
    return freed


# What the leases of this process hold, per lease directory: a waiter that
# wants any of it is not deferred to (it waits for this process).
_held_here: Counter[tuple[str, str]] = Counter()
_held_lock = threading.Lock()


def _held_names(lease_dir: str) -> set[str]:
    with _held_lock:
        return {name for (d, name), n in _held_here.items() if d == lease_dir and n > 0}


def _wanted_names(record: dict) -> set[str]:
    names: set[str] = set()
    for want in record.get("wants") or ():
        if isinstance(want, dict):
            names.update(str(n) for n in want.get("names") or ())
    return names


def _flock_holders(st: os.stat_result) -> set[int] | None:
    """Pids holding a ``flock`` on the file ``st`` describes, from ``/proc/locks``
    (None where the system does not tell)."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF" (blocked ones start "1: ->")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
            with contextlib.suppress(ValueError):
                pids.add(int(fields[4]))
    return pids


def _waiters(where: _Dir, *, forged: list[str] | None = None) -> list[dict]:
    entries = [n for n in where.names() if _WAITER_RE.fullmatch(n)]
    found = []
    for entry in entries:
        try:
            fd = _open_lease_file(where, entry, create=False, write=False)
        except (OSError, LeaseError):
            continue  # gone, or not ours to read: not a waiter of this harness
        try:
            if _try_lock(fd, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)  # free slot: nobody waits there
            else:
                # Exclusively locked: a waiter is alive there, if its record
                # names the process holding the lock (anyone can write a
                # record; only the waiter itself holds the lock it names).
                record = _read_record(fd)
                if record is None or not isinstance(record.get("ticket"), int):
                    continue
                holders = _flock_holders(os.fstat(fd))
                if holders and record.get("pid") not in holders:
                    if forged is not None:
                        forged.append(
                            f"{where.join(entry)} (its record names pid "
                            f"{record.get('pid')}; pid {min(holders)} holds it)"
                        )
                    continue
                found.append(dict(record, file=where.join(entry)))
        finally:
            os.close(fd)
    return sorted(found, key=lambda r: r["ticket"])


def waiters(lease_dir: str) -> list[dict]:
    """The lease waits in progress on ``lease_dir``, first come first: their
    records (``ticket``, ``pid``, ``holder``, ``since``, ``wants``: each
    ``{"what", "names", "count"}``; ``file``: the waiter file). A waiter that
    died is not listed, nor a record naming a pid other than the one that
    holds its file's lock (forged)."""
    try:
        where = _open_dir(lease_dir, _source_of(lease_dir), create=False)
    except LeaseError:
        return []
    with where:
        return _waiters(where)


class _Ticket:
    """This lease wait's place in the queue: an exclusively locked waiter file
    holding its ticket number and what it wants (dropped when the wait ends)."""

    def __init__(self, ticket: int, fd: int) -> None:
        self.ticket = ticket
        self._fd: int | None = fd

    @classmethod
    def take(cls, where: _Dir, wants: list[Want], holder: str) -> _Ticket | None:
        """Join the queue; None when the ticket counter is busy this instant."""
        fd = _open_lease_file(where, _TICKETS)
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                return None  # someone takes a ticket this very moment: next round
            _check_ours(fd, where.join(_TICKETS))
            try:
                last = int(os.pread(fd, 32, 0).decode() or 0)
            except ValueError:
                last = 0
            # A counter someone reset must not put us before live waiters.
            last = max([last] + [w["ticket"] for w in _waiters(where)])
            ticket = last + 1
            data = str(ticket).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            # Claimed and recorded before the counter is let go: whoever takes
            # the next ticket sees this one in the queue.
            waiter_fd = cls._claim_waiter_file(where)
            try:
                _write_record(
                    waiter_fd,
                    {
                        "ticket": ticket,
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "holder": holder,
                        "since": time.time(),
                        "wants": [
                            {"what": w.what, "names": list(w.names), "count": w.count}
                            for w in wants
                        ],
                    },
                )
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(waiter_fd, 0)
                os.close(waiter_fd)
                raise
        finally:
            os.close(fd)  # drops the counter's lock
        return cls(ticket, waiter_fd)

    @staticmethod
    def _claim_waiter_file(where: _Dir) -> int:
        for k in range(4096):
            name = f"waiter-{k}.lock"
            try:
                fd = _open_lease_file(where, name)
            except LeaseFileError:
                continue  # planted or foreign: never ours to use, try the next
            try:
                if _try_lock(fd, fcntl.LOCK_EX):
                    _check_ours(fd, where.join(name))
                    return fd
            except LeaseFileError:
                pass  # not what the harness writes: leave it alone
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # another waiter's, or not ours
        raise LeaseError(f"no usable waiter file in {where.path} (4096 tried)")

    def leave(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)


def _read_holder(where: _Dir, name: str) -> dict | None:
    files = _lock_files(where, name)
    held = _locked_by_another(where, name)
    for file in ([held] if held else []) + files:
        try:
            fd = _open_lease_file(where, file, create=False, write=False)
        except (OSError, LeaseError):
            continue
        try:
            record = _read_record(fd)
        finally:
            os.close(fd)
        if record is not None:
            return record
    return None


def read_holder(lease_dir: str, name: str) -> dict | None:
    """The holder record of resource ``name`` (None when unreadable or empty)."""
    try:
        where = _open_dir(lease_dir, _source_of(lease_dir), create=False)
    except LeaseError:
        return None
    with where:
        return _read_holder(where, name)


def describe_holder(record: dict | None) -> str:
    """Human words for a holder record: pid, what it runs, for how long, its ranks."""
    if not record or "pid" not in record:
        return "held by a process that left no record"
    import psutil

    pid = record["pid"]
    words = f"held by pid {pid}"
    if not psutil.pid_exists(pid):
        words += " (exited; processes it started still hold the lock)"
    details = []
    if record.get("holder"):
        details.append(str(record["holder"]))
    if record.get("since"):
        details.append(f"for {max(0.0, time.time() - record['since']):.1f} s")
    if record.get("ranks"):
        details.append("ranks " + ",".join(str(p) for p in record["ranks"]))
    if details:
        words += " (" + "; ".join(details) + ")"
    return words


class Lease:
    """Resources held exclusively until ``release()`` (or the holder's death)."""

    def __init__(self, where: _Dir, locks: list[_Lock], holder: str) -> None:
        self.lease_dir = where.path
        self._where = where
        self._locks = locks
        self._record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "holder": holder,
            "since": time.time(),
        }
        with _held_lock:
            _held_here.update((self.lease_dir, lock.name) for lock in locks)

    @property
    def resources(self) -> tuple[str, ...]:
        """Names of the held resources, e.g. ``("cuda:1", "slot:0")``."""
        return tuple(lock.name for lock in self._locks)

    def cards(self) -> list[Card]:
        """The held cards, in lease order."""
        out = []
        for name in self.resources:
            device, _, card_id = name.partition(":")
            if device != "slot":
                out.append(Card(device, card_id))
        return out

    def annotate(self, **info: object) -> None:
        """Add facts (e.g. ``ranks=[pids]``) to the holder record waiters see.

        The record only informs; a failure to write it (a full disk) leaves
        the lease held and the record as it was."""
        self._record.update(info)
        for lock in self._locks:
            if lock.fd is not None:
                with contextlib.suppress(OSError):
                    lock.write_record(self._record)

    def fds(self) -> list[int]:
        """Descriptors holding the locks, for processes that must keep the lease alive."""
        return [lock.fd for lock in self._locks if lock.fd is not None]

    def contended(self) -> bool:
        """Whether a lease wait in progress (any process) wants one of these resources."""
        mine = set(self.resources)
        if not mine or self._where.fd < 0:
            return False
        return any(_wanted_names(w) & mine for w in _waiters(self._where))

    def release(self, *, holders_gone: bool = True) -> None:
        """Give the resources back.

        ``holders_gone=False`` says processes the descriptors were passed to
        may still run: then this process only closes its descriptors and the
        OS frees each resource when the last of them exits.
        """
        locks, self._locks = self._locks, []
        with _held_lock:
            _held_here.subtract((self.lease_dir, lock.name) for lock in locks)
        try:
            for lock in locks:
                lock.release(unlock=holders_gone)
        finally:
            self._where.close()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(lease_dir: str, wants: Iterable[Want], *, timeout: float, holder: str) -> Lease:
    """Lease every ``Want`` at once, waiting at most ``timeout`` seconds.

    All-or-nothing: a partial grab is given back before waiting again, so two
    waiters can never deadlock holding halves of what each needs. First come,
    first served: what an earlier waiter wants is left to it (see the module
    docstring). The directory is opened once, at the start: everything after
    goes through that descriptor. Raises ``LeaseTimeout`` naming what was
    wanted, who holds it and who is queued ahead; ``LeaseDirError`` /
    ``LeaseFileError`` when the lease directory or a file in it is unusable;
    ``LeaseError`` for any other failure (a full disk), with nothing left
    held.
    """
    wants = [w for w in wants if w.count > 0]
    for want in wants:
        if want.count > len(want.names):
            raise ValueError(
                f"cannot lease {want.count} {want.what}: only {len(want.names)} exist "
                f"({', '.join(want.names) or 'none'})"
            )
    where = _open_dir(lease_dir, _source_of(lease_dir))
    try:
        lease = _acquire(where, wants, timeout=timeout, holder=holder)
    except BaseException:
        where.close()
        raise
    return lease


def _acquire(where: _Dir, wants: list[Want], *, timeout: float, holder: str) -> Lease:
    start = time.monotonic()
    delay = 0.02
    ticket: _Ticket | None = None
    try:
        while True:
            promised = _promised_to_others(where, ticket, wants)
            held: list[_Lock] = []
            short: list[Want] = []
            busy: set[str] = set()
            try:
                for want in wants:
                    got = 0
                    for name in want.names:
                        if got == want.count:
                            break
                        if name in promised:
                            continue
                        lock = _Lock(where, name)
                        if lock.try_acquire():
                            held.append(lock)
                            got += 1
                        else:
                            busy.add(name)
                    if got < want.count:
                        short.append(want)
                if not short:
                    return _granted(where, held, holder)
            except BaseException:
                for lock in held:
                    lock.release(unlock=True)
                raise
            for lock in held:
                lock.release(unlock=True)
            if busy and _yield(where.path, busy):
                continue  # this process freed some of it: try again at once
            waited = time.monotonic() - start
            if waited >= timeout:
                raise LeaseTimeout(_timeout_message(where, short, waited, ticket))
            if ticket is None:
                ticket = _Ticket.take(where, wants, holder)
            # Jitter keeps two waiters from looking in lockstep forever.
            time.sleep(min(delay * random.uniform(0.5, 1.5), max(0.0, timeout - waited)))
            delay = min(delay * 1.5, _POLL_MAX_S)
    except LeaseError:
        raise
    except OSError as exc:
        raise LeaseError(
            f"lease wait in {where.path} failed: {exc.strerror or exc}; nothing is left held"
        ) from exc
    finally:
        if ticket is not None:
            ticket.leave()


def _granted(where: _Dir, held: list[_Lock], holder: str) -> Lease:
    """The lease of ``held``, its holder record written; on any failure every
    lock is given back and one ``LeaseError`` says what failed."""
    lease = Lease(where, held, holder)
    for lock in held:
        try:
            lock.write_record(lease._record)
        except OSError as exc:
            lease.release()
            raise LeaseError(
                f"cannot write the holder record into lease file {lock.path}: "
                f"{exc.strerror or exc}; the lease of {', '.join(lk.name for lk in held)} is "
                "given back"
            ) from exc
    return lease


def _promised_to_others(where: _Dir, ticket: _Ticket | None, wants: list[Want]) -> set[str]:
    """What waiters ahead of ``ticket`` (all of them, without one) want among ``wants``,
    except waiters that want something this process holds (they wait for us)."""
    mine = {name for want in wants for name in want.names}
    held_here = _held_names(where.path)
    promised: set[str] = set()
    for waiter in _waiters(where):
        if ticket is not None and waiter["ticket"] >= ticket.ticket:
            break
        wanted = _wanted_names(waiter)
        if wanted & mine and not wanted & held_here:
            promised |= wanted & mine
    return promised


def _unreadable(where: _Dir, file: str) -> str | None:
    """Why the lease file ``file`` cannot be read (its owner's mode), ``None`` when it can."""
    try:
        os.close(_open_lease_file(where, file, create=False, write=False))
    except _Unreadable as exc:
        return str(exc)
    except (OSError, LeaseError):
        pass
    return None


def _timeout_message(where: _Dir, short: list[Want], waited: float, ticket: _Ticket | None) -> str:
    lines = [f"lease wait timed out after {waited:.1f} s (lease dir {where.path}):"]
    for want in short:
        lines.append(f"  waited for {want.count} of the {len(want.names)} {want.what}:")
        for name in want.names:
            file = _locked_by_another(where, name)
            state = describe_holder(_read_holder(where, name)) if file else "free"
            if file and (unreadable := _unreadable(where, file)):
                state = f"counted as held, whether or not it is: {unreadable}"
            lines.append(f"    {name}: {state}")
    wanted = {name for want in short for name in want.names}
    forged: list[str] = []
    ahead = [
        w
        for w in _waiters(where, forged=forged)
        if (ticket is None or w["ticket"] < ticket.ticket) and _wanted_names(w) & wanted
    ]
    if ahead:
        lines.append(f"  queued behind {len(ahead)} earlier waiter(s):")
        for w in ahead:
            since = w.get("since")
            waiting = f", waiting {max(0.0, time.time() - since):.1f} s" if since else ""
            lines.append(
                f"    pid {w.get('pid')} ({w.get('holder')}{waiting}; waiter file {w['file']})"
            )
    for entry in forged:
        lines.append(f"  ignored a forged waiter record: {entry}")
    return "\n".join(lines)
