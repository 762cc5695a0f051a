"""Exclusive, crash-safe, first-come-first-served leases on accelerator cards
and CPU process slots.

Every pytest process on the host (xdist workers, concurrent sessions, other
projects, scripts calling ``harness.launcher.launch``) leases through one
*lease directory*. Each resource is one lock file in it::

    <lease dir>/cuda-0.lock   card cuda:0
    <lease dir>/npu-3.lock    card npu:3
    <lease dir>/slot-0.lock   CPU process slot 0 (slot-0 .. slot-<max_procs-1>)

A resource is held while a process holds an exclusive ``flock`` on its file.
The OS drops the lock when the last process holding it exits, however it
exits, so a crashed holder never leaves a stale lease. The holder writes who
it is (pid, what it runs, since when, its rank pids) into the locked file so a
waiter that gives up can say who holds what. Cards are a host-wide resource:
the default directory is one per host, shared by every project and user.

Lock files are never deleted: deleting a lock file while someone waits on it
would let two processes lock two different files of the same name.

**Waiters are served in order.** A lease that cannot be had at once joins a
queue: it takes the next number from ``<lease dir>/tickets`` and holds an
exclusive ``flock`` on a *waiter file* (``waiter-<k>.lock``) holding its
ticket and what it wants, until its wait ends (the OS drops that lock too
when a waiter dies, so a dead waiter is never waited for). Every lease, a
newcomer's or a queued one's, leaves alone what a waiter with an earlier
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
Files in a lease directory are opened with ``O_NOFOLLOW`` and must be plain
files with one link: a planted symbolic or hard link to someone's file is
refused with an error naming it, never followed, written, truncated or
chmod'ed. Only a file this harness has just created (``O_EXCL``) is made
world-writable, so that other users' sessions can lease the same cards. A
default directory that is a symbolic link is refused too.

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

import psutil

from harness.devices import Card

LEASE_DIR_ENV = "HARNESS_LEASE_DIR"
#: Where a lease directory came from, as ``resolve_lease_dir`` names it.
LEASE_DIR_OPTION = "--harness-lease-dir"
_HOLDER_RECORD_MAX = 4096
_TICKETS = "tickets"
_WAITER_RE = re.compile(r"waiter-(\d+)\.lock")
#: Longest pause between two looks of a waiting lease: also the longest a
#: waiter lets a resource promised to it lie idle.
_POLL_MAX_S = 0.2
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


class LeaseError(RuntimeError):
    """A lease could not be had. The message says what, where and why."""


class LeaseTimeout(LeaseError, TimeoutError):
    """A lease wait ran past its bound. The message names what was wanted and who holds it."""


class LeaseFileError(LeaseError):
    """A file in the lease directory cannot be used safely (a planted link, not a
    plain file, not ours to write). The message names the file and what to do."""


class LeaseDirError(LeaseError):
    """The lease directory is unusable. The message names it and what set it."""


def _default_source() -> str:
    return f"the default (neither {LEASE_DIR_OPTION} nor ${LEASE_DIR_ENV} is set)"


def default_lease_dir() -> str:
    """``$HARNESS_LEASE_DIR``, else ``<system temp>/harness-leases``.

    The default is shared by every user and project on the host (cards are a
    host-wide resource); when another user created it without letting us
    write, a per-user directory is used instead.
    """
    return resolve_lease_dir(None)[0]


def resolve_lease_dir(option: str | None) -> tuple[str, str]:
    """The lease directory to use and what chose it, for error messages.

    ``option`` is ``--harness-lease-dir``'s value (None: not given); then
    ``$HARNESS_LEASE_DIR``; then the host-wide default. The second item names
    the source: ``"--harness-lease-dir"``, ``"$HARNESS_LEASE_DIR"`` or a phrase
    saying it is the default.
    """
    if option:
        return option, LEASE_DIR_OPTION
    env = os.environ.get(LEASE_DIR_ENV)
    if env:
        return env, f"${LEASE_DIR_ENV}"
    shared = os.path.join(tempfile.gettempdir(), "harness-leases")
    if (os.path.isdir(shared) and not os.path.islink(shared)
            and not os.access(shared, os.W_OK | os.X_OK)):
        return f"{shared}-{os.getuid()}", _default_source()
    return shared, _default_source()


def check_lease_dir(path: str, source: str) -> None:
    """Make sure ``path`` is a usable lease directory, creating it if missing
    (world-writable and sticky, so every user of the host can lease through it).

    Raises ``LeaseDirError`` naming ``path`` and ``source`` (what set it, e.g.
    ``"--harness-lease-dir"``) when it is not a directory, cannot be created,
    cannot be written, is world-writable without the sticky bit (anyone could
    delete lock files others hold), or is a symbolic link inside a
    world-writable directory (anyone could have planted it).
    """

    def fail(problem: str) -> LeaseDirError:
        return LeaseDirError(
            f"harness lease directory {path} (set by {source}) {problem}; point "
            f"{LEASE_DIR_OPTION} or ${LEASE_DIR_ENV} at a writable directory")

    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        try:
            os.makedirs(path)
        except FileExistsError:
            pass  # another process made it meanwhile
        except OSError as exc:
            raise fail(f"cannot be created ({exc.strerror})") from None
        else:
            with contextlib.suppress(OSError):
                os.chmod(path, 0o777 | stat.S_ISVTX)
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise fail(f"cannot be examined ({exc.strerror})") from None
    except OSError as exc:
        raise fail(f"cannot be examined ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        parent = os.path.dirname(os.path.abspath(path))
        with contextlib.suppress(OSError):
            if os.stat(parent).st_mode & stat.S_IWOTH:
                raise fail(f"is a symbolic link in the world-writable {parent}, which anyone "
                           "could have planted; it is not followed")
        try:
            st = os.stat(path)
        except OSError as exc:
            raise fail(f"is a symbolic link to nothing usable ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise fail("is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise fail("is not writable")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise fail("is world-writable without the sticky bit (any user could delete the lock "
                   "files others hold: chmod +t it)")


def ensure_lease_dir(lease_dir: str) -> str:
    """Create ``lease_dir`` if needed (world-writable, sticky), check it is
    usable (``check_lease_dir``: ``LeaseDirError``) and return it."""
    if lease_dir == os.environ.get(LEASE_DIR_ENV):
        source = f"${LEASE_DIR_ENV}"
    elif lease_dir == resolve_lease_dir(None)[0]:
        source = _default_source()
    else:
        source = "the caller"
    check_lease_dir(lease_dir, source)
    return lease_dir


def _open_lease_file(path: str, *, create: bool = True, write: bool = True) -> int:
    """Open a file of the lease directory without following links.

    Raises ``LeaseFileError`` (naming ``path``) for a symbolic link, a file
    with other links (a planted hard link to someone's file), anything not a
    plain file, or one we may not open; ``FileNotFoundError`` when it is
    missing and ``create`` is False. Only a file created here is chmod'ed.
    """
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    created = False
    try:
        for _ in range(8):
            if create:
                try:
                    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
                    created = True
                    break
                except FileExistsError:
                    pass
            try:
                fd = os.open(path, flags)
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
                "planted in a shared directory could point at anyone's file): remove it") from None
        if isinstance(exc, FileNotFoundError):
            raise
        raise LeaseFileError(f"cannot open lease file {path}: {exc.strerror}{_owner(path)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LeaseFileError(f"lease file {path} is not a plain file: remove it")
        if st.st_nlink != 1:
            raise LeaseFileError(
                f"lease file {path} has {st.st_nlink} links (a hard link to another file, "
                "which the harness never writes): remove it")
        if created:
            with contextlib.suppress(OSError):
                # Lets other users' sessions lease this resource too.
                os.fchmod(fd, 0o666)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owner(path: str) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return ""
    return f" (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; its owner can chmod 666 it)"


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
    return Want("process slots", tuple(f"slot:{i}" for i in range(max_procs)),
                min(count, max_procs))


class _Lock:
    """One exclusively flock-ed lock file."""

    def __init__(self, path: str, name: str) -> None:
        self.path = path
        self.name = name
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        # No O_TRUNC: the file carries the current holder's record.
        fd = _open_lease_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _BUSY:
                return False
            raise
        try:
            _check_ours(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
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
            "did not create it, so it leaves it alone): remove it or use another lease directory")


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
    os.pwrite(fd, data, 0)


def _read_record(fd: int) -> dict | None:
    try:
        data = os.pread(fd, _HOLDER_RECORD_MAX, 0)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _lock_file(lease_dir: str, name: str) -> str:
    return os.path.join(lease_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", name.replace(":", "-")) + ".lock")


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


def waiters(lease_dir: str) -> list[dict]:
    """The lease waits in progress on ``lease_dir``, first come first: their
    records (``ticket``, ``pid``, ``holder``, ``since``, ``wants``: each
    ``{"what", "names", "count"}``). A waiter that died is not listed."""
    try:
        entries = [e.name for e in os.scandir(lease_dir) if _WAITER_RE.fullmatch(e.name)]
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            fd = _open_lease_file(os.path.join(lease_dir, entry), create=False, write=False)
        except (OSError, LeaseError):
            continue  # gone, or not ours to read: not a waiter of this harness
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in _BUSY:
                    continue
                # Exclusively locked: a waiter is alive there.
                record = _read_record(fd)
                if record is not None and isinstance(record.get("ticket"), int):
                    found.append(record)
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)  # free slot: nobody waits there
        finally:
            os.close(fd)
    return sorted(found, key=lambda r: r["ticket"])


def has_waiters(lease_dir: str, name: str) -> bool:
    """Whether some process is waiting for resource ``name``."""
    return any(name in _wanted_names(w) for w in waiters(lease_dir))


class _Ticket:
    """This lease wait's place in the queue: an exclusively locked waiter file
    holding its ticket number and what it wants (dropped when the wait ends)."""

    def __init__(self, ticket: int, fd: int) -> None:
        self.ticket = ticket
        self._fd: int | None = fd

    @classmethod
    def take(cls, lease_dir: str, wants: list[Want], holder: str) -> _Ticket | None:
        """Join the queue; None when the ticket counter is busy this instant."""
        fd = _open_lease_file(os.path.join(lease_dir, _TICKETS))
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _BUSY:
                    return None  # someone takes a ticket this very moment: next round
                raise
            _check_ours(fd, os.path.join(lease_dir, _TICKETS))
            try:
                last = int(os.pread(fd, 32, 0).decode() or 0)
            except ValueError:
                last = 0
            # A counter someone reset must not put us before live waiters.
            last = max([last] + [w["ticket"] for w in waiters(lease_dir)])
            ticket = last + 1
            data = str(ticket).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            # Claimed and recorded before the counter is let go: whoever takes
            # the next ticket sees this one in the queue.
            waiter_fd = cls._claim_waiter_file(lease_dir)
            try:
                _write_record(waiter_fd, {
                    "ticket": ticket,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "holder": holder,
                    "since": time.time(),
                    "wants": [{"what": w.what, "names": list(w.names), "count": w.count}
                              for w in wants],
                })
            except BaseException:
                os.close(waiter_fd)
                raise
        finally:
            os.close(fd)  # drops the counter's lock
        return cls(ticket, waiter_fd)

    @staticmethod
    def _claim_waiter_file(lease_dir: str) -> int:
        for k in range(4096):
            try:
                fd = _open_lease_file(os.path.join(lease_dir, f"waiter-{k}.lock"))
            except LeaseFileError:
                continue  # planted or foreign: never ours to use, try the next
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in _BUSY:
                    continue  # another waiter's
                raise
            try:
                _check_ours(fd, os.path.join(lease_dir, f"waiter-{k}.lock"))
            except LeaseFileError:
                os.close(fd)
                continue
            return fd
        raise LeaseError(f"no usable waiter file in {lease_dir} (4096 tried)")

    def leave(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)


def read_holder(lease_dir: str, name: str) -> dict | None:
    """The holder record of resource ``name`` (None when unreadable or empty)."""
    try:
        fd = _open_lease_file(_lock_file(lease_dir, name), create=False, write=False)
    except (OSError, LeaseError):
        return None
    try:
        return _read_record(fd)
    finally:
        os.close(fd)


def _is_held(lease_dir: str, name: str) -> bool:
    try:
        fd = _open_lease_file(_lock_file(lease_dir, name), create=False, write=False)
    except (OSError, LeaseError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in _BUSY
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def describe_holder(record: dict | None) -> str:
    """Human words for a holder record: pid, what it runs, for how long, its ranks."""
    if not record or "pid" not in record:
        return "held by a process that left no record"
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

    def __init__(self, lease_dir: str, locks: list[_Lock], holder: str) -> None:
        self.lease_dir = lease_dir
        self._locks = locks
        self._record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "holder": holder,
            "since": time.time(),
        }
        for lock in locks:
            lock.write_record(self._record)
        with _held_lock:
            _held_here.update((lease_dir, lock.name) for lock in locks)

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
        """Add facts (e.g. ``ranks=[pids]``) to the holder record waiters see."""
        self._record.update(info)
        for lock in self._locks:
            if lock.fd is not None:
                lock.write_record(self._record)

    def fds(self) -> list[int]:
        """Descriptors holding the locks, for processes that must keep the lease alive."""
        return [lock.fd for lock in self._locks if lock.fd is not None]

    def contended(self) -> bool:
        """Whether a lease wait in progress (any process) wants one of these resources."""
        mine = set(self.resources)
        return any(_wanted_names(w) & mine for w in waiters(self.lease_dir))

    def release(self, *, holders_gone: bool = True) -> None:
        """Give the resources back.

        ``holders_gone=False`` says processes the descriptors were passed to
        may still run: then this process only closes its descriptors and the
        OS frees each resource when the last of them exits.
        """
        locks, self._locks = self._locks, []
        with _held_lock:
            _held_here.subtract((self.lease_dir, lock.name) for lock in locks)
        for lock in locks:
            lock.release(unlock=holders_gone)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(lease_dir: str, wants: Iterable[Want], *, timeout: float, holder: str) -> Lease:
    """Lease every ``Want`` at once, waiting at most ``timeout`` seconds.

    All-or-nothing: a partial grab is given back before waiting again, so two
    waiters can never deadlock holding halves of what each needs. First come,
    first served: what an earlier waiter wants is left to it (see the module
    docstring). Raises ``LeaseTimeout`` naming what was wanted, who holds it
    and who is queued ahead; ``LeaseDirError`` / ``LeaseFileError`` when the
    lease directory or a file in it is unusable.
    """
    wants = [w for w in wants if w.count > 0]
    ensure_lease_dir(lease_dir)
    for want in wants:
        if want.count > len(want.names):
            raise ValueError(
                f"cannot lease {want.count} {want.what}: only {len(want.names)} exist "
                f"({', '.join(want.names) or 'none'})"
            )
    start = time.monotonic()
    delay = 0.02
    ticket: _Ticket | None = None
    try:
        while True:
            promised = _promised_to_others(lease_dir, ticket, wants)
            held: list[_Lock] = []
            short: list[Want] = []
            busy: set[str] = set()
            for want in wants:
                got = 0
                for name in want.names:
                    if got == want.count:
                        break
                    if name in promised:
                        continue
                    lock = _Lock(_lock_file(lease_dir, name), name)
                    if lock.try_acquire():
                        held.append(lock)
                        got += 1
                    else:
                        busy.add(name)
                if got < want.count:
                    short.append(want)
            if not short:
                return Lease(lease_dir, held, holder)
            for lock in held:
                lock.release(unlock=True)
            if busy and _yield(lease_dir, busy):
                continue  # this process freed some of it: try again at once
            waited = time.monotonic() - start
            if waited >= timeout:
                raise LeaseTimeout(_timeout_message(lease_dir, short, waited, ticket))
            if ticket is None:
                ticket = _Ticket.take(lease_dir, wants, holder)
            # Jitter keeps two waiters from looking in lockstep forever.
            time.sleep(min(delay * random.uniform(0.5, 1.5), max(0.0, timeout - waited)))
            delay = min(delay * 1.5, _POLL_MAX_S)
    finally:
        if ticket is not None:
            ticket.leave()


def _promised_to_others(lease_dir: str, ticket: _Ticket | None, wants: list[Want]) -> set[str]:
    """What waiters ahead of ``ticket`` (all of them, without one) want among ``wants``,
    except waiters that want something this process holds (they wait for us)."""
    mine = {name for want in wants for name in want.names}
    held_here = _held_names(lease_dir)
    promised: set[str] = set()
    for waiter in waiters(lease_dir):
        if ticket is not None and waiter["ticket"] >= ticket.ticket:
            break
        wanted = _wanted_names(waiter)
        if wanted & mine and not wanted & held_here:
            promised |= wanted & mine
    return promised


def _timeout_message(lease_dir: str, short: list[Want], waited: float,
                     ticket: _Ticket | None) -> str:
    lines = [f"lease wait timed out after {waited:.1f} s (lease dir {lease_dir}):"]
    for want in short:
        lines.append(f"  waited for {want.count} of the {len(want.names)} {want.what}:")
        for name in want.names:
            state = describe_holder(read_holder(lease_dir, name)) if _is_held(lease_dir, name) else "free"
            lines.append(f"    {name}: {state}")
    wanted = {name for want in short for name in want.names}
    ahead = [w for w in waiters(lease_dir)
             if (ticket is None or w["ticket"] < ticket.ticket) and _wanted_names(w) & wanted]
    if ahead:
        lines.append(f"  queued behind {len(ahead)} earlier waiter(s):")
        for w in ahead:
            since = w.get("since")
            waiting = f", waiting {max(0.0, time.time() - since):.1f} s" if since else ""
            lines.append(f"    pid {w.get('pid')} ({w.get('holder')}{waiting})")
    return "\n".join(lines)
