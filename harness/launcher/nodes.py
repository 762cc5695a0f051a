"""Multi-node cases emulated on this host: ``run_nodes`` starts one process tree per node,
torch's elastic agent (``agent_main``) with the c10d rendezvous on loopback (node 0 hosts
the store; node K binds ``127.0.0.<100+K>``, so that it is ``GROUP_RANK`` K), and
supervises them as ``CaseRun`` does one node's ranks. A rank (``rank_main``) joins through
torchrun's environment; its supervisor writes its exit status for the launcher.
``HARNESS_EMULATED_NODE_DELAY`` (``K=SECONDS`` or ``K=never``, comma separated) makes node
K's agent go to the rendezvous that late, or never (for tests).
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from harness import processes
from harness.devices import Card, visible
from harness.jsonio import write_text
from harness.launcher.outcome import CaseOutcome
from harness.launcher.rank import CASE_ENV, EnclosingCase, RankContext, RankTask, run_one
from harness.launcher.ranks import (
    EXIT_WAIT_S,
    KILL_GRACE_S,
    RANK_ENV_DEFAULTS,
    CaseRun,
    rank_path,
    reap_on_sigterm,
    signals_deferred,
)
from harness.launcher.supervisor import split

if TYPE_CHECKING:
    from harness.launcher.case import CasePlan
    from harness.launcher.lease import Lease

DELAY_ENV = "HARNESS_EMULATED_NODE_DELAY"
_POLL_S = 0.1
_NODE_LOG_TAIL_LINES = 20
#: The loopback address of emulated node K is ``127.0.0.<NODE_ADDR_BASE + K>``:
#: three digits, so that torch's order of the addresses (as strings) is node order.
NODE_ADDR_BASE = 100
MAX_EMULATED_NODES = 255 - NODE_ADDR_BASE
CASE_FILE = "case.pkl"
PORT_FILE = "store-port"


@dataclass(frozen=True)
class NodeCase:
    """What every node of a multi-node case reads from its case directory: ``deadline``
    (wall clock), each node's ``delays`` (``math.inf``: never), each rank's context, the
    launcher's ``sys.path`` (which a rank takes over, as a spawned rank does)."""

    task: RankTask
    nnodes: int
    nproc: int
    deadline: float
    delays: tuple[float, ...]
    launcher_pid: int
    contexts: tuple[RankContext, ...]
    sys_path: tuple[str, ...]


def joined_path(case_dir: str, node: int) -> str:
    """Written by node ``node``'s agent as it goes to the rendezvous."""
    return os.path.join(case_dir, f"node-{node}.joining")


def load(case_dir: str) -> NodeCase:
    with open(os.path.join(case_dir, CASE_FILE), "rb") as f:
        return pickle.load(f)


def agent_main(case_dir: str, node: int) -> NoReturn:
    """Node ``node``'s agent: wait its emulated delay, find the rendezvous store (node 0
    hosts it), then run torch's elastic agent until its ranks are done, as ``torchrun``."""
    from harness.processes import die_with_parent, subreaper

    case = load(case_dir)
    die_with_parent(case.launcher_pid)
    subreaper()
    delay = case.delays[node]
    if delay:
        time.sleep(delay if math.isfinite(delay) else max(0.0, case.deadline - time.time()) + 60)
    if node == 0:
        from torch.distributed import TCPStore

        # Kept open: torch's rendezvous, asking for a multi-tenant store on this port in
        # this process, gets this one.
        store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        write_text(os.path.join(case_dir, PORT_FILE), str(store.port))
        port = store.port
    else:
        port = _wait_port(case_dir, case.deadline)
    with open(joined_path(case_dir, node), "w"):
        pass
    # The launcher stops the case at its deadline: torch must not give up first.
    join_timeout = math.ceil(max(1.0, case.deadline - time.time())) + 5
    argv = [
        f"--nnodes={case.nnodes}",
        f"--nproc-per-node={case.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={os.path.basename(case_dir)}",
        f"--rdzv-conf=join_timeout={join_timeout},is_host={'true' if node == 0 else 'false'}",
        f"--local-addr=127.0.0.{NODE_ADDR_BASE + node}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "-m",
        "harness.launcher.nodes",
        "rank",
        case_dir,
    ]
    from torch.distributed.run import main

    try:
        main(argv)
    except SystemExit:
        raise
    except BaseException:
        # torch's @record summary went to this node's log already.
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _wait_port(case_dir: str, deadline: float) -> int:
    """The rendezvous store's port, once node 0 published it (until the case deadline)."""
    while True:
        try:
            with open(os.path.join(case_dir, PORT_FILE)) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            pass
        if time.time() > deadline + 60:
            raise TimeoutError("node 0 never published the rendezvous store's port")
        time.sleep(_POLL_S)


def rank_main(case_dir: str) -> NoReturn:
    """A rank under its node's agent: run the case as an ordinary rank does, joining the
    process group through torchrun's environment."""

    def start() -> tuple[RankContext, RankTask]:
        case = load(case_dir)
        sys.path[:] = case.sys_path
        rank = int(os.environ["RANK"])
        split(os.getppid(), status_path=rank_path(case_dir, rank, "status"))
        write_text(rank_path(case_dir, rank, "pid"), str(os.getpid()))  # atomic: whole or none
        return case.contexts[rank], case.task

    run_one(start)


def node_delays(nnodes: int, raw: str | None = None) -> tuple[float, ...]:
    """Each node's emulated delay from ``HARNESS_EMULATED_NODE_DELAY`` (or ``raw``): seconds,
    ``math.inf`` for ``never``; ``ValueError`` names a bad item."""
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


def run_nodes(task: RankTask, plan: CasePlan, cards: list[Card], *, lease: Lease) -> CaseOutcome:
    """Run ``task`` on ``plan.spec.nnodes`` emulated nodes of ``plan.spec.nproc`` fresh
    ranks each and report what happened, with ``run_ranks``'s guarantees."""
    spec = plan.spec
    if spec.nnodes > MAX_EMULATED_NODES:
        raise ValueError(
            f"{spec.nnodes} nodes cannot be emulated on one host (at most {MAX_EMULATED_NODES})"
        )
    delays = node_delays(spec.nnodes)
    case_dir = tempfile.mkdtemp(prefix="harness-nodes-")
    # The bookkeeping of the ranks of all nodes together, by global rank.
    flat = dataclasses.replace(spec, nproc=spec.world_size, nnodes=1, reuse=False)
    run = CaseRun(dataclasses.replace(plan, spec=flat), cards, case_dir)
    result = run.result
    result.ranks_per_node = spec.nproc
    result.label += f", {spec.nnodes} emulated nodes x {spec.nproc}"
    per_node = [tuple(cards[k * spec.cards : (k + 1) * spec.cards]) for k in range(spec.nnodes)]
    wall_deadline = time.time() + plan.deadline.seconds
    # No separate start bound: the agents' rendezvous is bounded by the case deadline.
    run.ready, run.deadline = True, time.monotonic() + plan.deadline.seconds
    enclosing = [
        EnclosingCase(
            f"{plan.what} (node {k})",
            spec.nproc,
            spec.device,
            tuple(str(c) for c in per_node[k]),
            wall_deadline,
            budget_dir=os.path.join(case_dir, f"node-{k}-nested-slots"),
        ).to_env()
        for k in range(spec.nnodes)
    ]
    # Each rank's context as a fresh rank's, but joining through torchrun's environment.
    contexts = tuple(
        dataclasses.replace(
            run.rank_context(r),
            store_path="",
            env={CASE_ENV: enclosing[r // spec.nproc]},
            ready_path=None,
            deadline_s=None,
        )
        for r in range(spec.world_size)
    )
    case = NodeCase(
        task, spec.nnodes, spec.nproc, wall_deadline, delays, os.getpid(), contexts, tuple(sys.path)
    )
    with open(os.path.join(case_dir, CASE_FILE), "wb") as f:
        pickle.dump(case, f)
    agents: list[subprocess.Popen] = []
    with reap_on_sigterm():
        try:
            for k in range(spec.nnodes):
                agents.append(_start_agent(case_dir, k, per_node[k], plan, lease))
            lease.annotate(ranks=[a.pid for a in agents])
            per_node = spec.nproc
            run.supervise(
                [],
                exited=lambda r: _exited(case_dir, r),
                # A node whose agent ended with ranks of its own still pending (it failed at
                # the rendezvous, or crashed) is a failure as a rank's is.
                gone=lambda pending: any(
                    agents[r // per_node].poll() is not None and _rank_pid(case_dir, r) is None
                    for r in pending
                ),
                begun=lambda r: _rank_pid(case_dir, r) is not None,
            )
        finally:
            with signals_deferred():
                try:
                    _wind_down(run, agents, case_dir, delays)
                finally:
                    shutil.rmtree(case_dir, ignore_errors=True)
    return result


def _start_agent(
    case_dir: str, node: int, cards: tuple[Card, ...], plan: CasePlan, lease: Lease
) -> subprocess.Popen:
    """Start node ``node``'s agent in a session of its own, holding the lease descriptors,
    its output in its log when the case's output is captured."""
    env = {**RANK_ENV_DEFAULTS, **os.environ}
    env.pop(CASE_ENV, None)
    env.update(visible(cards))
    out = None
    if plan.settings.capture:
        out = open(os.path.join(case_dir, f"node-{node}.log"), "wb")  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "harness.launcher.nodes", "agent", case_dir, str(node)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
            pass_fds=lease.fds(),
        )
    finally:
        if out is not None:
            out.close()


def _exited(case_dir: str, rank: int) -> tuple[float, int] | None:
    """When and how a rank exited, from its supervisor's status file (None: not yet)."""
    status = rank_path(case_dir, rank, "status")
    with contextlib.suppress(OSError, ValueError), open(status) as f:
        return os.path.getmtime(status), int(f.read())
    return None


def _rank_pid(case_dir: str, rank: int) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(rank_path(case_dir, rank, "pid")) as f:
        return int(f.read())
    return None


def _wind_down(
    run: CaseRun, agents: list[subprocess.Popen], case_dir: str, delays: tuple[float, ...]
) -> None:
    """Dump the stacks of ranks being stopped, let nodes whose ranks all reported exit by
    themselves, stop and reap every node's tree, collect output, name node problems."""
    result = run.result
    stopping = [*result.timed_out, *result.abandoned]
    if stopping:
        pids = {r: _rank_pid(case_dir, r) for r in stopping}
        run.dump_stacks({r: pid for r, pid in pids.items() if pid is not None})
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
    arrived = [os.path.exists(joined_path(case_dir, k)) for k in range(len(states))]
    # The nodes that never arrived first: they are why the others waited.
    for k in sorted(range(len(states)), key=lambda k: arrived[k]):
        if all(_rank_pid(case_dir, r) is not None for r in range(k * per_node, (k + 1) * per_node)):
            continue
        late = delays[k]
        if not arrived[k]:
            why = "never arrived at the rendezvous"
            if late:
                why += f" (emulated: {DELAY_ENV} delays it {'forever' if math.isinf(late) else f'{late:g} s'})"
        elif states[k]:  # an exit code, neither 0 nor still running
            why = f"agent exited with code {states[k]} before all its ranks started"
        elif not all(arrived):
            missing = [str(j) for j, a in enumerate(arrived) if not a]
            why = f"waited at the rendezvous for node {', '.join(missing)}; its ranks never started"
        else:
            why = "its ranks never started"
        tail = _log_tail(os.path.join(case_dir, f"node-{k}.log"))
        problems[k] = why + (
            f"\n--- node {k} agent output (last lines) ---\n{tail}" if tail else ""
        )
    return problems


def _log_tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        lines = f.read().rstrip("\n").splitlines()
        return "\n".join(lines[-_NODE_LOG_TAIL_LINES:])
    return ""


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "agent":
        agent_main(sys.argv[2], int(sys.argv[3]))
    if len(sys.argv) >= 3 and sys.argv[1] == "rank":
        rank_main(sys.argv[2])
    sys.exit("usage: python -m harness.launcher.nodes agent CASE_DIR NODE | rank CASE_DIR")
