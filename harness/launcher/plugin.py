"""The pytest plugin (entry point ``pytest11: harness``): the ``launch`` marker and the
``--harness-*`` options; launched tests run on ranks (``case``), plain tests of an
accelerator entry apart on their leased cards, other card users on a card leased here;
real nodes torchrun started (``run_here``). See docs/harness.md."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
import tempfile
import time
from typing import Any, NoReturn

import pytest
from _pytest.logging import get_log_level_for_setting

from harness import busy
from harness.devices import (
    CARD_ENV,
    cpu_count,
    describe_inventory,
    device_type,
    inventory,
    is_simulated,
    local_index,
    parse_cards,
    runtime_available,
    set_device,
    visible,
)
from harness.launcher import containment, given
from harness.launcher.case import (
    DEFAULT_LEASE_TIMEOUT_S,
    CasePlan,
    Deadline,
    LaunchError,
    Settings,
    active,
    choose_deadline,
    conclude,
    missing_cards,
    run_case,
    task_for,
)
from harness.launcher.explain import AssertionSettings
from harness.launcher.lease import (
    LEASE_DIR_ENV,
    LEASE_DIR_OPTION,
    Lease,
    LeaseError,
    acquire,
    card_want,
    check_lease_dir,
    resolve_lease_dir,
)
from harness.launcher.outcome import REJECTED
from harness.launcher.pool import keeper
from harness.launcher.rank import CASE_ENV, EnclosingCase, outcome_from_exception, pg_timeout_for
from harness.launcher.ranks import ProcessSpec
from harness.launcher.supervisor import tie_to_controller
from harness.launcher.target import FunctionRef, conftests_for
from harness.names import (
    DEFAULT_CASE_TIMEOUT_S,
    DEVICE_MARKER,
    OPT_COMMANDS,
    OPT_MAX_PROCS,
    OPT_REQUIRE,
)
from harness.spec import ACCELERATORS, LaunchSpec, is_launched, launch_refusal, spec_for_item
from harness.validation import check_int, check_seconds
from harness.watchdog import WATCHDOG_GRACE_S, faulthandler_free, watchdog

SETTINGS_KEY = pytest.StashKey[Settings]()
ACTIVATION_KEY = pytest.StashKey["contextvars.Token[Settings]"]()
#: A test's spec and (launched) deadline, derived once (``_case``).
CASE_KEY = pytest.StashKey[tuple[LaunchSpec, Deadline]]()
_LEASE_DIR_PROBLEM = pytest.StashKey[str]()
#: A plain test's card lease, its environment and its nested-launch slots, until teardown.
CARD_LEASE_KEY = pytest.StashKey[contextlib.ExitStack]()
#: pytest-timeout's timeout (marker or ini) of a case that times itself, in seconds
TIMEOUT_KEY = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    busy.addoption(parser)
    containment.addoption(parser)
    group = parser.getgroup("harness", "multi-process and accelerator test harness")
    group.addoption(
        "--harness-timeout",
        type=float,
        default=DEFAULT_CASE_TIMEOUT_S,
        metavar="SECONDS",
        help="deadline of a launched case without LaunchSpec.timeout "
        f"(default {DEFAULT_CASE_TIMEOUT_S:g})",
    )
    group.addoption(
        "--harness-lease-dir",
        metavar="DIR",
        help="directory of the card / process-slot lock files shared by every "
        "pytest process on the host (default: $HARNESS_LEASE_DIR, else "
        "<system temp>/harness-leases)",
    )
    group.addoption(
        OPT_MAX_PROCS,
        dest="harness_max_procs",
        type=int,
        metavar="N",
        help="rank processes allowed to run at once on this host (default: the CPU count)",
    )
    group.addoption(
        "--harness-lease-timeout",
        type=float,
        default=DEFAULT_LEASE_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a case waits for its cards and process slots before failing "
        f"(default {DEFAULT_LEASE_TIMEOUT_S:g})",
    )
    group.addoption(
        OPT_REQUIRE,
        dest="harness_require",
        default="",
        metavar="DEVICES",
        help="comma-separated accelerators (cuda,npu): a case needing one this host "
        "lacks fails instead of being skipped",
    )
    group.addoption(
        "--harness-reuse",
        action="store_true",
        default=None,
        help="run consecutive launched cases with the same (device, nproc, backend) on a "
        "kept pool of ranks (ini harness_reuse; default: fresh ranks per case)",
    )
    group.addoption(
        "--harness-no-reuse",
        action="store_false",
        dest="harness_reuse",
        default=None,
        help="fresh rank processes for every launched case, whatever harness_reuse says",
    )
    group.addoption(
        OPT_COMMANDS,
        metavar="FILE",
        help="JSON file of command cases (written by `harness run`): collected as one case each "
        "when FILE is also given as a path to collect",
    )
    parser.addini(
        "harness_reuse",
        type="bool",
        default=False,
        help="run consecutive launched cases on kept rank pools (LaunchSpec.reuse=None cases)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "launch(spec=None, *, device=None, nproc=1, timeout=None, backend=None, reuse=None, "
        "nnodes=1): run the test body in LaunchSpec.nproc rank processes (on each of nnodes "
        "nodes) with torch.distributed initialised",
    )
    config.addinivalue_line(
        "markers",
        f"{DEVICE_MARKER}(device, cards): set by harness run on a plain case of an accelerator "
        "entry: its body runs in a process of its own with exactly `cards` leased cards visible",
    )
    tie_to_controller(worker=hasattr(config, "workerinput"))
    settings = _settings_from(config)
    config.stash[SETTINGS_KEY] = settings
    config.stash[ACTIVATION_KEY] = active.set(settings)
    phases = _FixtureDeadlines(config)
    config.pluginmanager.register(phases, "harness-fixture-deadlines")
    watchdog.exit_hooks.append(phases.on_exit)
    if not config.getoption("collectonly"):  # a session that runs no case contains none
        containment.configure(config)
    if config.getoption("harness_commands", None):
        from harness.launcher import command

        config.pluginmanager.register(command, "harness-commands")


def _settings_from(config: pytest.Config) -> Settings:
    opt = config.getoption
    require = frozenset(d.strip() for d in (opt("harness_require") or "").split(",") if d.strip())
    bad = sorted(require - set(ACCELERATORS))
    if bad:
        raise pytest.UsageError(
            f"{OPT_REQUIRE}: unknown device(s) {', '.join(bad)}; choose from {', '.join(ACCELERATORS)}"
        )
    for name in ("harness_timeout", "harness_lease_timeout"):
        check_seconds(opt(name), f"--{name.replace('_', '-')}", error=pytest.UsageError)
    max_procs = opt("harness_max_procs")
    if max_procs is not None:
        check_int(max_procs, OPT_MAX_PROCS, minimum=1, error=pytest.UsageError)
    if is_simulated():
        try:
            parse_cards(os.environ["HARNESS_CARDS"])
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    reuse = opt("harness_reuse")
    if reuse is None:
        reuse = config.getini("harness_reuse")
    lease_dir, lease_dir_source = resolve_lease_dir(opt("harness_lease_dir"))
    if not opt("collectonly"):  # a collect-only session leases nothing
        try:
            check_lease_dir(lease_dir, lease_dir_source)
        except LeaseError as exc:
            if lease_dir_source in (LEASE_DIR_OPTION, f"${LEASE_DIR_ENV}"):
                raise pytest.UsageError(str(exc)) from None
            # The host-wide default nobody here chose: only the cases that lease fail.
            config.stash[_LEASE_DIR_PROBLEM] = str(exc)
    return Settings(
        timeout=opt("harness_timeout"),
        lease_dir=lease_dir,
        max_procs=max_procs or cpu_count(),
        lease_timeout=opt("harness_lease_timeout"),
        require=require,
        capture=True,
        reuse=reuse,
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    # Before any case leases a card: cards a previous job's leftovers still hold.
    busy.check_busy_cards(session.config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    keeper.close()  # no rank outlives the session that started it


def pytest_unconfigure(config: pytest.Config) -> None:
    keeper.close()
    phases = config.pluginmanager.get_plugin("harness-fixture-deadlines")
    if phases is not None:
        watchdog.exit_hooks.remove(phases.on_exit)
        watchdog.disarm(("launched case fixtures", config))
    token = config.stash.get(ACTIVATION_KEY, None)
    if token is not None:
        del config.stash[ACTIVATION_KEY]
        try:
            active.reset(token)
        except ValueError:  # configured in another context: nothing of ours is active here
            pass


def pytest_report_header(config: pytest.Config) -> list[str]:
    settings = config.stash[SETTINGS_KEY]
    line = (
        f"harness: cards {describe_inventory()}; {settings.max_procs} process slots; "
        f"lease dir {settings.lease_dir}; {'kept' if settings.reuse else 'fresh'} ranks"
    )
    if settings.require:
        line += f"; required: {','.join(sorted(settings.require))}"
    problem = config.stash.get(_LEASE_DIR_PROBLEM, None)
    if problem:
        return [line, f"harness: cases that lease cards or process slots will fail: {problem}"]
    return [line]


# Not tryfirst: skip / xfail marks (evaluated by pytest's tryfirst hook) win
# over "no card here", but this still runs before any fixture is set up.
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not isinstance(item, pytest.Function):
        return
    try:
        spec, _ = _case(item)
    except ValueError as exc:
        _fail(f"{item.nodeid}: {exc}")
    refusal = launch_refusal(item) if is_launched(item) else None
    if refusal is not None:
        _fail(f"{item.nodeid}: {refusal}")
    # Emulated nodes share this host: it needs every node's cards (a real node, its own).
    need_cards(item, spec.device, spec.cards * (1 if under_torchrun() else spec.nnodes))
    if spec.cards and not runs_apart(item):
        _lease_card_in_process(item, spec)


def need_cards(item: pytest.Item, device: str, count: int) -> None:
    """Skip the test when this host lacks ``count`` cards of ``device``; fail it when
    ``--harness-require`` names the device."""
    reason = missing_cards(device, count)
    if reason is None:
        return
    if device in item.config.stash[SETTINGS_KEY].require:
        _fail(
            f"{reason}, and {OPT_REQUIRE} {device} is set (`harness run` sets it "
            f"for a {device} suite; --max-cards N runs only what fits)"
        )
    _skip_at_test(reason)


def lease_cards(item: pytest.Item, device: str, count: int) -> Lease:
    """Lease ``count`` cards of ``device`` for the test; past the lease timeout it fails."""
    settings = item.config.stash[SETTINGS_KEY]
    try:
        return acquire(
            settings.lease_dir,
            [card_want(inventory(device), count)],
            timeout=settings.lease_timeout,
            holder=item.nodeid,
        )
    except LeaseError as exc:
        what = f"a {device} card" if count == 1 else f"{count} {device} cards"
        _fail(f"{item.nodeid}: could not lease {what}\n{exc}")


def entry_device(item: pytest.Item) -> tuple[str, int] | None:
    """The device and cards of a plain case's ``harness_device`` marker (None: none)."""
    mark = item.get_closest_marker(DEVICE_MARKER)
    if mark is None or is_launched(item):
        return None
    return str(mark.kwargs["device"]), int(mark.kwargs["cards"])


def runs_apart(item: pytest.Item) -> bool:
    """Whether the test's body runs in processes of its own, its fixtures here: a launched
    test, or a plain case of an accelerator entry that is a plain function (a unittest
    method, a ``subtests`` user or a coroutine runs here, on a card leased here)."""
    if is_launched(item):
        return True
    if not isinstance(item, pytest.Function) or entry_device(item) is None:
        return False
    return launch_refusal(item) is None and not _is_async(item.obj)


def _is_async(body: Any) -> bool:
    return inspect.iscoroutinefunction(body) or inspect.isasyncgenfunction(body)


def _lease_card_in_process(item: pytest.Function, spec: LaunchSpec) -> None:
    held_until_teardown = item.stash[CARD_LEASE_KEY] = contextlib.ExitStack()
    lease = held_until_teardown.enter_context(lease_cards(item, spec.device, spec.cards))
    held = lease.cards()
    card = held[0]
    # A case of one rank on its card: a harness.launch it makes runs on that card.
    budget = held_until_teardown.enter_context(
        tempfile.TemporaryDirectory(prefix="harness-plain-", ignore_cleanup_errors=True)
    )
    enclosing = EnclosingCase(
        item.nodeid,
        len(held),
        spec.device,
        tuple(str(c) for c in held),
        time.time() + item.config.stash[SETTINGS_KEY].timeout,
        budget,
    )
    updates = {CARD_ENV: str(card), CASE_ENV: enclosing.to_env()}
    if entry_device(item) is not None:
        # A plain case of an accelerator entry that cannot run apart: what it starts sees
        # exactly its cards (this process does only if it had not initialised the runtime).
        updates.update(visible(held))
    environ = held_until_teardown.enter_context(pytest.MonkeyPatch.context())
    for name, value in updates.items():
        environ.setenv(name, value)
    # A simulated inventory where torch was never imported: no device to select.
    if (not is_simulated() or "torch" in sys.modules) and runtime_available(card.device):
        index = local_index(card)
        if index is not None:
            set_device(card, index)


class _FixtureDeadlines:
    """The setup and teardown of a case run apart (its fixtures run here), each bounded by
    the case's deadline (``harness.watchdog``); a card leased here released after teardown."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        with self._bounded(item, "setup"):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        try:
            with self._bounded(item, "teardown"):
                return (yield)
        finally:
            held = item.stash.get(CARD_LEASE_KEY, None)
            if held is not None:
                del item.stash[CARD_LEASE_KEY]
                held.close()  # the environment put back, the budget directory and the lease gone

    def _bounded(self, item: pytest.Item, phase: str) -> contextlib.AbstractContextManager:
        if not isinstance(item, pytest.Function) or not runs_apart(item):
            return contextlib.nullcontext()
        try:
            _, deadline = _case(item)
        except ValueError:
            return contextlib.nullcontext()  # the setup fails it, naming the problem
        return watchdog.bounding(
            ("launched case fixtures", self.config),
            deadline.seconds,
            grace=min(deadline.seconds, WATCHDOG_GRACE_S),
            what=f"{item.nodeid}: {phase} (fixtures of a launched case)",
            why=f"(the case deadline, {deadline.source})",
            error=lambda message: pytest.fail.Exception(message, pytrace=True),
            backstop=faulthandler_free(self.config),
        )

    def on_exit(self, headline: str) -> None:
        """The watchdog stops this process: what pytest captured goes out first."""
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(in_=True)
            out, err = capman.read_global_capture()
            sys.__stdout__.write(out)
            sys.__stderr__.write(err)
            sys.__stdout__.flush()
            sys.__stderr__.flush()


def _case(item: pytest.Function) -> tuple[LaunchSpec, Deadline]:
    """The test's spec and deadline (``LaunchSpec.timeout``, else pytest-timeout's, else
    ``--harness-timeout``), derived once and stashed; ``ValueError``: a bad spec."""
    case = item.stash.get(CASE_KEY, None)
    if case is None:
        placed = entry_device(item)
        spec = (
            spec_for_item(item) if placed is None else ProcessSpec(placed[0], card_count=placed[1])
        )
        timeout = item.stash.get(TIMEOUT_KEY, None)
        if timeout is None:
            default = Deadline(item.config.stash[SETTINGS_KEY].timeout, "--harness-timeout")
        else:
            default = Deadline(timeout, f"pytest-timeout's timeout={timeout:g}")
        case = item.stash[CASE_KEY] = (spec, choose_deadline(spec, default))
        longer = timeout is not None and spec.timeout and spec.timeout > timeout
        # Only a marker is warned of: the ini's timeout is a session default.
        if longer and item.get_closest_marker("timeout") is not None:
            message = (
                f"{item.nodeid}: LaunchSpec.timeout={spec.timeout:g} is its case deadline, "
                f"longer than its @pytest.mark.timeout({timeout:g}), which does not bound a "
                "launched test; give the launch marker the deadline you mean"
            )
            containment.warn_at(item, pytest.PytestWarning(message))
    return case


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not runs_apart(pyfuncitem) or _is_async(pyfuncitem.obj):
        return None  # an async test runs as its async plugin decides: nothing here awaits
    spec, deadline = _case(pyfuncitem)
    fixtures = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    if spec.nnodes > 1 and under_torchrun():
        # Real nodes: this process is one of the case's ranks, torchrun started it.
        problem = shape_problem(spec)
        if problem is not None:
            _fail(f"{pyfuncitem.nodeid}: {problem}")
        report = run_here(pyfuncitem.obj, fixtures, spec, pyfuncitem.nodeid, deadline.seconds)
        if report is not None:
            _fail(report)
        return True
    if hasattr(pyfuncitem.obj, "hypothesis"):
        _run_given(pyfuncitem, fixtures)
    else:
        _run_on_ranks(pyfuncitem, (), fixtures)
    return True


def _run_on_ranks(
    item: pytest.Function, args: tuple, kwargs: dict, placements: list | None = None
) -> None:
    """Run the test's body on ranks and report it as pytest would in-process. With
    ``placements`` it runs one Hypothesis example (a failure raises ``LaunchError`` for
    Hypothesis to shrink on) and appends its ``(cards, ranks)`` there."""
    example = placements is not None
    params = item.callspec.params if hasattr(item, "callspec") else {}
    kinds = dict.fromkeys(kwargs, "Hypothesis example argument")
    kinds.update((n, "fixture") for n in item._fixtureinfo.argnames if n in kwargs)
    kinds.update((n, "parametrized argument") for n in params if n in kwargs)
    spec, deadline = _case(item)
    config = item.config
    settings = config.stash[SETTINGS_KEY]
    live = config.getoption("capture", "fd") == "no"  # -s: streamed as they run
    reuse = settings.reuse if spec.reuse is None else spec.reuse
    try:
        task = task_for(
            FunctionRef.for_test(item),
            args,
            kwargs,
            kinds=kinds,
            want_value=False,
            state=None if item.instance is None else dict(vars(item.instance)),
            warning_filters=_warning_filters(item),
            show_deprecations=not sys.warnoptions,
            conftests=conftests_for(item),
            example=example,
            assertions=AssertionSettings.of(config),
            log_level=get_log_level_for_setting(config, "log_level"),
        )
    except TypeError as exc:
        _fail(f"{item.nodeid}: {exc}")
    try:
        result = run_case(task, CasePlan(spec, settings, item.nodeid, deadline, reuse, live=live))
    except LeaseError as exc:
        _fail(f"{item.nodeid}: could not lease what the case needs\n{exc}")
    placed = (",".join(result.cards), result.ranks)
    leaked = [f"rank {r}: {x}" for r, o in sorted(result.outcomes.items()) for x in o.leaked]
    if leaked:
        item.stash.setdefault(containment.RANK_LEAKS, []).extend(leaked)
    if not example:
        item.user_properties.extend(_placement(item, *placed))

    def fail(report: str) -> NoReturn:
        _raise_for_xfail(item, result.failure_types(), report)
        if example:
            raise LaunchError(report, result) from None
        _fail(report)

    if example:
        given.replay(result.feedbacks())  # in the example's build context, before its verdict
    try:
        conclude(result, fail=fail, skip=_skip_at_test, xfail=pytest.xfail, echo=not live)
    finally:
        if example:
            placements.append(placed)
    if result.status == REJECTED:
        from hypothesis import reject

        reject()  # a rejected example, as `assume` in-process: no failure, nothing torn down


def _placement(item: pytest.Function, cards: str, ranks: Any) -> list[tuple[str, Any]]:
    """The JUnit properties saying where and how a launched case ran."""
    spec, _ = _case(item)
    return [
        ("harness.device", spec.device),
        ("harness.nproc", spec.nproc),
        ("harness.cards", cards),
        ("harness.ranks", ranks),
    ]


def _run_given(item: pytest.Function, fixtures: dict) -> None:
    """A ``@given`` test: Hypothesis draws, shrinks and stores its examples here; each
    example runs on all ranks under the case deadline (Hypothesis's is off)."""
    test = item.obj
    hypothesis = test.hypothesis
    body = hypothesis.inner_test
    placements: list = []

    def on_ranks(*args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        if args and item.instance is not None and args[0] is item.instance:
            args = args[1:]
        _run_on_ranks(item, args, kwargs, placements)

    # Hypothesis names the failing example after the body, and seeds (derandomize) and keys
    # its database by the body's digest (source, signature, parametrization), as in-process.
    functools.update_wrapper(on_ranks, body)

    import hypothesis as hyp

    chosen = getattr(test, "_hypothesis_internal_use_settings", None) or hyp.settings.default
    # Its "explain" phase would report the launcher's lines, not the test's (on ranks).
    explain = getattr(hyp.Phase, "explain", None)
    phases = tuple(phase for phase in chosen.phases if phase is not explain)
    hypothesis.inner_test = on_ranks
    test._hypothesis_internal_use_settings = hyp.settings(chosen, deadline=None, phases=phases)
    try:
        test(**fixtures)
    finally:
        hypothesis.inner_test = body
        test._hypothesis_internal_use_settings = chosen
        last = placements[-1] if placements else ("", 0)
        item.user_properties.extend(
            [*_placement(item, *last), ("harness.examples", len(placements))]
        )


def _raise_for_xfail(item: pytest.Function, names: tuple[str, ...], report: str) -> None:
    """Raise an ``E`` carrying the report when an ``xfail(raises=E)`` marker names a class
    the failing rank's exception is (``names``: ``module.qualname`` of it and its bases)."""
    __tracebackhide__ = True
    for mark in item.iter_markers("xfail"):
        raises = mark.kwargs.get("raises")
        for cls in raises if isinstance(raises, tuple) else (raises,):
            if isinstance(cls, type) and f"{cls.__module__}.{cls.__qualname__}" in names:
                exc = cls.__new__(cls)
                exc.args = (report,)
                raise exc


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    """pytest-timeout's timeout of a case run apart (or a command case) is its deadline,
    instead of a timer interrupting this process (whose stack says nothing)."""
    if not _times_itself(item):
        return None
    item.stash[TIMEOUT_KEY] = float(settings.timeout)
    if CASE_KEY in item.stash:  # set at the call (func_only): the call's deadline is this
        del item.stash[CASE_KEY]
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if _times_itself(item) else None


def _times_itself(item: pytest.Item) -> bool:
    return runs_apart(item) or getattr(item, "times_itself", False)


def _fail(message: str) -> NoReturn:
    """Fail the test with ``message`` alone (no plugin traceback, no exception chain)."""
    raise pytest.fail.Exception(message, pytrace=False) from None


def _skip_at_test(reason: str) -> NoReturn:
    """Skip, reported at the test's location rather than at this plugin's line."""
    raise pytest.skip.Exception(reason, _use_item_location=True)


def _warning_filters(item: pytest.Function) -> tuple[tuple[str, bool], ...]:
    """The filters pytest applies around this test, in its order: the ini's, ``-W``, marks."""
    config = item.config
    filters = [(arg, False) for arg in config.getini("filterwarnings")]
    filters += [(arg, True) for arg in config.known_args_namespace.pythonwarnings or []]
    for mark in item.iter_markers(name="filterwarnings"):
        filters += [(arg, False) for arg in mark.args]
    return tuple(filters)


# Real nodes: this pytest process is a rank torchrun started (``torchrun ... -m pytest``
# on each host); each rank publishes its outcome in torchrun's store, rank 0 reports.

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def under_torchrun() -> bool:
    """Whether this process is a rank torch's elastic launcher started."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def shape_problem(spec: LaunchSpec) -> str | None:
    """Why this process's torchrun world cannot run a case of ``spec`` (None: it can)."""
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    if (world, local) == (spec.world_size, spec.nproc):
        return None
    return (
        f"the case needs {spec.nnodes} nodes x {spec.nproc} ranks; torchrun started this rank "
        f"in a world of {world} ranks, {local} per node (start it with --nnodes {spec.nnodes} "
        f"--nproc-per-node {spec.nproc})"
    )


def run_here(
    test: Any, kwargs: dict[str, Any], spec: LaunchSpec, case: str, deadline_s: float
) -> str | None:
    """Run ``test(**kwargs)`` on this rank of a torchrun world of the case's shape: a failure
    here is raised here; rank 0 returns a report naming the node and rank of every other
    rank that failed or reported nothing by the deadline (None: all passed or skipped)."""
    __tracebackhide__ = True
    from datetime import timedelta

    import torch.distributed as dist

    end = time.monotonic() + deadline_s
    rank, per_node = int(os.environ["RANK"]), spec.nproc
    if not dist.is_initialized():
        kind = device_type(spec.device)
        if kind.is_accelerator:
            kind.set_device(int(os.environ["LOCAL_RANK"]))
        pg_timeout = timedelta(seconds=pg_timeout_for(deadline_s))
        dist.init_process_group(spec.dist_backend, timeout=pg_timeout)
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=max(1.0, end - time.monotonic())),
    )
    store = dist.PrefixStore(f"harness/{os.environ['TORCHELASTIC_RUN_ID']}/{case}/", client)
    error: BaseException | None = None
    try:
        test(**kwargs)
        outcome = {"status": "passed"}
    except BaseException as exc:
        error = exc
        got = outcome_from_exception(rank, exc)
        outcome = {"status": got.status, "summary": got.summary}
    store.set(f"rank-{rank}", json.dumps(outcome))
    if error is not None:
        raise error
    if rank != 0:
        return None
    failures = []
    for other in range(1, spec.world_size):
        key, who = f"rank-{other}", f"node {other // per_node} rank {other}"
        while not store.check([key]) and time.monotonic() < end:
            time.sleep(0.1)
        if not store.check([key]):
            failures.append(f"{who} reported no outcome by the {deadline_s:g} s deadline")
        elif (got := json.loads(store.get(key)))["status"] == "failed":
            failures.append(f"{who} failed: {got['summary']}")
    if not failures:
        return None
    shape = f"({spec.world_size} ranks, {spec.nnodes} nodes x {per_node}, started by torchrun)"
    return "\n".join([*failures, shape])
