"""pytest plugin that ``harness run`` loads (``-p harness.suites.selection``): run exactly the planned cases.

``--harness-select FILE`` names a JSON file ``{"root": DIR, "cases":
{nodeid: deadline_s or null}, "entries": {nodeid: entry id}}``. Collected
items not in it are deselected; each kept one records the suite entry that owns
it as the JUnit property ``harness.entry`` (``entries`` is optional);
planned cases that were not collected are reported (``harness run`` counts
them as missing, never as passed). Each phase of a plain (not launched) case
with a deadline runs under the process's watchdog
(``harness.watchdog.watchdog``, a thread of its own, whatever pytest's
``faulthandler_timeout`` does): past the deadline plus as long again (at most a
minute) for setup, call and teardown together, the phase it is in fails with
every thread's stack and the session goes on. A case that does not come back
from that interruption stops its process: its stacks are written to
``watchdog-<pid>.log`` next to the selection file and the case is recorded as
failed (an xdist worker's controller reports it), so the cases that passed
before keep their verdict. Launched cases are left to the launch plugin, which
bounds their fixtures and enforces their deadline on the ranks.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from harness.jsonio import write_json
from harness.names import OPT_JUNIT, OPT_SELECT, OPT_WORKERS
from harness.spec import is_launched
from harness.watchdog import WATCHDOG_GRACE_S, faulthandler_free, watchdog

#: The launch side's pytest plugin, which every run of a suite needs.
LAUNCH_PLUGIN = "harness.launcher.plugin"

# The watchdog allows a case as long again as its deadline, at most a minute,
# for setup, call and teardown together, and as long again after interrupting it.

WATCHDOG_MARK = "harness watchdog:"

#: A selected item's deadline in seconds (``None``: no watchdog).
_DEADLINE = pytest.StashKey[Any]()
#: The parsed selection file, read once per process.
_SELECTION = pytest.StashKey[dict[str, Any]]()
#: When a plain planned case with a deadline started (``time.monotonic``).
_STARTED = pytest.StashKey[float]()
#: The node id of the case this process is running.
_CURRENT = pytest.StashKey[str]()
#: The watchdog key of a session's planned plain cases (with its config).
_WATCHDOG_KEY = "harness run case"
#: This process's hook on the watchdog stopping it.
_EXIT_HOOK = pytest.StashKey[Callable[[str], None]]()
#: The ``--junitxml`` the caller gave pytest (``None``: none), replaced by the run's own.
_CALLER_JUNIT = pytest.StashKey[Any]()


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
    # single-process controller (INTERNALERROR: no attribute 'configure_node'). And a
    # group after the first appends to the coverage data of the groups before it, which
    # pytest-cov would otherwise erase: the last group's report covers the whole run.
    known = early_config.known_args_namespace
    if not _is_worker(early_config):
        _set_workers(known, early_config)
        group, groups = _group(known)
        if getattr(known, "cov_source", None):
            if group > 1:
                known.cov_append = True
            if group < groups:
                # The threshold is the whole run's: the last group checks it.
                known.cov_fail_under = 0
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


def _group(known: Any) -> tuple[int, int]:
    """This pytest's group number in the run and the run's number of groups ((1, 1) when
    unknown), from its selection file."""
    path = getattr(known, "harness_select", None)
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return int(doc.get("group", 1)), int(doc.get("groups", 1))
    except (TypeError, OSError, ValueError, AttributeError):
        return 1, 1


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
    if _group(config.option)[0] > 1 and getattr(config.option, "cacheclear", False):
        # The caller's --cache-clear is the run's: the first group cleared the cache, and a
        # later one (its xdist workers too) would drop what the groups before it recorded.
        config.option.cacheclear = False
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
    if not path:
        return None
    if _SELECTION not in config.stash:
        try:
            config.stash[_SELECTION] = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise pytest.UsageError(f"{OPT_SELECT} {path}: {e}") from e
    return config.stash[_SELECTION]


def _case_id(item: pytest.Item, root: Path) -> str:
    from harness.suites.inventory import case_id

    return case_id(item, root)


def started_marker(select_file: Path) -> Path:
    """The file the controller writes next to ``select_file`` once its session has
    started: from then on an interrupt is reported by pytest; before, nothing ran."""
    return select_file.with_name(select_file.name + ".started")


def pytest_sessionstart(session: pytest.Session) -> None:
    path = session.config.getoption("harness_select")
    if path and not hasattr(session.config, "workerinput"):  # the controller only
        started_marker(Path(path)).touch()


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def records_glob(select_file: Path) -> str:
    """The glob, in ``select_file``'s folder, of the outcome records its pytest run wrote
    (one JSON-lines file per process: the controller and each xdist worker)."""
    return f"{select_file.name}.*.jsonl"


class _Outcomes:
    """Records, by node id, what pytest did with each planned case: one JSON object a line
    (flushed: a process that dies later keeps what it recorded) in this process's file.

    ``harness run`` reads the files of all processes back (:func:`read_records`); JUnit is
    an output for people and CI, never what the run's verdict is read from.
    """

    def __init__(self, config: pytest.Config, sel: dict[str, Any], path: Path):
        self.config = config
        self.root = Path(sel["root"])
        self.planned: dict[str, Any] = sel["cases"]
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed at unconfigure)
        self.worker = _is_worker(config)
        self.collection_complete = False
        #: Planned cases pytest's own options or plugins deselected (``-k``, ``--lf``, ...).
        self.deselected: set[str] = set()
        #: Files pytest's ``--lf`` did not collect.
        self.last_failed_skipped: set[str] = set()
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
        absent = [] if modules else _not_found(self.config, callers)
        self.record(
            options={
                "collectonly": bool(opt("collectonly", False)),
                # --setup-plan implies it: set up and torn down, never called.
                "setuponly": bool(opt("setuponly", False)),
                "maxfail": int(opt("maxfail", 0) or 0),
                # The caller named paths or node ids: planned cases outside them are deselected.
                "narrowed": bool(callers),
                # ... some of which name no file (pytest says so under -n 0 only).
                "not_found": absent,
                # ... or select no case of the run.
                "selecting_nothing": []
                if modules
                else _selecting_nothing(self.config, [a for a in callers if a not in absent], sel),
                # The planned cases those paths leave out (None: modules, not paths).
                "outside": None if modules else self._outside(callers),
                "junitxml": self.config.stash.get(_CALLER_JUNIT, None),
                "junit_prefix": opt("junitprefix", None) or "",
            }
        )

    def pytest_deselected(self, items: Sequence[pytest.Item]) -> None:
        ids = [cid for cid in (_case_id(i, self.root) for i in items) if cid in self.planned]
        if ids:
            self.deselected.update(ids)
            self.record(deselected=ids)

    def _outside(self, callers: Sequence[str]) -> list[str]:
        """The planned cases none of the caller's paths and node ids selects, or that the
        caller's ``--ignore`` / ``--ignore-glob`` leave out of them."""
        if not callers:
            return []
        cwd = self.config.invocation_params.dir
        return [
            cid
            for cid in self.planned
            if not any(_selects(a, cid, cwd, self.root) for a in callers)
            or _ignored(self.config, Path(os.path.abspath(self.root / cid.split("::", 1)[0])))
        ]

    def pytest_collection_modifyitems(self) -> None:
        # Called only when collection completed; pytest_collection_finish also runs when
        # collection was interrupted (from a ``finally``), with the items found so far.
        self.collection_complete = True

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
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
            complete=self.collection_complete,
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
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Any:
        report = yield
        if isinstance(collector, pytest.File) and _skipped_by_last_failed(self.config, collector):
            from harness.suites.manifest import rel

            file = rel(collector.path, self.root)
            self.last_failed_skipped.add(file)
            self.record(last_failed_skipped=file)
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
    if LAUNCH_PLUGIN not in loaded:
        # The run's plan counts launched cases' ranks and cards: without the plugin they
        # would run in this process, unlaunched.
        raise pytest.UsageError(
            f"harness run needs its pytest plugin {LAUNCH_PLUGIN}, which is disabled "
            "(-p no:harness, in the arguments, addopts or PYTEST_ADDOPTS)"
        )
    # The caller's paths and node ids replace the run's files (pytest would collect the
    # union, and a file subsumes a node id in it): pytest selects, and reports a name that
    # is not found, as it would alone; the group keeps only its own cases of what it collects.
    callers = _callers_args(config, sel)
    if callers:
        config.args[:] = callers
    path = Path(config.getoption("harness_select"))
    outcomes = _Outcomes(config, sel, path.with_name(f"{path.name}.{os.getpid()}.jsonl"))
    config.pluginmanager.register(outcomes, "harness-outcomes")
    if not outcomes.worker:
        outcomes.options()
        if sel.get("group", 1) == 1 and config.getoption("lf", False):
            _snapshot_last_failed(config, Path(sel["root"]), _last_failed_file(path))
    config.stash[_EXIT_HOOK] = hook = _on_watchdog_exit(config, outcomes)
    watchdog.exit_hooks.append(hook)


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


def _skipped_by_last_failed(config: pytest.Config, file: pytest.File) -> bool:
    """Whether pytest's ``--lf`` left ``file`` uncollected: once a file holding a recorded
    failure is collected, it skips the files without one (with no failure recorded, or
    none collected yet, it skips nothing)."""
    lf = config.pluginmanager.get_plugin("lfplugin")
    paths = getattr(lf, "_last_failed_paths", None)  # pytest's own; absent: nothing skipped
    return (
        paths is not None
        and config.pluginmanager.has_plugin("lfplugin-collskip")
        and file.path not in paths
    )


def _last_failed_file(select_file: Path) -> Path:
    """Where the run's first group keeps the failures ``--lf`` reruns, as the run found them."""
    return select_file.with_name("last-failed.json")


def _snapshot_last_failed(config: pytest.Config, root: Path, target: Path) -> None:
    """Keep pytest's record of failed node ids (``cache/lastfailed``) as the run starts, as
    case ids: each group's pytest rewrites it, and a later group must see the run's."""
    from harness.suites.manifest import rel

    cache = getattr(config, "cache", None)
    failed = cache.get("cache/lastfailed", {}) if cache is not None else {}
    ids = []
    for key in failed:
        file, sep, tail = str(key).partition("::")
        ids.append(rel(config.rootpath / file, root) + sep + tail)
    write_json(target, sorted(ids), indent=None)


def _has_failure(ids: Iterable[str], failed: set[str]) -> bool:
    """Whether a case of ``ids``, or its file or class (a failed collection), failed last."""
    return any(
        cid[:i] in failed
        for cid in ids
        for i in [len(cid), *(i for i in range(len(cid)) if cid.startswith("::", i))]
    )


def _no_failure_to_rerun(config: pytest.Config, sel: dict[str, Any]) -> bool:
    """``--lf`` across the run's groups, as one pytest over the whole run would do it: when
    the run's cases hold a failure to rerun and none is among this group's, the group has
    nothing to run (its pytest alone would rerun every case, finding no failure)."""
    if not config.getoption("lf", False):
        return False
    try:
        path = _last_failed_file(Path(config.getoption("harness_select")))
        failed = set(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False
    run = sel.get("run", ())
    callers = _callers_args(config, sel)
    if callers:  # the caller's paths and node ids narrowed the run: their cases are its cases
        if config.getoption("pyargs", False):
            return False  # module names: this group's pytest decides alone
        cwd, root = config.invocation_params.dir, Path(sel["root"])
        run = [cid for cid in run if any(_selects(a, cid, cwd, root) for a in callers)]
    return _has_failure(run, failed) and not _has_failure(sel["cases"], failed)


def _selects(arg: str, cid: str, cwd: Path, root: Path) -> bool:
    """Whether the path or node id ``arg`` (as pytest reads it from ``cwd``) selects the
    case ``cid`` (relative to ``root``): under the named folder or file, and its name,
    class or parametrization named. The path is read as case ids are (:func:`case_id`): a
    symlinked file inside ``root`` is its own file, not the one it points to."""
    from harness.suites.manifest import rel

    where, sep, name = arg.partition("::")
    file, has_name, tail = cid.partition("::")
    named = rel(Path(os.path.abspath(cwd / where)), root)
    if not has_name and (named == file or named.startswith(f"{file}/")):
        # The file or folder is one case (it failed to import, or skips whole): a node id in
        # it, or a path inside it, names that case.
        return True
    if named != "." and file != named and not file.startswith(f"{named}/"):
        return False
    return not sep or tail == name or tail.startswith((f"{name}::", f"{name}["))


def _selecting_nothing(
    config: pytest.Config, args: Sequence[str], sel: dict[str, Any]
) -> list[str]:
    """The paths and node ids of ``args`` (each one that exists: see :func:`_not_found`)
    that select no case of the whole run (a file outside the suite, a misspelled test name,
    a link to a planned file), each with what it is when it is a link: pytest alone would
    have run what they name."""
    cwd, root = config.invocation_params.dir, Path(sel["root"])
    run = sel.get("run", ())
    out = []
    for a in args:
        if any(_selects(a, c, cwd, root) for c in run):
            continue
        path = Path(os.path.abspath(cwd / a.split("::", 1)[0]))
        linked = [p for p in (path, *path.parents) if p.is_symlink()]
        out.append(f"{a} (a symlink to {linked[0].resolve()})" if linked else a)
    return out


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


def _not_found(config: pytest.Config, args: Sequence[str]) -> list[str]:
    """The paths and node ids of ``args`` whose file or folder does not exist (read from
    where pytest was started, as pytest reads them)."""
    base = config.invocation_params.dir
    return [a for a in args if not (base / a.split("::", 1)[0]).exists()]


@pytest.hookimpl(trylast=True)  # after pytest's -k, -m and --deselect: what they leave
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    sel = _load(config)
    if sel is None:
        return
    root = Path(sel["root"])
    wanted: dict[str, Any] = sel["cases"]
    entries: dict[str, str] = sel.get("entries", {})
    keep, drop, ignored, seen = [], [], [], set()
    for item in items:
        cid = _case_id(item, root)
        if cid not in wanted:
            drop.append(item)
            continue
        seen.add(cid)
        if _ignored(config, Path(os.path.abspath(item.path))):
            ignored.append(item)
            continue
        keep.append(item)
        item.stash[_DEADLINE] = wanted[cid]
        if cid in entries:
            item.user_properties.append(("harness.entry", entries[cid]))
    if keep and _no_failure_to_rerun(config, sel):
        ignored += keep
        keep = []
    outcomes = config.pluginmanager.get_plugin("harness-outcomes")
    callers = _callers_args(config, sel)
    if drop and outcomes is not None:
        # Cases pytest collected that the suite does not hold: under paths given to pytest
        # that no entry of the suite owns, or collected only with the arguments given (a
        # conftest option that adds cases, --doctest-modules). pytest alone would run them;
        # the summary names them (`harness run` tells the two apart). Recorded once --lf,
        # which deselects after this hook, has had its say (``_Outcomes``).
        suite = set(sel.get("suite", ()))
        outcomes.unplanned = {
            cid: i.nodeid for i in drop if (cid := _case_id(i, root)) not in suite
        }
    if drop or ignored:
        if drop:
            config.hook.pytest_deselected(items=drop)
        if ignored:
            config.hook.pytest_deselected(items=ignored)
        items[:] = keep
    if outcomes is not None:  # pytest's -k, -m, --deselect came first (this hook is last)
        seen |= outcomes.deselected
        seen |= {n for n in wanted if n.partition("::")[0] in outcomes.last_failed_skipped}
    missing = sorted(n for n in set(wanted) - seen if "::" in n)  # a bare file: it failed to import
    # Reported once, on the controller; cases outside the caller's paths are deselected.
    if missing and not _is_worker(config) and not callers:
        shown = "\n  ".join(missing[:20])
        more = f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        print(
            f"\nharness: {len(missing)} planned case(s) were not collected:\n  {shown}{more}",
            file=sys.stderr,
        )


def _message(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The first line of what went wrong (a failure) or why (a skip), at most 200 characters."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr or "")
        if crash is None and text:
            errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
            text = errors[-1] if errors else text.strip().splitlines()[-1]
    if getattr(report, "wasxfail", None) is not None and report.skipped:
        text = f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
    return (text.strip().splitlines() or [""])[0][:200]


def _watchdog_log(config: pytest.Config) -> IO[str]:
    """This process's watchdog file, next to the selection file, made when the
    watchdog stops the process: its headline and every thread's stack."""
    path = Path(config.getoption("harness_select")).with_name(f"watchdog-{os.getpid()}.log")
    return open(path, "w", encoding="utf-8")


def _started(item: pytest.Item) -> float | None:
    return item.stash.get(_STARTED, None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    item.config.stash[_CURRENT] = item.nodeid
    if item.stash.get(_DEADLINE, None) is not None and not is_launched(item):
        item.stash[_STARTED] = time.monotonic()
    try:
        return (yield)
    finally:
        if _STARTED in item.stash:
            del item.stash[_STARTED]


@contextlib.contextmanager
def _bounded(item: pytest.Item) -> Iterator[None]:
    """A phase of a plain planned case, under what is left of the case's deadline."""
    started = _started(item)
    if started is None:
        yield
        return
    deadline = float(item.stash[_DEADLINE])
    grace = min(deadline, WATCHDOG_GRACE_S)
    with watchdog.bounding(
        (_WATCHDOG_KEY, item.config),
        deadline + grace,
        start=started,
        grace=grace,
        what=item.nodeid,
        why=f"(deadline {deadline:g} s)",
        error=_deadline_failure,
        backstop=faulthandler_free(item.config),
    ):
        yield


def _deadline_failure(message: str) -> BaseException:
    return pytest.fail.Exception(f"{WATCHDOG_MARK} {message}", pytrace=True)


# Each phase is bounded inside pytest's own call of it, so the failure raised at
# the deadline is that phase's outcome and the session goes on to the next case.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _bounded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _bounded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _bounded(item):
        return (yield)


def _on_watchdog_exit(config: pytest.Config, outcomes: _Outcomes) -> Callable[[str], None]:
    """What this process leaves behind when the watchdog stops it: the log it
    writes the stacks to and, on the controller, a failed report of the case
    it was in (whose earlier phases may have passed)."""

    def on_exit(headline: str) -> None:
        watchdog.exit_log = _watchdog_log(config)
        nodeid = config.stash.get(_CURRENT, None)
        if not outcomes.worker and nodeid is not None:
            outcomes.record(
                report=nodeid, when="call", outcome="failed", seconds=0.0, message=headline[:200]
            )

    return on_exit


def pytest_unconfigure(config: pytest.Config) -> None:
    hook = config.stash.get(_EXIT_HOOK, None)
    if hook is not None:
        watchdog.exit_hooks.remove(hook)
        watchdog.disarm((_WATCHDOG_KEY, config))


def fired(folder: Path) -> list[tuple[str, Path]]:
    """``(headline, file)`` for each watchdog that fired in a run whose selection
    files are in ``folder`` (a file left non-empty by a process that died)."""
    out = []
    for p in sorted(folder.glob("watchdog-*.log")):
        text = p.read_text(encoding="utf-8", errors="replace")
        if "\nTimeout (" in text:
            out.append((text.splitlines()[0].strip(), p))
    return out


@dataclass
class Records:
    """What one pytest run of ``harness run`` recorded (:class:`_Outcomes`), all processes merged."""

    options: dict[str, Any] = field(default_factory=dict)
    #: Planned cases pytest collected and kept (after every deselection).
    collected: set[str] = field(default_factory=set)
    #: Whether a process of the run completed its collection (``collected`` is then final,
    #: even when empty or when the run was interrupted later); not when an interrupt or a
    #: crash ended collection.
    collection_finished: bool = False
    #: Planned cases deselected by pytest's own options or plugins (``-k``, ``-m``, ``--lf``, ...).
    deselected: set[str] = field(default_factory=set)
    #: Collector node id -> (``failed`` | ``skipped``, message): files that failed to import or
    #: skipped at module level.
    collect: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Node id -> its phases' ``(when, outcome, seconds, message)``.
    reports: dict[str, list[tuple[str, str, float, str]]] = field(default_factory=dict)
    #: Cases pytest collected that the suite does not hold (under paths given to pytest, of
    #: another suite or none, or collected only with the arguments given): never planned.
    unplanned: set[str] = field(default_factory=set)
    #: Files (case ids) pytest's ``--lf`` did not collect: none of their cases failed last.
    last_failed_skipped: set[str] = field(default_factory=set)
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
            elif "collected" in ev:
                out.collected.update(ev["collected"])
                for nodeid, cid in ev.get("aliases", ()):
                    out.aliases.setdefault(nodeid, set()).add(cid)
                out.collection_finished |= bool(ev.get("complete"))
            elif "unplanned" in ev:
                out.unplanned.update(ev["unplanned"])
            elif "last_failed_skipped" in ev:
                out.last_failed_skipped.add(ev["last_failed_skipped"])
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
    for nodeid in set(out.aliases) & set(out.reports):
        # Reports carry their case; those xdist makes itself (a crashed worker's) do not.
        if len(cases := out.aliases[nodeid]) == 1:
            out.reports.setdefault(next(iter(cases)), []).extend(out.reports.pop(nodeid))
    return out
