"""The one way rank processes are started and stopped, for fresh ranks and
kept pools alike.

Ranks start with the *spawn* start method (a fork after CUDA was initialised
breaks every child), inheriting the lease's descriptors; they are stopped by
waiting (a bounded time) for them to leave by themselves, then killing every
process of their trees (SIGTERM, then SIGKILL after ``KILL_GRACE_S``) and
reaping them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any

from harness.launcher import procs
from harness.launcher.fds import InheritedFd, lease_fds

if TYPE_CHECKING:
    from harness.launcher.lease import Lease

#: SIGTERM -> SIGKILL grace when stopping a rank's process tree.
KILL_GRACE_S = 3.0
#: How long a stopped rank, already dead, gets to be reaped.
_REAP_WAIT_S = 1.0


def spawn_ranks(
    nproc: int,
    target: Callable[..., Any],
    args_for: Callable[[int, list[InheritedFd]], tuple],
    started: list[Any],
    *,
    lease: Lease | None = None,
) -> None:
    """Start ``nproc`` rank processes ``target(*args_for(rank, fds))`` (``fds``: the
    lease's descriptors, inherited by each rank), appending each to ``started``
    as soon as it runs, so that a caller stopping ``started`` after a failure
    midway stops every one that did start."""
    mp = get_context("spawn")
    fds = lease_fds(lease)
    for rank in range(nproc):
        proc = mp.Process(target=target, args=args_for(rank, fds), name=f"harness-rank-{rank}")
        proc.start()
        started.append(proc)


def stop_ranks(started: list[Any], *, patience: float = 0.0) -> list[int]:
    """Give the ranks ``patience`` seconds (in all) to exit by themselves, then
    stop every process of their trees and reap them. Returns the pids still
    alive after SIGKILL (stuck in the kernel)."""
    end = time.monotonic() + patience
    for proc in started:
        if proc.pid is not None:
            proc.join(max(0.0, end - time.monotonic()))
    survivors = procs.kill_trees([p.pid for p in started if p.pid is not None], grace=KILL_GRACE_S)
    for proc in started:
        if proc.pid is not None:
            proc.join(_REAP_WAIT_S)  # reaps it, now that it is dead
    return [p.pid for p in survivors]
