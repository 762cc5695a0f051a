"""The harness's exception base class: every error the harness raises on purpose derives
from ``HarnessError``, so a caller can tell the harness's refusals from a bug."""

from __future__ import annotations

__all__ = ["HarnessError"]


class HarnessError(Exception):
    """Base of the errors the harness raises for bad input, bad manifests, failed leases and
    failed launches."""
