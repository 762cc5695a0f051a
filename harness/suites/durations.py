"""``harness durations OUT_DIR...``: fold the case durations runs recorded into
``suites/durations/<suite>.json``, which the planner balances shards on.

Each argument is a folder, searched recursively for the output folders of ``harness run``
(``plan.json`` next to ``junit.xml``; a CI run's downloaded artifacts): the suite comes from
``plan.json``, each planned case's seconds from the JUnit XML (every case pytest reported,
failed and skipped ones included: they took that share of the run too; not the cases
``harness run`` adds for pytest: not run after ``-x`` or an interrupt, never collected, or
in a pytest that was killed). Figures are merged into the durations file: cases absent from
the runs keep theirs; ``prune`` drops node ids the suite no longer has.

What is recorded is each case's share of the wall time of the pytest run that ran it: its
JUnit seconds scaled so that the cases of one ``<testsuite>`` add up to its ``time`` (the
run's wall time). xdist workers run cases side by side and every run pays worker start-up
and collection; the planner adds these shares up into a shard's expected wall time, which is
what it compares with a runner's budget.

Shares depend on where and under what load a case ran, so a run records its **context**
(``summary.json``: the runner class, xdist workers, process slots and cards of its host) and
the durations file the contexts of the runs it was last refreshed from (``recorded_with``).
A refresh from a run whose context differs from every recorded one says so: its figures and
the file's were measured differently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.suites import report
from harness.suites.manifest import ManifestError, read_json
from harness.suites.plan import default_durations_path, load_durations, write_durations

#: The durations file's key for the contexts of the runs its figures came from.
RECORDED_WITH = "recorded_with"


class DurationsError(HarnessError):
    """Nothing to refresh from (no ``harness run`` output under the folders given)."""


@dataclass
class RunShares:
    """One ``harness run`` output folder: its suite, each case's share of its wall time, and
    the run's context (empty for a run that recorded none)."""

    folder: Path
    suite: str
    seconds: dict[str, float]
    context: dict[str, Any] = field(default_factory=dict)


def run_shares(out_dir: Path) -> RunShares:
    """The suite, the cases' shares of the wall time and the context of the ``harness run``
    whose output folder is ``out_dir`` (see the module docstring)."""
    doc = json.loads((out_dir / "plan.json").read_text(encoding="utf-8"))
    nodeids = [c[0] for c in doc["cases"]]
    summary_file = out_dir / "summary.json"
    summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {}
    # The JUnit names carry the run's --junit-prefix (summary.json records it).
    prefix = summary.get("junit_prefix", "")
    # Only cases pytest reported have a share (a case absent from the JUnit has none).
    shares = report.read_junit([out_dir / "junit.xml"], wall_shares=True)
    keys = {n: report.junit_key(n, prefix) for n in nodeids}
    seconds = {n: shares[k].seconds for n, k in keys.items() if k in shares}
    return RunShares(out_dir, doc["suite"], seconds, dict(summary.get("context") or {}))


def recorded_contexts(path: Path) -> list[dict[str, Any]]:
    """The contexts a durations file says its figures were recorded with (none: unknown)."""
    try:
        doc = read_json(path, path.parent) if path.is_file() else {}
    except ManifestError:
        return []
    found = doc.get(RECORDED_WITH) if isinstance(doc, dict) else None
    return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []


def describe(context: Mapping[str, Any]) -> str:
    """A context in words: ``runner gpu-4, 4 xdist workers, 16 CPUs, 4 cards``."""
    runner = context.get("runner")
    parts = [f"runner {runner}" if runner else "no runner class (unsharded)"]
    parts.append(f"{context.get('workers', '?')} xdist workers")
    parts.append(f"{context.get('cpus', '?')} CPUs")
    if context.get("cards"):
        parts.append(f"{context['cards']} cards")
    return ", ".join(parts)


def differs(run: Mapping[str, Any], recorded: Sequence[Mapping[str, Any]]) -> bool:
    """True when a run's context is known and equals none of the ``recorded`` ones (known too)."""
    return bool(run) and bool(recorded) and all(dict(run) != dict(r) for r in recorded)


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
    lines = []
    by_suite: dict[str, list[RunShares]] = {}
    for r in runs:
        by_suite.setdefault(r.suite, []).append(r)
        lines.append(f"{r.folder}: {r.suite}: {len(r.seconds)} case(s) ran")
    for suite, suite_runs in sorted(by_suite.items()):
        path = default_durations_path(root, suite)
        before = recorded_contexts(path)
        for r in suite_runs:
            if differs(r.context, before):
                lines.append(
                    f"note: {r.folder} ran with {describe(r.context)}; {_rel(path, root)} was "
                    f"recorded with {'; '.join(describe(c) for c in before)}: the refreshed "
                    "figures mix runs of a different load or runner"
                )
        seconds = {n: s for r in suite_runs for n, s in r.seconds.items()}
        contexts = _merged_contexts(before, [r.context for r in suite_runs if r.context])
        keep = _suite_cases(root, suite) if prune else None
        write_durations(path, suite, seconds, contexts=contexts, keep=keep)
        total = len(load_durations(path))
        lines.append(f"{_rel(path, root)}: {total} case(s), {len(seconds)} refreshed")
    return lines


def _merged_contexts(
    before: Sequence[Mapping[str, Any]], now: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The contexts after a refresh: this refresh's runs', and the earlier ones of runner
    classes it did not run on (their figures stay in the file)."""
    runners = {c.get("runner") for c in now}
    out = [dict(c) for c in before if c.get("runner") not in runners]
    for c in now:
        if dict(c) not in out:
            out.append(dict(c))
    return out


def _suite_cases(root: Path, suite: str) -> set[str]:
    from harness.suites.inventory import build_inventory

    inv = build_inventory(root, [suite], check_ownership=False)
    return {c.nodeid for c, _ in inv.suite_cases(suite)}


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)
