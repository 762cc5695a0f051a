"""Shard planning: partition a suite's cases onto CI runners, balanced by duration.

Durations come from a recorded file (``suites/durations/<suite>.json`` when checked in),
else the median recorded duration of the case's entry, else the entry's ``estimated_s``.
Cases are placed longest-first, each on the least-loaded shard whose runner has the cards
it needs (LPT: the longest shard stays within ``mean + longest case``). The partition for
``N`` shards is a pure function of the cases, their durations and ``N``: every shard job
of a CI matrix recomputes it and picks its own shard.
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

DURATIONS_DIR = "durations"
#: Minutes a CI job gets beyond its runner's ``timeout_minutes``, where ``harness run``
#: stops pytest and still writes its summary: checkout, install and artifact upload.
JOB_SETUP_MINUTES = 10


class PlanError(HarnessError, ValueError):
    """The suite cannot be planned as asked (the message says what to change)."""


@dataclass(frozen=True)
class PlannedCase:
    """A case as the planner sees it: its entry, cards and expected seconds.

    ``basis`` says where ``seconds`` came from: ``recorded``, ``entry-median``
    or ``estimated``.
    """

    nodeid: str
    entry: str
    cards: int
    seconds: float
    basis: str = "estimated"
    #: nodes the case runs on (``LaunchSpec.nnodes``): its runner must provide them
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
        """Planned case seconds."""
        return sum(c.seconds for c in self.cases)

    @property
    def label(self) -> str:
        """``I/N``, as ``harness run --shard`` takes it."""
        return f"{self.index}/{self.total}"


@dataclass
class Plan:
    """A suite's shards in order; ``warnings``: why the plan may not fit its runners (a shard
    count the caller chose that puts shards over their runner's budget)."""

    suite: str
    shards: list[PlannedShard]
    warnings: list[str] = field(default_factory=list)

    def shard(self, index: int) -> PlannedShard:
        """Shard ``index`` (1-based); ``PlanError`` when out of range."""
        if not 1 <= index <= len(self.shards):
            raise PlanError(f"shard {index} does not exist; the plan has {len(self.shards)}")
        return self.shards[index - 1]

    def balance(self) -> float:
        """Longest shard load over the mean shard load (1.0 is perfect; 1.0 when empty)."""
        loads = [s.load for s in self.shards]
        mean = sum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean > 0 else 1.0

    def matrix(self, entries: Collection[str] | None = None) -> dict[str, Any]:
        """The GitHub Actions matrix: ``{"include": [{"suite", "shard", "runner", ...}]}``.

        With ``entries`` (the ids a change selects), only the shards holding a case of one of
        them, each counting those cases; their labels stay ``I/N`` of the whole plan, as
        ``harness run --shard I/N --changed-from REF`` cuts them. ``{"include": []}`` when no
        shard is left: a matrix job guarded by ``if:`` on it is skipped.
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


# --------------------------------------------------------------------------- durations


def default_durations_path(root: Path, suite: str) -> Path:
    """Where a suite's checked-in durations live: ``suites/durations/<suite>.json``."""
    return root / SUITES_DIR / DURATIONS_DIR / f"{suite}.json"


def load_durations(path: Path | None, *, required: bool = False) -> dict[str, float]:
    """Recorded seconds per node id from ``{"durations": {nodeid: s}}`` (or a bare
    mapping). A missing file is empty unless ``required`` (a file the user named), then a
    ``PlanError``; a malformed one raises ``PlanError`` naming it."""
    if path is None or not path.is_file():
        if required and path is not None:
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
    """Merge ``durations`` into the file at ``path`` (created if absent), atomically.

    Node ids already in the file and absent from ``durations`` are kept, so
    shards of one suite can record into the same file in turn; with ``keep``, only
    those of its node ids. ``contexts``: the runs' contexts the figures now come from
    (``recorded_with``, see :mod:`harness.suites.durations`); ``None`` keeps the file's.
    """
    try:
        merged = load_durations(path)
        doc = read_json(path, path.parent) if path.is_file() else {}
    except (PlanError, ManifestError):
        merged, doc = {}, {}  # a corrupt file is replaced by fresh measurements
    merged.update({k: round(float(v), 3) for k, v in durations.items()})
    if keep is not None:
        merged = {k: v for k, v in merged.items() if k in keep}
    out: dict[str, Any] = {"suite": suite, "durations": dict(sorted(merged.items()))}
    recorded = contexts if contexts is not None else (doc or {}).get("recorded_with")
    if recorded:
        out["recorded_with"] = [dict(c) for c in recorded]
    write_json(path, out)


def estimate(
    cases: Sequence[tuple[str, str, int, float]], durations: Mapping[str, float]
) -> list[PlannedCase]:
    """Expected seconds of each ``(nodeid, entry id, cards, entry estimated_s)``.

    A recorded duration wins; a case without one gets the median recorded
    duration of its entry's cases when the entry has any (hand estimates
    drift), else the entry's ``estimated_s``.
    """
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


# --------------------------------------------------------------------------- partition


def _fits(runner: Runner, case: PlannedCase) -> bool:
    return runner.cards >= case.cards and runner.nodes >= case.nodes


def _fit(runners: Sequence[Runner], case: PlannedCase) -> int:
    for i, r in enumerate(runners):
        if _fits(r, case):
            return i
    raise PlanError(
        f"a case needs {case.cards} card(s) and {case.nodes} node(s); no runner "
        f"({', '.join(r.name for r in runners)}) has that many"
    )


def _allocate(work: list[float], shards: int) -> list[int]:
    """Shards per runner class: every class with work gets one, the rest go where
    work per shard is highest. Classes beyond ``shards`` hand their work up to
    the next larger class (larger runners can run smaller cases)."""
    work = list(work)
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
    """Split ``cases`` into ``shards`` shards over the runner classes (ascending cards).

    Longest case first, each onto the least-loaded shard whose runner has
    enough cards (ties: the smaller runner, then the lower index). Raises
    ``PlanError`` when a case fits no runner.
    """
    shards = check_int(shards, "the number of shards", minimum=1, error=PlanError)
    runners = sorted(runners, key=lambda r: r.cards)
    work = [0.0] * len(runners)
    for c in cases:
        work[_fit(runners, c)] += c.seconds or 1e-9
    counts = _allocate(work, shards)
    classes = [r for r, n in zip(runners, counts, strict=True) for _ in range(n)]
    out = [PlannedShard(i, shards, r) for i, r in enumerate(classes, 1)]
    loads = [0.0] * len(out)
    for c in sorted(cases, key=lambda c: (-c.seconds, -c.cards, c.nodeid)):
        eligible = [i for i, s in enumerate(out) if _fits(s.runner, c)]
        if not eligible:
            raise PlanError(
                f"{c.nodeid} needs {c.cards} card(s) and {c.nodes} node(s); "
                "no shard's runner has that many"
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
    """Plan ``suite`` onto its runner classes.

    ``shards``: exactly that many shards. ``target_minutes`` (not with ``shards``; a
    positive finite number, as the command line checks): the fewest shards whose every
    shard stays within the target (and the runner's budget).
    Neither: the fewest shards within each runner's budget (``budget_minutes``,
    by default 75% of the job timeout). With ``enforce_budget``, a case longer
    than its runner's budget or a shard over budget raises ``PlanError``
    naming it; but with ``shards`` a shard over budget is planned as asked (the
    count is the caller's to choose) and named in :attr:`Plan.warnings`.
    An empty suite still gets one (empty) shard, so a CI matrix is never empty.
    """
    runners = sorted(runners, key=lambda r: r.cards)
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
            # The count the caller asked for is theirs to choose (a runner pool's size):
            # planned as asked, and said to be over budget.
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
    # The fewest shards each within its runner's budget and the target.
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
    """The plan of one suite: ``owned`` (its cases with their entries) estimated from the
    recorded ``durations`` (default: :func:`default_durations_path`, empty when absent; a
    file named here must exist) and partitioned by :func:`plan`. ``harness matrix`` and
    ``harness run --shard I/N`` both plan with it, so a job runs the shard that was planned.
    More shards than cases is a ``PlanError`` (they would only add empty jobs)."""
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
