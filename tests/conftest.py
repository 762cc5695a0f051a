"""Project-wide test configuration.

Imports: shared test helpers live in ``tests/`` and are imported by package
path, ``from tests.strategies import packed_cases``. This file puts the
repository root on ``sys.path`` (rank processes started by the harness inherit
it), so that works from any test directory and under any ``--import-mode``.

Hypothesis profiles, chosen with ``HYPOTHESIS_PROFILE`` (default ``ci``):

* ``ci``: bounded example counts, no deadline (CI machines stall), and
  derandomized so a CI run is reproducible;
* ``dev``: more examples, random seeds, for local exploration;
* ``nightly``: many more examples, random seeds.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from hypothesis import HealthCheck, settings

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Tests that stop an inner pytest with SIGINT play a terminal's Ctrl-C. Started as a
# background job of a script (`.ci/run &`, nohup), this run, and everything it
# starts, would inherit SIGINT ignored (an ignored signal stays ignored across
# exec), and those inner sessions would never see the signal. Take it as a
# terminal run does: a handler here resets to the default in every child.
if (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
):
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The tests start inner pytest sessions and `harness run`s that must behave as they do
# on a developer's machine wherever this suite runs: pytest shortens assertion diffs
# only off CI (CI, BUILD_NUMBER), and `harness run` takes the runner's timeout under CI.
# A test of CI behaviour sets these itself.
for _name in ("CI", "BUILD_NUMBER", "GITHUB_STEP_SUMMARY"):
    os.environ.pop(_name, None)

# The bitwise tests enable deterministic algorithms; on CUDA, cuBLAS then
# refuses to run unless its workspace is pinned. Set before any CUDA context
# exists (rank processes inherit it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "dev", max_examples=300, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.register_profile(
    "nightly", max_examples=3000, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
