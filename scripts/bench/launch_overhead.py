"""Per-case cost of a trivial 2-rank launched case: kept rank pools vs fresh ranks.

Runs one inner pytest session of ``--cases`` trivial ``@pytest.mark.launch(nproc=2)``
cases (each does one all-reduce) twice, with kept ranks (the default) and with
``--harness-no-reuse``, and prints the per-case time pytest measured (setup +
call + teardown, from its JUnit XML) and the sessions' wall times::

    python scripts/bench/launch_overhead.py [--cases 20]

Target: a pooled case at least 10x cheaper than a fresh one. The
mean includes the pool's first case, which pays for spawning its ranks; the
median is the steady state.
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


def write_project(root: Path, cases: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    body = "import pytest\nimport torch\nimport torch.distributed as dist\n"
    body += "".join(textwrap.dedent(CASE).format(i=i) for i in range(cases))
    (root / "test_trivial.py").write_text(body)


def run(root: Path, *args: str, timeout: float) -> tuple[float, list[float]]:
    """Run the inner session; return its wall time and each case's JUnit time."""
    junit = root / "junit.xml"
    junit.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "PYTEST_"))}
    env.update({"HARNESS_CARDS": "none", "HARNESS_LEASE_DIR": str(root / "leases")})
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *args,
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"inner session failed ({' '.join(args) or 'kept ranks'}):\n{proc.stdout}{proc.stderr}"
        )
    return wall, [row.seconds for row in read_junit([junit]).values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on each session (s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="launch-overhead-") as tmp:
        root = Path(tmp)
        write_project(root, args.cases)
        rows = {}
        for name, extra in (
            ("kept ranks (pool)", ()),
            ("fresh ranks (--harness-no-reuse)", ("--harness-no-reuse",)),
        ):
            wall, times = run(root, *extra, timeout=args.timeout)
            assert len(times) == args.cases, times
            rows[name] = (wall, times)
    print(
        f"{args.cases} trivial 2-rank Gloo cases (one all-reduce each), "
        f"{os.cpu_count()} CPUs, torch ranks spawned per case vs kept:\n"
    )
    head = f"{'mode':<34}{'mean ms/case':>14}{'median ms/case':>16}{'first case ms':>15}{'session s':>11}"
    print(head)
    print("-" * len(head))
    for name, (wall, times) in rows.items():
        print(
            f"{name:<34}{1000 * statistics.mean(times):>14.0f}{1000 * statistics.median(times):>16.0f}"
            f"{1000 * times[0]:>15.0f}{wall:>11.1f}"
        )
    (_, kept), (_, fresh) = rows.values()
    mean_ratio = statistics.mean(fresh) / statistics.mean(kept)
    median_ratio = statistics.median(fresh) / statistics.median(kept)
    verdict = "meets" if mean_ratio >= TARGET else "misses"
    print(
        f"\nfresh / kept: {mean_ratio:.1f}x by mean, {median_ratio:.1f}x by median "
        f"({verdict} the {TARGET:g}x target by mean)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
