"""Process trees: finding every process below another, stopping them all, tying a
process's life to its parent's, and stopping what a stretch of this process's life left
running below it. Waits poll instead of ``wait()``ing, so they never reap a child behind
its ``Popen``'s back; a zombie counts as gone. psutil is imported where used (``harness
inventory`` and collection need none).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
# Loaded once, here: a ``preexec_fn`` runs between fork and exec, where
# loading a library (allocating) is unsafe.
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: object) -> bool:
    try:
        return _libc.prctl(option, value, 0, 0, 0) == 0
    except AttributeError:  # not Linux
        return False


def subreaper(enable: bool = True) -> bool:
    """Make this process a child subreaper (``enable``; else no longer one): orphaned
    descendants are re-parented to it, not to init. False where unsupported (not Linux)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, int(enable))


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (False where that cannot be read)."""
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) and bool(flag.value)


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (the *thread* that
    started it) dies; exit at once (status 1) when ``parent_pid`` is already gone. False
    where unsupported (not Linux). Children do not inherit the request."""
    if not _prctl(_PR_SET_PDEATHSIG, int(sig)):
        return False
    if os.getppid() != parent_pid:
        os._exit(1)
    return True


def _gone(proc: psutil.Process) -> bool:
    import psutil

    try:  # a zombie is dead; only its parent's wait() is missing
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def process_tree(root: int, *, own_session: bool) -> list[psutil.Process]:
    """``root`` (if alive), its descendants, and, with ``own_session``, every other process
    still in the session ``root`` leads (a live session keeps its pid from reuse: these are
    the leftovers of a session a rank created). Never raises for vanished processes."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    for pid in (root, *_below(root)):
        with contextlib.suppress(psutil.Error):
            procs[pid] = psutil.Process(pid)
    for member in psutil.process_iter() if own_session else ():
        with contextlib.suppress(OSError):
            if member.pid != root and os.getsid(member.pid) == root:
                procs.setdefault(member.pid, member)
    return [p for p in procs.values() if not _gone(p)]


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            proc.send_signal(sig)


def wait_gone(
    procs: list[psutil.Process], timeout: float, *, reap: Callable[[], object] | None = None
) -> list[psutil.Process]:
    """Wait until every process in ``procs`` is dead (polling; ``reap`` is called on every
    poll by a caller that reaps its own children); return those alive at ``timeout``."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        if reap is not None:
            reap()
        alive = [p for p in alive if not _gone(p)]
    return alive


def terminate(
    procs: Iterable[psutil.Process],
    *,
    grace: float,
    kill_wait: float = 5.0,
    more: Callable[[], Iterable[psutil.Process]] = tuple,
    reap: Callable[[], object] | None = None,
) -> list[psutil.Process]:
    """Stop ``procs``: SIGTERM (and SIGCONT: a stopped process acts on SIGTERM only once it
    runs), then after ``grace`` seconds SIGKILL to whatever still runs and what ``more()``
    finds then (processes forked meanwhile); ``grace`` 0 sends SIGKILL alone. Returns the
    processes still alive ``kill_wait`` seconds after SIGKILL (stuck in the kernel)."""
    found = {p.pid: p for p in procs if not _gone(p)}
    if not found:
        return []
    if grace > 0:
        _signal(found.values(), signal.SIGTERM)
        _signal(found.values(), signal.SIGCONT)
        wait_gone(list(found.values()), grace, reap=reap)
    found.update((p.pid, p) for p in more() if p.pid not in found)
    alive = [p for p in found.values() if not _gone(p)]
    _signal(alive, signal.SIGKILL)
    return wait_gone(alive, kill_wait, reap=reap)


def kill_trees(
    roots: Iterable[int],
    *,
    grace: float,
    own_session: bool = True,
    kill_wait: float = 5.0,
    spare: Iterable[int] = (),
    reap: Callable[[], object] | None = None,
) -> list[psutil.Process]:
    """Stop the trees rooted at ``roots`` (``process_tree``) but the pids in ``spare``, as
    ``terminate`` does, and return what it returns."""
    roots, spared = list(roots), set(spare)

    def collect() -> list[psutil.Process]:
        trees = (process_tree(r, own_session=own_session) for r in roots)
        return [p for tree in trees for p in tree if p.pid not in spared]

    return terminate(collect(), grace=grace, kill_wait=kill_wait, more=collect, reap=reap)


#: A reported command line is cut to this many characters.
COMMAND_CHARS = 300


@dataclass(frozen=True)
class Leftover:
    """A process found still running where nothing should be: its pid and command line."""

    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.command}"


def descendants() -> set[psutil.Process]:
    """Every process below this one now (exited ones not yet waited for included). They
    compare by pid *and* start time: a pid reused later is a different process."""
    import psutil

    found: set[psutil.Process] = set()
    for pid in _below(os.getpid()):
        with contextlib.suppress(psutil.Error):
            found.add(psutil.Process(pid))
    return found


def _below(root: int) -> set[int]:
    """The pids below ``root``, from ``/proc/PID/task/TID/children`` where Linux has it:
    psutil walks the whole process table (1000x slower; a case pays for this twice)."""
    import psutil

    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        with contextlib.suppress(psutil.Error):
            return {p.pid for p in psutil.Process(root).children(recursive=True)}
        return set()
    found: set[int] = set()
    stack = [root]
    while stack:
        pid = stack.pop()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                    new = {int(c) for c in f.read().split()} - found
                    found |= new
                    stack.extend(new)
    return found


def command_line(proc: psutil.Process, fallback: str = "?") -> str:
    """``proc``'s command line (its name in brackets when it has none, ``fallback`` when it
    cannot be read), cut to ``COMMAND_CHARS``."""
    import psutil

    try:
        text = " ".join(proc.cmdline()) or f"[{proc.name()}]"
    except psutil.Error:
        text = fallback
    return text if len(text) <= COMMAND_CHARS else text[: COMMAND_CHARS - 3] + "..."


def stop_leftovers(
    before: set[psutil.Process],
    *,
    settle: float,
    grace: float,
    spare: Callable[[], set[int]] = set,
    kill_wait: float = 5.0,
) -> list[Leftover]:
    """Stop what runs below this process now and did not at ``before`` (``descendants``),
    but the trees of the pids ``spare()`` names (asked again before SIGKILL): ``settle``
    seconds to end by themselves, then ``terminate``. Those that were this process's
    children are reaped. Returns the stopped ones, described before they were stopped."""

    def new() -> list[psutil.Process]:
        found = [p for p in descendants() if p not in before]
        spared = set(spare()) if found else set()
        spared = spared.union(*(_below(pid) for pid in spared))
        return [p for p in found if p.pid not in spared]

    found = new()
    if not found:
        return []
    alive = wait_gone(found, settle)
    left = [Leftover(p.pid, command_line(p)) for p in alive]
    seen = {p.pid: p for p in found}

    def more() -> list[psutil.Process]:
        later = new()
        seen.update((p.pid, p) for p in later)
        return later

    terminate(alive, grace=grace, kill_wait=kill_wait, more=more)
    me = os.getpid()
    for proc in seen.values():  # reap those that were children of this process
        with contextlib.suppress(Exception):
            if proc.ppid() == me and _gone(proc):
                os.waitpid(proc.pid, os.WNOHANG)
    return left
