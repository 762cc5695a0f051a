"""Multi-node cases (``LaunchSpec(nnodes=2)``) emulated on this host by torch's
own elastic agents: one real pytest session runs a passing case (its node 1 late)
and two node faults; each test below checks one of them. A case passes with the
environment ``torchrun`` gives, fails naming the node and the rank, and
leaves nothing running."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import psutil
import pytest
from launch_project import inner_env, run_session, write_project

from harness.launcher.nodes import DELAY_ENV, node_delays
from harness.launcher.outcome import FAILED, CaseOutcome, RankOutcome

#: What a rank records of its environment: every variable (the tests compare
#: the ones torchrun sets) and the pids of the rank, its supervisor, its agent.
RECORD_ENV = """
    import json
    import os

    import psutil

    from recording import out_dir


    def record(tag):
        me = psutil.Process()
        pids = [me.pid, *(p.pid for p in me.parents()[:2])]
        doc = {"env": dict(os.environ), "pids": pids}
        (out_dir() / f"{tag}-{os.environ['RANK']}.json").write_text(json.dumps(doc))
"""

NODES = """
    import os

    import pytest
    import torch
    import torch.distributed as dist

    from record_env import record


    @pytest.fixture
    def node_1_late(monkeypatch):
        monkeypatch.setenv("HARNESS_EMULATED_NODE_DELAY", "1=4")


    @pytest.fixture
    def node_1_missing(monkeypatch):
        monkeypatch.setenv("HARNESS_EMULATED_NODE_DELAY", "1=never")


    # Node 1 late within the join timeout: the case still passes, with torchrun's shape.
    @pytest.mark.launch(nnodes=2, nproc=2, timeout=120)
    def test_two_nodes(node_1_late):
        record("pass")
        print(f"hello from node {os.environ['GROUP_RANK']}", flush=True)
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        assert total.item() == 6.0
        assert dist.get_world_size() == 4


    @pytest.mark.launch(nnodes=2, nproc=2, timeout=120)
    def test_rank_dies():
        record("dies")
        if dist.get_rank() == 3:
            os._exit(7)
        dist.barrier()


    # Waited out whole: long enough for node 0's agent to reach the rendezvous on a
    # loaded host (the deadline of a multi-node case counts from the start).
    @pytest.mark.launch(nnodes=2, nproc=2, timeout=15)
    def test_node_never_arrives(node_1_missing):
        record("never")
"""

TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
#: torchrun's variables whose values name this run, not the shape
PER_RUN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def _leftovers(root) -> list[str]:
    """Processes whose command line names the project (its case directories are
    under it: the inner session's TMPDIR)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if str(root) in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{proc.pid} {cmd}")
    return found


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    # In a folder of their own, off the ranks' working directory: the helper
    # is importable in a rank only through the sys.path pytest gave the launcher.
    (root / "sub").mkdir()
    write_project(root, {"sub/test_nodes_inner.py": NODES, "sub/record_env.py": RECORD_ENV})
    env = inner_env(root / "out", root / "leases")
    (root / "tmp").mkdir()
    env["TMPDIR"] = str(root / "tmp")
    start = time.monotonic()
    # -s: the ranks' output is streamed while the case runs.
    session = run_session(root, "-s", env=env, timeout=420)
    return root, session, time.monotonic() - start


def _records(root, tag: str) -> dict[int, dict]:
    return {
        int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text())
        for p in (root / "out").glob(f"{tag}-*.json")
    }


def test_nothing_of_any_case_is_left_running(nodes):
    root, session, _ = nodes
    pids = {
        pid for tag in ("pass", "dies") for r in _records(root, tag).values() for pid in r["pids"]
    }
    assert len(pids) >= 2 * 4, session.output
    alive = [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == []
    assert _leftovers(root) == []


def test_two_nodes_of_two_ranks_pass_with_torchruns_shape(nodes):
    root, session, _ = nodes
    assert session.case("test_two_nodes").status == "passed", session.output
    records = _records(root, "pass")
    assert sorted(records) == [0, 1, 2, 3]
    shape = {r: tuple(doc["env"][k] for k in TORCHRUN_KEYS) for r, doc in records.items()}
    assert shape == {
        0: ("0", "0", "0", "2", "4"),
        1: ("1", "1", "0", "2", "4"),
        2: ("2", "0", "1", "2", "4"),
        3: ("3", "1", "1", "2", "4"),
    }
    for rank in range(4):  # streamed live (-s), each line naming its rank
        assert f"[rank {rank}] hello from node {rank // 2}" in session.output
    # Each node is its own process tree: its own agent, shared by its ranks only.
    agents = {r: doc["pids"][2] for r, doc in records.items()}
    assert agents[0] == agents[1] != agents[2] == agents[3]


def test_one_nodes_dead_rank_fails_the_case_naming_node_and_rank(nodes):
    _, session, _ = nodes
    case = session.case("test_rank_dies")
    assert case.status == "failed"
    assert case.text.startswith("node 1 rank 3 exited with code 7 before reporting an outcome"), (
        case.text
    )


def test_a_node_late_within_the_join_timeout_still_passes(nodes):
    root, session, _ = nodes
    # The passing case is the late one (node_1_late): no case of its own for it.
    assert session.case("test_two_nodes").status == "passed", session.output
    assert sorted(_records(root, "pass")) == [0, 1, 2, 3]


def test_a_node_that_never_arrives_fails_at_the_deadline_naming_it(nodes):
    root, session, _ = nodes
    case = session.case("test_node_never_arrives")
    assert case.status == "failed"
    assert "case failed on its nodes at the 15 s deadline (LaunchSpec.timeout)" in case.text
    assert "node 1: never arrived at the rendezvous" in case.text
    assert "node 0: waited at the rendezvous for node 1" in case.text
    assert _records(root, "never") == {}


# ---------------------------------------------------------------- torchrun itself


def torchrun_hosts(
    run_id: str, command: list[str], envs: list[dict[str, str]], cwd, *extra: str
) -> list[tuple[int, str]]:
    """Run one torchrun agent per environment in ``envs`` (each standing for a
    host: ``--nnodes 2 --nproc-per-node 2``), sharing nothing but the c10d
    rendezvous store this test hosts (a port the kernel picked: no race);
    their exit codes and output. Nothing they started outlives the call."""
    from torch.distributed import TCPStore

    from harness.processes import kill_trees

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={k}",
                "--nproc-per-node=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{store.port}",
                f"--rdzv-id={run_id}",
                "--rdzv-conf=is_host=false,join_timeout=120",
                "--max-restarts=0",
                *(arg.format(node=k) for arg in extra),
                *command,
            ],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for k, env in enumerate(envs)
    ]
    try:
        outputs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        kill_trees([a.pid for a in agents], grace=1.0)
        for agent in agents:
            agent.wait()
    return [(a.returncode, out) for a, out in zip(agents, outputs, strict=True)]


# ---------------------------------------------------------------- real nodes

REAL_NODES = """
    import os

    import pytest
    import torch
    import torch.distributed as dist


    @pytest.mark.launch(nnodes=2, nproc=2, timeout=120)
    def test_across_hosts():
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 4.0
        assert os.environ["GROUP_RANK"] == str(dist.get_rank() // 2)


    @pytest.mark.launch(nnodes=2, nproc=2, timeout=120)
    def test_rank_3_fails():
        assert dist.get_rank() != 3


    @pytest.mark.launch(nnodes=3, nproc=2)
    def test_other_shape():
        pass
"""


#: Each rank of the real-nodes recipe runs ``python -m record_env_then_pytest ...``: it
#: records the environment torchrun gave it (before pytest adds variables of its own),
#: then runs pytest as ``python -m pytest`` would (the same argv, ``sys.path[0]`` the
#: working directory).
RECORD_THEN_PYTEST = """
    import json
    import os
    import runpy

    out = os.path.join(os.environ["HARNESS_TEST_OUT"], f"torchrun-{os.environ['RANK']}.json")
    with open(out, "w") as f:
        json.dump({"env": dict(os.environ)}, f)
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def real_nodes(tmp_path_factory):
    """The recipe of docs/harness.md (real nodes), with two agents standing for two hosts:
    each runs ``torchrun ... -m pytest`` (through ``RECORD_THEN_PYTEST``) on its own
    checkout, lease directory and temp directory; they share only the c10d rendezvous endpoint. The folder, the project, each
    host's environment and the agents' exit codes and output."""
    tmp = tmp_path_factory.mktemp("real")
    files = {"test_real_inner.py": REAL_NODES, "record_env_then_pytest.py": RECORD_THEN_PYTEST}
    root = write_project(tmp / "project", files)
    envs = []
    for k in range(2):
        (tmp / f"host{k}").mkdir()
        envs.append(inner_env(root / "out", tmp / f"host{k}" / "leases"))
        envs[-1]["TMPDIR"] = str(tmp / f"host{k}")
    pytest_args = ["-m", "record_env_then_pytest", "-p", "no:cacheprovider", "-q", "-rA"]
    done = torchrun_hosts(
        "real-nodes",
        [*pytest_args, "test_real_inner.py"],
        envs,
        root,
        f"--log-dir={tmp}/logs{{node}}",
        "--redirects=3",
    )
    return tmp, root, envs, done


def test_real_nodes_recipe_two_torchrun_hosts_run_the_case_node_0_reports(real_nodes):
    tmp_path, _, _, done = real_nodes
    # A failing case fails the job on every host.
    assert [code != 0 for code, _ in done] == [True, True], done
    logs = {
        (k, int(p.parent.name)): p.read_text()
        for k in range(2)
        for p in (tmp_path / f"logs{k}").glob("*/attempt_0/*/stdout.log")
    }
    assert sorted(logs) == [(0, 0), (0, 1), (1, 0), (1, 1)], done
    report = logs[(0, 0)]  # node 0's rank 0: the case's verdict
    assert "PASSED test_real_inner.py::test_across_hosts" in report
    assert "FAILED test_real_inner.py::test_rank_3_fails" in report
    assert "node 1 rank 3 failed: AssertionError: assert 3 != 3" in report
    assert "the case needs 3 nodes x 2 ranks; torchrun started this rank in a world of 4" in report
    # Ranks 1 and 2 passed the failing case; rank 3 reports its own failure.
    assert "PASSED test_real_inner.py::test_rank_3_fails" in logs[(0, 1)]
    assert "FAILED test_real_inner.py::test_rank_3_fails" in logs[(1, 1)]


def test_ranks_see_the_environment_torchrun_gives_for_the_same_shape(nodes, real_nodes):
    # The reference: torchrun itself, two agents (`--node-rank k`) on loopback, for the
    # same shape (the real-nodes recipe's ranks, as torchrun started them).
    root, session, _ = nodes
    harness_ranks = _records(root, "pass")
    assert sorted(harness_ranks) == [0, 1, 2, 3], session.output
    _, project, envs, done = real_nodes
    recorded = sorted(p.name for p in (project / "out").glob("torchrun-*.json"))
    assert recorded == [f"torchrun-{r}.json" for r in range(4)], done
    reference = {
        r: json.loads((project / "out" / f"torchrun-{r}.json").read_text())["env"] for r in range(4)
    }
    for rank, env in reference.items():
        base = envs[int(env["GROUP_RANK"])]  # what that host's agent was started with
        torchrun_vars = {k for k in env if k not in base}
        ours = harness_ranks[rank]["env"]
        assert torchrun_vars <= set(ours), sorted(torchrun_vars - set(ours))
        same = {k: env[k] for k in torchrun_vars - PER_RUN}
        assert {k: ours[k] for k in same} == same
    # The shape seen on each node: the same (RANK, LOCAL_RANK, GROUP_RANK) triples.
    triples = {
        tuple(env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK")) for env in reference.values()
    }
    assert triples == {
        tuple(doc["env"][k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK"))
        for doc in harness_ranks.values()
    }


# ---------------------------------------------------------------- pieces


def test_node_delays_read_seconds_and_never():
    assert node_delays(3, "") == (0.0, 0.0, 0.0)
    assert node_delays(3, "1=2.5, 2=never") == (0.0, 2.5, math.inf)
    for bad in ("2=1", "x=1", "1=-1", "1=soon", "1"):
        with pytest.raises(ValueError, match=DELAY_ENV):
            node_delays(2, bad)


def test_reports_of_a_multi_node_case_name_each_ranks_node():
    result = CaseOutcome(4, "cpu/gloo", 10.0, "LaunchSpec.timeout", ranks_per_node=2)
    result.outcomes[0] = RankOutcome(0, "passed", 1.0)
    result.outcomes[3] = RankOutcome(3, FAILED, 2.0, summary="ValueError: x")
    result.timed_out = [1, 2]
    text = result.report()
    assert "node 0 rank 1, node 1 rank 2 still running at the 10 s deadline" in text
    assert "node 1 rank 3 failed: ValueError: x" in text
