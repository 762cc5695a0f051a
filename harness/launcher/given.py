"""Hypothesis's in-test API for a launched ``@given`` test: each example's body runs on
the ranks in a build context of their own (``example_context``) that records what it told
Hypothesis (``Feedback``); the launcher replays that in its own (``replay``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Feedback:
    """What one rank's run of an example told Hypothesis."""

    notes: list[str] = field(default_factory=list)
    events: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, float] = field(default_factory=dict)
    rejected: bool = False


@contextlib.contextmanager
def example_context(test: Any, feedback: Feedback) -> Iterator[None]:
    """Run one example's body of ``test`` (its ``@given`` wrapper) in a Hypothesis build
    context recording into ``feedback`` (a rejection recorded, and re-raised)."""
    from hypothesis.control import BuildContext
    from hypothesis.errors import UnsatisfiedAssumption
    from hypothesis.internal.conjecture.data import ConjectureData
    from hypothesis.reporting import with_reporter

    data = ConjectureData.for_choices(())
    # is_final: every note is recorded; the launcher's note() decides what is reported.
    try:
        with (
            with_reporter(feedback.notes.append),
            BuildContext(data, is_final=True, wrapped_test=test),
        ):
            yield
    except UnsatisfiedAssumption:
        feedback.rejected = True
        raise
    finally:
        feedback.events = dict(data.events)
        feedback.targets = dict(data.target_observations)


def is_rejection(exc: BaseException) -> bool:
    """``exc`` is Hypothesis's rejection of an example (``assume``, ``reject``)."""
    errors = sys.modules.get("hypothesis.errors")
    return errors is not None and isinstance(exc, errors.UnsatisfiedAssumption)


def replay(feedbacks: dict[int, Feedback]) -> None:
    """In the launcher's build context: the events, targets and notes of the lowest rank
    that reported, then the other ranks' notes it did not make, prefixed ``rank N:``."""
    if not feedbacks:
        return
    from hypothesis import event, note, target

    first, *others = sorted(feedbacks)
    own = feedbacks[first]
    for text in own.notes:
        note(text)
    for rank in others:
        for text in feedbacks[rank].notes:
            if text not in own.notes:
                note(f"rank {rank}: {text}")
    for value, payload in own.events.items():
        event(value, payload)
    for label, score in own.targets.items():
        target(score, label=label)
