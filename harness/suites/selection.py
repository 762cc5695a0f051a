"""pytest plugin that ``harness run`` loads (``-p harness.suites.selection``): run exactly the planned cases.

``--harness-select FILE`` names a JSON file ``{"root": DIR, "cases":
{nodeid: deadline_s or null}}``. Collected items not in it are deselected;
planned cases that were not collected are reported (``harness run`` counts
them as missing, never as passed). A plain (not launched) case with a
deadline runs under a faulthandler watchdog: past the deadline (plus as
long again, at most a minute) its stacks are written to ``watchdog-<pid>.log``
next to the selection file and its process exits, so a hung in-process test
fails its xdist worker instead of stalling the job. Launched cases are left to the
launch plugin, which enforces their deadline and reaps their ranks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.spec import is_launched

# Extra time the watchdog allows past a case's deadline (setup, teardown and
# fixtures count against it too): as long again, at most a minute.
WATCHDOG_GRACE_S = 60.0

WATCHDOG_MARK = "harness watchdog:"

#: A selected item's deadline in seconds (``None``: no watchdog).
_DEADLINE = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness-run", "harness run (case selection)")
    group.addoption(
        "--harness-select",
        metavar="FILE",
        default=None,
        help="JSON file of the planned cases (written by `harness run`); other items are deselected",
    )


def _load(config: pytest.Config) -> dict[str, Any] | None:
    path = config.getoption("harness_select")
    if not path:
        return None
    cached = getattr(config, "_harness_selection", None)
    if cached is None:
        try:
            cached = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise pytest.UsageError(f"--harness-select {path}: {e}") from e
        config._harness_selection = cached  # type: ignore[attr-defined]
    return cached


def _case_id(item: pytest.Item, root: Path) -> str:
    from harness.suites.inventory import case_id

    return case_id(item, root)


def started_marker(select_file: Path) -> Path:
    """The file the controller writes next to ``select_file`` once its session has
    started: from then on an interrupt is reported by pytest; before, nothing ran."""
    return select_file.with_name(select_file.name + ".started")


def pytest_sessionstart(session: pytest.Session) -> None:
    path = session.config.getoption("harness_select")
    if path and not hasattr(session.config, "workerinput"):  # the controller only
        started_marker(Path(path)).touch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    sel = _load(config)
    if sel is None:
        return
    root = Path(sel["root"])
    wanted: dict[str, Any] = sel["cases"]
    keep, drop, seen = [], [], set()
    for item in items:
        cid = _case_id(item, root)
        if cid in wanted:
            keep.append(item)
            seen.add(cid)
            item.stash[_DEADLINE] = wanted[cid]
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    missing = sorted(set(wanted) - seen)
    if missing and not hasattr(config, "workerinput"):  # report once, on the controller
        shown = "\n  ".join(missing[:20])
        more = f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        print(f"\nharness: {len(missing)} planned case(s) were not collected:\n  {shown}{more}", file=sys.stderr)


def _watchdog_log(config: pytest.Config) -> Any:
    """This process's watchdog file, next to the selection file: it holds the
    armed case's name and, if the watchdog fires, the stacks (empty otherwise)."""
    f = getattr(config, "_harness_watchdog", None)
    if f is None:
        path = Path(config.getoption("harness_select")).with_name(f"watchdog-{os.getpid()}.log")
        f = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open for the process's life)
        config._harness_watchdog = f  # type: ignore[attr-defined]
    return f


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    deadline = item.stash.get(_DEADLINE, None)
    armed = deadline is not None and not is_launched(item)
    if armed:
        seconds = float(deadline) + min(float(deadline), WATCHDOG_GRACE_S)
        log = _watchdog_log(item.config)
        log.seek(0)
        log.truncate()
        log.write(f"{WATCHDOG_MARK} {item.nodeid} ran past {seconds:g} s (deadline {float(deadline):g} s)\n")
        log.flush()
        # exit=True: the process dies with the stacks in the log; under xdist
        # the controller reports the case as failed ("worker crashed").
        faulthandler.dump_traceback_later(seconds, exit=True, file=log)
    try:
        return (yield)
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()
            log.seek(0)
            log.truncate()
            log.flush()


def pytest_unconfigure(config: pytest.Config) -> None:
    f = getattr(config, "_harness_watchdog", None)
    if f is not None:
        f.close()
        Path(f.name).unlink(missing_ok=True)


def fired(folder: Path) -> list[tuple[str, Path]]:
    """``(headline, file)`` for each watchdog that fired in a run whose selection
    files are in ``folder`` (a file left non-empty by a process that died)."""
    out = []
    for p in sorted(folder.glob("watchdog-*.log")):
        text = p.read_text(encoding="utf-8", errors="replace")
        if text.startswith(WATCHDOG_MARK) and "Timeout" in text:
            out.append((text.splitlines()[0].removeprefix(WATCHDOG_MARK).strip(), p))
    return out
