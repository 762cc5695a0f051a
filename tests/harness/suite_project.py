"""Builds small repositories (tests/ + suites/) for the suite, inventory, plan and CLI tests."""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path
from typing import Any

# The in-process inventory loads every pytest plugin, hypothesis's among them.
# pytester drops modules first imported during a test and they would be
# re-imported (~1 s) by every test: import them once, up front.
import hypothesis  # noqa: F401
import xdist  # noqa: F401

CPU_RUNNER: dict[str, Any] = {"labels": ["ubuntu-latest"], "cards": 0, "timeout_minutes": 10}
GPU_RUNNER: dict[str, Any] = {"labels": ["self-hosted", "gpu"], "cards": 2, "timeout_minutes": 10}
NPU_RUNNER: dict[str, Any] = {"labels": ["self-hosted", "npu"], "cards": 2, "timeout_minutes": 10}

DEVICE_TESTS = """
    import pytest

    def test_plain():
        pass

    @pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
    def test_dev(device):
        pass
"""


def manifest(
    suite: str, device: str, entries: list[dict[str, Any]], runner: Any = None
) -> dict[str, Any]:
    """A manifest document for ``suites/<suite>.json``."""
    default = {"cpu": CPU_RUNNER, "cuda": GPU_RUNNER, "npu": NPU_RUNNER}[device]
    # Deep copies: tests mutate the documents they get.
    return copy.deepcopy(
        {"suite": suite, "device": device, "runner": runner or default, "entries": entries}
    )


def make_project(
    root: Path, tests: dict[str, str], suites: dict[str, Any], extra: dict[str, Any] | None = None
) -> Path:
    """Write ``pyproject.toml``, the test files (dedented), ``suites/<name>.json`` for each
    suite (a dict is dumped as JSON, a str written verbatim) and ``extra`` files."""
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    files: dict[str, Any] = dict(tests)
    files.update({f"suites/{name}.json": doc for name, doc in suites.items()})
    files.update(extra or {})
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        text = content if isinstance(content, str) else json.dumps(content, indent=2)
        p.write_text(textwrap.dedent(text) if rel.endswith(".py") else text)
    (root / "suites").mkdir(exist_ok=True)
    return root
