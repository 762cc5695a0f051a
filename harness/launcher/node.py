"""The code inside one node of a multi-node case (``LaunchSpec(nnodes > 1)``):
``python -m harness.launcher.node agent CASE_DIR K`` is node K's agent,
``python -m harness.launcher.node rank CASE_DIR`` one of its ranks.

The agent is torch's own elastic agent (``torch.distributed.run.main``, what
``torchrun`` runs) in a process that dies with the launcher and adopts
whatever its ranks orphan (a child subreaper). Node 0 hosts the c10d
rendezvous store on a port the kernel picked (no free-port race) and
publishes it; the other nodes read it, so the nodes share nothing but that
endpoint. Each node gives torch its own loopback address (``--local-addr
127.0.0.<100+K>``): torch orders the nodes by address, so node K is
``GROUP_RANK`` K and ``MASTER_ADDR`` is node 0's address, as across hosts.

A rank is started by the agent with torchrun's environment (``RANK``,
``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` /
``MASTER_PORT``, ``TORCHELASTIC_*``); it splits off its supervisor (which
writes the rank's exit status for the launcher, not its parent), initialises
the process group from that environment (``init_method="env://"``, as code
written for torchrun does) and runs the case's function through the code of
an ordinary rank (``harness.launcher.rank``).
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

from harness.devices import Card
from harness.launcher.coverage import CoverageSpec
from harness.launcher.rank import CASE_ENV, RankContext, RankTask, run_one
from harness.launcher.supervisor import split

#: The loopback address of emulated node K is ``127.0.0.<NODE_ADDR_BASE + K>``:
#: three digits, so that torch's order of the addresses (as strings) is node order.
NODE_ADDR_BASE = 100
MAX_EMULATED_NODES = 255 - NODE_ADDR_BASE
CASE_FILE = "case.pkl"
PORT_FILE = "store-port"
_POLL_S = 0.05


@dataclass(frozen=True)
class NodeCase:
    """What every node of a multi-node case reads from its case directory."""

    task: RankTask
    what: str
    nnodes: int
    nproc: int
    device: str
    backend: str
    #: wall-clock time of the case deadline
    deadline: float
    pg_timeout_s: float
    capture: bool
    simulated: bool
    coverage: CoverageSpec | None
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


def path(case_dir: str, name: str) -> str:
    """A file of the case directory."""
    return os.path.join(case_dir, name)


def rank_path(case_dir: str, rank: int, kind: str) -> str:
    """The file ``rank-<rank>.<kind>`` (outcome, status, pid, stacks, log), as
    ``harness.launcher.ranks.CaseRun.path`` names it."""
    return os.path.join(case_dir, f"rank-{rank}.{kind}")


def joined_path(case_dir: str, node: int) -> str:
    """Written by node ``node``'s agent as it goes to the rendezvous."""
    return os.path.join(case_dir, f"node-{node}.joining")


def load(case_dir: str) -> NodeCase:
    """The case's ``NodeCase``."""
    with open(path(case_dir, CASE_FILE), "rb") as f:
        return pickle.load(f)


def node_addr(node: int) -> str:
    """The loopback address emulated node ``node`` gives torch."""
    return f"127.0.0.{NODE_ADDR_BASE + node}"


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
        from harness.jsonio import write_text

        write_text(path(case_dir, PORT_FILE), str(store.port))
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
        f"--local-addr={node_addr(node)}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "-m",
        "harness.launcher.node",
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
            with open(path(case_dir, PORT_FILE)) as f:
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
        with open(rank_path(case_dir, rank, "pid"), "w") as f:
            f.write(str(os.getpid()))
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


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "agent":
        agent_main(sys.argv[2], int(sys.argv[3]))
    if len(sys.argv) >= 3 and sys.argv[1] == "rank":
        rank_main(sys.argv[2])
    sys.exit(
        f"usage: python -m {__spec__.name if __spec__ else 'harness.launcher.node'} "
        "agent CASE_DIR NODE | rank CASE_DIR"
    )
