"""Declarative accelerator test matrix: launch specs, leasing, launching, suites."""

from harness.devices import DEVICES
from harness.launcher.launch import LaunchBudgetError, LaunchError, launch
from harness.launcher.lease import LeaseTimeout
from harness.spec import LaunchSpec

__all__ = ["DEVICES", "LaunchBudgetError", "LaunchError", "LaunchSpec", "LeaseTimeout", "launch"]
