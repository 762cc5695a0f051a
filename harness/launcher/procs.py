"""Finding and killing every process a rank started.

The process the launcher starts for a rank (its supervisor, see
``harness.launcher.supervisor``) calls ``setsid()`` first thing and is a child
subreaper, so everything the rank starts stays in its tree; descendants are
found through the live process tree *and* through the session id, which also
catches orphans where subreapers are unsupported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

import psutil


def _gone(proc: psutil.Process) -> bool:
    try:
        # A zombie is dead; only its parent's wait() is missing (the launcher
        # reaps its own ranks, init reaps orphans).
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def session_members(sid: int) -> list[psutil.Process]:
    """Processes in session ``sid`` other than its leader.

    Only meaningful for a session a rank created: the kernel keeps a pid out
    of reuse while it names a live session, so members found here are that
    rank's leftovers.
    """
    members = []
    for proc in psutil.process_iter():
        if proc.pid == sid:
            continue
        with contextlib.suppress(OSError):
            if os.getsid(proc.pid) == sid:
                members.append(proc)
    return members


def process_tree(root: int, *, own_session: bool) -> list[psutil.Process]:
    """``root`` (if alive), its descendants, and, with ``own_session``, every
    other process still in the session ``root`` leads. Never raises for
    processes that vanish meanwhile."""
    procs: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(root)
        procs[root] = proc
        for child in proc.children(recursive=True):
            procs[child.pid] = child
    if own_session:
        for member in session_members(root):
            procs.setdefault(member.pid, member)
    return [p for p in procs.values() if not _gone(p)]


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            proc.send_signal(sig)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process in ``procs`` is dead; return those still alive at ``timeout``.

    Polls rather than ``wait()``s so that it never reaps a child of this process
    behind the back of the ``multiprocessing.Process`` that owns it.
    """
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if not _gone(p)]
    return alive


def kill_trees(roots: Iterable[int], *, grace: float, own_session: bool = True,
               kill_wait: float = 5.0, spare: Iterable[int] = ()) -> list[psutil.Process]:
    """Stop every process of the trees rooted at ``roots``: SIGTERM, then after
    ``grace`` seconds SIGKILL to whatever still runs (re-collected, so processes
    forked meanwhile are included). Pids in ``spare`` are left alone (a kept
    rank whose leftover children are stopped). Returns processes still alive
    ``kill_wait`` seconds after SIGKILL (stuck in the kernel), normally none."""
    roots = list(roots)
    spared = set(spare)
    procs = {p.pid: p for r in roots for p in process_tree(r, own_session=own_session)
             if p.pid not in spared}
    if not procs:
        return []
    _signal(procs.values(), signal.SIGTERM)
    if hasattr(signal, "SIGCONT"):
        # A stopped process acts on SIGTERM only once it runs again.
        _signal(procs.values(), signal.SIGCONT)
    wait_gone(list(procs.values()), grace)
    for r in roots:
        for p in process_tree(r, own_session=own_session):
            if p.pid not in spared:
                procs.setdefault(p.pid, p)
    alive = [p for p in procs.values() if not _gone(p)]
    if not alive:
        return []
    _signal(alive, signal.SIGKILL)
    return wait_gone(alive, kill_wait)


_STOPPED = {psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop")}


def stopped(pid: int) -> bool:
    """Whether rank process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP, a
    debugger). A rank that runs under a supervisor (``harness.launcher.rank``)
    is the supervisor's oldest child, which is checked too."""
    try:
        proc = psutil.Process(pid)
        if proc.status() in _STOPPED:
            return True
        children = sorted(proc.children(), key=lambda p: p.create_time())
        return bool(children) and children[0].status() in _STOPPED
    except psutil.Error:
        return False
