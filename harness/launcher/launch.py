"""Starting a case's ranks, watching them, enforcing its deadline, reaping them.

``run_ranks`` runs a case on fresh ranks (``launch`` and the plugin's
``reuse=False`` cases use it); it never returns with a rank process alive.
``harness.launcher.pool`` runs cases on kept ranks with the same parts: ``supervise``,
``wind_down``, the reports, the signal handling. Either way:

* ranks start with the *spawn* start method (a fork after CUDA was
  initialised breaks every child) and rendezvous through a ``FileStore`` in a
  fresh per-case directory, so there is no port to race for;
* each rank's process-group timeout is set below the case deadline, so a stuck
  collective raises inside the rank first;
* at the deadline (or a few seconds after another rank failed) the ranks
  still running dump their Python stacks (faulthandler), then every process
  of their trees gets SIGTERM and, after a grace period, SIGKILL;
* SIGINT / SIGTERM to the launching process reap the ranks before it goes.

``launch(fn, spec, *args)`` is the public entry for code that starts ranks
itself; it leases what it starts unless it runs inside a case that already
holds a lease (then it may not start more ranks than that case declared).
"""

from __future__ import annotations

import contextlib
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
from typing import Any

from harness.devices import CARD_ENV, VISIBILITY_ENV, Card, inventory, is_simulated
from harness.launcher import lease as leases
from harness.launcher import procs
from harness.launcher.outcome import FAILED, PASSED, SKIPPED, XFAILED, CaseResult, RankOutcome
from harness.launcher.rank import STACK_DUMP_SIGNAL, RankContext, RankTask, rank_main
from harness.launcher.settings import Settings, current
from harness.launcher.target import FunctionRef
from harness.spec import LaunchSpec

#: After one rank failed, the others get this long to finish before they are
#: stopped (a peer blocked in a collective that never notices).
ABANDON_GRACE_S = 5.0
#: SIGTERM -> SIGKILL grace when stopping a rank's process tree.
KILL_GRACE_S = 3.0
#: How long a rank that reported its outcome may take to exit by itself.
EXIT_WAIT_S = 5.0
STACK_DUMP_WAIT_S = 2.0
#: Environment variable describing the enclosing case to its ranks (JSON).
CASE_ENV = "HARNESS_CASE"
_HARNESS_RANK_FILE = os.path.join("harness", "rank.py")


class LaunchError(Exception):
    """A launched case failed; the message is the case report (``rank N`` first)."""

    def __init__(self, message: str, result: CaseResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class LaunchBudgetError(LaunchError, ValueError):
    """``harness.launcher.launch`` asked for more ranks or cards than the enclosing case declared."""


def pg_timeout_for(deadline_s: float) -> float:
    """Process-group timeout for a case with this deadline: strictly below it,
    leaving room (up to 30 s) for the rank to report the timeout error."""
    return max(0.1, deadline_s - min(30.0, 0.2 * deadline_s))


@dataclass(frozen=True)
class Case:
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
    def from_env() -> Case | None:
        raw = os.environ.get(CASE_ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return Case(d["what"], d["nproc"], d["device"], tuple(d["cards"]), d["deadline"])


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


def run_ranks(task: RankTask, spec: LaunchSpec, *, deadline_s: float, deadline_source: str,
              cards: list[Card] | None = None, lease: leases.Lease | None = None,
              capture: bool = True, what: str = "") -> CaseResult:
    """Run ``task`` in ``spec.nproc`` fresh rank processes and report what happened.

    Guarantees: returns within ``deadline_s`` plus the stop grace periods; no
    process of any rank's tree is alive on return (``result.survivors`` lists
    any the kernel would not kill); rank ``r`` gets card ``cards[r]``; with
    ``capture`` the ranks' output is in ``result.logs`` instead of the
    launcher's stdout / stderr.
    """
    cards = list(cards or [])
    result = new_result(spec, cards, deadline_s, deadline_source)
    case_dir = tempfile.mkdtemp(prefix="harness-case-")
    deadline_wall = time.time() + deadline_s
    case = Case(what or f"harness.launch({task.ref.module}.{task.ref.qualname})", spec.nproc,
                spec.device, tuple(str(c) for c in cards), deadline_wall)
    started: list[Any] = []
    try:
        with reap_on_sigterm():
            try:
                mp = get_context("spawn")
                fds = [InheritedFd(fd) for fd in (lease.fds() if lease else [])]
                for rank in range(spec.nproc):
                    ctx = rank_context(rank, spec, case_dir, cards[rank] if spec.cards else None,
                                        deadline_s, capture, case)
                    proc = mp.Process(target=rank_main, args=(ctx, task, fds),
                                      name=f"harness-rank-{rank}")
                    proc.start()
                    started.append(proc)
                if lease is not None:
                    lease.annotate(ranks=[p.pid for p in started])
                supervise(started, result, case_dir, time.monotonic() + deadline_s)
            finally:
                with signals_deferred():
                    wind_down(started, result, case_dir, capture)
    finally:
        shutil.rmtree(case_dir, ignore_errors=True)
    return result


def new_result(spec: LaunchSpec, cards: list[Card], deadline_s: float,
               deadline_source: str) -> CaseResult:
    """An empty ``CaseResult`` for one run of ``spec`` on ``cards``
    (``ValueError`` when there are fewer cards than the spec needs)."""
    if len(cards) < spec.cards:
        raise ValueError(f"{spec.nproc} {spec.device} ranks need {spec.cards} cards; got {cards}")
    label = f"{spec.device}/{spec.dist_backend}"
    if cards:
        label += " on " + ",".join(str(c) for c in cards[: spec.cards])
    return CaseResult(spec.nproc, label, deadline_s, deadline_source, abandon_grace_s=ABANDON_GRACE_S)


def rank_context(rank: int, spec: LaunchSpec, case_dir: str, card: Card | None,
                 deadline_s: float, capture: bool, case: Case,
                 store_path: str | None = None) -> RankContext:
    """What rank ``rank`` of a case needs to know: its environment, card, the
    case's files in ``case_dir`` and the rendezvous store (default: in ``case_dir``)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.nproc),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(spec.nproc),
        CASE_ENV: case.to_env(),
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
    if card is not None:
        env[VISIBILITY_ENV[card.device]] = card.id
        env[CARD_ENV] = str(card)
    return RankContext(
        rank=rank,
        world_size=spec.nproc,
        device=spec.device,
        backend=spec.dist_backend,
        card=card,
        simulated=is_simulated(),
        store_path=store_path or os.path.join(case_dir, "store"),
        outcome_path=_outcome_path(case_dir, rank),
        stacks_path=os.path.join(case_dir, f"rank-{rank}.stacks"),
        log_path=os.path.join(case_dir, f"rank-{rank}.log") if capture else None,
        pg_timeout_s=pg_timeout_for(deadline_s),
        parent_pid=os.getpid(),
        env=env,
    )


def _outcome_path(case_dir: str, rank: int) -> str:
    return os.path.join(case_dir, f"rank-{rank}.outcome")


def supervise(started: list[Any], result: CaseResult, case_dir: str, deadline: float,
              channels: list[Any] | None = None) -> None:
    """Wait until every rank has reported or exited, the deadline passes, or the
    others overstay ``ABANDON_GRACE_S`` after a failure; record which.

    ``channels`` (pooled ranks: one per rank, with ``fileno()`` and
    ``drain()``) wake the wait when a rank says its outcome is written, instead
    of the outcome files being polled.
    """
    first_failure: float | None = None
    while True:
        pending = []
        for rank, proc in enumerate(started):
            code = proc.exitcode  # before reading the outcome: it is written before exit
            if rank not in result.outcomes:
                outcome = RankOutcome.read(_outcome_path(case_dir, rank))
                if outcome is not None:
                    result.outcomes[rank] = outcome
            if code is not None and rank not in result.exits:
                result.exits[rank] = (time.time(), code)
            if rank not in result.outcomes and rank not in result.exits:
                pending.append(rank)
        if not pending:
            return
        now = time.monotonic()
        if first_failure is None and _has_failure(result):
            first_failure = now
        if now >= deadline:
            result.timed_out = pending
            return
        if first_failure is not None and now >= first_failure + ABANDON_GRACE_S:
            result.abandoned = pending
            return
        # Exits wake us at once, and so do pooled ranks' messages; outcomes of
        # ranks still tearing down are polled.
        waitables: list[Any] = [started[r].sentinel for r in pending]
        if channels is not None:
            waitables += [channels[r] for r in pending if not channels[r].closed]
        for ready in wait_any(waitables, timeout=min(0.1, deadline - now)):
            if not isinstance(ready, int):
                ready.drain()


def _has_failure(result: CaseResult) -> bool:
    return any(o.status == FAILED for o in result.outcomes.values()) or any(
        rank not in result.outcomes or code != 0 for rank, (_, code) in result.exits.items()
    )


def wind_down(started: list[Any], result: CaseResult, case_dir: str, capture: bool) -> None:
    """Dump stacks of ranks being stopped, stop every tree, reap, collect logs."""
    stopping = [r for r in (*result.timed_out, *result.abandoned) if r < len(started)]
    if stopping and STACK_DUMP_SIGNAL is not None:
        _dump_stacks(started, stopping, result, case_dir)
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
    if capture:
        collect_logs(result, case_dir, len(started))


def collect_logs(result: CaseResult, case_dir: str, nproc: int) -> None:
    """Read each rank's captured output of the case into ``result.logs``."""
    for rank in range(nproc):
        with contextlib.suppress(OSError), open(
            os.path.join(case_dir, f"rank-{rank}.log"), errors="replace"
        ) as f:
            result.logs[rank] = f.read()


def _dump_stacks(started: list[Any], ranks: list[int], result: CaseResult, case_dir: str) -> None:
    paths = {r: os.path.join(case_dir, f"rank-{r}.stacks") for r in ranks}
    for rank in ranks:
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
            result.stacks[rank] = _trim_stack(f.read())


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


def echo_logs(result: CaseResult, stream: Any = None) -> None:
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


def launch(fn: Callable[..., Any], spec: LaunchSpec, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` in ``spec.nproc`` rank processes and return each rank's
    return value, in rank order.

    The ranks are set up as for a ``launch``-marked test (process group,
    environment, card, deadline ``spec.timeout`` or the session default) and
    are all gone when this returns or raises. ``fn`` must be importable
    (module level) and ``args`` and the results picklable.

    Outside a case, the cards and process slots are leased first (bounded
    wait, ``LeaseTimeout``). Inside the ranks of a case, the case's lease is
    used, and asking for more ranks (or cards) than the case declared raises
    ``LaunchBudgetError`` giving both numbers. A failing, crashing or
    overdue rank raises ``LaunchError`` whose message names the rank.
    """
    __tracebackhide__ = True
    settings = current()
    ref = FunctionRef.of(fn)
    task = RankTask(ref, pickle_args(args, {}))
    enclosing = Case.from_env()
    deadline_s = spec.timeout or settings.timeout
    source = "LaunchSpec.timeout" if spec.timeout else "the session's default timeout"
    lease = None
    if enclosing is not None:
        cards = _within(enclosing, spec)
        remaining = enclosing.deadline - time.time() - KILL_GRACE_S
        if remaining < deadline_s:
            deadline_s, source = max(0.1, remaining), f"the deadline of {enclosing.what}"
    else:
        reason = missing_cards(spec.device, spec.cards)
        if reason is not None:
            _missing_hardware(spec.device, reason)
        holder = os.environ.get("PYTEST_CURRENT_TEST") or f"harness.launch({ref.module}.{ref.qualname})"
        lease = lease_case(spec, settings, holder)
        cards = lease.cards()
    result = None
    try:
        result = run_ranks(task, spec, deadline_s=deadline_s, deadline_source=source, cards=cards,
                           lease=lease, capture=settings.capture)
    finally:
        if lease is not None:
            lease.release(holders_gone=result is not None and not result.survivors)
    if settings.capture:
        echo_logs(result)
    status = result.status
    if status == FAILED:
        raise LaunchError(result.report(), result)
    if status in (SKIPPED, XFAILED) and "pytest" in sys.modules:
        import pytest

        (pytest.skip if status == SKIPPED else pytest.xfail)(result.reason())
    if status != PASSED:
        raise LaunchError(f"ranks {status}: {result.reason()}", result)
    return result.values()


def lease_case(spec: LaunchSpec, settings: Settings, holder: str) -> leases.Lease:
    """Lease the process slots and cards ``spec`` needs, waiting at most
    ``settings.lease_timeout`` (``LeaseTimeout`` names what it waited for)."""
    wants = [leases.slot_want(settings.max_procs, spec.nproc)]
    if spec.cards:
        wants.append(leases.card_want(inventory(spec.device), spec.cards))
    return leases.acquire(settings.lease_dir, wants, timeout=settings.lease_timeout, holder=holder)


def _within(case: Case, spec: LaunchSpec) -> list[Card]:
    if spec.nproc > case.nproc:
        raise LaunchBudgetError(
            f"harness.launcher.launch would start {spec.nproc} ranks, but {case.what} declares "
            f"nproc={case.nproc}; declare the number of ranks it really starts "
            f"(e.g. @pytest.mark.launch(nproc={spec.nproc}))"
        )
    if spec.cards:
        cards = [Card(*c.split(":", 1)) for c in case.cards if c.startswith(spec.device + ":")]
        if len(cards) < spec.cards:
            raise LaunchBudgetError(
                f"harness.launcher.launch would use {spec.cards} {spec.device} cards, but {case.what} "
                f"holds {len(cards)} ({', '.join(case.cards) or 'none'})"
            )
        return cards[: spec.cards]
    return []


def _missing_hardware(device: str, reason: str) -> None:
    if "pytest" in sys.modules and device not in current().require:
        import pytest

        pytest.skip(reason)
    raise LaunchError(f"harness.launcher.launch: {reason}")
