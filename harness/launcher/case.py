"""One case: what it needs and how it is run, prepared once for the plugin and
``harness.launch`` alike (``prepare_case``), and its outcome mapped to the
caller's verdict (``conclude``).

``harness.launcher.launch.run_case(task, plan)`` runs a prepared case with a
*rank strategy* (a ``RankStrategy``): fresh ranks (``harness.launcher.fresh``)
or the kept pool (``harness.launcher.pool``); the strategy leases what the case
needs (``lease_case``), runs it through the phases of
``harness.launcher.caserun.CaseRun`` and releases. The jobs around a case live
in modules of their own: ``deadline`` (how long it may run), ``enclosing``
(the case as its ranks see it), ``spawn`` (starting and stopping ranks),
``fds`` (lease descriptors the ranks inherit), ``signals`` (SIGTERM /
SIGINT while ranks run), ``output`` (bounded rank output) and ``args``
(pickling what the ranks receive).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol

from harness.devices import Card, inventory
from harness.launcher import lease as leases
from harness.launcher.args import pickle_args, pickle_state
from harness.launcher.deadline import Deadline, choose_deadline
from harness.launcher.enclosing import EnclosingCase
from harness.launcher.outcome import FAILED, SKIPPED, XFAILED, CaseOutcome
from harness.launcher.output import echo_logs
from harness.launcher.rank import RankTask
from harness.launcher.settings import Settings
from harness.launcher.target import FunctionRef
from harness.spec import LaunchSpec


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
    #: stream the ranks' output while the case runs, each line prefixed with
    #: its rank (``pytest -s``), instead of echoing it after the case
    live: bool = False


class RankStrategy(Protocol):
    """How a case's ranks come to be: fresh per case, or kept across cases.

    ``run`` leases what ``plan`` needs (``LeaseTimeout``), runs the case,
    releases what it leased (a kept pool: when the pool closes) and returns
    the outcome; no process of the case is alive when it returns.
    """

    def run(self, task: RankTask, plan: CasePlan) -> CaseOutcome: ...


def prepare_case(
    ref: FunctionRef,
    args: tuple,
    kwargs: dict,
    spec: LaunchSpec,
    *,
    what: str,
    settings: Settings,
    default_source: str,
    reuse: bool,
    kinds: dict[str, str] | None = None,
    want_value: bool = True,
    enclosing: EnclosingCase | None = None,
    cards: tuple[Card, ...] | None = None,
    state: dict | None = None,
    warning_filters: tuple[tuple[str, bool], ...] = (),
    show_deprecations: bool = False,
    conftests: tuple[tuple[str, str], ...] = (),
    live: bool = False,
    example: bool = False,
) -> tuple[RankTask, CasePlan]:
    """The task the ranks run (``ref`` called with the pickled ``args`` /
    ``kwargs``; ``TypeError`` names a value that cannot travel, ``kinds``
    saying what each keyword is) and the plan it runs under: its deadline
    (``spec.timeout``, else ``settings.timeout`` named ``default_source``,
    never past the ``enclosing`` case's), kept ranks when ``reuse``, and the
    ``cards`` of an enclosing case it runs on without leasing. ``state``: the
    attributes of the test method's instance, set on the rank's instance;
    ``warning_filters`` / ``show_deprecations``: the warning filters the
    ranks apply around the function; ``conftests``: the conftest modules
    the ranks import first (see ``RankTask``); ``live``: stream the ranks'
    output while they run (``CasePlan.live``); ``example``: ``args`` /
    ``kwargs`` are one Hypothesis example for the body of a ``@given`` test."""
    task = RankTask(
        ref,
        pickle_args(args, kwargs, kinds=kinds),
        want_value=want_value,
        state=None if state is None else pickle_state(state),
        warning_filters=warning_filters,
        show_deprecations=show_deprecations,
        conftests=conftests,
        example=example,
    )
    deadline = choose_deadline(spec, settings, default_source=default_source, enclosing=enclosing)
    return task, CasePlan(spec, settings, what, deadline, reuse=reuse, cards=cards, live=live)


def lease_case(spec: LaunchSpec, settings: Settings, holder: str) -> leases.Lease:
    """Lease the process slots and cards ``spec`` needs, waiting at most
    ``settings.lease_timeout`` (``LeaseTimeout`` names what it waited for)."""
    wants = [leases.slot_want(settings.max_procs, spec.nproc)]
    if spec.cards:
        wants.append(leases.card_want(inventory(spec.device), spec.cards))
    return leases.acquire(settings.lease_dir, wants, timeout=settings.lease_timeout, holder=holder)


def conclude(
    result: CaseOutcome,
    *,
    fail: Callable[[str], NoReturn],
    skip: Callable[[str], NoReturn],
    xfail: Callable[[str], NoReturn],
    echo: bool = True,
) -> None:
    """Echo the case's notes and captured output, issue the ranks' warnings
    again here (``CaseOutcome.reissue_warnings``), then map its status: failed ->
    ``fail(report)``, skipped -> ``skip(reason)``, xfailed -> ``xfail(reason)``;
    returns only for a passed case."""
    if echo:
        echo_logs(result)
    result.reissue_warnings()
    status = result.status
    if status == FAILED:
        fail(result.report())
    if status == SKIPPED:
        skip(result.reason())
    if status == XFAILED:
        xfail(result.reason())


def missing_cards(device: str, need: int) -> str | None:
    """Why this host cannot run a case needing ``need`` cards of ``device`` (None: it can)."""
    if need == 0:
        return None
    have = inventory(device)
    if len(have) >= need:
        return None
    found = f"{len(have)} ({', '.join(str(c) for c in have)})" if have else "none"
    return f"needs {need} {device} card{'s' if need > 1 else ''}; this host has {found}"
