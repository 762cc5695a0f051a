"""The fresh-ranks strategy: spawn a case's ranks for it alone, stop them after.

``run_ranks`` is also what a nested ``harness.launch`` inside a case uses (on
the enclosing case's cards, leasing nothing).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

from harness.devices import Card
from harness.launcher import lease as leases
from harness.launcher.case import CasePlan, lease_case
from harness.launcher.caserun import CaseRun
from harness.launcher.outcome import CaseOutcome
from harness.launcher.rank import RankTask, rank_main
from harness.launcher.signals import reap_on_sigterm, signals_deferred
from harness.launcher.spawn import spawn_ranks


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


def run_ranks(
    task: RankTask, plan: CasePlan, cards: list[Card], *, lease: leases.Lease | None = None
) -> CaseOutcome:
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
            # Inside reap_on_sigterm: a SIGTERM re-raised on its way out ends
            # the process, and the directory must be gone by then.
            with signals_deferred():
                try:
                    run.wind_down(started)
                finally:
                    shutil.rmtree(run.case_dir, ignore_errors=True)
    return run.result
