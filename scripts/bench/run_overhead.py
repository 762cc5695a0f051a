"""What ``harness run`` costs on top of plain pytest running the same cases.

Side by side in one run, on two workloads:

- ``small``: a repository this script generates (7 cases in 3 files, one of them
  importing torch, one ``cpu`` suite of 3 entries), ``harness run cpu`` against
  ``python -m pytest tests``;
- ``cpu``: this repository's ``cpu`` suite, ``harness run cpu`` against ``python -m
  pytest`` on the suite's paths followed by each of its command entries' argv (the same
  cases: the harness runs a command entry as one case of the run); ``--quick``: one test
  file of it, given to both, as ``harness run cpu -- FILE`` and ``python -m pytest FILE``.

Both commands get the same ``-n`` (``--workers``, default 0 and 2 on ``small``, 2 on
``cpu``). The two commands of a workload alternate (``--repeat`` pairs, the first
command of a pair alternating too), and a ratio is the median over the pairs of each
pair's ``harness run / pytest`` wall time: adjacent runs share the machine's state of the
moment. Prints one table and the load average before and after::

    python scripts/bench/run_overhead.py [--quick] [--repeat 3] [--workloads small,cpu]
        [--workers 0,2] [--cpu-path tests/channel_loss/test_layout.py]

Target: ``harness run / pytest <= 1.3`` on both workloads on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TARGET = 1.3
REPO = Path(__file__).resolve().parents[2]
#: The one file of the ``cpu`` suite ``--quick`` runs (plain and launched cases, quick).
QUICK_PATH = "tests/channel_loss/test_layout.py"

SMALL_TESTS = {
    "tests/a/test_a.py": """
        def test_one():
            assert 1 + 1 == 2

        def test_two():
            assert "a" * 2 == "aa"

        def test_three():
            assert sorted([3, 1, 2]) == [1, 2, 3]
    """,
    "tests/b/test_b.py": """
        import pytest

        @pytest.mark.parametrize("n", [1, 2])
        def test_param(n):
            assert n > 0
    """,
    "tests/c/test_c.py": """
        import torch

        def test_tensor():
            assert torch.ones(2).sum().item() == 2

        def test_zeros():
            assert torch.zeros(3).sum().item() == 0
    """,
}


def write_small(root: Path) -> None:
    """The generated repository: 7 cases, a ``cpu`` suite with one entry per folder."""
    for rel, body in SMALL_TESTS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body).lstrip())
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    suite = {
        "suite": "cpu",
        "device": "cpu",
        "runner": {"name": "cpu", "labels": ["ubuntu-latest"], "cards": 0, "timeout_minutes": 30},
        "entries": [{"id": k, "paths": [f"tests/{k}"]} for k in "abc"],
    }
    (root / "suites").mkdir(exist_ok=True)
    (root / "suites/cpu.json").write_text(json.dumps(suite, indent=1))


def timed(cmds: list[list[str]], cwd: Path, timeout: float) -> float:
    """Wall seconds of ``cmds`` run one after the other; raises, with its output, when one
    fails."""
    t0 = time.perf_counter()
    for cmd in cmds:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        # pytest: 0 passed, 1 failed; the same cases on both sides, so only a crash is an error.
        if done.returncode not in (0, 1):
            raise RuntimeError(
                f"{' '.join(cmd)} exited {done.returncode}:\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
    return time.perf_counter() - t0


def plain_suite(root: Path, n: list[str]) -> list[list[str]]:
    """The whole ``cpu`` suite without the harness: pytest on its entries' paths (its
    ``testpaths`` may hold more), then each command entry's argv, as a user would run them."""
    entries = json.loads((root / "suites" / "cpu.json").read_text())["entries"]
    paths = [p for e in entries for p in e.get("paths", [])]
    commands = [
        [sys.executable if e["command"][0] == "python" else e["command"][0], *e["command"][1:]]
        for e in entries
        if "command" in e
    ]
    return [[sys.executable, "-m", "pytest", "-q", *n, *paths], *commands]


def measure(
    name: str, root: Path, paths: list[str], workers: int, repeat: int, out: Path, timeout: float
) -> dict[str, object]:
    """``repeat`` alternating pairs of (harness run, pytest) on ``paths`` (empty: the whole
    suite, and pytest on the suite's entries' paths) with ``-n workers``."""
    n = ["-n", str(workers)]
    harness = [[sys.executable, "-m", "harness", "run", "cpu", "--out", str(out), "--", *n, *paths]]
    plain = [[sys.executable, "-m", "pytest", "-q", *n, *paths]] if paths else plain_suite(root, n)
    pairs = []
    for k in range(repeat):
        order = [("harness", harness), ("pytest", plain)]
        if k % 2:
            order.reverse()
        got = {label: timed(cmd, root, timeout) for label, cmd in order}
        pairs.append(got)
    ratios = [p["harness"] / p["pytest"] for p in pairs]
    return {
        "workload": name,
        "n": workers,
        "pytest_s": statistics.median(p["pytest"] for p in pairs),
        "harness_s": statistics.median(p["harness"] for p in pairs),
        "ratio": statistics.median(ratios),
        "pairs": len(pairs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="small,cpu", help="comma-separated: small, cpu")
    ap.add_argument(
        "--workers", default=None, help="comma-separated -n values (default: small 0,2; cpu 2)"
    )
    ap.add_argument("--repeat", type=int, default=3, help="pairs per row (default 3)")
    ap.add_argument("--quick", action="store_true", help=f"cpu: only {QUICK_PATH} (or --cpu-path)")
    ap.add_argument(
        "--cpu-path", action="append", default=None, help="cpu: these paths only (repeatable)"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="per command, seconds")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="run-overhead-") as tmp:
        for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            if workload == "small":
                root, paths = Path(tmp) / "small", []
                write_small(root)
                default_n = "0,2"
            elif workload == "cpu":
                root = REPO
                paths = args.cpu_path or ([QUICK_PATH] if args.quick else [])
                default_n = "2"
            else:
                ap.error(f"unknown workload {workload!r}; choose from small, cpu")
            for n in (args.workers or default_n).split(","):
                rows.append(
                    measure(
                        workload + (f" ({', '.join(paths)})" if paths else ""),
                        root,
                        paths,
                        int(n),
                        args.repeat,
                        Path(tmp) / f"out-{workload}-{n}",
                        args.timeout,
                    )
                )
    load_after = os.getloadavg()
    w = max(len("workload"), *(len(str(r["workload"])) for r in rows))
    print(f"{'workload':<{w}}  -n  pytest (s)  harness run (s)  ratio  pairs")
    for r in rows:
        print(
            f"{r['workload']:<{w}}  {r['n']:>2}  {r['pytest_s']:>10.2f}  {r['harness_s']:>15.2f}  "
            f"{r['ratio']:>5.2f}  {r['pairs']:>5}"
        )
    print(f"target: harness run / pytest <= {TARGET} on a quiet machine")
    print(
        f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {' '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
