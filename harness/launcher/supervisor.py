"""A rank's supervisor: nothing a case starts outlives the case, or the launcher.

A spawned rank process first *splits* (``split``): it leads a new session,
declares itself a child subreaper (``PR_SET_CHILD_SUBREAPER``) and forks. The
child goes on to be the rank; the parent -- the process the launcher started
and knows by pid -- becomes its supervisor and runs no test code:

* every process the case starts stays below the supervisor, whatever it
  does: an orphan (a double-forked ``setsid()`` daemon included) is
  re-parented to the supervisor, the nearest living subreaper, never to init;
* when the rank exits, the supervisor stops everything left below it
  (SIGTERM, then SIGKILL after ``LEFTOVER_GRACE_S``), reaps it, and exits
  with the rank's status (the same exit code, or killed by the same signal);
* when the launcher dies (even by SIGKILL) the kernel tells the supervisor
  (``PR_SET_PDEATHSIG``), which kills the whole tree at once and exits; the
  rank dies with its supervisor the same way;
* the lease descriptors stay in the supervisor alone: the rank closes its
  copies, so no process of the case can hold a lease past the supervisor,
  which is the last of the case to exit;
* signals for the rank (the stack-dump signal, SIGTERM, SIGINT) are
  forwarded to it.

Linux only; elsewhere ``split`` does nothing and the rank runs unsupervised,
watching its parent from a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: How long processes left behind by a rank get between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 1.0
#: How often the supervisor checks its parent, besides being told.
_POLL_S = 0.5

_FORWARDED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGQUIT")
                   if hasattr(signal, name))


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def subreaper() -> bool:
    """Make this process a child subreaper (orphaned descendants come to it). False: unsupported."""
    return sys.platform.startswith("linux") and _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def split(parent_pid: int, *, keep: Iterable[int] = (), rank_only: Iterable[int] = ()) -> None:
    """Split this freshly spawned rank process into supervisor and rank; only
    the rank returns. ``keep`` (the lease descriptors) stay in the supervisor
    alone; ``rank_only`` (the pool's pipe) in the rank alone.

    Where subreapers are unsupported, returns at once in this process, which
    then leads its own session and dies with its parent.
    """
    with contextlib.suppress(OSError):
        os.setsid()
    if not subreaper():
        _watch_parent(parent_pid)
        return
    watched = {signal.SIGCHLD, signal.SIGHUP, *_FORWARDED}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    # The launcher's death arrives as SIGHUP (taken by sigtimedwait below).
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGHUP))
    if os.getppid() != parent_pid:  # the launcher died before prctl
        os._exit(1)
    supervisor = os.getpid()
    rank = os.fork()
    if rank == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != supervisor:  # the supervisor died before prctl
            os._exit(1)
        for fd in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
        return
    for fd in rank_only:
        with contextlib.suppress(OSError):
            os.close(fd)
    _supervise(rank, parent_pid, frozenset(watched))


def _watch_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux") and _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)):
        if os.getppid() != parent_pid:
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def _supervise(rank: int, parent_pid: int, watched: frozenset[int]) -> NoReturn:
    status: int | None = None
    while True:
        info = signal.sigtimedwait(watched, _POLL_S)
        if os.getppid() != parent_pid:
            _stop_all(grace=0.0)
            os._exit(1)
        if info is not None and info.si_signo in _FORWARDED:
            with contextlib.suppress(OSError):
                os.kill(rank, info.si_signo)
        status = _reap(rank, status)
        if status is not None:
            _stop_all(grace=LEFTOVER_GRACE_S)
            _exit_like(status)


def _reap(rank: int, status: int | None) -> int | None:
    """Reap every dead child; return the rank's wait status once it is among them."""
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == rank:
            status = st


def _descendants() -> list[int]:
    """Every process below this one (orphans come to it: it is a subreaper)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields follow the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop_all(*, grace: float) -> None:
    """SIGTERM (with ``grace`` > 0) then SIGKILL every descendant, reaping them."""
    sigs = [signal.SIGTERM, signal.SIGKILL] if grace > 0 else [signal.SIGKILL]
    for sig in sigs:
        pids = _descendants()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once it runs
        end = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < end:
            _reap(-1, None)
            if not _descendants():
                return
            time.sleep(0.02)


def _exit_like(status: int) -> NoReturn:
    """Leave the way the rank left: its exit code, or killed by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL / SIGSTOP take no handler
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
