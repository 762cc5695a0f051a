"""Declarative accelerator test matrix: launch specs, leasing, launching, suites."""

from harness.spec import LaunchSpec

__all__ = ["LaunchSpec"]
