"""The start of the ``harness`` command (console script and ``python -m harness``).

It checks, before anything imports them, that the dependencies the command's modules
import are installed, so that an environment which installed the harness without them (a copied
source tree, ``pip install --no-deps``) gets one line naming what is missing and how
to install it instead of a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from harness.names import EXIT_USAGE

#: (import name, distribution) of the declared dependencies that the command's own modules
#: import, so that no command can start without them (a test checks the list against
#: ``import harness.suites.cli``). Not pytest-xdist: ``harness run`` and the inventory work
#: without it (serially); not torch: only launched ranks import it.
REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("pytest", "pytest"),
    ("jsonschema", "jsonschema"),
    ("pathspec", "pathspec"),
)
#: What ``harness run`` needs besides: it stops pytest's process tree, and the cases it
#: launches are supervised, with psutil (imported where used, so that the inventory, the
#: planner and ``init`` work without it).
RUN_REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("psutil", "psutil"),
    # The planned cases' deadlines (pytest-timeout's markers, in the run's pytest).
    ("pytest_timeout", "pytest-timeout"),
    # The run's junit.xml, completed with the cases pytest did not report.
    ("junitparser", "junitparser"),
    # Flaky entries' reruns (its `flaky` marker, in the run's pytest).
    ("pytest_rerunfailures", "pytest-rerunfailures"),
)


def missing_requirements(argv: Sequence[str] = ()) -> list[str]:
    """The distributions the command in ``argv`` needs (``REQUIREMENTS``, and
    ``RUN_REQUIREMENTS`` when it names ``run``) whose import package cannot be found
    (nothing is imported to find out)."""
    needed = REQUIREMENTS + (RUN_REQUIREMENTS if "run" in argv else ())
    gone = []
    for module, distribution in needed:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken parent package, or a spec-less module
            found = False
        if not found:
            gone.append(distribution)
    return gone


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``harness`` console script; returns the exit code.

    Exit 2 with one line on stderr naming each missing dependency when any is absent;
    otherwise ``harness.suites.cli.main(argv)``.
    """
    gone = missing_requirements(sys.argv[1:] if argv is None else argv)
    if gone:
        print(
            f"harness: missing {'dependency' if len(gone) == 1 else 'dependencies'}"
            f" {', '.join(gone)}: install the harness with its dependencies"
            " (`pip install ./harness` from the repository root,"
            f" or `pip install {' '.join(gone)}`)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from harness.suites.cli import main as cli_main

    return cli_main(argv)
