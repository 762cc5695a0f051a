"""Kept rank processes (opt-in): consecutive launched cases with the same (device, nproc,
backend) run on one pool of ranks whose process group stays up, one pool per process.
A pool holds its lease until it is closed: on a key change, a failed or unresettable
case, when this process needs the resources (``lease.add_yield_hook``), when another
process waits for them (after the pool's slice, or once idle), at session end and exit.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util  # noqa: F401  (its exit handler must be registered before ours)
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import TYPE_CHECKING, Any

from harness import processes
from harness.launcher.lease import Lease, add_yield_hook
from harness.launcher.outcome import FAILED, CaseOutcome
from harness.launcher.rank import (
    EXIT,
    Idle,
    RankTask,
    RunCase,
    coverage_of_launcher,
    pool_rank_main,
)
from harness.launcher.ranks import (
    EXIT_WAIT_S,
    KILL_GRACE_S,
    CaseRun,
    reap_on_sigterm,
    signals_deferred,
    spawn_ranks,
    stop_ranks,
)
from harness.launcher.reset import Inherited
from harness.spec import LaunchSpec

if TYPE_CHECKING:
    from harness.launcher.case import CasePlan

LeaseFor = Callable[["CasePlan"], Lease]
#: How often an idle pool checks whether another process waits for its lease.
IDLE_CHECK_S = 0.25
#: A pool another process waits for is kept, while its process runs case after case,
#: for ``SLICE_FACTOR`` x what starting it cost (within ``MIN_SLICE_S`` .. ``MAX_SLICE_S``),
#: then given back: pools of xdist workers sharing too few slots take turns in slices
#: instead of restarting for every case, and a waiting session is never starved.
SLICE_FACTOR = 10.0
MIN_SLICE_S = 2.0
MAX_SLICE_S = 8.0
#: An idle pool another process waits for is given back after this long idle.
IDLE_YIELD_S = 1.0
#: How long ranks told to exit get before their trees are killed.
CLOSE_WAIT_S = 2.0


def pool_key(spec: LaunchSpec) -> tuple[str, int, str]:
    return (spec.device, spec.nproc, spec.dist_backend)  # what a case shares with its pool


def _send(conn: Connection, message: object) -> bool:
    """Send ``message`` to a rank (False, and the pipe closed: the rank is not listening)."""
    try:
        conn.send(message)
    except (OSError, ValueError):
        conn.close()
        return False
    return True


def _idle(conn: Connection) -> Idle | None:
    """The rank's ``Idle`` message, dropping those before it (None: none yet)."""
    try:
        while not conn.closed and conn.poll(0):
            if isinstance(message := conn.recv(), Idle):
                return message
    except (EOFError, OSError):
        conn.close()
    return None


class RankPool:
    """``spec.nproc`` kept rank processes holding ``lease``. Only the thread that created
    it may use it (Linux kills the ranks when the thread that spawned them ends)."""

    def __init__(self, spec: LaunchSpec, lease: Lease) -> None:
        self.nproc = spec.nproc
        self.key = pool_key(spec)
        self.lease = lease
        self.cards = lease.cards()
        self.usable = True  # False once it must not run another case
        self.problem = ""  # why it could not take the last case
        self.busy = False
        self.cases = 0
        self.survivors: list[int] = []
        self.started = time.monotonic()
        self.startup_s: float | None = None  # to the end of the first case
        self.idle_since: float | None = None
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix="harness-pool-")
        self._store = os.path.join(self._dir, "store")
        self._procs: list[Any] = []
        self._channels: list[Connection] = []
        theirs: list[Any] = []
        coverage = coverage_of_launcher()

        def args_for(rank: int, fds: list[Any]) -> tuple:
            ours, end = get_context("spawn").Pipe()
            theirs.append(end)
            self._channels.append(ours)
            return (os.getpid(), end, fds, self._dir, coverage)

        try:
            spawn_ranks(spec.nproc, pool_rank_main, args_for, self._procs, lease=lease)
        except BaseException:
            self.close()
            raise
        finally:
            for end in theirs:
                end.close()  # so that a rank's death reads as EOF here

    def should_yield(self, *, busy: bool) -> bool:
        """Whether to give the lease back to another process waiting for it: once the pool
        had its slice, or (``busy`` False) once it sat idle ``IDLE_YIELD_S``."""
        if not self.lease.contended():
            return False
        now = time.monotonic()
        slice_s = min(MAX_SLICE_S, max(MIN_SLICE_S, SLICE_FACTOR * (self.startup_s or 0.0)))
        if now - self.started >= slice_s:
            return True
        return not busy and self.idle_since is not None and now - self.idle_since >= IDLE_YIELD_S

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def alive(self) -> bool:
        return (
            self.usable
            and all(p.is_alive() for p in self._procs)
            and not any(c.closed for c in self._channels)
        )

    def run(self, task: RankTask, plan: CasePlan) -> CaseOutcome | None:
        """Run one case on the pool, through the phases fresh ranks go through. None: a rank
        was gone before the case started (``problem`` says why); after any other problem
        the result says so and ``usable`` is False. Never returns with a rank of a closed
        pool, or a process a case started, alive."""
        self.cases += 1
        case_dir = os.path.join(self._dir, f"case-{self.cases}")
        os.mkdir(case_dir)
        run = CaseRun(plan, self.cards, case_dir, store_path=self._store)
        run.result.ranks = f"kept (case {self.cases} of its pool)"
        self.lease.annotate(holder=plan.what, ranks=self.pids)
        kept = False
        try:
            with reap_on_sigterm():
                try:
                    if not self._dispatch(task, run):
                        return None
                    run.supervise(self._procs, self._channels, release=self._release)
                    kept = self._settle(run.result)
                finally:
                    with signals_deferred():
                        if kept:
                            run.collect_logs()
                        else:
                            self._stop(run)
            return run.result
        finally:
            shutil.rmtree(case_dir, ignore_errors=True)

    def _dispatch(self, task: RankTask, run: CaseRun) -> bool:
        """Hand the case to every rank (False: a rank is gone)."""
        if not self.alive():
            self.problem = "a rank is gone"
            return False
        inherited = Inherited.now()  # what fresh ranks would start with, fixtures' doing included
        for rank, channel in enumerate(self._channels):
            if not _send(channel, RunCase(run.rank_context(rank), task, inherited)):
                self.problem = f"rank {rank} is not listening"
                return False
        return True

    def _collect_idle(self) -> dict[int, Idle]:
        """Each rank's ``Idle``, waiting at most ``EXIT_WAIT_S`` (ranks that die or close
        their pipe are left out at once)."""
        got: dict[int, Idle] = {}
        end = time.monotonic() + EXIT_WAIT_S
        while True:
            for rank, channel in enumerate(self._channels):
                if rank not in got and (message := _idle(channel)) is not None:
                    got[rank] = message
            waiting = [
                r
                for r in range(len(self._channels))
                if r not in got and not self._channels[r].closed and self._procs[r].is_alive()
            ]
            left = end - time.monotonic()
            if not waiting or left <= 0:
                return got
            wait_any(
                [self._channels[r] for r in waiting] + [self._procs[r].sentinel for r in waiting],
                timeout=left,
            )

    def _settle(self, result: CaseOutcome) -> bool:
        """After a case: whether the pool can run another (every rank passed or skipped and
        reported itself clean); processes the case started are stopped either way."""
        if result.status == FAILED or result.exits or len(result.outcomes) < self.nproc:
            return False
        idle = self._collect_idle()
        problems = [f"rank {r}: {idle[r].problem}" for r in sorted(idle) if idle[r].problem]
        problems += [
            f"rank {r} did not report back after the case"
            for r in range(self.nproc)
            if r not in idle
        ]
        ranks = [*self.pids, *(message.pid for message in idle.values())]
        leftovers = processes.kill_trees(self.pids, grace=KILL_GRACE_S, spare=ranks)
        if leftovers:
            problems.append(f"pids {[p.pid for p in leftovers]} the case started would not die")
        if problems:
            result.notes.append(
                "the case passed, but its ranks are not reused: " + "; ".join(problems)
            )
            return False
        return True

    def _release(self, ranks: list[int]) -> None:
        """Let ``ranks`` (finished while peers still run) leave now; no reuse."""
        self.usable = False
        for rank in ranks:
            _send(self._channels[rank], EXIT)

    def _stop(self, run: CaseRun) -> None:
        """Tear the pool down mid-case, the way fresh ranks are stopped."""
        self.usable = False
        for channel in self._channels:
            _send(channel, EXIT)  # ranks that reported exit now instead of waiting
        run.wind_down(self._procs)
        self.survivors = list(run.result.survivors)
        self.close()

    def close(self) -> None:
        """Stop and reap every rank and give the lease back. Idempotent."""
        self.usable = False
        if self._closed:
            return
        self._closed = True
        for channel in self._channels:
            _send(channel, EXIT)
        survivors = stop_ranks(self._procs, patience=CLOSE_WAIT_S)
        for channel in self._channels:
            with contextlib.suppress(OSError):
                channel.close()
        self.survivors += survivors
        # Ranks the kernel would not kill keep their inherited lock.
        self.lease.release(holders_gone=not self.survivors)
        shutil.rmtree(self._dir, ignore_errors=True)


class PoolKeeper:
    """This process's pool (``pool``; None: none): reused, replaced, yielded and closed."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.pool: RankPool | None = None
        self._watcher: threading.Thread | None = None

    def run(self, task: RankTask, plan: CasePlan, lease_for: LeaseFor) -> CaseOutcome:
        """Run a case on the kept pool for ``plan.spec``, starting one (leased with
        ``lease_for``: ``LeaseTimeout``) when none fits or has every rank alive. Main
        thread only (the one that outlives the pool)."""
        with self._lock:
            notes: list[str] = []
            pool = self.pool
            if pool is not None and (
                pool.key != pool_key(plan.spec) or not pool.alive() or pool.should_yield(busy=True)
            ):
                self._close_locked()  # (should_yield: another process waits, the slice is over)
            while True:
                pool = self.pool or self._start(plan, lease_for)
                pool.busy = True
                result = None
                try:
                    result = pool.run(task, plan)
                finally:
                    pool.busy = False
                    pool.idle_since = time.monotonic()
                    if pool.startup_s is None:
                        pool.startup_s = pool.idle_since - pool.started
                    if not pool.usable or result is None:
                        self._close_locked()
                if result is not None:
                    result.notes[:0] = notes
                    return result
                # A fresh pool's ranks are all there, so this loops at most once.
                notes.append(f"a kept rank was gone ({pool.problem}); the case ran on fresh ranks")

    def _start(self, plan: CasePlan, lease_for: LeaseFor) -> RankPool:
        lease = lease_for(plan)
        try:
            self.pool = RankPool(plan.spec, lease)
        except BaseException:
            lease.release()
            raise
        self._watch()
        return self.pool

    def close(self) -> None:
        """Close the pool, if any (session end, interpreter exit)."""
        with self._lock:
            self._close_locked()

    def yield_idle(self, lease_dir: str, busy: frozenset[str]) -> bool:
        """Lease-wait hook: close the pool if it is idle and holds one of ``busy`` in
        ``lease_dir``. True when it did."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            pool = self.pool
            if pool is None or pool.busy or pool.lease.lease_dir != lease_dir:
                return False
            if busy & set(pool.lease.resources):
                self._close_locked()
                return True
            return False
        finally:
            self._lock.release()

    def _close_locked(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def _watch(self) -> None:
        """While a pool is kept, give it up when idle and another process waits for it."""
        if self._watcher is not None and self._watcher.is_alive():
            return

        def watch() -> None:
            while self.pool is not None:
                time.sleep(IDLE_CHECK_S)
                if not self._lock.acquire(blocking=False):
                    continue  # a case is running (or starting) on it
                try:
                    pool = self.pool
                    if pool is not None and not pool.busy and pool.should_yield(busy=False):
                        self._close_locked()
                except Exception:
                    pass  # the next case closes a pool that misbehaves
                finally:
                    self._lock.release()

        self._watcher = threading.Thread(target=watch, name="harness-pool-watch", daemon=True)
        self._watcher.start()


#: The pool of this process (pytest session or script).
keeper = PoolKeeper()
add_yield_hook(keeper.yield_idle)
# Registered after multiprocessing's exit handler, so it runs before it: the
# ranks are stopped here instead of being joined (forever) there.
atexit.register(keeper.close)
