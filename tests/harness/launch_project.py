"""Builds and runs small pytest projects that exercise the harness plugin for real.

Inner sessions are real ``python -m pytest`` processes: they load the plugin
through its entry point, spawn real ranks and take real file locks in a lease
directory of their own. Inner tests report through files in ``$HARNESS_TEST_OUT``
(rank pids, card-use intervals) and through JUnit XML (per-test outcome and
report text).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import psutil

OUT_ENV = "HARNESS_TEST_OUT"

#: A helper module inner tests import (ranks import it too): records which
#: card a test body used, and when.
RECORDING = '''
import json
import os
import time
from pathlib import Path


def out_dir():
    return Path(os.environ["HARNESS_TEST_OUT"])


def record_card_use(case, seconds=1.0):
    """Hold the card for `seconds` and record the interval and the card."""
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    record = {
        "case": case,
        "card": os.environ.get("HARNESS_CARD"),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "rank": os.environ.get("RANK"),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        "start": start,
        "end": end,
    }
    path = out_dir() / f"use-{case}-{os.getpid()}.json"
    path.write_text(json.dumps(record))


def record_pid(name, pid=None):
    # Written whole or not at all: a reader polling the folder never sees an empty file.
    tmp = out_dir() / f".{name}.pid.{os.getpid()}"
    tmp.write_text(str(pid or os.getpid()))
    os.replace(tmp, out_dir() / f"{name}.pid")
'''


def inner_env(out: Path, lease_dir: Path, *, cards: str = "none") -> dict[str, str]:
    """Environment for an inner session: its own lease dir, a simulated card
    inventory, nothing inherited that would change how pytest runs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HARNESS_", "PYTEST_")) and k not in ("CUDA_VISIBLE_DEVICES",)
    }
    env.update(
        {
            "HARNESS_CARDS": cards,
            "HARNESS_LEASE_DIR": str(lease_dir),
            OUT_ENV: str(out),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    return env


def write_project(root: Path, files: dict[str, str], *, reuse: bool = False) -> Path:
    """Write ``files`` (dedented) plus ``recording.py`` and a ``pytest.ini`` pinning the
    rootdir (with ``reuse``: opting in to kept rank pools, ``harness_reuse = true``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n" + ("harness_reuse = true\n" if reuse else ""))
    (root / "recording.py").write_text(RECORDING)
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    (root / "out").mkdir(exist_ok=True)
    return root


@dataclass
class JunitCase:
    """One test's outcome as the inner session's JUnit report gives it."""

    status: str  # passed / failed / error / skipped
    message: str
    text: str


@dataclass
class Session:
    returncode: int
    output: str
    seconds: float
    cases: dict[str, JunitCase] = field(default_factory=dict)

    def case(self, name: str) -> JunitCase:
        assert name in self.cases, f"no test {name} in {sorted(self.cases)}\n{self.output}"
        return self.cases[name]


def pytest_command(root: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rA",
        f"--junitxml={root / 'junit.xml'}",
        *args,
    ]


def run_session(root: Path, *args: str, env: dict[str, str], timeout: float = 180) -> Session:
    """Run pytest in ``root`` (bounded by ``timeout``) and parse its JUnit report."""
    junit = root / "junit.xml"
    junit.unlink(missing_ok=True)
    start = time.monotonic()
    proc = subprocess.run(
        pytest_command(root, *args),
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    session = Session(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start)
    if junit.exists():
        session.cases = parse_junit(junit)
    return session


def parse_junit(path: Path) -> dict[str, JunitCase]:
    cases = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        status, message, text = "passed", "", ""
        for tag in ("failure", "error", "skipped"):
            node = tc.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message, text = node.get("message", ""), node.text or ""
                break
        cases[tc.get("name")] = JunitCase(status, message, text)
    return cases


def gone(pid: int) -> bool:
    """The process is dead (a zombie awaiting its reaper counts as dead)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def survivors(pids: list[int], wait: float = 5.0) -> list[int]:
    """Pids still alive after waiting up to ``wait`` seconds."""
    end = time.monotonic() + wait
    alive = [p for p in pids if not gone(p)]
    while alive and time.monotonic() < end:
        time.sleep(0.05)
        alive = [p for p in alive if not gone(p)]
    return alive


def read_pids(out: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in out.glob("*.pid")}


def read_card_uses(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("use-*.json"))]


def assert_disjoint_per_card(uses: list[dict]) -> None:
    """No two cases used one card at the same time."""
    by_card: dict[str, list[dict]] = {}
    for use in uses:
        by_card.setdefault(use["card"], []).append(use)
    for card, card_uses in by_card.items():
        card_uses.sort(key=lambda u: u["start"])
        for a, b in itertools.pairwise(card_uses):
            assert a["end"] <= b["start"], (
                f"{card} used by {a['case']} and {b['case']} at once: {a} {b}"
            )
