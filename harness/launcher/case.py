"""A case's lifecycle, for the plugin and ``harness.launch`` alike: its task (``task_for``)
and ``CasePlan`` (deadline chosen once) -> lease (``lease_case``) -> ranks (``run_case``:
fresh, a kept pool or emulated nodes) -> outcome (``conclude``)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NoReturn

from harness.devices import Card, cpu_count, inventory
from harness.errors import HarnessError
from harness.launcher import lease as leases
from harness.launcher.lease import default_lease_dir
from harness.launcher.nodes import run_nodes
from harness.launcher.outcome import FAILED, SKIPPED, XFAILED, CaseOutcome, echo_logs
from harness.launcher.pool import keeper
from harness.launcher.rank import EnclosingCase, RankTask
from harness.launcher.ranks import KILL_GRACE_S, run_ranks
from harness.launcher.target import FunctionRef, dumps
from harness.names import DEFAULT_CASE_TIMEOUT_S
from harness.spec import LaunchSpec

DEFAULT_LEASE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Settings:
    """A session's launch settings: the default case deadline, the lease directory (made
    absolute: where the session started, whatever directory a test is in when it leases),
    the host's process slots, the bound on a lease wait, the accelerators whose absence
    fails instead of skipping, rank output captured (not streamed), kept pools."""

    timeout: float = DEFAULT_CASE_TIMEOUT_S
    lease_dir: str = field(default_factory=default_lease_dir)
    max_procs: int = field(default_factory=cpu_count)
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT_S
    require: frozenset[str] = frozenset()
    capture: bool = False
    reuse: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "lease_dir", os.path.abspath(self.lease_dir))


#: The running pytest session's settings (a ContextVar: a nested pytester session
#: restores the outer one's by resetting its token); unset: none.
active: ContextVar[Settings] = ContextVar("harness_settings")


@dataclass(frozen=True)
class Deadline:
    """A case's deadline in seconds and the words saying where it came from."""

    seconds: float
    source: str


def choose_deadline(
    spec: LaunchSpec, default: Deadline, enclosing: EnclosingCase | None = None
) -> Deadline:
    """``spec.timeout``, else ``default``; never past what is left of an ``enclosing`` case
    (minus the kill grace)."""
    deadline = Deadline(spec.timeout, "LaunchSpec.timeout") if spec.timeout else default
    if enclosing is not None:
        remaining = enclosing.deadline - time.time() - KILL_GRACE_S
        if remaining < deadline.seconds:
            deadline = Deadline(max(0.1, remaining), f"the deadline of {enclosing.what}")
    return deadline


@dataclass(frozen=True)
class CasePlan:
    """One case to run: what it needs, the session's settings, its name, its deadline, kept
    ranks or not, and (inside an enclosing case) the cards it runs on unleased."""

    spec: LaunchSpec
    settings: Settings
    what: str
    deadline: Deadline
    reuse: bool = False
    cards: tuple[Card, ...] | None = None  # None: lease cards and process slots
    #: stream the ranks' output, each line prefixed with its rank (``pytest -s``)
    live: bool = False


def task_for(
    ref: FunctionRef,
    args: tuple,
    kwargs: dict,
    *,
    kinds: dict[str, str] | None = None,
    state: dict | None = None,
    **task: Any,
) -> RankTask:
    """The ``RankTask`` calling ``ref`` with ``args`` / ``kwargs`` (``state``: the attributes
    of the test method's instance; ``task``: its other fields), pickled. ``TypeError``
    names a value that cannot travel, ``kinds`` saying what each keyword is."""
    named = {f"argument {index}": value for index, value in enumerate(args)}
    named.update({f"{(kinds or {}).get(k, 'argument')} {k!r}": v for k, v in kwargs.items()})
    if state is not None:
        attributes = {f"attribute self.{k} of the test's instance": v for k, v in state.items()}
        task["state"] = _pickled(state, attributes)
    return RankTask(ref, _pickled((args, kwargs), named), **task)


def lease_case(plan: CasePlan) -> leases.Lease:
    """Lease the process slots and cards ``plan.spec`` needs (all its nodes': emulated nodes
    share this host), waiting at most ``lease_timeout`` (``LeaseTimeout`` names them)."""
    spec, settings = plan.spec, plan.settings
    wants = [leases.slot_want(settings.max_procs, spec.world_size)]
    if spec.cards:
        wants.append(leases.card_want(inventory(spec.device), spec.cards * spec.nnodes))
    return leases.acquire(
        settings.lease_dir, wants, timeout=settings.lease_timeout, holder=plan.what
    )


def conclude(
    result: CaseOutcome,
    *,
    fail: Callable[[str], NoReturn],
    skip: Callable[[str], NoReturn],
    xfail: Callable[[str], NoReturn],
    echo: bool,
) -> None:
    """Echo the case's notes and output, reissue the ranks' warnings and log records here,
    then map its status: failed -> ``fail(report)``, skipped -> ``skip(reason)``, xfailed
    -> ``xfail(reason)``; returns only for a passed (or rejected) case."""
    if echo:
        echo_logs(result)
    result.reissue_warnings()
    result.reissue_logs()
    status = result.status
    if status == FAILED:
        fail(result.report())
    if status in (SKIPPED, XFAILED):
        (skip if status == SKIPPED else xfail)(result.reason())


def missing_cards(device: str, need: int) -> str | None:
    """Why this host cannot run a case needing ``need`` cards of ``device`` (None: it can)."""
    if need == 0 or len(have := inventory(device)) >= need:
        return None
    found = f"{len(have)} ({', '.join(str(c) for c in have)})" if have else "none"
    return f"needs {need} {device} card{'s' if need > 1 else ''}; this host has {found}"


def _pickled(value: Any, named: dict[str, Any]) -> bytes:
    """``value`` pickled; ``TypeError`` names the first of ``named`` (words: part) that is not."""
    for what, part in named.items():
        try:
            dumps(part)
        except Exception as exc:
            raise TypeError(
                f"{what} (a {type(part).__module__}.{type(part).__qualname__}) cannot be sent "
                f"to the rank processes: {type(exc).__name__}: {exc}. Ranks receive values by "
                "pickling; pass something picklable or build it inside the ranks."
            ) from None
    return dumps(value)


class LaunchError(HarnessError):
    """A launched case failed; the message is the case report (``rank N`` first)."""

    def __init__(self, message: str, result: CaseOutcome | None = None) -> None:
        super().__init__(message)
        self.result = result


class LaunchBudgetError(LaunchError, ValueError):
    """``harness.launch`` asked for more ranks or cards than the enclosing case declared."""


def run_case(task: RankTask, plan: CasePlan) -> CaseOutcome:
    """Lease, run ``task`` and release, as ``plan`` says: on the kept pool (``reuse``, main
    thread), on an enclosing case's ``cards`` unleased, on emulated nodes (``nnodes > 1``)
    or on fresh ranks. No process of the case is alive when it returns."""
    if plan.cards is not None:
        return run_ranks(task, plan, list(plan.cards))
    multi_node = plan.spec.nnodes > 1
    # Pools are kept by the main thread: Linux kills ranks whose spawning thread ends.
    if plan.reuse and not multi_node and threading.current_thread() is threading.main_thread():
        return keeper.run(task, plan, lease_case)
    lease = lease_case(plan)
    result = None
    run = run_nodes if multi_node else run_ranks
    try:
        result = run(task, plan, lease.cards(), lease=lease)
    finally:
        # Ranks the kernel would not kill keep their inherited lock: the card stays leased.
        lease.release(holders_gone=result is not None and not result.survivors)
    return result


def launch(fn: Callable[..., Any], spec: LaunchSpec, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` in ``spec.nproc`` rank processes and return each rank's return
    value, in rank order.

    The ranks are set up as for a ``launch``-marked test (process group, environment, card,
    deadline ``spec.timeout`` or the session default) and are all gone when this returns or
    raises; ``fn`` must be importable (module level), ``args`` and the results picklable.
    Outside a case, the cards and process slots are leased first (bounded wait,
    ``LeaseTimeout``). Inside a case (a launched test's ranks; a plain test holding a card
    is a case of one rank on it) the case's lease is used: more ranks or cards than it
    declared raise ``LaunchBudgetError`` giving both numbers, and its nested launches
    together never run more ranks at once than it declared (later ones wait, within its
    deadline, then raise ``LaunchBudgetError``). A failing, crashing or overdue rank raises
    ``LaunchError`` whose message names the rank.
    """
    __tracebackhide__ = True
    settings = active.get(None) or Settings()
    pytest = sys.modules.get("pytest")
    ref = FunctionRef.of(fn)
    what = f"harness.launch({ref.module}.{ref.qualname})"
    enclosing = EnclosingCase.from_env()
    cards: tuple[Card, ...] | None = None
    if enclosing is not None:
        cards = _within(enclosing, spec)
    else:
        reason = missing_cards(spec.device, spec.cards * spec.nnodes)
        if reason is not None:
            if pytest is not None and spec.device not in settings.require:
                pytest.skip(reason)
            raise LaunchError(f"harness.launch: {reason}")
        what = os.environ.get("PYTEST_CURRENT_TEST") or what
    default = Deadline(settings.timeout, "the session's default timeout")
    plan = CasePlan(spec, settings, what, choose_deadline(spec, default, enclosing), cards=cards)
    task = task_for(ref, args, {})
    with contextlib.nullcontext() if enclosing is None else _nested_slots(enclosing, spec, what):
        result = run_case(task, plan)

    def fail(message: str) -> NoReturn:
        raise LaunchError(message, result)

    def not_passed(reason: str) -> NoReturn:
        raise LaunchError(f"ranks {result.status}: {reason}", result)

    conclude(
        result,
        fail=fail,
        echo=settings.capture,
        skip=pytest.skip if pytest is not None else not_passed,
        xfail=pytest.xfail if pytest is not None else not_passed,
    )
    return result.values()


def _nested_slots(case: EnclosingCase, spec: LaunchSpec, what: str) -> leases.Lease:
    """``spec.nproc`` of the enclosing case's ``case.nproc`` rank slots, leased for a nested
    launch (every nested launch of the case's ranks and threads leases from them)."""
    waited = max(0.1, case.deadline - time.time())
    try:
        return leases.acquire(
            case.budget_dir,
            [leases.slot_want(case.nproc, spec.nproc)],
            timeout=waited,
            holder=what,
        )
    except leases.LeaseTimeout:
        raise LaunchBudgetError(
            f"{what} waited {waited:.3g} s for {spec.nproc} of the {case.nproc} rank slot(s) of "
            f"{case.what}: its other nested launches held them until its deadline"
        ) from None


def _within(case: EnclosingCase, spec: LaunchSpec) -> tuple[Card, ...]:
    """The enclosing case's cards a nested launch of ``spec`` runs on (``LaunchBudgetError``:
    more nodes, ranks or cards than the case has)."""
    if spec.nnodes > 1:
        raise LaunchBudgetError(
            f"harness.launch cannot start a {spec.nnodes}-node case inside {case.what}; "
            "a multi-node case is launched on its own (a launch marker or a top-level call)"
        )
    if spec.nproc > case.nproc:
        raise LaunchBudgetError(
            f"harness.launch would start {spec.nproc} ranks, but {case.what} declares "
            f"nproc={case.nproc}; declare the number of ranks it really starts "
            f"(e.g. @pytest.mark.launch(nproc={spec.nproc}))"
        )
    if not spec.cards:
        return ()
    cards = [Card(*c.split(":", 1)) for c in case.cards if c.startswith(spec.device + ":")]
    if len(cards) < spec.cards:
        raise LaunchBudgetError(
            f"harness.launch would use {spec.cards} {spec.device} cards, but {case.what} "
            f"holds {len(cards)} ({', '.join(case.cards) or 'none'})"
        )
    return tuple(cards[: spec.cards])
