"""Shard planning: partition a suite's cases onto CI runners, balanced by recorded durations
(longest case first onto the least-loaded shard that fits it). The partition is a pure function
of the cases, their durations and the shard count: every shard job recomputes it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.errors import HarnessError
from harness.jsonio import write_json
from harness.suites.manifest import SUITES_DIR, Manifest, ManifestError, Runner, read_json
from harness.validation import check_int, is_finite

if TYPE_CHECKING:
    from harness.suites.inventory import CollectedCase
    from harness.suites.manifest import Entry

#: Minutes a CI job gets beyond its runner's ``timeout_minutes``, where ``harness run``
#: stops pytest and still writes its summary: checkout, install and artifact upload.
JOB_SETUP_MINUTES = 10


class PlanError(HarnessError, ValueError):
    """The suite cannot be planned as asked (the message says what to change)."""


@dataclass(frozen=True)
class PlannedCase:
    """A case as the planner sees it: its entry, cards, expected ``seconds`` (``basis``: from
    ``recorded``, ``entry-median`` or ``estimated``) and ``nodes`` (its runner's at least)."""

    nodeid: str
    entry: str
    cards: int
    seconds: float
    basis: str = "estimated"
    nodes: int = 1


@dataclass
class PlannedShard:
    """One CI job's share of a suite: 1-based ``index`` of ``total`` on ``runner``."""

    index: int
    total: int
    runner: Runner
    cases: list[PlannedCase] = field(default_factory=list)

    @property
    def load(self) -> float:
        return sum(c.seconds for c in self.cases)

    @property
    def label(self) -> str:
        """``I/N``, as ``harness run --shard`` takes it."""
        return f"{self.index}/{self.total}"


@dataclass
class Plan:
    """A suite's shards in order; ``warnings``: shards a caller-chosen count put over budget."""

    suite: str
    shards: list[PlannedShard]
    warnings: list[str] = field(default_factory=list)

    def shard(self, index: int) -> PlannedShard:
        """Shard ``index`` (1-based, as :func:`parse_shard` checked it against the count)."""
        return self.shards[index - 1]

    def balance(self) -> float:
        """Longest shard load over the mean shard load (1.0 is perfect, and when all are empty)."""
        loads = [s.load for s in self.shards]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def matrix(self, entries: Collection[str] | None = None) -> dict[str, Any]:
        """The GitHub Actions matrix: ``{"include": [{"suite", "shard", "runner", ...}]}``.
        With ``entries`` (the ids a change selects), only the shards holding their cases, each
        counting those; labels stay ``I/N`` of the whole plan (``{"include": []}``: none left).
        """
        rows = []
        for s in self.shards:
            mine = s.cases if entries is None else [c for c in s.cases if c.entry in entries]
            if entries is not None and not mine:
                continue
            rows.append(
                {
                    "suite": self.suite,
                    "shard": s.label,
                    "runner": list(s.runner.labels),
                    "runner_name": s.runner.name,
                    "cards": s.runner.cards,
                    "nodes": max((c.nodes for c in mine), default=1),
                    "timeout_minutes": s.runner.timeout_minutes,
                    "job_timeout_minutes": s.runner.timeout_minutes + JOB_SETUP_MINUTES,
                    "cases": len(mine),
                    "estimated_minutes": round(sum(c.seconds for c in mine) / 60.0, 1),
                }
            )
        return {"include": rows}


def parse_shard(text: str) -> tuple[int, int]:
    """Parse ``I/N``, two decimal integers with ``1 <= I <= N``; ``PlanError`` otherwise
    (an empty string included: it never means "the whole suite")."""
    match = re.fullmatch(r"([0-9]+)/([0-9]+)", text)
    if match is None:
        raise PlanError(f"--shard takes I/N, e.g. 2/4; got {text!r}")
    i, n = int(match[1]), int(match[2])
    if not 1 <= i <= n:
        raise PlanError(f"--shard {text}: need 1 <= I <= N")
    return i, n


def default_durations_path(root: Path, suite: str) -> Path:
    """Where a suite's checked-in durations live: ``suites/durations/<suite>.json``."""
    return root / SUITES_DIR / "durations" / f"{suite}.json"


def load_durations(path: Path, *, required: bool = False) -> dict[str, float]:
    """Recorded seconds per node id from ``{"durations": {nodeid: s}}`` (or a bare mapping).
    A missing file is empty unless ``required``; missing then, or malformed: ``PlanError``."""
    if not path.is_file():
        if required:
            raise PlanError(f"{path}: no such durations file")
        return {}
    try:
        doc = read_json(path, path.parent)
    except ManifestError as e:
        raise PlanError(f"{path}: cannot read durations: {e}") from e
    data = doc.get("durations", doc) if isinstance(doc, dict) else None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and is_finite(v) and v >= 0 for k, v in data.items()
    ):
        raise PlanError(
            f'{path}: expected {{"durations": {{"<nodeid>": <finite seconds >= 0>, ...}}}}'
        )
    return {k: float(v) for k, v in data.items()}


def write_durations(
    path: Path,
    suite: str,
    durations: Mapping[str, float],
    *,
    contexts: Sequence[Mapping[str, Any]] | None = None,
    keep: Collection[str] | None = None,
) -> None:
    """Merge ``durations`` into the file at ``path`` (created, or replaced when corrupt),
    atomically: its other node ids are kept (with ``keep``, only those in it). ``contexts``:
    the runs' contexts the figures now come from (``recorded_with``); ``None`` keeps the file's.
    """
    try:
        merged = load_durations(path)
    except PlanError:
        merged = {}
    merged.update({k: round(float(v), 3) for k, v in durations.items()})
    if keep is not None:
        merged = {k: v for k, v in merged.items() if k in keep}
    out: dict[str, Any] = {"suite": suite, "durations": dict(sorted(merged.items()))}
    recorded = recorded_contexts(path) if contexts is None else contexts
    if recorded:
        out["recorded_with"] = [dict(c) for c in recorded]
    write_json(path, out)


def recorded_contexts(path: Path) -> list[dict[str, Any]]:
    """The run contexts (``recorded_with``) of the durations file at ``path``; ``[]`` when it
    has none or cannot be read."""
    try:
        doc = read_json(path, path.parent) if path.is_file() else {}
    except ManifestError:
        return []
    found = doc.get("recorded_with") if isinstance(doc, dict) else None
    return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []


def estimate(
    cases: Sequence[tuple[str, str, int, float]], durations: Mapping[str, float]
) -> list[PlannedCase]:
    """Expected seconds of each ``(nodeid, entry id, cards, entry estimated_s)``: its recorded
    duration, else the median recorded one of its entry (hand estimates drift), else the
    entry's ``estimated_s``."""
    per_entry: dict[str, list[float]] = {}
    for nodeid, entry, _, _ in cases:
        if nodeid in durations:
            per_entry.setdefault(entry, []).append(durations[nodeid])
    out = []
    for nodeid, entry, cards, estimated in cases:
        if nodeid in durations:
            seconds, basis = durations[nodeid], "recorded"
        elif per_entry.get(entry):
            seconds, basis = statistics.median(per_entry[entry]), "entry-median"
        else:
            seconds, basis = float(estimated), "estimated"
        out.append(PlannedCase(nodeid, entry, cards, seconds, basis))
    return out


def _fits(runner: Runner, case: PlannedCase) -> bool:
    return runner.cards >= case.cards and runner.nodes >= case.nodes


def _allocate(work: list[float], shards: int) -> list[int]:
    """Shards per runner class: one per class with work, the rest where work per shard is
    highest; classes beyond ``shards`` hand their work up to the next larger class."""
    needed = [i for i, w in enumerate(work) if w > 0]
    while len(needed) > shards:
        small = needed.pop(0)
        work[needed[0]] += work[small]
        work[small] = 0.0
    counts = [1 if w > 0 else 0 for w in work]
    if not needed:
        counts[0] = 1
    for _ in range(shards - sum(counts)):
        best = max(range(len(work)), key=lambda i: (work[i] / counts[i] if counts[i] else -1.0, -i))
        counts[best] += 1
    return counts


def partition(
    cases: Sequence[PlannedCase], runners: Sequence[Runner], shards: int
) -> list[PlannedShard]:
    """Split ``cases`` into ``shards`` shards over the runner classes: longest case first, each
    onto the least-loaded shard whose runner fits it (ties: the smaller runner, then the lower
    index). Raises ``PlanError`` when a case fits no runner."""
    shards = check_int(shards, "the number of shards", minimum=1, error=PlanError)
    runners = sorted(runners, key=lambda r: r.cards)
    work = [0.0] * len(runners)
    for c in cases:
        fit = next((i for i, r in enumerate(runners) if _fits(r, c)), None)
        if fit is not None:  # a case no runner fits is refused below
            work[fit] += c.seconds or 1e-9
    counts = _allocate(work, shards)
    classes = [r for r, n in zip(runners, counts, strict=True) for _ in range(n)]
    out = [PlannedShard(i, shards, r) for i, r in enumerate(classes, 1)]
    loads = [0.0] * len(out)
    for c in sorted(cases, key=lambda c: (-c.seconds, -c.cards, c.nodeid)):
        eligible = [i for i, s in enumerate(out) if _fits(s.runner, c)]
        if not eligible:
            raise PlanError(
                f"{c.nodeid} needs {c.cards} card(s) and {c.nodes} node(s); no runner of the "
                f"plan ({', '.join(sorted({s.runner.name for s in out}))}) has that many"
            )
        best = min(eligible, key=lambda i: (loads[i], out[i].runner.cards, i))
        out[best].cases.append(c)
        loads[best] += c.seconds
    return out


def plan(
    suite: str,
    runners: Sequence[Runner],
    cases: Sequence[PlannedCase],
    *,
    shards: int | None = None,
    target_minutes: float | None = None,
    enforce_budget: bool = True,
) -> Plan:
    """Plan ``suite`` onto its runner classes: exactly ``shards`` shards, else the fewest whose
    every shard stays within ``target_minutes`` (positive, finite) and its runner's budget.
    With ``enforce_budget``, a case over its runner's budget, or a shard over budget where
    the count was not given, raises ``PlanError`` naming it; a given count over budget is
    planned as asked and named in :attr:`Plan.warnings`. An empty suite gets one empty shard.
    """
    limit = target_minutes * 60.0 if target_minutes is not None else math.inf
    for c in cases if enforce_budget else ():
        eligible = [r.budget_s for r in runners if _fits(r, c)]
        if eligible and c.seconds > max(eligible):
            raise PlanError(
                f"{c.nodeid} is expected to take {c.seconds / 60:.1f} min, over the shard budget of "
                f"{max(eligible) / 60:.1f} min; split the case or raise the runner's timeout_minutes / budget_minutes"
            )
    for c in cases:
        if c.seconds > limit:
            raise PlanError(
                f"{c.nodeid} alone takes {c.seconds / 60:.1f} min, over --target-minutes {target_minutes}"
            )

    def over(result: list[PlannedShard]) -> list[PlannedShard]:
        return [s for s in result if s.load > min(s.runner.budget_s, limit)]

    if shards is not None:
        result = partition(cases, runners, shards)
        warnings = []
        if enforce_budget and over(result):
            warnings.append(
                "; ".join(
                    f"shard {s.label} is planned at {s.load / 60:.1f} min, over the "
                    f"{s.runner.budget_minutes:.1f}-min budget of runner {s.runner.name} "
                    f"(timeout {s.runner.timeout_minutes} min)"
                    for s in over(result)
                )
                + "; more shards would fit"
            )
        return Plan(suite, result, warnings)
    cap = min(limit, max(r.budget_s for r in runners))
    n = max(1, math.ceil(sum(c.seconds for c in cases) / cap) if cap > 0 else 1)
    while over(result := partition(cases, runners, n)) and n < max(1, len(cases)):
        n += 1
    if enforce_budget and over(result):
        raise PlanError(f"cannot fit suite {suite} within the budget even with one case per shard")
    return Plan(suite, result)


def plan_suite(
    root: Path,
    manifest: Manifest,
    owned: Sequence[tuple[CollectedCase, Entry]],
    *,
    durations: Path | None = None,
    shards: int | None = None,
    target_minutes: float | None = None,
) -> Plan:
    """The plan of one suite (``harness matrix`` and ``harness run --shard`` alike): ``owned``
    (its cases with their entries) estimated from ``durations`` (a file that must exist;
    default: :func:`default_durations_path`, if present) and planned by :func:`plan`. More
    shards than cases is a ``PlanError``."""
    if shards is not None and shards > max(1, len(owned)):
        raise PlanError(
            f"{shards} shards for suite {manifest.suite!r} of {len(owned)} case(s): "
            f"at most {max(1, len(owned))} (one case per shard)"
        )
    recorded = load_durations(
        durations or default_durations_path(root, manifest.suite), required=durations is not None
    )
    nodes = {c.nodeid: c.nnodes for c, _ in owned}
    planned = [
        dataclasses.replace(p, nodes=nodes[p.nodeid])
        for p in estimate([(c.nodeid, e.id, c.cards, e.estimated_s) for c, e in owned], recorded)
    ]
    return plan(
        manifest.suite, manifest.runners, planned, shards=shards, target_minutes=target_minutes
    )
