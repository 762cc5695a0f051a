"""Every case contained, plain or launched: what a case started that still runs after its
teardown is stopped and reported against it (``harness_leaks``: warn or fail); the pytest
process a child subreaper meanwhile. See docs/harness.md ("Process containment")."""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any

import pytest

from harness import processes
from harness.launcher.pool import keeper
from harness.names import LEAK_PROPERTY

if TYPE_CHECKING:
    import psutil

LEAKS_INI = "harness_leaks"
LEAK_MODES = ("warn", "fail")
#: How long a case's leftover gets to end by itself (one told to stop that has not yet).
SETTLE_S = 0.5
#: Between SIGTERM and SIGKILL for a case's leftovers.
GRACE_S = 1.0

_BEFORE = pytest.StashKey["set[psutil.Process]"]()
#: What a case's own processes (ranks, a command's supervisor) stopped and named.
RANK_LEAKS = pytest.StashKey[list[str]]()


class LeakWarning(pytest.PytestWarning):
    """A case left processes running after its teardown (they were stopped)."""


def addoption(parser: pytest.Parser) -> None:
    parser.addini(
        LEAKS_INI,
        default="warn",
        help="a process a case leaves running after its teardown is stopped and "
        "reported: warn (a LeakWarning of the case, the default) or fail (the case fails)",
    )


def configure(config: pytest.Config) -> None:
    """Register the containment of every case for this session (a bad ``harness_leaks``
    is a usage error)."""
    mode = str(config.getini(LEAKS_INI)).strip().lower()
    if mode not in LEAK_MODES:
        raise pytest.UsageError(
            f"ini {LEAKS_INI} = {config.getini(LEAKS_INI)!r}: choose one of {', '.join(LEAK_MODES)}"
        )
    config.pluginmanager.register(_Containment(mode), "harness-containment")


class _Containment:
    """One session's containment: each case's, and the session's at its end. Spared: what
    a wider-scoped fixture still set up started, the kept pool, the runtime's helpers."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # An inner session (pytester, in process) leaves the outer one's state as it was.
        self.was_subreaper = processes.is_subreaper()
        processes.subreaper()
        self.session_before = processes.descendants()
        #: what each wider-scoped fixture started while it was set up
        self.owned: dict[Any, set[psutil.Process]] = {}
        #: processes of wider-scoped fixtures torn down since the running case began
        self.released: set[psutil.Process] = set()

    def _spare(self) -> set[int]:
        pids = {p.pid for procs in self.owned.values() for p in procs} | runtime_helpers()
        if keeper.pool is not None:
            pids.update(keeper.pool.pids)
        return pids

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        processes.subreaper()  # again: a test may have turned it off
        self.released = set()
        item.stash[_BEFORE] = processes.descendants()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Any:
        if fixturedef.scope == "function":
            return (yield)
        before = processes.descendants()
        try:
            return (yield)
        finally:
            claimed = {p for procs in self.owned.values() for p in procs}
            self.owned[fixturedef] = processes.descendants() - before - claimed

    def pytest_fixture_post_finalizer(self, fixturedef: Any, request: Any) -> None:
        self.released |= self.owned.pop(fixturedef, set())

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        try:
            result = yield
        except BaseException:
            self._contain(item, failing=True)
            raise
        self._contain(item, failing=False)
        return result

    def _contain(self, item: pytest.Item, *, failing: bool) -> None:
        before = item.stash.get(_BEFORE, None)
        if before is None:
            return
        del item.stash[_BEFORE]
        stopped = processes.stop_leftovers(
            before - self.released, settle=SETTLE_S, grace=GRACE_S, spare=self._spare
        )
        self.released = set()
        rank_leaks = item.stash.get(RANK_LEAKS, [])
        if rank_leaks:
            del item.stash[RANK_LEAKS]  # a rerun of the case reports its own
        left = [*map(str, stopped), *rank_leaks]
        if not left:
            return
        item.user_properties.append((LEAK_PROPERTY, "; ".join(left)))
        message = (
            f"{item.nodeid} left {len(left)} process(es) running after its teardown; "
            "stopped them:\n" + "\n".join(f"  {leftover}" for leftover in left)
        )
        if self.mode == "fail" and not failing:
            raise pytest.fail.Exception(message, pytrace=False)
        warn_at(item, LeakWarning(message))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        left = processes.stop_leftovers(
            self.session_before, settle=SETTLE_S, grace=GRACE_S, spare=self._spare
        )
        if left:
            warnings.warn(
                LeakWarning(
                    f"{len(left)} process(es) started outside any case outlived the session; "
                    "stopped them:\n" + "\n".join(f"  {leftover}" for leftover in left)
                ),
                stacklevel=1,
            )

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if not self.was_subreaper:
            processes.subreaper(False)


def warn_at(item: pytest.Item, warning: Warning) -> None:
    """Issue ``warning`` at the test's own location (where pytest's summary points)."""
    path, lineno, _ = item.location
    warnings.warn_explicit(
        warning, type(warning), str(item.config.rootpath / path), (lineno or 0) + 1
    )


def runtime_helpers() -> set[int]:
    """The processes the runtime keeps for this process's life, whichever case started them:
    multiprocessing's resource tracker and forkserver, torch inductor's compile workers."""
    pids: set[int] = set()
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    forkserver = sys.modules.get("multiprocessing.forkserver")
    for pid in (
        getattr(getattr(tracker, "_resource_tracker", None), "_pid", None),
        getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None),
    ):
        if isinstance(pid, int):
            pids.add(pid)
    compile_pools = getattr(sys.modules.get("torch._inductor.async_compile"), "_pool_set", ())
    for pool in list(compile_pools):
        process = getattr(pool, "process", None)  # a SubprocPool: its one child
        if isinstance(getattr(process, "pid", None), int):
            pids.add(process.pid)
        pids.update(getattr(pool, "_processes", None) or ())  # a ProcessPoolExecutor
    return pids
