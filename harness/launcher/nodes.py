"""Multi-node cases (``LaunchSpec(nnodes > 1)``) on torch's own launcher,
emulated on this host: ``run_nodes`` starts one process tree per node, each
torch's elastic agent (``harness.launcher.node``) with the c10d rendezvous on
loopback, and supervises them as ``harness.launcher.ranks`` does one node's
ranks: until every rank reported or exited, the deadline passed, or the
others overstayed ``ABANDON_GRACE_S`` after a failure (a rank's, or a node
agent's that ended before its ranks did); then stack dumps, every node's tree
stopped and reaped, one ``CaseOutcome`` whose report names the node and rank.

Ranks are numbered as torch numbers them: node K holds ranks ``K*nproc`` to
``(K+1)*nproc - 1``. The case's cards (``nnodes * cards``) and process slots
are leased by the caller (``harness.launcher.case.run_case``); node K gets
the K-th ``cards`` of them, visible to its agent and ranks through the
device's visibility variable (each rank selects its ``LOCAL_RANK``-th).

``HARNESS_EMULATED_NODE_DELAY`` (``K=SECONDS`` or ``K=never``, comma
separated) makes node K's agent go to the rendezvous that late, or never:
a node that starts late or never arrives, for tests of what a case (or the
code under test) does then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

from harness import processes
from harness.devices import Card, is_simulated
from harness.launcher import node as nodes
from harness.launcher.coverage import CoverageSpec
from harness.launcher.outcome import CaseOutcome
from harness.launcher.rank import (
    CASE_ENV,
    STACK_DUMP_SIGNAL,
    EnclosingCase,
    RankTask,
    pg_timeout_for,
)
from harness.launcher.ranks import (
    ABANDON_GRACE_S,
    EXIT_WAIT_S,
    KILL_GRACE_S,
    CaseRun,
    reap_on_sigterm,
    signals_deferred,
)

if TYPE_CHECKING:
    from harness.launcher.case import CasePlan
    from harness.launcher.lease import Lease

DELAY_ENV = "HARNESS_EMULATED_NODE_DELAY"
_POLL_S = 0.1
_NODE_LOG_TAIL_LINES = 20


def node_delays(nnodes: int, raw: str | None = None) -> tuple[float, ...]:
    """Each node's emulated delay from ``HARNESS_EMULATED_NODE_DELAY`` (or
    ``raw``): seconds, ``math.inf`` for ``never``; ``ValueError`` names a bad item."""
    raw = os.environ.get(DELAY_ENV, "") if raw is None else raw
    delays = [0.0] * nnodes
    for item in filter(None, (part.strip() for part in raw.split(","))):
        node, _, value = item.partition("=")
        try:
            k = int(node)
            seconds = math.inf if value.strip() == "never" else float(value)
        except ValueError:
            k, seconds = -1, math.nan
        if not 0 <= k < nnodes or not seconds >= 0:
            raise ValueError(
                f"{DELAY_ENV}: {item!r} is not NODE=SECONDS or NODE=never with "
                f"0 <= NODE < {nnodes} and SECONDS >= 0"
            )
        delays[k] = seconds
    return tuple(delays)


def run_nodes(
    task: RankTask, plan: CasePlan, cards: list[Card], *, lease: Lease | None = None
) -> CaseOutcome:
    """Run ``task`` on ``plan.spec.nnodes`` emulated nodes of ``plan.spec.nproc``
    fresh ranks each and report what happened (``run_ranks``'s guarantees:
    within the deadline plus the stop grace periods; no process of any node
    alive on return, ``result.survivors`` lists any the kernel would not
    kill; the case directory is gone)."""
    spec = plan.spec
    if spec.nnodes > nodes.MAX_EMULATED_NODES:
        raise ValueError(
            f"{spec.nnodes} nodes cannot be emulated on one host (at most {nodes.MAX_EMULATED_NODES})"
        )
    delays = node_delays(spec.nnodes)
    case_dir = tempfile.mkdtemp(prefix="harness-nodes-")
    # The per-rank bookkeeping (outcome, files, logs, stacks) of the case's
    # ranks on all nodes together, rank by global rank.
    flat = dataclasses.replace(spec, nproc=spec.world_size, nnodes=1, reuse=False)
    run = CaseRun(dataclasses.replace(plan, spec=flat), cards, case_dir)
    result = run.result
    result.ranks_per_node = spec.nproc
    result.label += f", {spec.nnodes} emulated nodes x {spec.nproc}"
    per_node = [tuple(cards[k * spec.cards : (k + 1) * spec.cards]) for k in range(spec.nnodes)]
    wall_deadline = time.time() + plan.deadline.seconds
    deadline = time.monotonic() + plan.deadline.seconds
    case = nodes.NodeCase(
        task=task,
        what=plan.what,
        nnodes=spec.nnodes,
        nproc=spec.nproc,
        device=spec.device,
        backend=spec.dist_backend,
        deadline=wall_deadline,
        pg_timeout_s=pg_timeout_for(plan.deadline.seconds),
        capture=plan.settings.capture,
        simulated=is_simulated(),
        coverage=CoverageSpec.of_launcher(),
        cards=tuple(per_node),
        enclosing=tuple(
            EnclosingCase(
                f"{plan.what} (node {k})",
                spec.nproc,
                spec.device,
                tuple(str(c) for c in per_node[k]),
                wall_deadline,
                budget_dir=os.path.join(case_dir, f"node-{k}-nested-slots"),
            ).to_env()
            for k in range(spec.nnodes)
        ),
        delays=delays,
        launcher_pid=os.getpid(),
        sys_path=tuple(sys.path),
    )
    with open(nodes.path(case_dir, nodes.CASE_FILE), "wb") as f:
        pickle.dump(case, f)
    agents: list[subprocess.Popen] = []
    with reap_on_sigterm():
        try:
            for k in range(spec.nnodes):
                agents.append(_start_agent(case_dir, k, per_node[k], plan, lease))
            if lease is not None:
                lease.annotate(ranks=[a.pid for a in agents])
            # The case deadline counts from the start here: the agents' rendezvous is
            # bounded by it (``node.agent_main``), so there is no separate start bound.
            _supervise(run, agents, case_dir, deadline)
        finally:
            with signals_deferred():
                try:
                    _wind_down(run, agents, case_dir, delays)
                finally:
                    shutil.rmtree(case_dir, ignore_errors=True)
    return result


def _start_agent(
    case_dir: str, node: int, cards: tuple[Card, ...], plan: CasePlan, lease: Lease | None
) -> subprocess.Popen:
    """Start node ``node``'s agent in a session of its own, its output in its
    log (when the case's output is captured), the lease descriptors kept by it."""
    env = dict(os.environ)
    env.pop(CASE_ENV, None)
    # As torchrun does: N ranks each using every core oversubscribe the host.
    env.setdefault("OMP_NUM_THREADS", "1")
    # See CaseRun.rank_context: no rank leaves while a peer still joins a group.
    env.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    if cards:
        from harness.devices import device_type

        variable = device_type(cards[0].device).visibility_env
        assert variable is not None
        env[variable] = ",".join(c.id for c in cards)
    fds = lease.fds() if lease is not None else []
    out = None
    if plan.settings.capture:
        out = open(nodes.path(case_dir, f"node-{node}.log"), "wb")  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "harness.launcher.node", "agent", case_dir, str(node)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
            pass_fds=fds,
        )
    finally:
        if out is not None:
            out.close()


def _exited(case_dir: str, rank: int) -> tuple[float, int] | None:
    """When and how a rank exited, from its supervisor's status file (None: not yet)."""
    status = nodes.rank_path(case_dir, rank, "status")
    with contextlib.suppress(OSError, ValueError), open(status) as f:
        return os.path.getmtime(status), int(f.read())
    return None


def _supervise(
    run: CaseRun, agents: list[subprocess.Popen], case_dir: str, deadline: float
) -> None:
    result = run.result
    per_node = result.ranks_per_node
    first_failure: float | None = None
    while True:
        pending = run.observe(lambda r: _exited(case_dir, r))
        if not pending:
            return
        now = time.monotonic()
        # A node whose agent ended with ranks of its own still pending (it
        # failed at the rendezvous, or crashed) is a failure as a rank's is.
        node_gone = any(
            agents[r // per_node].poll() is not None and not _started(case_dir, r) for r in pending
        )
        if first_failure is None and (node_gone or result.has_failure()):
            first_failure = now
        if now >= deadline:
            result.timed_out = [r for r in pending if _started(case_dir, r)]
            result.deadline_passed = True
            return
        if first_failure is not None and now >= first_failure + ABANDON_GRACE_S:
            result.abandoned = [r for r in pending if _started(case_dir, r)]
            return
        if run.capture:
            run.stream_output()  # with `pytest -s`: each line as it comes, `[rank N] ...`
        time.sleep(min(_POLL_S, max(0.0, deadline - now)))


def _started(case_dir: str, rank: int) -> bool:
    return os.path.exists(nodes.rank_path(case_dir, rank, "pid"))


def _rank_pid(case_dir: str, rank: int) -> int | None:
    with (
        contextlib.suppress(OSError, ValueError),
        open(nodes.rank_path(case_dir, rank, "pid")) as f,
    ):
        return int(f.read())
    return None


def _wind_down(
    run: CaseRun, agents: list[subprocess.Popen], case_dir: str, delays: tuple[float, ...]
) -> None:
    """Dump the stacks of ranks being stopped, let nodes whose ranks all
    reported exit by themselves (``EXIT_WAIT_S``), stop every node's tree,
    reap, collect output and say what went wrong with nodes."""
    result = run.result
    stopping = [*result.timed_out, *result.abandoned]
    if stopping and STACK_DUMP_SIGNAL is not None:
        handles = [SimpleNamespace(pid=_rank_pid(case_dir, r)) for r in range(result.nproc)]
        run.dump_stacks(handles, [r for r in stopping if handles[r].pid is not None])
    if not stopping and len(result.outcomes) == result.nproc:
        stop_at = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < stop_at and any(a.poll() is None for a in agents):
            time.sleep(_POLL_S)
        run.observe(lambda r: _exited(case_dir, r))
    states = [a.poll() for a in agents]
    survivors = processes.kill_trees([a.pid for a in agents], grace=KILL_GRACE_S)
    for agent in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(1.0)
    result.survivors = [p.pid for p in survivors]
    run.collect_logs()
    result.node_problems = _node_problems(result, states, case_dir, delays)


def _node_problems(
    result: CaseOutcome, states: list[int | None], case_dir: str, delays: tuple[float, ...]
) -> dict[int, str]:
    """node -> what its agent did wrong, for nodes with ranks that never started."""
    per_node = result.ranks_per_node
    problems: dict[int, str] = {}
    arrived = [os.path.exists(nodes.joined_path(case_dir, k)) for k in range(len(states))]
    # The nodes that never arrived first: they are why the others waited.
    for k in sorted(range(len(states)), key=lambda k: arrived[k]):
        code = states[k]
        ranks = range(k * per_node, (k + 1) * per_node)
        if all(_started(case_dir, r) for r in ranks):
            continue
        late = delays[k]
        if not arrived[k]:
            why = "never arrived at the rendezvous"
            if late:
                why += f" (emulated: {DELAY_ENV} delays it {'forever' if math.isinf(late) else f'{late:g} s'})"
        elif code is not None and code != 0:
            why = f"agent exited with code {code} before all its ranks started"
        elif not all(arrived):
            missing = [str(j) for j, a in enumerate(arrived) if not a]
            why = f"waited at the rendezvous for node {', '.join(missing)}; its ranks never started"
        else:
            why = "its ranks never started"
        tail = _log_tail(nodes.path(case_dir, f"node-{k}.log"))
        problems[k] = why + (
            f"\n--- node {k} agent output (last lines) ---\n{tail}" if tail else ""
        )
    return problems


def _log_tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        lines = f.read().rstrip("\n").splitlines()
        return "\n".join(lines[-_NODE_LOG_TAIL_LINES:])
    return ""
