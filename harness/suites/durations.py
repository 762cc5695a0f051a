"""``harness durations OUT_DIR...``: fold each case's share of its run's wall time, from
``harness run`` output folders, into ``suites/durations/<suite>.json`` with the runs' contexts
(``recorded_with``); docs/suites.md, "Recorded durations", says what a figure is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from harness.errors import HarnessError
from harness.suites import plan, report
from harness.suites.inventory import build_inventory
from harness.suites.manifest import rel


class DurationsError(HarnessError):
    """Nothing to refresh from (no ``harness run`` output under the folders given)."""


class RunShares(NamedTuple):
    """One ``harness run`` output folder: its suite, each case's share of its wall time, and
    the run's context (empty for a run that recorded none)."""

    folder: Path
    suite: str
    seconds: dict[str, float]
    context: dict[str, Any]


def run_shares(out_dir: Path) -> RunShares:
    """What the ``harness run`` whose output folder is ``out_dir`` recorded."""
    doc = json.loads((out_dir / "plan.json").read_text(encoding="utf-8"))
    summary_file = out_dir / "summary.json"
    summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {}
    shares = report.read_junit([out_dir / "junit.xml"], wall_shares=True)
    # The JUnit names carry the run's --junit-prefix (summary.json records it).
    keys = {c[0]: report.junit_key(c[0], summary.get("junit_prefix", "")) for c in doc["cases"]}
    seconds = {n: shares[k].seconds for n, k in keys.items() if k in shares}
    return RunShares(out_dir, doc["suite"], seconds, dict(summary.get("context") or {}))


def describe(context: Mapping[str, Any]) -> str:
    """A context in words: ``runner gpu-4, 4 xdist workers, 16 CPUs, 4 cards``."""
    runner = context.get("runner")
    parts = [f"runner {runner}" if runner else "no runner class (unsharded)"]
    parts += [f"{context.get('workers', '?')} xdist workers", f"{context.get('cpus', '?')} CPUs"]
    return ", ".join(parts + [f"{context['cards']} cards"] * bool(context.get("cards")))


def refresh(root: Path, folders: Sequence[Path], *, prune: bool = False) -> list[str]:
    """Fold the runs under ``folders`` into their suites' durations files under ``root``;
    returns what was done, one line each (notes on runs of another context included).
    ``DurationsError``: no ``harness run`` output found; ``PlanError``: a file unreadable."""
    runs: list[RunShares] = []
    for d in folders:
        if not d.is_dir():
            raise DurationsError(f"{d}: not a folder")
        runs += [run_shares(p.parent) for p in sorted(d.rglob("plan.json"))]
    if not runs:
        where = ", ".join(map(str, folders))
        raise DurationsError(f"no `harness run` output (plan.json + junit.xml) under {where}")
    lines = [f"{r.folder}: {r.suite}: {len(r.seconds)} case(s) ran" for r in runs]
    for suite in sorted({r.suite for r in runs}):
        path = plan.default_durations_path(root, suite)
        before = plan.recorded_contexts(path)
        for r in [r for r in runs if r.suite == suite]:
            if r.context and before and r.context not in before:
                lines.append(
                    f"note: {r.folder} ran with {describe(r.context)}; {rel(path, root)} was "
                    f"recorded with {'; '.join(describe(c) for c in before)}: the refreshed "
                    "figures mix runs of a different load or runner"
                )
        # This refresh's contexts replace the earlier ones of the runner classes it ran on;
        # the others' figures stay in the file, and so do their contexts.
        now = [r.context for r in runs if r.suite == suite and r.context]
        contexts = [c for c in before if c.get("runner") not in {n.get("runner") for n in now}]
        for c in now:
            if c not in contexts:
                contexts.append(c)
        seconds = {n: s for r in runs if r.suite == suite for n, s in r.seconds.items()}
        keep = None
        if prune:
            inv = build_inventory(root, [suite], check_ownership=False)
            keep = {c.nodeid for c, _ in inv.suite_cases(suite)}
        plan.write_durations(path, suite, seconds, contexts=contexts, keep=keep)
        total = len(plan.load_durations(path))
        lines.append(f"{rel(path, root)}: {total} case(s), {len(seconds)} refreshed")
    return lines
