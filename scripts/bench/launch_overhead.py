"""Per-case cost of a trivial 2-rank launched case: kept rank pools vs fresh
ranks, and kept pools under plain ``pytest -n 0`` vs ``pytest -n N``.

Runs one inner pytest session of ``--cases`` trivial ``@pytest.mark.launch(nproc=2)``
cases (each does one all-reduce) with kept ranks (the default), with
``--harness-no-reuse``, and with kept ranks under ``-n --workers`` (xdist's
default ``--dist load``; ``--dist`` picks another); and, as the reference for
what xdist itself costs, the same file's bodies as plain in-process tests under
``-n 0`` and ``-n --workers``. Prints the per-case time pytest measured (setup +
call + teardown, from its JUnit XML) and the sessions' wall times::

    python scripts/bench/launch_overhead.py [--cases 24] [--workers 2] [--dist load]
        [--repeat 1] [--no-fresh]

Targets: a pooled case at least 10x cheaper than a fresh one, and launched
cases costing no more under ``-n N`` than under ``-n 0`` beyond what xdist
costs plain tests. The mean includes the pool's first case, which pays for
spawning its ranks; the median is the steady state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from harness.suites.report import read_junit

TARGET = 10.0

CASE = """
@pytest.mark.launch(nproc=2)
def test_case_{i:02d}():
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2
"""

PLAIN_CASE = """
def test_case_{i:02d}():
    assert torch.ones(1).item() == 1
"""


def write_project(root: Path, cases: int, *, launched: bool = True) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    body = "import pytest\nimport torch\nimport torch.distributed as dist\n"
    case = CASE if launched else PLAIN_CASE
    body += "".join(textwrap.dedent(case).format(i=i) for i in range(cases))
    (root / "test_trivial.py").write_text(body)


def run(root: Path, *args: str, timeout: float) -> tuple[float, list[float]]:
    """Run the inner session; return its wall time and each case's JUnit time."""
    junit = root / "junit.xml"
    junit.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "PYTEST_"))}
    env.update({"HARNESS_CARDS": "none", "HARNESS_LEASE_DIR": str(root / "leases")})
    start = time.monotonic()
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*pytest, f"--junitxml={junit}", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"inner session failed ({' '.join(args) or 'kept ranks'}):\n{proc.stdout}{proc.stderr}"
        )
    return wall, [row.seconds for row in read_junit([junit]).values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2, help="xdist workers of the -n rows")
    parser.add_argument("--dist", default="load", help="xdist distribution of the -n rows")
    parser.add_argument(
        "--repeat", type=int, default=1, help="sessions per row, interleaved (median wall time)"
    )
    parser.add_argument("--no-fresh", action="store_true", help="leave out the fresh-ranks row")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on each session (s)")
    args = parser.parse_args(argv)
    xdist = ("-n", str(args.workers), "--dist", args.dist)
    kept0, fresh0 = "kept ranks (pool), -n 0", "fresh ranks (--harness-no-reuse)"
    keptn = f"kept ranks, -n {args.workers} --dist {args.dist}"
    plain0, plainn = "in-process (no launch), -n 0", f"in-process, -n {args.workers}"
    modes = {
        kept0: (True, ("-n", "0")),
        fresh0: (True, ("-n", "0", "--harness-no-reuse")),
        keptn: (True, xdist),
        plain0: (False, ("-n", "0")),
        plainn: (False, xdist),
    }
    if args.no_fresh:
        del modes[fresh0]
    walls: dict[str, list[float]] = {name: [] for name in modes}
    cases: dict[str, list[float]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory(prefix="launch-overhead-") as tmp:
        roots = {True: Path(tmp) / "launched", False: Path(tmp) / "plain"}
        for launched, root in roots.items():
            write_project(root, args.cases, launched=launched)
        # Interleaved, so that a load change on a shared host hits every row alike.
        for _ in range(args.repeat):
            for name, (launched, extra) in modes.items():
                wall, times = run(roots[launched], *extra, timeout=args.timeout)
                assert len(times) == args.cases, times
                walls[name].append(wall)
                cases[name] += times
    rows = {name: (statistics.median(walls[name]), cases[name]) for name in modes}
    print(
        f"{args.cases} trivial 2-rank Gloo cases (one all-reduce each), "
        f"{os.cpu_count()} CPUs, {args.repeat} session(s) per row:\n"
    )
    head = f"{'mode':<38}{'mean ms/case':>14}{'median ms/case':>16}{'first case ms':>15}{'session s':>11}"
    print(head)
    print("-" * len(head))
    for name, (wall, times) in rows.items():
        print(
            f"{name:<38}{1000 * statistics.mean(times):>14.0f}{1000 * statistics.median(times):>16.0f}"
            f"{1000 * times[0]:>15.0f}{wall:>11.1f}"
        )
    print()
    if fresh0 in rows:
        kept, fresh = rows[kept0][1], rows[fresh0][1]
        mean_ratio = statistics.mean(fresh) / statistics.mean(kept)
        median_ratio = statistics.median(fresh) / statistics.median(kept)
        verdict = "meets" if mean_ratio >= TARGET else "misses"
        print(
            f"fresh / kept: {mean_ratio:.1f}x by mean, {median_ratio:.1f}x by median "
            f"({verdict} the {TARGET:g}x target by mean)"
        )
    n = args.workers
    for label, zero, many in (("kept ranks", kept0, keptn), ("in-process", plain0, plainn)):
        (wall0, times0), (walln, timesn) = rows[zero], rows[many]
        print(
            f"-n {n} / -n 0, {label}: {walln / wall0:.2f}x the session wall time, "
            f"{statistics.median(timesn) / statistics.median(times0):.2f}x by median per case, "
            f"+{walln - wall0:.1f} s"
        )
    extra = (rows[keptn][0] - rows[kept0][0]) - (rows[plainn][0] - rows[plain0][0])
    print(
        f"launched cases under -n {n} beyond what xdist costs plain tests: {extra:+.1f} s "
        f"({'meets' if extra <= 0 else 'misses'} the no-extra-cost target)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
