"""Lease descriptors handed to spawned ranks, so the OS keeps a lease held for
as long as any process of the case is alive (even when the launcher dies first)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.launcher.lease import Lease


class InheritedFd:
    """A descriptor a spawned rank inherits (pass it in the process's arguments)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        # Registers the fd with the spawning Popen, which passes it to the child.
        return (_inherited_fd, (reduction.DupFd(self.fd),))


def _inherited_fd(dup: Any) -> int:
    return dup.detach()


def lease_fds(lease: Lease | None) -> list[InheritedFd]:
    """The lease's descriptors, ready to travel to a spawned rank."""
    return [InheritedFd(fd) for fd in (lease.fds() if lease else [])]
