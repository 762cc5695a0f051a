"""Running a case: ``run_case`` (for the plugin and ``harness.launch``) and ``harness.launch``.

``run_case(task, plan)`` is the one case lifecycle: it picks the rank
strategy (kept pool or fresh ranks), which leases, runs and releases
(``harness.launcher.fresh``, ``harness.launcher.pool``).
``launch(fn, spec, *args)`` is the public entry for code that starts ranks
itself; it leases what it starts unless it runs inside a case that already
holds a lease (then it may not start more ranks than that case declared).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from harness.devices import Card
from harness.errors import HarnessError
from harness.launcher import lease as leases
from harness.launcher.case import CasePlan, RankStrategy, conclude, missing_cards, prepare_case
from harness.launcher.enclosing import EnclosingCase
from harness.launcher.fresh import FRESH
from harness.launcher.outcome import CaseOutcome
from harness.launcher.pool import keeper
from harness.launcher.rank import RankTask
from harness.launcher.settings import current
from harness.launcher.target import FunctionRef
from harness.spec import LaunchSpec


class LaunchError(HarnessError):
    """A launched case failed; the message is the case report (``rank N`` first)."""

    def __init__(self, message: str, result: CaseOutcome | None = None) -> None:
        super().__init__(message)
        self.result = result


class LaunchBudgetError(LaunchError, ValueError):
    """``harness.launch`` asked for more ranks or cards than the enclosing case declared."""


def run_case(task: RankTask, plan: CasePlan) -> CaseOutcome:
    """Run ``task`` as ``plan`` says: on the kept pool when ``plan.reuse`` (and
    this is the main thread, which outlives the pool), else on fresh ranks."""
    # Pools are kept by the main thread: Linux kills ranks whose spawning thread ends.
    kept = (
        plan.reuse and plan.cards is None and threading.current_thread() is threading.main_thread()
    )
    strategy: RankStrategy = keeper if kept else FRESH
    return strategy.run(task, plan)


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
    ``LaunchBudgetError`` giving both numbers; nested launches from all the
    case's ranks and threads together never run more ranks at once than the
    case declared (later ones wait, within the case's deadline, then raise
    ``LaunchBudgetError``). A plain test holding a card (parametrized with an
    accelerator ``device``) is such a case of one rank on its card. A failing, crashing or
    overdue rank raises ``LaunchError`` whose message names the rank.
    """
    __tracebackhide__ = True
    settings = current()
    ref = FunctionRef.of(fn)
    enclosing = EnclosingCase.from_env()
    cards: tuple[Card, ...] | None = None
    if enclosing is not None:
        cards = tuple(_within(enclosing, spec))
        what = f"harness.launch({ref.module}.{ref.qualname})"
    else:
        reason = missing_cards(spec.device, spec.cards)
        if reason is not None:
            _missing_hardware(spec.device, reason)
        what = (
            os.environ.get("PYTEST_CURRENT_TEST") or f"harness.launch({ref.module}.{ref.qualname})"
        )
    task, plan = prepare_case(
        ref,
        args,
        {},
        spec,
        what=what,
        settings=settings,
        default_source="the session's default timeout",
        reuse=False,
        enclosing=enclosing,
        cards=cards,
    )
    with _nested_slots(enclosing, spec, what):
        result = run_case(task, plan)

    def fail(message: str) -> NoReturn:
        raise LaunchError(message, result)

    def not_passed(reason: str) -> NoReturn:
        raise LaunchError(f"ranks {result.status}: {reason}", result)

    pytest = sys.modules.get("pytest")
    conclude(
        result,
        fail=fail,
        echo=settings.capture,
        skip=pytest.skip if pytest is not None else not_passed,
        xfail=pytest.xfail if pytest is not None else not_passed,
    )
    return result.values()


@contextlib.contextmanager
def _nested_slots(case: EnclosingCase | None, spec: LaunchSpec, what: str) -> Iterator[None]:
    """Hold ``spec.nproc`` of the enclosing case's ``case.nproc`` rank slots
    while a nested launch runs (nothing outside a case)."""
    if case is None or case.budget_dir is None:
        yield
        return
    waited = max(0.1, case.deadline - time.time())
    try:
        lease = leases.acquire(
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
    try:
        yield
    finally:
        lease.release()


def _within(case: EnclosingCase, spec: LaunchSpec) -> list[Card]:
    if spec.nproc > case.nproc:
        raise LaunchBudgetError(
            f"harness.launch would start {spec.nproc} ranks, but {case.what} declares "
            f"nproc={case.nproc}; declare the number of ranks it really starts "
            f"(e.g. @pytest.mark.launch(nproc={spec.nproc}))"
        )
    if spec.cards:
        cards = [Card(*c.split(":", 1)) for c in case.cards if c.startswith(spec.device + ":")]
        if len(cards) < spec.cards:
            raise LaunchBudgetError(
                f"harness.launch would use {spec.cards} {spec.device} cards, but {case.what} "
                f"holds {len(cards)} ({', '.join(case.cards) or 'none'})"
            )
        return cards[: spec.cards]
    return []


def _missing_hardware(device: str, reason: str) -> None:
    if "pytest" in sys.modules and device not in current().require:
        import pytest

        pytest.skip(reason)
    raise LaunchError(f"harness.launch: {reason}")
