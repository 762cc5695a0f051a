"""xdist scheduling: launched cases go to as few workers as can run them at once.

A worker keeps one pool of ranks (``harness.launcher.pool``). When there are
more xdist workers than pools fit in the host's process slots (``-n 2`` on 2
CPUs with 2-rank cases), workers handed launched cases would take turns with
the slots and restart their pools every slice, making ``-n N`` slower than
``-n 0``. So, under xdist's default ``load`` distribution:

* each worker, once it has collected, computes the case's *lanes*: how many
  of the session's launched cases can hold pools at the same time
  (``concurrent_lanes``), and when that is fewer than the workers, puts the
  launched cases, in collection order, into that many contiguous lanes; it
  writes the lanes to a file in a directory the controller made for the
  session (the controller does not collect, and node ids are all it gets);
* the controller's scheduler (``LaneScheduling``) reads them when it starts
  scheduling and gives each lane to one worker as one work unit. Under the
  scope distributions a lane takes whole scopes: every scope (class, module)
  holding a launched case joins the lane of its first one, so what the user's
  ``--dist`` keeps together stays together. Everything else is scheduled as
  the chosen distribution would.

When every worker can hold a pool (``lanes >= workers``), when there is no
launched case, or when no lanes file can be read, the scheduler is xdist's own
unchanged. ``loadgroup``, ``each``, ``worksteal`` and other plugins'
distributions are never changed, nor is anything with ``-p no:harness-routing``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from harness.devices import inventory
from harness.jsonio import write_json
from harness.launcher.settings import Settings
from harness.spec import LaunchSpec, is_launched, spec_for_item

#: The key of the lanes directory in a worker's ``workerinput``.
ROUTES_KEY = "harness_routes_dir"
#: The distributions whose scheduler routes lanes (xdist's ``--dist`` values).
# Not ``loadgroup``: an ``xdist_group`` of launched cases was once seen on two
# workers there, with this routing on and with it off alike; until that is
# understood, the user's groups alone decide where launched cases run.
ROUTED_DISTS = ("load", "loadscope", "loadfile")
#: A lane's scope name; the brackets keep it apart from any node id's scope.
LANE_SCOPE = "<harness lane {}>"


def concurrent_lanes(specs: Iterable[LaunchSpec], slots: int) -> int:
    """How many of these launched cases can run at the same time, each on a
    pool of the widest of them, within ``slots`` process slots and each
    accelerator's cards; at least 1. Cases this host cannot run at all (more
    ranks than slots, more cards than it has) are left out: they hold nothing."""
    cards = {}
    runnable = []
    for spec in specs:
        if spec.cards and spec.device not in cards:
            cards[spec.device] = len(inventory(spec.device))
        if spec.nproc <= slots and spec.cards <= cards.get(spec.device, 0):
            runnable.append(spec)
    if not runnable:
        return max(1, slots)
    lanes = slots // max(spec.nproc for spec in runnable)
    for device, count in cards.items():
        widest = max((spec.cards for spec in runnable if spec.device == device), default=0)
        if widest:
            lanes = min(lanes, count // widest)
    return max(1, lanes)


def lanes_of(items: Sequence[pytest.Item], slots: int, workers: int) -> dict[str, int]:
    """The lane (0, 1, ...) of each launched case among ``items`` by node id,
    when fewer lanes than ``workers`` fit (see ``concurrent_lanes``); else none.
    The cases are split into contiguous runs of collection order, so that
    consecutive cases of one key stay on one pool."""
    launched: list[tuple[str, LaunchSpec]] = []
    for item in items:
        if not is_launched(item):
            continue
        try:
            spec = spec_for_item(item)
        except ValueError:
            continue  # the case fails at its setup, naming the problem
        launched.append((item.nodeid, spec))
    if not launched:
        return {}
    lanes = concurrent_lanes((spec for _, spec in launched), slots)
    if lanes >= workers:
        return {}
    return {nodeid: i * lanes // len(launched) for i, (nodeid, _) in enumerate(launched)}


def _lanes_file(directory: str, worker: str) -> str:
    return os.path.join(directory, f"{worker}.json")


def read_lanes(directory: str, worker: str) -> dict[str, int] | None:
    """The lanes worker ``worker`` wrote (None: none readable)."""
    try:
        with open(_lanes_file(directory, worker), encoding="utf-8") as f:
            lanes = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(lanes, dict) or not all(isinstance(v, int) for v in lanes.values()):
        return None
    return lanes


class _Routed:
    """Mixin over an xdist scope scheduler: a case's scope is its lane's when
    ``scope_lane`` names one for its own scope (set before ``schedule``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scope_lane: dict[str, str] = {}

    def _base_scope(self, nodeid: str) -> str:
        return super()._split_scope(nodeid)  # type: ignore[misc]

    def _split_scope(self, nodeid: str) -> str:
        scope = self._base_scope(nodeid)
        return self.scope_lane.get(scope, scope)

    def remove_node(self, node: Any) -> str | None:
        """As xdist's scope schedulers: the worker's unfinished work goes back to the queue
        and the case it crashed in is returned (xdist reports it failed); except that this
        case goes back marked done. xdist's would run it again on the next worker, and
        again, until it gave up on crashed workers: the cases after it in its lane never
        ran (plain ``load`` runs a crashed case once)."""
        workload = self.assigned_work.pop(node)  # type: ignore[attr-defined]
        pending = [
            nodeid for unit in workload.values() for nodeid, done in unit.items() if not done
        ]
        if not pending:
            return None
        crashed = pending[0]
        for scope, unit in workload.items():
            if crashed in unit:
                unit[crashed] = True
            if not all(unit.values()):
                self.workqueue[scope] = unit  # type: ignore[attr-defined]
        for other in self.assigned_work:  # type: ignore[attr-defined]
            self._reschedule(other)  # type: ignore[attr-defined]
        return crashed

    def route(self, lanes: dict[str, int], collection: Sequence[str]) -> None:
        """Give every scope holding a case of ``lanes`` to that case's lane
        (the first such case's, in collection order)."""
        self.scope_lane = {}
        for nodeid in collection:
            lane = lanes.get(nodeid)
            if lane is not None:
                self.scope_lane.setdefault(self._base_scope(nodeid), LANE_SCOPE.format(lane))


def _schedulers(dist: str, config: pytest.Config, log: Any) -> tuple[Any, Any]:
    """xdist's scheduler for ``dist`` and its routed counterpart."""
    from xdist.scheduler import (
        LoadFileScheduling,
        LoadScheduling,
        LoadScopeScheduling,
    )

    class RoutedLoad(_Routed, LoadScopeScheduling):
        """``load`` with lanes: every other case is its own work unit."""

        def _base_scope(self, nodeid: str) -> str:
            return nodeid

    class RoutedLoadScope(_Routed, LoadScopeScheduling):
        pass

    class RoutedLoadFile(_Routed, LoadFileScheduling):
        pass

    plain, routed = {
        "load": (LoadScheduling, RoutedLoad),
        "loadscope": (LoadScopeScheduling, RoutedLoadScope),
        "loadfile": (LoadFileScheduling, RoutedLoadFile),
    }[dist]
    return plain(config, log), routed(config, log)


class LaneScheduling:
    """The session's xdist scheduler: until it first schedules, both xdist's
    scheduler for the chosen distribution and its routed counterpart follow
    every node and collection; at the first ``schedule`` it keeps the routed
    one when the workers wrote lanes, else the plain one, and is that one from
    then on."""

    def __init__(self, plain: Any, routed: Any, lanes_dir: str) -> None:
        self._candidates = (plain, routed)
        self._lanes_dir = lanes_dir
        self._chosen: Any = None

    @property
    def chosen(self) -> Any:
        """The scheduler that schedules (before the first ``schedule``: the plain one)."""
        return self._chosen if self._chosen is not None else self._candidates[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.chosen, name)

    def _each(self) -> tuple[Any, ...]:
        return (self._chosen,) if self._chosen is not None else self._candidates

    def add_node(self, node: Any) -> None:
        for scheduler in self._each():
            scheduler.add_node(node)

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        for scheduler in self._each():
            scheduler.add_node_collection(node, collection)

    def remove_node(self, node: Any) -> str | None:
        # Every candidate forgets the node; the chosen (or plain) one's answer counts.
        crashed = [scheduler.remove_node(node) for scheduler in self._each()]
        return crashed[0]

    def schedule(self) -> None:
        if self._chosen is None:
            self._chosen = self._choose()
        self._chosen.schedule()

    def _choose(self) -> Any:
        plain, routed = self._candidates
        for node, collection in routed.registered_collections.items():
            lanes = read_lanes(self._lanes_dir, node.workerinput["workerid"])
            if lanes is not None:
                if not lanes:
                    return plain
                routed.route(lanes, collection)
                return routed
        return plain


class Routing:
    """The plugin object (one per pytest config) doing the above on both sides."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self._settings = settings
        self._lanes_dir: str | None = None
        workerinput = getattr(config, "workerinput", None)
        self._worker = (
            workerinput if workerinput is not None and ROUTES_KEY in workerinput else None
        )

    def _controller_dir(self, config: pytest.Config) -> str | None:
        if self._lanes_dir is None and getattr(config, "workerinput", None) is None:
            self._lanes_dir = tempfile.mkdtemp(prefix="harness-lanes-")
        return self._lanes_dir

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        lanes_dir = self._controller_dir(node.config)
        if lanes_dir is not None:
            node.workerinput[ROUTES_KEY] = lanes_dir

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        dist = config.getvalue("dist")
        lanes_dir = self._controller_dir(config)
        if dist not in ROUTED_DISTS or lanes_dir is None:
            return None
        return LaneScheduling(*_schedulers(dist, config, log), lanes_dir)

    # Before xdist's worker reports its collection to the controller.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self._worker is None:
            return
        lanes = lanes_of(session.items, self._settings.max_procs, self._worker["workercount"])
        path = _lanes_file(self._worker[ROUTES_KEY], self._worker["workerid"])
        with contextlib.suppress(OSError):  # unreadable lanes: xdist's own scheduling
            write_json(path, lanes)

    def pytest_unconfigure(self) -> None:
        if self._lanes_dir is not None:
            shutil.rmtree(self._lanes_dir, ignore_errors=True)
            self._lanes_dir = None


#: The routing's plugin name: ``-p no:harness-routing`` leaves xdist's scheduling alone.
PLUGIN_NAME = "harness-routing"


def install(config: pytest.Config, settings: Settings) -> None:
    """Register the routing for this config's session (a no-op without xdist's
    hooks, or when ``-p no:harness-routing`` blocks it)."""
    if not config.pluginmanager.is_blocked(PLUGIN_NAME):
        config.pluginmanager.register(Routing(config, settings), PLUGIN_NAME)
