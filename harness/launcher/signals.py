"""Signals in the launching process while it has ranks: SIGTERM reaps them
before the process goes, and a second Ctrl-C cannot interrupt the reaping."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class _Terminated(BaseException):
    """SIGTERM arrived while ranks were running."""


@contextlib.contextmanager
def reap_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into an exception while ranks run, so ``finally`` blocks reap
    them; afterwards the signal is delivered again to its previous handler
    (by default: the process ends as a SIGTERM would have ended it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)
        raise KeyboardInterrupt("SIGTERM") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM while reaping, so a second Ctrl-C cannot leave
    half-killed ranks behind; deliver them afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        saved[sig] = signal.getsignal(sig)
        if saved[sig] not in (signal.SIG_IGN, None):
            signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)
