"""pytest plugin that ``harness run`` loads (``-p harness.suites.selection``): plan the suite
from the run's own collection and run exactly the planned cases.

``--harness-select FILE`` names a JSON file of the run's inputs, written by ``harness run``
before pytest starts: ``{"root": DIR, "suite": name, "shard": [I, N] or null,
"durations": path or null, "changed": [entry id, ...] or null (``--changed-from``'s
entries), "max_cards": N or null, "files": [path, ...], "partial": bool (the files of some entries
only), "flaky": bool}``. Each process
that collects (pytest itself, or each xdist worker, alike: the plan is a pure function of
what they all collect) builds the suite's inventory from its own items
(:func:`harness.suites.inventory.run_inventory`), refuses a suite with blocking problems
(every item deselected, the problems recorded), cuts the shard from the whole suite's
cases on their recorded durations as ``harness matrix`` does (:func:`plan_shard`), keeps
``--changed-from``'s entries and what fits ``--max-cards``, and deselects the rest. Each
kept case carries its entry as the JUnit property ``harness.entry``, its deadline as
pytest-timeout's ``timeout`` marker (:func:`deadline_marker`), its entry's device and cards
as the launch plugin's ``harness_device`` marker (a plain case of an accelerator entry) and
its entry's ``env`` while it runs (:func:`entry_env`); a case of a flaky entry carries
pytest-rerunfailures' ``flaky`` marker (:func:`rerun_marker`), and one that passes on a
rerun the JUnit property ``harness.flaky``; a case of a quarantined entry the property
``harness.quarantine``. The plan and what pytest does with each planned case are recorded
from pytest's own hooks (reports, deselections, exit status) by case id, one JSON-lines
file per process (:func:`read_records`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import fnmatch
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pytest

from harness.names import (
    DEFAULT_CASE_TIMEOUT_S,
    DEVICE_MARKER,
    LEAK_PROPERTY,
    OPT_JUNIT,
    OPT_SELECT,
    OPT_WORKERS,
)

if TYPE_CHECKING:
    from harness.suites.inventory import CollectedCase, Collection
    from harness.suites.manifest import Entry, Manifest

#: A case with its owning entry.
Pair = tuple["CollectedCase", "Entry"]

#: The launch side's pytest plugin, which every run of a suite needs.
LAUNCH_PLUGIN = "harness.launcher.plugin"
#: pytest-timeout's plugin: it enforces each planned case's deadline (its ``timeout`` marker).
TIMEOUT_PLUGIN = "pytest_timeout"
#: pytest-rerunfailures' plugin: it reruns the failed cases of flaky entries (its ``flaky`` marker).
RERUN_PLUGIN = "pytest_rerunfailures"

#: The parsed selection file, read once per process.
_SELECTION = pytest.StashKey[dict[str, Any]]()
#: The ``--junitxml`` the caller gave pytest (``None``: none), replaced by the run's own.
_CALLER_JUNIT = pytest.StashKey[Any]()
#: Whether every phase of a case's current attempt passed so far (a rerun starts anew).
_ATTEMPT_PASSED = pytest.StashKey[bool]()
#: A plain planned case's backstop (seconds after it starts): see :func:`pytest_runtest_protocol`.
_BACKSTOP = pytest.StashKey[float]()
#: The environment a planned case's entry sets (its ``env``).
_ENV = pytest.StashKey[dict[str, str]]()
#: This process's backstop log (opened on its first plain planned case).
_BACKSTOP_LOG = pytest.StashKey[IO[str]]()
#: How long past its deadline a plain case that pytest-timeout could not interrupt (native
#: code holding the GIL, a case that swallows the interruption) may run before the backstop
#: stops its process: as long again as the deadline, at most this.
BACKSTOP_GRACE_S = 60.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness-run", "harness run (case selection)")
    group.addoption(
        OPT_SELECT,
        metavar="FILE",
        default=None,
        help="JSON file of the planned cases (written by `harness run`); other items are deselected",
    )
    group.addoption(
        OPT_WORKERS,
        type=int,
        metavar="N",
        default=None,
        help="xdist workers (0: none) unless pytest's own -n / --numprocesses is given",
    )
    group.addoption(
        OPT_JUNIT,
        metavar="FILE",
        default=None,
        help="where the run's JUnit XML goes; a --junitxml of the caller's is recorded, to be written after the run",
    )


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> Any:
    # pytest-cov picks its controller here, from the options parsed so far: the run's
    # worker count must be among them, or a --cov run starts xdist workers under its
    # single-process controller (INTERNALERROR: no attribute 'configure_node').
    if not _is_worker(early_config):
        _set_workers(early_config.known_args_namespace, early_config)
    try:
        return (yield)
    except pytest.skip.Exception:
        # A planned folder whose conftest skips at module level (its one case, as the
        # inventory's): pytest loads that conftest again as it collects the folder, and
        # reports the folder skipped instead of a traceback before the session.
        return None


def _set_workers(options: Any, config: pytest.Config) -> None:
    """The run's xdist worker count (``--harness-workers``) into ``options`` (pytest's early
    or final option namespace) where xdist is loaded and the caller gave no ``-n``."""
    workers = getattr(options, "harness_workers", None)
    xdist = config.pluginmanager.hasplugin("xdist")
    if workers is not None and xdist and getattr(options, "numprocesses", None) is None:
        options.numprocesses = workers


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> Any:
    # Before xdist and junitxml read their options (as pytest parsed them from the command
    # line, addopts and PYTEST_ADDOPTS): the run's own choices apply only where the caller
    # made none.
    for flag, dest in (("--pdb", "usepdb"), ("--trace", "trace")):
        if config.getoption("harness_select", None) and getattr(config.option, dest, False):
            # harness run holds the terminal; pytest, in a process group of its own, would
            # be stopped (SIGTTIN) at the debugger's prompt. (Before xdist, which refuses
            # them next to the run's workers with advice that leads here.)
            raise pytest.UsageError(
                f"harness run cannot give pytest's {flag} the terminal: debug with pytest "
                f"itself, which runs launched cases the same way: python -m pytest -n 0 {flag} PATH"
            )
    if not _is_worker(config):
        _set_workers(config.option, config)
        junit = config.getoption("harness_junit")
        if junit:
            asked = getattr(config.option, "xmlpath", None)
            config.stash[_CALLER_JUNIT] = (
                os.path.abspath(os.path.expanduser(asked)) if asked else None
            )
            config.option.xmlpath = junit
    return (yield)


def _load(config: pytest.Config) -> dict[str, Any] | None:
    path = config.getoption("harness_select")
    if path and _SELECTION not in config.stash:  # written by harness run, read once
        config.stash[_SELECTION] = json.loads(Path(path).read_text(encoding="utf-8"))
    return config.stash.get(_SELECTION, None)


def _case_id(item: pytest.Item, root: Path) -> str:
    from harness.suites.inventory import case_id

    return case_id(item, root)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def records_glob(select_file: Path) -> str:
    """The glob, in ``select_file``'s folder, of the outcome records its pytest run wrote
    (one JSON-lines file per process: the controller and each xdist worker)."""
    return f"{select_file.name}.*.jsonl"


def _workers(config: pytest.Config) -> int:
    """The xdist workers of this pytest run (0: none, or xdist not loaded)."""
    n = getattr(config.option, "numprocesses", None)
    return n if isinstance(n, int) else 0


def _mark_flaky_pass(item: pytest.Item, report: pytest.TestReport) -> None:
    """Give the teardown report of an attempt that passed after a failed one (a rerun of
    pytest-rerunfailures, which counts attempts in ``execution_count``) the JUnit property
    ``harness.flaky``: pytest writes the teardown report's properties into the case's record."""
    before = report.when == "setup" or item.stash.get(_ATTEMPT_PASSED, False)
    item.stash[_ATTEMPT_PASSED] = before and report.passed
    attempt = getattr(item, "execution_count", 1)
    if report.when == "teardown" and attempt > 1 and item.stash[_ATTEMPT_PASSED]:
        report.user_properties.append(("harness.flaky", f"passed on attempt {attempt}"))


class _Outcomes:
    """Records what pytest did with each planned case: one JSON object a line, flushed (a
    process that dies later keeps what it recorded), in this process's file."""

    def __init__(self, config: pytest.Config, sel: dict[str, Any], path: Path):
        from harness.suites.inventory import Collection

        self.config = config
        self.root = Path(sel["root"])
        #: The planned cases by case id (None until this process has planned).
        self.planned: dict[str, Pair] | None = None
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed at unconfigure)
        self.worker = _is_worker(config)
        #: Every item collected, before any deselection: the order the plan keeps.
        self.collected: list[pytest.Item] = []
        #: Items deselected (``-k``, ``-m``, ``--deselect``) before this process planned.
        self.early: list[pytest.Item] = []
        #: The run's collection as the inventory records it (collection errors, skipped
        #: files, the files collected); its cases are added when the plan is made.
        self.found = Collection(self.root)
        config.pluginmanager.register(self.found, "harness-collection")
        #: Case id -> pytest's node id of the cases pytest collected that the suite does
        #: not hold (set by the selection hook, recorded at the end of collection).
        self.unplanned: dict[str, str] = {}

    def record(self, **event: Any) -> None:
        self.file.write(json.dumps(event) + "\n")
        self.file.flush()

    def options(self) -> None:
        """What pytest's own options (command line, ``addopts``, ``PYTEST_ADDOPTS``, as
        pytest parsed them) mean for the run's verdict."""
        opt = self.config.getoption
        sel = _load(self.config) or {}
        callers = _callers_args(self.config, sel)
        modules = bool(opt("pyargs", False))  # --pyargs: module names, not paths
        base = self.config.invocation_params.dir
        self.record(
            options={
                "collectonly": bool(opt("collectonly", False)),
                # --setup-plan implies it: set up and torn down, never called.
                "setuponly": bool(opt("setuponly", False)),
                "maxfail": int(opt("maxfail", 0) or 0),
                # The caller named paths or node ids (or --lf skips files): planned cases
                # pytest did not collect are deselected.
                "narrowed": bool(callers) or bool(opt("lf", False)),
                # ... some of which name no file (pytest says so under -n 0 only).
                "not_found": []
                if modules
                else [a for a in callers if not (base / a.split("::", 1)[0]).exists()],
                "junitxml": self.config.stash.get(_CALLER_JUNIT, None),
                # xdist's worker count as it resolved it (-n auto included); 0: none.
                "workers": _workers(self.config),
                "junit_prefix": opt("junitprefix", None) or "",
            }
        )

    def pytest_deselected(self, items: Sequence[pytest.Item]) -> None:
        if self.planned is None:  # -k, -m, --deselect: before the plan, which counts them
            self.early += items
            return
        ids = [cid for cid in (_case_id(i, self.root) for i in items) if cid in self.planned]
        if ids:
            self.record(deselected=ids)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # Called only when collection completed (pytest_collection_finish also runs when
        # it was interrupted, from a ``finally``, with the items found so far).
        self.collected = list(items)

    def plan(self, items: Sequence[pytest.Item]) -> dict[str, Pair]:
        """Plan the run from what this process collected: ``items`` (what the project's
        own hooks kept) and what pytest's options deselected before; record the plan (or
        why the suite cannot be planned: then nothing is planned)."""
        present = {id(i) for i in [*items, *self.early]}
        seen = {id(i) for i in self.collected}
        universe = [i for i in self.collected if id(i) in present]
        universe += [i for i in items if id(i) not in seen]  # added by a later hook
        sel = _load(self.config) or {}
        narrowed = bool(_callers_args(self.config, sel)) or bool(self.config.getoption("lf"))
        narrowed = narrowed or bool(sel.get("partial"))
        try:
            planned, suite, record = make_plan(sel, self.found, universe, whole=not narrowed)
        except _Unplannable as e:
            planned, suite, record = {}, set(), {"refused": e.lines}
        self.record(plan=record)
        self.planned = planned
        early = [cid for cid in (_case_id(i, self.root) for i in self.early) if cid in planned]
        if early:
            self.record(deselected=early)
        self.unplanned = {
            cid: i.nodeid for i in items if (cid := _case_id(i, self.root)) not in suite
        }
        return planned

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.planned is None:  # (only a process that collects calls this hook)
            # Collection did not finish (files that fail to collect under node ids given,
            # a folder skipped as a whole, an interrupt): plan what it found, so that each
            # case it found (and each file that failed) is reported.
            self.plan(session.items)
        unplanned = set(self.unplanned)
        lf = self.config.pluginmanager.get_plugin("lfplugin")
        if self.config.getoption("lf", False) and getattr(lf, "_previously_failed_count", 0):
            # --lf kept only the cases that failed last: it would have deselected the rest.
            unplanned = {c for c in unplanned if self.unplanned[c] in lf.lastfailed}
        if unplanned:
            self.record(unplanned=sorted(unplanned))
        ids = [(i.nodeid, _case_id(i, self.root)) for i in session.items]
        self.record(
            collected=[cid for _, cid in ids],
            # pytest's node ids that are not the case's: a path reached through a link to
            # the repository, which pytest names without its file ("::test_x"), so that two
            # files' cases may share one.
            aliases=[[n, cid] for n, cid in ids if n != cid],
        )

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        # Travels with the report (xdist passes it on): its case, whatever pytest's node id.
        report.harness_case = _case_id(item, self.root)
        _mark_flaky_pass(item, report)
        return report

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # Workers collect; xdist passes their failed and skipped reports on to the controller.
        if report.failed or report.skipped:
            self.record(collect=report.nodeid, outcome=report.outcome, message=_message(report))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # The controller sees every case's reports (xdist passes its workers' on and reports
        # a crashed worker's case itself); workers recording them too would count them twice.
        if self.worker:
            return
        self.record(
            report=getattr(report, "harness_case", report.nodeid),
            when=report.when,
            outcome=report.outcome,
            seconds=float(report.duration or 0.0),
            message="" if report.passed else _message(report),
        )
        for name, value in report.user_properties if report.when == "teardown" else ():
            if name == LEAK_PROPERTY:
                self.record(leaked=getattr(report, "harness_case", report.nodeid), text=value)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        # pytest.exit or KeyboardInterrupt: from a case (in a worker too), or the runner's SIGINT.
        self.record(interrupted=f"{excinfo.typename}: {excinfo.value}")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.worker:
            stopped = session.shouldstop or session.shouldfail
            self.record(finish=int(exitstatus), stopped=str(stopped) if stopped else "")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.file.close()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    sel = _load(config)
    if sel is None:
        return
    loaded = {getattr(p, "__name__", "") for p in config.pluginmanager.get_plugins()}
    for plugin, why in (
        # The run's plan counts launched cases' ranks and cards: without the plugin they
        # would run in this process, unlaunched.
        (LAUNCH_PLUGIN, "launched cases would run unlaunched"),
        # The planned cases' deadlines are its markers: without it nothing bounds them.
        (TIMEOUT_PLUGIN, "nothing would bound the cases' deadlines"),
        # Flaky entries' reruns are its markers: without it their cases would run once.
        *([(RERUN_PLUGIN, "flaky entries' cases would not be rerun")] if sel.get("flaky") else []),
    ):
        if plugin not in loaded:
            raise pytest.UsageError(
                f"harness run needs the pytest plugin {plugin}, which is disabled or not "
                f"installed (-p no:..., in the arguments, addopts or PYTEST_ADDOPTS): {why}"
            )
    # The caller's paths and node ids replace the run's files (pytest would collect the
    # union, and a file subsumes a node id in it): pytest selects, and reports a name that
    # is not found, as it would alone; the run keeps only its own cases of what it collects.
    callers = _callers_args(config, sel)
    if callers:
        config.args[:] = callers
    path = Path(config.getoption("harness_select"))
    outcomes = _Outcomes(config, sel, path.with_name(f"{path.name}.{os.getpid()}.jsonl"))
    config.pluginmanager.register(outcomes, "harness-outcomes")
    if not outcomes.worker:
        outcomes.options()


def _ignored(config: pytest.Config, path: Path) -> bool:
    """True when pytest's own ``--ignore`` / ``--ignore-glob`` (as pytest parsed them) name
    ``path`` or a directory above it. pytest applies them only while it walks directories, and
    ``harness run`` names the planned files: the same rules are applied to those here."""
    paths = {Path(os.path.abspath(p)) for p in config.getoption("ignore", None) or ()}
    globs = [str(g) for g in config.getoption("ignore_glob", None) or ()]
    for p in (path, *path.parents):
        if p in paths or any(fnmatch.fnmatch(str(p), g) for g in globs):
            return True
    return False


def _callers_args(config: pytest.Config, sel: dict[str, Any]) -> list[str]:
    """The paths and node ids the caller gave pytest, next to the files ``harness run`` gave
    (none once the caller's have replaced them)."""
    own = list(sel.get("files", ()))
    args = list(config.args)
    if not any(a in own for a in args):  # pytest_configure put the caller's in their place
        return args
    for a in own:
        if a in args:
            args.remove(a)
    return args


@pytest.hookimpl(trylast=True)  # after pytest's -k, -m and --deselect: what they leave
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    outcomes = config.pluginmanager.get_plugin("harness-outcomes")
    if outcomes is None:
        return
    root = outcomes.root
    wanted = outcomes.plan(items)
    keep, drop, ignored = [], [], []
    for item in items:
        cid = _case_id(item, root)
        if cid not in wanted:
            drop.append(item)
            continue
        if _ignored(config, Path(os.path.abspath(item.path))):
            ignored.append(item)
            continue
        keep.append(item)
        case, entry = wanted[cid]
        marker = deadline_marker(item, entry.timeout_s)
        if marker is not None:
            item.add_marker(marker)
        if not _launched(item) and not hasattr(item, "harness_case_id"):
            # (A command case stops its own command at its deadline: no backstop.)
            timeout = item.get_closest_marker("timeout")
            seconds = (timeout.args or [timeout.kwargs.get("timeout")])[0] if timeout else None
            if isinstance(seconds, (int, float)) and seconds > 0:
                item.stash[_BACKSTOP] = seconds + min(seconds, BACKSTOP_GRACE_S)
        item.user_properties.append(("harness.entry", entry.id))
        _place(item, case, entry)
    # Cases pytest collected that the suite does not hold (under paths given to pytest that
    # no entry of the suite owns) are dropped: pytest alone would run them; the summary
    # names them. Recorded once --lf, which deselects after this hook, has had its say.
    if drop or ignored:
        if drop:
            config.hook.pytest_deselected(items=drop)
        if ignored:
            config.hook.pytest_deselected(items=ignored)
        items[:] = keep


class _Unplannable(Exception):
    """The suite cannot be planned from this collection: ``lines``, what ``harness run``
    prints (as it printed them when it planned before pytest started)."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def make_plan(
    sel: dict[str, Any], found: Collection, items: Sequence[pytest.Item], *, whole: bool
) -> tuple[dict[str, Pair], set[str], dict[str, Any]]:
    """The run's plan from the run's own collection (``items``, recorded into ``found``):
    the planned cases by case id (collection order), every case id the suite holds (other
    shards' too), and the plan's record for ``harness run``'s report. ``whole``: no paths
    were given to pytest, so whole-suite rules (``entry-matches-nothing``) are judged.
    Raises :class:`_Unplannable` with what keeps the suite from being planned."""
    from harness.suites.inventory import blocking_problems, case_id, run_inventory
    from harness.suites.manifest import load_suites
    from harness.suites.plan import PlanError

    root = Path(sel["root"])
    manifests, problems = load_suites(root, [sel["suite"]])
    if not manifests:  # harness run checked it loads: changed since
        raise _Unplannable([f"error: {p}" for p in problems])
    m = manifests[0]
    found.add_items(items)
    inv = run_inventory(root, m, found, whole=whole)
    problems = blocking_problems(inv, m.suite)
    if problems:
        raise _Unplannable(
            [f"error: {p}" for p in problems]
            + [
                f"harness run: suite {m.suite!r} cannot be planned; see `harness inventory {m.suite}`"
            ]
        )
    collected = {case_id(i, root) for i in items}
    # A command entry's case is the manifest's: planned where its item was collected.
    owned = [
        (c, e) for c, e in inv.suite_cases(m.suite) if c.command is None or c.nodeid in collected
    ]
    shard = tuple(sel["shard"]) if sel.get("shard") else None
    durations = Path(sel["durations"]) if sel.get("durations") else None
    suite = owned
    if shard and not whole and shard[1] > len(owned):
        # A narrowed run's shard is cut from the cases it collected; one beyond them holds none.
        shard = (shard[0], max(1, len(owned))) if shard[0] <= len(owned) else None
        owned = owned if shard else []
    try:
        cases, runner, warnings = plan_shard(root, m, owned, durations, shard)
    except PlanError as e:
        raise _Unplannable([f"harness run: {e}"]) from None
    if sel.get("changed") is not None:
        cases = [(c, e) for c, e in cases if e.id in sel["changed"]]
    max_cards = sel.get("max_cards")
    too_big = [c for c, _ in cases if max_cards is not None and c.cards > max_cards]
    cases = [(c, e) for c, e in cases if max_cards is None or c.cards <= max_cards]
    record = {
        "cases": [[c.nodeid, e.id, c.cards] for c, e in cases],
        "quarantine": {c.nodeid: e.quarantine.reason for c, e in cases if e.quarantine},
        "too_big": [[c.nodeid, c.cards] for c in too_big],
        "whole": len(cases) == len(suite),
        "runner": runner,
        "warnings": warnings,
    }
    return {c.nodeid: (c, e) for c, e in cases}, {c.nodeid for c, _ in suite}, record


def plan_shard(
    root: Path,
    m: Manifest,
    owned: Sequence[Pair],
    durations: Path | None,
    shard: tuple[int, int] | None,
) -> tuple[list[Pair], str | None, list[str]]:
    """The cases of one shard (all of ``owned`` when ``shard`` is None), in collection order,
    planned as ``harness matrix`` plans (``PlanError`` where the matrix refuses the suite),
    the name of the runner class the shard was planned onto (the suite's one class when
    unsharded; ``None`` for an unsharded suite of several) and the plan's warnings."""
    from harness.suites.plan import plan_suite

    result = plan_suite(root, m, owned, durations=durations, shards=shard[1] if shard else None)
    if shard is None:
        return list(owned), (m.runners[0].name if len(m.runners) == 1 else None), result.warnings
    planned = result.shard(shard[0])
    mine = {p.nodeid for p in planned.cases}
    return [(c, e) for c, e in owned if c.nodeid in mine], planned.runner.name, result.warnings


def _place(item: pytest.Item, case: CollectedCase, entry: Entry) -> None:
    """Give a planned case what its entry says beyond its deadline: a plain case of an
    accelerator entry gets the launch plugin's ``harness_device`` marker (its device and
    cards: it runs apart on them), a flaky entry's case a rerun marker, a quarantined
    entry's case a JUnit property; the entry's ``env`` is kept for the case's run."""
    if case.entry_device:
        marker = getattr(pytest.mark, DEVICE_MARKER)(device=case.entry_device, cards=case.cards)
        item.add_marker(marker)
    if entry.env:
        item.stash[_ENV] = dict(entry.env)
    if entry.flaky and (marker := rerun_marker(item, entry.flaky.retries)) is not None:
        item.add_marker(marker)
    if entry.quarantine is not None:
        item.user_properties.append(("harness.quarantine", entry.quarantine.reason))


@contextlib.contextmanager
def entry_env(env: dict[str, str] | None) -> Iterator[None]:
    """``os.environ`` with ``env`` set while the case runs (its setup, call and teardown:
    what it starts, ranks included, inherits it), then as it was before."""
    if not env:
        yield
        return
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rerun_marker(item: pytest.Item, retries: int) -> pytest.MarkDecorator | None:
    """pytest-rerunfailures' ``flaky`` marker rerunning a failed case of a flaky entry up to
    ``retries`` times; ``None`` where the case has a ``flaky`` marker of its own (it wins)."""
    if item.get_closest_marker("flaky") is not None:
        return None
    return pytest.mark.flaky(reruns=retries)


def _message(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The first line of what went wrong (a failure) or why (a skip), at most 200 characters."""
    longrepr = report.longrepr
    if getattr(report, "wasxfail", None) is not None and report.skipped:
        text = f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
    elif isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2]).removeprefix("Skipped: ")
    elif (crash := getattr(longrepr, "reprcrash", None)) is not None:
        text = crash.message
    else:  # a bare text: its last "E " line, else its last line
        lines = str(longrepr or "").strip().splitlines() or [""]
        text = next((ln[1:] for ln in reversed(lines) if ln.startswith("E ")), lines[-1])
    return (text.strip().splitlines() or [""])[0][:200]


def deadline_marker(item: pytest.Item, timeout_s: float | None) -> pytest.MarkDecorator | None:
    """pytest-timeout's ``timeout`` marker carrying a planned case's deadline, the one
    carrier of an entry's ``timeout_s`` (the launch plugin takes it as a launched case's
    deadline on its ranks); ``None`` where the case keeps what it has: a ``timeout`` marker
    of its own wins, then the entry's ``timeout_s``, then the project's pytest-timeout
    setting (``timeout`` ini, ``--timeout``, ``PYTEST_TIMEOUT``), then
    :data:`~harness.names.DEFAULT_CASE_TIMEOUT_S` for a plain case (a launched one gets the
    launch plugin's own default, ``--harness-timeout``, the same number unless the caller
    gives one)."""
    if item.get_closest_marker("timeout") is not None:
        return None
    if timeout_s is None:
        if _launched(item):
            return None
        from pytest_timeout import get_env_settings

        if get_env_settings(item.config).timeout:
            return None
        timeout_s = DEFAULT_CASE_TIMEOUT_S
    return pytest.mark.timeout(timeout_s)


def _launched(item: pytest.Item) -> bool:
    from harness.spec import is_launched

    return is_launched(item)


def backstop_log(select_file: Path, pid: int) -> Path:
    """Where process ``pid`` of the run for ``select_file`` writes the stacks of a plain case
    its backstop stopped."""
    return select_file.with_name(f"backstop-{pid}.log")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    # pytest-timeout interrupts a plain case from a signal handler, which native code holding
    # the GIL, or a case that swallows the interruption, never sees. faulthandler's timer
    # needs no GIL: past the backstop it writes every thread's stack and ends the process.
    # pytest's own faulthandler_timeout uses the same timer: where it is set, no backstop.
    with entry_env(item.stash.get(_ENV, None)):
        return (yield from _bounded_by_backstop(item))


def _bounded_by_backstop(item: pytest.Item) -> Any:
    backstop = item.stash.get(_BACKSTOP, None)
    if backstop is None or float(item.config.getini("faulthandler_timeout") or 0) > 0:
        return (yield)
    log = item.config.stash.get(_BACKSTOP_LOG, None)
    if log is None:
        path = backstop_log(Path(item.config.getoption("harness_select")), os.getpid())
        log = item.config.stash[_BACKSTOP_LOG] = open(path, "w", encoding="utf-8")  # noqa: SIM115
    log.seek(0)
    log.truncate()
    log.write(f"{item.nodeid}: stopped {backstop:g} s after it started, past its deadline\n")
    log.flush()
    faulthandler.dump_traceback_later(backstop, exit=True, file=log)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
        log.seek(0)
        log.truncate()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # pytest-rerunfailures reruns a failed case inside one pytest_runtest_protocol, where
    # pytest-timeout armed the case's deadline once: a rerun after a timeout would run
    # unbounded. Each attempt after the first gets the deadline (and the backstop) anew.
    if getattr(item, "execution_count", 1) > 1 and _load(item.config) is not None:
        _restart_deadline(item)


def _restart_deadline(item: pytest.Item) -> None:
    """Arm ``item``'s pytest-timeout deadline and its backstop again, from now."""
    from pytest_timeout import _get_item_settings  # the settings its own hooks are given

    settings = _get_item_settings(item)
    if settings.timeout and settings.timeout > 0 and not settings.func_only:
        hook = item.config.pluginmanager.hook
        hook.pytest_timeout_cancel_timer(item=item)
        hook.pytest_timeout_set_timer(item=item, settings=settings)
    backstop = item.stash.get(_BACKSTOP, None)
    log = item.config.stash.get(_BACKSTOP_LOG, None)
    if backstop is not None and log is not None:  # a log: this run arms backstops
        faulthandler.dump_traceback_later(backstop, exit=True, file=log)


def pytest_unconfigure(config: pytest.Config) -> None:
    log = config.stash.get(_BACKSTOP_LOG, None)
    if log is not None:  # no backstop fired in this process: nothing to keep
        log.close()
        path = Path(log.name)
        if path.stat().st_size == 0:
            path.unlink()


def fired(folder: Path) -> list[tuple[str, Path]]:
    """``(headline, file)`` for each backstop that stopped a process of a run whose selection
    file is in ``folder``."""
    out = []
    for p in sorted(folder.glob("backstop-*.log")):
        text = p.read_text(encoding="utf-8", errors="replace")
        if "\nTimeout (" in text:
            out.append((text.splitlines()[0].strip(), p))
    return out


@dataclass
class Records:
    """What one pytest run of ``harness run`` recorded (:class:`_Outcomes`), all processes merged."""

    options: dict[str, Any] = field(default_factory=dict)
    #: The plan a collecting process made (:func:`make_plan`): ``cases`` (``[node id, entry
    #: id, cards]``), ``quarantine``, ``too_big``, ``whole``, ``runner``, ``warnings``; or
    #: ``refused`` (what to print); ``None``: no process got to plan (pytest never collected).
    plan: dict[str, Any] | None = None
    #: Planned cases pytest collected and kept (after every deselection).
    collected: set[str] = field(default_factory=set)
    #: Planned cases deselected by pytest's own options or plugins (``-k``, ``-m``, ``--lf``, ...).
    deselected: set[str] = field(default_factory=set)
    #: Collector node id -> (``failed`` | ``skipped``, message): files that failed to import or
    #: skipped at module level.
    collect: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Node id -> its phases' ``(when, outcome, seconds, message)``.
    reports: dict[str, list[tuple[str, str, float, str]]] = field(default_factory=dict)
    #: Cases pytest collected that the suite does not hold (under paths given to pytest, of
    #: another suite or none): never planned.
    unplanned: set[str] = field(default_factory=set)
    #: pytest's node id -> the case ids it names, where they differ (a path through a link
    #: to the repository: two files' cases may share one); ``reports`` are by case id.
    aliases: dict[str, set[str]] = field(default_factory=dict)
    #: pytest's exit status, ``None`` when the session never finished (killed, crashed).
    finish: int | None = None
    #: Why pytest stopped early (``-x``, ``--maxfail``), ``""`` when it did not.
    stopped: str = ""
    #: ``pytest.exit`` or ``KeyboardInterrupt`` ended the session (``"Exit: <reason>"``),
    #: ``""`` when neither did.
    interrupted: str = ""
    #: Case id -> the processes it left running after its teardown (stopped by the plugin).
    leaked: dict[str, str] = field(default_factory=dict)


def _text(message: str) -> str:
    """``message`` as UTF-8 can hold it: a lone surrogate (from a file name or output decoded
    with ``surrogateescape``) is written as its escape, ``\\udcff``."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def read_records(select_file: Path) -> Records:
    """Merge the outcome records every process of the pytest run for ``select_file`` wrote
    (a truncated last line, from a process that was killed, is skipped)."""
    out = Records()
    for path in sorted(select_file.parent.glob(records_glob(select_file))):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "options" in ev:
                out.options = ev["options"]
            elif "plan" in ev:  # every collecting process plans alike
                out.plan = ev["plan"]
            elif "collected" in ev:
                out.collected.update(ev["collected"])
                for nodeid, cid in ev.get("aliases", ()):
                    out.aliases.setdefault(nodeid, set()).add(cid)
            elif "unplanned" in ev:
                out.unplanned.update(ev["unplanned"])
            elif "deselected" in ev:
                out.deselected.update(ev["deselected"])
            elif "collect" in ev:
                out.collect.setdefault(ev["collect"], (ev["outcome"], _text(ev["message"])))
            elif "report" in ev:
                out.reports.setdefault(ev["report"], []).append(
                    (ev["when"], ev["outcome"], float(ev["seconds"]), _text(ev["message"]))
                )
            elif "finish" in ev:
                out.finish, out.stopped = int(ev["finish"]), _text(ev["stopped"])
            elif "interrupted" in ev:
                out.interrupted = _text(ev["interrupted"])
            elif "leaked" in ev:
                out.leaked[ev["leaked"]] = _text(ev["text"])
    for nodeid in set(out.aliases) & set(out.reports):
        # Reports carry their case; those xdist makes itself (a crashed worker's) do not.
        if len(cases := out.aliases[nodeid]) == 1:
            out.reports.setdefault(next(iter(cases)), []).extend(out.reports.pop(nodeid))
    return out
