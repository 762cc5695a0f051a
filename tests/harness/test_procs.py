"""Stopping a rank's whole process tree, orphans included."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from launch_project import survivors

from harness.processes import descendants, kill_trees, stop_leftovers, subreaper

# Leads its own session like a rank: a child, an orphaned grandchild (its
# parent exits at once), then it prints the pids and waits.
RANK_LIKE = textwrap.dedent("""
    import signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = subprocess.Popen(sleeper, **quiet)
    spawner = subprocess.run(
        [sys.executable, "-c",
         "import subprocess; print(subprocess.Popen(%r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)" % (sleeper,)],
        capture_output=True, text=True, check=True)
    print(child.pid, spawner.stdout.strip(), flush=True)
    time.sleep(60)
""")


def start(*args: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK_LIKE, *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    return proc, pids


def test_tree_and_orphans_of_a_session_are_stopped():
    root, (child, orphan) = start()
    try:
        assert kill_trees([root.pid], grace=2.0) == []
        assert survivors([root.pid, child, orphan], wait=0) == []
    finally:
        root.kill()
        root.wait()


def test_process_ignoring_sigterm_gets_sigkill_after_the_grace():
    root, (child, orphan) = start("--ignore-term")
    try:
        began = time.monotonic()
        assert kill_trees([root.pid], grace=0.5) == []
        assert time.monotonic() - began >= 0.5
        assert survivors([root.pid, child, orphan], wait=0) == []
    finally:
        root.kill()
        root.wait()
    assert root.returncode == -9


def test_stop_leftovers_stops_what_is_new_but_the_spared_trees_and_reaps_it():
    # This (pytest's) process is a child subreaper for the session (the plugin), so the
    # orphaned grandchild of a tree started here comes below it: no longer below its
    # spared tree's root, it is stopped with the new ones.
    assert subreaper()
    kept = subprocess.Popen(["sleep", "60"])
    before = descendants()
    spared, (spared_child, orphan) = start()
    leaked, leaked_pids = start("--ignore-term")
    try:
        assert {p.pid for p in descendants()} >= {leaked.pid, *leaked_pids, spared.pid, orphan}
        left = stop_leftovers(before, settle=0.1, grace=0.5, spare=lambda: {spared.pid})
        assert {x.pid for x in left} == {leaked.pid, *leaked_pids, orphan}
        assert all(x.command.startswith(sys.executable) for x in left), left
        assert survivors([leaked.pid, *leaked_pids, orphan], wait=0) == []
        alive = [spared.pid, spared_child, kept.pid]
        assert survivors(alive, wait=0) == alive
        # The stopped child was waited for: no zombie of it is left below this process.
        assert leaked.pid not in {p.pid for p in descendants()}
    finally:
        kill_trees([spared.pid, kept.pid], grace=0)
        for proc in (spared, leaked, kept):
            proc.wait()
