"""Multi-node cases on real nodes: the pytest process is itself a rank that torch's
elastic launcher started (``torchrun ... -m pytest ...`` on each host). The case's body
runs here, with the process group initialised from torchrun's environment, after the
world's shape is checked against the case's ``LaunchSpec``; each rank publishes its
outcome in torchrun's rendezvous store, and rank 0's verdict (until the case deadline)
is the case's, naming the node and rank of each failure.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

from harness.launcher.rank import pg_timeout_for
from harness.spec import LaunchSpec

#: torchrun's environment, which a pytest process it started has.
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
_POLL_S = 0.1


def under_torchrun() -> bool:
    """Whether this process is a rank torch's elastic launcher started."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def shape_problem(spec: LaunchSpec) -> str | None:
    """Why the torchrun world this process is in cannot run a case of ``spec``
    (None: its nodes and ranks per node are the case's)."""
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
    """Run the case's body ``test(**kwargs)`` on this rank of a torchrun world
    of the case's shape, then agree on the verdict: a failure here is raised
    here; on rank 0, the other ranks' failures (and ranks that reported
    nothing by the deadline) are returned as a report naming each one's node
    and rank (None: every rank passed or skipped)."""
    __tracebackhide__ = True
    import torch.distributed as dist

    end = time.monotonic() + deadline_s
    rank, per_node = int(os.environ["RANK"]), spec.nproc
    if not dist.is_initialized():
        _init(spec, deadline_s)
    store = _store(case, end)
    error: BaseException | None = None
    try:
        test(**kwargs)
        outcome = {"status": "passed"}
    except BaseException as exc:
        error = exc
        only = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        status = "skipped" if type(exc).__name__ in ("Skipped", "XFailed") else "failed"
        outcome = {"status": status, "summary": only.splitlines()[0] if only else ""}
    store.set(f"rank-{rank}", json.dumps(outcome))
    if error is not None:
        raise error
    if rank != 0:
        return None
    failures = []
    for other in range(1, spec.world_size):
        got = _wait(store, f"rank-{other}", end)
        who = f"node {other // per_node} rank {other}"
        if got is None:
            failures.append(f"{who} reported no outcome by the {deadline_s:g} s deadline")
        elif got["status"] == "failed":
            failures.append(f"{who} failed: {got['summary']}")
    if not failures:
        return None
    shape = f"({spec.world_size} ranks, {spec.nnodes} nodes x {per_node}, started by torchrun)"
    return "\n".join([*failures, shape])


def _init(spec: LaunchSpec, deadline_s: float) -> None:
    """Join torchrun's process group, on the ``LOCAL_RANK``-th card of an accelerator."""
    from datetime import timedelta

    import torch.distributed as dist

    from harness.devices import device_type

    kind = device_type(spec.device)
    if kind.is_accelerator:
        kind.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(
        spec.dist_backend, timeout=timedelta(seconds=pg_timeout_for(deadline_s))
    )


def _store(case: str, end: float) -> Any:
    """A client of the rendezvous store torchrun's agents host, under a prefix of this case."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=max(1.0, end - time.monotonic()))
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    run = os.environ["TORCHELASTIC_RUN_ID"]
    return dist.PrefixStore(f"harness/{run}/{case}/", client)


def _wait(store: Any, key: str, end: float) -> dict[str, Any] | None:
    while True:
        if store.check([key]):
            return json.loads(store.get(key))
        if time.monotonic() >= end:
            return None
        time.sleep(_POLL_S)
