"""Exclusive, crash-safe leases on accelerator cards and CPU process slots.

Every pytest process on the host (xdist workers, concurrent sessions, scripts
calling ``harness.launcher.launch``) leases through one *lease directory*. Each
resource is one lock file in it::

    <lease dir>/cuda-0.lock   card cuda:0
    <lease dir>/npu-3.lock    card npu:3
    <lease dir>/slot-0.lock   CPU process slot 0 (slot-0 .. slot-<max_procs-1>)

A resource is held while a process holds an exclusive ``flock`` on its file.
The OS drops the lock when the last process holding it exits, however it
exits, so a crashed holder never leaves a stale lease. The holder writes who
it is (pid, what it runs, since when, its rank pids) into the locked file so a
waiter that gives up can say who holds what.

Lock files are never deleted: deleting a lock file while someone waits on it
would let two processes lock two different files of the same name.

A process waiting for a busy resource says so by holding a *shared* flock on
``<resource>.want`` next to its lock file while it waits; a holder that could
give the resource back early (an idle pool of rank processes) checks
``Lease.contended()`` and yields. Within one process, a wait that finds
resources busy first asks the registered *yield hooks* (``add_yield_hook``)
to free what this very process holds idle.

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
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import psutil

from harness.devices import Card

LEASE_DIR_ENV = "HARNESS_LEASE_DIR"
_HOLDER_RECORD_MAX = 4096


def default_lease_dir() -> str:
    """``$HARNESS_LEASE_DIR``, else ``<system temp>/harness-leases``.

    The default is shared by every user of the host (cards are a host-wide
    resource); when another user created it without letting us write, a
    per-user directory is used instead.
    """
    env = os.environ.get(LEASE_DIR_ENV)
    if env:
        return env
    shared = os.path.join(tempfile.gettempdir(), "harness-leases")
    if os.path.isdir(shared) and not os.access(shared, os.W_OK | os.X_OK):
        return f"{shared}-{os.getuid()}"
    return shared


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


class LeaseTimeout(TimeoutError):
    """A lease wait ran past its bound. The message names what was wanted and who holds it."""


class _Lock:
    """One exclusively flock-ed lock file."""

    def __init__(self, path: str, name: str) -> None:
        self.path = path
        self.name = name
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        # No O_TRUNC: the file carries the current holder's record.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise
        with contextlib.suppress(OSError):
            # Lets other users' sessions lease this resource too.
            if os.fstat(fd).st_uid == os.getuid():
                os.fchmod(fd, 0o666)
        self.fd = fd
        return True

    def write_record(self, record: dict) -> None:
        assert self.fd is not None
        data = json.dumps(record, sort_keys=True).encode()[:_HOLDER_RECORD_MAX]
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

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


def _lock_file(lease_dir: str, name: str) -> str:
    return os.path.join(lease_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", name.replace(":", "-")) + ".lock")


def _want_file(lease_dir: str, name: str) -> str:
    return _lock_file(lease_dir, name)[: -len(".lock")] + ".want"


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


class _Wants:
    """The shared ``.want`` locks of one waiting ``acquire`` (released when it ends)."""

    def __init__(self, lease_dir: str) -> None:
        self.lease_dir = lease_dir
        self.fds: dict[str, int] = {}

    def announce(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self.fds:
                continue
            with contextlib.suppress(OSError):
                fd = os.open(_want_file(self.lease_dir, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                             0o666)
                try:
                    # Non-blocking: a holder checking for waiters holds it
                    # exclusively for an instant; the next round retries.
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                with contextlib.suppress(OSError):
                    if os.fstat(fd).st_uid == os.getuid():
                        os.fchmod(fd, 0o666)
                self.fds[name] = fd

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def has_waiters(lease_dir: str, name: str) -> bool:
    """Whether some process is waiting for resource ``name`` (holds its ``.want`` lock)."""
    try:
        fd = os.open(_want_file(lease_dir, name), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False  # never wanted by anyone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def ensure_lease_dir(lease_dir: str) -> str:
    """Create ``lease_dir`` if needed (world-writable, sticky) and return it."""
    try:
        os.makedirs(lease_dir, exist_ok=False)
        with contextlib.suppress(OSError):
            os.chmod(lease_dir, 0o777 | stat.S_ISVTX)
    except FileExistsError:
        pass
    return lease_dir


def read_holder(lease_dir: str, name: str) -> dict | None:
    """The holder record of resource ``name`` (None when unreadable or empty)."""
    try:
        with open(_lock_file(lease_dir, name), "rb") as f:
            data = f.read(_HOLDER_RECORD_MAX)
        return json.loads(data) if data else None
    except (OSError, ValueError):
        return None


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
        """Whether another lease wait (any process) wants one of these resources."""
        return any(has_waiters(self.lease_dir, name) for name in self.resources)

    def release(self, *, holders_gone: bool = True) -> None:
        """Give the resources back.

        ``holders_gone=False`` says processes the descriptors were passed to
        may still run: then this process only closes its descriptors and the
        OS frees each resource when the last of them exits.
        """
        locks, self._locks = self._locks, []
        for lock in locks:
            lock.release(unlock=holders_gone)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(lease_dir: str, wants: Iterable[Want], *, timeout: float, holder: str) -> Lease:
    """Lease every ``Want`` at once, waiting at most ``timeout`` seconds.

    All-or-nothing: a partial grab is given back before waiting again, so two
    waiters can never deadlock holding halves of what each needs. Raises
    ``LeaseTimeout`` naming what was wanted and who holds it.
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
    waiting = _Wants(lease_dir)
    try:
        while True:
            held: list[_Lock] = []
            short: list[Want] = []
            busy: set[str] = set()
            for want in wants:
                got = 0
                for name in want.names:
                    if got == want.count:
                        break
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
            if _yield(lease_dir, busy):
                continue  # this process freed some of it: try again at once
            waiting.announce(busy)
            waited = time.monotonic() - start
            if waited >= timeout:
                raise LeaseTimeout(_timeout_message(lease_dir, short, busy, waited))
            # Jitter keeps two waiters from retrying in lockstep forever.
            time.sleep(min(delay * random.uniform(0.5, 1.5), max(0.0, timeout - waited)))
            delay = min(delay * 1.5, 0.5)
    finally:
        waiting.close()


def _timeout_message(lease_dir: str, short: list[Want], busy: set[str], waited: float) -> str:
    lines = [f"lease wait timed out after {waited:.1f} s (lease dir {lease_dir}):"]
    for want in short:
        lines.append(f"  waited for {want.count} of the {len(want.names)} {want.what}:")
        for name in want.names:
            state = describe_holder(read_holder(lease_dir, name)) if name in busy else "free"
            lines.append(f"    {name}: {state}")
    return "\n".join(lines)
