"""Rank processes of one case: ``spawn_ranks`` / ``stop_ranks``, ``CaseRun`` (each rank's
context, the one supervision loop, wind down), and ``run_ranks``, a case on fresh ranks
start to end (a kept pool goes through the same phases).
"""

from __future__ import annotations

import contextlib
import operator
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import get_context, reduction
from multiprocessing.connection import wait as wait_any
from typing import TYPE_CHECKING, Any

from harness import processes
from harness.devices import Card, device_type, is_simulated, visibility, visible
from harness.launcher.outcome import (
    OUTPUT_TAIL_BYTES,
    CaseOutcome,
    RankOutcome,
    file_size,
    read_bounded,
)
from harness.launcher.rank import (
    CASE_ENV,
    STACK_DUMP_SIGNAL,
    EnclosingCase,
    RankContext,
    RankTask,
    coverage_of_launcher,
    pg_timeout_for,
    rank_main,
)
from harness.spec import LaunchSpec, LaunchSpecError
from harness.validation import check_int

if TYPE_CHECKING:
    from harness.launcher.case import CasePlan
    from harness.launcher.lease import Lease

#: SIGTERM -> SIGKILL grace when stopping a rank's process tree.
KILL_GRACE_S = 3.0
_REAP_WAIT_S = 1.0
#: After one rank failed, how long the others get before they are stopped.
ABANDON_GRACE_S = 5.0
#: How long a rank that reported its outcome may take to exit by itself.
EXIT_WAIT_S = 5.0
STACK_DUMP_WAIT_S = 2.0
#: Kept ranks that finished a case wait this long for their peers before they leave.
STRAGGLER_GRACE_S = 1.0
_HARNESS_RANK_FILE = os.path.join("harness", "launcher", "rank.py")
#: How long a case's ranks may take to be ready (spawning, imports, joining the process
#: group): the case deadline counts from the moment they are.
START_BOUND_S = 300.0
#: What every rank gets unless the launcher's environment says otherwise: one OpenMP
#: thread (as torchrun: N ranks using every core oversubscribe the host), and torch's
#: store-based barrier after init_process_group / new_group (a rank leaving with os._exit
#: must not close its connections while a peer still joins: "connectFullMesh failed").
RANK_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "TORCH_DIST_INIT_BARRIER": "1"}


@dataclass(frozen=True)
class ProcessSpec(LaunchSpec):
    """A plain case of an accelerator suite entry, run apart (internal): one process, no
    process group, its ``card_count`` leased cards visible to it and its children."""

    card_count: int = 1
    reuse: bool | None = False

    def __post_init__(self) -> None:
        super().__post_init__()
        count = check_int(self.card_count, "card_count", minimum=1, error=LaunchSpecError)
        object.__setattr__(self, "card_count", count)

    @property
    def cards(self) -> int:
        return self.card_count if device_type(self.device).is_accelerator else 0


def run_ranks(
    task: RankTask, plan: CasePlan, cards: list[Card], *, lease: Lease | None = None
) -> CaseOutcome:
    """Run ``task`` in ``plan.spec.nproc`` fresh ranks (rank ``r`` on ``cards[r]``) and
    report what happened, within the deadline plus the stop graces. No process of any
    rank's tree is alive then (``result.survivors``: any the kernel would not kill)."""
    run = CaseRun(plan, cards, tempfile.mkdtemp(prefix="harness-case-"))
    started: list[Any] = []
    with reap_on_sigterm():
        try:
            spawn_ranks(
                plan.spec.nproc,
                rank_main,
                lambda rank, fds: (run.rank_context(rank), task, fds),
                started,
                lease=lease,
            )
            if lease is not None:
                lease.annotate(ranks=[p.pid for p in started])
            run.supervise(started)
        finally:
            # Inside reap_on_sigterm: gone before a re-raised SIGTERM ends the process.
            with signals_deferred():
                try:
                    run.wind_down(started)
                finally:
                    shutil.rmtree(run.case_dir, ignore_errors=True)
    return run.result


class CaseRun:
    """One run of a case on a set of ranks (fresh or kept): its directory, its outcome so
    far, and the phases that fill it in."""

    def __init__(
        self, plan: CasePlan, cards: list[Card], case_dir: str, *, store_path: str | None = None
    ) -> None:
        spec = plan.spec
        apart = isinstance(spec, ProcessSpec)
        label = spec.device + (" (a process of its own)" if apart else f"/{spec.dist_backend}")
        if cards:
            label += " on " + ",".join(str(c) for c in cards[: spec.cards])
        self.plan = plan
        self.cards = cards
        self.case_dir = case_dir
        self.capture = plan.settings.capture
        self.store_path = store_path or os.path.join(case_dir, "store")
        self.result = CaseOutcome(
            spec.nproc,
            label,
            plan.deadline.seconds,
            plan.deadline.source,
            abandon_grace_s=ABANDON_GRACE_S,
            cards=tuple(str(c) for c in cards[: spec.cards]),
        )
        self.enclosing = EnclosingCase(
            plan.what,
            # A case run apart may launch ranks on its cards (harness.launch), one per card.
            max(spec.nproc, spec.cards) if apart else spec.nproc,
            spec.device,
            tuple(str(c) for c in cards),
            time.time() + plan.deadline.seconds,
            budget_dir=os.path.join(case_dir, "nested-slots"),
        )
        self._started = time.monotonic()
        #: ``START_BOUND_S`` until every rank is ready, then the case deadline from then
        self.deadline = self._started + START_BOUND_S
        self.ready = False
        self._streamed: dict[int, int] = {}

    def path(self, rank: int, kind: str) -> str:
        return rank_path(self.case_dir, rank, kind)

    def rank_context(self, rank: int) -> RankContext:
        """What rank ``rank`` needs to know: environment, card, files, rendezvous store. A
        case run apart gets its cards in the visibility variable and nothing of a rank."""
        spec = self.plan.spec
        apart = isinstance(spec, ProcessSpec)
        env = {CASE_ENV: self.enclosing.to_env()}
        card = None
        if apart:
            env.update(visible(self.cards[: spec.cards]))
        else:
            for name in ("RANK", "LOCAL_RANK"):
                env[name] = str(rank)
            for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                env[name] = str(spec.nproc)
            env.update({k: v for k, v in RANK_ENV_DEFAULTS.items() if k not in os.environ})
            if spec.cards:
                card = self.cards[rank]
                env.update(visibility(card))
        return RankContext(
            rank=rank,
            world_size=spec.nproc,
            backend=spec.dist_backend,
            card=card,
            simulated=is_simulated(),
            store_path=self.store_path,
            outcome_path=self.path(rank, "outcome"),
            stacks_path=self.path(rank, "stacks"),
            log_path=self.path(rank, "log") if self.capture else None,
            ready_path=self.path(rank, "ready"),
            deadline_s=self.plan.deadline.seconds,
            pg_timeout_s=pg_timeout_for(self.plan.deadline.seconds),
            parent_pid=os.getpid(),
            env=env,
            coverage=coverage_of_launcher(),
            process_group=not apart,
        )

    def supervise(
        self,
        started: list[Any],
        channels: list[Any] | None = None,
        *,
        release: Callable[[list[int]], None] | None = None,
        exited: Callable[[int], tuple[float, int] | None] | None = None,
        gone: Callable[[list[int]], bool] | None = None,
        begun: Callable[[int], bool] | None = None,
    ) -> None:
        """Wait until every rank has reported or exited, the deadline passes, or the
        others overstay ``ABANDON_GRACE_S`` after a failure; record which.

        Kept ranks: ``channels`` wake the wait when a rank's outcome is written; ``release``
        gets, once, the ranks that finished while others still run ``STRAGGLER_GRACE_S``
        later, so that they leave as fresh ranks would (a peer blocked in a collective with
        them fails now). Ranks that are not this process's children (emulated nodes):
        ``exited(rank)`` (see ``observe``), ``gone(pending)`` (a node agent ended),
        ``begun(rank)`` (only such ranks are timed out or abandoned).
        """
        result = self.result
        first_failure: float | None = None
        first_done: float | None = None
        if exited is None:

            def exited(rank: int) -> tuple[float, int] | None:
                code = started[rank].exitcode
                return None if code is None else (time.time(), code)

        while True:
            pending = self.observe(exited)
            if not pending:
                return
            now = time.monotonic()
            if not self.ready and all(  # the case deadline starts once every rank is ready
                r in result.outcomes or r in result.exits or os.path.exists(self.path(r, "ready"))
                for r in range(self.plan.spec.nproc)
            ):
                self.ready = True
                result.start_s = now - self._started
                self.deadline = now + self.plan.deadline.seconds
            if first_failure is None and (result.has_failure() or (gone and gone(pending))):
                first_failure = now
            if release is not None and result.outcomes:
                first_done = now if first_done is None else first_done
                if now >= first_done + STRAGGLER_GRACE_S:
                    release(sorted(r for r in result.outcomes if r not in result.exits))
                    release = None
            running = [r for r in pending if begun is None or begun(r)]
            if now >= self.deadline:
                result.timed_out, result.deadline_passed = running, True
                if not self.ready:
                    result.deadline_s, result.starting = START_BOUND_S, True
                    result.deadline_source = "the harness's bound on starting ranks"
                return
            if first_failure is not None and now >= first_failure + ABANDON_GRACE_S:
                result.abandoned = running
                return
            if self.capture:
                self.stream_output()
            # Exits wake us at once, and so do kept ranks' messages (read later: the next
            # observe finds the outcome); outcomes of ranks still tearing down are polled.
            waitables: list[Any] = [started[r].sentinel for r in pending if r < len(started)]
            if channels is not None:
                waitables += [channels[r] for r in pending if not channels[r].closed]
            wait_any(waitables, timeout=min(0.1, self.deadline - now))

    def observe(self, exited: Callable[[int], tuple[float, int] | None]) -> list[int]:
        """Record new outcomes and exits (``exited(rank)``: (when, code) or None, asked before
        the outcome is read); return the ranks neither reported nor exited."""
        result = self.result
        pending = []
        for rank in range(self.plan.spec.nproc):
            exit_ = None if rank in result.exits else exited(rank)
            if rank not in result.outcomes:
                outcome = RankOutcome.read(self.path(rank, "outcome"))
                if outcome is not None:
                    result.outcomes[rank] = outcome
            if exit_ is not None:
                result.exits[rank] = exit_
            if rank not in result.outcomes and rank not in result.exits:
                pending.append(rank)
        return pending

    def wind_down(self, started: list[Any]) -> None:
        """Dump stacks of ranks being stopped, stop every tree, reap, collect output."""
        result = self.result
        stopping = [r for r in (*result.timed_out, *result.abandoned) if r < len(started)]
        if stopping:
            self.dump_stacks({r: started[r].pid for r in stopping})
        # Ranks that reported get a moment to exit by themselves; the others are stopped.
        stop_at = time.monotonic() + EXIT_WAIT_S
        for rank, proc in enumerate(started):
            if rank not in result.outcomes or rank in result.exits:
                continue
            proc.join(max(0.0, stop_at - time.monotonic()))
            if proc.exitcode is not None and rank not in result.exits:
                result.exits[rank] = (time.time(), proc.exitcode)
        result.survivors = stop_ranks(started)
        self.collect_logs()

    def collect_logs(self) -> None:
        """Read each rank's captured output (head and tail) into ``result.logs``."""
        if not self.capture:
            return
        self.stream_output(final=True)
        for rank in range(self.plan.spec.nproc):
            with contextlib.suppress(OSError):
                self.result.logs[rank] = read_bounded(self.path(rank, "log"))

    def stream_output(self, *, final: bool = False) -> None:
        """With ``plan.live`` (``-s``): write what each rank printed since the last call to
        stdout, prefixed ``[rank N]`` (whole lines unless ``final``; beyond the kept tail
        skipped, with a note)."""
        if not self.plan.live:
            return
        out = sys.stdout
        for rank in range(self.plan.spec.nproc):
            path = self.path(rank, "log")
            size = file_size(path)
            offset = self._streamed.get(rank, 0)
            if size - offset > OUTPUT_TAIL_BYTES:
                out.write(
                    f"[rank {rank}] [harness: {size - OUTPUT_TAIL_BYTES - offset} bytes skipped]\n"
                )
                offset = size - OUTPUT_TAIL_BYTES
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size - offset)
            except OSError:
                continue
            if not final:
                data = data[: data.rfind(b"\n") + 1]
            self._streamed[rank] = offset + len(data)
            for line in data.decode(errors="replace").replace("\x00", "").splitlines():
                out.write(f"[rank {rank}] {line}\n")
        out.flush()

    def dump_stacks(self, pids: dict[int, int]) -> None:
        """Have these ranks (rank -> pid) dump their Python stacks into ``result.stacks``."""
        paths = {r: self.path(r, "stacks") for r in pids}
        for rank in pids:
            # Only ranks that registered the handler: the default action would kill the others.
            if os.path.exists(paths[rank]):
                with contextlib.suppress(OSError):
                    os.kill(pids[rank], STACK_DUMP_SIGNAL)
        end = time.monotonic() + STACK_DUMP_WAIT_S
        sizes: dict[int, int] = {}
        while time.monotonic() < end:
            time.sleep(0.1)
            now = {r: file_size(p) for r, p in paths.items()}
            if now == sizes and all(now.values()):
                break
            sizes = now
        for rank, path in paths.items():
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                self.result.stacks[rank] = _trim_stack(f.read())


def spawn_ranks(
    nproc: int,
    target: Callable[..., Any],
    args_for: Callable[[int, list[InheritedFd]], tuple],
    started: list[Any],
    *,
    lease: Lease | None = None,
) -> None:
    """Start ``nproc`` rank processes ``target(*args_for(rank, fds))`` (``fds``: the
    lease's descriptors, inherited), each appended to ``started`` as soon as it runs."""
    mp = get_context("spawn")
    fds = [InheritedFd(fd) for fd in (lease.fds() if lease else [])]
    for rank in range(nproc):
        proc = mp.Process(target=target, args=args_for(rank, fds), name=f"harness-rank-{rank}")
        proc.start()
        started.append(proc)


def stop_ranks(started: list[Any], *, patience: float = 0.0) -> list[int]:
    """Give the ranks ``patience`` seconds (in all) to exit, then stop and reap their
    trees. Returns the pids still alive after SIGKILL (stuck in the kernel)."""
    end = time.monotonic() + patience
    for proc in started:
        proc.join(max(0.0, end - time.monotonic()))
    survivors = processes.kill_trees([p.pid for p in started], grace=KILL_GRACE_S)
    for proc in started:
        proc.join(_REAP_WAIT_S)  # reaps it, now that it is dead
    return [p.pid for p in survivors]


@dataclass(frozen=True)
class InheritedFd:
    """A descriptor a spawned rank inherits (it arrives as an int)."""

    fd: int

    def __reduce__(self) -> tuple:
        # DupFd registers the fd with the spawning Popen, which passes it to the child.
        return (operator.methodcaller("detach"), (reduction.DupFd(self.fd),))


class _Terminated(BaseException):
    """SIGTERM arrived while ranks were running."""


@contextlib.contextmanager
def reap_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into an exception while ranks run, so ``finally`` blocks reap them;
    then deliver it again to its previous handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)
        raise KeyboardInterrupt("SIGTERM") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM while reaping (a second Ctrl-C must not leave half-killed
    ranks); deliver them afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, handler in saved.items():
        if handler not in (signal.SIG_IGN, None):
            signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def rank_path(case_dir: str, rank: int, kind: str) -> str:
    """The case file ``rank-<rank>.<kind>`` (outcome, stacks, log, ...)."""
    return os.path.join(case_dir, f"rank-{rank}.{kind}")


def _trim_stack(text: str) -> str:
    """Drop the frames below the rank's entry (faulthandler lists most recent first)."""
    out, skipping = [], False
    for line in text.splitlines():
        if not line.startswith(" "):  # a thread header or the blank line between threads
            skipping = False
        elif _HARNESS_RANK_FILE in line:
            skipping = True
        if not skipping:
            out.append(line)
    return "\n".join(out)
