"""Session-wide harness settings: deadlines, lease directory, process slots.

The pytest plugin activates the settings its command line gives for the
length of the session (``active``); ``harness.launch`` called from scripts
gets the defaults (``HARNESS_LEASE_DIR`` honoured).
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from dataclasses import dataclass, field

from harness.launcher.lease import default_lease_dir

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_LEASE_TIMEOUT_S = 600.0


def cpu_count() -> int:
    """CPUs this process may run on (affinity-aware where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Settings:
    """``timeout``: default case deadline (s); ``lease_dir`` (made absolute
    against the current directory at construction); ``max_procs``: CPU
    process slots on the host; ``lease_timeout``: bound on a lease wait (s);
    ``require``: accelerator types whose absence fails instead of skipping;
    ``capture``: collect rank output into the report instead of streaming it;
    ``reuse``: run consecutive launched cases on kept rank pools (``harness.launcher.pool``)."""

    timeout: float = DEFAULT_TIMEOUT_S
    lease_dir: str = field(default_factory=default_lease_dir)
    max_procs: int = field(default_factory=cpu_count)
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT_S
    require: frozenset[str] = frozenset()
    capture: bool = False
    reuse: bool = False

    def __post_init__(self) -> None:
        # A relative lease directory means where the session started, not
        # wherever a test has changed directory to when it leases.
        object.__setattr__(self, "lease_dir", os.path.abspath(self.lease_dir))


#: The settings of the pytest session this code runs in (unset: none). The
#: plugin keeps its session's ``Settings`` in ``config.stash`` and activates
#: them here for the session's length (a ContextVar: nested pytester runs
#: restore the outer session's on exit by resetting their token).
active: ContextVar[Settings] = ContextVar("harness_settings")


def current() -> Settings:
    """The active session's settings, else defaults from the environment."""
    settings = active.get(None)
    return settings if settings is not None else Settings()
