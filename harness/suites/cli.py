"""The ``harness`` command (also ``python -m harness``).

- ``harness inventory [SUITE ...] [--json]``: every case with its device,
  ranks, cards and owning entries; exit 1 naming the rule, file and case of
  each problem.
- ``harness run SUITE [--shard I/N] [--changed-from REF] [--durations-out FILE] [-- PYTEST_ARGS]``.
- ``harness matrix SUITE [--shards N | --target-minutes M]``: the GitHub
  Actions matrix JSON, on one line (ready for ``$GITHUB_OUTPUT``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.suites.inventory import Inventory, build_inventory
from harness.suites.manifest import find_root
from harness.suites.plan import PlanError, default_durations_path, estimate, load_durations, plan
from harness.suites.run import RunOptions, load_suite, run_suite


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description="Declarative accelerator test matrix.")
    p.add_argument("--root", type=Path, default=None,
                   help="repository root (default: the nearest directory above the working one with suites/)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inv = sub.add_parser("inventory", help="list every case and check suite ownership and fit")
    inv.add_argument("suites", nargs="*", metavar="SUITE", help="suite names or manifest paths (default: all)")
    inv.add_argument("--json", action="store_true", help='print {"cases": [...], "errors": [...]}')
    inv.add_argument("-q", "--quiet", action="store_true", help="print only problems and the count line")

    run = sub.add_parser("run", help="run a suite (or one shard of it) through pytest",
                         usage="harness run SUITE [options] [-- PYTEST_ARGS]")
    run.add_argument("suite", metavar="SUITE")
    run.add_argument("--shard", metavar="I/N", help="run shard I of N (the partition `harness matrix` plans)")
    run.add_argument("--changed-from", metavar="REF",
                     help="run only the entries the change since git REF's merge base affects")
    run.add_argument("--durations-out", type=Path, metavar="FILE",
                     help="record each passed case's seconds into FILE (merged), for the planner")
    run.add_argument("--durations", type=Path, metavar="FILE",
                     help="recorded durations to plan with (default: suites/durations/SUITE.json)")
    run.add_argument("--out", type=Path, metavar="DIR",
                     help="where junit.xml and the summary go (default: out/harness/SUITE[-IofN])")
    run.add_argument("--workers", type=int, metavar="N", help="xdist workers (default: sized to cards / slots)")
    run.add_argument("--max-cards", type=int, metavar="N",
                     help="run only cases needing at most N cards (a machine smaller than the suite's runners); "
                          "the others are listed as not run")

    mx = sub.add_parser("matrix", help="print the GitHub Actions matrix JSON for a suite")
    mx.add_argument("suite", metavar="SUITE")
    size = mx.add_mutually_exclusive_group()
    size.add_argument("--shards", type=int, metavar="N", help="exactly N shards")
    size.add_argument("--target-minutes", type=float, metavar="M",
                      help="the fewest shards of at most M planned minutes each")
    mx.add_argument("--durations", type=Path, metavar="FILE",
                    help="recorded durations (default: suites/durations/SUITE.json when present)")
    mx.add_argument("--indent", type=int, default=None, help="pretty-print the JSON")
    return p


def _print_inventory(inv: Inventory, suites: Sequence[str], quiet: bool) -> None:
    doc = inv.as_dict(suites or None)
    cases = doc["cases"]
    if not quiet and cases:
        w = min(max(len(c["nodeid"]) for c in cases), 110)
        print(f"{'CASE':<{w}}  DEVICE NPROC CARDS  ENTRIES")
        for c in cases:
            entries = ",".join(c["entries"]) or "-"
            print(f"{c['nodeid']:<{w}}  {c['device']:<6} {c['nproc']:>5} {c['cards']:>5}  {entries}")
    per_suite: dict[str, int] = {}
    for c in cases:
        for s in {e.split(":", 1)[0] for e in c["entries"]}:
            per_suite[s] = per_suite.get(s, 0) + 1
    counts = ", ".join(f"{s} {n}" for s, n in sorted(per_suite.items())) or "none"
    for p in inv.problems:
        print(f"error: {p}", file=sys.stderr)
    n = len(inv.problems)
    print(f"{len(cases)} case(s); per suite: {counts}; {n} problem(s)")


def _cmd_inventory(root: Path, args: argparse.Namespace) -> int:
    names = [Path(s).stem if s.endswith(".json") else s for s in args.suites]
    inv = build_inventory(root, args.suites or None)
    if args.json:
        print(json.dumps(inv.as_dict(names or None), indent=1))
    else:
        _print_inventory(inv, names, args.quiet)
    return 1 if inv.problems else 0


def _cmd_matrix(root: Path, args: argparse.Namespace) -> int:
    loaded = load_suite(root, args.suite, "matrix")
    if loaded is None:
        return 1
    suite, inv = loaded
    m = inv.manifests[suite]
    try:
        durations = load_durations(args.durations or default_durations_path(root, suite))
        cases = estimate([(c.nodeid, e.id, c.cards, e.estimated_s) for c, e in inv.suite_cases(suite)], durations)
        result = plan(suite, m.runners, cases, shards=args.shards, target_minutes=args.target_minutes)
    except PlanError as e:
        print(f"harness matrix: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result.matrix(), indent=args.indent, separators=None if args.indent else (",", ":")))
    loads = ", ".join(f"{s.label} {s.load / 60:.1f} min" for s in result.shards)
    print(f"harness matrix: {suite}: {len(cases)} case(s) in {len(result.shards)} shard(s): {loads}; "
          f"longest/mean {result.balance():.3f}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``harness`` console script; returns the exit code.

    Everything after the first ``--`` goes to pytest (``harness run`` only).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = _parser().parse_args(argv)
    if extra and args.command != "run":
        _parser().error("only `harness run` takes pytest arguments after --")
    root = (args.root or find_root()).resolve()
    if args.command == "inventory":
        return _cmd_inventory(root, args)
    if args.command == "matrix":
        return _cmd_matrix(root, args)
    return run_suite(
        root,
        RunOptions(
            suite=args.suite,
            shard=args.shard,
            changed_from=args.changed_from,
            durations_out=args.durations_out,
            durations=args.durations,
            out=args.out,
            workers=args.workers,
            max_cards=args.max_cards,
            pytest_args=extra,
        ),
    )
