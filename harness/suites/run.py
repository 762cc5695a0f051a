"""``harness run``: run a suite's planned cases through pytest and the harness plugin.

The suite is inventoried in-process (collect only), narrowed by
``--changed-from``, planned and cut to the requested shard, then run in a
pytest subprocess per distinct entry ``timeout_s`` (passed as
``--harness-timeout``), with xdist workers sized to the cards (accelerator
suites) or process slots (cpu) this host can lease, and ``-p
harness.suites.selection`` so that exactly the planned cases run. Accelerator suites
pass ``--harness-require DEVICE``: a runner without cards goes red, not green.

Outputs, in ``--out`` (default ``out/harness/<suite>[-<i>of<n>]``):
``junit.xml``, ``summary.md``, ``summary.json``, ``plan.json``; the summary
table also goes to stdout and, when set, ``$GITHUB_STEP_SUMMARY``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.suites import changes, report, selection
from harness.suites.inventory import Case, Inventory, build_inventory
from harness.suites.manifest import Entry, Manifest
from harness.suites.plan import (
    PlanError,
    default_durations_path,
    estimate,
    load_durations,
    parse_shard,
    partition,
    write_durations,
)

#: Deadline of a plain (in-process) case whose entry sets no ``timeout_s``;
#: the watchdog fires this long plus a grace after the case starts.
PLAIN_CASE_DEADLINE_S = 600.0

# pytest options that narrow or stop a run: with these, planned cases that did
# not run are expected, not missing.
_NARROWING = ("-k", "-m", "-x", "--exitfirst", "--maxfail", "--lf", "--last-failed", "--sw",
              "--stepwise", "--deselect")
_XDIST = ("-n", "--numprocesses", "--dist", "-d")
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
    pytest_args: list[str] = field(default_factory=list)


def _print(msg: str) -> None:
    print(f"harness: {msg}", flush=True)


def _cpu_slots() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _option_value(args: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _has_option(args: Sequence[str], names: Sequence[str]) -> bool:
    return any(a == n or a.startswith(n + "=") or (len(n) == 2 and a.startswith(n) and len(a) > 2)
               for a in args for n in names)


def leasable_cards(device: str) -> int:
    """Cards of ``device`` this host offers (``HARNESS_CARDS`` or the runtime); 0 for cpu."""
    if device == "cpu":
        return 0
    try:
        from harness import devices
    except ImportError:
        return 0
    return len(devices.inventory(device))


def worker_count(device: str, cases: Sequence[Case], pytest_args: Sequence[str], requested: int | None = None) -> int:
    """xdist workers for a run: one per process slot on cpu (``--harness-max-procs``,
    else the CPUs this process may use); on accelerators as many as the
    leasable cards allow for the smallest case, at most one per slot; never
    more than there are cases, never fewer than one."""
    if requested:
        return max(1, requested)
    slots = _cpu_slots()
    given = _option_value(pytest_args, "--harness-max-procs")
    if given and given.isdigit():
        slots = max(1, int(given))
    if device == "cpu":
        n = slots
    else:
        need = min((c.cards for c in cases), default=1) or 1
        n = min(slots, max(1, leasable_cards(device) // need))
    return max(1, min(n, len(cases)))


def _default_out(root: Path, suite: str, shard: tuple[int, int] | None) -> Path:
    name = suite if shard is None else f"{suite}-{shard[0]}of{shard[1]}"
    return root / "out" / "harness" / name


def load_suite(root: Path, suite: str, command: str) -> tuple[str, Inventory] | None:
    """The name and inventory of one suite, or None after printing why it cannot be planned.

    ``suite`` is a suite name or a manifest path. Ownership of files is the
    inventory job's business: only problems that make this suite unplannable
    or unrunnable count here.
    """
    name = Path(suite).stem if suite.endswith(".json") else suite
    inv = build_inventory(root, [suite], check_ownership=False)
    problems = [
        p for p in inv.problems
        if p.suite in (name, None) and p.rule not in ("unowned-file", "unowned-case")
    ]
    if problems or name not in inv.manifests:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        print(f"harness {command}: suite {suite!r} cannot be planned; see `harness inventory {name}`",
              file=sys.stderr)
        return None
    return name, inv


def plan_cases(
    root: Path, m: Manifest, owned: Sequence[tuple[Case, Entry]], durations: Path | None,
    shard: tuple[int, int] | None,
) -> list[tuple[Case, Entry]]:
    """The cases of one shard (all of ``owned`` when ``shard`` is None), in collection order."""
    if shard is None:
        return list(owned)
    recorded = load_durations(durations or default_durations_path(root, m.suite))
    planned = estimate([(c.nodeid, e.id, c.cards, e.estimated_s) for c, e in owned], recorded)
    shards = partition(planned, m.runners, shard[1])
    mine = {p.nodeid for p in shards[shard[0] - 1].cases}
    return [(c, e) for c, e in owned if c.nodeid in mine]


def _run_pytest(cmd: list[str], root: Path, limit_s: float) -> int:
    """Run one pytest subprocess, output streaming through; past ``limit_s`` its
    whole process tree is terminated, then killed."""
    proc = subprocess.Popen(cmd, cwd=root)
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        _print(f"pytest ran past {limit_s / 60:.0f} min (the runner's timeout); stopping it")
        import psutil

        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(tree, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        return 124
    except KeyboardInterrupt:
        # The child got the same SIGINT; let it write its reports and exit.
        proc.wait()
        raise


def run_suite(root: Path, opts: RunOptions) -> int:
    """Run one suite (or shard); returns the process exit code.

    0: every planned case passed or skipped and at least one passed (or
    nothing needed to run); 1: a case failed, went missing, or nothing passed;
    2: the suite cannot be planned (inventory problems, bad arguments).
    """
    t0 = time.monotonic()
    root = root.resolve()
    try:
        shard = parse_shard(opts.shard) if opts.shard else None
    except PlanError as e:
        print(f"harness run: {e}", file=sys.stderr)
        return 2
    loaded = load_suite(root, opts.suite, "run")
    if loaded is None:
        return 2
    suite_name, inv = loaded
    m = inv.manifests[suite_name]
    owned = inv.suite_cases(suite_name)

    if opts.changed_from:
        sel = changes.select(m.entries, changes.changed_files(root, opts.changed_from))
        _print(f"--changed-from {opts.changed_from}: {sel.reason}")
        owned = [(c, e) for c, e in owned if e.id in sel.entries]
    try:
        cases = plan_cases(root, m, owned, opts.durations, shard)
    except PlanError as e:
        print(f"harness run: {e}", file=sys.stderr)
        return 2

    too_big: list[Case] = []
    if opts.max_cards is not None:
        # A smaller machine than the suite's runners (a workstation, a device
        # check): run what fits and say what did not, rather than fail it.
        too_big = [c for c, _ in cases if c.cards > opts.max_cards]
        cases = [(c, e) for c, e in cases if c.cards <= opts.max_cards]
    not_here = "".join(
        f"- not run here (needs {c.cards} cards > --max-cards {opts.max_cards}): `{c.nodeid}`\n" for c in too_big
    )

    out = (opts.out or _default_out(root, m.suite, shard)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("watchdog-*.log"):
        stale.unlink()  # a previous run's; this run reports its own
    title = f"harness run {m.suite}" + (f" (shard {shard[0]}/{shard[1]})" if shard else "")
    (out / "plan.json").write_text(
        json.dumps({"suite": m.suite, "shard": opts.shard, "cases": [[c.nodeid, e.id] for c, e in cases]}, indent=1)
        + "\n",
        encoding="utf-8",
    )
    if not cases:
        text = f"### {title}\n\nnothing to run\n" + (f"\n{not_here}" if not_here else "")
        _print(f"{title}: nothing to run")
        (out / "summary.md").write_text(text, encoding="utf-8")
        _step_summary(text)
        return 0

    workers = worker_count(m.device, [c for c, _ in cases], opts.pytest_args, opts.workers)
    user_xdist = _has_option(opts.pytest_args, _XDIST) or "no:xdist" in opts.pytest_args
    entries = list(dict.fromkeys(e.id for _, e in cases))
    _print(
        f"{title}: {len(cases)} case(s) in {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} on {m.device}; "
        f"{'xdist as given' if user_xdist else f'{workers} xdist worker(s)'}; output in {out}"
    )

    groups: dict[float | None, list[tuple[Case, Entry]]] = {}
    for c, e in cases:
        groups.setdefault(e.timeout_s, []).append((c, e))
    junits: list[Path] = []
    codes: list[int] = []
    limit_s = max(r.timeout_minutes for r in m.runners) * 60.0
    for k, (timeout, group) in enumerate(sorted(groups.items(), key=lambda kv: kv[0] or 0), 1):
        select_file = out / f"select-{k}.json"
        deadline = timeout or PLAIN_CASE_DEADLINE_S
        select_file.write_text(
            json.dumps({"root": str(root), "cases": {c.nodeid: deadline for c, _ in group}}), encoding="utf-8"
        )
        junit = out / f"junit-{k}.xml"
        junit.unlink(missing_ok=True)
        # The caller's pytest arguments first: where they clash with ours
        # (--junitxml), ours come later and win, so the run can be read back.
        cmd = [sys.executable, "-m", "pytest", *sorted({c.file for c, _ in group}), *opts.pytest_args]
        cmd += ["-p", "harness.suites.selection", f"--harness-select={select_file}", f"--rootdir={root}"]
        cmd += [f"--junitxml={junit}", "-o", "junit_duration_report=total"]
        if not user_xdist and _XDIST_INSTALLED:
            # One case gains nothing from a worker process; more keep the
            # worker boundary even at -n 1, so a case that kills its process
            # fails alone.
            cmd += ["-n", str(min(workers, len(group)) if len(group) > 1 else 0)]
        if timeout is not None:
            cmd.append(f"--harness-timeout={timeout:g}")
        if m.device != "cpu":
            cmd.append(f"--harness-require={m.device}")
        if len(groups) > 1:
            _print(f"group {k}/{len(groups)}: {len(group)} case(s), timeout {timeout or 'default'}")
        codes.append(_run_pytest(cmd, root, limit_s))
        junits.append(junit)

    junit_all = out / "junit.xml"
    report.merge_junit(junits, junit_all)
    asked = _requested_junit(opts.pytest_args)
    if asked is not None:
        # Our own --junitxml overrode the caller's; give them the merged file too.
        asked.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(junit_all, asked)
    results = report.results_for([c.nodeid for c, _ in cases], report.read_junit(junits))
    rows = report.summarize([(c.nodeid, e.id, c.cards) for c, e in cases], results)
    wall = time.monotonic() - t0
    table = report.render(rows, title, wall)
    total = report.totals(rows)
    narrowed = _has_option(opts.pytest_args, _NARROWING)
    verdict = []
    if total.failed:
        verdict.append(f"{total.failed} failed")
    if total.missing and not narrowed:
        verdict.append(f"{total.missing} planned case(s) never ran")
    if not total.passed and not narrowed:
        verdict.append(f"no case passed ({total.skipped} skipped)")
    bad_codes = [c for c in codes if c not in (0, 1, 5)]
    if bad_codes:
        verdict.append(f"pytest exited with {', '.join(map(str, bad_codes))}")
    detail = report.failures(results)
    for headline, log in selection.fired(out):
        detail += f"- watchdog: {headline}; stacks in {log}\n"
    text = table + ("\n" + detail if detail else "") + ("\n" + not_here if not_here else "") + (
        f"\n**FAILED**: {'; '.join(verdict)}\n" if verdict else "\n**PASSED**\n"
    )
    print("\n" + text, flush=True)
    (out / "summary.md").write_text(text, encoding="utf-8")
    report.write_summary_json(out / "summary.json", title, rows, results)
    _step_summary(text)
    if opts.durations_out:
        # Passed cases only: a failure (at setup, say) says little about how long the case takes.
        ran = {n: r.seconds for n, r in results.items() if r.outcome == "passed"}
        write_durations(opts.durations_out, m.suite, ran)
        _print(f"recorded {len(ran)} duration(s) in {opts.durations_out}")
    return 1 if verdict else 0


def _requested_junit(pytest_args: Sequence[str]) -> Path | None:
    """The JUnit path the caller asked pytest for (``-- --junitxml=X`` or in
    ``$PYTEST_ADDOPTS``), the last one winning as in pytest; ``None`` if none."""
    args = [*shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), *pytest_args]
    found = None
    for i, a in enumerate(args):
        for name in ("--junitxml", "--junit-xml"):
            if a == name and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(name + "="):
                found = a.split("=", 1)[1]
    return Path(found).resolve() if found else None


def _step_summary(text: str) -> None:
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text + "\n")
