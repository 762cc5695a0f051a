"""SuiteInventory: which suite entry owns each test case, and whether every case fits its runner.

Cases are collected with pytest in-process (collect only) through a small
plugin object that records the items; nothing runs. Ownership rules:

- A suite owns the cases its entries match. A device-parametrized case (its
  ``device`` parameter, e.g. from ``harness.DEVICES``) and a launched case
  belong to the suite whose ``device`` equals the case's; the other suites'
  entries skip them silently when they match by path. A case an entry names
  by node id is owned whatever its device (and then checked against the suite).
- Within a suite, a case belongs to the *first* entry that matches it.

Rules (each problem names the rule, the file and the case):
``cpu-case-needs-cards``, ``accelerator-case-without-cards``, ``wrong-device``,
``case-exceeds-runner-cards``, ``unowned-file`` (a ``tests/**/test_*.py``
owned by no entry), ``unowned-case``, ``entry-matches-nothing``,
``duplicate-entry-id``, ``schema`` / ``json`` / ``path`` / ``include``
(manifest problems), ``collection-error`` and ``bad-launch-spec``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.spec import LaunchSpec, is_launched, spec_for_item
from harness.suites.manifest import (
    Entry,
    Manifest,
    Problem,
    has_glob,
    load_suites,
    path_matches,
    rel,
)

TESTS_GLOB = "tests/**/test_*.py"


@dataclass(frozen=True)
class CollectedCase:
    """One collected test case.

    ``nodeid`` is repository-relative (``tests/x/test_a.py::test_b[cuda]``);
    ``spec`` is ``None`` when the case's launch marker is invalid
    (``spec_error`` says why); ``marks`` are the names and keyword arguments of
    its markers, for ``-m`` expressions; ``device_param`` is the value of its
    ``device`` parameter, if any.
    """

    nodeid: str
    file: str
    spec: LaunchSpec | None
    launched: bool
    device_param: str | None
    marks: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    spec_error: str | None = None

    @property
    def device(self) -> str:
        """The device the case runs on (``cpu`` when its spec is invalid)."""
        return self.spec.device if self.spec else "cpu"

    @property
    def cards(self) -> int:
        """Cards the case needs."""
        return self.spec.cards if self.spec else 0

    @property
    def nproc(self) -> int:
        """Rank processes the case starts."""
        return self.spec.nproc if self.spec else 1


@dataclass
class SuiteInventory:
    """The outcome of :func:`build_inventory`.

    ``owners[nodeid]`` lists ``(suite, entry id)`` pairs; ``problems`` holds
    every rule violation found (empty: the inventory is clean).
    """

    root: Path
    manifests: dict[str, Manifest]
    cases: list[CollectedCase]
    owners: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def suite_cases(self, suite: str) -> list[tuple[CollectedCase, Entry]]:
        """The cases ``suite`` owns, each with its owning entry, in collection order."""
        m = self.manifests[suite]
        out = []
        for c in self.cases:
            for s, eid in self.owners.get(c.nodeid, ()):
                if s == suite:
                    out.append((c, m.entry(eid)))
        return out

    def as_dict(self, suites: Iterable[str] | None = None) -> dict[str, Any]:
        """JSON form ``{"cases": [...], "errors": [...]}``, limited to ``suites`` when given."""
        wanted = set(suites) if suites is not None else None
        cases = []
        for c in self.cases:
            owners = self.owners.get(c.nodeid, [])
            if wanted is not None and not any(s in wanted for s, _ in owners):
                continue
            cases.append(
                {
                    "nodeid": c.nodeid,
                    "device": c.device,
                    "nproc": c.nproc,
                    "cards": c.cards,
                    "launched": c.launched,
                    "entries": [f"{s}:{e}" for s, e in owners],
                }
            )
        return {"cases": cases, "errors": [p.as_dict() for p in self.problems]}


# --------------------------------------------------------------------------- collection


class _Recorder:
    """pytest plugin object: records collected items and collection errors."""

    def __init__(self, root: Path):
        self.root = root
        self.cases: list[CollectedCase] = []
        self.problems: list[Problem] = []

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            text = str(report.longrepr).strip().splitlines()
            last = text[-1] if text else "collection failed"
            self.problems.append(Problem("collection-error", report.nodeid or ".", "", last))

    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:
            self.cases.append(_case(item, self.root))


def case_id(item: Any, root: Path) -> str:
    """A collected item's node id relative to ``root`` (pytest's own is relative to its rootdir)."""
    path = rel(Path(str(item.path)), root)
    _, sep, tail = item.nodeid.partition("::")
    return f"{path}::{tail}" if sep else path


def _case(item: Any, root: Path) -> CollectedCase:
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("device") if callspec is not None else None
    marks = tuple(
        (m.name, tuple(sorted((k, v) for k, v in m.kwargs.items() if isinstance(v, (str, int, bool)) or v is None)))
        for m in item.iter_markers()
    )
    nodeid = case_id(item, root)
    try:
        spec, err = spec_for_item(item), None
    except (ValueError, TypeError) as e:
        spec, err = None, str(e)
    return CollectedCase(
        nodeid=nodeid,
        file=nodeid.split("::", 1)[0],
        spec=spec,
        launched=is_launched(item),
        device_param=param if isinstance(param, str) else None,
        marks=marks,
        spec_error=err,
    )


@contextlib.contextmanager
def _quiet() -> Any:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


def collect(root: Path, targets: Sequence[str]) -> tuple[list[CollectedCase], list[Problem]]:
    """Collect ``targets`` (repository-relative files or directories) with pytest,
    in-process and collect-only, using the repository's pytest configuration.

    Returns the cases and the collection problems (files that failed to import,
    or pytest itself failing, with the tail of its output).
    """
    import pytest

    if not targets:
        return [], []
    rec = _Recorder(root)
    args = [
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        f"--rootdir={root}",
    ]
    if importlib.util.find_spec("xdist") is not None:
        args += ["-n", "0"]  # never start workers just to collect
    args += [str(root / t) for t in targets]
    # The caller's PYTEST_ADDOPTS is for running tests (a --junitxml there
    # would be overwritten by an empty collect-only report): not for this.
    addopts = os.environ.pop("PYTEST_ADDOPTS", None)
    try:
        with _quiet() as out:
            code = pytest.main(args, plugins=[rec])
    finally:
        if addopts is not None:
            os.environ["PYTEST_ADDOPTS"] = addopts
    # 0: collected, 1: some collection error (recorded above), 5: nothing collected.
    if int(code) not in (0, 1, 5):
        tail = "\n".join(out.getvalue().strip().splitlines()[-15:])
        rec.problems.append(Problem("collection-error", ".", "", f"pytest exited with {int(code)}:\n{tail}"))
    return rec.cases, rec.problems


def _targets(root: Path, manifests: Iterable[Manifest], with_tests: bool) -> list[str]:
    """Minimal collection arguments covering the test files and every entry path."""
    paths: set[str] = set()
    if with_tests:
        paths.update(rel(p, root) for p in root.glob(TESTS_GLOB))
    for m in manifests:
        for e in m.entries:
            for p in e.paths:
                file_part = p.split("::", 1)[0]
                if has_glob(file_part):
                    paths.update(rel(x, root) for x in root.glob(file_part) if x.suffix == ".py" or x.is_dir())
                elif (root / file_part).exists():
                    paths.add(file_part)
    ordered = sorted(paths, key=lambda p: (p.count("/"), p))
    kept: list[str] = []
    for p in ordered:
        if p == "." or not any(path_matches(p, k) for k in kept):
            kept.append(p)
    return sorted(kept)


# --------------------------------------------------------------------------- matching


@functools.lru_cache(maxsize=256)
def _expression(expr: str) -> Any:
    from _pytest.mark.expression import Expression  # pytest's own -m language

    return Expression.compile(expr)


def _matches_markers(case: CollectedCase, expr: str) -> bool:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for name, kwargs in case.marks:
        by_name.setdefault(name, []).append(dict(kwargs))

    def matcher(name: str, /, **kwargs: Any) -> bool:
        return any(all(m.get(k, object()) == v for k, v in kwargs.items()) for m in by_name.get(name, ()))

    return _expression(expr).evaluate(matcher)


def _selector_matches(selector: str, case: CollectedCase) -> tuple[bool, bool]:
    """(matches, by node id) for one entry path."""
    if "::" in selector:
        hit = case.nodeid == selector or case.nodeid.startswith((selector + "::", selector + "["))
        return hit, hit
    return path_matches(case.file, selector), False


def _entry_matches(entry: Entry, case: CollectedCase, suite_device: str) -> bool:
    """True when ``entry`` (of a suite on ``suite_device``) selects ``case``."""
    by_path = by_id = False
    for sel in entry.paths:
        hit, explicit = _selector_matches(sel, case)
        by_id |= explicit
        by_path |= hit and not explicit
    if not (by_path or by_id):
        return False
    # Another device's variant of a shared test is that device's suite's case.
    if not by_id and case.device != suite_device:
        return False
    return entry.markers is None or _matches_markers(case, entry.markers)


def _fit_problems(m: Manifest, entry: Entry, case: CollectedCase) -> list[Problem]:
    where = f"{case.nodeid} (entry {entry.id!r} at {entry.source} {entry.pointer})"
    spec = case.spec
    assert spec is not None
    out = []

    def add(rule: str, message: str) -> None:
        out.append(Problem(rule, m.path, where, message, m.suite))

    if spec.cards > 0 and "cpu" in (spec.device, m.device):
        add("cpu-case-needs-cards", f"case on {spec.device} asks for {spec.cards} card(s) in cpu suite {m.suite!r}")
    elif m.device != "cpu" and spec.cards < 1:
        add(
            "accelerator-case-without-cards",
            f"{spec.device} case needs no card, but {m.device} suite {m.suite!r} runs on accelerator runners",
        )
    elif m.device != spec.device:
        add("wrong-device", f"{spec.device} case in {m.device} suite {m.suite!r}")
    if spec.cards > m.max_cards:
        add(
            "case-exceeds-runner-cards",
            f"case needs {spec.cards} card(s); the largest runner of suite {m.suite!r} has {m.max_cards}",
        )
    return out


# --------------------------------------------------------------------------- building

_MANIFEST_RULES = ("schema", "json", "path", "include")


@dataclass
class _Scope:
    """Which manifests an inventory reads (all of them) and judges (the selected ones)."""

    all: list[Manifest]
    selected: list[Manifest]
    problems: list[Problem]
    #: Every manifest loaded: only then is ownership meaningful (else it is noise).
    manifests_ok: bool

    @property
    def selected_names(self) -> set[str]:
        return {m.suite for m in self.selected}


def _load_scope(root: Path, suites: Iterable[str] | None) -> _Scope:
    """Phase 1: load every manifest, keep the problems of the selected suites."""
    all_manifests, problems = load_suites(root)
    ok = not any(p.rule in _MANIFEST_RULES for p in problems)
    if not suites:
        return _Scope(all_manifests, list(all_manifests), problems, ok)
    # Unknown names are problems; a suite named by path (suites/x.json) is its stem.
    problems += [p for p in load_suites(root, suites)[1] if p.rule == "unknown-suite"]
    wanted = {Path(s).stem if s.endswith(".json") else s for s in suites}
    problems = [p for p in problems if p.suite in wanted or p.rule == "unknown-suite"]
    return _Scope(all_manifests, [m for m in all_manifests if m.suite in wanted], problems, ok)


def _spec_problems(cases: Iterable[CollectedCase]) -> list[Problem]:
    """Phase 3: one ``bad-launch-spec`` problem per case whose launch marker is invalid."""
    return [
        Problem("bad-launch-spec", c.file, c.nodeid, c.spec_error or "invalid launch marker")
        for c in cases
        if c.spec is None
    ]


def _assign_owners(inv: SuiteInventory, m: Manifest, judged: bool) -> None:
    """Phase 4, one suite: record the first matching entry of ``m`` for each case;
    when the suite is ``judged``, add its fit and ``entry-matches-nothing`` problems."""
    owned_by: dict[str, int] = {e.id: 0 for e in m.entries}
    matched: dict[str, int] = {e.id: 0 for e in m.entries}
    first_owner: dict[str, str] = {}
    for c in inv.cases:
        if c.spec is None:
            continue
        owner: Entry | None = None
        for e in m.entries:
            if _entry_matches(e, c, m.device):
                matched[e.id] += 1
                if owner is None:
                    owner = e
                    owned_by[e.id] += 1
                else:
                    first_owner.setdefault(e.id, owner.id)
        if owner is not None:
            inv.owners.setdefault(c.nodeid, []).append((m.suite, owner.id))
            if judged:
                inv.problems.extend(_fit_problems(m, owner, c))
    if judged:
        inv.problems.extend(_idle_entries(m, owned_by, matched, first_owner))


def _idle_entries(
    m: Manifest, owned_by: dict[str, int], matched: dict[str, int], first_owner: dict[str, str]
) -> list[Problem]:
    """``entry-matches-nothing`` for each entry of ``m`` that owns no case (once per id)."""
    out = []
    seen: set[str] = set()
    for e in m.entries:
        if e.id in seen or owned_by[e.id]:
            seen.add(e.id)
            continue
        seen.add(e.id)
        if matched[e.id]:
            why = f"every case it matches is owned by the earlier entry {first_owner[e.id]!r}"
        else:
            why = f"its paths {list(e.paths)} match no {m.device} case" + (
                f" with markers {e.markers!r}" if e.markers else ""
            )
        out.append(
            Problem("entry-matches-nothing", e.source, f"{e.pointer} (entry {e.id!r})", f"suite {m.suite!r}: {why}", m.suite)
        )
    return out


def _ownership_problems(inv: SuiteInventory, manifests: Sequence[Manifest]) -> list[Problem]:
    """Phase 5: ``unowned-file`` for each test file none of whose cases any suite owns,
    ``unowned-case`` for each other case no suite owns."""
    by_file: dict[str, list[CollectedCase]] = {}
    for c in inv.cases:
        by_file.setdefault(c.file, []).append(c)
    covered = [p.split("::", 1)[0] for m in manifests for e in m.entries for p in e.paths]
    out = []
    for f in sorted(rel(p, inv.root) for p in inv.root.glob(TESTS_GLOB)):
        fcases = by_file.get(f, [])
        if any(c.nodeid in inv.owners for c in fcases):
            continue
        if not fcases and any(path_matches(f, p) for p in covered):
            continue  # collects nothing here (e.g. a module-level skip); its entry covers it
        out.append(Problem("unowned-file", f, "", "test file owned by no suite entry: add it to a suite in suites/"))
    unowned_files = {p.file for p in out}
    out += [
        Problem("unowned-case", c.file, c.nodeid, f"{c.device} case owned by no suite entry")
        for c in inv.cases
        if c.spec is not None and c.nodeid not in inv.owners and c.file not in unowned_files
    ]
    return out


def build_inventory(
    root: Path, suites: Iterable[str] | None = None, *, check_ownership: bool = True
) -> SuiteInventory:
    """Collect the repository's tests and check them against its suites.

    ``suites`` limits the checked suites (default: all of ``suites/*.json``).
    With ``check_ownership`` (default) every test file is collected and the
    ``unowned-file`` / ``unowned-case`` rules are checked against *all* suites
    (ownership is global: a file the cpu suite owns is owned even when only
    the gpu suite is inventoried); without it only the selected suites' entry
    paths are collected (what ``harness run`` needs).
    """
    root = root.resolve()
    scope = _load_scope(root, suites)
    read = scope.all if check_ownership else scope.selected
    cases, collect_problems = collect(root, _targets(root, read, check_ownership))
    inv = SuiteInventory(
        root=root,
        manifests={m.suite: m for m in scope.all},
        cases=cases,
        problems=[*scope.problems, *collect_problems, *_spec_problems(cases)],
    )
    judged = scope.selected_names
    for m in read:
        _assign_owners(inv, m, m.suite in judged)
    if check_ownership and scope.manifests_ok:
        inv.problems.extend(_ownership_problems(inv, scope.all))
    return inv
