"""Checks of user-supplied values, written once for both rooms of the harness (the int /
real checks tied to ``channel_loss/validation.py``'s copy by a test). Booleans are never
numbers here; numpy / torch scalars are."""

from __future__ import annotations

import math
import numbers
from typing import Any


def is_int(value: Any) -> bool:
    """True for integers of any kind (``numbers.Integral``), False for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for real numbers of any kind (``numbers.Real``), False for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """True for a real number (not a bool) that is finite as a float (not an int too large
    for one)."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


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


def check_seconds(
    value: Any, what: str, *, allow_none: bool = False, error: type[Exception] = ValueError
) -> float | None:
    """``value`` as a float when it is a positive, finite number of seconds (``None`` passes
    when ``allow_none``); else ``error`` naming ``what`` and the value."""
    if value is None and allow_none:
        return None
    if not is_finite(value) or not value > 0:
        tail = " or None" if allow_none else ""
        raise error(f"{what} must be a positive, finite number of seconds{tail}; got {value!r}")
    return float(value)
