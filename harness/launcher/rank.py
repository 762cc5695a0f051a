"""The code inside a rank process: ``rank_main`` / ``run_one`` run one case,
``pool_rank_main`` a kept pool's cases. A rank leaves with ``os._exit``: interpreter
finalisation races the process group's C++ threads, and the OS closing its sockets fails
the peers' pending operations at once (``destroy_process_group`` is known to hang).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import faulthandler
import gc
import inspect
import json
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from harness import processes
from harness.devices import Card, local_index, runtime_available, set_device
from harness.launcher import explain, given, groups
from harness.launcher.explain import AssertionSettings
from harness.launcher.outcome import (
    FAILED,
    PASSED,
    REJECTED,
    SKIPPED,
    XFAILED,
    RankOutcome,
    capture_logs,
)
from harness.launcher.reset import Baseline, Inherited
from harness.launcher.supervisor import split
from harness.launcher.target import FunctionRef, import_conftests, undo_monkeypatches

#: How long a pooled rank whose launcher is gone waits for its supervisor to stop it.
LAUNCHER_GONE_WAIT_S = 10.0
STACK_DUMP_SIGNAL = signal.SIGUSR1
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_keep: dict[str, Any] = {}

#: Environment variable describing the enclosing case to its ranks (JSON).
CASE_ENV = "HARNESS_CASE"
#: The longest process-group timeout: ``timedelta`` and torch's milliseconds hold it
#: (a schema-valid ``timeout_s`` of 1e300 failed every rank with ``OverflowError``).
LONGEST_PG_TIMEOUT_S = 30 * 24 * 3600.0


def pg_timeout_for(deadline_s: float) -> float:
    """Process-group timeout for a case with this deadline: below it by up to 30 s (for
    the rank to report the timeout), at most ``LONGEST_PG_TIMEOUT_S``."""
    return min(LONGEST_PG_TIMEOUT_S, max(0.1, deadline_s - min(30.0, 0.2 * deadline_s)))


@dataclass(frozen=True)
class EnclosingCase:
    """The case a set of ranks belongs to, as seen from inside them (``HARNESS_CASE``):
    a ``harness.launch`` made inside it stays within its ranks, cards and deadline."""

    what: str
    nproc: int
    device: str
    cards: tuple[str, ...]
    deadline: float  # wall-clock time
    #: lease directory of the case's rank slots, which bounds its nested launches together
    budget_dir: str | None = None

    def to_env(self) -> str:
        """The value of ``CASE_ENV`` that ``from_env`` reads back."""
        return json.dumps(dict(vars(self), cards=list(self.cards)))

    @staticmethod
    def from_env() -> EnclosingCase | None:
        """The case whose rank this process is (None: not inside a case)."""
        raw = os.environ.get(CASE_ENV)
        if not raw:
            return None
        fields = json.loads(raw)
        return EnclosingCase(**{**fields, "cards": tuple(fields["cards"])})


@dataclass(frozen=True)
class RankTask:
    """The function a rank runs and what it runs with, as the launcher's pytest would:
    ``args`` the pickled ``(args, kwargs)``; ``state`` the pickled attributes of the test's
    instance; ``warning_filters`` (filter, escape) pairs in pytest's order;
    ``show_deprecations`` as pytest without ``-W``; ``conftests`` (name, file), outermost
    first; ``example``: the arguments are one Hypothesis example for the ``@given`` body;
    ``assertions``: how pytest explains a failing comparison (None: no pytest);
    ``log_level``: the root logger's level while it runs (None: left as it is)."""

    ref: FunctionRef
    args: bytes
    want_value: bool = True
    state: bytes | None = None
    warning_filters: tuple[tuple[str, bool], ...] = ()
    show_deprecations: bool = False
    conftests: tuple[tuple[str, str], ...] = ()
    example: bool = False
    assertions: AssertionSettings | None = None
    log_level: int | None = None


@dataclass(frozen=True)
class RankContext:
    """Where one rank stands in its case (plain values: unpickled before its env is set)."""

    rank: int
    world_size: int
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
    coverage: dict[str, Any] | None = None  # ``coverage_of_launcher``
    process_group: bool = True  # False: a plain case run apart
    #: created when the rank is ready to run the function: ``deadline_s`` counts from then
    ready_path: str | None = None
    deadline_s: float | None = None


@dataclass(frozen=True)
class RunCase:
    """Launcher -> kept rank: run this case."""

    ctx: RankContext
    task: RankTask
    inherited: Inherited


#: Launcher -> kept rank: leave now (so is anything but a ``RunCase``).
EXIT = "exit"
#: Kept rank -> launcher: this case's outcome file is written.
OUTCOME_WRITTEN = "outcome written"


@dataclass(frozen=True)
class Idle:
    """Kept rank -> launcher: the case is cleaned up (``problem``: why this rank cannot
    run another); ``pid``: the rank's own, below the supervisor the launcher knows."""

    problem: str | None
    pid: int


def coverage_of_launcher() -> dict[str, Any] | None:
    """How this process measures coverage now (``pytest --cov``, ``coverage run``), as the
    ``coverage.Coverage`` keywords a rank measures with, its data file next to this one's
    for ``coverage combine`` / pytest-cov (None: no measurement)."""
    coverage = sys.modules.get("coverage")
    cov = coverage.Coverage.current() if coverage is not None else None
    if cov is None:
        return None
    config = cov.config
    # Never cov.get_data(): on a live measurement it runs coverage's end-of-run checks,
    # whose warnings fail every launched test under -W error.
    data = getattr(cov, "_data", None)
    return {
        "data_file": data.base_filename() if data else os.path.abspath(config.data_file),
        "config_file": config.config_file or False,
        "source": config.source or None,
        "branch": bool(config.branch),
        "include": config.run_include or None,
        "omit": config.run_omit or None,
    }


#: The rank's measurement, and whether it measured since its data was last written (a
#: kept rank's second write after pytest-cov combined the files would leave an empty one).
_coverage: dict[str, Any] = {"cov": None, "unsaved": False}


def _start_coverage(keywords: dict[str, Any] | None) -> None:
    if keywords is None:
        return
    import coverage

    _coverage["cov"] = coverage.Coverage(data_suffix=True, auto_data=False, **keywords)
    _coverage["cov"].start()
    _coverage["unsaved"] = True


def _save_coverage(*, stop: bool = True) -> None:
    """Write the rank's coverage data (``os._exit`` skips coverage's exit hook)."""
    cov = _coverage["cov"]
    if cov is None:
        return
    try:
        if stop:
            _coverage["cov"] = None
            cov.stop()
        if _coverage["unsaved"]:
            cov.save()
    except Exception as exc:  # the rank's verdict stands; say what coverage lost
        print(f"harness: saving this rank's coverage data failed: {exc}", file=sys.stderr)
    _coverage["unsaved"] = False


def rank_main(ctx: RankContext, task: RankTask, lease_fds: list[int]) -> NoReturn:
    """Entry point of a spawned rank that runs one case. Only its supervisor holds
    ``lease_fds``, so the lease lasts as long as the case, even past a launcher that died
    (the supervisor then removes the case's directory)."""

    def start() -> tuple[RankContext, RankTask]:
        split(ctx.parent_pid, keep=lease_fds, leftover_dir=os.path.dirname(ctx.outcome_path))
        return ctx, task

    run_one(start)


def run_one(start: Callable[[], tuple[RankContext, RankTask]]) -> NoReturn:
    """Run one case in this rank process (fresh ranks, emulated nodes' ranks): ``start()``
    splits off the supervisor and says which case; the function runs (joining the process
    group: ``store_path``'s FileStore, else torchrun's ``env://``), its ``RankOutcome`` is
    written, and the rank exits 0 unless it failed (1 and no outcome when the harness's own
    code failed)."""
    try:
        ctx, task = start()
        _arm()
        _start_coverage(ctx.coverage)
        _enter_case(ctx)
        outcome = _run(ctx, task, fresh_module=False)
        outcome.write(ctx.outcome_path)
    except BaseException:
        _fatal()
    # At once either way: a peer blocked in a collective with it fails now.
    _hard_exit(1 if outcome.status == FAILED else 0)


def pool_rank_main(
    parent_pid: int,
    conn: Any,
    lease_fds: list[int],
    pool_dir: str | None = None,
    coverage: dict[str, Any] | None = None,
) -> NoReturn:
    """Entry point of a pooled rank: runs the cases ``conn`` delivers until told to exit.
    Per case it takes over what a fresh rank would inherit, restores the pool's
    ``Baseline``, and runs the function in a fresh copy of its module and a fresh context.
    A failed case ends the rank; after a passed one it reports whether it can run another.
    """
    try:
        # The pool's directory goes with a launcher that dies (its supervisor removes it).
        split(parent_pid, keep=lease_fds, rank_only=(conn.fileno(),), leftover_dir=pool_dir)
        _arm()
        _start_coverage(coverage)
        baseline: Baseline | None = None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                _launcher_gone()
            if not isinstance(message, RunCase):
                _hard_exit(0)  # told to exit
            ctx = message.ctx
            message.inherited.apply(ctx.env)
            _enter_case(ctx)
            _coverage["unsaved"] = True
            if baseline is not None:
                baseline.restore()
                if ctx.card is not None:
                    _select_card(ctx)  # the last case may have made another device current
            outcome, baseline = _run_kept(ctx, message.task, baseline)
            outcome.write(ctx.outcome_path)
            _save_coverage(stop=False)  # the launcher's report may come before the pool closes
            _flush()
            _send(conn, OUTCOME_WRITTEN)
            if outcome.status == FAILED:
                _hard_exit(1)
            try:  # a passed case: the baseline is recorded
                problem = baseline.leftovers() or _once_per_process(message.task)
            except Exception as exc:
                problem = f"cleaning up after the case failed: {type(exc).__name__}: {exc}"
            _send(conn, Idle(problem, os.getpid()))
            gc.collect()  # the case's garbage (device memory too), off the critical path
    except BaseException:
        _fatal()


def _send(conn: Any, message: object) -> None:
    try:
        conn.send(message)
    except OSError:
        _launcher_gone()


def _launcher_gone() -> NoReturn:
    """The launcher died: leave the stopping to the supervisor (bounded wait). The kernel
    closes a dying launcher's files before it re-parents its children: a rank exiting on
    EOF would look like one that ended on its own, and the supervisor would not remove
    the pool's directory."""
    _save_coverage()
    _flush()
    time.sleep(LAUNCHER_GONE_WAIT_S)
    os._exit(0)


def _run_kept(
    ctx: RankContext, task: RankTask, baseline: Baseline | None
) -> tuple[RankOutcome, Baseline | None]:
    """Run a case on a kept rank; the first joins the process group and records the
    baseline (before any test code ran)."""
    if baseline is None:
        try:
            _init_distributed(ctx)
        except BaseException as exc:
            return outcome_from_exception(ctx.rank, exc), None
        baseline = Baseline.capture()
    else:
        groups.set_timeout(ctx.pg_timeout_s)
    return _run(ctx, task, fresh_module=True), baseline


def _arm() -> None:
    """Arm the crash dump; no multiprocessing start method set yet, as in a test process."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    multiprocessing.set_start_method(None, force=True)


def _enter_case(ctx: RankContext) -> None:
    if ctx.log_path is not None:
        _redirect_output(ctx.log_path)
    # A file of its own, kept open for faulthandler: quoted whether output is captured.
    previous = _keep.get("stacks")
    _keep["stacks"] = open(ctx.stacks_path, "w")  # noqa: SIM115
    faulthandler.register(STACK_DUMP_SIGNAL, file=_keep["stacks"], all_threads=True)
    if previous is not None:
        with contextlib.suppress(Exception):
            previous.close()
    os.environ.update(ctx.env)


def _redirect_output(path: str) -> None:
    _flush()
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


def _run(ctx: RankContext, task: RankTask, *, fresh_module: bool) -> RankOutcome:
    """Run the case's function and return its outcome; never raises."""
    feedback = given.Feedback() if task.example else None
    # Orphans of what the body starts (setsid daemons) come back to this rank, in sight.
    processes.subreaper()
    before = processes.descendants()
    error: BaseException | None = None
    with capture_logs(task.log_level) as records:
        with warnings.catch_warnings(record=True) as caught:  # the test's filters inside
            try:
                # A context of its own: ContextVars the case sets do not outlive it.
                outcome = contextvars.copy_context().run(_call, ctx, task, fresh_module, feedback)
            except BaseException as exc:
                error = exc
        if feedback is not None and feedback.rejected and given.is_rejection(error):
            outcome = RankOutcome(ctx.rank, REJECTED, time.time(), summary="assumption not met")
        elif error is not None:
            outcome = outcome_from_exception(ctx.rank, error)
    outcome.feedback = feedback
    outcome.records = records
    # Stop what the body left running below this rank, for the launcher to report.
    from harness.launcher.containment import GRACE_S, SETTLE_S, runtime_helpers

    left = processes.stop_leftovers(before, settle=SETTLE_S, grace=GRACE_S, spare=runtime_helpers)
    outcome.leaked = [str(leftover) for leftover in left]
    outcome.warnings = [
        (exception_names(w.category)[0], str(w.message), w.filename, w.lineno)
        for w in caught[:MAX_WARNINGS]
    ]
    return outcome


#: Warnings a rank reports per case (the first: a loop warning a million times must not
#: flood the report).
MAX_WARNINGS = 100


def _call(
    ctx: RankContext, task: RankTask, fresh_module: bool, feedback: given.Feedback | None
) -> RankOutcome:
    # The test's warning filters, as pytest applies them around the in-process test.
    if task.show_deprecations:
        warnings.filterwarnings("always", category=DeprecationWarning)
        warnings.filterwarnings("always", category=PendingDeprecationWarning)
    if task.warning_filters:
        from _pytest.config import parse_warning_filter

        for arg, escape in task.warning_filters:
            warnings.filterwarnings(*parse_warning_filter(arg, escape=escape))
    import_conftests(task.conftests)
    fn = test = task.ref.load(fresh=fresh_module)
    if task.example:
        # The launcher's Hypothesis drew this example: run the test's body on
        # it, never Hypothesis again (every rank must run the same example).
        inner = fn.hypothesis.inner_test
        fn = types.MethodType(inner, fn.__self__) if inspect.ismethod(fn) else inner
    if task.state is not None:
        vars(fn.__self__).update(pickle.loads(task.state))
    args, kwargs = pickle.loads(task.args)
    if ctx.process_group:
        import torch.distributed as dist

        if not dist.is_initialized():
            _init_distributed(ctx)
    if task.assertions is not None:
        explain.install(task.assertions)
    # An example's body runs in a Hypothesis build context of its own, so that
    # assume / note / event / target work (``harness.launcher.given``).
    example = (
        given.example_context(test, feedback) if feedback is not None else contextlib.nullcontext()
    )
    _ready(ctx)
    try:
        with example:
            value = fn(*args, **kwargs)
    finally:
        undo_monkeypatches()
    if not task.want_value and not task.example and value is not None:
        _warn_return_not_none(task.ref, value)
    blob = None
    if task.want_value:
        try:
            blob = pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"rank {ctx.rank} returned a {type(value).__qualname__}, which cannot be "
                f"pickled back to the launcher: {exc}"
            ) from exc
    return RankOutcome(ctx.rank, PASSED, time.time(), value=blob)


def _warn_return_not_none(ref: FunctionRef, value: Any) -> None:
    """Warn of a test's return value as pytest does in-process (under the test's filters)."""
    from _pytest.warning_types import PytestReturnNotNoneWarning

    warnings.warn(
        PytestReturnNotNoneWarning(
            f"Test functions should return None, but {ref.module}.{ref.qualname} returned "
            f"{type(value)!r}.\nDid you mean to use `assert` instead of `return`?\n"
            "See https://docs.pytest.org/en/stable/how-to/assert.html#return-not-none "
            "for more information."
        ),
        stacklevel=1,
    )


def _ready(ctx: RankContext) -> None:
    """Tell the launcher this rank is ready (the deadline starts once every rank is), and
    move the deadline its nested launches see."""
    if ctx.deadline_s is not None:
        case = EnclosingCase.from_env()
        if case is not None:
            moved = dataclasses.replace(case, deadline=time.time() + ctx.deadline_s)
            os.environ[CASE_ENV] = moved.to_env()
    if ctx.ready_path is not None:
        with open(ctx.ready_path, "w"):
            pass


def _init_distributed(ctx: RankContext) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    if ctx.card is not None:
        _select_card(ctx)
    # No store: torchrun's environment (env://), as code written for torchrun joins.
    where = (
        {"store": dist.FileStore(ctx.store_path, ctx.world_size), "rank": ctx.rank}
        if ctx.store_path
        else {}
    )
    # The deadline starts just after the join: a blocked collective raises before it.
    timeout = timedelta(seconds=ctx.pg_timeout_s)
    dist.init_process_group(ctx.backend, world_size=ctx.world_size, timeout=timeout, **where)
    groups.set_timeout(ctx.pg_timeout_s)


def _once_per_process(task: RankTask) -> str | None:
    """What the case's module did that a process can do only once, so that the next case
    (which executes the module again) would fail: a module-level ``Library(ns, "DEF")``."""
    library = sys.modules.get("torch.library")
    module = sys.modules.get(task.ref.module)
    if library is None or module is None:
        return None
    names = sorted(
        name
        for name, value in vars(module).items()
        if isinstance(value, library.Library) and getattr(value, "kind", None) == "DEF"
    )
    if names:
        return (
            f"its module defines torch.library namespace(s) at import ({', '.join(names)}), "
            "which a process can define only once"
        )
    return None


def _select_card(ctx: RankContext) -> None:
    card = ctx.card
    if runtime_available(card.device):
        index = local_index(card)
        set_device(card, 0 if index is None else index)
    elif ctx.simulated:
        # HARNESS_CARDS names cards this torch cannot use: the inventory is
        # simulated (lease logic tested on a CPU machine); run without one.
        if not _keep.get("simulated_note"):
            _keep["simulated_note"] = True
            print(
                f"harness: rank {ctx.rank} holds simulated card {card}; not selecting it",
                file=sys.stderr,
            )
    else:
        raise RuntimeError(
            f"rank {ctx.rank} was leased {card}, but torch cannot use {card.device} here"
        )


def outcome_from_exception(rank: int, exc: BaseException) -> RankOutcome:
    """Classify what a rank's function raised: pytest skip / xfail / fail, or any error."""
    now = time.time()
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None and isinstance(exc, outcomes.OutcomeException):
        msg = exc.msg or ""
        if isinstance(exc, outcomes.Skipped):
            return RankOutcome(rank, SKIPPED, now, summary=msg)
        if isinstance(exc, outcomes.XFailed):
            return RankOutcome(rank, XFAILED, now, summary=msg)
        if isinstance(exc, outcomes.Failed) and not exc.pytrace:
            return RankOutcome(
                rank, FAILED, now, summary=(msg.splitlines() or [""])[0], traceback=msg
            )
    only = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    summary = only.splitlines()[0] if only else type(exc).__name__
    names = exception_names(type(exc))
    return RankOutcome(rank, FAILED, now, summary, _user_traceback(exc), exc_types=names)


def exception_names(cls: type) -> tuple[str, ...]:
    """``module.qualname`` of an exception class and of each of its bases, so the
    launcher can tell which classes (e.g. ``xfail(raises=)``) the error matches."""
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__)


def _user_traceback(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_HARNESS_DIR):
        tb = tb.tb_next
    if tb is None:  # the error is in the harness (e.g. rendezvous): show it all
        tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _flush() -> None:
    # logging's handlers, held by weak references (a dead one raises, suppressed)
    for ref in list(getattr(sys.modules.get("logging"), "_handlerList", [])):
        with contextlib.suppress(Exception):
            ref().flush()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()


def _fatal() -> NoReturn:
    """The harness's own code failed: exit 1 without an outcome (a dead rank, never passed)."""
    with contextlib.suppress(BaseException):
        traceback.print_exc()
    _hard_exit(1)


def _hard_exit(code: int) -> NoReturn:
    """Leave without interpreter finalisation (see the module docstring)."""
    _save_coverage()
    _flush()
    os._exit(code)
