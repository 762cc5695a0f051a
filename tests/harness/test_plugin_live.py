"""``pytest -s``: rank output is streamed while the case runs, each line
prefixed with its rank."""

from __future__ import annotations

import subprocess
import time

from launch_project import inner_env, pytest_command, write_project

LIVE = """
    import os
    import time

    import pytest

    from recording import out_dir


    @pytest.mark.launch(nproc=2)
    def test_talks_while_it_runs():
        print(f"waiting for the go, rank {os.environ['RANK']}", flush=True)
        end = time.monotonic() + 60
        while not (out_dir() / "go").exists():
            assert time.monotonic() < end, "nobody saw the output while the case ran"
            time.sleep(0.05)
        print("done", flush=True)
"""


def test_rank_output_is_streamed_live_with_the_rank_prefix(tmp_path):
    root = write_project(tmp_path / "project", {"test_live.py": LIVE})
    out = root / "out"
    proc = subprocess.Popen(
        pytest_command(root, "-s"),
        cwd=root,
        env=inner_env(out, root / "leases"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        end = time.monotonic() + 120
        waiting = {"[rank 0] waiting for the go, rank 0", "[rank 1] waiting for the go, rank 1"}
        for line in proc.stdout:
            seen.append(line.rstrip("\n"))
            waiting.discard(seen[-1])
            if not waiting:
                (out / "go").write_text("")  # the case is still running: it waits for this
                break
            assert time.monotonic() < end
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    output = "\n".join(seen) + rest
    assert not waiting, output
    assert proc.returncode == 0, output
    assert "[rank 0] done" in rest, output
    assert "[rank 1] done" in rest, output
    assert "----- rank 0 output -----" not in output  # streamed, not echoed again
