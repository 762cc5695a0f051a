"""``harness durations OUT_DIR...``: fold the case durations runs recorded into
``suites/durations/<suite>.json``, which the planner balances shards on.

Each argument is searched recursively for ``harness run`` output folders (``plan.json`` next
to ``junit.xml``). A figure is a case's share of the wall time of the pytest run that ran it:
its JUnit seconds scaled so that the cases of one ``<testsuite>`` add up to the run's wall
time (xdist workers run side by side, and every run pays start-up and collection), for every
case pytest reported, failed and skipped ones included; not for the cases ``harness run``
added for pytest (not run, never collected, in a pytest that was killed). Figures are merged:
cases absent from the runs keep theirs; ``prune`` drops node ids the suite no longer has.

Shares depend on the load and runner a case ran under, so a run records its **context**
(``summary.json``: runner class, xdist workers, CPUs, cards) and the durations file the
contexts of the runs it was refreshed from (``recorded_with``); a refresh from a run whose
context differs from every recorded one says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from harness.errors import HarnessError
from harness.suites import report
from harness.suites.manifest import ManifestError, read_json, rel
from harness.suites.plan import default_durations_path, load_durations, write_durations


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
    returns what was done, one line each, notes on runs of a different context included.
    Raises ``DurationsError`` when no ``harness run`` output is found, ``PlanError`` when a
    durations file cannot be read."""
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
        path = default_durations_path(root, suite)
        before = _recorded_contexts(path)
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
        keep = _suite_cases(root, suite) if prune else None
        write_durations(path, suite, seconds, contexts=contexts, keep=keep)
        total = len(load_durations(path))
        lines.append(f"{rel(path, root)}: {total} case(s), {len(seconds)} refreshed")
    return lines


def _recorded_contexts(path: Path) -> list[dict[str, Any]]:
    try:
        doc = read_json(path, path.parent) if path.is_file() else {}
    except ManifestError:
        return []
    found = doc.get("recorded_with") if isinstance(doc, dict) else None
    return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []


def _suite_cases(root: Path, suite: str) -> set[str]:
    from harness.suites.inventory import build_inventory

    inv = build_inventory(root, [suite], check_ownership=False)
    return {c.nodeid for c, _ in inv.suite_cases(suite)}
