"""Hypothesis's in-test API across processes, for a launched ``@given`` test.

Hypothesis draws, shrinks and stores examples in the launcher; each example's body runs
on the ranks, inside a build context of their own (``example_context``) that records
what the body told Hypothesis (``Feedback``: notes, events, targets, a rejection); the
launcher replays it inside its own build context (``replay``). ``st.data()`` cannot be
split this way (its draws are made on the ranks), so a launched test using it is refused
(``harness.spec.launch_refusal``).
"""

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
    """Run the body of one example of ``test`` (its ``@given`` wrapper) inside a
    Hypothesis build context that records into ``feedback``; an
    ``UnsatisfiedAssumption`` the body raises is recorded and re-raised."""
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
    """In the launcher's build context: replay what the ranks' bodies told Hypothesis
    (events and targets of the lowest rank that reported; its notes, then the other
    ranks' notes it did not make, prefixed ``rank N:``)."""
    if not feedbacks:
        return
    from hypothesis import event, note, target

    first = min(feedbacks)
    own = feedbacks[first]
    for text in own.notes:
        note(text)
    for rank in sorted(feedbacks):
        if rank != first:
            for text in feedbacks[rank].notes:
                if text not in own.notes:
                    note(f"rank {rank}: {text}")
    for value, payload in own.events.items():
        event(value, payload)
    for label, score in own.targets.items():
        target(score, label=label)
