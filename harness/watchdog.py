"""The watchdog that holds each phase of this process's work (a launched case's fixture
setup or teardown) to its deadline, on a thread of its own (faulthandler's single timer is
pytest's ``faulthandler_timeout``'s)."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

#: How long past its deadline the watchdog waits, after interrupting the main
#: thread, before it stops the process (never more than the deadline again).
WATCHDOG_GRACE_S = 60.0
#: Interrupts the main thread at a phase deadline: ignored by default (a late one does
#: nothing), and neither pytest-timeout's (SIGALRM) nor faulthandler's.
INTERRUPT_SIGNAL = signal.SIGURG
#: How long after the watch thread's stop faulthandler's C timer stops the process.
BACKSTOP_MARGIN_S = 5.0
# The longest the watch thread sleeps at once (a deadline years away would overflow the
# wait), and the latest backstop faulthandler takes (its timer overflows beyond a year).
_LONGEST_WAIT_S = 3600.0
_LONGEST_BACKSTOP_S = 365 * 86400.0
# This process's stderr as it was when the harness was loaded: pytest loads its plugins
# before its capture replaces fd 2 with a file that dies with the process.
try:
    _STDERR: int | None = os.dup(2)
except OSError:  # no stderr at all
    _STDERR = None


@dataclass
class _Armed:
    seconds: float
    grace: float
    what: str
    why: str
    error: Callable[[str], BaseException]
    start: float
    backstop: bool = True  # faulthandler's timer is free for the backstop while armed
    interrupted: bool = False
    signalled: bool = False
    raised: bool = False

    def headline(self) -> str:
        return f"{self.what} ran past {self.seconds:g} s" + (f" {self.why}" if self.why else "")


class Watchdog:
    """The deadlines of the phases of this process's work, on a thread of its own.

    Past ``seconds`` the main thread is interrupted: ``error(message)`` is raised where it
    is and the process goes on. A main thread still in the phase ``grace`` seconds later:
    ``exit_hooks`` are called with the headline, every thread's stack goes to stderr and the
    process exits 1. Phases are armed per ``key`` (one per owner). Native code holding the
    GIL starves the thread, so with ``backstop`` faulthandler's C timer also stops the
    process ``BACKSTOP_MARGIN_S`` later (``backstop=False``: the session uses that timer).
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._armed: dict[object, _Armed] = {}
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self._installed = False
        self.exit_hooks: list[Callable[[str], None]] = []
        self._backstop_set = False

    def _set_backstop(self) -> None:
        """Set faulthandler's timer for the earliest stop of the phases armed (under the
        lock); while one without ``backstop`` is armed, the timer is its session's."""
        free = all(a.backstop for a in self._armed.values())
        stops = [a.start + a.seconds + a.grace for a in self._armed.values()]
        seconds = min(stops) - time.monotonic() + BACKSTOP_MARGIN_S if stops else None
        if free and _STDERR is not None and seconds is not None and seconds < _LONGEST_BACKSTOP_S:
            faulthandler.dump_traceback_later(max(seconds, 0.001), exit=True, file=_STDERR)
            self._backstop_set = True
        elif self._backstop_set:
            if free:  # nobody else's: ours is stale
                faulthandler.cancel_dump_traceback_later()
            self._backstop_set = False

    def disarm(self, key: object) -> None:
        """``key``'s phase is over (it ended, or failed at its deadline)."""
        with self._lock:
            self._armed.pop(key, None)
            self._set_backstop()
            if not self._armed and self._installed:
                signal.signal(INTERRUPT_SIGNAL, self._previous)
                self._installed = False
                self._previous = None
            self._lock.notify_all()

    @contextlib.contextmanager
    def bounding(
        self,
        key: object,
        seconds: float,
        *,
        grace: float,
        what: str,
        why: str = "",
        error: Callable[[str], BaseException],
        backstop: bool = True,
    ) -> Iterator[None]:
        """Bound ``key``'s phase, the body (in the main thread), replacing what ``key`` had
        armed; disarmed however it ends. Messages read ``{what} ran past {seconds} s {why}``."""
        armed = _Armed(seconds, grace, what, why, error, time.monotonic(), backstop)
        with self._lock:
            if not self._installed and threading.current_thread() is threading.main_thread():
                self._previous = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
                self._installed = True
            self._armed[key] = armed
            self._set_backstop()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="harness-watchdog", daemon=True
                )
                self._thread.start()
            self._lock.notify_all()
        try:
            yield
        finally:
            self.disarm(key)

    def _on_signal(self, signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        due = [a for a in list(self._armed.values()) if a.signalled and not a.raised]
        if not due:
            if callable(self._previous):
                self._previous(signum, frame)
            return
        due[0].raised = True
        raise due[0].error(
            f"{due[0].headline()}; the stacks of this process's threads then:\n{_stacks()}"
        )

    def _watch(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                wake = None
                for armed in list(self._armed.values()):
                    due = armed.start + armed.seconds + (armed.grace if armed.interrupted else 0.0)
                    if due > now:
                        wake = due if wake is None else min(wake, due)
                    elif not armed.interrupted:
                        armed.interrupted = True
                        armed.signalled = self._installed
                        if armed.signalled:
                            signal.pthread_kill(threading.main_thread().ident, INTERRUPT_SIGNAL)
                        wake = now
                    else:
                        self._exit(armed)
                if wake is None:
                    self._lock.wait()
                elif wake > now:
                    self._lock.wait(min(wake - now, _LONGEST_WAIT_S))

    def _exit(self, armed: _Armed) -> NoReturn:
        try:
            for hook in self.exit_hooks:
                with contextlib.suppress(Exception):
                    hook(armed.headline())
            log = sys.__stderr__
            log.write(
                f"{armed.headline()}\nTimeout ({datetime.timedelta(seconds=round(armed.seconds))})! "
                f"{'still running' if armed.signalled else 'not interruptible here;'} "
                f"{armed.grace:g} s later; the stacks of this process's threads:\n"
            )
            log.flush()
            faulthandler.dump_traceback(file=log, all_threads=True)
            log.flush()
        finally:
            os._exit(1)


def _stacks() -> str:
    """Every thread's stack as faulthandler writes it (it needs a real file)."""
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


#: This process's watchdog (one per process: one main thread to interrupt).
watchdog = Watchdog()


def faulthandler_free(config: Any) -> bool:
    """Whether the pytest session of ``config`` leaves faulthandler's one timer free (its
    ``faulthandler_timeout`` is not set): the ``backstop`` of its phases."""
    try:
        return not float(config.getini("faulthandler_timeout") or 0) > 0
    except ValueError:  # -p no:faulthandler: pytest does not use the timer
        return True
