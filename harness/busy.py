"""Cards held by processes outside this run, asked of each device type's own tool.

A card a previous job left a process on (a crashed training run, a stuck rank) fails the
next suite in ways that look like the suite's fault: out of memory, a hung collective. At
the start of a session the plugin asks the device's tool which processes hold cards
(:data:`BUSY_QUERIES`, one entry per accelerator of the device table: a test checks),
leaves out this run's own processes and names the others: a warning, or with ini
``harness_busy_cards = fail`` a stop before any test runs. A device whose tool is not on
``PATH`` has no cards here to check.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from collections.abc import Callable, Collection

from harness.errors import HarnessError

#: A process on a card as a tool reports it: ``(pid, card, memory_mb, name)``.
Row = tuple[int, str, "int | None", str]


def _nvidia(text: str) -> list[Row]:
    # pid, process_name, gpu_bus_id, used_memory ("123 MiB"), one process per line.
    out = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) >= 4 and row[0].strip().isdigit():
            memory = re.match(r"\d+", row[3].strip())
            out.append((int(row[0]), row[2].strip(), int(memory[0]) if memory else None, row[1]))
    return out


# `npu-smi info`'s process table: | NPU  Chip | Process id | Process name | Process memory(MB) |
_NPU_PROCESS = re.compile(r"^\|\s*(\d+)\s+(\d+)\s*\|\s*(\d+)\s*\|\s*(.*?)\s*\|\s*(\d+)\s*\|")


def _npu(text: str) -> list[Row]:
    matches = filter(None, map(_NPU_PROCESS.match, text.splitlines()))
    return [(int(m[3]), f"{m[1]}/{m[2]}", int(m[5]), m[4]) for m in matches]


#: Device type -> (the tool's argv, the parser of its output into :data:`Row` values).
BUSY_QUERIES: dict[str, tuple[tuple[str, ...], Callable[[str], list[Row]]]] = {
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
    return {me.pid, *(p.pid for p in me.parents()), *(p.pid for p in me.children(recursive=True))}


def card_users(device: str, exclude: Collection[int] = (), timeout: float = 30.0) -> list[str]:
    """One line per process other than ``exclude`` holding a ``device`` card (card, pid,
    command line, memory), by the device's own tool; none when the tool is not on ``PATH``.
    Raises :class:`BusyCheckError` when it fails or does not answer within ``timeout``."""
    argv, parse = BUSY_QUERIES[device]
    tool = shutil.which(argv[0])
    if tool is None:
        return []
    try:
        done = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BusyCheckError(f"{' '.join(argv)}: {e}") from None
    if done.returncode != 0:
        raise BusyCheckError(
            f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-300:]}"
        )
    return [
        f"{device} card {card}: pid {pid} ({_command(pid, name)}"
        + (f", {memory} MiB)" if memory is not None else ")")
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


def check_busy_cards(config) -> None:
    """The session-start check, for the plugin's ``pytest_sessionstart`` (xdist's controller
    runs it once, before any worker starts; workers skip it). Names each process outside
    this run holding a card of an accelerator whose tool is on ``PATH``: a warning line, or
    under ``fail`` a stop (exit 1) before any test runs; a tool that fails is a warning."""
    import pytest

    mode = str(config.getini(BUSY_CARDS_INI)).strip().lower() or "warn"
    if mode not in BUSY_MODES:
        raise pytest.UsageError(f"ini {BUSY_CARDS_INI} = {mode!r}: expected one of {BUSY_MODES}")
    # Not on xdist workers (their controller checked), not in a collect-only session
    # (the inventory's: it runs nothing), not where no device tool is installed (psutil,
    # which the inventory does without, is then never imported).
    tools = [d for d in sorted(BUSY_QUERIES) if shutil.which(BUSY_QUERIES[d][0][0])]
    if mode == "off" or hasattr(config, "workerinput") or config.option.collectonly or not tools:
        return
    say = config.get_terminal_writer()
    found: list[str] = []
    own = own_processes()
    for device in tools:
        try:
            found += card_users(device, own)
        except BusyCheckError as e:
            say.line(
                f"harness: warning: could not ask which processes hold the {device} cards: {e}",
                yellow=True,
            )
    if found:
        message = (
            f"cards held by processes outside this run ({BUSY_CARDS_INI} = {mode}): "
            + "; ".join(found)
        )
        if mode == "fail":
            pytest.exit(f"harness: {message}", returncode=1)
        say.line(f"harness: warning: {message}", yellow=True)
