"""Sub-groups a rank keeps for its whole life (``harness.kept_group``), and how the
harness counts process groups (``process_groups``)."""

from __future__ import annotations

import contextlib
import operator
import sys
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

#: (sorted ranks, backend) -> what ``dist.new_group`` returned for them on this rank
_kept: dict[tuple[tuple[int, ...], str | None], Any] = {}
_owner: Any = None  # the default process group the kept groups were made under
_entries = 0  # process-group entries (torch's ``pg_map``) the kept groups added
_timeout_s: float | None = None  # the collective timeout of the rank's current case


def process_groups() -> tuple[int, Any]:
    """(number of process groups, the default group); ``(0, None)`` before a default group
    exists, a count of -1 when torch's internals are not the ones read here."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0, None
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    count = len(pg_map) if pg_map is not None else -1
    return count, c10d._get_default_group()


def kept_entries() -> int:
    """How many of this rank's process groups :func:`kept_group` made."""
    _forget_stale()
    return _entries


def kept_group(ranks: Sequence[int], *, backend: str | None = None) -> Any:
    """A process group over ``ranks`` (as ``dist.new_group(ranks, backend=backend)``) that
    lives as long as this process's default group: later calls, in this case or a later
    one on the same kept ranks, return it without a collective. Every rank of the world
    makes the same calls in the same order (a rank outside ``ranks`` gets torch's
    non-member value). Such groups do not retire a kept rank, where the case's own
    ``dist.new_group`` does; they get each case's process-group timeout.

    Raises ``RuntimeError`` without a default group, and ``ValueError`` (naming the
    value) for ranks that are empty, repeated, not integers, or outside the world.
    """
    global _entries
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "harness.kept_group: torch.distributed has no default process group here; "
            "call it on launched ranks (or after dist.init_process_group)"
        )
    key = (_checked_ranks(ranks, dist.get_world_size()), backend)
    _forget_stale()
    if key in _kept:
        return _kept[key]
    before, _ = process_groups()
    extra = {} if _timeout_s is None else {"timeout": timedelta(seconds=_timeout_s)}
    group = dist.new_group(list(key[0]), backend=backend, **extra)
    after, _ = process_groups()
    _entries += after - before
    _kept[key] = group
    return group


def set_timeout(seconds: float) -> None:
    """Give the default group, this rank's kept groups and those made from now on a
    collective timeout of ``seconds`` (each case's, below its deadline)."""
    global _timeout_s
    _timeout_s = seconds
    import torch.distributed as dist

    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None or not dist.is_initialized():
        return
    _forget_stale()
    outside = dist.GroupMember.NON_GROUP_MEMBER
    members = [g for g in _kept.values() if g is not None and g is not outside]
    for group in [None, *members]:
        with warnings.catch_warnings(), contextlib.suppress(Exception):
            warnings.simplefilter("ignore")  # "only supported for nccl or gloo" (hccl)
            setter(timedelta(seconds=seconds), group=group)


def _checked_ranks(ranks: Sequence[int], world: int) -> tuple[int, ...]:
    try:
        given = list(ranks)
    except TypeError:
        raise ValueError(
            f"harness.kept_group: ranks must be a sequence of ints; got {ranks!r}"
        ) from None
    if not given:
        raise ValueError("harness.kept_group: ranks is empty")
    for k, r in enumerate(given):
        try:
            if isinstance(r, bool):
                raise TypeError
            given[k] = r = operator.index(r)  # numpy integers too, as LaunchSpec takes them
        except TypeError:
            raise ValueError(f"harness.kept_group: rank {r!r} in {given} is not an int") from None
        if not 0 <= r < world:
            raise ValueError(
                f"harness.kept_group: rank {r} in {given} is outside the world of {world} ranks"
            )
    if len(set(given)) != len(given):
        raise ValueError(f"harness.kept_group: ranks {given} repeat a rank")
    return tuple(sorted(given))


def _forget_stale() -> None:
    """Drop the kept groups of a default group that is gone or replaced."""
    global _owner, _entries
    _, default = process_groups()
    if default is not _owner:
        _kept.clear()
        _owner = default
        _entries = 0
