"""Exclusive, crash-safe leases on accelerator cards and CPU process slots.

One lock file per resource in a host-wide lease directory, held by an exclusive ``flock``
(the OS drops it when the last process sharing the descriptor exits), with the holder's
record in it. A waiter that takes ``queue.lock`` is the head of the queue: other leases
leave what it wants alone, unless this process holds part of it (deferring would
deadlock). ``flock`` rather than ``filelock``: the descriptors travel to the ranks and the
record lives in the lock file (filelock truncates it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
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
LEASE_DIR_OPTION = "--harness-lease-dir"
_POLL_MAX_S = 0.2  # the longest pause between two looks of a waiting lease
_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW


class LeaseError(HarnessError, RuntimeError):
    """A lease could not be had. The message says what, where and why."""


class LeaseTimeout(LeaseError, TimeoutError):
    """A lease wait ran past its bound. The message names what was wanted and who holds it."""


class LeaseFileError(LeaseError):
    """A file in the lease directory cannot be used (a planted link, not ours to open)."""


class LeaseDirError(LeaseError):
    """The lease directory is unusable. The message names it and what set it."""


def _shared_dir() -> str:
    return os.path.join(os.path.abspath(tempfile.gettempdir()), "harness-leases")


def default_lease_dir() -> str:
    """``$HARNESS_LEASE_DIR``, else the host-wide default (``resolve_lease_dir``)."""
    return resolve_lease_dir(None)[0]


def resolve_lease_dir(option: str | None) -> tuple[str, str]:
    """The absolute lease directory and what chose it: ``option`` (``--harness-lease-dir``),
    else ``$HARNESS_LEASE_DIR``, else the host-wide ``<system temp>/harness-leases`` (a
    per-user ``harness-leases-<uid>`` when another user made that one unwritable to us)."""
    if option:
        return os.path.abspath(option), LEASE_DIR_OPTION
    env = os.environ.get(LEASE_DIR_ENV)
    if env:
        return os.path.abspath(env), f"${LEASE_DIR_ENV}"
    shared = _shared_dir()
    if os.path.isdir(shared) and not os.access(shared, os.W_OK | os.X_OK):
        shared = f"{shared}-{os.getuid()}"
    return shared, f"the default (neither {LEASE_DIR_OPTION} nor ${LEASE_DIR_ENV} is set)"


def check_lease_dir(path: str, source: str) -> None:
    """Make sure ``path`` is a usable lease directory, creating it if missing (the
    host-wide default ``1777``, any other ``0700``, whatever the umask). Raises
    ``LeaseDirError`` naming ``path`` and ``source`` (what set it) when it is not a
    directory, cannot be created or written, or is world-writable without the sticky bit.
    """

    def fail(problem: str) -> LeaseDirError:
        return LeaseDirError(
            f"harness lease directory {path} (set by {source}) {problem}; point "
            f"{LEASE_DIR_OPTION} or ${LEASE_DIR_ENV} at a writable directory"
        )

    try:
        os.makedirs(path, mode=0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        raise fail(f"cannot be created ({exc.strerror})") from None
    else:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o1777 if path == _shared_dir() else 0o700)
    if not os.path.isdir(path):
        raise fail("is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise fail("is not writable")
    mode = os.stat(path).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise fail(
            "is world-writable without the sticky bit (any user could delete the lock "
            "files others hold: chmod +t it)"
        )


def _open(path: str) -> int:
    """Open (create) lease file ``path`` read-write without following a link; only a file
    created here is chmod'ed."""
    try:
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, _FLAGS | os.O_CREAT | os.O_EXCL, 0o666)
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o666)  # whatever the umask
            return fd
        return os.open(path, _FLAGS)
    except OSError as exc:
        problem = (
            "is a symbolic link, which the harness never follows"
            if exc.errno == errno.ELOOP
            else f"cannot be opened ({exc.strerror})"
        )
        raise LeaseFileError(
            f"lease file {path} {problem}: remove it or use another lease directory"
        ) from None


def _try_lock(fd: int, how: int) -> bool:
    """``flock(fd, how)`` without waiting: False when another lock is in the way."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _unlock(fds: Iterable[int]) -> None:
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write_record(fd: int, record: dict) -> None:
    """Replace the file's content by ``record``; a failure (a full disk) is ignored: the
    record only informs waiters."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record, sort_keys=True).encode(), 0)


def _read_record(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 1 << 20, 0)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _peek(path: str) -> tuple[bool, dict | None]:
    """Whether lease file ``path`` is locked (by anyone, this process included), and its
    record."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError:  # missing, or not ours to open
        return False, None
    try:
        free = _try_lock(fd, fcntl.LOCK_SH)
        if free:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return not free, _read_record(fd)
    finally:
        os.close(fd)


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
    """Want ``count`` of ``max_procs`` CPU process slots; more ranks than slots take all of
    them (the case runs alone) instead of never running."""
    return Want(
        "process slots", tuple(f"slot:{i}" for i in range(max_procs)), min(count, max_procs)
    )


def _lock_path(lease_dir: str, name: str) -> str:
    return os.path.join(
        lease_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", name.replace(":", "-")) + ".lock"
    )


def read_holder(lease_dir: str, name: str) -> dict | None:
    """The holder record of resource ``name`` (None when unreadable or empty)."""
    return _peek(_lock_path(lease_dir, name))[1]


def describe_holder(record: dict | None) -> str:
    """Human words for a holder record: pid, what it runs, for how long, its ranks."""
    if not record or "pid" not in record:
        return "held by a process that left no record"
    import psutil

    words = f"held by pid {record['pid']}"
    if not psutil.pid_exists(record["pid"]):
        words += " (exited; processes it started still hold the lock)"
    details = [str(record["holder"])] if record.get("holder") else []
    if record.get("since"):
        details.append(f"for {max(0.0, time.time() - record['since']):.1f} s")
    if record.get("ranks"):
        details.append("ranks " + ",".join(str(p) for p in record["ranks"]))
    return words + (" (" + "; ".join(details) + ")" if details else "")


def waiters(lease_dir: str) -> list[dict]:
    """The live head of ``lease_dir``'s queue as a one-item list of its record (``pid``,
    ``holder``, ``since``, ``wants``: resource names); ``[]`` when nobody waits."""
    held, record = _peek(_lock_path(lease_dir, "queue"))
    return [record] if held and record and "wants" in record else []


class Lease:
    """Resources held exclusively until ``release()`` (or the holder's death)."""

    def __init__(self, lease_dir: str, locks: dict[str, int], holder: str) -> None:
        self.lease_dir = lease_dir
        self._locks = locks
        self._record = {"pid": os.getpid(), "holder": holder, "since": time.time()}
        with _held_lock:
            _held_here.update((lease_dir, name) for name in locks)
        self.annotate()

    @property
    def resources(self) -> tuple[str, ...]:
        """Names of the held resources, e.g. ``("cuda:1", "slot:0")``."""
        return tuple(self._locks)

    def cards(self) -> list[Card]:
        """The held cards, in lease order."""
        return [Card(*name.split(":", 1)) for name in self._locks if not name.startswith("slot:")]

    def annotate(self, **info: object) -> None:
        """Add facts (e.g. ``ranks=[pids]``) to the holder record waiters see."""
        self._record.update(info)
        for fd in self._locks.values():
            _write_record(fd, self._record)

    def fds(self) -> list[int]:
        """Descriptors holding the locks, for processes that must keep the lease alive."""
        return list(self._locks.values())

    def contended(self) -> bool:
        """Whether the waiter at the head of the queue wants one of these resources."""
        return any(set(w["wants"]) & set(self._locks) for w in waiters(self.lease_dir))

    def release(self, *, holders_gone: bool = True) -> None:
        """Give the resources back. ``holders_gone=False``: processes the descriptors were
        passed to may still run, and the OS frees each resource when the last of them exits."""
        locks, self._locks = self._locks, {}
        with _held_lock:
            _held_here.subtract((self.lease_dir, name) for name in locks)
        for fd in locks.values():
            if holders_gone:
                # Unlocking drops the lock for every process sharing this open file
                # (the ranks it was passed to): only once they are gone.
                _write_record(fd, {})
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(lease_dir: str, wants: Iterable[Want], *, timeout: float, holder: str) -> Lease:
    """Lease every ``Want`` at once, waiting at most ``timeout`` seconds.

    All-or-nothing (a partial grab is given back before waiting again: no deadlock), the
    head of the queue served before newcomers. Raises ``LeaseTimeout`` naming what was
    wanted, who holds it and who waits ahead; ``LeaseDirError`` / ``LeaseFileError`` for an
    unusable lease directory or file; ``LeaseError`` for any other failure, nothing held.
    """
    wants = [w for w in wants if w.count > 0]
    for want in wants:
        if want.count > len(want.names):
            raise ValueError(
                f"cannot lease {want.count} {want.what}: only {len(want.names)} exist "
                f"({', '.join(want.names) or 'none'})"
            )
    chosen, source = resolve_lease_dir(None)
    check_lease_dir(lease_dir, source if os.path.abspath(lease_dir) == chosen else "the caller")
    queue = _open(_lock_path(lease_dir, "queue"))
    head = False
    start = time.monotonic()
    delay = 0.02
    try:
        while True:
            if not head and _try_lock(queue, fcntl.LOCK_EX):
                head = True
                os.ftruncate(queue, 0)  # a dead head's wants are no one's
            locks, short, busy = _grab(
                lease_dir, wants, set() if head else _promised(queue, lease_dir)
            )
            if not short:
                return Lease(lease_dir, locks, holder)
            if busy and _yield(lease_dir, busy):
                continue  # this process freed some of it: try again at once
            waited = time.monotonic() - start
            if waited >= timeout:
                raise LeaseTimeout(_timeout_message(lease_dir, short, waited, head))
            if head and not os.fstat(queue).st_size:
                names = [name for want in wants for name in want.names]
                _write_record(
                    queue,
                    {"pid": os.getpid(), "holder": holder, "since": time.time(), "wants": names},
                )
            # Jitter keeps two waiters from looking in lockstep forever.
            time.sleep(min(delay * random.uniform(0.5, 1.5), max(0.0, timeout - waited)))
            delay = min(delay * 1.5, _POLL_MAX_S)
    except LeaseError:
        raise
    except OSError as exc:
        raise LeaseError(
            f"lease wait in {lease_dir} failed: {exc.strerror or exc}; nothing is left held"
        ) from exc
    finally:
        if head:
            with contextlib.suppress(OSError):
                os.ftruncate(queue, 0)
        os.close(queue)


def _grab(
    lease_dir: str, wants: list[Want], promised: set[str]
) -> tuple[dict[str, int], list[Want], set[str]]:
    """Lock what ``wants`` asks for but ``promised``: (the locks, the wants left short, the
    names found busy). Nothing stays locked unless all is had."""
    locks: dict[str, int] = {}
    short: list[Want] = []
    busy: set[str] = set()
    try:
        for want in wants:
            got = 0
            for name in want.names:
                if got == want.count:
                    break
                if name in promised or name in locks:
                    continue
                fd = _open(_lock_path(lease_dir, name))
                if _try_lock(fd, fcntl.LOCK_EX):
                    locks[name] = fd
                    got += 1
                else:
                    os.close(fd)
                    busy.add(name)
            if got < want.count:
                short.append(want)
    except BaseException:
        _unlock(locks.values())
        raise
    if short:
        _unlock(locks.values())
        locks = {}
    return locks, short, busy


def _promised(queue: int, lease_dir: str) -> set[str]:
    """What the head of the queue waits for, unless it waits for something this process
    holds (it waits for us, then: deferring would deadlock)."""
    wanted = set((_read_record(queue) or {}).get("wants") or ())
    with _held_lock:
        mine = {name for (d, name), n in _held_here.items() if d == lease_dir and n > 0}
    return set() if wanted & mine else wanted


def _timeout_message(lease_dir: str, short: list[Want], waited: float, head: bool) -> str:
    lines = [f"lease wait timed out after {waited:.1f} s (lease dir {lease_dir}):"]
    for want in short:
        lines.append(f"  waited for {want.count} of the {len(want.names)} {want.what}:")
        for name in want.names:
            held, record = _peek(_lock_path(lease_dir, name))
            lines.append(f"    {name}: {describe_holder(record) if held else 'free'}")
    wanted = {name for want in short for name in want.names}
    ahead = [] if head else [w for w in waiters(lease_dir) if set(w["wants"]) & wanted]
    if ahead:
        lines.append(f"  queued behind {len(ahead)} earlier waiter(s):")
        for w in ahead:
            waiting = max(0.0, time.time() - float(w.get("since") or time.time()))
            lines.append(f"    pid {w.get('pid')} ({w.get('holder')}, waiting {waiting:.1f} s)")
    return "\n".join(lines)


_yield_hooks: list[Callable[[str, frozenset[str]], bool]] = []


def add_yield_hook(hook: Callable[[str, frozenset[str]], bool]) -> None:
    """Register ``hook(lease_dir, busy_names) -> bool``: a lease wait in this process that
    finds resources busy calls it before waiting, to free what this process holds idle
    among them (its idle rank pool); True when it freed something."""
    if hook not in _yield_hooks:
        _yield_hooks.append(hook)


def _yield(lease_dir: str, busy: set[str]) -> bool:
    # Every hook is called, even after one freed something.
    return any([bool(hook(lease_dir, frozenset(busy))) for hook in list(_yield_hooks)])


# What the leases of this process hold, per lease directory (see ``_promised``).
_held_here: Counter[tuple[str, str]] = Counter()
_held_lock = threading.Lock()
