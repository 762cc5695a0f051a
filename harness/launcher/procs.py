"""Finding and killing every process a rank started.

The process the launcher starts for a rank (its supervisor, see
``harness.launcher.supervisor``) calls ``setsid()`` first thing and is a child
subreaper, so everything the rank starts stays in its tree; descendants are
found through the live process tree *and* through the session id, which also
catches orphans where subreapers are unsupported. The tree walking and
stopping is ``harness.processes`` (shared with ``harness run``); this module
adds what only ranks need.
"""

from __future__ import annotations

from harness.processes import kill_trees, process_tree, session_members, wait_gone

__all__ = ["kill_trees", "process_tree", "session_members", "stopped", "wait_gone"]


def stopped(pid: int) -> bool:
    """Whether rank process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP, a
    debugger). A rank that runs under a supervisor (``harness.launcher.rank``)
    is the supervisor's oldest child, which is checked too."""
    import psutil

    halted = {psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop")}
    try:
        proc = psutil.Process(pid)
        if proc.status() in halted:
            return True
        children = sorted(proc.children(), key=lambda p: p.create_time())
        return bool(children) and children[0].status() in halted
    except psutil.Error:
        return False
