"""The code that runs inside one rank process.

A rank: ties its life to the launcher's (parent death kills it), leads its
own session (so the launcher finds everything it starts), sends its output to
its log file, registers a stack dump on SIGUSR1, sets its environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, card
visibility) before anything imports torch, selects its card, joins the
process group through a ``FileStore``, runs the function and writes its
``RankOutcome``. Nothing here imports torch at module level: the spawned
interpreter imports this module before the environment is set.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from harness.devices import Card, local_index, runtime_available, set_device
from harness.outcome import FAILED, PASSED, SKIPPED, XFAILED, RankOutcome
from harness.target import FunctionRef

#: A rank whose function returned gets this long to tear down (destroy the
#: process group, run exit handlers) before it exits regardless: a known
#: ``destroy_process_group`` hang must not hold the case.
EXIT_GRACE_S = 3.0
STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_keep: dict[str, object] = {}


@dataclass(frozen=True)
class RankTask:
    """The function a rank runs and its pickled ``(args, kwargs)``."""

    ref: FunctionRef
    args: bytes
    want_value: bool = True


@dataclass(frozen=True)
class RankContext:
    """Where one rank stands in its case (plain values only: it is unpickled
    before the rank's environment is set)."""

    rank: int
    world_size: int
    device: str
    backend: str
    card: Card | None
    simulated: bool
    store_path: str
    outcome_path: str
    stacks_path: str
    log_path: str | None
    pg_timeout_s: float
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)


def rank_main(ctx: RankContext, task: RankTask, lease_fds: list[int]) -> None:
    """Entry point of a spawned rank (a ``multiprocessing`` target).

    ``lease_fds`` are the launcher's lease descriptors, inherited and kept
    open for this process's whole life: the OS keeps the lease until every
    rank is gone, even if the launcher dies first.
    """
    del lease_fds  # kept open by never closing them
    _die_with_parent(ctx.parent_pid)
    with contextlib.suppress(OSError):
        os.setsid()
    if ctx.log_path is not None:
        _redirect_output(ctx.log_path)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if STACK_DUMP_SIGNAL is not None:
        # A file of its own, so the launcher can quote the dump whether or not
        # the rank's output is captured. faulthandler needs it kept open.
        _keep["stacks"] = open(ctx.stacks_path, "w")  # noqa: SIM115
        faulthandler.register(STACK_DUMP_SIGNAL, file=_keep["stacks"], all_threads=True)
    os.environ.update(ctx.env)
    outcome, dist_ready = _run(ctx, task)
    outcome.write(ctx.outcome_path)
    _finish(outcome, dist_ready)


def _die_with_parent(parent_pid: int) -> None:
    # Linux: the kernel SIGKILLs this rank when the thread that spawned it
    # ends (so a pool keeping ranks across calls must spawn them from a thread
    # that lives as long as the pool). Elsewhere: a watcher thread.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent_pid:  # the parent died before prctl
                    os._exit(1)
                return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def _redirect_output(path: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for name, fileno in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(fileno, "w", closefd=False, line_buffering=True))  # noqa: SIM115
        else:
            with contextlib.suppress(Exception):
                stream.reconfigure(line_buffering=True)


def _run(ctx: RankContext, task: RankTask) -> tuple[RankOutcome, bool]:
    dist_ready = False
    try:
        fn = task.ref.load()
        args, kwargs = pickle.loads(task.args)
        _init_distributed(ctx)
        dist_ready = True
        value = fn(*args, **kwargs)
        blob = None
        if task.want_value:
            try:
                blob = pickle.dumps(value)
            except Exception as exc:
                raise TypeError(
                    f"rank {ctx.rank} returned a {type(value).__qualname__}, which cannot be "
                    f"pickled back to the launcher: {exc}"
                ) from exc
        return RankOutcome(ctx.rank, PASSED, time.time(), value=blob), dist_ready
    except BaseException as exc:
        return outcome_from_exception(ctx.rank, exc), dist_ready


def _init_distributed(ctx: RankContext) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    if ctx.card is not None:
        _select_card(ctx)
    store = dist.FileStore(ctx.store_path, ctx.world_size)
    dist.init_process_group(
        ctx.backend,
        store=store,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=ctx.pg_timeout_s),
    )


def _select_card(ctx: RankContext) -> None:
    card = ctx.card
    assert card is not None
    if runtime_available(card.device):
        index = local_index(card)
        set_device(card, 0 if index is None else index)
    elif ctx.simulated:
        # HARNESS_CARDS names cards this torch cannot use: the inventory is
        # simulated (lease logic tested on a CPU machine); run without one.
        print(f"harness: rank {ctx.rank} holds simulated card {card}; not selecting it", file=sys.stderr)
    else:
        raise RuntimeError(f"rank {ctx.rank} was leased {card}, but torch cannot use {card.device} here")


def outcome_from_exception(rank: int, exc: BaseException) -> RankOutcome:
    """Classify what a rank's function raised: pytest skip / xfail / fail, or any error."""
    now = time.time()
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None:
        if isinstance(exc, outcomes.Skipped):
            return RankOutcome(rank, SKIPPED, now, summary=exc.msg or "")
        if isinstance(exc, outcomes.XFailed):
            return RankOutcome(rank, XFAILED, now, summary=exc.msg or "")
        if isinstance(exc, outcomes.Failed) and not exc.pytrace:
            return RankOutcome(rank, FAILED, now, summary=(exc.msg or "").splitlines()[0] if exc.msg else "",
                               traceback=exc.msg or "")
    only = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    summary = only.splitlines()[0] if only else type(exc).__name__
    return RankOutcome(rank, FAILED, now, summary=summary, traceback=_user_traceback(exc))


def _user_traceback(exc: BaseException) -> str:
    """The traceback without the harness's own frames at its top."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_HARNESS_DIR):
        tb = tb.tb_next
    if tb is None:  # the error is in the harness (e.g. rendezvous): show it all
        tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _finish(outcome: RankOutcome, dist_ready: bool) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if outcome.status == FAILED:
        # Exit now: peers blocked in a collective with this rank see its
        # sockets close and fail at once instead of at the group timeout.
        os._exit(0)
    watchdog = threading.Timer(EXIT_GRACE_S, os._exit, args=(0,))
    watchdog.daemon = True  # must not itself hold up the interpreter's exit
    watchdog.start()
    if dist_ready:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
