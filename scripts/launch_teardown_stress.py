"""Launch 2-rank Gloo cases back to back and count the ones that fail.

A rank that returned its result must exit cleanly every time (see
``harness/launcher/rank.py``: it leaves with ``os._exit`` instead of racing interpreter
finalisation against Gloo's threads). This is the check for that, too slow
for the test suite::

    python scripts/launch_teardown_stress.py --runs 60 --work allreduce
    python scripts/launch_teardown_stress.py --runs 100 --work demo

``allreduce`` ends each rank right after an all-reduce of temporaries;
``demo`` trains ``channel_loss.demo`` for 2 steps on 2 SP ranks (the case in
which the teardown crash was first seen, about 1 run in 25); ``noop`` returns
at once, so a rank leaves while its peer may still be joining the group.
Exits 1 when any run failed, printing each failure report.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def all_reduce_work() -> list[float]:
    """A few all-reduces; the last one's tensors are dropped right before returning."""
    import torch
    import torch.distributed as dist

    total = torch.zeros(4)
    for step in range(8):
        part = torch.full((4,), float(dist.get_rank() + step))
        dist.all_reduce(part)
        total += part
    dist.all_reduce(torch.ones(1024))
    return total.tolist()


def noop_work() -> int:
    """Nothing at all: the ranks return as soon as they have joined the group."""
    return 0


def demo_work() -> list[dict]:
    from channel_loss.demo import DemoConfig, train

    return train(DemoConfig(steps=2, interval=1, sp=2, quiet=True))


WORK = {"allreduce": all_reduce_work, "demo": demo_work, "noop": noop_work}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--work", choices=sorted(WORK), default="allreduce")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each run (s)")
    args = parser.parse_args(argv)

    import harness

    # Imported under its module name, so the spawned ranks can import it too.
    from scripts import launch_teardown_stress as this

    fn = getattr(this, WORK[args.work].__name__)
    spec = harness.LaunchSpec(device="cpu", nproc=2, timeout=args.timeout)
    failures: list[int] = []
    start = time.monotonic()
    for run in range(args.runs):
        try:
            harness.launch(fn, spec)
        except harness.LaunchError as error:
            failures.append(run)
            print(f"--- run {run} failed:\n{error}\n", flush=True)
    seconds = time.monotonic() - start
    print(
        f"{args.work}: {args.runs} runs of 2 Gloo ranks, {len(failures)} failed "
        f"{failures or ''} in {seconds:.1f} s ({seconds / max(1, args.runs):.2f} s/run)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
