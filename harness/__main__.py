"""``python -m harness``: the same as the ``harness`` console script."""

from harness.suites.cli import main

raise SystemExit(main())
