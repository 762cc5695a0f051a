"""Cards held by processes outside this run, asked of each device type's own tool
(``busy_query`` / ``parse_busy`` of its device-table row) at session start: a card a
previous job left a process on fails the next suite in ways that look like its fault.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Collection

from harness.devices import DEVICE_TABLE, device_type
from harness.errors import HarnessError
from harness.processes import command_line, descendants

#: The ini option: ``off``, ``warn`` (the default) or ``fail``.
BUSY_CARDS_INI = "harness_busy_cards"
BUSY_MODES = ("off", "warn", "fail")


class BusyCheckError(HarnessError):
    """The device's tool is there but did not answer."""


def own_processes() -> set[int]:
    """This run's processes: this one, those above it (``harness run``, the shell) and
    those below it (xdist workers, ranks)."""
    import psutil

    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents()), *(p.pid for p in descendants())}


def card_users(device: str, exclude: Collection[int]) -> list[str]:
    """One line per process other than ``exclude`` holding a ``device`` card (card, pid,
    command line, memory), by the device's own tool; none when the tool is not on ``PATH``.
    Raises :class:`BusyCheckError` when it fails or does not answer within 30 s."""
    argv, parse = device_type(device).busy_query, device_type(device).parse_busy
    tool = shutil.which(argv[0])
    if tool is None:
        return []
    import psutil

    try:
        done = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BusyCheckError(f"{' '.join(argv)}: {e}") from None
    if done.returncode != 0:
        raise BusyCheckError(
            f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-300:]}"
        )
    lines = []
    for pid, card, memory, name in parse(done.stdout):
        if pid in exclude:
            continue
        with contextlib.suppress(psutil.Error):  # gone, or in another pid namespace
            name = command_line(psutil.Process(pid), fallback=name)
        lines.append(
            f"{device} card {card}: pid {pid} ({name}"
            + (f", {memory} MiB)" if memory is not None else ")")
        )
    return lines


def addoption(parser) -> None:
    """Register :data:`BUSY_CARDS_INI` (for the plugin's ``pytest_addoption``)."""
    parser.addini(
        BUSY_CARDS_INI,
        "cards held by processes outside this run at the start of the session: "
        "off, warn (the default: name them) or fail (name them and run nothing)",
        default="warn",
    )


def check_busy_cards(config) -> None:
    """The plugin's session-start check: each process outside this run holding a card of an
    accelerator whose tool is on ``PATH``, in a warning line, or under ``fail`` a stop
    (exit 1) before any test runs; a tool that fails is a warning."""
    import pytest

    mode = str(config.getini(BUSY_CARDS_INI)).strip().lower() or "warn"
    if mode not in BUSY_MODES:
        raise pytest.UsageError(f"ini {BUSY_CARDS_INI} = {mode!r}: expected one of {BUSY_MODES}")
    # Not on xdist workers (their controller checked), not in a collect-only session
    # (the inventory's: it runs nothing), not where no device tool is installed (psutil,
    # which the inventory does without, is then never imported).
    tools = [d.name for d in DEVICE_TABLE if d.busy_query and shutil.which(d.busy_query[0])]
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
