"""The start of the ``harness`` command (console script and ``python -m harness``): it names
missing dependencies in one line before any import of them fails deep in a traceback."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from harness.names import EXIT_USAGE

#: (import name, distribution) of the declared dependencies the command's own modules import
#: (a test checks the list against ``import harness.suites.cli``). Not pytest-xdist (the
#: inventory and ``harness run`` work serially without it), not torch (only ranks import it).
REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("pytest", "pytest"),
    ("jsonschema", "jsonschema"),
    ("pathspec", "pathspec"),
)
#: What ``harness run`` needs besides (psutil and junitparser are imported where used, so the
#: inventory, the planner and ``init`` work without them), its pytest's plugins included.
RUN_REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("psutil", "psutil"),
    ("pytest_timeout", "pytest-timeout"),
    ("junitparser", "junitparser"),
    ("pytest_rerunfailures", "pytest-rerunfailures"),
)


def missing_requirements(argv: Sequence[str] = ()) -> list[str]:
    """The distributions the command in ``argv`` needs (``RUN_REQUIREMENTS`` too when it
    names ``run``) whose import package cannot be found (nothing is imported to find out)."""
    wanted = REQUIREMENTS + (RUN_REQUIREMENTS if "run" in argv else ())
    return [dist for module, dist in wanted if importlib.util.find_spec(module) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``harness`` console script; returns the exit code: 2 with one line
    on stderr naming each missing dependency, else ``harness.suites.cli.main(argv)``'s."""
    if gone := missing_requirements(sys.argv[1:] if argv is None else argv):
        print(
            f"harness: missing {'dependency' if len(gone) == 1 else 'dependencies'}"
            f" {', '.join(gone)}: install the harness with its dependencies"
            f" (`pip install ./harness` from the repository root, or `pip install {' '.join(gone)}`)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from harness.suites.cli import main as cli_main

    return cli_main(argv)
