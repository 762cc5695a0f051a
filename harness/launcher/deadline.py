"""A case's deadline: how long it may run, where that number came from, and the
process-group timeout that makes a stuck collective raise inside the rank first
(the watchdog holding a phase of the pytest process to its deadline is
``harness.watchdog``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from harness.launcher.enclosing import EnclosingCase
from harness.launcher.settings import Settings
from harness.launcher.spawn import KILL_GRACE_S
from harness.spec import LaunchSpec

#: The longest process-group timeout: ``timedelta`` and torch's milliseconds hold it
#: (a schema-valid ``timeout_s`` of 1e300 failed every rank with ``OverflowError``).
LONGEST_PG_TIMEOUT_S = 30 * 24 * 3600.0


def pg_timeout_for(deadline_s: float) -> float:
    """Process-group timeout for a case with this deadline: strictly below it,
    leaving room (up to 30 s) for the rank to report the timeout error, and at most
    ``LONGEST_PG_TIMEOUT_S`` (30 days)."""
    return min(LONGEST_PG_TIMEOUT_S, max(0.1, deadline_s - min(30.0, 0.2 * deadline_s)))


@dataclass(frozen=True)
class Deadline:
    """A case's deadline in seconds and the words saying where it came from."""

    seconds: float
    source: str


def choose_deadline(
    spec: LaunchSpec,
    settings: Settings,
    *,
    default_source: str,
    enclosing: EnclosingCase | None = None,
) -> Deadline:
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
