"""Inventory scale: time of ``build_inventory`` against N manifest entries.

For each N and each kind of entry (node ids, directories, globs) a synthetic
repository is generated with N cases (N/5 test files of five marked tests each)
and one suite whose N entries each own exactly one case:

- ``nodeid``: ``tests/g3/d312/test_312.py::test_4``
- ``dir``:    ``tests/g3/d312`` with ``"markers": "m4"``
- ``glob``:   ``tests/g*/d312/test_*.py`` with ``"markers": "m4"``

Each measurement runs in a fresh interpreter, after one untimed collection
that writes the bytecode caches. ``pytest collect`` is pytest alone collecting
the same tree in-process (the floor: the inventory collects with pytest);
``inventory`` is the whole ``build_inventory`` (collection, manifest
validation, ownership, every rule); ``own`` is ``build_inventory`` again with
the same collection results replayed (best of three): the inventory's own
work, which must grow linearly with N (``own/entry`` stays flat).

    python scripts/bench/inventory.py [--sizes 1000,2000,5000,10000] [--kinds nodeid,dir,glob]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from harness.jsonio import write_json

CASES_PER_FILE = 5
FILES_PER_GROUP = 100

MEASURE = textwrap.dedent(
    """
    import contextlib, io, json, os, sys, time
    from pathlib import Path

    import pytest

    from harness.suites import inventory

    root = Path(sys.argv[1])
    os.chdir(root)
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"])  # warm the bytecode caches
        t0 = time.perf_counter()
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"])
        collect_s = time.perf_counter() - t0

    # The full inventory, recording what its pytest collections returned ...
    real_collect, seen = inventory.collect, []

    def recording(*args):
        seen.append(real_collect(*args))
        return seen[-1]

    inventory.collect = recording
    t0 = time.perf_counter()
    inv = inventory.build_inventory(root)
    inventory_s = time.perf_counter() - t0
    # ... then again with those collections replayed: the inventory's own work
    # alone (best of three: the least disturbed by whatever else the host runs).
    own_s = float("inf")
    for _ in range(3):
        replay = iter(seen)
        inventory.collect = lambda *args: next(replay)
        t0 = time.perf_counter()
        again = inventory.build_inventory(root)
        own_s = min(own_s, time.perf_counter() - t0)
        assert again.owners == inv.owners and again.problems == inv.problems
    owned = sum(1 for c in inv.cases if c.nodeid in inv.owners)
    print(json.dumps({"collect_s": collect_s, "inventory_s": inventory_s, "own_s": own_s, "cases": len(inv.cases),
                      "owned": owned, "problems": [str(p) for p in inv.problems[:3]]}))
    """
)


def file_of(f: int) -> str:
    return f"tests/g{f // FILES_PER_GROUP}/d{f}/test_{f}.py"


def entry(kind: str, f: int, k: int) -> dict[str, object]:
    d = f"tests/g{f // FILES_PER_GROUP}/d{f}"
    eid = f"e{f}-{k}"
    if kind == "nodeid":
        return {"id": eid, "paths": [f"{file_of(f)}::test_{k}"]}
    if kind == "dir":
        return {"id": eid, "paths": [d], "markers": f"m{k}"}
    return {"id": eid, "paths": [f"tests/g*/d{f}/test_*.py"], "markers": f"m{k}"}


def make_repo(root: Path, n: int, kind: str) -> None:
    files = max(1, n // CASES_PER_FILE)
    marks = ", ".join(f'"m{k}: bench marker"' for k in range(CASES_PER_FILE))
    (root / "pyproject.toml").write_text(
        f'[tool.pytest.ini_options]\ntestpaths = ["tests"]\nmarkers = [{marks}]\naddopts = ["--strict-markers"]\n'
    )
    body = "import pytest\n" + "".join(
        f"\n\n@pytest.mark.m{k}\ndef test_{k}():\n    pass\n" for k in range(CASES_PER_FILE)
    )
    for f in range(files):
        p = root / file_of(f)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(body)
    entries = [entry(kind, f, k) for f in range(files) for k in range(CASES_PER_FILE)]
    suite = {
        "suite": "cpu",
        "device": "cpu",
        "runner": {"labels": ["ubuntu-latest"], "cards": 0, "timeout_minutes": 60},
        "entries": entries,
    }
    write_json(root / "suites/cpu.json", suite, indent=None)


def measure(n: int, kind: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"inv-bench-{kind}-{n}-") as tmp:
        root = Path(tmp)
        make_repo(root, n, kind)
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, str(root)],
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"{kind} N={n}: measurement failed:\n{done.stdout}\n{done.stderr}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if result["problems"] or result["owned"] != result["cases"]:
            raise SystemExit(f"{kind} N={n}: the inventory is not clean: {result}")
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", default="1000,2000,5000,10000", help="entry counts N (comma-separated)"
    )
    ap.add_argument("--kinds", default="nodeid,dir,glob", help="entry kinds (comma-separated)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    print(
        f"{'kind':<7} {'N':>6} {'pytest collect s':>17} {'inventory s':>12} {'inv/collect':>12} "
        f"{'own s':>7} {'own/entry us':>13} {'own/entry vs smallest N':>24}"
    )
    for kind in kinds:
        first = None
        for n in sizes:
            r = measure(n, kind)
            per = r["own_s"] / n * 1e6
            first = first if first is not None else per
            print(
                f"{kind:<7} {n:>6} {r['collect_s']:>17.2f} {r['inventory_s']:>12.2f} "
                f"{r['inventory_s'] / r['collect_s']:>12.2f} {r['own_s']:>7.2f} {per:>13.0f} "
                f"{per / first:>24.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
