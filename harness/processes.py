"""Process trees: finding every process below another, stopping them all (SIGTERM with
SIGCONT, a grace, SIGKILL to what still runs and was forked meanwhile, a bounded wait),
tying a process's life to its parent's (``die_with_parent``), and stopping what a stretch
of this process's life left running below it (``descendants`` before, ``stop_leftovers``
after: a case, a session, a run). Waits poll instead of ``wait()``ing, so they never reap
a child behind its ``Popen``'s back; a zombie counts as gone. psutil is imported where
used: ``harness inventory`` and collection need none.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
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
_libc = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: object) -> bool:
    try:
        return _libc is not None and _libc.prctl(option, value, 0, 0, 0) == 0
    except AttributeError:
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
    """Have the kernel send ``sig`` to this process when its parent dies; exit at once
    (status 1) when ``parent_pid`` is already gone. False where unsupported (not Linux).
    The kernel acts on the death of the parent *thread* that started this process, and
    children do not inherit the request."""
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
    still in the session ``root`` leads (the kernel keeps a pid out of reuse while it
    names a live session, so for a session a rank created these are its leftovers).
    Never raises for processes that vanish meanwhile."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(root)
        procs = {p.pid: p for p in [proc, *proc.children(recursive=True)]}
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
    """Stop every process of the trees rooted at ``roots`` (``process_tree``) as
    ``terminate`` does, but the pids in ``spare``. Returns those still alive
    ``kill_wait`` seconds after SIGKILL."""
    roots, spared = list(roots), set(spare)

    def collect() -> list[psutil.Process]:
        trees = (process_tree(r, own_session=own_session) for r in roots)
        return [p for tree in trees for p in tree if p.pid not in spared]

    return terminate(collect(), grace=grace, kill_wait=kill_wait, more=collect, reap=reap)


#: A leftover's command line is cut to this many characters in its description.
COMMAND_CHARS = 300


@dataclass(frozen=True)
class Leftover:
    """A process found still running where nothing should be: its pid and command line."""

    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.command}"


def descendants() -> set[psutil.Process]:
    """Every process below this one now (exited ones not yet waited for included).
    psutil's processes compare by pid *and* start time: a pid reused later is a different
    process."""
    import psutil

    found: set[psutil.Process] = set()
    for pid in _below(os.getpid()):
        with contextlib.suppress(psutil.Error):
            found.add(psutil.Process(pid))
    return found


def _below(root: int) -> set[int]:
    """The pids below ``root``. Walks only its tree where Linux lists each thread's
    children (``/proc/PID/task/TID/children``), not the whole process table as psutil
    does (1000x slower, and a case pays for this twice)."""
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
    but the pids ``spare()`` names (asked again before SIGKILL) and the processes below
    them: each gets ``settle`` seconds to end by itself (a process told to stop that has
    not yet), then the rest are stopped as ``terminate`` does. Those that were this
    process's children (its own, or orphans a child subreaper gets) are reaped. Returns
    the stopped ones, described before they were stopped; one walk of the process table
    when nothing is new."""

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
