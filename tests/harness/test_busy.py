"""Cards held by processes outside the run, found with the device's own tool.

The tool is a stand-in script first on ``PATH`` (a real subprocess, printing what
``nvidia-smi`` / ``npu-smi`` print), and the processes it names are real: one outside the
run (a ``sleep`` this test starts) and the pytest process that runs the tool (its parent),
which is the run's own.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.devices import ACCELERATOR_NAMES, device_type

NVIDIA_SMI = """\
#!/bin/sh
[ "$*" = "--query-compute-apps=pid,process_name,gpu_bus_id,used_memory --format=csv,noheader" ] || exit 9
echo "$PPID, python, 00000000:01:00.0, 100 MiB"
echo "$FOREIGN_PID, sleep, 00000000:02:00.0, 2048 MiB"
"""

NPU_SMI = """\
#!/bin/sh
[ "$*" = "info" ] || exit 9
cat <<EOF
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                   Version: 23.0.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.5        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3382 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | $PPID         | python                   | 100                     |
| 0       0                 | $FOREIGN_PID  | sleep                    | 2048                    |
+===========================+===============+====================================================+
| No running processes found in NPU 1                                                            |
+===========================+===============+====================================================+
EOF
"""


def test_every_accelerator_has_a_query():
    # A device type added to the table gets its tool here too.
    rows = [device_type(name) for name in ACCELERATOR_NAMES]
    assert all(r.busy_query and r.parse_busy for r in rows)


@pytest.fixture
def foreign():
    """A real process outside the run, holding a card as far as the stand-in tools say."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def _tools(folder: Path, **scripts: str) -> str:
    folder.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(stat.S_IRWXU)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


#: The card each stand-in tool says the foreign process holds.
CARDS = {"nvidia-smi": "00000000:02:00.0", "npu-smi": "0/0"}


def test_a_card_held_outside_the_run_is_named_and_fails_in_strict_mode(
    pytester, foreign, monkeypatch
):
    # Both tools on PATH: each session asks both, so each check below holds for each tool.
    pytester.makepyfile("def test_a():\n    pass\n")
    scripts = {"nvidia-smi": NVIDIA_SMI, "npu-smi": NPU_SMI}
    monkeypatch.setenv("PATH", _tools(pytester.path / "bin", **scripts))
    monkeypatch.setenv("FOREIGN_PID", str(foreign.pid))
    named = {tool: f"card {card}: pid {foreign.pid} (" for tool, card in CARDS.items()}

    warned = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert warned.ret == 0
    out = warned.stdout.str()
    assert "harness: warning: cards held by processes outside this run" in out
    for tool, card in CARDS.items():
        # its command line, read from /proc, and the memory the tool gave
        entry = r"\((?:(?! card ).)*time\.sleep\(60\), 2048 MiB\)"  # within this card's entry
        held = rf"card {re.escape(card)}: pid {foreign.pid} {entry}"
        assert re.search(held, out), (tool, out)
    # The pytest process that ran the tools is the run's own: never named.
    assert "python, 100 MiB" not in out, out

    failed = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-o", "harness_busy_cards=fail"
    )
    assert failed.ret == 1
    for text in named.values():
        assert text in failed.stdout.str() + failed.stderr.str()
    assert "1 passed" not in failed.stdout.str()  # nothing ran

    # Under xdist: checked once, by the controller (whose workers are its own processes).
    spread = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    assert spread.ret == 0
    for text in named.values():
        assert spread.stdout.str().count(text) == 1, spread.stdout.str()

    off = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "harness_busy_cards=off")
    assert off.ret == 0
    assert "cards held" not in off.stdout.str()


def test_no_tool_no_check_and_a_failing_tool_is_a_warning(pytester, monkeypatch):
    pytester.makepyfile("def test_a():\n    pass\n")
    # No tool on PATH (a CPU machine): nothing to check, strict or not.
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    quiet = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "harness_busy_cards=fail")
    assert quiet.ret == 0
    assert "cards held" not in quiet.stdout.str()
    assert "could not ask" not in quiet.stdout.str()
    # A tool that fails (a driver not loaded) is said, not taken for free cards or a stop.
    broken = textwrap.dedent("""\
        #!/bin/sh
        echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver" >&2
        exit 9
    """)
    monkeypatch.setenv("PATH", _tools(pytester.path / "bin", **{"nvidia-smi": broken}))
    said = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "harness_busy_cards=fail")
    assert said.ret == 0
    assert "could not ask which processes hold the cuda cards" in said.stdout.str()
    assert "couldn't communicate with the NVIDIA driver" in said.stdout.str()
    bad = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "harness_busy_cards=maybe")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
