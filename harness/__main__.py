"""``python -m harness``: the same as the ``harness`` console script."""

from harness.cli import main

raise SystemExit(main())
