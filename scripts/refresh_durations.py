"""Fold CI's recorded case durations into ``suites/durations/<suite>.json``.

Usage (also ``nox -s durations -- DIR ...``)::

    gh run download RUN_ID --dir artifacts        # the harness-* artifacts of a push run
    python scripts/refresh_durations.py artifacts  # then commit suites/durations/

Each argument is a folder, searched recursively for the output folders of
``harness run`` (``plan.json`` next to ``junit.xml``): the suite comes from
``plan.json``, each planned case's seconds from the JUnit XML (every case
pytest reported, failed and skipped ones included: they took that share of
the run too; not the cases ``harness run`` adds for pytest: not run after
``-x`` or an interrupt, never collected, or in a pytest that was killed).
Durations are merged into the checked-in file: cases absent from the
artifacts keep their old value; ``--prune`` drops node ids that the suite no
longer has.

What is recorded is each case's share of the wall time of the pytest run
that ran it: its JUnit seconds scaled so that the cases of one
``<testsuite>`` add up to that testsuite's ``time`` (the run's wall time).
xdist workers run cases side by side and every run pays worker start-up and
collection; the planner adds these shares up into a shard's expected wall
time, which is what it compares with a runner's budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.suites import report
from harness.suites.inventory import build_inventory
from harness.suites.manifest import find_root
from harness.suites.plan import default_durations_path, load_durations, write_durations


def passed_seconds(out_dir: Path) -> tuple[str, dict[str, float]]:
    """The suite of one ``harness run`` output folder and the shares of its wall time
    of the cases that ran (see the module docstring)."""
    doc = json.loads((out_dir / "plan.json").read_text(encoding="utf-8"))
    nodeids = [c[0] for c in doc["cases"]]
    # The JUnit names carry the run's --junit-prefix (summary.json records it).
    summary = out_dir / "summary.json"
    prefix = (
        json.loads(summary.read_text(encoding="utf-8")).get("junit_prefix", "")
        if summary.is_file()
        else ""
    )
    # Only cases pytest reported have a share (a case absent from the JUnit has none).
    shares = report.read_junit([out_dir / "junit.xml"], wall_shares=True)
    keys = {n: report.junit_key(n, prefix) for n in nodeids}
    return doc["suite"], {n: shares[k].seconds for n, k in keys.items() if k in shares}


def main(argv: Sequence[str] | None = None) -> int:
    """Refresh the durations files from the given artifact folders; the exit code."""
    p = argparse.ArgumentParser(prog="refresh_durations", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="downloaded CI artifacts")
    p.add_argument(
        "--root", type=Path, default=None, help="repository root (default: found from here)"
    )
    p.add_argument(
        "--prune", action="store_true", help="drop node ids the suite no longer collects"
    )
    args = p.parse_args(argv)
    root = (args.root or find_root()).resolve()
    found: dict[str, dict[str, float]] = {}
    for d in args.dirs:
        if not d.is_dir():
            p.error(f"{d}: not a folder")
        for plan_file in sorted(d.rglob("plan.json")):
            suite, seconds = passed_seconds(plan_file.parent)
            found.setdefault(suite, {}).update(seconds)
            print(f"{plan_file.parent}: {suite}: {len(seconds)} case(s) ran")
    if not found:
        print(
            "refresh_durations: no `harness run` output (plan.json + junit.xml) under "
            + ", ".join(map(str, args.dirs)),
            file=sys.stderr,
        )
        return 1
    for suite, seconds in sorted(found.items()):
        path = default_durations_path(root, suite)
        write_durations(path, suite, seconds)
        if args.prune:
            inv = build_inventory(root, [suite], check_ownership=False)
            keep = {c.nodeid for c, _ in inv.suite_cases(suite)}
            merged = load_durations(path)
            path.unlink()
            write_durations(path, suite, {k: v for k, v in merged.items() if k in keep})
        print(
            f"{path.relative_to(root)}: {len(load_durations(path))} case(s), {len(seconds)} refreshed"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
