"""Declarative accelerator test matrix: launch specs, leasing, launching, suites.

The public names are resolved on first use, so the suite side imports only the shared
ground (``harness/*.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.devices import DEVICES
    from harness.launcher.case import LaunchBudgetError, LaunchError, launch
    from harness.launcher.groups import kept_group
    from harness.launcher.lease import LeaseTimeout
    from harness.spec import LaunchSpec

#: public name -> the module that defines it
_HOMES = {
    "DEVICES": "harness.devices",
    "LaunchBudgetError": "harness.launcher.case",
    "LaunchError": "harness.launcher.case",
    "LaunchSpec": "harness.spec",
    "LeaseTimeout": "harness.launcher.lease",
    "kept_group": "harness.launcher.groups",
    "launch": "harness.launcher.case",
}

__all__ = [
    "DEVICES",
    "LaunchBudgetError",
    "LaunchError",
    "LaunchSpec",
    "LeaseTimeout",
    "kept_group",
    "launch",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
