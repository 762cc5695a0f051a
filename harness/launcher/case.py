"""One case lifecycle: lease, run on ranks, release; deadline, outcome and report written once.

``harness.launcher.launch.run_case(task, plan)`` is the one function the
pytest plugin and ``harness.launch`` call. It picks a *rank strategy* (a
``RankStrategy``): ``FreshRanks`` here (spawn the case's ranks, stop them
after) or the kept pool (``harness.launcher.pool``); the strategy leases what
the case needs, runs it and releases. Both strategies run a case through the
same phases of ``CaseRun``:

* ``rank_context``: what each rank is told (environment, card, files);
* ``supervise``: wait until every rank reported or exited, the deadline
  passed, or the others overstayed ``ABANDON_GRACE_S`` after a failure;
* ``wind_down``: dump the stacks of ranks being stopped, stop every process
  tree, reap, collect the (bounded) output.

``choose_deadline`` decides a case's deadline and where it came from;
``conclude`` maps a ``CaseOutcome``'s status to the caller's pass / fail /
skip / xfail. Either way:

* ranks start with the *spawn* start method (a fork after CUDA was
  initialised breaks every child) and rendezvous through a ``FileStore`` in a
  fresh per-case directory, so there is no port to race for;
* each rank's process-group timeout is set below the case deadline, so a stuck
  collective raises inside the rank first;
* at the deadline (or a few seconds after another rank failed) the ranks
  still running dump their Python stacks (faulthandler), then every process
  of their trees gets SIGTERM and, after a grace period, SIGKILL;
* SIGINT / SIGTERM to the launching process reap the ranks before it goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import wait as wait_any
from typing import Any, NoReturn, Protocol

from harness.devices import Card, inventory, is_simulated, visibility
from harness.launcher import lease as leases
from harness.launcher import procs
from harness.launcher.outcome import FAILED, SKIPPED, XFAILED, CaseOutcome, RankOutcome
from harness.launcher.rank import STACK_DUMP_SIGNAL, RankContext, RankTask, rank_main
from harness.launcher.settings import Settings
from harness.spec import LaunchSpec

#: After one rank failed, the others get this long to finish before they are
#: stopped (a peer blocked in a collective that never notices).
ABANDON_GRACE_S = 5.0
#: SIGTERM -> SIGKILL grace when stopping a rank's process tree.
KILL_GRACE_S = 3.0
#: How long a rank that reported its outcome may take to exit by itself.
EXIT_WAIT_S = 5.0
STACK_DUMP_WAIT_S = 2.0
#: Kept ranks that finished a case wait this long for their peers to finish
#: too before they leave (as fresh ranks leave at once), see ``CaseRun.supervise``.
STRAGGLER_GRACE_S = 1.0
#: Per rank and case, the first and the last this many bytes of its output
#: are kept (on disk while it runs); what lies between is dropped and counted.
OUTPUT_HEAD_BYTES = 64 * 1024
OUTPUT_TAIL_BYTES = 256 * 1024
#: Environment variable describing the enclosing case to its ranks (JSON).
CASE_ENV = "HARNESS_CASE"
_HARNESS_RANK_FILE = os.path.join("harness", "launcher", "rank.py")


def pg_timeout_for(deadline_s: float) -> float:
    """Process-group timeout for a case with this deadline: strictly below it,
    leaving room (up to 30 s) for the rank to report the timeout error."""
    return max(0.1, deadline_s - min(30.0, 0.2 * deadline_s))


@dataclass(frozen=True)
class EnclosingCase:
    """What a set of ranks belongs to, as seen from inside them (for nested launches)."""

    what: str
    nproc: int
    device: str
    cards: tuple[str, ...]
    deadline: float  # wall-clock time

    def to_env(self) -> str:
        return json.dumps({"what": self.what, "nproc": self.nproc, "device": self.device,
                           "cards": list(self.cards), "deadline": self.deadline})

    @staticmethod
    def from_env() -> EnclosingCase | None:
        """The case whose rank this process is (None: not inside a case)."""
        raw = os.environ.get(CASE_ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return EnclosingCase(d["what"], d["nproc"], d["device"], tuple(d["cards"]), d["deadline"])


@dataclass(frozen=True)
class Deadline:
    """A case's deadline in seconds and the words saying where it came from."""

    seconds: float
    source: str


def choose_deadline(spec: LaunchSpec, settings: Settings, *, default_source: str,
                    enclosing: EnclosingCase | None = None) -> Deadline:
    """``spec.timeout``, else the session default (named ``default_source``);
    never past what is left of an ``enclosing`` case (minus the kill grace)."""
    if spec.timeout:
        deadline = Deadline(spec.timeout, "LaunchSpec.timeout")
    else:
        deadline = Deadline(settings.timeout, default_source)
    if enclosing is not None:
        remaining = enclosing.deadline - time.time() - KILL_GRACE_S
        if remaining < deadline.seconds:
            deadline = Deadline(max(0.1, remaining), f"the deadline of {enclosing.what}")
    return deadline


@dataclass(frozen=True)
class CasePlan:
    """One case to run: what it needs, the session's settings, its name, its
    deadline, and (inside an enclosing case) the cards it runs on unleased."""

    spec: LaunchSpec
    settings: Settings
    what: str
    deadline: Deadline
    reuse: bool = False
    #: None: lease cards and process slots; else run on these, leasing nothing
    #: (a nested launch inside a case that holds them)
    cards: tuple[Card, ...] | None = None


class RankStrategy(Protocol):
    """How a case's ranks come to be: fresh per case, or kept across cases.

    ``run`` leases what ``plan`` needs (``LeaseTimeout``), runs the case,
    releases what it leased (a kept pool: when the pool closes) and returns
    the outcome; no process of the case is alive when it returns.
    """

    def run(self, task: RankTask, plan: CasePlan) -> CaseOutcome: ...


def conclude(result: CaseOutcome, *, fail: Callable[[str], NoReturn],
             skip: Callable[[str], NoReturn], xfail: Callable[[str], NoReturn],
             echo: bool = True) -> None:
    """Echo the case's notes and captured output, then map its status: failed ->
    ``fail(report)``, skipped -> ``skip(reason)``, xfailed -> ``xfail(reason)``;
    returns only for a passed case."""
    if echo:
        echo_logs(result)
    status = result.status
    if status == FAILED:
        fail(result.report())
    if status == SKIPPED:
        skip(result.reason())
    if status == XFAILED:
        xfail(result.reason())


class FreshRanks:
    """The strategy that spawns a case's ranks for it alone."""

    def run(self, task: RankTask, plan: CasePlan) -> CaseOutcome:
        """Lease (unless ``plan.cards`` is given), run on fresh ranks, release."""
        if plan.cards is not None:
            return run_ranks(task, plan, list(plan.cards))
        lease = lease_case(plan.spec, plan.settings, plan.what)
        result = None
        try:
            result = run_ranks(task, plan, lease.cards(), lease=lease)
        finally:
            # Ranks the kernel would not kill keep their inherited lock: the card
            # stays leased until they are really gone.
            lease.release(holders_gone=result is not None and not result.survivors)
        return result


FRESH = FreshRanks()


def lease_case(spec: LaunchSpec, settings: Settings, holder: str) -> leases.Lease:
    """Lease the process slots and cards ``spec`` needs, waiting at most
    ``settings.lease_timeout`` (``LeaseTimeout`` names what it waited for)."""
    wants = [leases.slot_want(settings.max_procs, spec.nproc)]
    if spec.cards:
        wants.append(leases.card_want(inventory(spec.device), spec.cards))
    return leases.acquire(settings.lease_dir, wants, timeout=settings.lease_timeout, holder=holder)


class InheritedFd:
    """A descriptor a spawned rank inherits (pass it in the process's arguments)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        # Registers the fd with the spawning Popen, which passes it to the child.
        return (_inherited_fd, (reduction.DupFd(self.fd),))


def _inherited_fd(dup: Any) -> int:
    return dup.detach()


def lease_fds(lease: leases.Lease | None) -> list[InheritedFd]:
    """The lease's descriptors, ready to travel to a spawned rank."""
    return [InheritedFd(fd) for fd in (lease.fds() if lease else [])]


class _Terminated(BaseException):
    """SIGTERM arrived while ranks were running."""


@contextlib.contextmanager
def reap_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into an exception while ranks run, so ``finally`` blocks reap
    them; afterwards the signal is delivered again to its previous handler
    (by default: the process ends as a SIGTERM would have ended it)."""
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
    """Hold SIGINT / SIGTERM while reaping, so a second Ctrl-C cannot leave
    half-killed ranks behind; deliver them afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        saved[sig] = signal.getsignal(sig)
        if saved[sig] not in (signal.SIG_IGN, None):
            signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def run_ranks(task: RankTask, plan: CasePlan, cards: list[Card], *,
              lease: leases.Lease | None = None) -> CaseOutcome:
    """Run ``task`` in ``plan.spec.nproc`` fresh rank processes and report what happened.

    Guarantees: returns within the deadline plus the stop grace periods; no
    process of any rank's tree is alive on return (``result.survivors`` lists
    any the kernel would not kill); rank ``r`` gets card ``cards[r]``; with
    ``settings.capture`` the ranks' (bounded) output is in ``result.logs``
    instead of the launcher's stdout / stderr; the case directory is gone.
    """
    run = CaseRun(plan, cards, tempfile.mkdtemp(prefix="harness-case-"))
    started: list[Any] = []
    with reap_on_sigterm():
        try:
            mp = get_context("spawn")
            fds = lease_fds(lease)
            for rank in range(plan.spec.nproc):
                proc = mp.Process(target=rank_main, args=(run.rank_context(rank), task, fds),
                                  name=f"harness-rank-{rank}")
                proc.start()
                started.append(proc)
            if lease is not None:
                lease.annotate(ranks=[p.pid for p in started])
            run.supervise(started)
        finally:
            # Inside reap_on_sigterm: a SIGTERM re-raised on its way out ends
            # the process, and the directory must be gone by then.
            with signals_deferred():
                try:
                    run.wind_down(started)
                finally:
                    shutil.rmtree(run.case_dir, ignore_errors=True)
    return run.result


class CaseRun:
    """One run of a case on a set of ranks (fresh or kept): its directory, its
    outcome so far, and the phases that fill it in."""

    def __init__(self, plan: CasePlan, cards: list[Card], case_dir: str, *,
                 store_path: str | None = None) -> None:
        spec = plan.spec
        if len(cards) < spec.cards:
            raise ValueError(f"{spec.nproc} {spec.device} ranks need {spec.cards} cards; got {cards}")
        label = f"{spec.device}/{spec.dist_backend}"
        if cards:
            label += " on " + ",".join(str(c) for c in cards[: spec.cards])
        self.plan = plan
        self.cards = cards
        self.case_dir = case_dir
        self.capture = plan.settings.capture
        self.store_path = store_path or os.path.join(case_dir, "store")
        self.result = CaseOutcome(spec.nproc, label, plan.deadline.seconds, plan.deadline.source,
                                  abandon_grace_s=ABANDON_GRACE_S)
        self.enclosing = EnclosingCase(plan.what, spec.nproc, spec.device,
                                       tuple(str(c) for c in cards), time.time() + plan.deadline.seconds)
        self.deadline = time.monotonic() + plan.deadline.seconds

    def path(self, rank: int, kind: str) -> str:
        """The case file ``rank-<rank>.<kind>`` (outcome, stacks, log)."""
        return os.path.join(self.case_dir, f"rank-{rank}.{kind}")

    def rank_context(self, rank: int) -> RankContext:
        """What rank ``rank`` of the case needs to know: its environment, card,
        the case's files and the rendezvous store."""
        spec = self.plan.spec
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(spec.nproc),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(spec.nproc),
            CASE_ENV: self.enclosing.to_env(),
        }
        if "OMP_NUM_THREADS" not in os.environ:
            # As torchrun does: N ranks each using every core oversubscribe the host.
            env["OMP_NUM_THREADS"] = "1"
        if "TORCH_DIST_INIT_BARRIER" not in os.environ:
            # torch's store-based barrier at the end of init_process_group and
            # new_group: a rank leaves (os._exit) as soon as its function returns,
            # and must not close its connections while a peer is still joining the
            # group (it would fail with "connectFullMesh failed ... closed by peer").
            env["TORCH_DIST_INIT_BARRIER"] = "1"
        card = self.cards[rank] if spec.cards else None
        if card is not None:
            env.update(visibility(card))
        return RankContext(
            rank=rank,
            world_size=spec.nproc,
            device=spec.device,
            backend=spec.dist_backend,
            card=card,
            simulated=is_simulated(),
            store_path=self.store_path,
            outcome_path=self.path(rank, "outcome"),
            stacks_path=self.path(rank, "stacks"),
            log_path=self.path(rank, "log") if self.capture else None,
            pg_timeout_s=pg_timeout_for(self.plan.deadline.seconds),
            parent_pid=os.getpid(),
            env=env,
        )

    def supervise(self, started: list[Any], channels: list[Any] | None = None, *,
                  release: Callable[[list[int]], None] | None = None) -> None:
        """Wait until every rank has reported or exited, the deadline passes, or the
        others overstay ``ABANDON_GRACE_S`` after a failure; record which.

        ``channels`` (kept ranks: one per rank, with ``fileno()``, ``closed``
        and ``drain()``) wake the wait when a rank says its outcome is
        written, instead of the outcome files being polled. Meanwhile each
        rank's output file is kept to its head and tail (``bound_output``).

        ``release`` (kept ranks, which outlive their case) is called once with
        the ranks that finished when others are still running
        ``STRAGGLER_GRACE_S`` after the first finished: it makes them leave as
        fresh ranks would have at once, so a peer blocked in a collective with
        them fails now instead of at the process-group timeout.
        """
        result = self.result
        first_failure: float | None = None
        first_done: float | None = None
        while True:
            pending = self._observe(started)
            if not pending:
                return
            now = time.monotonic()
            if first_failure is None and _has_failure(result):
                first_failure = now
            if release is not None and result.outcomes:
                first_done = now if first_done is None else first_done
                if now >= first_done + STRAGGLER_GRACE_S:
                    release(sorted(r for r in result.outcomes if r not in result.exits))
                    release = None
            if now >= self.deadline:
                result.timed_out = pending
                return
            if first_failure is not None and now >= first_failure + ABANDON_GRACE_S:
                result.abandoned = pending
                return
            if self.capture:
                for rank in pending:
                    bound_output(self.path(rank, "log"))
            # Exits wake us at once, and so do kept ranks' messages; outcomes of
            # ranks still tearing down are polled.
            waitables: list[Any] = [started[r].sentinel for r in pending]
            if channels is not None:
                waitables += [channels[r] for r in pending if not channels[r].closed]
            for ready in wait_any(waitables, timeout=min(0.1, self.deadline - now)):
                if not isinstance(ready, int):
                    ready.drain()

    def _observe(self, started: list[Any]) -> list[int]:
        """Record new outcomes and exits; return the ranks neither reported nor exited."""
        result = self.result
        pending = []
        for rank, proc in enumerate(started):
            code = proc.exitcode  # before reading the outcome: it is written before exit
            if rank not in result.outcomes:
                outcome = RankOutcome.read(self.path(rank, "outcome"))
                if outcome is not None:
                    result.outcomes[rank] = outcome
            if code is not None and rank not in result.exits:
                result.exits[rank] = (time.time(), code)
            if rank not in result.outcomes and rank not in result.exits:
                pending.append(rank)
        return pending

    def wind_down(self, started: list[Any]) -> None:
        """Dump stacks of ranks being stopped, stop every tree, reap, collect output."""
        result = self.result
        stopping = [r for r in (*result.timed_out, *result.abandoned) if r < len(started)]
        if stopping and STACK_DUMP_SIGNAL is not None:
            self._dump_stacks(started, stopping)
        # Ranks that reported get a moment to tear down and exit by themselves;
        # the others (interrupted launcher, overdue ranks) are stopped right away.
        stop_at = time.monotonic() + EXIT_WAIT_S
        for rank, proc in enumerate(started):
            if rank not in result.outcomes or rank in result.exits:
                continue
            proc.join(max(0.0, stop_at - time.monotonic()))
            if proc.exitcode is not None and rank not in result.exits:
                result.exits[rank] = (time.time(), proc.exitcode)
        survivors = procs.kill_trees([p.pid for p in started if p.pid is not None], grace=KILL_GRACE_S)
        for proc in started:
            proc.join(1.0)  # reaps it, now that it is dead
        result.survivors = [p.pid for p in survivors]
        self.collect_logs()

    def collect_logs(self) -> None:
        """Read each rank's captured output of the case (head and tail, with a
        note of what was dropped) into ``result.logs``."""
        if not self.capture:
            return
        for rank in range(self.plan.spec.nproc):
            with contextlib.suppress(OSError):
                self.result.logs[rank] = read_bounded(self.path(rank, "log"))

    def _dump_stacks(self, started: list[Any], ranks: list[int]) -> None:
        paths = {r: self.path(r, "stacks") for r in ranks}
        for rank in ranks:
            if procs.stopped(started[rank].pid):
                self.result.stopped.append(rank)
                continue
            # Only ranks that registered the dump handler (it creates the file):
            # the signal's default action would kill one that has not.
            if os.path.exists(paths[rank]):
                with contextlib.suppress(OSError):
                    os.kill(started[rank].pid, STACK_DUMP_SIGNAL)
        end = time.monotonic() + STACK_DUMP_WAIT_S
        sizes: dict[int, int] = {}
        while time.monotonic() < end:
            time.sleep(0.1)
            now = {r: _size(p) for r, p in paths.items()}
            if now == sizes and all(now.values()):
                break
            sizes = now
        for rank, path in paths.items():
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                self.result.stacks[rank] = _trim_stack(f.read())


def _has_failure(result: CaseOutcome) -> bool:
    return any(o.status == FAILED for o in result.outcomes.values()) or any(
        rank not in result.outcomes or code != 0 for rank, (_, code) in result.exits.items()
    )


def _trim_stack(text: str) -> str:
    """Drop the frames below the rank's entry (multiprocessing bootstrap, the
    harness): faulthandler lists most recent first, so they end each thread."""
    out, skipping = [], False
    for line in text.splitlines():
        if not line.startswith(" "):  # a thread header or the blank line between threads
            skipping = False
        elif _HARNESS_RANK_FILE in line:
            skipping = True
        if not skipping:
            out.append(line)
    return "\n".join(out)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_BLOCK = 4096


def bound_output(path: str) -> None:
    """Keep a rank's output file to its first ``OUTPUT_HEAD_BYTES`` and last
    ``OUTPUT_TAIL_BYTES`` on disk: the middle is punched out (the file keeps
    its size, the dropped bytes read as NULs and take no space). A file
    system that cannot punch holes keeps it all; reading stays bounded."""
    size = _size(path)
    if size <= OUTPUT_HEAD_BYTES + OUTPUT_TAIL_BYTES + _BLOCK:
        return
    start = -(-OUTPUT_HEAD_BYTES // _BLOCK) * _BLOCK
    end = (size - OUTPUT_TAIL_BYTES) // _BLOCK * _BLOCK
    if end <= start or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _libc().fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                              ctypes.c_long(start), ctypes.c_long(end - start))
        finally:
            os.close(fd)


_libc_handle: list[Any] = []


def _libc() -> Any:
    if not _libc_handle:
        _libc_handle.append(ctypes.CDLL(None, use_errno=True))
    return _libc_handle[0]


def read_bounded(path: str) -> str:
    """A rank's output: all of it when short, else its head, a line saying how
    many bytes were dropped, and its tail (never more than head + tail bytes
    read into memory)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= OUTPUT_HEAD_BYTES + OUTPUT_TAIL_BYTES:
            return f.read().decode(errors="replace")
        head = f.read(OUTPUT_HEAD_BYTES)
        f.seek(size - OUTPUT_TAIL_BYTES)
        tail = f.read(OUTPUT_TAIL_BYTES)
    dropped = size - len(head) - len(tail)
    head_text = head.decode(errors="replace").rstrip("\x00")
    tail_text = tail.decode(errors="replace").lstrip("\x00")
    return (f"{head_text}\n[harness: {dropped} bytes of this rank's output dropped; "
            f"the first {len(head)} and the last {len(tail)} are kept]\n{tail_text}")


def echo_logs(result: CaseOutcome, stream: Any = None) -> None:
    """Write the harness's notes on the case, then the ranks' captured output,
    one headed block per rank."""
    stream = stream or sys.stdout
    for note in result.notes:
        stream.write(f"harness: {note}\n")
    for rank in sorted(result.logs):
        text = result.logs[rank]
        if text.strip():
            stream.write(f"----- rank {rank} output -----\n{text}")
            if not text.endswith("\n"):
                stream.write("\n")
    stream.flush()


def pickle_args(args: tuple, kwargs: dict, *, kinds: dict[str, str] | None = None) -> bytes:
    """Pickle what the ranks receive; an unpicklable value raises ``TypeError``
    naming it (``kinds`` maps keyword names to words like "fixture")."""
    kinds = kinds or {}
    for index, value in enumerate(args):
        _check_picklable(value, f"argument {index}")
    for name, value in kwargs.items():
        _check_picklable(value, f"{kinds.get(name, 'argument')} {name!r}")
    return pickle.dumps((args, kwargs))


def _check_picklable(value: Any, what: str) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"{what} (a {type(value).__module__}.{type(value).__qualname__}) cannot be sent to "
            f"the rank processes: {type(exc).__name__}: {exc}. Ranks receive values by pickling; "
            "pass something picklable or build it inside the ranks."
        ) from None


def missing_cards(device: str, need: int) -> str | None:
    """Why this host cannot run a case needing ``need`` cards of ``device`` (None: it can)."""
    if need == 0:
        return None
    have = inventory(device)
    if len(have) >= need:
        return None
    found = f"{len(have)} ({', '.join(str(c) for c in have)})" if have else "none"
    return f"needs {need} {device} card{'s' if need > 1 else ''}; this host has {found}"

