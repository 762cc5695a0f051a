"""A rank's supervisor (``split``): a child subreaper above the rank, so nothing a case
starts outlives the case, or the launcher. It holds the lease descriptors, forwards
signals to the rank, and exits as the rank did; without subreapers (not Linux) the rank
watches its parent from a thread. A command case runs under it too (:func:`main`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import NoReturn

from harness import processes
from harness.jsonio import write_text
from harness.processes import die_with_parent, subreaper

#: How long processes left behind by a rank get between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 1.0
_POLL_S = 0.5  # how often the supervisor checks its parent, besides being told
#: The pid of the pytest controller, for its xdist workers (``tie_to_controller``).
CONTROLLER_ENV = "HARNESS_CONTROLLER_PID"

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGQUIT)


def tie_to_controller(*, worker: bool) -> None:
    """Tie an xdist worker's life to its pytest controller's (called in both): the
    controller records its pid (``$HARNESS_CONTROLLER_PID``); a worker is SIGKILLed when
    the controller dies, at once when it is already gone."""
    if not worker:
        os.environ[CONTROLLER_ENV] = str(os.getpid())
        return
    raw = os.environ.get(CONTROLLER_ENV, "")
    _watch_parent(int(raw) if raw.isdigit() else os.getppid())


def split(
    parent_pid: int,
    *,
    keep: Iterable[int] = (),
    rank_only: Iterable[int] = (),
    leftover_dir: str | None = None,
    status_path: str | None = None,
    leftovers_to: str | None = None,
) -> None:
    """Split this freshly spawned process into supervisor and rank; only the rank returns.
    ``keep`` (lease descriptors) stay in the supervisor alone, ``rank_only`` in the rank
    alone. When the launcher dies, the supervisor also removes ``leftover_dir``.
    ``status_path``: where it writes the rank's exit code (minus the signal) for a
    launcher that is not its parent; ``leftovers_to``: where it writes ``PID<TAB>COMMAND``
    for each process still running below it once the rank exited, before it stops them.
    """
    with contextlib.suppress(OSError):
        os.setsid()
    if not subreaper():
        _watch_parent(parent_pid)
        return
    watched = {signal.SIGCHLD, signal.SIGHUP, *_FORWARDED}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    # The launcher's death arrives as SIGHUP (taken by sigtimedwait below).
    die_with_parent(parent_pid, signal.SIGHUP)
    supervisor = os.getpid()
    rank = os.fork()
    if rank == 0:
        # `kill 0` from the rank or what it starts stops the rank, never its supervisor.
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        die_with_parent(supervisor)
        for fd in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
        return
    with contextlib.suppress(OSError):
        os.setpgid(rank, rank)  # also from here: whichever runs first, the group exists
    for fd in rank_only:
        with contextlib.suppress(OSError):
            os.close(fd)
    status: int | None = None
    while True:  # the supervisor, until it exits as the rank did
        info = signal.sigtimedwait(watched, _POLL_S)
        if os.getppid() != parent_pid:
            _stop_all(grace=0.0)
            if leftover_dir is not None:
                shutil.rmtree(leftover_dir, ignore_errors=True)
            os._exit(1)
        if info is not None and info.si_signo in _FORWARDED:
            with contextlib.suppress(OSError):
                os.kill(rank, info.si_signo)
        status = _reap(rank, status)
        if status is not None:
            if leftovers_to is not None:
                _record_leftovers(leftovers_to)
            _stop_all(grace=LEFTOVER_GRACE_S)
            if status_path is not None:
                with contextlib.suppress(OSError, ValueError):
                    write_text(status_path, str(os.waitstatus_to_exitcode(status)))
            _exit_like(status)


def _watch_parent(parent_pid: int) -> None:
    if die_with_parent(parent_pid):
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def _record_leftovers(path: str) -> None:
    me = os.getpid()
    lines = []
    for proc in processes.process_tree(me, own_session=False):
        if proc.pid != me:
            with contextlib.suppress(Exception):  # gone meanwhile: not a leftover
                lines.append(f"{proc.pid}\t{' '.join(proc.cmdline()) or proc.name()}\n")
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


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


def _stop_all(*, grace: float) -> None:
    me = os.getpid()
    processes.kill_trees(
        [me], grace=grace, own_session=False, spare=[me], reap=lambda: _reap(-1, None)
    )
    _reap(-1, None)


def main(argv: Sequence[str]) -> NoReturn:
    """``python -m harness.launcher.supervisor PARENT_PID LEFTOVERS KEEP -- PROGRAM [ARG...]``:
    run a command case's argv as a supervised rank (:func:`split`'s ``leftovers_to`` and
    ``keep``, comma-separated, each possibly ``""``); a program that cannot be run exits
    127 saying so on stderr."""
    parent, leftovers, keep, sep, *command = argv
    if sep != "--" or not command:
        sys.exit(
            "usage: python -m harness.launcher.supervisor PARENT_PID LEFTOVERS KEEP -- "
            "PROGRAM [ARG...]"
        )
    fds = [int(fd) for fd in keep.split(",") if fd]
    split(int(parent), keep=fds, leftovers_to=leftovers or None)
    # What Python ignores for itself, the program gets back (as subprocess's restore_signals).
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"harness: cannot run {command[0]!r}: {exc.strerror or exc}\n")
        sys.stderr.flush()
        os._exit(127)


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


if __name__ == "__main__":
    main(sys.argv[1:])
