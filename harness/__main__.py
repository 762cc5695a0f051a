"""``python -m harness``: the same as the ``harness`` console script."""

from harness.suites.entry import main

raise SystemExit(main())
