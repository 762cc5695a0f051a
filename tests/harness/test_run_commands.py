"""Command entries (``command``, ``expect_output``): each is one case ``<suite>::<entry id>``
that ``harness run`` runs next to the pytest cases, leasing its cards, under its deadline,
contained; the inventory, the matrix, JUnit and the durations name it. Real ``harness run``
processes on a small generated project."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
from suite_project import make_project, manifest
from test_cli import harness, summary_rows

from harness.names import COMMANDS_FORMAT, LEAK_PROPERTY
from harness.suites.report import read_junit

PY = sys.executable

# Writes its pid, and its child's, to the files named; then sleeps past any deadline here.
HANG = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "open('hang.pids', 'w').write(f'{os.getpid()} {child.pid}')\n"
    "print('started', flush=True)\n"
    "time.sleep(300)\n"
)
# Starts a daemon in a session of its own, records its pid, and exits 0 at once.
LEAK = (
    "import subprocess, sys\n"
    "d = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
    " start_new_session=True)\n"
    "open('leak.pid', 'w').write(str(d.pid))\n"
)

ENTRIES = [
    {"id": "tests", "paths": ["tests"]},
    {
        "id": "ok",
        "command": [PY, "-c", "print('step 1 loss 2.5'); print('done')"],
        "expect_output": r"^step \d+ loss [0-9.]+$",
    },
    {"id": "exit3", "command": [PY, "-c", "import sys; print('about to fail'); sys.exit(3)"]},
    {"id": "nomatch", "command": [PY, "-c", "print('hello')"], "expect_output": "^loss"},
    {"id": "absent", "command": ["no-such-program-for-harness", "--x"]},
    {"id": "hang", "command": [PY, "-c", HANG], "timeout_s": 6},
    {"id": "leak", "command": [PY, "-c", LEAK]},
    # 400 kB of output, failing: the report keeps its head and tail.
    {"id": "loud", "command": [PY, "-c", "print('x' * 400_000); print('THE-END'); exit(1)"]},
]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_command_cases_run_with_the_suite_each_with_its_own_verdict(pytester):
    root = make_project(
        pytester.path,
        {"tests/test_t.py": "def test_t():\n    pass\n"},
        {"cpu": manifest("cpu", "cpu", ENTRIES)},
    )
    # py-spy, where installed, dumps each process still running at the deadline: a stand-in
    # here (the real one needs ptrace rights over them, which CI runners do not give).
    stub = root / "bin/py-spy"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "stack of pid $3"\n')
    stub.chmod(0o755)
    path = f"{stub.parent}{os.pathsep}{os.environ['PATH']}"
    started = time.monotonic()
    done = harness(
        root, "run", "cpu", "--out", "out", "--durations-out", "d.json", env={"PATH": path}
    )
    took = time.monotonic() - started
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    cases = {c["nodeid"]: c for c in json.loads((root / "out/summary.json").read_text())["cases"]}
    assert {n: c["outcome"] for n, c in cases.items()} == {
        "tests/test_t.py::test_t": "passed",
        "cpu::ok": "passed",
        "cpu::exit3": "failed",
        "cpu::nomatch": "failed",
        "cpu::absent": "failed",  # named, and the run went on
        "cpu::hang": "failed",
        "cpu::leak": "passed",
        "cpu::loud": "failed",
    }
    assert cases["cpu::exit3"]["message"] == "exited with code 3"
    assert "does not match expect_output '^loss'" in cases["cpu::nomatch"]["message"]
    assert "'no-such-program-for-harness' not found" in cases["cpu::absent"]["message"]
    assert "stopped at its deadline of 6 s" in cases["cpu::hang"]["message"]
    rows = summary_rows((root / "out/summary.md").read_text())
    assert rows["ok"][:3] == ["1", "1", "0"]
    assert rows["exit3"][:3] == ["1", "0", "1"]

    # The failure report holds the output (bounded) and, at the deadline, what still ran.
    assert "about to fail" in said
    assert "----- output (400009 bytes) -----" in said
    assert "bytes of the command's output dropped" in said
    assert "THE-END" in said
    assert "still running at the deadline" in said
    parent, child = map(int, (root / "hang.pids").read_text().split())
    assert f"pid {child} (parent {parent}" in said
    assert f"--- py-spy dump --pid {child} ---\nstack of pid {child}\n" in said
    assert _gone(parent)
    assert _gone(child)
    assert took < 120

    # The setsid daemon was stopped when its case ended and reported against that case as
    # any case's leftovers are (containment: a LeakWarning, the JUnit property
    # harness.leaked, the run's summary), not left for the run to find after pytest.
    daemon = int((root / "leak.pid").read_text())
    assert _gone(daemon)
    assert "cpu::leak left 1 process(es) running after its teardown; stopped them:" in said
    assert f"left running: `cpu::leak` — pid {daemon}: " in said
    assert "outlived pytest" not in said

    junit = read_junit([root / "out/junit.xml"])
    xml = (root / "out/junit.xml").read_text()
    assert f'<property name="{LEAK_PROPERTY}" value="pid {daemon}: ' in xml
    for entry in ("ok", "exit3", "absent", "hang", "leak"):
        assert ("cpu", entry) in junit, sorted(junit)
    durations = json.loads((root / "d.json").read_text())["durations"]
    assert set(durations) == {"tests/test_t.py::test_t", "cpu::ok", "cpu::leak"}


def test_inventory_and_matrix_list_a_command_case_with_its_device_and_cards(pytester):
    root = make_project(
        pytester.path,
        {"tests/test_t.py": "def test_t():\n    pass\n"},
        {
            "cpu": manifest("cpu", "cpu", [{"id": "tests", "paths": ["tests"]}]),
            "gpu": manifest(
                "gpu",
                "cuda",
                [{"id": "smoke", "command": ["torchrun", "train.py"], "estimated_s": 60}],
            ),
        },
    )
    done = harness(root, "inventory", "gpu", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    (case,) = json.loads(done.stdout)["cases"]
    assert case == {
        "nodeid": "gpu::smoke",
        "device": "cuda",
        "nproc": 1,
        "cards": 1,
        "nnodes": 1,
        "launched": False,
        "entries": ["gpu:smoke"],
        "command": ["torchrun", "train.py"],
    }
    assert harness(root, "inventory").returncode == 0  # owned: no entry matches nothing
    done = harness(root, "matrix", "gpu")
    assert done.returncode == 0, done.stdout + done.stderr
    (shard,) = json.loads(done.stdout)["include"]
    assert shard["cases"] == 1
    assert shard["estimated_minutes"] == 1.0  # its estimated_s
    # A recorded duration, under its case id, wins over the estimate.
    recorded = {"suite": "gpu", "durations": {"gpu::smoke": 120.0}}
    (root / "suites/durations").mkdir()
    (root / "suites/durations/gpu.json").write_text(json.dumps(recorded))
    done = harness(root, "matrix", "gpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["include"][0]["estimated_minutes"] == 2.0


# Prints the cards it sees, checks that card 0 is leased (its lock held) while it runs, and
# records when it ran (start, end: 1 s) in the file named.
PROBE = (
    "import fcntl, os, sys, time\n"
    "print('visible=' + os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
    "lock = os.open(os.path.join(os.environ['HARNESS_LEASE_DIR'], 'cuda-0.lock'), os.O_RDWR)\n"
    "try:\n"
    "    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "    sys.exit('cuda:0 is not leased')\n"
    "except BlockingIOError:\n"
    "    pass\n"
    "start = time.time(); time.sleep(1)\n"
    "open(sys.argv[1], 'w').write(f'{start} {time.time()}')\n"
)


def test_accelerator_command_cases_see_exactly_their_card_one_at_a_time(pytester):
    # One simulated card, two command cases on two xdist workers: each sees the card, and
    # the lease keeps them from holding it at once.
    probes = [
        {"id": n, "command": [PY, "-c", PROBE, f"{n}.held"], "expect_output": "^visible=0$"}
        for n in ("a", "b")
    ]
    root = make_project(pytester.path, {}, {"gpu": manifest("gpu", "cuda", probes)})
    lease_dir = root / "leases"
    lease_dir.mkdir()
    done = harness(
        root, "run", "gpu", "--out", "out", "--workers", "2",
        env={"HARNESS_CARDS": "cuda:0", "HARNESS_LEASE_DIR": str(lease_dir)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (a0, a1), (b0, b1) = (map(float, (root / f"{n}.held").read_text().split()) for n in "ab")
    assert a1 <= b0 or b1 <= a0, (a0, a1, b0, b1)
    junit = (root / "out/junit.xml").read_text()
    assert junit.count('name="harness.cards" value="cuda:0"') == 2
    assert 'name="harness.entry" value="a"' in junit


def test_k_selects_command_cases_and_paths_given_to_pytest_leave_them_out(pytester):
    root = make_project(
        pytester.path,
        {"tests/test_t.py": "def test_t():\n    pass\n"},
        {
            "cpu": manifest(
                "cpu",
                "cpu",
                [{"id": "tests", "paths": ["tests"]}, {"id": "smoke", "command": [PY, "-c", "0"]}],
            )
        },
    )
    done = harness(root, "run", "cpu", "--out", "o1", "-k", "smoke")
    assert done.returncode == 0, done.stdout + done.stderr
    assert outcomes(root / "o1") == {
        "tests/test_t.py::test_t": "deselected",
        "cpu::smoke": "passed",
    }
    done = harness(root, "run", "cpu", "--out", "o2", "--", "tests/test_t.py")
    assert done.returncode == 0, done.stdout + done.stderr
    # The paths given collect no command case: the run plans what they collect.
    assert outcomes(root / "o2") == {"tests/test_t.py::test_t": "passed"}


def outcomes(out: Path) -> dict[str, str]:
    return {
        c["nodeid"]: c["outcome"] for c in json.loads((out / "summary.json").read_text())["cases"]
    }


def test_what_a_command_left_running_fails_its_teardown_under_harness_leaks_fail(
    pytester, tmp_path
):
    # A command case's leftovers are any case's (containment): harness_leaks = fail makes
    # them a teardown error of the case, which itself passed.
    pytester.makeini("[pytest]\nharness_leaks = fail\n")
    commands = pytester.path / "commands.json"
    case = {"id": "cpu::leak", "argv": [PY, "-c", LEAK], "device": "cpu", "cards": 0}
    commands.write_text(
        json.dumps({"format": COMMANDS_FORMAT, "root": str(pytester.path), "cases": [case]})
    )
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--harness-lease-dir={tmp_path / 'leases'}",
        f"--harness-commands={commands}",
        str(commands),
    )
    result.assert_outcomes(passed=1, errors=1)
    daemon = int((pytester.path / "leak.pid").read_text())
    assert _gone(daemon)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of *leak*",
            "*cpu::leak left 1 process(es) running after its teardown; stopped them:",
            f"*pid {daemon}: *",
        ]
    )
