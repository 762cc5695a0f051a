"""Multi-node cases (``LaunchSpec(nnodes > 1)``) on torch's own launcher, emulated on
this host: ``run_nodes`` starts one process tree per node, each torch's elastic agent
(``python -m harness.launcher.nodes agent CASE_DIR K``: ``agent_main``) with the c10d
rendezvous on loopback, and supervises them as ``harness.launcher.ranks`` does one node's
ranks (a node agent that ended before its ranks did is a failure as a rank's is); then
stack dumps, every node's tree stopped and reaped, one ``CaseOutcome`` whose report names
the node and rank.

Node 0's agent hosts the rendezvous store on a port the kernel picked and publishes it;
each node gives torch its own loopback address (``127.0.0.<100+K>``), so that node K is
``GROUP_RANK`` K, as across hosts. A rank (``rank_main``) is started by its agent with
torchrun's environment, splits off its supervisor (which writes the rank's exit status
for the launcher, not its parent) and runs the case through ``harness.launcher.rank``'s
``run_one``, joining the process group through that environment (``env://``). Node K
holds ranks ``K*nproc`` to ``(K+1)*nproc - 1`` and gets the K-th ``cards`` of the case's
lease, visible through the device's visibility variable.

``HARNESS_EMULATED_NODE_DELAY`` (``K=SECONDS`` or ``K=never``, comma separated) makes
node K's agent go to the rendezvous that late, or never (for tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from harness import processes
from harness.devices import Card, is_simulated
from harness.jsonio import write_text
from harness.launcher.outcome import CaseOutcome
from harness.launcher.rank import (
    CASE_ENV,
    EnclosingCase,
    RankContext,
    RankTask,
    coverage_of_launcher,
    pg_timeout_for,
    run_one,
)
from harness.launcher.ranks import (
    EXIT_WAIT_S,
    KILL_GRACE_S,
    RANK_ENV_DEFAULTS,
    CaseRun,
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
    """What every node of a multi-node case reads from its case directory."""

    task: RankTask
    nnodes: int
    nproc: int
    device: str
    backend: str
    #: wall-clock time of the case deadline
    deadline: float
    pg_timeout_s: float
    capture: bool
    simulated: bool
    coverage: dict[str, Any] | None
    #: the cards of each node (empty lists on cpu)
    cards: tuple[tuple[Card, ...], ...]
    #: node -> the ``HARNESS_CASE`` value its ranks see (nested launches stay
    #: within the node's ranks, cards and the case deadline)
    enclosing: tuple[str, ...]
    #: node -> seconds its agent waits before it goes to the rendezvous
    #: (``math.inf``: it never does), the emulated late / missing node
    delays: tuple[float, ...]
    launcher_pid: int
    #: the launcher's ``sys.path``, which a rank takes over (as a spawned rank does)
    sys_path: tuple[str, ...] = ()


def rank_path(case_dir: str, rank: int, kind: str) -> str:
    """The file ``rank-<rank>.<kind>`` (outcome, status, pid, stacks, log), as
    ``harness.launcher.ranks.CaseRun.path`` names it."""
    return os.path.join(case_dir, f"rank-{rank}.{kind}")


def joined_path(case_dir: str, node: int) -> str:
    """Written by node ``node``'s agent as it goes to the rendezvous."""
    return os.path.join(case_dir, f"node-{node}.joining")


def load(case_dir: str) -> NodeCase:
    """The case's ``NodeCase``."""
    with open(os.path.join(case_dir, CASE_FILE), "rb") as f:
        return pickle.load(f)


def agent_main(case_dir: str, node: int) -> NoReturn:
    """Node ``node``'s agent: wait its emulated delay, find the rendezvous
    store (node 0 hosts it), then run torch's elastic agent until its ranks
    are done; exits as ``torchrun`` does."""
    from harness.processes import die_with_parent, subreaper

    case = load(case_dir)
    die_with_parent(case.launcher_pid)
    subreaper()
    delay = case.delays[node]
    if delay:
        time.sleep(delay if math.isfinite(delay) else max(0.0, case.deadline - time.time()) + 60)
    store = None
    if node == 0:
        from torch.distributed import TCPStore

        # Kept open for the agent's life: torch's rendezvous, asking for a
        # multi-tenant store on this port in this process, gets this one.
        store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        write_text(os.path.join(case_dir, PORT_FILE), str(store.port))
        port = store.port
    else:
        port = _wait_port(case_dir, case.deadline)
    with open(joined_path(case_dir, node), "w"):
        pass
    # Past the case deadline the launcher stops the case: torch must not give up
    # first (its default join timeout is 600 s, far past any case deadline).
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
    """A rank under node's agent: run the case's function on it with the
    process group initialised from torchrun's environment, write its
    ``RankOutcome`` (``rank-<RANK>.outcome``) and exit as an ordinary rank does."""

    def start() -> tuple[RankContext, RankTask]:
        case = load(case_dir)
        sys.path[:] = case.sys_path or sys.path
        rank, local, node = (int(os.environ[v]) for v in ("RANK", "LOCAL_RANK", "GROUP_RANK"))
        split(os.getppid(), status_path=rank_path(case_dir, rank, "status"))
        write_text(rank_path(case_dir, rank, "pid"), str(os.getpid()))  # atomic: whole or none
        faulthandler.enable(file=sys.stderr, all_threads=True)
        cards = case.cards[node] if node < len(case.cards) else ()
        ctx = RankContext(
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            device=case.device,
            backend=case.backend,
            card=cards[local] if local < len(cards) else None,
            simulated=case.simulated,
            store_path="",  # env://
            outcome_path=rank_path(case_dir, rank, "outcome"),
            stacks_path=rank_path(case_dir, rank, "stacks"),
            log_path=rank_path(case_dir, rank, "log") if case.capture else None,
            pg_timeout_s=case.pg_timeout_s,
            parent_pid=case.launcher_pid,
            env={CASE_ENV: case.enclosing[node]},
            coverage=case.coverage,
        )
        return ctx, case.task

    run_one(start)


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
    # The per-rank bookkeeping (outcome, files, logs, stacks) of the case's
    # ranks on all nodes together, rank by global rank.
    flat = dataclasses.replace(spec, nproc=spec.world_size, nnodes=1, reuse=False)
    run = CaseRun(dataclasses.replace(plan, spec=flat), cards, case_dir)
    result = run.result
    result.ranks_per_node = spec.nproc
    result.label += f", {spec.nnodes} emulated nodes x {spec.nproc}"
    per_node = [tuple(cards[k * spec.cards : (k + 1) * spec.cards]) for k in range(spec.nnodes)]
    wall_deadline = time.time() + plan.deadline.seconds
    # The case deadline counts from the start here: the agents' rendezvous is bounded by
    # it (``agent_main``), so there is no separate start bound.
    run.ready, run.deadline = True, time.monotonic() + plan.deadline.seconds
    case = NodeCase(
        task=task,
        nnodes=spec.nnodes,
        nproc=spec.nproc,
        device=spec.device,
        backend=spec.dist_backend,
        deadline=wall_deadline,
        pg_timeout_s=pg_timeout_for(plan.deadline.seconds),
        capture=plan.settings.capture,
        simulated=is_simulated(),
        coverage=coverage_of_launcher(),
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
    """Start node ``node``'s agent in a session of its own, its output in its
    log (when the case's output is captured), the lease descriptors kept by it."""
    env = {**RANK_ENV_DEFAULTS, **os.environ}
    env.pop(CASE_ENV, None)
    if cards:
        from harness.devices import device_type

        variable = device_type(cards[0].device).visibility_env
        assert variable is not None
        env[variable] = ",".join(c.id for c in cards)
    fds = lease.fds()
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
            pass_fds=fds,
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
    """The pid of a rank that started (None: not yet)."""
    with (
        contextlib.suppress(OSError, ValueError),
        open(rank_path(case_dir, rank, "pid")) as f,
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
        code = states[k]
        ranks = range(k * per_node, (k + 1) * per_node)
        if all(_rank_pid(case_dir, r) is not None for r in ranks):
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
