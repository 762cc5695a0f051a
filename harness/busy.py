"""Cards held by processes outside this run, asked of each device type's own tool.

A card a previous job left a process on (a crashed training run, a stuck rank) fails the
next suite in ways that look like the suite's fault: out of memory, a hung collective. At
the start of a session the plugin asks the device's tool which processes hold cards
(:data:`BUSY_QUERIES`, one entry per accelerator row of the device table: a test checks),
leaves out this run's own processes, and says which others it found: a warning, or with
ini ``harness_busy_cards = fail`` the session stops before any test runs. A device whose
tool is not on ``PATH`` has no cards here to check.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from harness.errors import HarnessError


@dataclass(frozen=True)
class CardUser:
    """A process holding a card: its ``pid``, the ``card`` (the tool's name for it),
    ``memory_mb`` it holds (None when the tool does not say) and its ``command``."""

    device: str
    pid: int
    card: str
    memory_mb: int | None
    command: str

    def __str__(self) -> str:
        memory = f", {self.memory_mb} MiB" if self.memory_mb is not None else ""
        return f"{self.device} card {self.card}: pid {self.pid} ({self.command}{memory})"


def _nvidia(text: str) -> list[tuple[int, str, int | None, str]]:
    # pid, process_name, gpu_bus_id, used_memory ("123 MiB"), one process per line.
    out = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) >= 4 and row[0].strip().isdigit():
            memory = re.match(r"\d+", row[3].strip())
            out.append((int(row[0]), row[2].strip(), int(memory[0]) if memory else None, row[1]))
    return out


# `npu-smi info`'s process table: | NPU  Chip | Process id | Process name | Process memory(MB) |
_NPU_PROCESS = re.compile(r"^\|\s*(\d+)\s+(\d+)\s*\|\s*(\d+)\s*\|\s*(.*?)\s*\|\s*(\d+)\s*\|")


def _npu(text: str) -> list[tuple[int, str, int | None, str]]:
    return [
        (int(m[3]), f"{m[1]}/{m[2]}", int(m[5]), m[4])
        for m in map(_NPU_PROCESS.match, text.splitlines())
        if m
    ]


#: Device type -> (the tool's argv, the parser of its output into ``(pid, card,
#: memory_mb, name)``).
BUSY_QUERIES: dict[str, tuple[tuple[str, ...], Callable[[str], list]]] = {
    "cuda": (
        (
            "nvidia-smi",
            "--query-compute-apps=pid,process_name,gpu_bus_id,used_memory",
            "--format=csv,noheader",
        ),
        _nvidia,
    ),
    "npu": (("npu-smi", "info"), _npu),
}


class BusyCheckError(HarnessError):
    """The device's tool is there but did not answer."""


def _command(pid: int, fallback: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:  # gone, or in another pid namespace: the tool's name for it
        return fallback
    return " ".join(w.decode(errors="replace") for w in words if w) or fallback


def own_processes() -> set[int]:
    """This run's processes: this one, those above it (``harness run``, the shell) and
    those below it (xdist workers, ranks)."""
    import psutil

    me = psutil.Process()
    return {
        me.pid,
        *(p.pid for p in me.parents()),
        *(p.pid for p in me.children(recursive=True)),
    }


def card_users(device: str, exclude: Collection[int] = (), timeout: float = 30.0):
    """The processes holding ``device`` cards other than ``exclude``, by the device's own
    tool (:data:`BUSY_QUERIES`); None when the tool is not on ``PATH``. Raises
    :class:`BusyCheckError` when it fails or does not answer within ``timeout``."""
    argv, parse = BUSY_QUERIES[device]
    tool = shutil.which(argv[0])
    if tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, *argv[1:]], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BusyCheckError(f"{' '.join(argv)}: {e}") from None
    if done.returncode != 0:
        raise BusyCheckError(
            f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-300:]}"
        )
    return [
        CardUser(device, pid, card, memory, _command(pid, name))
        for pid, card, memory, name in parse(done.stdout)
        if pid not in exclude
    ]


# --------------------------------------------------------------------------- pytest

#: The ini option: ``off``, ``warn`` (the default) or ``fail``.
BUSY_CARDS_INI = "harness_busy_cards"
BUSY_MODES = ("off", "warn", "fail")


def addoption(parser) -> None:
    """Register :data:`BUSY_CARDS_INI` (for the plugin's ``pytest_addoption``)."""
    parser.addini(
        BUSY_CARDS_INI,
        "cards held by processes outside this run at the start of the session: "
        "off, warn (the default: name them) or fail (name them and run nothing)",
        default="warn",
    )


def check_busy_cards(config, devices: Iterable[str] | None = None) -> None:
    """The session-start check, for the plugin's ``pytest_sessionstart`` (which runs in
    xdist's controller too, before any worker starts; ``devices``: the accelerator types to
    check, default every one whose tool is on ``PATH``). Names each process outside this
    run holding a card of those devices: a warning line, or under ``fail`` a stop (exit 1)
    before any test runs. Nothing on xdist workers (their controller checked)."""
    import pytest

    mode = str(config.getini(BUSY_CARDS_INI)).strip().lower() or "warn"
    if mode not in BUSY_MODES:
        raise pytest.UsageError(f"ini {BUSY_CARDS_INI} = {mode!r}: expected one of {BUSY_MODES}")
    if mode == "off" or hasattr(config, "workerinput"):
        return
    found: list[str] = []
    notes: list[str] = []
    own = own_processes()
    for device in sorted(
        BUSY_QUERIES.keys() if devices is None else set(devices) & BUSY_QUERIES.keys()
    ):
        try:
            found += map(str, card_users(device, own) or ())
        except BusyCheckError as e:
            notes.append(f"could not ask which processes hold the {device} cards: {e}")
    say = config.pluginmanager.get_plugin("terminalreporter")
    for note in notes:
        if say is not None:
            say.write_line(f"harness: warning: {note}", yellow=True)
    if not found:
        return
    message = f"cards held by processes outside this run ({BUSY_CARDS_INI} = {mode}): " + "; ".join(
        found
    )
    if mode == "fail":
        pytest.exit(f"harness: {message}", returncode=1)
    if say is not None:
        say.write_line(f"harness: warning: {message}", yellow=True)
    else:
        os.write(2, f"harness: warning: {message}\n".encode())
