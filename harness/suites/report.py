"""Results of ``harness run``: each planned case's outcome, summarised per entry.

Outcomes (:data:`OUTCOMES`) come from the selection plugin's records of the pytest run
(:func:`results_from_records`). pytest's own JUnit file is completed with the planned cases
it lacks (:func:`complete_junit`); :func:`read_junit` reads JUnit back for tools that only
have the XML (``harness durations``, ``.ci/run``).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.jsonio import write_json
from harness.suites.selection import Records

if TYPE_CHECKING:
    from junitparser import TestSuite

OUTCOMES = (
    "passed", "failed", "skipped", "deselected", "not run", "missing", "flaky", "quarantined",
)  # fmt: skip


@dataclass(frozen=True)
class CaseRow:
    """What happened to one case: ``outcome`` in :data:`OUTCOMES`, JUnit seconds, first message line."""

    nodeid: str
    outcome: str
    seconds: float = 0.0
    message: str = ""


@dataclass(frozen=True)
class EntryRow:
    """One line of the summary table."""

    entry: str
    cases: int
    passed: int
    failed: int
    skipped: int
    missing: int
    cards: int
    seconds: float
    deselected: int = 0
    not_run: int = 0
    flaky: int = 0
    quarantined: int = 0


def junit_key(nodeid: str, prefix: str = "") -> tuple[str, str]:
    """The ``(classname, name)`` pytest's junitxml writes for ``nodeid`` under the
    ``--junit-prefix`` ``prefix`` (none by default)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    # As pytest joins them: an empty file part (a path outside its rootdir) stays, "".TestC.
    return ".".join([prefix, *names[:-1]] if prefix else names[:-1]), names[-1]


def _junit_suites(paths: Iterable[Path]) -> Iterator[TestSuite]:
    """Every ``<testsuite>`` of the readable JUnit files in ``paths``."""
    # Imported here: inventory, matrix and init work without junitparser.
    from junitparser import JUnitXml, TestSuite

    for p in paths:
        try:
            xml = JUnitXml.fromfile(str(p))
        except (OSError, ET.ParseError, ValueError):
            continue
        yield from [xml] if isinstance(xml, TestSuite) else xml


def read_junit(
    paths: Iterable[Path], *, wall_shares: bool = False
) -> dict[tuple[str, str], CaseRow]:
    """Outcome per ``(classname, name)`` from JUnit files; unreadable or absent files are skipped.

    ``failure`` or ``error`` anywhere in a testcase makes it failed, else ``skipped`` skipped.
    With ``wall_shares``, only the cases pytest reported (not :data:`UNREPORTED_SUITE`'s),
    each one's seconds scaled so that one ``<testsuite>``'s cases add up to its wall ``time``.
    """
    from junitparser import Error, Failure, Skipped

    out: dict[tuple[str, str], CaseRow] = {}
    for suite in _junit_suites(paths):
        if wall_shares and suite.name == UNREPORTED_SUITE:
            continue
        cases = list(suite)
        total = sum(tc.time or 0.0 for tc in cases)
        wall = float(suite.time or 0.0) if wall_shares else 0.0
        # Cases pytest timed at 0.000 s each (a few quick ones) share the wall equally.
        factor, even = (wall / total, 0.0) if total > 0 else (0.0, wall / max(1, len(cases)))
        for tc in cases:
            key = (tc.classname or "", tc.name or "")
            bad = [r for r in tc.result if isinstance(r, (Failure, Error))]
            skip = [r for r in tc.result if isinstance(r, Skipped)]
            outcome, msg = (
                ("failed", bad[0].message)
                if bad
                else ("skipped", skip[0].message)
                if skip
                else ("passed", "")
            )
            prev = out.get(key)
            own = tc.time or 0.0
            seconds = (own * factor + even if wall > 0 else own) + (prev.seconds if prev else 0.0)
            if prev is not None and prev.outcome == "failed":
                outcome, msg = prev.outcome, prev.message
            out[key] = CaseRow("", outcome, seconds, (msg or "").split("\n")[0][:200])
    return out


#: What :func:`_phases` returns for a case that started and never finished.
UNFINISHED = "unfinished"


def _phases(phases: Sequence[tuple[str, str, float, str]]) -> tuple[str, float, str]:
    """One case's outcome, seconds and message from its phases' reports: failed, else skipped,
    else passed (``flaky`` after a pytest-rerunfailures ``rerun``) when the last call and
    teardown passed, else :data:`UNFINISHED` with the phase it died in as its message."""
    seconds = sum(s for _, _, s, _ in phases)
    attempts = sum(when == "setup" for when, _, _, _ in phases)
    first = next((m for _, outcome, _, m in phases if outcome == "rerun"), None)
    for wanted in ("failed", "skipped"):
        for _, outcome, _, message in phases:
            if outcome == wanted:
                if first is not None and wanted == "failed":
                    message = f"{message} (failed all {attempts} attempts)"
                return wanted, seconds, message
    last = {when: outcome for when, outcome, _, _ in phases}
    if last.get("call") == "passed" and last.get("teardown") == "passed":
        if first is not None:
            return "flaky", seconds, f"passed on attempt {attempts}; first failure: {first}"
        return "passed", seconds, ""
    return UNFINISHED, seconds, "teardown" if "call" in last else "call"


def _collect_problem(nodeid: str, collect: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The failed or skipped collection of ``nodeid``'s file (or a class above it), if any."""
    for prefix in [
        nodeid.split("::", 1)[0],
        *(nodeid[:i] for i in range(len(nodeid)) if nodeid.startswith("::", i)),
    ]:
        if prefix in collect:
            return collect[prefix]
    return None


def results_from_records(
    nodeids: Iterable[str], records: Records, halted: str = ""
) -> dict[str, CaseRow]:
    """Each planned node id's result from one pytest run's records.

    ``halted``: why ``harness run`` stopped that pytest itself (``""``: it did not). A case
    that started and never finished is ``not run`` when the run was stopped, else ``failed``.
    """
    opts = records.options
    outcomes = [_phases(phases)[0] for phases in records.reports.values()]
    failures = outcomes.count("failed")
    maxfail = int(opts.get("maxfail", 0) or 0)
    # pytest.exit inside a case stopped the run there, as -x does.
    exited_in_a_case = UNFINISHED in outcomes and bool(records.interrupted)
    stopped = any((halted, records.interrupted, records.stopped, opts.get("collectonly"))) or (
        opts.get("setuponly") or 0 < maxfail <= failures or records.finish == 2
    )
    why_stopped = (
        halted
        or records.stopped
        or ("--setup-only" if opts.get("setuponly") else "")
        or (f"{records.interrupted} during a case" if exited_in_a_case else "")
        or records.interrupted
    )
    out = {}
    for n in nodeids:
        if n in records.reports:
            outcome, seconds, message = _phases(records.reports[n])
            if outcome != UNFINISHED:
                out[n] = CaseRow(n, outcome, seconds, message)
            elif opts.get("setuponly") and not halted:
                out[n] = CaseRow(n, "not run", 0.0, "set up, never called (--setup-only)")
            elif stopped:
                why = f" ({why_stopped})" if why_stopped else ""
                out[n] = CaseRow(n, "not run", 0.0, f"the run stopped during its {message}{why}")
            else:  # its process died, or an xdist worker could not send its report
                how = (
                    "its pytest process died during"
                    if records.finish is None
                    else f"pytest ended (exit status {records.finish}) without reporting"
                )
                out[n] = CaseRow(n, "failed", seconds, f"{how} its {message}")
        elif n in records.deselected:
            out[n] = CaseRow(n, "deselected")
        elif (broken := _collect_problem(n, records.collect)) is not None:
            out[n] = CaseRow(n, broken[0], 0.0, broken[1])
        elif stopped and (n in records.collected or not records.collected):
            out[n] = CaseRow(n, "not run", 0.0, why_stopped)
        else:
            why = "collected, never reported" if n in records.collected else "never collected"
            out[n] = CaseRow(n, "missing", 0.0, why)
    return out


#: The name of the ``<testsuite>`` :func:`complete_junit` adds for the cases pytest did not report.
UNREPORTED_SUITE = "harness run"


def complete_junit(
    junit: Path,
    rows: Iterable[CaseRow],
    prefix: str = "",
    aliases: Mapping[str, Iterable[str]] | None = None,
) -> None:
    """Complete pytest's JUnit file ``junit`` (written anew when pytest left none) with the
    non-deselected cases of ``rows`` it lacks, in a :data:`UNREPORTED_SUITE` ``<testsuite>``,
    named as pytest names them under ``--junit-prefix`` ``prefix`` (``aliases``: pytest's
    node id -> the case ids it names, where they differ)."""
    from junitparser import Error, Failure, JUnitXml, Skipped, TestCase, TestSuite

    children = {
        "failed": Failure,
        "quarantined": Failure,
        "missing": Error,
        "not run": Skipped,
        "skipped": Skipped,
    }

    xml = JUnitXml()
    for suite in _junit_suites([junit]):
        xml.add_testsuite(suite)
    held = set(read_junit([junit]))
    aliased = {
        cid for n, cids in (aliases or {}).items() if junit_key(n, prefix) in held for cid in cids
    }
    lacking = [
        r
        for r in rows
        if r.outcome != "deselected"
        and junit_key(r.nodeid, prefix) not in held
        and r.nodeid not in aliased
    ]
    if lacking:
        suite = TestSuite(UNREPORTED_SUITE)
        for row in lacking:
            classname, name = junit_key(row.nodeid, prefix)
            case = TestCase(_xml_text(name), _xml_text(classname), row.seconds)
            child = children.get(row.outcome)
            if child is not None:
                case.result = [child(_xml_text(f"{row.outcome}: {row.message}".rstrip(": ")))]
            suite.add_testcase(case)
        suite.update_statistics()
        xml.add_testsuite(suite)
    for attr in ("tests", "failures", "errors", "skipped"):
        setattr(xml, attr, sum(int(getattr(s, attr) or 0) for s in xml))
    junit.parent.mkdir(parents=True, exist_ok=True)
    xml.write(str(junit))


#: Characters XML 1.0 cannot hold (and DEL), as pytest's junitxml leaves them out.
_NOT_XML = re.compile(
    "[^\u0009\u000a\u000d\u0020-\u007e\u0080-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
)


def _xml_text(text: str) -> str:
    """``text`` with each character XML cannot hold written as ``#xHH`` (as pytest does)."""
    return _NOT_XML.sub(lambda m: f"#x{ord(m.group()):02X}", text)


def quarantine(results: Mapping[str, CaseRow], reasons: Mapping[str, str]) -> dict[str, CaseRow]:
    """``results`` with each failed case of a quarantined entry (``reasons``: node id -> the
    quarantine's reason) reported ``quarantined``, which does not make the run red."""
    out = dict(results)
    for n, r in results.items():
        if r.outcome == "failed" and n in reasons:
            out[n] = CaseRow(n, "quarantined", r.seconds, f"{r.message} [{reasons[n]}]")
    return out


def summarize(
    planned: Sequence[tuple[str, str, int]], results: Mapping[str, CaseRow]
) -> list[EntryRow]:
    """Per-entry rows, in first-seen entry order, from ``(nodeid, entry id, cards)`` and results."""
    rows: dict[str, dict[str, float]] = {}
    for nodeid, entry, cards in planned:
        r = rows.setdefault(entry, dict.fromkeys(("cases", "cards", "seconds", *OUTCOMES), 0))
        res = results.get(nodeid, CaseRow(nodeid, "missing"))
        r["cases"] += 1
        r[res.outcome] += 1
        r["cards"] = max(r["cards"], cards)
        r["seconds"] += res.seconds
    return [_row(e, r) for e, r in rows.items()]


def _row(entry: str, r: Mapping[str, float]) -> EntryRow:
    counts = {k.replace(" ", "_"): int(v) for k, v in r.items() if k != "seconds"}
    return EntryRow(entry, seconds=round(r["seconds"], 2), **counts)


def totals(rows: Sequence[EntryRow]) -> EntryRow:
    """The sum of ``rows`` (cards: the most any entry needs)."""
    total = {
        k: sum(getattr(r, k.replace(" ", "_")) for r in rows)
        for k in ("cases", "seconds", *OUTCOMES)
    }
    return _row("total", {**total, "cards": max((r.cards for r in rows), default=0)})


def render(rows: Sequence[EntryRow], title: str, wall_s: float) -> str:
    """A Markdown table (readable as plain text too) with a total line."""
    columns = [f.name for f in fields(EntryRow)]
    cells = [[{"seconds": "time (s)"}.get(f, f.replace("_", " ")) for f in columns]] + [
        [f"{v:.1f}" if f == "seconds" else str(v) for f in columns for v in [getattr(r, f)]]
        for r in (*rows, totals(rows))
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]

    def line(c: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(x.rjust(w) if i else x.ljust(w) for i, x, w in zip(count(), c, widths))
            + " |"
        )

    sep = (
        "|"
        + "|".join("-" * (w + 1) + ":" if i else "-" * (w + 2) for i, w in enumerate(widths))
        + "|"
    )
    out = [f"### {title}", "", line(cells[0]), sep, *(line(c) for c in cells[1:])]
    out += ["", f"wall time {wall_s:.1f} s; time (s) is the sum of the cases' own durations."]
    return "\n".join(out) + "\n"


def failures(results: Mapping[str, CaseRow]) -> str:
    """The failed, missing, flaky and quarantined cases, one per line, for the log."""
    bad = [
        r for r in results.values() if r.outcome in ("failed", "missing", "flaky", "quarantined")
    ]
    return bullets(
        [f"{r.outcome}: `{r.nodeid}`" + (f" — {r.message}" if r.message else "") for r in bad]
    )


#: A case pytest collected under the paths given to it that the suite does not hold.
NOT_IN_SUITE = (
    "not in suite {suite}, not run: `{n}` (collected under the paths given to pytest; "
    "`harness inventory` says whether an entry of any suite owns it)"
)


def bullets(lines: Sequence[str]) -> str:
    """Markdown bullets of the first 30 of ``lines``, then "- ... and N more"."""
    limit = 30
    more = [f"... and {len(lines) - limit} more"] if len(lines) > limit else []
    return "".join(f"- {line}\n" for line in [*lines[:limit], *more])


def write_summary_json(
    path: Path,
    title: str,
    rows: Sequence[EntryRow],
    results: Mapping[str, CaseRow],
    junit_prefix: str = "",
    context: Mapping[str, Any] | None = None,
) -> None:
    """Machine-readable summary: the table rows, every case's result, the ``--junit-prefix``
    of its JUnit names and the run's ``context`` (runner, load: :mod:`harness.suites.durations`)."""
    doc = {
        "title": title,
        "entries": [asdict(r) for r in rows],
        "total": asdict(totals(rows)),
        "cases": [asdict(r) for r in results.values()],
        "junit_prefix": junit_prefix,
        "context": dict(context or {}),
    }
    write_json(path, doc)
