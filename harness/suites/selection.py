"""pytest plugin that ``harness run`` loads (``-p harness.suites.selection``): plan the suite
from the run's own collection and run exactly the planned cases.

``--harness-select FILE`` names the run's inputs (JSON, written by ``harness run``). Each
process that collects (pytest, or each xdist worker: the plan is a pure function of the
collection) plans alike (:func:`make_plan`), deselects the rest, gives each planned case what
its entry says (deadline, device, env, reruns, quarantine) and records the plan and what
pytest did with each case, one JSON-lines file per process (:func:`read_records`).
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
from harness.spec import is_launched
from harness.suites.inventory import Collection, blocking_problems, case_id, run_inventory
from harness.suites.manifest import load_suites, suite_name
from harness.suites.plan import PlanError, plan_suite

if TYPE_CHECKING:
    from harness.suites.inventory import CollectedCase
    from harness.suites.manifest import Entry, Manifest

#: A case with its owning entry.
Pair = tuple["CollectedCase", "Entry"]

#: The plugins every run needs: the launch side's, pytest-timeout (the cases' deadlines);
#: pytest-rerunfailures (flaky entries' reruns) where an entry is flaky.
LAUNCH_PLUGIN = "harness.launcher.plugin"
TIMEOUT_PLUGIN = "pytest_timeout"
RERUN_PLUGIN = "pytest_rerunfailures"

_SELECTION = pytest.StashKey[dict[str, Any]]()
#: The caller's ``--junitxml`` (``None``: none), replaced by the run's own.
_CALLER_JUNIT = pytest.StashKey[Any]()
#: Whether every phase of a case's current attempt passed so far (a rerun starts anew).
_ATTEMPT_PASSED = pytest.StashKey[bool]()
#: A plain planned case's backstop, in seconds after it starts.
_BACKSTOP = pytest.StashKey[float]()
_ENV = pytest.StashKey[dict[str, str]]()
_BACKSTOP_LOG = pytest.StashKey[IO[str]]()
#: How long past its deadline a plain case pytest-timeout could not interrupt (native code
#: holding the GIL) may run before the backstop ends its process: the deadline again, at most this.
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
    # pytest-cov picks its controller from the options parsed so far: without the worker
    # count, a --cov run starts xdist workers under its single-process controller.
    if not _is_worker(early_config):
        _set_workers(early_config.known_args_namespace, early_config)
    try:
        return (yield)
    except pytest.skip.Exception:
        # A planned folder's conftest that skips at module level: pytest loads it again as
        # it collects the folder, and reports the folder skipped.
        return None


def _set_workers(options: Any, config: pytest.Config) -> None:
    """``--harness-workers`` into ``options`` as ``-n``, where xdist is loaded and no ``-n`` given."""
    workers = getattr(options, "harness_workers", None)
    xdist = config.pluginmanager.hasplugin("xdist")
    if workers is not None and xdist and getattr(options, "numprocesses", None) is None:
        options.numprocesses = workers


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> Any:
    # Before xdist and junitxml read their options: the run's choices apply where the
    # caller made none.
    for flag, dest in (("--pdb", "usepdb"), ("--trace", "trace")):
        if config.getoption("harness_select", None) and getattr(config.option, dest, False):
            # pytest, in a process group of its own, would be stopped (SIGTTIN) at the prompt.
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
    if path and _SELECTION not in config.stash:
        config.stash[_SELECTION] = json.loads(Path(path).read_text(encoding="utf-8"))
    return config.stash.get(_SELECTION, None)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _mark_flaky_pass(item: pytest.Item, report: pytest.TestReport) -> None:
    """Give the teardown report of an attempt that passed after a failed one (pytest-
    rerunfailures' ``execution_count``) the JUnit property ``harness.flaky``."""
    before = report.when == "setup" or item.stash.get(_ATTEMPT_PASSED, False)
    item.stash[_ATTEMPT_PASSED] = before and report.passed
    attempt = getattr(item, "execution_count", 1)
    if report.when == "teardown" and attempt > 1 and item.stash[_ATTEMPT_PASSED]:
        report.user_properties.append(("harness.flaky", f"passed on attempt {attempt}"))


class _Outcomes:
    """Records what pytest did with each planned case: one JSON object a line, flushed (a
    process that dies later keeps what it recorded), in this process's file."""

    def __init__(self, config: pytest.Config, sel: dict[str, Any], path: Path):
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
        #: The run's collection as the inventory records it; its cases added by the plan.
        self.found = Collection(self.root)
        config.pluginmanager.register(self.found, "harness-collection")
        #: Case id -> pytest's node id of collected cases the suite does not hold.
        self.unplanned: dict[str, str] = {}

    def record(self, **event: Any) -> None:
        self.file.write(json.dumps(event) + "\n")
        self.file.flush()

    def options(self) -> None:
        """Record what pytest's own options, as it parsed them, mean for the run's verdict."""
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
                # Paths, node ids or --lf: planned cases pytest did not collect are deselected.
                "narrowed": bool(callers) or bool(opt("lf", False)),
                # ... some of which name no file (pytest says so under -n 0 only).
                "not_found": []
                if modules
                else [a for a in callers if not (base / a.split("::", 1)[0]).exists()],
                "junitxml": self.config.stash.get(_CALLER_JUNIT, None),
                # As xdist resolved it (-n auto included); 0: none.
                "workers": n if isinstance(n := opt("numprocesses", None), int) else 0,
                "junit_prefix": opt("junitprefix", None) or "",
            }
        )

    def pytest_deselected(self, items: Sequence[pytest.Item]) -> None:
        if self.planned is None:  # -k, -m, --deselect: before the plan, which counts them
            self.early += items
            return
        ids = [cid for cid in (case_id(i, self.root) for i in items) if cid in self.planned]
        if ids:
            self.record(deselected=ids)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # Only when collection completed (pytest_collection_finish runs in any case).
        self.collected = list(items)

    def plan(self, items: Sequence[pytest.Item]) -> dict[str, Pair]:
        """Plan and record the run from ``items`` (what the project's hooks kept) and what
        pytest's options deselected before (nothing, recording why, when unplannable)."""
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
        early = [cid for cid in (case_id(i, self.root) for i in self.early) if cid in planned]
        if early:
            self.record(deselected=early)
        self.unplanned = {
            cid: i.nodeid for i in items if (cid := case_id(i, self.root)) not in suite
        }
        return planned

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.planned is None:
            # Collection did not finish (an interrupt, a folder skipped as a whole, files
            # failing under node ids given): plan what it found, so each is reported.
            self.plan(session.items)
        unplanned = set(self.unplanned)
        lf = self.config.pluginmanager.get_plugin("lfplugin")
        if self.config.getoption("lf", False) and getattr(lf, "_previously_failed_count", 0):
            # --lf would have deselected all but the cases that failed last.
            unplanned = {c for c in unplanned if self.unplanned[c] in lf.lastfailed}
        if unplanned:
            self.record(unplanned=sorted(unplanned))
        ids = [(i.nodeid, case_id(i, self.root)) for i in session.items]
        self.record(
            collected=[cid for _, cid in ids],
            # A path through a link to the repository, which pytest names without its
            # file ("::test_x"): two files' cases may share one.
            aliases=[[n, cid] for n, cid in ids if n != cid],
        )

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        # Travels with the report (xdist passes it on): its case, whatever pytest's node id.
        report.harness_case = case_id(item, self.root)
        _mark_flaky_pass(item, report)
        return report

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # Workers collect; xdist passes their failed and skipped reports on to the controller.
        if report.failed or report.skipped:
            self.record(collect=report.nodeid, outcome=report.outcome, message=_message(report))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # The controller sees every case's reports, a crashed worker's too.
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
        (LAUNCH_PLUGIN, "launched cases would run unlaunched"),
        (TIMEOUT_PLUGIN, "nothing would bound the cases' deadlines"),
        *([(RERUN_PLUGIN, "flaky entries' cases would not be rerun")] if sel.get("flaky") else []),
    ):
        if plugin not in loaded:
            raise pytest.UsageError(
                f"harness run needs the pytest plugin {plugin}, which is disabled or not "
                f"installed (-p no:..., in the arguments, addopts or PYTEST_ADDOPTS): {why}"
            )
    # The caller's paths and node ids replace the run's files (pytest would collect the
    # union, where a file subsumes a node id in it): pytest selects as it would alone.
    callers = _callers_args(config, sel)
    if callers:
        config.args[:] = callers
    path = Path(config.getoption("harness_select"))
    outcomes = _Outcomes(config, sel, path.with_name(f"{path.name}.{os.getpid()}.jsonl"))
    config.pluginmanager.register(outcomes, "harness-outcomes")
    if not outcomes.worker:
        outcomes.options()


def _ignored(config: pytest.Config, path: Path) -> bool:
    """Whether ``--ignore`` / ``--ignore-glob`` name ``path`` or a folder above it (pytest
    applies them only while it walks folders, and ``harness run`` names the planned files)."""
    paths = {Path(os.path.abspath(p)) for p in config.getoption("ignore", None) or ()}
    globs = [str(g) for g in config.getoption("ignore_glob", None) or ()]
    for p in (path, *path.parents):
        if p in paths or any(fnmatch.fnmatch(str(p), g) for g in globs):
            return True
    return False


def _callers_args(config: pytest.Config, sel: dict[str, Any]) -> list[str]:
    """The paths and node ids the caller gave pytest, beside the run's own files."""
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
    keep, drop = [], []
    for item in items:
        cid = case_id(item, root)
        # Cases the suite does not hold (under paths given to pytest) are dropped; the
        # summary names them.
        if cid not in wanted or _ignored(config, Path(os.path.abspath(item.path))):
            drop.append(item)
            continue
        keep.append(item)
        case, entry = wanted[cid]
        marker = deadline_marker(item, entry.timeout_s)
        if marker is not None:
            item.add_marker(marker)
        if not is_launched(item) and not hasattr(item, "harness_case_id"):  # not a command case
            timeout = item.get_closest_marker("timeout")
            seconds = (timeout.args or [timeout.kwargs.get("timeout")])[0] if timeout else None
            if isinstance(seconds, (int, float)) and seconds > 0:
                item.stash[_BACKSTOP] = seconds + min(seconds, BACKSTOP_GRACE_S)
        item.user_properties.append(("harness.entry", entry.id))
        _place(item, case, entry)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class _Unplannable(Exception):
    """The suite cannot be planned from this collection: ``lines``, what ``harness run`` prints."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def cannot_plan(problems: Sequence[object], suite: str, command: str) -> list[str]:
    """What ``harness COMMAND`` prints for ``suite`` (a name or a manifest path) that it cannot
    plan: its blocking ``problems``, then where to look."""
    name = suite_name(suite)
    see = f"see `harness inventory {name}`"
    return [f"error: {p}" for p in problems] + [
        f"harness {command}: suite {suite!r} cannot be planned; {see}"
    ]


def make_plan(
    sel: dict[str, Any], found: Collection, items: Sequence[pytest.Item], *, whole: bool
) -> tuple[dict[str, Pair], set[str], dict[str, Any]]:
    """The run's plan from the run's own collection (``items``, recorded into ``found``):
    the planned cases by case id (collection order), every case id the suite holds (other
    shards' too), and the plan's record for ``harness run``'s report. ``whole``: no paths
    were given to pytest, so whole-suite rules (``entry-matches-nothing``) are judged.
    Raises :class:`_Unplannable` with what keeps the suite from being planned."""
    root = Path(sel["root"])
    manifests, problems = load_suites(root, [sel["suite"]])
    if not manifests:  # harness run checked it loads: changed since
        raise _Unplannable([f"error: {p}" for p in problems])
    m = manifests[0]
    found.add_items(items)
    inv = run_inventory(root, m, found, whole=whole)
    problems = blocking_problems(inv, m.suite)
    if problems:
        raise _Unplannable(cannot_plan(problems, m.suite, "run"))
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
    the name of its runner class (``None`` for an unsharded suite of several) and the plan's
    warnings."""
    result = plan_suite(root, m, owned, durations=durations, shards=shard[1] if shard else None)
    if shard is None:
        return list(owned), (m.runners[0].name if len(m.runners) == 1 else None), result.warnings
    planned = result.shard(shard[0])
    mine = {p.nodeid for p in planned.cases}
    return [(c, e) for c, e in owned if c.nodeid in mine], planned.runner.name, result.warnings


def _place(item: pytest.Item, case: CollectedCase, entry: Entry) -> None:
    """Give a planned case what its entry says beyond its deadline: ``harness_device`` (a plain
    case of an accelerator entry), ``env``, reruns, the quarantine's JUnit property."""
    if case.entry_device:
        marker = getattr(pytest.mark, DEVICE_MARKER)(device=case.entry_device, cards=case.cards)
        item.add_marker(marker)
    if entry.env:
        item.stash[_ENV] = dict(entry.env)
    if entry.flaky and item.get_closest_marker("flaky") is None:  # the case's own wins
        item.add_marker(pytest.mark.flaky(reruns=entry.flaky.retries))
    if entry.quarantine is not None:
        item.user_properties.append(("harness.quarantine", entry.quarantine.reason))


@contextlib.contextmanager
def entry_env(env: dict[str, str] | None) -> Iterator[None]:
    """``os.environ`` with ``env`` set while the case runs (its setup, call and teardown:
    what it starts, ranks included, inherits it), then those variables as they were."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        yield


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
    """pytest-timeout's ``timeout`` marker carrying a planned case's deadline, the one carrier
    of an entry's ``timeout_s`` (a launched case's deadline on its ranks too); ``None`` where
    the case keeps what it has. First wins: the case's own ``timeout`` marker, ``timeout_s``,
    the project's pytest-timeout setting, then :data:`~harness.names.DEFAULT_CASE_TIMEOUT_S`
    for a plain case (a launched one gets ``--harness-timeout``'s default)."""
    if item.get_closest_marker("timeout") is not None:
        return None
    if timeout_s is None:
        if is_launched(item):
            return None
        from pytest_timeout import get_env_settings  # not needed by inventory / matrix

        if get_env_settings(item.config).timeout:
            return None
        timeout_s = DEFAULT_CASE_TIMEOUT_S
    return pytest.mark.timeout(timeout_s)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    with entry_env(item.stash.get(_ENV, None)):
        return (yield from _bounded_by_backstop(item))


def _bounded_by_backstop(item: pytest.Item) -> Any:
    # pytest-timeout's signal handler never runs while native code holds the GIL;
    # faulthandler's timer needs none: past the backstop it dumps the stacks and exits.
    # pytest's own faulthandler_timeout uses the same timer: where it is set, no backstop.
    backstop = item.stash.get(_BACKSTOP, None)
    if backstop is None or float(item.config.getini("faulthandler_timeout") or 0) > 0:
        return (yield)
    log = item.config.stash.get(_BACKSTOP_LOG, None)
    if log is None:
        path = Path(item.config.getoption("harness_select")).with_name(
            f"backstop-{os.getpid()}.log"
        )
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
    # pytest-rerunfailures reruns inside one pytest_runtest_protocol, where pytest-timeout
    # armed the deadline once: each later attempt gets it (and the backstop) anew.
    if getattr(item, "execution_count", 1) == 1 or _load(item.config) is None:
        return
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
    """``(headline, file)`` for each backstop that stopped a process of the run in ``folder``."""
    out = []
    for p in sorted(folder.glob("backstop-*.log")):
        text = p.read_text(encoding="utf-8", errors="replace")
        if "\nTimeout (" in text:
            out.append((text.splitlines()[0].strip(), p))
    return out


@dataclass
class Records:
    """What one pytest run of ``harness run`` recorded (:class:`_Outcomes`), all processes merged."""

    #: What pytest's options mean for the verdict (:meth:`_Outcomes.options`).
    options: dict[str, Any] = field(default_factory=dict)
    #: :func:`make_plan`'s record; ``None``: no process got to plan.
    plan: dict[str, Any] | None = None
    #: Planned cases pytest collected and kept, and those its own options deselected.
    collected: set[str] = field(default_factory=set)
    deselected: set[str] = field(default_factory=set)
    #: Collector node id -> (``failed`` | ``skipped``, message).
    collect: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Case id -> its phases' ``(when, outcome, seconds, message)``.
    reports: dict[str, list[tuple[str, str, float, str]]] = field(default_factory=dict)
    #: Cases pytest collected that the suite does not hold.
    unplanned: set[str] = field(default_factory=set)
    #: pytest's node id -> the case ids it names, where they differ.
    aliases: dict[str, set[str]] = field(default_factory=dict)
    #: pytest's exit status (``None``: the session never finished) and why it stopped early.
    finish: int | None = None
    stopped: str = ""
    #: ``"Exit: <reason>"`` when ``pytest.exit`` or ``KeyboardInterrupt`` ended the session.
    interrupted: str = ""
    #: Case id -> the processes it left running after its teardown.
    leaked: dict[str, str] = field(default_factory=dict)


def _text(message: str) -> str:
    """``message`` with each lone surrogate (``surrogateescape``) written as its escape."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def read_records(select_file: Path) -> Records:
    """Merge the outcome records every process of the pytest run for ``select_file`` wrote
    (a truncated last line, from a process that was killed, is skipped)."""
    out = Records()
    for path in sorted(select_file.parent.glob(f"{select_file.name}.*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "options" in ev:
                out.options = ev["options"]
            elif "plan" in ev:
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
