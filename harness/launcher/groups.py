"""Sub-groups a rank keeps for its whole life (``harness.kept_group``), so that a case
making its ``sp x dp`` sub-groups does not retire its kept ranks (a ``dist.new_group``
of the case does); and how the harness counts process groups (``process_groups``).
"""

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
#: the default process group the kept groups were made under
_owner: Any = None
#: process-group entries (torch's ``pg_map``) the kept groups added on this rank
_entries = 0
#: the timeout (s) the rank's collectives get now: the case's, set by the rank
_timeout_s: float | None = None


def process_groups() -> tuple[int, Any]:
    """(number of process groups, the default group) as torch.distributed knows them;
    ``(0, None)`` before a default group exists, a count of -1 when torch's
    internals are not the ones read here (callers treat that as a change)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0, None
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    count = len(pg_map) if pg_map is not None else -1
    return count, c10d._get_default_group()


def kept_entries() -> int:
    """How many of this rank's process groups :func:`kept_group` made (for the current
    default group)."""
    _forget_stale()
    return _entries


def kept_group(ranks: Sequence[int], *, backend: str | None = None) -> Any:
    """A process group over ``ranks`` (as ``dist.new_group(ranks, backend=backend)``
    makes it) that lives as long as this process's default group.

    The first call for a set of ranks and a backend makes the group; every later
    call, in this case or a later case on the same kept ranks, returns that
    same group without a collective. As with ``dist.new_group``, every rank of
    the world must make the same calls in the same order (a rank outside
    ``ranks`` gets torch's non-member value). Groups made here do not retire a
    kept rank, where a ``dist.new_group`` of the case's own does. Inside
    harness ranks a new group gets the case's process-group timeout, and kept
    groups follow each later case's.

    Raises ``RuntimeError`` when torch.distributed has no default group, and
    ``ValueError`` (naming the offending value) for ranks that are empty,
    repeated, not integers, or outside the world.
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
    """Give the default process group, the kept groups this rank is a member of,
    and those made from now on a collective timeout of ``seconds``: a rank
    calls it with each case's (below the case's deadline)."""
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
