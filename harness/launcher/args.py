"""What a case's ranks receive: its arguments, pickled once in the launcher,
with an error naming the value that cannot travel."""

from __future__ import annotations

import pickle
from typing import Any


def pickle_args(args: tuple, kwargs: dict, *, kinds: dict[str, str] | None = None) -> bytes:
    """Pickle what the ranks receive; an unpicklable value raises ``TypeError``
    naming it (``kinds`` maps keyword names to words like "fixture")."""
    kinds = kinds or {}
    for index, value in enumerate(args):
        _check_picklable(value, f"argument {index}")
    for name, value in kwargs.items():
        _check_picklable(value, f"{kinds.get(name, 'argument')} {name!r}")
    return pickle.dumps((args, kwargs))


def pickle_state(state: dict[str, Any]) -> bytes:
    """Pickle a test instance's attributes for the ranks; an unpicklable one
    raises ``TypeError`` naming it (``self.<name>``)."""
    for name, value in state.items():
        _check_picklable(value, f"attribute self.{name} of the test's instance")
    return pickle.dumps(state)


def _check_picklable(value: Any, what: str) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"{what} (a {type(value).__module__}.{type(value).__qualname__}) cannot be sent to "
            f"the rank processes: {type(exc).__name__}: {exc}. Ranks receive values by pickling; "
            "pass something picklable or build it inside the ranks."
        ) from None
