"""The harness's exception base class: the harness's own error classes (a launch that failed,
a lease wait that timed out, a refused launch spec, ...) derive from ``HarnessError``, so a
caller can tell those refusals from a bug. A bad argument to a function raises ``ValueError``
or ``TypeError``, as Python's own functions do."""

from __future__ import annotations

__all__ = ["HarnessError"]


class HarnessError(Exception):
    """Base of the errors the harness raises for bad input, bad manifests, failed leases and
    failed launches."""
