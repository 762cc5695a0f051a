"""Checks of user-supplied arguments, written once for the whole library.

Booleans are never integers here; numpy / torch integer scalars are (``numbers.Integral``).
Each check raises ``ValueError`` (or the class the caller passes) naming ``what``.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["check_int", "is_int", "is_real"]


def is_int(value: Any) -> bool:
    """True for integers of any kind (``numbers.Integral``), False for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for real numbers of any kind (``numbers.Real``), False for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(
    value: Any,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[Exception] = ValueError,
) -> int:
    """``value`` as an ``int`` when it is an integer (not a bool) within the bounds; else
    ``error`` naming ``what``, the bounds and the value."""
    bounds = []
    if minimum is not None:
        bounds.append(f">= {minimum}")
    if maximum is not None:
        bounds.append(f"<= {maximum}")
    expected = "an int" + (f" {' and '.join(bounds)}" if bounds else "")
    if (
        not is_int(value)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        raise error(f"{what} must be {expected}; got {value!r}")
    return int(value)
