"""``harness run``: run a suite's planned cases in one pytest process with the harness plugins.

Here: the options, the suite's manifest, ``--changed-from``'s entries, the plan's inputs in
the selection file (the plan is made inside pytest: :mod:`harness.suites.selection`), xdist
workers sized before collection, the output folder's lock, stop signals and the run's budget,
and the report: ``junit.xml``, ``summary.md``, ``summary.json``, ``plan.json`` in ``--out``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import names, processes
from harness.jsonio import write_json, write_text
from harness.names import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from harness.suites import changes, report, selection
from harness.suites.inventory import (
    SuiteInventory,
    autoload_disabled,
    blocking_problems,
    build_inventory,
    command_case,
    entry_targets,
    load_suite_manifest,
    plugin_args,
)
from harness.suites.manifest import Manifest, suite_name
from harness.suites.plan import PlanError, parse_shard, write_durations

if TYPE_CHECKING:  # imported where used: the inventory and the planner need no psutil
    import psutil

_XDIST_INSTALLED = importlib.util.find_spec("xdist") is not None


@dataclass
class RunOptions:
    """What ``harness run`` was asked to do."""

    suite: str
    shard: str | None = None
    changed_from: str | None = None
    durations_out: Path | None = None
    durations: Path | None = None
    out: Path | None = None
    workers: int | None = None
    max_cards: int | None = None
    #: ``--timeout-minutes``; ``None``: the runner's ``timeout_minutes`` in CI, else no budget.
    timeout_minutes: float | None = None
    pytest_args: list[str] = field(default_factory=list)


def _print(msg: str) -> None:
    print(f"harness: {msg}", flush=True)


def option_values(args: Sequence[str], names: Sequence[str]) -> list[str | None]:
    """The value of each occurrence in pytest arguments ``args`` of an option in ``names``
    (``--opt V``, ``--opt=V``, ``-nV``; ``None`` for a flag or an option at the very end)."""
    found: list[str | None] = []
    for i, a in enumerate(args):
        for n in names:
            if a == n:
                found.append(args[i + 1] if i + 1 < len(args) else None)
            elif a.startswith(n + "=") and n.startswith("--"):
                found.append(a.split("=", 1)[1])
            elif len(n) == 2 and a.startswith(n) and len(a) > 2 and not a.startswith("--"):
                found.append(a[2:])
    return found


def leasable_cards(device: str) -> int:
    """Cards of ``device`` this host offers (``HARNESS_CARDS`` or the runtime); 0 for cpu."""
    if device == "cpu":
        return 0
    from harness import devices

    return len(devices.inventory(device))


def worker_count(device: str, pytest_args: Sequence[str], requested: int | None = None) -> int:
    """xdist workers for a run of a suite on ``device``, sized before anything is collected:
    ``requested`` (``--workers``), else the process slots (``--harness-max-procs``, else the
    CPUs), at most the leasable cards on accelerators, and at most the node ids when every
    positional pytest argument is one. A wider case waits for its lease while others run."""
    from harness.devices import cpu_count

    if requested:
        return max(1, requested)
    given = option_values(pytest_args, [names.OPT_MAX_PROCS])
    n = max(1, int(given[-1])) if given and given[-1] and given[-1].isdigit() else cpu_count()
    if device != "cpu":
        n = min(n, leasable_cards(device))
    # An argument after an option is taken for its value: at worst a run gets fewer workers.
    loose = [
        a
        for i, a in enumerate(pytest_args)
        if not a.startswith("-") and not (i and pytest_args[i - 1].startswith("-"))
    ]
    named = [a for a in loose if "::" in a]
    if named and len(named) == len(loose):
        n = min(n, len(named))
    return max(1, n)


def load_suite(root: Path, suite: str, command: str) -> tuple[str, SuiteInventory] | None:
    """The name and inventory of ``suite`` (a name or a manifest path), or None after printing
    why it cannot be planned (file ownership aside: ``harness inventory``'s)."""
    name = suite_name(suite)
    inv = build_inventory(root, [suite], check_ownership=False)
    problems = blocking_problems(inv, name)
    if problems or name not in inv.manifests:
        print("\n".join(selection.cannot_plan(problems, suite, command)), file=sys.stderr)
        return None
    return name, inv


#: How long an interrupted pytest gets to stop and report before its tree is terminated.
INTERRUPT_GRACE_S = 30.0
#: Between SIGTERM and SIGKILL when a process tree is stopped.
KILL_AFTER_S = 5.0
#: How long what pytest left behind gets to end by itself before it is stopped.
LEFTOVER_GRACE_S = 2.0
#: The signals that stop a run: exit code 128 + signal number.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop:
    """The stop signals of a ``harness run``: passed on to the running pytest (its own process
    group) as SIGINT, or acted on before it starts; a second one stops its tree at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.tree: dict[int, psutil.Process] = {}
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        again = self.signum is not None
        self.signum = self.signum or signum
        if self.child is None:
            return  # acted on between phases: a raise could land in any import (and be swallowed)
        self.snapshot()
        if again:
            _stop_tree(list(self.tree.values()))
        else:
            self.interrupt()

    def interrupt(self) -> None:
        assert self.child is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGINT)

    def snapshot(self) -> None:
        """Remember pytest's process tree: once pytest has exited, orphans cannot be found."""
        if self.child is not None:
            for p in processes.process_tree(self.child.pid, own_session=False):
                self.tree.setdefault(p.pid, p)

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for a KeyboardInterrupt not seen as a signal)."""
        return 128 + (self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name


def _stop_tree(procs: Sequence[psutil.Process]) -> None:
    processes.terminate(procs, grace=KILL_AFTER_S, kill_wait=KILL_AFTER_S)


def _run_pytest(cmd: list[str], budget: Budget | None, stop: _Stop) -> tuple[int, str]:
    """Run pytest in its own process group; returns its exit code and why the run stopped it
    (``""``: it did not). Past ``budget`` its tree is stopped (:data:`TIMED_OUT`); after a
    stop signal it gets :data:`INTERRUPT_GRACE_S`, then what is left of its tree is stopped.
    """
    me = os.getpid()

    def in_child() -> None:
        os.setpgrp()  # a Ctrl-C to our group reaches it once, through _Stop
        processes.die_with_parent(me)  # and it dies with us, even when we are SIGKILLed

    deadline = time.monotonic() + budget.seconds if budget else float("inf")
    # Outside the foreground group, reading the terminal would stop pytest (SIGTTIN).
    try:
        stdin = subprocess.DEVNULL if os.isatty(sys.stdin.fileno()) else None
    except (AttributeError, OSError, ValueError):  # no stdin, or not a file
        stdin = None
    proc = stop.child = subprocess.Popen(cmd, preexec_fn=in_child, stdin=stdin)
    if stop.signum is not None:  # the signal came between planning and the start
        stop.interrupt()
    try:
        while True:
            if stop.signum is not None:
                deadline = min(deadline, time.monotonic() + INTERRUPT_GRACE_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                break
            if time.monotonic() < deadline:
                continue
            timed_out = stop.signum is None and budget is not None
            if timed_out:
                _print(f"pytest ran past {budget.name}; stopping it")
            stop.snapshot()
            _stop_tree(list(stop.tree.values()))
            code = proc.wait()
            if timed_out:
                return TIMED_OUT, f"stopped at {budget.name}"
            break
        if stop.signum is not None:
            _stop_tree(list(stop.tree.values()))  # what outlived pytest
            return code, f"interrupted by {stop.name}"
        return code, ""
    finally:
        stop.child = None
        stop.tree.clear()


#: The exit code of a pytest the run's budget stopped (``timeout``'s convention).
TIMED_OUT = 124


@dataclass(frozen=True)
class Budget:
    """How long a whole run may take: ``seconds``, and what set it (``name``)."""

    seconds: float
    name: str


def run_budget(m: Manifest, minutes: float | None) -> Budget | None:
    """The run's budget: ``--timeout-minutes`` (``minutes``), else in CI (``CI`` set, not
    empty, ``0`` or ``false``) its runners' longest ``timeout_minutes``, else none."""
    if minutes is not None:
        return Budget(minutes * 60.0, f"--timeout-minutes {minutes:g}")
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        limit = max(r.timeout_minutes for r in m.runners)
        return Budget(limit * 60.0, f"the runner's timeout of {limit:g} min (CI is set)")
    return None


class _Refused(Exception):
    """``harness run`` cannot start as asked; the message says why."""


@dataclass
class _Run:
    """One ``harness run``, passed from phase to phase: what it knows before pytest collects."""

    root: Path
    opts: RunOptions
    manifest: Manifest
    shard: tuple[int, int] | None
    out: Path
    started: float
    #: ``--changed-from``'s entry ids (None: every entry).
    changed: list[str] | None = None
    workers: int = 1
    budget: Budget | None = None

    @property
    def title(self) -> str:
        shard = f" (shard {self.shard[0]}/{self.shard[1]})" if self.shard else ""
        return f"harness run {self.manifest.suite}{shard}"

    @property
    def select_file(self) -> Path:
        return self.out / "select.json"


def _plan_run(root: Path, opts: RunOptions, started: float) -> _Run:
    """Phase 1, what needs no collection: the options, the suite's manifest (its blocking
    problems refuse the run), ``--changed-from``'s entries. Raises ``_Refused``."""
    try:
        shard = parse_shard(opts.shard) if opts.shard is not None else None
    except PlanError as e:
        raise _Refused(f"harness run: {e}") from None
    m, problems = load_suite_manifest(root, opts.suite)
    if problems or m is None:
        raise _Refused("\n".join(selection.cannot_plan(problems, opts.suite, "run")))
    if opts.durations is not None and not opts.durations.is_file():
        raise _Refused(f"harness run: {opts.durations}: no such durations file")
    changed = None
    if opts.changed_from:
        sel = changes.select(
            m.entries,
            *changes.changed_files(root, opts.changed_from),
            run_everything_on=m.run_everything_on,
        )
        _print(f"--changed-from {opts.changed_from}: {sel.reason}")
        changed = sorted(sel.entries)
    default = m.suite if shard is None else f"{m.suite}-{shard[0]}of{shard[1]}"
    out = (opts.out or root / "out" / "harness" / default).resolve()
    workers = worker_count(m.device, opts.pytest_args, opts.workers)
    budget = run_budget(m, opts.timeout_minutes)
    return _Run(root, opts, m, shard, out, started, changed, workers, budget)


#: The lock file in a run's output folder, ``flock``'d by the run that writes there and naming it.
OUT_LOCK = ".harness-run.lock"


@contextlib.contextmanager
def claim_out(out: Path, title: str) -> Iterator[None]:
    """Hold the output folder ``out`` for one run (``title``) until it ends, however it ends.
    While another run holds it, ``_Refused`` names that run and the way out (``--out``).
    (``flock``, not filelock, which truncates the holder record; leases are the launcher's.)"""
    if out.exists() and not out.is_dir():
        raise _Refused(f"harness run: --out {out} is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(out / OUT_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:  # another user's lock file: flock needs no write access
            fd = os.open(out / OUT_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _Refused(
            f"harness run: cannot make the output folder {out} ({e.strerror}); "
            "give the run a folder it can write: --out DIR"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "starting"
            raise _Refused(
                f"harness run: the output folder {out} is in use by another run ({holder}); "
                "wait for it to end, or give this run a folder of its own: --out DIR"
            ) from None
        except OSError as e:  # a file system without flock
            raise _Refused(
                f"harness run: cannot lock {out / OUT_LOCK} ({e.strerror}); --out DIR"
            ) from None
        with contextlib.suppress(OSError):  # read-only: the holder goes unnamed
            os.ftruncate(fd, 0)
            since = time.strftime("%Y-%m-%d %H:%M:%S %z")
            os.pwrite(fd, f"pid {os.getpid()}: {title}, since {since}\n".encode(), 0)
            os.fchmod(fd, 0o666)  # writable for the next user's run too (ours only)
        yield
    finally:
        os.close(fd)


def _prepare_out(run: _Run) -> None:
    """Phase 2: the output folder, cleared of a previous run's files."""
    reports = ("junit.xml", "summary.md", "summary.json", "plan.json")
    for pattern in ("select.json*", COMMANDS_FILE, "backstop-*.log", *reports):
        for stale in run.out.glob(pattern):
            stale.unlink()


#: Runs pytest with the root (its first argument) first on ``sys.path``, as ``python -m
#: pytest`` in the root would: not through the environment, where it would shadow what a
#: test's own subprocess or virtualenv installs.
_PYTEST_FROM_ROOT = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('pytest', run_name='__main__', alter_sys=True)"
)


#: The run's command cases, in its output folder (the format: ``harness.launcher.command``).
COMMANDS_FILE = "commands.json"


def _write_commands(run: _Run) -> Path | None:
    """The file of the suite's command cases, for the launch plugin to collect (None: none)."""
    m = run.manifest
    cases = [
        {
            "id": c.nodeid,
            "argv": list(c.command or ()),
            "expect_output": e.expect_output,
            "timeout_s": e.timeout_s,
            "device": c.device,
            "cards": c.cards,
            "env": dict(e.env),
            "source": e.source,
        }
        for e in m.entries
        if e.command is not None and (run.changed is None or e.id in run.changed)
        for c in [command_case(m, e)]
    ]
    if not cases:
        return None
    path = run.out / COMMANDS_FILE
    write_json(path, {"format": names.COMMANDS_FORMAT, "root": str(run.root), "cases": cases})
    return path


def _pytest_command(run: _Run) -> list[str]:
    """The pytest command line of the run; writes its selection file (the plan's inputs)
    and its command cases' file (collected as a test file of its own)."""
    m = run.manifest
    # --changed-from's entries' paths alone, unless a shard is cut (from the whole suite).
    chosen = m
    if run.changed is not None and not run.shard:
        chosen = dataclasses.replace(m, entries=tuple(e for e in m.entries if e.id in run.changed))
    files = [str(run.root / t) for t in entry_targets(run.root, [chosen])]
    commands = _write_commands(run)
    if commands is not None:
        files.append(str(commands))
    write_json(
        run.select_file,
        {
            "root": str(run.root),
            "suite": str(run.root / m.path),
            "shard": list(run.shard) if run.shard else None,
            "durations": str(run.opts.durations.resolve()) if run.opts.durations else None,
            "changed": run.changed,
            "max_cards": run.opts.max_cards,
            "flaky": any(e.flaky for e in m.entries),
            "files": files,  # the paths below; any other is the caller's, and narrows the run
            "partial": chosen is not m,  # files of some entries: whole-suite rules not judged
        },
        indent=None,
    )
    # The caller's arguments as they are, pytest running where harness run was started (their
    # relative paths mean what they mean there); the run's own JUnit path and workers go
    # through the selection plugin, which applies them where the caller made no choice.
    cmd = [sys.executable, "-c", _PYTEST_FROM_ROOT, str(run.root), *files, *run.opts.pytest_args]
    cmd += _config_args(run)
    cmd += ["-p", "harness.suites.selection", f"{names.OPT_SELECT}={run.select_file}"]
    if commands is not None:
        cmd.append(f"{names.OPT_COMMANDS}={commands}")
    cmd += [
        f"{names.OPT_JUNIT}={run.out / 'junit.xml'}",
        "-o",
        "junit_duration_report=total",
        "--continue-on-collection-errors",
    ]
    if _XDIST_INSTALLED:  # workers even at -n 1: a case that kills its process fails alone
        cmd.append(f"{names.OPT_WORKERS}={run.workers}")
    if m.device != "cpu":
        cmd.append(f"{names.OPT_REQUIRE}={m.device}")
    return cmd


_CONFIG_OPTIONS = ("-c", "--config-file", "--inifile")


def _config_args(run: _Run) -> list[str]:
    """Arguments that pin the run's pytest configuration and plugins: ``-c`` unless the caller
    named one (pytest looks for it before plugins declare their options, so a value such as
    ``--harness-lease-dir DIR``'s would count as a path); with autoloading off, ``-p``."""
    given = [*shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), *run.opts.pytest_args]
    out = [f"--rootdir={run.root}"]
    inipath = _inipath(run.root)
    if inipath is not None and not option_values(given, _CONFIG_OPTIONS):
        out += ["-c", str(inipath)]
    out += plugin_args(given)
    if autoload_disabled(given):
        out += ["-p", selection.TIMEOUT_PLUGIN]
        if any(e.flaky for e in run.manifest.entries):
            out += ["-p", selection.RERUN_PLUGIN]
    return out


def _inipath(root: Path) -> Path | None:
    """The pytest configuration file in ``root``, found as pytest looks in a folder."""
    import configparser

    import tomllib

    for name, section in _INI_FILES:
        path = root / name
        with contextlib.suppress(OSError, ValueError, configparser.Error):
            if path.suffix == ".toml":
                found = section in tomllib.loads(path.read_text(encoding="utf-8")).get("tool", {})
            else:
                (cfg := configparser.ConfigParser(interpolation=None)).read(path, "utf-8")
                found = not section or cfg.has_section(section)
            if found and path.is_file():
                return path
    return None


#: pytest's configuration files, in the order it looks, with the section it reads.
_INI_FILES = (
    ("pytest.ini", ""), (".pytest.ini", ""), ("pyproject.toml", "pytest"),
    ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest"),
)  # fmt: skip


@dataclass
class _Ran:
    """What phase 3 left for the report: pytest's exit code, its records, why the run
    stopped it (``""``: it did not)."""

    code: int
    records: selection.Records
    halted: str


def _execute(run: _Run, stop: _Stop) -> _Ran:
    """Phase 3: the run's pytest, until it ends, a stop signal or the run's budget."""
    budget = f"bounded by {run.budget.name}" if run.budget else "no time budget (CI unset)"
    print(
        f"{run.title}: planned by pytest's own collection, on {run.manifest.device}; up to "
        f"{run.workers} xdist worker(s) unless pytest's -n says otherwise; {budget}; output "
        f"in {run.out}",
        flush=True,
    )
    # What a pytest that died left in a session of its own comes here, to be stopped; an
    # in-process caller gets its subreaper state back and its own processes are spared.
    was_subreaper = processes.is_subreaper()
    processes.subreaper()
    try:
        before = processes.descendants()
        code, halted = _run_pytest(_pytest_command(run), run.budget, stop)
        left = processes.stop_leftovers(
            before, settle=LEFTOVER_GRACE_S, grace=KILL_AFTER_S, kill_wait=KILL_AFTER_S
        )
        if left:
            _print(f"{len(left)} process(es) outlived pytest; stopped them:")
            for leftover in left:
                print(f"  {leftover}", flush=True)
        return _Ran(code, selection.read_records(run.select_file), halted)
    finally:
        if not was_subreaper:
            processes.subreaper(False)


_USAGE_ERROR = 4  # pytest's ExitCode.USAGE_ERROR


def _verdict(total: report.EntryRow, ran: _Ran, stop: _Stop, whole: bool) -> list[str]:
    """Why the run is red (empty: green). Cases pytest's own options deselected or left unrun
    are the caller's choice, unless none of a ``whole`` suite's is left to run; a case that
    ends the session (``pytest.exit``, even with status 0) fails the run."""
    narrowed = bool(total.deselected or total.not_run or ran.records.options.get("narrowed"))
    verdict = [f"interrupted by {stop.name}"] if stop.signum is not None else []
    if total.failed:
        verdict.append(f"{total.failed} failed")
    if total.missing:
        verdict.append(f"{total.missing} planned case(s) never ran")
    if ran.records.plan is None and stop.signum is None:
        verdict.append("pytest ended before its collection planned the run")
    elif not (total.passed or total.flaky or total.quarantined) and not narrowed:
        verdict.append(f"no case passed ({total.skipped} skipped)")
    absent = ran.records.options.get("not_found", ())
    if absent:  # under xdist pytest only says "no tests ran"
        verdict.append(f"paths given to pytest are not there: {', '.join(absent)}")
    elif whole and total.deselected == total.cases and stop.signum is None and ran.records.plan:
        verdict.append("the paths and options given to pytest select no case of the run: none ran")
    if stop.signum is not None:
        return verdict
    timed_out = ran.code == TIMED_OUT and ran.halted.startswith("stopped at")
    if timed_out:
        verdict.append(ran.halted)
    elif ran.records.interrupted:
        verdict.append(f"a case ended pytest's session ({ran.records.interrupted})")
    if ran.code not in (0, 1, 5) and not timed_out:
        usage = " (a usage error: see pytest's message above)" if ran.code == _USAGE_ERROR else ""
        verdict.append(f"pytest exited with {ran.code}{usage}")
    if ran.code == 1 and not total.failed and not total.quarantined:
        # Something else failed the run (--cov-fail-under, say), said by pytest above.
        verdict.append("pytest exited with 1 though no case failed (see its output)")
    return verdict


def _report(run: _Run, ran: _Ran, stop: _Stop) -> int:
    """Phase 4: complete the JUnit file, write the summaries, ``plan.json`` and durations;
    returns the exit code."""
    junit = run.out / "junit.xml"
    records, halted = ran.records, ran.halted
    plan = records.plan or {}
    if plan.get("refused"):
        print("\n".join(plan["refused"]), file=sys.stderr)
        if stop.signum is None:
            return EXIT_USAGE
    for warning in plan.get("warnings", ()):
        print(f"harness run: warning: {warning}", file=sys.stderr)
    planned = [(n, e, cards) for n, e, cards in plan.get("cases", ())]
    if plan and not planned and stop.signum is None and not records.options.get("narrowed"):
        return _nothing_to_run(run, plan)
    write_json(
        run.out / "plan.json",
        {"suite": run.manifest.suite, "shard": run.opts.shard, "cases": [p[:2] for p in planned]},
    )
    if ran.code == _USAGE_ERROR:
        halted = halted or "pytest stopped on a usage error (exit status 4)"
    results = report.results_from_records([n for n, _, _ in planned], records, halted)
    results = report.quarantine(results, plan.get("quarantine", {}))
    prefix = records.options.get("junit_prefix") or ""
    report.complete_junit(junit, results.values(), prefix, records.aliases)
    asked = records.options.get("junitxml")
    if asked:  # the run's own JUnit path replaced the caller's --junitxml
        Path(asked).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(junit, asked)
    rows = report.summarize(planned, results)
    table = report.render(rows, run.title, time.monotonic() - run.started)
    verdict = _verdict(report.totals(rows), ran, stop, plan.get("whole", True))
    detail = report.failures(results)
    detail += report.bullets([f"left running: `{n}` — {t}" for n, t in records.leaked.items()])
    for headline, log in selection.fired(run.out):
        detail += f"- backstop: {headline}; stacks in {log}\n"
    outside = sorted(records.unplanned) if records.options.get("narrowed") else []
    not_here = _not_here(run, plan) + report.bullets(
        [report.NOT_IN_SUITE.format(n=n, suite=run.manifest.suite) for n in outside]
    )
    text = (
        table
        + ("\n" + detail if detail else "")
        + ("\n" + not_here if not_here else "")
        + (f"\n**FAILED**: {'; '.join(verdict)}\n" if verdict else "\n**PASSED**\n")
    )
    print("\n" + text, flush=True)
    write_text(run.out / "summary.md", text)
    _step_summary(text)
    report.write_summary_json(
        run.out / "summary.json", run.title, rows, results, prefix, _context(run, ran)
    )
    if run.opts.durations_out:
        # Passed cases only: a failure says little about how long the case takes.
        passed = {n: r.seconds for n, r in results.items() if r.outcome == "passed"}
        write_durations(run.opts.durations_out, run.manifest.suite, passed)
        _print(f"recorded {len(passed)} duration(s) in {run.opts.durations_out}")
    # The last line: the summary above, and the header naming the folder, scroll away.
    said = f"FAILED ({'; '.join(verdict)})" if verdict else "PASSED"
    print(f"{run.title}: {said}; summary {run.out / 'summary.md'}, JUnit {junit}", flush=True)
    if stop.signum is not None:
        return stop.exit_code
    return EXIT_FAILED if verdict else EXIT_OK


def _not_here(run: _Run, plan: dict[str, Any]) -> str:
    """Markdown lines for the cases ``--max-cards`` left out."""
    return "".join(
        f"- not run here (needs {cards} cards > --max-cards {run.opts.max_cards}): `{n}`\n"
        for n, cards in plan.get("too_big", ())
    )


def _nothing_to_run(run: _Run, plan: dict[str, Any] | None = None) -> int:
    """The reports of a run with no case to run (green)."""
    not_here = _not_here(run, plan or {})
    text = f"### {run.title}\n\nnothing to run\n" + (f"\n{not_here}" if not_here else "")
    write_text(run.out / "summary.md", text)
    _step_summary(text)
    # The files a CI job uploads or parses exist on every green run, empty here.
    report.complete_junit(run.out / "junit.xml", [])
    report.write_summary_json(run.out / "summary.json", run.title, [], {})
    plan_json = {"suite": run.manifest.suite, "shard": run.opts.shard, "cases": []}
    write_json(run.out / "plan.json", plan_json)
    print(f"{run.title}: nothing to run; summary {run.out / 'summary.md'}", flush=True)
    return EXIT_OK


def _context(run: _Run, ran: _Ran) -> dict[str, Any]:
    """Where and under what load the cases took their time (``harness durations`` warns of a
    mix): the runner class planned onto, pytest's xdist workers, this host's CPUs and cards."""
    from harness.devices import cpu_count

    workers = ran.records.options.get("workers")
    return {
        "runner": (ran.records.plan or {}).get("runner"),
        "workers": workers if isinstance(workers, int) else run.workers,
        "cpus": cpu_count(),
        "cards": leasable_cards(run.manifest.device),
    }


def run_suite(root: Path, opts: RunOptions) -> int:
    """Run one suite (or shard); returns the process exit code.

    :data:`EXIT_OK`: every planned case passed, was flaky, skipped or quarantined, and one
    ran (or none needed to); :data:`EXIT_FAILED`: a case failed, went missing, or none
    passed; :data:`EXIT_USAGE`: the suite cannot be planned (inventory problems, bad
    arguments); 128 + N after signal N: pytest's tree is stopped and reaped, and the summary
    of what ran is written.
    """
    with _Stop() as stop:
        run: _Run | None = None
        try:
            run = _plan_run(root.resolve(), opts, time.monotonic())
        except _Refused as e:
            if stop.signum is None:
                print(e, file=sys.stderr)
                return EXIT_USAGE
        if run is None or stop.signum is not None:
            _print(f"{stop.name}: stopped before any case ran")
            return stop.exit_code
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(claim_out(run.out, run.title))
            except _Refused as e:
                print(e, file=sys.stderr)
                return EXIT_USAGE
            _prepare_out(run)
            if run.changed == []:  # --changed-from selects no entry: no pytest to start
                return _nothing_to_run(run)
            return _report(run, _execute(run, stop), stop)


def _step_summary(text: str) -> None:
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text + "\n")
