"""The ``harness`` command (also ``python -m harness``): one ``_add_<name>`` per subcommand in
:data:`SUBCOMMANDS` (docs/suites.md, "The harness command", says what each does)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

from harness.names import EXIT_FAILED, EXIT_OK, EXIT_USAGE, WARNING_RULES
from harness.suites import changes
from harness.suites.durations import DurationsError, refresh
from harness.suites.init import add_parser as _add_init
from harness.suites.inventory import build_inventory
from harness.suites.manifest import find_root, suite_name
from harness.suites.plan import PlanError, plan_suite
from harness.suites.run import RunOptions, load_suite, run_suite
from harness.suites.workflows import DISTRIBUTION


def number(
    kind: type[int] | type[float], *, minimum: float, above: bool = False
) -> Callable[[str], float]:
    """An argparse ``type=`` for a finite ``kind`` ``>= minimum`` (``> minimum`` when ``above``):
    anything else is a usage error (exit 2) naming the value and the bound."""
    expected = f"expected {'an integer' if kind is int else 'a finite number'} {'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value" messages
    return parse


class _VersionAction(argparse.Action):
    # Reading distribution metadata costs tens of ms: only when asked.
    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib import metadata

        try:
            print(f"{parser.prog} {DISTRIBUTION} {metadata.version(DISTRIBUTION)}")
        except metadata.PackageNotFoundError:
            print(f"{parser.prog} unknown (not installed)")
        parser.exit()


def _add_inventory(sub: argparse._SubParsersAction) -> None:
    inv = sub.add_parser("inventory", help="list every case and check suite ownership and fit")
    inv.add_argument(
        "suites", nargs="*", metavar="SUITE", help="suite names or manifest paths (default: all)"
    )
    inv.add_argument(
        "--json",
        action="store_true",
        help='print {"cases": [...], "errors": [...], "warnings": [...]}',
    )
    inv.add_argument(
        "--cases", action="store_true", help="list every case, not one line per suite entry"
    )
    inv.add_argument(
        "-q", "--quiet", action="store_true", help="print only problems and the count line"
    )
    inv.set_defaults(handler=_cmd_inventory)


def _add_run(sub: argparse._SubParsersAction) -> None:
    # allow_abbrev=False: pytest's options (`--durations 5`, `-vx`) pass through unchanged,
    # never taken for an abbreviation of one of ours.
    run = sub.add_parser(
        "run",
        help="run a suite (or one shard of it) through pytest",
        allow_abbrev=False,
        usage="harness run SUITE [options] [PYTEST_ARGS] [-- PYTEST_ARGS]",
        description="Options harness run does not know are pytest's: they go to pytest "
        "as they are, and so does everything after --.",
    )
    run.add_argument("suite", metavar="SUITE")
    run.add_argument(
        "--shard", metavar="I/N", help="run shard I of N (the partition `harness matrix` plans)"
    )
    run.add_argument(
        "--changed-from",
        metavar="REF",
        help="run only the entries the change since git REF's merge base affects",
    )
    run.add_argument(
        "--durations-out",
        type=Path,
        metavar="FILE",
        help="record each passed case's seconds into FILE (merged), for the planner",
    )
    run.add_argument(
        "--durations-file",
        dest="durations",
        type=Path,
        metavar="FILE",
        help="recorded durations to plan with (default: suites/durations/SUITE.json); "
        "`--durations N` is pytest's",
    )
    run.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where junit.xml and the summary go (default: out/harness/SUITE[-IofN])",
    )
    run.add_argument(
        "--workers",
        type=number(int, minimum=1),
        metavar="N",
        help="xdist workers (default: sized to cards / slots)",
    )
    run.add_argument(
        "--max-cards",
        type=number(int, minimum=0),
        metavar="N",
        help="run only cases needing at most N cards (a machine smaller than the suite's runners); "
        "the others are listed as not run",
    )
    run.add_argument(
        "--timeout-minutes",
        type=number(float, minimum=0, above=True),
        metavar="M",
        help="stop the run after M minutes (default: the runner's timeout_minutes in CI, "
        "where CI is set; no limit elsewhere)",
    )
    run.set_defaults(handler=_cmd_run, takes_pytest_args=True)


def _add_matrix(sub: argparse._SubParsersAction) -> None:
    mx = sub.add_parser("matrix", help="print the GitHub Actions matrix JSON for a suite")
    mx.add_argument("suite", metavar="SUITE")
    size = mx.add_mutually_exclusive_group()
    size.add_argument("--shards", type=number(int, minimum=1), metavar="N", help="exactly N shards")
    size.add_argument(
        "--target-minutes",
        type=number(float, minimum=0, above=True),
        metavar="M",
        help="the fewest shards of at most M planned minutes each",
    )
    mx.add_argument(
        "--durations-file",
        "--durations",
        dest="durations",
        type=Path,
        metavar="FILE",
        help="recorded durations (default: suites/durations/SUITE.json when present)",
    )
    mx.add_argument(
        "--changed-from",
        metavar="REF",
        help="only the shards holding a case of an entry the change since git REF's merge base "
        'affects (shard labels stay those of the whole suite); none: {"include": []}',
    )
    mx.add_argument(
        "--indent", type=number(int, minimum=0), default=None, help="pretty-print the JSON"
    )
    mx.set_defaults(handler=_cmd_matrix)


def _add_durations(sub: argparse._SubParsersAction) -> None:
    du = sub.add_parser(
        "durations",
        help="fold the case durations of `harness run` outputs into suites/durations/SUITE.json",
        description="Each OUT_DIR is searched for `harness run` output folders (plan.json next "
        "to junit.xml), e.g. a CI run's downloaded artifacts; each case's share of its run's "
        "wall time is merged into suites/durations/SUITE.json, which the planner balances on.",
    )
    du.add_argument("dirs", nargs="+", type=Path, metavar="OUT_DIR", help="harness run outputs")
    du.add_argument(
        "--prune", action="store_true", help="drop node ids the suite no longer collects"
    )
    du.set_defaults(handler=_cmd_durations)


#: One function per subcommand, in help order, adding its parser with its ``handler`` (and
#: ``takes_pytest_args`` / ``root_is_cwd`` through ``set_defaults`` where they are true).
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_inventory,
    _add_run,
    _add_matrix,
    _add_durations,
    _add_init,
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description="Declarative accelerator test matrix.")
    p.add_argument(
        "--version", action=_VersionAction, nargs=0, help="print the harness version and exit"
    )
    above = "the nearest directory above the working one with suites/"
    p.add_argument("--root", type=Path, default=None, help=f"repository root (default: {above})")
    p.set_defaults(takes_pytest_args=False, root_is_cwd=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    for command in sub.choices.values():  # before or after the subcommand alike
        here = "the working directory" if command.get_default("root_is_cwd") else above
        command.add_argument(
            "--root",
            type=Path,
            default=argparse.SUPPRESS,
            help=f"repository root (default: {here})",
        )
    return p


def _cmd_inventory(root: Path, args: argparse.Namespace) -> int:
    inv = build_inventory(root, args.suites or None)
    listed = inv.as_dict([suite_name(s) for s in args.suites] or None)
    warned = sum(p.rule in WARNING_RULES for p in inv.problems)
    code = EXIT_FAILED if len(inv.problems) > warned else EXIT_OK
    if args.json:
        print(json.dumps(listed, indent=1))
        return code
    cases = listed["cases"]
    if cases and args.cases and not args.quiet:
        w = min(max(len(c["nodeid"]) for c in cases), 110)
        print(f"{'CASE':<{w}}  DEVICE NPROC CARDS  ENTRIES")
        for c in cases:
            entries = ",".join(c["entries"]) or "-"
            print(
                f"{c['nodeid']:<{w}}  {c['device']:<6} {c['nproc']:>5} {c['cards']:>5}  {entries}"
            )
    elif cases and not args.quiet:  # one line per owning entry: cases, devices, most ranks / cards
        rows: dict[str, list[dict]] = {}
        for c in cases:
            for e in c["entries"] or ["-"]:
                rows.setdefault(e, []).append(c)
        w = max(len("ENTRY"), *(len(e) for e in rows))
        print(f"{'ENTRY':<{w}}  CASES  DEVICES     NPROC CARDS")
        for e, cs in rows.items():
            devices = ",".join(sorted({c["device"] for c in cs}))
            nproc, cards = (max(c[k] for c in cs) for k in ("nproc", "cards"))
            print(f"{e:<{w}}  {len(cs):>5}  {devices:<11} {nproc:>5} {cards:>5}")
    per_suite = Counter(s for c in cases for s in {e.split(":", 1)[0] for e in c["entries"]})
    counts = ", ".join(f"{s} {n}" for s, n in sorted(per_suite.items())) or "none"
    for p in inv.problems:
        print(f"{'warning' if p.rule in WARNING_RULES else 'error'}: {p}", file=sys.stderr)
    print(
        f"{len(cases)} case(s); per suite: {counts}; {len(inv.problems) - warned} problem(s)"
        + (f", {warned} warning(s)" if warned else "")
    )
    return code


def _cmd_matrix(root: Path, args: argparse.Namespace) -> int:
    loaded = load_suite(root, args.suite, "matrix")
    if loaded is None:
        return EXIT_USAGE
    suite, inv = loaded
    m, selected, owned = inv.manifests[suite], None, inv.suite_cases(suite)
    size = {"shards": args.shards, "target_minutes": args.target_minutes}
    try:
        result = plan_suite(root, m, owned, durations=args.durations, **size)
        if args.changed_from:
            changed = changes.changed_files(root, args.changed_from)
            sel = changes.select(m.entries, *changed, run_everything_on=m.run_everything_on)
            print(
                f"harness matrix: --changed-from {args.changed_from}: {sel.reason}", file=sys.stderr
            )
            selected = sel.entries
        rows = result.matrix(selected)["include"]
        # allow_nan=False: a value that is not a number is an error here, never invalid JSON for CI.
        compact = None if args.indent else (",", ":")
        text = json.dumps(
            {"include": rows}, indent=args.indent, separators=compact, allow_nan=False
        )
    except ValueError as e:  # PlanError is one
        print(f"harness matrix: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    for warning in result.warnings:
        print(f"harness matrix: warning: {warning}", file=sys.stderr)
    loads = ", ".join(f"{r['shard']} {r['estimated_minutes']:.1f} min" for r in rows)
    if selected is None:
        planned = f"{len(owned)} case(s) in {len(rows)} shard(s): {loads}; "
        planned += f"longest/mean {result.balance():.3f}"
    else:  # what the matrix holds: the affected cases' shards, not the whole suite's
        planned = f"{sum(r['cases'] for r in rows)} affected case(s) in {len(rows)} of "
        planned += f"{len(result.shards)} shard(s)" + (f": {loads}" if rows else "")
    print(f"harness matrix: {suite}: {planned}", file=sys.stderr)
    return EXIT_OK


def _cmd_durations(root: Path, args: argparse.Namespace) -> int:
    try:
        lines = refresh(root, args.dirs, prune=args.prune)
    except (DurationsError, PlanError) as e:
        print(f"harness durations: {e}", file=sys.stderr)
        return EXIT_USAGE
    for line in lines:
        print(line, file=sys.stderr if line.startswith("note: ") else sys.stdout)
    return EXIT_OK


def _cmd_run(root: Path, args: argparse.Namespace) -> int:
    # Every RunOptions field is an option of `harness run` of the same name.
    return run_suite(
        root, RunOptions(**{f.name: getattr(args, f.name) for f in fields(RunOptions)})
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The ``harness`` command (``harness.suites.entry`` checks its dependencies first);
    returns the exit code: usage errors 2, Ctrl-C 130 and a closed stdout (``| head``) 141,
    as a shell shows SIGINT and SIGPIPE, without a traceback. ``harness run`` passes the
    options it does not know, and everything after the first ``--``, to pytest."""
    try:
        code = _main(argv)
        if sys.stdout is not None:  # a closed stdout (`>&-`) has none
            sys.stdout.flush()  # a reader gone (`| head`) shows here, not as an error at exit
        return code
    except BrokenPipeError:
        # stdout goes nowhere from here on, so that Python's flush at exit does not fail again.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    i = argv.index("--") if "--" in argv else len(argv)
    argv, extra = argv[:i], argv[i + 1 :]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if not args.takes_pytest_args:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if extra:
            parser.error("only `harness run` takes pytest arguments after --")
    args.pytest_args = [*unknown, *extra]
    root = (args.root or (Path.cwd() if args.root_is_cwd else find_root())).resolve()
    try:
        return args.handler(root, args)
    except KeyboardInterrupt:  # Ctrl-C: stop without a traceback, with the shell's code
        print(f"harness {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
