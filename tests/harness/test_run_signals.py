"""``harness run`` under SIGTERM / SIGINT / Ctrl-C: real signals to a real run.

The run holds a plain case in an xdist worker (which has started a process
that ignores SIGINT and SIGTERM in a session of its own) and a launched
2-rank case; every pid is written to a file. Whatever the signal, the run
must stop promptly, leave none of those processes alive, write the partial
summary and exit 128 + the signal number without a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import psutil
import pytest
from suite_project import make_project, manifest

PLAIN = """
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    STUBBORN = "import signal, time\\nfor s in (signal.SIGINT, signal.SIGTERM):\\n    signal.signal(s, signal.SIG_IGN)\\ntime.sleep(600)\\n"

    def test_plain_waits():
        pids = Path(os.environ["PIDS_DIR"])
        child = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True)
        (pids / "stubborn").write_text(str(child.pid))
        (pids / "worker").write_text(str(os.getpid()))
        (pids / "controller").write_text(str(os.getppid()))
        time.sleep(600)
"""
LAUNCHED = """
    import os
    import time
    from pathlib import Path

    import pytest

    @pytest.mark.launch(nproc=2)
    def test_ranks_wait():
        Path(os.environ["PIDS_DIR"], f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(600)
"""
EXPECTED = {"stubborn", "worker", "controller", "rank0", "rank1"}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_run(root, pids_dir, *args: str) -> subprocess.Popen:
    """``harness run cpu --out out`` in ``root``, reporting pids under ``pids_dir``.

    Its own session and process group, as a shell job would be: "the group" is the harness's.
    """
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "GITHUB_STEP_SUMMARY")
    }
    env["PIDS_DIR"] = str(pids_dir)
    return subprocess.Popen(
        [sys.executable, "-m", "harness", "run", "cpu", "--out", "out", *args],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def signal_once(
    proc: subprocess.Popen, marker, what: str, signum: int, wait: float = 240
) -> tuple[str, str]:
    """Once ``marker`` exists, send ``signum`` to the run ``proc``; its output. The run never
    outlives the call (killed with its group when it does not end)."""
    try:
        wait_for(marker.exists, wait, what)
        os.kill(proc.pid, signum)
        return proc.communicate(timeout=60)  # a bound against a hang, not a timing claim
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize(
    ("how", "signum", "code"),
    [
        ("harness", signal.SIGTERM, 143),
        ("harness", signal.SIGINT, 130),
        ("group", signal.SIGINT, 130),
    ],
    ids=["term-harness", "int-harness", "ctrl-c-group"],
)
def test_signal_stops_the_whole_run(pytester, tmp_path_factory, how, signum, code):
    root = make_project(
        pytester.path,
        {"tests/plain/test_p.py": PLAIN, "tests/dist/test_d.py": LAUNCHED},
        {
            "cpu": manifest(
                "cpu",
                "cpu",
                [
                    {"id": "plain", "paths": ["tests/plain"]},
                    {"id": "dist", "paths": ["tests/dist"]},
                ],
            )
        },
    )
    pids_dir = tmp_path_factory.mktemp("pids")
    proc = start_run(root, pids_dir, "--workers", "2")
    try:
        wait_for(
            lambda: {p.name for p in pids_dir.iterdir()} >= EXPECTED, 240, "every case to start"
        )
        pids = {p.name: int(p.read_text()) for p in pids_dir.iterdir()}
        assert all(alive(pid) for pid in pids.values())
        if how == "group":
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=120)  # a bound against a hang, not a timing claim
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, out + err
    assert "Traceback" not in out + err
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    assert left == {}, f"still running after the harness exited: {left}"
    summary = json.loads((root / "out/summary.json").read_text())
    assert {c["nodeid"].split("::")[1] for c in summary["cases"]} == {
        "test_plain_waits",
        "test_ranks_wait",
    }
    name = signal.Signals(signum).name
    assert f"**FAILED**: interrupted by {name}" in (root / "out/summary.md").read_text()


SLOW_START_CONFTEST = """
    import os
    import sys
    import time
    from pathlib import Path

    # Only in the pytest `harness run` starts (not in the in-process inventory):
    # hold it in its start-up, before its session begins.
    if any(a.startswith("--harness-select") for a in sys.argv):
        Path(os.environ["PIDS_DIR"], "pytest").write_text(str(os.getpid()))
        time.sleep(600)
"""


def test_signal_during_pytest_startup_stops_it(pytester, tmp_path_factory):
    root = make_project(
        pytester.path,
        {
            "tests/plain/test_p.py": "def test_p():\n    pass\n",
            "tests/conftest.py": SLOW_START_CONFTEST,
        },
        {"cpu": manifest("cpu", "cpu", [{"id": "plain", "paths": ["tests/plain"]}])},
    )
    pids_dir = tmp_path_factory.mktemp("pids")
    proc = start_run(root, pids_dir)
    out, err = signal_once(proc, pids_dir / "pytest", "pytest to start", signal.SIGTERM)
    pid = int((pids_dir / "pytest").read_text())
    assert proc.returncode == 143, out + err
    assert not alive(pid)
    assert "**FAILED**: interrupted by SIGTERM" in (root / "out/summary.md").read_text()


DISPOSITION = """
    import os
    import signal
    from pathlib import Path

    def test_records_its_sigint():
        Path(os.environ["PIDS_DIR"], "sigint").write_text(repr(signal.getsignal(signal.SIGINT)))
"""


def test_pytest_takes_sigint_when_the_run_was_started_ignoring_it(pytester, tmp_path_factory):
    # A background job of a script (`harness run cpu &`, nohup) starts with SIGINT
    # ignored, and an ignored signal stays ignored across exec. `harness run` stops its
    # pytest with SIGINT, so that pytest (and its workers) must take it all the same:
    # the run's own handler, installed over the ignored one, is what resets it.
    root = make_project(
        pytester.path,
        {"tests/plain/test_p.py": DISPOSITION},
        {"cpu": manifest("cpu", "cpu", [{"id": "plain", "paths": ["tests/plain"]}])},
    )
    pids_dir = tmp_path_factory.mktemp("pids")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PIDS_DIR"] = str(pids_dir)
    done = subprocess.run(
        [sys.executable, "-m", "harness", "run", "cpu", "--out", "out", "--workers", "1"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (pids_dir / "sigint").read_text() == repr(signal.default_int_handler)


UNFINISHED = """
    import os
    import time
    from pathlib import Path

    def test_slow():
        Path(os.environ["PIDS_DIR"], "slow").write_text(str(os.getpid()))
        time.sleep(600)
"""


def test_a_case_interrupted_while_it_runs_is_not_run_never_passed(pytester, tmp_path_factory):
    # Its setup had passed and its call never reported: it was counted as passed, and
    # --durations-out recorded it.
    root = make_project(
        pytester.path,
        {"tests/slow/test_s.py": UNFINISHED},
        {"cpu": manifest("cpu", "cpu", [{"id": "slow", "paths": ["tests/slow"]}])},
    )
    pids_dir = tmp_path_factory.mktemp("pids")
    proc = start_run(root, pids_dir, "--durations-out", "d.json")
    out, err = signal_once(proc, pids_dir / "slow", "the case to start", signal.SIGINT)
    assert proc.returncode == 130, out + err
    (case,) = json.loads((root / "out/summary.json").read_text())["cases"]
    assert case["outcome"] == "not run", case
    assert case["message"].startswith("the run stopped during its call"), case
    assert json.loads((root / "d.json").read_text())["durations"] == {}
    assert "**FAILED**: interrupted by SIGINT" in (root / "out/summary.md").read_text()


def test_cases_the_interrupt_left_unstarted_are_not_run(pytester, tmp_path_factory):
    # Regression: SIGINT in the first case of two: the second was "missing: never
    # collected", a failure with an untrue reason.
    root = make_project(
        pytester.path,
        {"tests/one/test_s.py": UNFINISHED, "tests/two/test_t.py": UNFINISHED},
        {
            "cpu": manifest(
                "cpu",
                "cpu",
                [
                    {"id": "one", "paths": ["tests/one"], "timeout_s": 300},
                    {"id": "two", "paths": ["tests/two"], "timeout_s": 400},
                ],
            )
        },
    )
    pids_dir = tmp_path_factory.mktemp("pids")
    proc = start_run(root, pids_dir, "--", "-n", "0")
    out, err = signal_once(proc, pids_dir / "slow", "the first case to start", signal.SIGINT)
    assert proc.returncode == 130, out + err
    cases = json.loads((root / "out/summary.json").read_text())["cases"]
    assert sorted(c["outcome"] for c in cases) == ["not run", "not run"], cases
    messages = sorted(c["message"] for c in cases)
    assert messages[0] == "interrupted by SIGINT", cases
    assert messages[1].startswith("the run stopped during its call"), cases
    assert "never ran" not in (root / "out/summary.md").read_text()


def interrupt_narrowed(pytester, tmp_path_factory, slow: str, *pytest_args: str):
    """``harness run cpu -- PYTEST_ARGS`` over ``tests/slow/test_s.py`` (``slow``, which
    writes ``PIDS_DIR/slow`` once it runs) and ``tests/slow/test_other.py`` (two passing
    cases), interrupted with SIGINT once ``slow`` has written: the root and the output."""
    root = make_project(
        pytester.path,
        {
            "tests/slow/test_s.py": slow,
            "tests/slow/test_other.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
        },
        {"cpu": manifest("cpu", "cpu", [{"id": "slow", "paths": ["tests/slow"]}])},
    )
    pids_dir = tmp_path_factory.mktemp("pids")
    proc = start_run(root, pids_dir, "--", *pytest_args)
    out, err = signal_once(proc, pids_dir / "slow", "tests/slow/test_s.py", signal.SIGINT)
    assert proc.returncode == 130, out + err
    return root, out, err


def test_cases_outside_the_paths_given_stay_deselected_when_the_run_is_interrupted(
    pytester, tmp_path_factory
):
    # Regression: `harness run cpu -- FILE` interrupted: every case outside FILE was
    # "missing: never collected" (a JUnit error) instead of deselected, as without the signal.
    root, out, err = interrupt_narrowed(
        pytester, tmp_path_factory, UNFINISHED, "tests/slow/test_s.py"
    )
    cases = json.loads((root / "out/summary.json").read_text())["cases"]
    # (test_other.py, outside the path given, is not collected: in no plan.)
    assert {c["nodeid"]: c["outcome"] for c in cases} == {
        "tests/slow/test_s.py::test_slow": "not run",
    }
    assert "never ran" not in out + err
    junit = ET.parse(root / "out/junit.xml").getroot()
    assert junit.get("errors") == "0"


SLOW_IMPORT = """
    import os
    import sys
    import time
    from pathlib import Path

    if any(a.startswith("--harness-select") for a in sys.argv):  # the run's pytest only
        Path(os.environ["PIDS_DIR"], "slow").write_text(str(os.getpid()))
        time.sleep(600)

    def test_s():
        pass
"""


def test_cases_of_a_run_interrupted_while_it_collects_are_not_run(pytester, tmp_path_factory):
    # Regression: pytest_collection_finish runs even when collection is interrupted; its
    # empty list was taken as final, and every case, the named ones too, became
    # "deselected: not among the paths and node ids given". The run plans as pytest
    # collects now: interrupted before it collected a case, it planned none, lists none,
    # and is red for the interrupt.
    root, out, err = interrupt_narrowed(
        pytester,
        tmp_path_factory,
        SLOW_IMPORT,
        "-n",
        "0",
        "tests/slow/test_s.py",
        "tests/slow/test_other.py::test_a",
    )
    assert json.loads((root / "out/summary.json").read_text())["cases"] == []
    assert "**FAILED**: interrupted by SIGINT" in (root / "out/summary.md").read_text()
    assert "select no case" not in out + err


def run_one_file(
    path, entry: str, source: str, pids_dir, *args: str
) -> tuple[subprocess.Popen, str, str]:
    """A suite of one entry holding ``source`` as ``tests/ENTRY/test_x.py``, run to its end by
    ``harness run`` (``args`` after the suite); the run and its output. The run never
    outlives the call (killed with its group when it does not end)."""
    root = make_project(
        path,
        {f"tests/{entry}/test_x.py": source},
        {"cpu": manifest("cpu", "cpu", [{"id": entry, "paths": [f"tests/{entry}"]}])},
    )
    proc = start_run(root, pids_dir, *args)
    try:
        out, err = proc.communicate(timeout=240)  # a bound against a hang, not a timing claim
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, out, err


LEAKY = """
    import os
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    STUBBORN = "import signal, time\\nfor s in (signal.SIGINT, signal.SIGTERM):\\n    signal.signal(s, signal.SIG_IGN)\\ntime.sleep(600)\\n"

    def test_leaks_a_daemon():
        child = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True)
        Path(os.environ["PIDS_DIR"], "stubborn").write_text(str(child.pid))

    def test_next_sees_it_gone():
        pid = int(Path(os.environ["PIDS_DIR"], "stubborn").read_text())
        gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert gone, "the daemon outlived the case that started it"
"""
LEAKER = "tests/leak/test_x.py::test_leaks_a_daemon"


@pytest.mark.parametrize("mode", ["warn", "fail"])
def test_a_process_a_plain_case_leaked_is_stopped_with_its_case_and_named(
    pytester, tmp_path_factory, mode
):
    # Regression: a daemon a plain case started in a session of its own lived until pytest
    # ended, and was then named by pid alone ("1 process(es) outlived pytest (pid N)"),
    # without the case that leaked it.
    pids_dir = tmp_path_factory.mktemp("pids")
    args = ["--", "--dist", "loadfile", "-o", f"harness_leaks={mode}"]  # one worker, in order
    proc, out, err = run_one_file(pytester.path, "leak", LEAKY, pids_dir, *args)
    stubborn = int((pids_dir / "stubborn").read_text())
    try:
        cases = {
            c["nodeid"]: c
            for c in json.loads((pytester.path / "out/summary.json").read_text())["cases"]
        }
        assert cases["tests/leak/test_x.py::test_next_sees_it_gone"]["outcome"] == "passed"
        assert not alive(stubborn)
        assert "outlived pytest" not in out + err
        named = f"{LEAKER} left 1 process(es) running after its teardown"
        assert named in out + err
        summary = (pytester.path / "out/summary.md").read_text()
        assert f"- left running: `{LEAKER}` — pid {stubborn}: {sys.executable} -c " in summary
        (leaker,) = [
            tc
            for tc in ET.parse(pytester.path / "out/junit.xml").getroot().iter("testcase")
            if tc.get("name") == "test_leaks_a_daemon"
        ]
        props = {p.get("name"): p.get("value") for p in leaker.iter("property")}
        assert props["harness.leaked"].startswith(f"pid {stubborn}: "), props
        if mode == "warn":
            assert proc.returncode == 0, out + err
            assert cases[LEAKER]["outcome"] == "passed"
        else:
            assert proc.returncode == 1, out + err
            assert cases[LEAKER]["outcome"] == "failed"
            assert named in cases[LEAKER]["message"]
    finally:
        if alive(stubborn):
            os.kill(stubborn, signal.SIGKILL)


DIES = """
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    STUBBORN = "import signal, time\\nfor s in (signal.SIGINT, signal.SIGTERM):\\n    signal.signal(s, signal.SIG_IGN)\\ntime.sleep(600)\\n"

    def test_leaks_a_daemon_and_dies():
        child = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True)
        Path(os.environ["PIDS_DIR"], "stubborn").write_text(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)  # -n 0: it runs in pytest's own process
"""


def test_what_a_pytest_that_died_left_is_stopped_by_the_run(pytester, tmp_path_factory):
    # The plugin cannot act for a pytest that died; the run (a child subreaper) gets its
    # orphans and stops them, naming each with its command line.
    pids_dir = tmp_path_factory.mktemp("pids")
    proc, out, err = run_one_file(pytester.path, "dies", DIES, pids_dir, "--", "-n", "0")
    stubborn = int((pids_dir / "stubborn").read_text())
    try:
        assert proc.returncode == 1, out + err
        assert "1 process(es) outlived pytest; stopped them:" in out + err
        assert f"  pid {stubborn}: {sys.executable} -c " in out + err
        assert not alive(stubborn)
    finally:
        if alive(stubborn):
            os.kill(stubborn, signal.SIGKILL)


TRACKER = """
    import multiprocessing
    import multiprocessing.resource_tracker
    import os
    import time
    from pathlib import Path

    def test_joins_its_multiprocessing_child():
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=time.sleep, args=(0.1,))
        proc.start()
        proc.join()
        tracker = multiprocessing.resource_tracker._resource_tracker._pid
        Path(os.environ["PIDS_DIR"], "tracker").write_text(str(tracker))
"""


def test_multiprocessings_resource_tracker_is_no_leftover(pytester, tmp_path_factory):
    # Regression: "process(es) outlived pytest" named multiprocessing's resource tracker,
    # which ends by itself once pytest has, and stopped it in the middle of its cleanup. It
    # is kept for the life of the process that started it: no case's leak either.
    pids_dir = tmp_path_factory.mktemp("pids")
    proc, out, err = run_one_file(
        pytester.path, "helper", TRACKER, pids_dir, "--", "-p", "no:xdist"
    )
    tracker = int((pids_dir / "tracker").read_text())
    assert proc.returncode == 0, out + err
    assert "outlived pytest" not in out + err
    assert "left 1 process(es)" not in out + err
    assert not alive(tracker)


def _in_a_terminal(cwd, args, answers, timeout=180.0):
    """Run ``harness ARGS`` in ``cwd`` as a shell would in a terminal (a pseudo-terminal,
    the run's group in its foreground); ``answers``: (bytes awaited, bytes typed) in turn.
    Returns the exit status and everything the terminal showed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_"))}
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover (the child execs)
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, "-m", "harness", *args], env)
    seen, pending, end = b"", list(answers), time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if not select.select([fd], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's last process is gone
                break
            if not chunk:
                break
            seen += chunk
            if pending and pending[0][0] in seen:
                os.write(fd, pending.pop(0)[1])
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), seen.decode("utf-8", "replace")


def test_a_run_in_a_terminal_never_waits_on_it(pytester):
    # Regression: pytest, in a process group of its own, read the terminal (--pdb, or
    # breakpoint() / input() under -s): stopped by SIGTTIN, it hung the run until the
    # runner's timeout, deaf to what was typed.
    tests = {
        "tests/a/test_a.py": "def test_fails():\n    assert False\n",
        "tests/b/test_b.py": (
            "import time\n\ndef test_sleeps():\n    print('sleeping', flush=True)\n"
            "    time.sleep(120)\n"
        ),
        "tests/c/test_c.py": "def test_asks():\n    breakpoint()\n    input('more? ')\n",
    }
    entries = [{"id": k, "paths": [f"tests/{k}"]} for k in "abc"]
    root = make_project(pytester.path, tests, {"cpu": manifest("cpu", "cpu", entries)})
    refused = "harness run cannot give pytest's --pdb the terminal"
    for args, typed, code, said in (
        (["-n", "0", "--pdb", "tests/a"], [], 1, refused),
        # Not xdist's "incompatible with distributing tests; try using -n0", which led here.
        (["--pdb", "tests/a"], [], 1, refused),
        (["-n", "0", "--trace", "tests/a"], [], 1, "python -m pytest -n 0 --trace PATH"),
        # Its stdin is not the terminal: the debugger and input() read an end of file.
        (["-n", "0", "-s", "tests/c"], [], 1, "**FAILED**: 1 failed"),
        # The terminal's Ctrl-C reaches the run's group, which stops pytest's.
        (["-n", "0", "-s", "tests/b"], [(b"sleeping", b"\x03")], 130, "interrupted by SIGINT"),
    ):
        got, shown = _in_a_terminal(
            root, ["run", "cpu", "--out", "out", "--", *args], typed, timeout=120
        )
        assert got == code, shown
        assert said in shown, shown


def test_ctrl_z_stops_the_run_alone_and_fg_carries_on(pytester, tmp_path_factory):
    # Ctrl-Z stops `harness run` only: pytest and its ranks run on (their deadlines count
    # wall time: pausing them would fail the cases that were running), and `fg` lets the
    # run report. A version that paused them too had a paused pytest fail its case on `fg`,
    # its deadline long past.
    pids_dir = tmp_path_factory.mktemp("pids")
    test = (
        "import os, time\nfrom pathlib import Path\n\n"
        "def test_sleeps():\n"
        "    Path(os.environ['PIDS_DIR'], 'pytest').write_text(str(os.getpid()))\n"
        "    print('sleeping', flush=True)\n"
        "    time.sleep(3)\n"
    )
    root = make_project(
        pytester.path,
        {"tests/b/test_b.py": test},
        {"cpu": manifest("cpu", "cpu", [{"id": "b", "paths": ["tests/b"], "timeout_s": 5}])},
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_"))}
    env.update(PIDS_DIR=str(pids_dir), PS1="$ ", TERM="dumb")
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover (the child execs)
        os.chdir(root)
        os.execve("/bin/bash", ["bash", "--norc", "--noprofile", "-i"], env)
    seen = b""

    def until(needle: bytes, timeout: float = 60.0) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while needle not in seen and time.monotonic() < end:
            if select.select([fd], [], [], 0.5)[0]:
                seen += os.read(fd, 65536)
        assert needle in seen, seen.decode("utf-8", "replace")

    try:
        command = f"{sys.executable} -m harness run cpu --out out -- -n 0 -s tests/b\n"
        os.write(fd, command.encode())
        until(b"sleeping")
        tested = int((pids_dir / "pytest").read_text())
        os.write(fd, b"\x1a")
        until(b"Stopped")
        assert psutil.Process(tested).status() != psutil.STATUS_STOPPED
        time.sleep(6)  # past the case's 5 s deadline
        os.write(fd, b"fg; echo EXIT=$?\n")
        until(b"EXIT=0")
        os.write(fd, b"exit\n")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
