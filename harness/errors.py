"""``HarnessError``, the base of the harness's own error classes (a failed launch, a lease
timeout, a refused spec, ...), so a caller can tell those refusals from a bug; a bad
argument to a function raises ``ValueError`` or ``TypeError``."""

from __future__ import annotations


class HarnessError(Exception):
    """Base of the errors the harness raises for bad input, bad manifests, failed leases and
    failed launches."""
