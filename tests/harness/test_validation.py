"""The two distributions keep their own copy of the int / real checks (neither imports the
other); these tests tie the copies, so a fix to one cannot silently miss the other."""

from __future__ import annotations

import inspect

import pytest

import channel_loss.validation as library
import harness.validation as harness_checks

SHARED = ["is_int", "is_real", "check_int"]


@pytest.mark.parametrize("name", SHARED)
def test_the_library_and_the_harness_share_one_definition(name):
    assert inspect.getsource(getattr(library, name)) == inspect.getsource(
        getattr(harness_checks, name)
    )


@pytest.mark.parametrize(
    "value", [0, 3, -2, True, False, 1.0, 2.5, float("nan"), "3", None, 10**400]
)
def test_both_copies_give_the_same_answers(value):
    assert library.is_int(value) == harness_checks.is_int(value)
    assert library.is_real(value) == harness_checks.is_real(value)
    outcomes = []
    for module in (library, harness_checks):
        try:
            outcomes.append(module.check_int(value, "x", minimum=0, maximum=5))
        except ValueError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
