"""Inventory: which suite entry owns each test case, and whether every case fits its runner.

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
class Case:
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
class Inventory:
    """The outcome of :func:`build_inventory`.

    ``owners[nodeid]`` lists ``(suite, entry id)`` pairs; ``problems`` holds
    every rule violation found (empty: the inventory is clean).
    """

    root: Path
    manifests: dict[str, Manifest]
    cases: list[Case]
    owners: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def suite_cases(self, suite: str) -> list[tuple[Case, Entry]]:
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
        self.cases: list[Case] = []
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


def _case(item: Any, root: Path) -> Case:
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
    return Case(
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


def collect(root: Path, targets: Sequence[str]) -> tuple[list[Case], list[Problem]]:
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


def _matches_markers(case: Case, expr: str) -> bool:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for name, kwargs in case.marks:
        by_name.setdefault(name, []).append(dict(kwargs))

    def matcher(name: str, /, **kwargs: Any) -> bool:
        return any(all(m.get(k, object()) == v for k, v in kwargs.items()) for m in by_name.get(name, ()))

    return _expression(expr).evaluate(matcher)


def _selector_matches(selector: str, case: Case) -> tuple[bool, bool]:
    """(matches, by node id) for one entry path."""
    if "::" in selector:
        hit = case.nodeid == selector or case.nodeid.startswith((selector + "::", selector + "["))
        return hit, hit
    return path_matches(case.file, selector), False


def _entry_matches(entry: Entry, case: Case, suite_device: str) -> bool:
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


def _fit_problems(m: Manifest, entry: Entry, case: Case) -> list[Problem]:
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


def build_inventory(
    root: Path, suites: Iterable[str] | None = None, *, check_ownership: bool = True
) -> Inventory:
    """Collect the repository's tests and check them against its suites.

    ``suites`` limits the checked suites (default: all of ``suites/*.json``).
    With ``check_ownership`` (default) every ``tests/**/test_*.py`` file is
    collected and the ``unowned-file`` / ``unowned-case`` rules are checked
    against *all* suites (ownership is global: a file the cpu suite owns is
    owned even when only the gpu suite is inventoried); without it only the
    selected suites' entry paths are collected (what ``harness run`` needs).
    """
    root = root.resolve()
    all_manifests, problems = load_suites(root)
    # Ownership is only meaningful when every manifest loaded (else: noise).
    manifests_ok = not any(p.rule in ("schema", "json", "path", "include") for p in problems)
    manifests = {m.suite: m for m in all_manifests}
    if suites:
        # Unknown names are problems; a suite named by path (suites/x.json) is its stem.
        problems += [p for p in load_suites(root, suites)[1] if p.rule == "unknown-suite"]
        wanted = {Path(s).stem if s.endswith(".json") else s for s in suites}
        problems = [p for p in problems if p.suite in wanted or p.rule == "unknown-suite"]
        selected = [m for m in all_manifests if m.suite in wanted]
    else:
        selected = list(all_manifests)
    scope = all_manifests if check_ownership else selected
    cases, collect_problems = collect(root, _targets(root, scope, check_ownership))
    problems += collect_problems
    inv = Inventory(root=root, manifests=manifests, cases=cases, problems=problems)

    for c in cases:
        if c.spec is None:
            inv.problems.append(Problem("bad-launch-spec", c.file, c.nodeid, c.spec_error or "invalid launch marker"))

    selected_names = {m.suite for m in selected}
    for m in scope:
        owned_by: dict[str, int] = {e.id: 0 for e in m.entries}
        matched: dict[str, int] = {e.id: 0 for e in m.entries}
        first_owner: dict[str, str] = {}
        for c in cases:
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
                if m.suite in selected_names:
                    inv.problems.extend(_fit_problems(m, owner, c))
        if m.suite not in selected_names:
            continue
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
            inv.problems.append(
                Problem(
                    "entry-matches-nothing", e.source, f"{e.pointer} (entry {e.id!r})", f"suite {m.suite!r}: {why}", m.suite
                )
            )

    if check_ownership and manifests_ok:
        by_file: dict[str, list[Case]] = {}
        for c in cases:
            by_file.setdefault(c.file, []).append(c)
        covered = [p.split("::", 1)[0] for m in all_manifests for e in m.entries for p in e.paths]
        for f in sorted(rel(p, root) for p in root.glob(TESTS_GLOB)):
            fcases = by_file.get(f, [])
            if any(c.nodeid in inv.owners for c in fcases):
                continue
            if not fcases and any(path_matches(f, p) for p in covered):
                continue  # collects nothing here (e.g. a module-level skip); its entry covers it
            inv.problems.append(
                Problem("unowned-file", f, "", "test file owned by no suite entry: add it to a suite in suites/")
            )
        unowned_files = {p.file for p in inv.problems if p.rule == "unowned-file"}
        for c in cases:
            if c.spec is not None and c.nodeid not in inv.owners and c.file not in unowned_files:
                inv.problems.append(
                    Problem("unowned-case", c.file, c.nodeid, f"{c.device} case owned by no suite entry")
                )
    return inv
